#!/usr/bin/env python
"""Micro-benchmark: hgsgc's fused compression kernels vs today's pure-TensorFlow path, side by side.

For every tensor size (``--sizes``, entries) and density (``--densities``), one process times:

* compress (one rank, error feedback, ``--bits``): the reference ``kernels.compress_reference``
  (compensate ``g + r``, ``sparsify.sampled_threshold_topk``, ``codec.encode``, residual
  ``a - scatter_nd(idx, sent)``: what the communicator runs per tensor), the same reference
  without the compensate / residual steps (``select+encode``: the figure issue 14 quotes), and
  the fused kernel ``kernels.compress``;
* decode-accumulate of n = ``--ranks`` payloads: the reference ``kernels.decode_accumulate_reference``
  (n sequential ``codec.decode`` + ``tf.scatter_nd`` into dense tensors, then ``tf.add_n``) vs
  the kernel ``kernels.decode_accumulate``.

Each callable is a ``tf.function``, traced and warmed up once, then timed ``--repeats`` times
round-robin (reference, kernel, reference, ...), median reported; outputs are checked bit for bit
against each other before timing. ``cat /proc/loadavg`` is recorded with every row (the machine
is shared). Peak extra memory: the peak of TF's CPU allocator during one call minus what it held
before (``tf.config.experimental.get_memory_info``); it includes the op's outputs (the dense sum
for decode; compress updates the residual variable in place, the reference allocates a new one). Memory-bandwidth bound: the bytes a kernel
must move (compress: read g and r, write the new residual = 12 numel; decode: write the sum
4 numel + read the n payloads + 8 bytes per received entry) divided by the measured copy
bandwidth (``--copy-mb`` MB numpy copy, read + write bytes counted, best of 5); ``x bound`` =
measured time / that bound.

``--model`` also times the compute-only training step (forward, backward, exchange on 1 rank,
apply) of the Fashion-MNIST model with fp16 vs SGC (reference ops vs kernels).

Usage: python scripts/bench_kernels.py [--sizes 100000 1000000 6500000 25600000]
       [--densities 0.01 0.001] [--ranks 1 4 16] [--bits 2] [--repeats 5] [--json out.json]
"""
import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hgsgc import ops  # noqa: E402
from hgsgc.compression import kernels  # noqa: E402
from hgsgc.compression import codec  # noqa: E402
from hgsgc.compression.sparsify import num_selected  # noqa: E402


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def peak_extra_mb(fn, *args):
    """Peak bytes TF's CPU allocator held during fn(*args) minus those held before (MB).

    ``tf.config.experimental.get_memory_info("CPU:0")``: available when TF's CPU allocator is a
    BFC pool (TensorFlow 2.15 with oneDNN, the default on x86); None otherwise. Counts every
    tensor the call allocates, its outputs included.
    """
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except (ValueError, tf.errors.OpError):
        return None
    out = fn(*args)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    del out
    return max(0.0, (peak - before) / 2**20)


def copy_bandwidth(mb):
    """Bytes/s of a numpy copy of ``mb`` MB (read + write counted), best of 5."""
    a = np.ones(mb * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def timed(fns, args, repeats):
    """(min wall, median wall, min CPU) seconds of each fn(*args), timed round-robin.

    CPU = the process's user + system time during the call (all threads, TF's pool included):
    the work done, much less sensitive than wall time to other jobs taking the cores."""
    times = [[] for _ in fns]
    cpus = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            c0, t0 = time.process_time(), time.perf_counter()
            out = fn(*args)
            if isinstance(out, (tuple, list)):
                out = out[0]
            out.numpy()
            times[i].append(time.perf_counter() - t0)
            cpus[i].append(time.process_time() - c0)
    return [(min(t), statistics.median(t), min(c)) for t, c in zip(times, cpus)]


def ms(t):
    """{"min", "median", "cpu"} in milliseconds from timed()'s seconds."""
    return {"min": 1e3 * t[0], "median": 1e3 * t[1], "cpu": 1e3 * t[2]}


def ratio(slow, fast):
    """Speed-up of fast over slow: medians, minima and CPU times."""
    return {"min": slow[0] / fast[0], "median": slow[1] / fast[1], "cpu": slow[2] / fast[2]}


def cell(d, digits=1):
    return f"{d['median']:.{digits}f} / {d['min']:.{digits}f} / {d['cpu']:.{digits}f}"


def xcell(d):
    return f"{d['median']:.1f} / {d['min']:.1f} / {d['cpu']:.1f}"


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32:
        a, b = a.view(np.uint32), b.view(np.uint32)
    return a.shape == b.shape and np.array_equal(a, b)


def bench_compress(numel, density, bits, repeats, bw):
    k = num_selected(numel, density)
    rng = np.random.default_rng(numel)
    g = tf.constant(rng.standard_normal(numel).astype(np.float32))
    r0 = (rng.standard_normal(numel) * 0.1).astype(np.float32)
    var_ref, var_ker = tf.Variable(r0), tf.Variable(r0)
    seed = tf.constant(5, tf.int64)

    # today's per-tensor path in the communicator, residual variable updated by assign
    ref = tf.function(lambda g, s: kernels.compress_into(g, var_ref, k, bits, seed=s, backend="reference"))
    # the part issue 14 quotes: sampled_threshold_topk + codec.encode
    sel = tf.function(lambda g, s: codec.encode(*kernels.topk_select_reference(g, k, seed=s), numel, bits))
    ker = tf.function(lambda g, s: kernels.compress_into(g, var_ker, k, bits, seed=s, backend="custom"))
    # the kernel doing what `sel` does (no residual): HgsgcCompress with an empty residual
    ker_sel = tf.function(lambda g, s: kernels.compress(g, None, k, bits, seed=s, backend="custom")[0])
    assert same_bits(ker_sel(g, seed), sel(g, seed)[0]), "select+encode: kernel != reference"
    p_ref, p_ker = ref(g, seed), ker(g, seed)
    sel(g, seed)
    assert same_bits(p_ref, p_ker) and same_bits(var_ref.numpy(), var_ker.numpy()), \
        "compress: kernel != reference"
    del p_ref, p_ker
    t_ref, t_sel, t_ker, t_ksel = timed([ref, sel, ker, ker_sel], (g, seed), repeats)
    la = loadavg()
    m_ref = peak_extra_mb(ref, g, seed)
    m_ker = peak_extra_mb(ker, g, seed)
    bound = 12 * numel / bw
    return dict(numel=numel, density=density, k=k, bits=bits, ref_ms=ms(t_ref),
                ref_select_encode_ms=ms(t_sel), kernel_ms=ms(t_ker), speedup=ratio(t_ref, t_ker),
                kernel_select_encode_ms=ms(t_ksel), speedup_select_encode=ratio(t_sel, t_ksel),
                ref_mem_mb=m_ref, kernel_mem_mb=m_ker,
                bound_ms=1e3 * bound, x_bound=t_ker[0] / bound, loadavg=la)


def today_decode(gathered, numel, k, bits):
    """The communicator's allgather path before the kernels: n sequential codec.decode +
    tf.scatter_nd into n dense tensors, then tf.add_n."""
    p = codec.payload_length(numel, k, bits)
    dense = []
    for r in range(int(gathered.shape[0])):
        idx, vals = codec.decode(gathered[r, :p], numel, k, bits)
        dense.append(tf.scatter_nd(idx[:, None], vals, [numel]))
    return tf.add_n(dense) if len(dense) > 1 else dense[0]


def bench_decode(numel, density, bits, n, repeats, bw):
    k = num_selected(numel, density)
    rows = []
    for rank in range(n):
        x = tf.constant(np.random.default_rng(1000 + rank).standard_normal(numel).astype(np.float32))
        rows.append(kernels.compress(x, None, k, bits, backend="custom")[0].numpy())
    gathered = tf.constant(np.stack(rows))
    del rows
    today = tf.function(lambda G: today_decode(G, numel, k, bits))
    ref = tf.function(lambda G: kernels.decode_accumulate_reference(G, numel, k, bits))
    ker = tf.function(lambda G: kernels.decode_accumulate(G, numel, k, bits, backend="custom"))
    a, b = ref(gathered), ker(gathered)
    assert same_bits(a.numpy(), b.numpy()), "decode-accumulate: kernel != reference"
    c = today(gathered).numpy()
    assert np.allclose(c, b.numpy(), rtol=1e-5, atol=1e-6), "today's path disagrees beyond rounding"
    del a, b, c
    t_today, t_ref, t_ker = timed([today, ref, ker], (gathered,), repeats)
    la = loadavg()
    m_today = peak_extra_mb(today, gathered)
    m_ker = peak_extra_mb(ker, gathered)
    P = int(gathered.shape[1])
    bound = (4 * numel + n * P + 8 * n * k) / bw
    return dict(numel=numel, density=density, k=k, bits=bits, n=n, today_ms=ms(t_today),
                ref_ms=ms(t_ref), kernel_ms=ms(t_ker), speedup=ratio(t_today, t_ker),
                speedup_vs_ref=ratio(t_ref, t_ker), today_mem_mb=m_today, kernel_mem_mb=m_ker,
                bound_ms=1e3 * bound, x_bound=t_ker[0] / bound, loadavg=la)


def fmt_mb(v):
    return "n/a" if v is None else f"{v:.0f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 6_500_000, 25_600_000])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--bits", type=int, default=2, choices=[2, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copy-mb", type=int, default=256)
    p.add_argument("--model", action="store_true", help="also time the Fashion-MNIST step")
    p.add_argument("--model-rounds", type=int, default=4)
    p.add_argument("--model-only", action="store_true", help="only the Fashion-MNIST step")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-accumulate table")
    p.add_argument("--phases", nargs="+", metavar="CONFIG",
                   help="only the per-phase table of one exchange on these configs' model gradients")
    p.add_argument("--exchange-only", action="store_true",
                   help="with --phases: only the whole-exchange rows (SGC, top-k, fp16)")
    p.add_argument("--index-codings", nargs="+", default=["fixed"], choices=["fixed", "elias_fano"])
    p.add_argument("--json", help="write all rows here")
    args = p.parse_args(argv)

    ops.load()  # the kernels must be built
    if args.phases:
        rows = bench_phases(args.phases, args.repeats, args.index_codings, args.exchange_only)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"phases": rows, "host": platform.node(), "cores": os.cpu_count()}, f, indent=1)
        return
    bw = copy_bandwidth(args.copy_mb)
    print(f"hgsgc fused kernels vs reference path; TensorFlow {tf.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} cores, intra-op threads "
          f"{tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()}; "
          f"bits={args.bits}; times in ms as median wall / min wall / min CPU (process user+sys) "
          f"of {args.repeats} side-by-side repeats; speed-ups (x) the same three ratios; "
          f"x bound: min wall / bandwidth bound")
    print(f"copy bandwidth (numpy, {args.copy_mb} MB, read+write): {bw / 1e9:.2f} GB/s; "
          f"loadavg {loadavg()}")
    out = dict(copy_bandwidth_gbs=bw / 1e9, bits=args.bits, repeats=args.repeats, compress=[],
               decode=[], host=platform.node(), cores=os.cpu_count())

    if args.model_only:
        args.sizes = []
    print("\n## compress (one tensor, error feedback)")
    print("| entries | density | k | reference ms | kernel ms | speedup | ref select+encode ms "
          "| kernel select+encode ms | speedup | ref extra MB | kernel extra MB | bound ms "
          "| x bound | loadavg |")
    print("|" + "---|" * 14)
    for numel in args.sizes:
        for d in args.densities:
            reps = args.repeats if numel <= 1_000_000 else max(3, args.repeats // 2 + 1)
            row = bench_compress(numel, d, args.bits, reps, bw)
            out["compress"].append(row)
            print(f"| {numel:,} | {d} | {row['k']:,} | {cell(row['ref_ms'])} | "
                  f"{cell(row['kernel_ms'], 2)} | {xcell(row['speedup'])} | "
                  f"{cell(row['ref_select_encode_ms'])} | {cell(row['kernel_select_encode_ms'], 2)} | "
                  f"{xcell(row['speedup_select_encode'])} | "
                  f"{fmt_mb(row['ref_mem_mb'])} | {fmt_mb(row['kernel_mem_mb'])} | "
                  f"{row['bound_ms']:.2f} | {row['x_bound']:.1f} | {row['loadavg']} |", flush=True)

    print("\n## decode-accumulate of n payloads")
    print("| entries | density | n | today ms (n decodes + add_n) | reference ms (scatter_nd) "
          "| kernel ms | speedup vs today | vs reference | today extra MB | kernel extra MB "
          "| bound ms | x bound | loadavg |")
    print("|" + "---|" * 13)
    for numel in ([] if args.no_decode else args.sizes):  # noqa: E501
        for d in args.densities:
            for n in args.ranks:
                reps = args.repeats if numel * n <= 4_000_000 else 3
                row = bench_decode(numel, d, args.bits, n, reps, bw)
                out["decode"].append(row)
                print(f"| {numel:,} | {d} | {n} | {cell(row['today_ms'])} | {cell(row['ref_ms'])} | "
                      f"{cell(row['kernel_ms'], 2)} | {xcell(row['speedup'])} | {xcell(row['speedup_vs_ref'])} | "
                      f"{fmt_mb(row['today_mem_mb'])} | {fmt_mb(row['kernel_mem_mb'])} | "
                      f"{row['bound_ms']:.2f} | {row['x_bound']:.1f} | {row['loadavg']} |", flush=True)

    if args.model or args.model_only:
        out["model_tensors"] = bench_model_tensors(max(args.repeats, 7))
        out["model"] = bench_model(args.repeats, rounds=args.model_rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def bench_model_tensors(repeats, density=0.005, bits=2):
    """Compression work of one SGC exchange (1 rank) on the Fashion-MNIST model's gradients:
    compress (error feedback) + decode-accumulate of every trainable tensor, reference vs kernels,
    wall and CPU time (side by side, ``repeats`` rounds)."""
    from hgsgc.models import build_model

    model = build_model("alexnet_small")
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    gs = [tf.constant(np.random.default_rng(i).standard_normal(n).astype(np.float32))
          for i, n in enumerate(sizes)]

    def make(backend):
        res = [tf.Variable(tf.zeros_like(g)) for g in gs]

        @tf.function
        def step(seed):
            outs = []
            for g, r in zip(gs, res):
                k = num_selected(int(g.shape[0]), density)
                p = kernels.compress_into(g, r, k, bits, seed=seed, backend=backend)
                outs.append(kernels.decode_accumulate(tf.reshape(p, [1, -1]), int(g.shape[0]), k, bits,
                                                  backend=backend))
            return tf.stack([tf.reduce_sum(o) for o in outs])
        return step

    ref, ker = make("reference"), make("custom")
    seed = tf.constant(1, tf.int64)
    assert same_bits(ref(seed).numpy(), ker(seed).numpy()), "model tensors: kernel != reference"
    t_ref, t_ker = timed([ref, ker], (seed,), repeats)
    la = loadavg()
    print(f"\n## compression work of one SGC exchange on the Fashion-MNIST model's "
          f"{len(sizes)} tensors ({sum(sizes):,} entries, density {density}, 1 rank)")
    print("| path | ms: median wall / min wall / min CPU | loadavg |")
    print("|---|---|---|")
    print(f"| reference | {cell(ms(t_ref))} | {la} |")
    print(f"| kernels | {cell(ms(t_ker))} | {la} |")
    print(f"| speed-up | {xcell(ratio(t_ref, t_ker))} | |")
    return {"sizes": sizes, "ref_ms": ms(t_ref), "kernel_ms": ms(t_ker),
            "speedup": ratio(t_ref, t_ker), "loadavg": la}


MODEL_RUNS = [  # (label, config, overrides, HGSGC_COMPRESSION_KERNELS)
    ("fp16", "configs/fashion_mnist_dense.yaml", ["compression.method=fp16"], "auto"),
    ("sgc delay=1, reference", "configs/fashion_mnist_sgc.yaml", ["compression.delay=1"], "reference"),
    ("sgc delay=1, kernels", "configs/fashion_mnist_sgc.yaml", ["compression.delay=1"], "custom"),
]


def bench_model(repeats, steps=60, rounds=2):
    """Compute-only step (one plain process, world size 1, no communication; as ``hgsgc bench``'s
    compute_only) of the Fashion-MNIST model: fp16 vs SGC with the reference ops / the kernels.

    Every round runs each configuration once, in turn (side by side); the figure is the mean
    step time of ``hgsgc train``'s summary.json (first step, i.e. tracing, excluded there),
    median over the rounds.
    """
    import subprocess
    import tempfile

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out_dir = tempfile.mkdtemp(prefix="hgsgc_bench_kernels_")
    times = {label: [] for label, *_ in MODEL_RUNS}
    loads = []
    for rnd in range(rounds):
        for label, cfg, overrides, kernels in MODEL_RUNS:
            run_id = f"r{rnd}-{label.replace(' ', '_').replace(',', '').replace('=', '')}"
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
            env["HGSGC_COMPRESSION_KERNELS"] = kernels
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, "-m", "hgsgc.cli", "train", os.path.join(root, cfg), *overrides,
                   "train.epochs=1", f"train.max_steps_per_epoch={steps}", f"run.out_dir={out_dir}",
                   f"run.id={run_id}", "train.progress=false"]
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{label}: hgsgc train failed: {proc.stderr[-2000:]}")
            with open(os.path.join(out_dir, run_id, "summary.json")) as f:
                times[label].append(json.load(f)["mean_step_time_s"])
            loads.append(loadavg())
    res = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    print(f"\n## compute-only training step, Fashion-MNIST model ({steps} steps per run, "
          f"median of {rounds} side-by-side rounds)")
    print("| configuration | step ms | vs fp16 | loadavg (per run) |")
    print("|---|---|---|---|")
    for i, (label, *_rest) in enumerate(MODEL_RUNS):
        la = "; ".join(loads[i::len(MODEL_RUNS)])
        print(f"| {label} | {res[label]:.1f} | {res[label] / res['fp16']:.2f}x | {la} |")
    return {"step_ms": res, "all_s": times, "loadavg": loads, "steps": steps, "rounds": rounds}


# ------------------------------------------------------------------------------------------------
# --phases: where one SGC exchange's compression compute goes, per phase, vs top-k (session 10).

def model_gradients(config, seed=0):
    """(names, float32 gradient tensors shaped like the trainable variables, momentum) of the
    model of training config ``config`` (``hgsgc.tasks.make_task(cfg).build_model()``), filled
    with seeded N(0, 1e-3^2) entries; momentum = ``train.momentum``."""
    from hgsgc import config as config_mod
    from hgsgc.tasks import make_task

    cfg = config_mod.load_config(config, [])
    model = make_task(cfg).build_model()
    rng = np.random.default_rng(seed)
    grads = [tf.constant((1e-3 * rng.standard_normal(v.shape)).astype(np.float32))
             for v in model.trainable_variables]
    names = [f"t{i}" for i in range(len(grads))]
    return cfg, names, grads


def phase_functions(cfg, names, grads, index_coding, exchange_only=False):
    """{phase: tf.function() over every tensor of one exchange} for ``cfg``'s SGC setting and its
    top-k twin (method topk at the same density: 32-bit values, error feedback, no momentum
    correction), plus the whole exchange (``Exchanger.exchange``, world size 1) of SGC, top-k
    and fp16. Every function returns a float32 scalar (the outputs reduced), so nothing is
    pruned."""
    from hgsgc import config as config_mod
    from hgsgc.communicator import Exchanger
    from hgsgc.compression import DenseCompression
    from hgsgc.compression.sparsify import exact_topk

    c = cfg.compression
    sgc = config_mod.compression_from_config(c)
    sgc = dataclasses.replace(sgc, index_coding=index_coding)
    topk = dataclasses.replace(sgc, method="topk", bits=32, momentum_correction=False)
    m = float(cfg.train.momentum)
    flat = [tf.reshape(g, [-1]) for g in grads]
    numels = [int(f.shape[0]) for f in flat]
    ks = [num_selected(n, sgc.density) for n in numels]
    seed = tf.constant(3, tf.int64)
    vel = [tf.Variable(tf.reshape(tf.random.stateless_normal([n], [1, i]) * 1e-3, [-1]))
           for i, n in enumerate(numels)]
    res = {b: [tf.Variable(tf.zeros([n])) for n in numels] for b in (2, 32)}
    scal = lambda xs: tf.add_n([tf.reduce_sum(tf.cast(x, tf.float32)) for x in xs])  # noqa: E731
    # inputs of the later phases, computed once
    us = [m * v + f for v, f in zip(vel, flat)]
    sel = [kernels.topk_select(u, k, seed=seed, backend="custom") for u, k in zip(us, ks)]
    pay = {b: [kernels.compress(u, None, k, b, seed=seed, backend="custom", index_coding=index_coding)[0]
               for u, k in zip(us, ks)] for b in (2, 32)}
    fns = {}

    def fn(name, body):
        if exchange_only and not name.startswith("whole exchange"):
            return
        fns[name] = tf.function(body)

    fn("momentum u = m v + g (TF ops)", lambda: scal([m * v + f for v, f in zip(vel, flat)]))
    if hasattr(kernels, "momentum_accumulate"):
        fn("momentum u = m v + g (kernel)", lambda: scal(
            [kernels.momentum_accumulate(v, f, m) for v, f in zip(vel, flat)]))
    fn("select: sampled threshold (kernel)",
       lambda: scal([kernels.topk_select(u, k, seed=seed, backend="custom")[1] for u, k in zip(us, ks)]))
    fn("select: exact top-k (tf.math.top_k)", lambda: scal([exact_topk(u, k)[1] for u, k in zip(us, ks)]))
    for b in (2, 32):
        fn(f"encode {b}-bit (quantize + pack, kernel)", lambda b=b: scal(
            [kernels.sparse_encode(i, v, n, b, backend="custom", index_coding=index_coding)[0]
             for (i, v), n in zip(sel, numels)]))
        fn(f"select+encode {b}-bit (kernel, no residual)", lambda b=b: scal(
            [kernels.compress(u, None, k, b, seed=seed, backend="custom", index_coding=index_coding)[0]
             for u, k in zip(us, ks)]))
        fn(f"compress_into {b}-bit (compensate+select+encode+residual)", lambda b=b: scal(
            [kernels.compress_into(u, r, k, b, seed=seed, backend="custom", index_coding=index_coding)
             for u, r, k in zip(us, res[b], ks)]))
        fn(f"decode-accumulate n=1 {b}-bit + /n", lambda b=b: scal(
            [kernels.decode_accumulate(tf.reshape(p, [1, -1]), n, k, b, backend="custom",
                                       index_coding=index_coding) / 1.0
             for p, n, k in zip(pay[b], numels, ks)]))
    codec2 = sgc.codec()
    fn("own decode for masking (codec.decode: wire.decode + scatter_nd)", lambda: scal(
        [codec2.decode(p, n) for p, n in zip(pay[2], numels)]))
    fn("own decode for masking (decode_accumulate, 1 row)", lambda: scal(
        [kernels.decode_accumulate(tf.reshape(p, [1, -1]), n, k, 2, backend="custom",
                                   index_coding=index_coding) for p, n, k in zip(pay[2], numels, ks)]))
    sents = [codec2.decode(p, n) for p, n in zip(pay[2], numels)]
    fn("mask + velocity assign (TF ops)", lambda: scal(
        [v.assign(tf.where(tf.equal(s, 0.0), u, 0.0)) for v, s, u in zip(vel, sents, us)]))
    if hasattr(kernels, "momentum_mask"):
        def mask_kernel():
            for v, s, u in zip(vel, sents, us):
                kernels.momentum_mask(v, u, s)
            return scal(vel)
        fn("mask + velocity assign (kernel) + read", mask_kernel)
        fn("read velocity (to subtract from the row above)", lambda: scal(vel))
    if hasattr(kernels, "compress_momentum_into"):  # session 11
        res2 = [tf.Variable(tf.zeros([n])) for n in numels]
        vel2 = [tf.Variable(v.read_value()) for v in vel]
        fn("momentum+compress+mask 2-bit: session 10's 4 kernels (composed)", lambda: scal(
            [kernels._compress_momentum_composed(f, r, v, m, k, 2, True, 1024, 1.5, seed, "custom",
                                                 index_coding)
             for f, r, v, k in zip(flat, res2, vel2, ks)]))
        fn("momentum+compress+mask 2-bit: HgsgcCompressMomentum (fused)", lambda: scal(
            [kernels.compress_momentum_into(f, r, v, m, k, 2, True, seed=seed, backend="custom",
                                            index_coding=index_coding)
             for f, r, v, k in zip(flat, res2, vel2, ks)]))
        two = [tf.concat([tf.reshape(p, [1, -1])] * 2, 0) for p in pay[2]]
        fn("decode-accumulate n=2 2-bit, then / 2 in TF", lambda: scal(
            [kernels.decode_accumulate(g2, n, k, 2, backend="custom", index_coding=index_coding) / 2.0
             for g2, n, k in zip(two, numels, ks)]))
        fn("decode-accumulate n=2 2-bit, / 2 in the kernel", lambda: scal(
            [kernels.decode_accumulate(g2, n, k, 2, backend="custom", index_coding=index_coding,
                                       divisor=2) for g2, n, k in zip(two, numels, ks)]))
    from hgsgc.compression import wrappers

    def exchange_fn(ex, fold):
        def body():
            old_fold = wrappers.FOLD_MOMENTUM
            wrappers.FOLD_MOMENTUM = fold  # read at trace time
            try:
                return scal(ex.exchange(grads, names))
            finally:
                wrappers.FOLD_MOMENTUM = old_fold
        return body

    for label, comp in (("SGC", sgc), ("top-k", topk), ("fp16", DenseCompression("fp16"))):
        ex = Exchanger(comp, momentum=m if getattr(comp, "momentum_correction", False) else None)
        fn(f"whole exchange: {label}", exchange_fn(ex, True))
        if label == "SGC" and hasattr(kernels, "compress_momentum_into") and sgc.momentum_correction:
            ex2 = Exchanger(comp, momentum=m)
            fn("whole exchange: SGC, momentum not folded (session 10 kernels)", exchange_fn(ex2, False))
    return fns, sum(numels), len(numels)


def bench_phases(configs, repeats, index_codings=("fixed",), exchange_only=False):
    """Per-phase ms of one exchange's compression compute (world size 1) on each config's model
    gradients, every phase timed round-robin ``repeats`` times (interleaved)."""
    import horovod.tensorflow as hvd

    hvd.init()
    rows = []
    for config in configs:
        cfg, names, grads = model_gradients(config)
        for coding in index_codings:
            fns, numel, count = phase_functions(cfg, names, grads, coding, exchange_only)
            for f in fns.values():  # trace + warm up
                f()
                f()
            la0 = loadavg()
            labels = list(fns)
            ts = timed([fns[k] for k in labels], (), repeats)
            la1 = loadavg()
            print(f"\n## {config}: {count} tensors, {numel:,} entries, density "
                  f"{cfg.compression.density}, index_coding {coding}, momentum {cfg.train.momentum}; "
                  f"{repeats} interleaved rounds; loadavg {la0} -> {la1}")
            print("| phase (all tensors of one exchange) | ms: median wall / min wall / min CPU |")
            print("|---|---|")
            for lab, t in zip(labels, ts):
                print(f"| {lab} | {cell(ms(t), 2)} |")
                rows.append({"config": config, "index_coding": coding, "phase": lab, **ms(t),
                             "loadavg_before": la0, "loadavg_after": la1, "repeats": repeats})
    return rows


if __name__ == "__main__":
    main()
