"""Raw ``HourglassTrainer`` trace marks of every rank and step, on one machine, and their
timeline (issue 11, session 7: where the Hourglass step's waiting comes from).

    mpirun -np 4 python scripts/trace_hourglass_steps.py CONFIG OUT.json [overrides]   # 3 warm-up + 30 steps
    # (the analysis reads two micro-batches: hourglass.micro_batches=2)
    python scripts/trace_hourglass_steps.py --analyse OUT.json

``time.perf_counter`` is ``CLOCK_MONOTONIC``, one clock for every process of a kernel (also the
emulated cluster's namespaces), so the marks of different ranks compare directly. The analysis
prints, per mark, the median over steps of its time after the step's earliest ``step_start``
(the FC rank's, which waits), for the CONV ranks the earliest, the latest and their spread.
No assertion: a measurement tool; the load goes with the output.
"""
import json
import os
import sys


def analyse(path):
    """Print the timeline of a trace written by this script (see the module docstring)."""
    import numpy as np

    d = json.load(open(path))
    R = {e["rank"]: e for e in d["ranks"]}
    conv = [r for r in R if R[r]["role"] == "conv"]; fc = [r for r in R if R[r]["role"] == "fc"][0]
    nst = len(R[fc]["steps"])
    marks = {m[0] for m in R[conv[0]]["steps"][0]} if nst else set()
    if "send_enter 1" not in marks:
        sys.exit(f"{path}: the timeline reads two micro-batches per step (marks 'send_enter 0' and "
                 "'send_enter 1'); trace with the override hourglass.micro_batches=2")
    rows = []
    for s in range(nst):
        t = {r: {m[0]: m[1] for m in R[r]["steps"][s]} for r in R}
        t0 = min(t[r]["step_start"] for r in R)
        rel = lambda r, k: (t[r][k] - t0) * 1e3
        row = {"conv_start": [rel(r, "step_start") for r in conv], "send0": [rel(r, "send_enter 0") for r in conv],
               "send1": [rel(r, "send_enter 1") for r in conv],
               "fc_waited0": rel(fc, "recv_waited 0"), "fc_head0": (t[fc]["head_exit 0"] - t[fc]["head_enter 0"]) * 1e3,
               "fc_waited1": rel(fc, "recv_waited 1"), "fc_head1": (t[fc]["head_exit 1"] - t[fc]["head_enter 1"]) * 1e3,
               "fc_headexit1": rel(fc, "head_exit 1"),
               "conv_recvw0": [rel(r, "recv_waited 0") for r in conv], "conv_recvw1": [rel(r, "recv_waited 1") for r in conv],
               "conv_end": [rel(r, "step_end") for r in conv], "fc_end": rel(fc, "step_end"),
               "fc_start": rel(fc, "step_start")}
        rows.append(row)
    def med(k, agg=None):
        v = [ (agg(r[k]) if agg else r[k]) for r in rows]
        return round(float(np.median(v)), 2)
    print("load", d["load"].strip(), "steps", nst)
    print("median over steps (ms from the earliest step_start):")
    for k in ("conv_start", "send0", "send1", "conv_recvw0", "conv_recvw1", "conv_end"):
        print(f"  {k:12s} min {med(k, min):7.2f}  max {med(k, max):7.2f}  spread {med(k, lambda v: max(v)-min(v)):6.2f}")
    for k in ("fc_start", "fc_waited0", "fc_head0", "fc_waited1", "fc_head1", "fc_headexit1", "fc_end"):
        print(f"  {k:12s} {med(k):7.2f}")
    step = [max(r["conv_end"]) for r in rows]
    print("step (last conv end) median", round(float(np.median(step)), 2))


def main():
    """Trace the steps under mpirun (see the module docstring)."""
    import numpy as np  # noqa: F811
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from profile_hourglass import build_trainer

    cfg, world, rank, task, layout, tr = build_trainer(sys.argv[1], sys.argv[3:])
    if layout.is_conv:
        batches = iter(task.train_data(layout.role_index, layout.n_conv, 0)[0])
    steps = []
    for i in range(33):
        tr.trace = []
        if layout.is_conv:
            x, y = next(batches)
            tr.train_step(np.asarray(x), np.asarray(y))
        else:
            tr.train_step()
        if i >= 3:
            steps.append([(m[0], m[1], m[2]) for m in tr.trace])
    every = world.gather({"rank": rank, "role": "conv" if layout.is_conv else "fc", "steps": steps}, root=0)
    if rank == 0:
        json.dump({"load": open("/proc/loadavg").read(), "ranks": every}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    if sys.argv[1] == "--analyse":
        analyse(sys.argv[2])
    else:
        main()
