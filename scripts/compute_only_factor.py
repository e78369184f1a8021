#!/usr/bin/env python3
"""A bench method's compute-only step alone and with N copies at once, and their ratio (the ``cpu_share`` factor).

Runs :func:`hgsgc.bench.run_compute_only` for one method of a bench spec twice, ``copies=1`` then ``copies=N``
(the N copies lined up by the start barrier), and prints each record and ``factor = alone / shared``, the
time-dilation factor ``dilation: cpu_share`` would give (:func:`hgsgc.bench.dilation_factor`). ``--steps`` sets the
compute-only runs' steps (the spec's ``compute_only_steps``; default: the cells' own). Session 18
(docs/benchmarks.md, "LM, 8 hosts, ... with the barrier's cpu_share factor")::

    flock /work/coord/cluster.lock .venv/bin/python scripts/compute_only_factor.py \\
        configs/bench/ptb_8h_s17_1gbit.yaml horovod_fp16 8 --steps 11

Run from the repository root (the specs use relative config paths); the machine should be otherwise idle.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from hgsgc import bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="bench spec YAML")
    ap.add_argument("method", help="a method name of the spec")
    ap.add_argument("copies", type=int, help="processes at once (the cells' host count)")
    ap.add_argument("--steps", type=int, default=None, help="steps per compute-only run (>= 2)")
    a = ap.parse_args(argv)
    spec = bench.load_spec(a.spec)
    if a.steps is not None:
        spec = bench.load_spec({**spec, "compute_only_steps": a.steps})
    method = next((m for m in spec["methods"] if m["name"] == a.method), None)
    if method is None:
        ap.error(f"method {a.method!r} is not in {a.spec} (methods: {', '.join(m['name'] for m in spec['methods'])})")
    if a.copies < 2:
        ap.error("copies must be >= 2")
    os.makedirs(spec["runs_dir"], exist_ok=True)
    keys = ("status", "error", "mean_step_time_s", "step_times_s", "timed_overlap", "steps", "wall_time_s",
            "load_before", "load_after")
    recs = {}
    for c in (1, a.copies):
        r = bench.run_compute_only(method, spec, copies=c)
        recs[c] = {k: r.get(k) for k in keys}
        print(json.dumps({"copies": c, **recs[c]}), flush=True)
        if r["status"] != "ok":
            return 1
    print(json.dumps({"factor": recs[1]["mean_step_time_s"] / recs[a.copies]["mean_step_time_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
