"""Where a Hourglass training step's time goes, per phase, with the boundary codec's current and
reference implementations side by side in one run.

    mpirun -np 4 python scripts/profile_hourglass.py configs/fashion_mnist.yaml \
        hourglass.act_codec=sparse+q4 hourglass.grad_codec=sparse+q4 hourglass.micro_batches=2 \
        --steps 40 --json out.json

Builds the job as ``hgsgc train`` does (task, model, split, layout, SGC, codecs, seed), runs
``--warmup`` untimed steps, then ``3 x --steps`` timed steps cycling the codec implementation step
by step: ``compiled`` (:mod:`hgsgc.hourglass.boundary` with the C quantizers of
``ops/boundary_codec.cc``), ``numpy`` (the same module, whole-array numpy) and ``reference``
(:mod:`hgsgc.hourglass.boundary_reference`, the previous implementation). All three give the same
bytes for the same generator state, so the training is the same whichever runs. Per step and rank it records the trainer's trace marks
(``HourglassTrainer.trace``): wall time (``time.perf_counter``) and CPU time of the process
(``time.process_time``, all its threads) of each phase, plus the codec's own thread CPU time
(``HourglassTrainer.codec_times``). CPU time is the figure to trust on a loaded machine; every
result carries ``/proc/loadavg`` before and after.

Phases, CONV rank: ``forward`` (trunk forward of every micro-batch), ``encode_act`` (encode +
post the sends), ``wait_grad`` (waiting for activation gradients), ``decode_grad``, ``backward``
(trunk backward of micro-batches 0..M-2), ``backward_last+update`` (last backward, the CONV
exchange when due, the update). FC rank: ``post_recv``, ``wait_act``, ``decode_act`` (decode +
concatenate), ``head`` (head forward + backward), ``encode_grad`` (encode + post the sends),
``update`` (FC exchange + update), ``wait_send``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _loadavg():
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().strip()
    except OSError:
        return "unavailable"


def phases(trace, is_conv):
    """``{phase: [wall_s, process_cpu_s, thread_cpu_s]}`` from one step's marks (module
    docstring); thread CPU is that of the thread that made both marks (the step's numpy_function
    threads on CONV ranks, the Python thread on FC ranks), so it leaves out TensorFlow's pools;
    NaN where the two marks come from different threads."""
    marks = {label: (w, p, t, tid) for label, w, p, t, tid in trace}
    out = {}

    def add(name, a, b):
        if a in marks and b in marks:
            rec = out.setdefault(name, [0.0, 0.0, 0.0])
            for i in range(2):
                rec[i] += marks[b][i] - marks[a][i]
            same = marks[a][3] == marks[b][3]
            rec[2] += marks[b][2] - marks[a][2] if same else float("nan")

    m = sum(1 for label, *_ in trace if label.startswith("recv_enter"))  # micro-batches
    if is_conv:
        for j in range(m):
            add("forward", "step_start" if j == 0 else f"send_exit {j - 1}", f"send_enter {j}")
            add("encode_act", f"send_enter {j}", f"send_exit {j}")
            add("wait_grad", f"recv_enter {j}", f"recv_waited {j}")
            add("decode_grad", f"recv_waited {j}", f"recv_exit {j}")
            if j + 1 < m:
                add("backward", f"recv_exit {j}", f"recv_enter {j + 1}")
        add("other", f"send_exit {m - 1}", "recv_enter 0")
        add("backward_last+update", f"recv_exit {m - 1}", "step_end")
    else:
        add("post_recv", "step_start", "recv_enter 0")
        for j in range(m):
            add("wait_act", f"recv_enter {j}", f"recv_waited {j}")
            add("decode_act", f"recv_waited {j}", f"head_enter {j}")
            add("head", f"head_enter {j}", f"head_exit {j}")
            add("encode_grad", f"head_exit {j}", f"recv_enter {j + 1}" if j + 1 < m else "apply_enter")
        add("update", "apply_enter", "apply_exit")
        add("wait_send", "apply_exit", "step_end")
    add("step", "step_start", "step_end")
    return out


def build_trainer(config, overrides):
    """The Hourglass trainer of ``config`` (+ ``overrides``) for this MPI rank, as ``hgsgc train`` builds it.

    Seeds TensorFlow with ``run.seed``, splits the task's model at ``hourglass.split_layer``,
    forms the layout over ``MPI.COMM_WORLD`` and passes every ``hourglass.*`` and compression
    setting to :class:`hgsgc.hourglass.step.HourglassTrainer` (plain SGD with ``train.lr`` and
    ``train.momentum``; no schedule). Shared by this script and ``trace_hourglass_steps.py``.

    Returns:
        ``(cfg, world, rank, task, layout, trainer)``.

    Raises:
        hgsgc.config.ConfigError: a bad config or override (one line, from ``load_config``).
    """
    from mpi4py import MPI

    from hgsgc import config as config_mod
    from hgsgc.loop import setup_threads

    cfg = config_mod.load_config(config, overrides)
    setup_threads(cfg.train.threads)
    import tensorflow as tf

    from hgsgc.hourglass.layout import Layout
    from hgsgc.hourglass.split import split_model
    from hgsgc.hourglass.step import HourglassTrainer
    from hgsgc.tasks import make_task

    world = MPI.COMM_WORLD
    tf.keras.utils.set_random_seed(cfg.run.seed)
    task = make_task(cfg)
    split = split_model(task.build_model(), cfg.hourglass.split_layer)
    layout = Layout(world, int(cfg.hourglass.fc_workers))
    opt = tf.keras.optimizers.legacy.SGD(learning_rate=cfg.train.lr, momentum=cfg.train.momentum)
    trainer = HourglassTrainer(layout, split, cfg.train.batch_size, opt,
                               compression=config_mod.compression_from_config(cfg.compression),
                               fc_compression=config_mod.fc_compression_from_config(cfg),
                               wire_dtype=cfg.hourglass.wire_dtype,
                               micro_batches=cfg.hourglass.micro_batches,
                               act_codec=cfg.hourglass.act_codec, grad_codec=cfg.hourglass.grad_codec,
                               codec_seed=cfg.run.seed)
    return cfg, world, world.Get_rank(), task, layout, trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the per-rank results here (rank 0)")
    args = ap.parse_args(argv)

    cfg, world, rank, task, layout, trainer = build_trainer(args.config, args.overrides)
    C = layout.n_conv
    from hgsgc.hourglass import boundary as bd
    from hgsgc.hourglass.boundary_reference import ReferenceCodec

    impls = {"compiled": (trainer.act_codec, trainer.grad_codec),
             "numpy": (trainer.act_codec, trainer.grad_codec),
             "reference": (ReferenceCodec(trainer.act_codec), ReferenceCodec(trainer.grad_codec))}
    backend = {"compiled": "compiled", "numpy": "numpy", "reference": "numpy"}
    if layout.is_conv:
        batches, _ = task.train_data(layout.role_index, C, 0)
        batches = iter(batches)
    total = args.warmup + len(impls) * args.steps
    res = {k: {"steps": 0, "phases": {}, "codec": {}} for k in impls}
    load_before = _loadavg()
    for i in range(total):
        impl = list(impls)[i % len(impls)]
        trainer.act_codec, trainer.grad_codec = impls[impl]
        bd.set_codec_backend(backend[impl])
        trainer.trace = []
        trainer.codec_times(reset=True)
        if layout.is_conv:
            x, y = next(batches)
            trainer.train_step(np.asarray(x), np.asarray(y))
        else:
            trainer.train_step()
        if i < args.warmup:
            continue
        r = res[impl]
        r["steps"] += 1
        for k, v in phases(trainer.trace, layout.is_conv).items():
            acc = r["phases"].setdefault(k, [0.0, 0.0, 0.0])
            for n in range(3):
                acc[n] += v[n]
        for k, v in trainer.codec_times().items():
            acc = r["codec"].setdefault(k, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0})
            for f in acc:
                acc[f] += v[f]
    # (no trainer.synchronize(): nothing is evaluated or saved here)
    mine = {"rank": rank, "role": "conv" if layout.is_conv else "fc", "results": res}
    every = world.gather(mine, root=0)
    if rank != 0:
        return 0
    out = {"config": args.config, "overrides": args.overrides, "world": world.Get_size(),
           "steps_per_impl": args.steps, "warmup": args.warmup, "batch_size": cfg.train.batch_size,
           "micro_batches": cfg.hourglass.micro_batches, "loadavg_before": load_before,
           "loadavg_after": _loadavg(), "ranks": every}
    print(f"loadavg before {load_before} | after {out['loadavg_after']}")
    for role in ("conv", "fc"):
        rows = [e for e in every if e["role"] == role]
        if not rows:
            continue
        print(f"\n{role.upper()} ranks ({len(rows)}), ms per step, mean over ranks: "
              f"wall / process CPU / marking thread CPU")
        names = sorted({k for e in rows for impl in impls for k in e["results"][impl]["phases"]})
        print(f"  {'phase':22s}" + "".join(f" {k:>23s}" for k in impls))
        for k in names:
            cells = []
            for impl in impls:
                v = [np.mean([e["results"][impl]["phases"].get(k, [0, 0, 0])[n] / e["results"][impl]["steps"]
                              for e in rows]) for n in range(3)]
                cells.append(" / ".join(f"{1e3 * t:6.1f}" for t in v))
            print(f"  {k:22s}" + "".join(f" {c:>23s}" for c in cells))
        print("  codec thread CPU per call (one micro-batch of one CONV rank), ms:")
        for k in ("encode_act", "decode_grad", "decode_act", "encode_grad"):
            cells = []
            for impl in impls:
                calls = sum(e["results"][impl]["codec"].get(k, {}).get("calls", 0) for e in rows)
                cpu = sum(e["results"][impl]["codec"].get(k, {}).get("cpu_s", 0.0) for e in rows)
                wall = sum(e["results"][impl]["codec"].get(k, {}).get("wall_s", 0.0) for e in rows)
                cells.append(f"{1e3 * cpu / calls:6.2f} (wall {1e3 * wall / calls:6.2f})" if calls else "-")
            if any(c != "-" for c in cells):
                print(f"  {k:22s}" + "".join(f" {c:>23s}" for c in cells))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
