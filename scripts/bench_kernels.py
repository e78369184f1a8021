#!/usr/bin/env python
"""Micro-benchmark: hgsgc's fused compression kernels vs today's pure-TensorFlow path, side by side.

For every tensor size (``--sizes``, entries) and density (``--densities``), one process times:

* compress (one rank, error feedback, ``--bits``): the reference ``ops.compress_reference``
  (compensate ``g + r``, ``sparsify.sampled_threshold_topk``, ``codec.encode``, residual
  ``a - scatter_nd(idx, sent)``: what the communicator runs per tensor), the same reference
  without the compensate / residual steps (``select+encode``: the figure issue 14 quotes), and
  the fused kernel ``ops.compress``;
* decode-accumulate of n = ``--ranks`` payloads: the reference ``ops.decode_accumulate_reference``
  (n sequential ``codec.decode`` + ``tf.scatter_nd`` into dense tensors, then ``tf.add_n``) vs
  the kernel ``ops.decode_accumulate``.

Each callable is a ``tf.function``, traced and warmed up once, then timed ``--repeats`` times
round-robin (reference, kernel, reference, ...), median reported; outputs are checked bit for bit
against each other before timing. ``cat /proc/loadavg`` is recorded with every row (the machine
is shared). Peak extra memory: the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) during one call minus the RSS before it, with glibc told to mmap every
allocation >= 64 KiB (so freed tensors leave the RSS); it includes the op's outputs (the new
residual for compress, the dense sum for decode). Memory-bandwidth bound: the bytes a kernel
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
import json
import os
import platform
import statistics
import sys
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # freed tensors must leave the RSS
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hgsgc import ops  # noqa: E402
from hgsgc.compression import codec  # noqa: E402
from hgsgc.compression.sparsify import num_selected  # noqa: E402


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def peak_extra_mb(fn, *args):
    """Peak RSS during fn(*args) minus the RSS before (MB); None where clear_refs is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_kb("VmRSS")
    out = fn(*args)
    peak = _status_kb("VmHWM")
    del out
    return max(0.0, (peak - before) / 1024.0)


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
    """Median seconds of each fn(*args), round-robin; returns [median...] and loadavg samples."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            out = fn(*args)
            if isinstance(out, (tuple, list)):
                out = out[0]
            out.numpy()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32:
        a, b = a.view(np.uint32), b.view(np.uint32)
    return a.shape == b.shape and np.array_equal(a, b)


def bench_compress(numel, density, bits, repeats, bw):
    k = num_selected(numel, density)
    rng = np.random.default_rng(numel)
    g = tf.constant(rng.standard_normal(numel).astype(np.float32))
    r = tf.constant((rng.standard_normal(numel) * 0.1).astype(np.float32))
    seed = tf.constant(5, tf.int64)

    ref = tf.function(lambda g, r, s: ops.compress_reference(g, r, k, bits, seed=s))
    sel = tf.function(lambda g, r, s: codec.encode(*ops.topk_select_reference(g, k, seed=s), numel, bits))
    ker = tf.function(lambda g, r, s: ops.compress(g, r, k, bits, seed=s, backend="custom"))
    p_ref, r_ref = ref(g, r, seed)
    p_ker, r_ker = ker(g, r, seed)
    sel(g, r, seed)
    assert same_bits(p_ref, p_ker) and same_bits(r_ref, r_ker), "compress: kernel != reference"
    del p_ref, r_ref, p_ker, r_ker
    t_ref, t_sel, t_ker = timed([ref, sel, ker], (g, r, seed), repeats)
    la = loadavg()
    m_ref = peak_extra_mb(ref, g, r, seed)
    m_ker = peak_extra_mb(ker, g, r, seed)
    bound = 12 * numel / bw
    return dict(numel=numel, density=density, k=k, bits=bits, ref_ms=1e3 * t_ref,
                ref_select_encode_ms=1e3 * t_sel, kernel_ms=1e3 * t_ker, speedup=t_ref / t_ker,
                speedup_vs_select_encode=t_sel / t_ker, ref_mem_mb=m_ref, kernel_mem_mb=m_ker,
                bound_ms=1e3 * bound, x_bound=t_ker / bound, loadavg=la)


def bench_decode(numel, density, bits, n, repeats, bw):
    k = num_selected(numel, density)
    rows = []
    for rank in range(n):
        x = tf.constant(np.random.default_rng(1000 + rank).standard_normal(numel).astype(np.float32))
        rows.append(ops.compress(x, None, k, bits, backend="custom")[0].numpy())
    gathered = tf.constant(np.stack(rows))
    del rows
    ref = tf.function(lambda G: ops.decode_accumulate_reference(G, numel, k, bits))
    ker = tf.function(lambda G: ops.decode_accumulate(G, numel, k, bits, backend="custom"))
    a, b = ref(gathered), ker(gathered)
    assert same_bits(a.numpy(), b.numpy()), "decode-accumulate: kernel != reference"
    del a, b
    t_ref, t_ker = timed([ref, ker], (gathered,), repeats)
    la = loadavg()
    m_ref = peak_extra_mb(ref, gathered)
    m_ker = peak_extra_mb(ker, gathered)
    P = int(gathered.shape[1])
    bound = (4 * numel + n * P + 8 * n * k) / bw
    return dict(numel=numel, density=density, k=k, bits=bits, n=n, ref_ms=1e3 * t_ref,
                kernel_ms=1e3 * t_ker, speedup=t_ref / t_ker, ref_mem_mb=m_ref,
                kernel_mem_mb=m_ker, bound_ms=1e3 * bound, x_bound=t_ker / bound, loadavg=la)


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
    p.add_argument("--json", help="write all rows here")
    args = p.parse_args(argv)

    ops.load()  # the kernels must be built
    bw = copy_bandwidth(args.copy_mb)
    print(f"hgsgc fused kernels vs reference path; TensorFlow {tf.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} cores, intra-op threads "
          f"{tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()}; "
          f"bits={args.bits}; median of {args.repeats} side-by-side repeats")
    print(f"copy bandwidth (numpy, {args.copy_mb} MB, read+write): {bw / 1e9:.2f} GB/s; "
          f"loadavg {loadavg()}")
    out = dict(copy_bandwidth_gbs=bw / 1e9, bits=args.bits, repeats=args.repeats, compress=[],
               decode=[], host=platform.node(), cores=os.cpu_count())

    print("\n## compress (one tensor, error feedback)")
    print("| entries | density | k | reference ms | ref select+encode ms | kernel ms | speedup "
          "| vs select+encode | ref extra MB | kernel extra MB | bound ms | x bound | loadavg |")
    print("|" + "---|" * 13)
    for numel in args.sizes:
        for d in args.densities:
            reps = args.repeats if numel <= 1_000_000 else max(3, args.repeats // 2 + 1)
            row = bench_compress(numel, d, args.bits, reps, bw)
            out["compress"].append(row)
            print(f"| {numel:,} | {d} | {row['k']:,} | {row['ref_ms']:.1f} | "
                  f"{row['ref_select_encode_ms']:.1f} | {row['kernel_ms']:.2f} | "
                  f"{row['speedup']:.1f}x | {row['speedup_vs_select_encode']:.1f}x | "
                  f"{fmt_mb(row['ref_mem_mb'])} | {fmt_mb(row['kernel_mem_mb'])} | "
                  f"{row['bound_ms']:.2f} | {row['x_bound']:.1f} | {row['loadavg']} |", flush=True)

    print("\n## decode-accumulate of n payloads")
    print("| entries | density | n | reference ms | kernel ms | speedup | ref extra MB "
          "| kernel extra MB | bound ms | x bound | loadavg |")
    print("|" + "---|" * 11)
    for numel in args.sizes:
        for d in args.densities:
            for n in args.ranks:
                reps = args.repeats if numel * n <= 4_000_000 else 3
                row = bench_decode(numel, d, args.bits, n, reps, bw)
                out["decode"].append(row)
                print(f"| {numel:,} | {d} | {n} | {row['ref_ms']:.1f} | {row['kernel_ms']:.2f} | "
                      f"{row['speedup']:.1f}x | {fmt_mb(row['ref_mem_mb'])} | "
                      f"{fmt_mb(row['kernel_mem_mb'])} | {row['bound_ms']:.2f} | "
                      f"{row['x_bound']:.1f} | {row['loadavg']} |", flush=True)

    if args.model:
        out["model"] = bench_model(args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def bench_model(repeats):
    """Compute-only step of the Fashion-MNIST model: fp16 vs SGC (reference ops / kernels)."""
    from bench_kernels_model import time_model_steps  # noqa: E402  (scripts/ helper)

    return time_model_steps(repeats)


if __name__ == "__main__":
    main()
