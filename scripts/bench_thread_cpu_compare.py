#!/usr/bin/env python3
"""The same bench cells in two runs at different machine loads: wall time vs CPU per step.

    python scripts/bench_thread_cpu_compare.py docs/benchmarks/A.json docs/benchmarks/B.json [--md OUT]

For every cell (method, hosts, bandwidth) ok in both runs, and every compute-only record in both:
the 1-minute load average when it started, the mean step (wall), the CPU per timed step of the
TensorFlow side (main thread + the rest, ``thread_cpu_s_per_step``) and of Horovod's background
thread + Open MPI's / PMIx's threads (``hvd_mpi_cpu_s_per_step``), with the ratio B / A of each
(hgsgc.bench_threads; runs recorded since session 8). A figure that does not depend on the load has
a ratio near 1 whatever the wall time does.
"""
import argparse
import json
import sys


def _cells(d):
    return {(c["method"], c["hosts"], c["bandwidth"]): c for c in d["cells"]
            if c.get("status") == "ok" and c.get("thread_cpu_s_per_step")}


def tf_cpu(rec):
    t = rec["thread_cpu_s_per_step"]
    return t["main"] + t["other"]


def rows(a, b):
    """``[(label, load_a, load_b, {figure: (value_a, value_b)})]`` for the cells and compute-only
    records both runs have (seconds per step)."""
    out = []
    ca, cb = _cells(a), _cells(b)
    for key in [k for k in ca if k in cb]:
        x, y = ca[key], cb[key]
        out.append((f"{key[0]}@{key[1]}h/{key[2]}", (x.get("load_before") or [None])[0],
                    (y.get("load_before") or [None])[0],
                    {"wall": (x["mean_step_time_s"], y["mean_step_time_s"]),
                     "tf_cpu": (tf_cpu(x), tf_cpu(y)),
                     "hvd_mpi_cpu": (x["hvd_mpi_cpu_s_per_step"], y["hvd_mpi_cpu_s_per_step"])}))
    for m in [m for m in a.get("compute_only", {}) if m in b.get("compute_only", {})]:
        x, y = a["compute_only"][m], b["compute_only"][m]
        if not (x.get("thread_cpu_s_per_step") and y.get("thread_cpu_s_per_step")):
            continue
        out.append((f"{m} compute-only (1 process)", (x.get("load_before") or [None])[0],
                    (y.get("load_before") or [None])[0],
                    {"wall": (x["mean_step_time_s"], y["mean_step_time_s"]),
                     "tf_cpu": (tf_cpu(x), tf_cpu(y)),
                     "hvd_mpi_cpu": (x["hvd_mpi_cpu_s_per_step"], y["hvd_mpi_cpu_s_per_step"])}))
    return out


def markdown(a, b, name_a, name_b):
    lines = [f"| cell | load {name_a} / {name_b} | wall ms | B/A | TF CPU ms | B/A | Horovod+MPI CPU ms | B/A |",
             "|---|---|---|---|---|---|---|---|"]
    f = lambda v: f"{v:.1f}" if v is not None else "-"
    for label, la, lb, fig in rows(a, b):
        cells = []
        for k in ("wall", "tf_cpu", "hvd_mpi_cpu"):
            va, vb = fig[k]
            cells += [f"{va * 1e3:.2f} / {vb * 1e3:.2f}", f"{vb / va:.2f}" if va else "-"]
        lines.append(f"| `{label}` | {f(la)} / {f(lb)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    text = markdown(a, b, a.get("name", "A"), b.get("name", "B"))
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
