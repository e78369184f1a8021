#!/usr/bin/env python
"""Compute-only training step of two checkouts side by side (interleaved rounds, load recorded).

For every round, every config and every method, runs ``hgsgc train`` (world size 1: the
compute-only path of ``hgsgc bench``, no communication) once from each checkout (``--old``,
``--new``), one after the other, pinned to core 0 with one TensorFlow thread
(``HGSGC_PIN_CORES=1 train.threads=1``, as the bench's pinned compute-only cells), and reads the
mean step time (first step excluded) from the run's ``summary.json``. The 1-minute load is
recorded before and after every run. Each checkout runs with its own ``PYTHONPATH`` (and so its
own ``hgsgc/_ops*.so``: build it there first).

Methods (overrides on each config): ``fp16`` (Horovod fp16 allreduce; momentum in the
optimizer), ``topk`` (fp32 values, error feedback, momentum in the optimizer), ``sgc`` (the
config's own SGC setting with ``compression.delay=1``; DGC momentum correction where the config
has it). ``fp16`` drops the SGC config's density and selector with ``=null``, which a checkout
older than session 21 (2026-12-04) refuses, as the newer one refuses them with fp16: against such
an ``--old`` checkout pass ``--methods topk sgc``.

Usage:
    python scripts/profile_compression.py --old /tmp/old --new . \\
        --configs configs/fashion_mnist_sgc.yaml configs/cifar10_vgg16/sgc.yaml \\
        --methods fp16 topk sgc --rounds 3 --steps 25 --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

METHODS = {
    # density / selector: the sgc configs' own, refused with fp16 since session 21 (a checkout older
    # than that has no null density: compare those with topk and sgc only)
    "fp16": ["compression.method=fp16", "compression.momentum_correction=false", "compression.delay=1",
             "compression.density=null", "compression.selector=null"],
    "topk": ["compression.method=topk", "compression.momentum_correction=false", "compression.delay=1"],
    "sgc": ["compression.delay=1"],
}
COMMON = ["faults.nonfinite='off'", "checkpoint.at_end=false", "train.epochs=1", "data.test_limit=200",
          "compression.warmup_steps=0", "train.threads=1", "train.progress=false"]


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_one(checkout, config, method, steps, out_dir, timeout):
    """Mean step ms of one ``hgsgc train`` run from ``checkout``, or raises RuntimeError."""
    rid = f"prof-{method}-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env.update(PYTHONPATH=os.path.abspath(checkout), HGSGC_PIN_CORES="1", TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "hgsgc.cli", "train", os.path.join(checkout, config), *COMMON,
           *METHODS[method], f"train.max_steps_per_epoch={steps}", f"run.out_dir={out_dir}",
           f"run.id={rid}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=checkout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
    with open(os.path.join(out_dir, rid, "summary.json")) as f:
        s = json.load(f)
    return 1e3 * s["mean_step_time_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="checkout of the old code (its .so built)")
    ap.add_argument("--new", default=".", help="checkout of the new code (its .so built)")
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--methods", nargs="+", default=["fp16", "topk", "sgc"], choices=sorted(METHODS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--out-dir", default="/tmp/profile_compression_runs")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    for rnd in range(args.rounds):
        for config in args.configs:
            for method in args.methods:
                # alternate which checkout goes first, round by round
                order = [("old", args.old), ("new", args.new)]
                if rnd % 2:
                    order.reverse()
                for label, co in order:
                    la0 = loadavg()
                    t0 = time.time()
                    ms = run_one(co, config, method, args.steps, args.out_dir, args.timeout)
                    row = dict(round=rnd, config=config, method=method, code=label, step_ms=ms,
                               load_before=la0, load_after=loadavg(), wall_s=time.time() - t0,
                               utc=time.strftime("%H:%M:%S", time.gmtime()))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(rows, f, indent=1)
    print("\n| config | method | old ms (rounds) | new ms (rounds) | median old -> new | load |")
    print("|---|---|---|---|---|---|")
    for config in args.configs:
        for method in args.methods:
            r = [x for x in rows if x["config"] == config and x["method"] == method]
            o = [x["step_ms"] for x in r if x["code"] == "old"]
            n = [x["step_ms"] for x in r if x["code"] == "new"]
            la = [x["load_before"] for x in r] + [x["load_after"] for x in r]
            print(f"| {config} | {method} | {', '.join(f'{v:.1f}' for v in o)} | "
                  f"{', '.join(f'{v:.1f}' for v in n)} | {statistics.median(o):.1f} -> "
                  f"{statistics.median(n):.1f} | {min(la):.1f}-{max(la):.1f} |")


if __name__ == "__main__":
    main()
