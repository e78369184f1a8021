#!/usr/bin/env python3
"""Where one training step goes: a per-phase profile of a (compressed) step on the emulated cluster.

Run under ``cluster.sh mpirun`` (one rank per emulated host). Each rank pins itself to one core
(``--pin``: core ``rank % ncpu``, before TensorFlow starts any thread, so every thread it and
Horovod create inherits the mask, as ``taskset -c`` would) and uses one TensorFlow thread. The
phases, each timed over ``--steps`` repetitions after ``--warmup`` untimed ones, every repetition
after a barrier-free start (a phase starts after an ``MPI_Barrier``):

* ``compute_no_hvd``: forward + backward + plain SGD apply, before ``hvd.init()`` (no Horovod
  background thread exists yet): the compute of one step on a quiet core.
* ``compute_hvd_idle``: the same function after ``hvd.init()``: Horovod's background thread now
  runs one negotiation cycle every ``HOROVOD_CYCLE_TIME`` ms (a collective over the process set,
  even when no tensor is pending), on the same core. The difference is what the idle background
  thread costs a step that exchanges nothing.
* ``compression``: what the sparse exchange computes besides communication (top-k selection,
  2-bit quantisation and index packing of every tensor, then decoding and scattering ``n``
  payloads), with no collective.
* ``allgather_hvd``: one ``hvd.allgather`` of the step's payload (uint8, ``P`` bytes per rank):
  Horovod's queueing, negotiation and cycle wait, its size exchange and the ``MPI_Allgatherv``.
* ``allgather_mpi``: one ``MPI_Allgather`` of ``P`` bytes through mpi4py from the main thread
  (sizes known: no size exchange, no negotiation): latency + wire time of the payload.
* ``step``: the full ``hgsgc.DistributedOptimizer`` step as training runs it; with ``delay > 1``
  the local and the synchronising steps are reported apart.

For every phase it also reads ``/proc/self/task/*/schedstat`` (ns on CPU, ns waiting for a CPU)
of the main thread, of the threads ``hvd.init()`` started (Horovod's background thread and MPI's
progress threads) and of the rest (TensorFlow's pools), per repetition. Rank 0 prints one JSON
object (each figure the slowest rank's mean, plus every rank's), with ``/proc/loadavg`` before and
after. Example::

    sudo scripts/cluster/cluster.sh run 2 --bandwidth 100mbit -- \\
        .venv/bin/python scripts/cluster/step_profile.py --method sgc --delay 4 --pin
"""
import argparse
import json
import os
import sys
import time


def _tids():
    return set(int(t) for t in os.listdir("/proc/self/task"))


def _schedstat(tids):
    run = wait = 0
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                a, b, _ = f.read().split()
            run += int(a)
            wait += int(b)
        except (OSError, ValueError):
            pass
    return run, wait


def _core_busy_ms():
    """Busy time (ms) of the cores this process may run on, from /proc/stat (all processes)."""
    cores = os.sched_getaffinity(0)
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                parts = line.split()
                if int(parts[0][3:]) in cores:
                    v = [int(x) for x in parts[1:]]
                    busy += sum(v) - v[3] - v[4]  # all but idle and iowait
    return 1e3 * busy / tick


def _load():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


class Threads:
    """Groups of this process's threads whose CPU time is accounted separately."""

    def __init__(self):
        self.main = {int(os.getpid())}  # the main thread's tid is the pid
        self.hvd = set()

    def groups(self):
        allt = _tids()
        return {"main": self.main & allt, "hvd_mpi": self.hvd & allt,
                "tf_other": allt - self.main - self.hvd}

    def snap(self):
        out = {k: _schedstat(v) for k, v in self.groups().items()}
        out["core_busy_ms"] = _core_busy_ms()
        return out

    @staticmethod
    def diff(a, b, reps):
        out = {"core_busy_ms_per_rep": (b["core_busy_ms"] - a["core_busy_ms"]) / max(reps, 1)}
        for k in b:
            if k == "core_busy_ms":
                continue
            r0, w0 = a.get(k, (0, 0))
            r1, w1 = b[k]
            out[k] = {"cpu_ms_per_rep": (r1 - r0) / 1e6 / max(reps, 1),
                      "runqueue_wait_ms_per_rep": (w1 - w0) / 1e6 / max(reps, 1)}
        return out


def timed(fn, reps, warmup, threads, barrier=None, per_rep=False):
    """Run ``fn`` ``warmup`` + ``reps`` times; wall times and thread CPU of the timed ones.

    With ``per_rep`` the thread accounting is also kept per repetition (``per_rep``: a list of
    ``Threads.diff`` dicts), so steps of different kinds (local / sync) can be split."""
    for _ in range(warmup):
        fn()
    if barrier:
        barrier()
    s0 = threads.snap()
    times, reps_acc = [], []
    prev = s0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if per_rep:
            cur = threads.snap()
            reps_acc.append(Threads.diff(prev, cur, 1))
            prev = cur
    s1 = threads.snap()
    out = {"times_ms": [1e3 * t for t in times], "mean_ms": 1e3 * sum(times) / len(times),
           "threads": Threads.diff(s0, s1, reps)}
    if per_rep:
        out["per_rep"] = reps_acc
    return out


def _mean_threads(items):
    """Average of a list of ``Threads.diff`` dicts."""
    out = {"core_busy_ms_per_rep": sum(i["core_busy_ms_per_rep"] for i in items) / len(items)}
    for g in ("main", "hvd_mpi", "tf_other"):
        out[g] = {k: sum(i[g][k] for i in items) / len(items)
                  for k in ("cpu_ms_per_rep", "runqueue_wait_ms_per_rep")}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="sgc", choices=["sgc", "topk", "fp16", "none"])
    ap.add_argument("--delay", type=int, default=1)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--bits", type=int, default=None, help="2 or 32 (default: the method's)")
    ap.add_argument("--model", default="alexnet_small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r %% ncpu")
    ap.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads")
    ap.add_argument("--inter-op", type=int, default=1,
                    help="TensorFlow inter-op threads (1: one executor thread, as hgsgc train with "
                         "train.threads=1; 2 lets a ready exchange branch run beside the backward chain)")
    ap.add_argument("--phases", default="compute_no_hvd,compute_hvd_idle,compression,allgather_hvd,"
                    "allgather_mpi,step")
    ap.add_argument("--label", default="")
    ap.add_argument("--bandwidth", default="100mbit", help="the cluster's link rate (recorded only)")
    ap.add_argument("--defaults", action="store_true",
                    help="apply hgsgc.runtime.apply_defaults() before hvd.init()")
    ap.add_argument("--buckets", default="1",
                    help="comma-separated allgather bucket counts (sgc/topk, compression buckets=B): "
                         "one step phase each, 'step' for the first value, 'step_b<B>' for the others")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the step phases of --buckets this many times, interleaved (round r>0: "
                         "phase name + '_r<r>'), so slow drifts of the machine hit every setting alike")
    ap.add_argument("--out", help="also write the JSON here (rank 0)")
    args = ap.parse_args(argv)
    phases = args.phases.split(",")
    rank_env = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if args.pin:
        ncpu = os.cpu_count() or 1
        os.sched_setaffinity(0, {rank_env % ncpu})
    load0 = _load()
    applied = {}
    if args.defaults:
        from hgsgc.runtime import apply_defaults

        applied = apply_defaults()
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    from hgsgc.models import build_model

    threads = Threads()
    model = build_model(args.model, seed=0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank_env)
    x = tf.constant(rng.random((args.batch, 28, 28, 1), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch).astype(np.int32))
    plain = tf.keras.optimizers.legacy.SGD(0.01, momentum=0.9)

    @tf.function
    def compute_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        plain.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    res = {"phases": {}}
    if "compute_no_hvd" in phases:
        res["phases"]["compute_no_hvd"] = timed(lambda: compute_step().numpy(), args.steps,
                                                args.warmup, threads)
    before = _tids()
    import horovod.tensorflow as hvd

    hvd.init()
    time.sleep(0.2)
    threads.hvd = _tids() - before
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n, rank = hvd.size(), hvd.rank()
    barrier = comm.Barrier
    import hgsgc
    from hgsgc.compression import codec
    from hgsgc.compression.sparsify import exact_topk, num_selected

    if args.method in ("sgc", "topk"):
        kw = {"density": args.density}
        if args.bits:
            kw["bits"] = args.bits
        if args.method == "sgc":
            kw["delay"] = args.delay
        comp = getattr(hgsgc.Compression, args.method)(**kw)
    elif args.method == "fp16":
        comp = hgsgc.Compression.fp16 if args.delay == 1 else hgsgc.Compression.localsgd(args.delay)
    else:
        comp = hgsgc.Compression.none
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    sparse = args.method in ("sgc", "topk")
    P = codec.exchange_payload_bytes(comp, shapes) if sparse else 2 * sum(int(np.prod(s)) for s in shapes)
    res.update({"world_size": n, "method": args.method, "delay": args.delay, "density": args.density,
                "compression": comp.to_dict() if hasattr(comp, "to_dict") else str(comp),
                "index_coding": getattr(comp, "index_coding", None),  # sparse: the library default
                "payload_bytes": P, "model": args.model, "batch": args.batch, "pin": args.pin,
                "tf_threads": args.threads, "inter_op_threads": args.inter_op, "label": args.label, "bandwidth": args.bandwidth,
                "env": {k: v for k, v in os.environ.items()
                        if k.startswith(("HOROVOD_", "OMPI_MCA_", "HGSGC_"))},
                "hvd_threads": len(threads.hvd), "runtime_defaults_applied": applied})
    if "compute_hvd_idle" in phases:
        barrier()
        res["phases"]["compute_hvd_idle"] = timed(lambda: compute_step().numpy(), args.steps,
                                                  args.warmup, threads, barrier)

    if "compression" in phases and sparse:
        grads = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        bits = comp.bits

        @tf.function
        def compress_only():
            outs = []
            for g in grads:
                numel = int(np.prod(g.shape))
                flat = tf.reshape(g, [-1])
                k = num_selected(numel, comp.density)
                idx, vals = exact_topk(flat, k)
                payload, _ = codec.encode(idx, vals, numel, bits)
                dense = []
                for _ in range(n):  # decode + scatter every rank's payload (here: our own)
                    i2, v2 = codec.decode(payload, numel, k, bits)
                    dense.append(tf.scatter_nd(i2[:, None], v2, [numel]))
                outs.append(tf.reduce_sum(tf.add_n(dense)))
            return tf.add_n(outs)

        res["phases"]["compression"] = timed(lambda: compress_only().numpy(), args.steps,
                                             args.warmup, threads)
    buf = tf.constant(rng.integers(0, 256, P).astype(np.uint8))
    if "allgather_hvd" in phases:
        @tf.function
        def ag():
            return tf.reduce_sum(tf.cast(hvd.allgather(tf.identity(buf), name="prof_allgather"), tf.int32))

        res["phases"]["allgather_hvd"] = timed(lambda: ag().numpy(), args.steps, args.warmup,
                                               threads, barrier)
    if "allgather_mpi" in phases:
        sb = buf.numpy()
        rb = np.empty(n * P, np.uint8)
        res["phases"]["allgather_mpi"] = timed(lambda: comm.Allgather(sb, rb), args.steps,
                                               args.warmup, threads, barrier)
    bucket_list = [int(b) for b in args.buckets.split(",")]
    if "step" in phases:
        import dataclasses

        hvd.broadcast_variables(model.variables, root_rank=0)
        steps = {}
        for b in bucket_list:
            c = dataclasses.replace(comp, buckets=b) if b != 1 else comp
            opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.01, momentum=0.9),
                                             compression=c)

            def make(opt):
                @tf.function
                def train_step():
                    with tf.GradientTape() as tape:
                        loss = loss_fn(y, model(x, training=True))
                    grads = tape.gradient(loss, model.trainable_variables)
                    opt.apply_gradients(zip(grads, model.trainable_variables))
                    return loss
                return train_step

            steps[b] = make(opt)

        # warm-up: a multiple of the delay so the timed steps start right after a sync
        wu = max(args.warmup, args.delay)
        wu += (-wu) % args.delay
        reps = args.steps + (-args.steps) % args.delay
        for rnd in range(args.rounds):
            for j, b in enumerate(bucket_list):
                name = ("step" if j == 0 else f"step_b{b}") + (f"_r{rnd}" if rnd else "")
                fn = steps[b]
                r = timed(lambda: fn().numpy(), reps, wu, threads, barrier, per_rep=True)
                res["phases"][name] = r
                if args.delay > 1:
                    t, pr = r["times_ms"], r.pop("per_rep")
                    for kind, keep in (("sync", lambda i: (i + 1) % args.delay == 0),
                                       ("local", lambda i: (i + 1) % args.delay != 0)):
                        idx = [i for i in range(len(t)) if keep(i)]
                        res["phases"][name.replace("step", "step_" + kind, 1)] = {
                            "times_ms": [t[i] for i in idx], "mean_ms": sum(t[i] for i in idx) / len(idx),
                            "threads": _mean_threads([pr[i] for i in idx])}
                else:
                    r.pop("per_rep")
    load1 = _load()
    allres = comm.gather({"rank": rank, "phases": res["phases"], "load": [load0, load1]}, root=0)
    if rank == 0:
        res["load_before"], res["load_after"] = load0, load1
        res["ranks"] = allres
        summ = {}
        for ph in res["phases"]:
            per = [a["phases"][ph] for a in allres]
            s = {"mean_ms_slowest_rank": max(p["mean_ms"] for p in per),
                 "mean_ms_per_rank": [round(p["mean_ms"], 2) for p in per]}
            for g in ("main", "hvd_mpi", "tf_other"):
                s[f"cpu_ms_{g}"] = [round(p["threads"][g]["cpu_ms_per_rep"], 2) for p in per]
                s[f"wait_ms_{g}"] = [round(p["threads"][g]["runqueue_wait_ms_per_rep"], 2) for p in per]
            s["core_busy_ms"] = [round(p["threads"]["core_busy_ms_per_rep"], 2) for p in per]
            summ[ph] = s
        res["summary"] = summ
        # every rank's per-repetition wall times stay in the JSON ("ranks"[r]["phases"][ph]["times_ms"]):
        # the performance model's wait for the slowest rank is computed from their distributions
        res.pop("phases")
        text = json.dumps(res)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
