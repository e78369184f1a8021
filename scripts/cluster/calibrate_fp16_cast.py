#!/usr/bin/env python3
"""Calibrate the fp16 cast of the dense fp16 allreduce per tensor size (hgsgc/perfmodel.py).

The fp16 exchange (``hgsgc.compression.reducers.DenseAllreduce.reduce_raw`` on ``n >= 2`` ranks)
casts every float32 gradient ``x`` to ``float16(x / n)`` before Horovod's allreduce and the sum
back to float32 after; a compute-only run (a world of one) skips both, so the bench's compute input
lacks them. This script times those casts (:func:`hgsgc.perfmodel.measure_fp16_cast_s`: one
``tf.function`` per call, no collective) for ``m`` tensors of ``d`` elements over a grid of
``(m, d)``, as the clean cells run (the process pinned to one core, one TensorFlow intra-op and
inter-op thread), and fits ``seconds = c + m a + m d b`` (:func:`hgsgc.perfmodel.fit_fp16_cast`);
the model charges ``sum over tensors (a + b d)`` (:func:`hgsgc.perfmodel.fp16_cast_s`). With
``--bench`` it also times the casts of each fp16 method's model (its own tensor shapes) and puts
the formula beside the measurement. The 1-minute load is recorded before and after every point.

Run it on a quiet machine (the committed file: docs/benchmarks.md, "Session 11: the model")::

    .venv/bin/python scripts/cluster/calibrate_fp16_cast.py --core 1 \\
        --bench docs/benchmarks/clean_2h_s9_quiet.json docs/benchmarks/vgg16_2h_s10.json docs/benchmarks/ptb_2h_s10.json \\
        --out docs/benchmarks/perfmodel_validation_s11_fp16_cast.json
"""
import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _fp16_models(paths):
    """``{label: shapes}`` of the models of the fp16 methods of ``hgsgc bench`` result JSONs (the
    spec's config + overrides, as scripts/cluster/perfmodel_validation.py builds them)."""
    from hgsgc.config import compression_from_config, load_config
    from hgsgc.plan import build_plan_model

    out = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        spec = d["spec"]
        for m in spec["methods"]:
            cfg = load_config(m["config"], [*spec["overrides"], *m["overrides"], *m.get("cell_overrides", [])])
            if getattr(compression_from_config(cfg.compression), "kind", None) != "fp16":
                continue
            label = f"{cfg.model.name} (width {cfg.model.width}, {cfg.data.format})"
            if label not in out:
                model, _ = build_plan_model(cfg)
                out[label] = {"from": os.path.basename(path),
                              "shapes": [[int(x) for x in v.shape] for v in model.trainable_variables]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e3, 1e4, 1e5, 1e6, 4e6],
                    help="elements d per tensor")
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 8], help="tensors m per call (>= 2 values)")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per point (median; 2 warm-up calls)")
    ap.add_argument("--core", type=int, default=0, help="pin to this core (-1: no pinning)")
    ap.add_argument("--ranks", type=int, default=2, help="n of the division x / n (any n >= 2 casts alike)")
    ap.add_argument("--bench", nargs="*", default=[], help="hgsgc bench JSONs: also time their fp16 models' casts")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})  # before TensorFlow starts any thread
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hgsgc import perfmodel as pm

    rec = {"what": "fp16 casts of one dense fp16 exchange (perfmodel.measure_fp16_cast_s), per call of m tensors "
                   "of d elements; wall = time.perf_counter, cpu = time.process_time (medians)",
           "start_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "core": args.core,
           "threads": {"intra_op": 1, "inter_op": 1}, "ranks_n": args.ranks, "reps": args.reps,
           "tensorflow": tf.__version__, "points": []}
    for d in [int(x) for x in args.sizes]:
        for m in args.counts:
            lb = _load()
            shapes = [(d,)] * m
            wall = pm.measure_fp16_cast_s(shapes, reps=args.reps, n=args.ranks)
            cpu = pm.measure_fp16_cast_s(shapes, reps=args.reps, n=args.ranks, clock=time.process_time)
            p = {"m": m, "d": d, "wall_s": wall, "cpu_s": cpu, "load_before": lb, "load_after": _load()}
            rec["points"].append(p)
            print(f"m {m:2d} d {d:8d}: wall {wall * 1e3:8.3f} ms, cpu {cpu * 1e3:8.3f} ms, load {lb:.2f}-"
                  f"{p['load_after']:.2f}", flush=True)
    rec["fit"] = pm.fit_fp16_cast([(p["m"], p["d"], p["wall_s"]) for p in rec["points"]])
    rec["fit_cpu"] = pm.fit_fp16_cast([(p["m"], p["d"], p["cpu_s"]) for p in rec["points"]])
    f = rec["fit"]
    print(f"fit (wall): call {f['call_s'] * 1e6:.1f} us + per tensor {f['per_tensor_s'] * 1e6:.2f} us + "
          f"{f['per_element_s'] * 1e9:.3f} ns per element (max |residual| {100 * f['residual_rel']:.1f} %)")
    rec["models"] = {}
    for label, info in _fp16_models(args.bench).items():
        lb = _load()
        meas = pm.measure_fp16_cast_s(info["shapes"], reps=args.reps, n=args.ranks)
        formula = pm.fp16_cast_s(info["shapes"], f)
        rec["models"][label] = {**info, "tensors": len(info["shapes"]),
                                "elements": sum(math.prod(s) for s in info["shapes"]),
                                "measured_wall_s": meas, "formula_s": formula,
                                "formula_plus_call_s": formula + f["call_s"], "load_before": lb, "load_after": _load()}
        r = rec["models"][label]
        print(f"{label}: {r['tensors']} tensors, {r['elements']} elements: measured {meas * 1e3:.3f} ms, "
              f"formula {formula * 1e3:.3f} ms (+ call {f['call_s'] * 1e3:.3f} ms)", flush=True)
    rec["end_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(args.out, "w") as fh:
        json.dump(rec, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
