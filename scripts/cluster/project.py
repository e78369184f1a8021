#!/usr/bin/env python3
"""Project the data-parallel step time of each method to 8 .. 1,024 nodes at 1, 10, 100 Gbit/s.

Inputs measured here, in CPU time (``time.process_time``, one TensorFlow thread: the time on a
dedicated core, independent of other load on the machine): the compute step of the config's
model and batch, and each method's compression cost (``perfmodel.measure_compression_s``). The
links are ``perfmodel.link_for(rate, bidir_factor=1)`` (a tuned cluster without Open MPI's TCP
``put`` penalty; alpha as in ``perfmodel.EMULATOR``), one rank per node, Horovod cycle ``perfmodel.EMULATOR["cycle_s"]`` (1 ms, what hgsgc sets).
Writes ``OUT.json``, ``OUT.md`` and ``OUT.png`` (predicted step time vs nodes, one panel per
bandwidth). Time to target would multiply by the steps to target of full-length quality
curves, which are not measured yet: this projects step times only::

    .venv/bin/python scripts/cluster/project.py configs/fashion_mnist_sgc.yaml \
        compression.index_coding=fixed --out docs/benchmarks/projection

The committed ``docs/benchmarks/projection.*`` were computed with fixed-width payload indices (the
default before 2026-12-02), hence the override above (the sparse candidates of
``plan.plan_candidates`` take the config's coding); without it the sparse rows get today's default
Elias-Fano bytes and decode cost. The coding is recorded in ``OUT.json`` (``index_coding``) and
named in ``OUT.md``'s first line.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--bandwidths", nargs="+", default=["1gbit", "10gbit", "100gbit"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hgsgc.runtime import apply_defaults

    apply_defaults()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hgsgc import perfmodel as pm
    from hgsgc.config import load_config
    from hgsgc.models import build_model
    from hgsgc.plan import plan_candidates

    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    cfg = load_config(args.config, args.overrides)
    model = build_model(cfg.model.name, seed=cfg.run.seed)
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    clock = time.process_time
    compute = pm.measure_compute_s(model, cfg.train.batch_size, reps=max(args.reps, 5), clock=clock)
    methods = []
    for label, comp in plan_candidates(cfg):
        if label == "config":
            continue
        cost = pm.measure_compression_s(comp, shapes, reps=args.reps, clock=clock)
        methods.append((label, comp, cost))
        print(f"{label}: compression {cost['base_s'] * 1e3:.2f} ms + {cost['per_payload_s'] * 1e3:.3f} ms/payload (CPU)",
              flush=True)
    rows = []
    for bw in args.bandwidths:
        link = pm.link_for(bw, bidir_factor=1.0)
        for n in args.nodes:
            for label, comp, cost in methods:
                tr = pm.traffic(comp, shapes)
                alg = pm.algorithm_of(comp)
                p = pm.predict_step(compute, pm.compression_at(cost, n, alg), tr, n, link)
                rows.append({"bandwidth": bw, "nodes": n, "method": label, "algorithm": alg, **p})
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    res = {"config": args.config, "overrides": args.overrides, "model": cfg.model.name,
           "index_coding": cfg.compression.index_coding,
           "batch_size": cfg.train.batch_size, "compute_cpu_s": compute,
           "compression_cpu": {m: c for m, _, c in methods}, "loadavg_before": load0, "loadavg_after": load1,
           "link": {"alpha_s": pm.EMULATOR["alpha_s"], "efficiency": pm.EMULATOR["efficiency"],
                    "bidir_factor": 1.0, "cycle_s": pm.EMULATOR["cycle_s"]},
           "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    labels = [m for m, _, _ in methods]
    lines = [f"Predicted step time (ms) of `{cfg.model.name}`, batch {cfg.train.batch_size} per node; compute "
             f"{compute * 1e3:.1f} ms (CPU time, one thread); sparse payload indices "
             f"{cfg.compression.index_coding}; loadavg {' '.join(load0)} / {' '.join(load1)}.", ""]
    for bw in args.bandwidths:
        lines += [f"**{bw}**", "", "| nodes | " + " | ".join(labels) + " | fastest |",
                  "|---|" + "---|" * (len(labels) + 1)]
        for n in args.nodes:
            rs = {r["method"]: r for r in rows if r["bandwidth"] == bw and r["nodes"] == n}
            best = min(rs.values(), key=lambda r: r["step_s"])["method"]
            lines.append(f"| {n} | " + " | ".join(f"{rs[m]['step_s'] * 1e3:.0f}" for m in labels) + f" | {best} |")
        lines.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.bandwidths), figsize=(5 * len(args.bandwidths), 4), sharey=True)
    for ax, bw in zip(axes if len(args.bandwidths) > 1 else [axes], args.bandwidths):
        for m in labels:
            xs = [r["nodes"] for r in rows if r["bandwidth"] == bw and r["method"] == m]
            ys = [r["step_s"] * 1e3 for r in rows if r["bandwidth"] == bw and r["method"] == m]
            ax.plot(xs, ys, marker="o", ms=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{bw}")
        ax.set_xlabel("nodes")
        ax.grid(True, which="both", alpha=0.3)
    (axes[0] if len(args.bandwidths) > 1 else axes).set_ylabel("predicted step (ms)")
    (axes[-1] if len(args.bandwidths) > 1 else axes).legend(fontsize=7)
    fig.suptitle(f"hgsgc perfmodel projection: {cfg.model.name}, batch {cfg.train.batch_size}/node (CPU compute)")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=100)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
