#!/usr/bin/env python3
"""Predicted vs measured step time: hgsgc/perfmodel.py against step_profile.py runs.

For every ``step_profile.py`` result JSON given, the prediction is
``perfmodel.predict_step(compute, compression, traffic(method), 2, link)`` with the inputs
measured *in the same run* (so they saw the same machine load): ``compute`` = the slowest rank's
``compute_no_hvd`` wall time, ``compression`` = its ``compression`` phase wall time (0 for the
dense methods), ``link`` = ``perfmodel.link_for(bandwidth, calibration)`` with the emulator's
calibration (``--calibration`` JSON from calibrate_link.py, else ``perfmodel.EMULATOR``). The
measured figure is the slowest rank's mean ``step`` wall time. Writes a Markdown table (stdout,
and ``--md``) and the rows as JSON (``--json``)::

    .venv/bin/python scripts/cluster/perfmodel_validation.py docs/benchmarks/step_profile/*.json \\
        --calibration docs/benchmarks/link_calibration.json --md docs/benchmarks/perfmodel_validation.md
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def calibration_from(path, bandwidth, put=True):
    """The perfmodel calibration dict for ``bandwidth`` from calibrate_link.py's JSON (the cell
    of that bandwidth; ``put``: Open MPI's default TCP flags)."""
    from hgsgc import perfmodel as pm

    if not path:
        return dict(pm.EMULATOR)
    with open(path) as f:
        cal = json.load(f)
    rate = pm.parse_rate(bandwidth)
    cell = min(cal["cells"], key=lambda c: abs(c["rate_bit_s"] - rate))
    # alpha: the median 0-byte round (the fit's intercept is poorly determined under load)
    zero = [r["median_s"] for r in cell["no_put"]["runs"] if r["size"] == 0]
    alpha = zero[0] if zero else max(0.0, cell["no_put"]["alpha_s"])
    return {"alpha_s": alpha, "efficiency": cell["efficiency"],
            "bidir_factor": min(1.0, cell["bidir_factor"]) if put else 1.0,
            "cycle_s": pm.EMULATOR["cycle_s"], "source": f"{path} ({cell['bandwidth']})"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--bandwidth", default="100mbit", help="link rate of the runs (when not recorded)")
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hgsgc
    from hgsgc import perfmodel as pm
    from hgsgc.models import build_model

    shapes_of = {}
    rows = []
    for path in args.results:
        with open(path) as f:
            r = json.load(f)
        s = r.get("summary", {})
        if "step" not in s or "compute_no_hvd" not in s:
            continue
        if r["model"] not in shapes_of:
            shapes_of[r["model"]] = [tuple(v.shape) for v in build_model(r["model"]).trainable_variables]
        shapes = shapes_of[r["model"]]
        m = r["method"]
        if m in ("sgc", "topk"):
            kw = {"density": r["density"]}
            if m == "sgc":
                kw["delay"] = r["delay"]
            comp = getattr(hgsgc.Compression, m)(**kw)
        elif m == "fp16":
            comp = hgsgc.Compression.fp16 if r["delay"] == 1 else hgsgc.Compression.localsgd(r["delay"])
        else:
            comp = hgsgc.Compression.none
        bw = r.get("bandwidth", args.bandwidth)
        cal = calibration_from(args.calibration, bw)
        cal["cycle_s"] = float(r["env"].get("HOROVOD_CYCLE_TIME", 1.0)) / 1e3  # Horovod 0.28 default: 1 ms
        link = pm.link_for(bw, calibration=cal)
        compute = s["compute_no_hvd"]["mean_ms_slowest_rank"] / 1e3
        compression = s["compression"]["mean_ms_slowest_rank"] / 1e3 if "compression" in s else 0.0
        p = pm.predict_step(compute, compression, pm.traffic(comp, shapes), r["world_size"], link,
                            cycle_s=cal["cycle_s"])
        meas = s["step"]["mean_ms_slowest_rank"] / 1e3
        # dedicated-core estimate: CPU-time inputs; measured step minus its TF threads' run-queue
        # wait (the time they were runnable but another process had the core), per rank, slowest
        cpu = lambda ph: max(a + b for a, b in zip(s[ph]["cpu_ms_tf_other"], s[ph]["cpu_ms_main"])) / 1e3
        p_cpu = pm.predict_step(cpu("compute_no_hvd"), cpu("compression") if "compression" in s else 0.0,
                                pm.traffic(comp, shapes), r["world_size"], link, cycle_s=cal["cycle_s"])
        ranks = r.get("ranks") or []
        waits = [a["phases"]["step"]["threads"]["tf_other"]["runqueue_wait_ms_per_rep"] for a in ranks]
        walls = [a["phases"]["step"]["mean_ms"] for a in ranks]
        meas_ded = max(w - q for w, q in zip(walls, waits)) / 1e3 if ranks else None
        rows.append({"run": os.path.basename(path)[:-5], "method": m, "delay": r["delay"], "bandwidth": bw,
                     "hosts": r["world_size"],
                     "settings": ", ".join(f"{k.replace('OMPI_MCA_mpi_', '').replace('HOROVOD_', '')}={v}"
                                           for k, v in sorted(r["env"].items())
                                           if k in ("OMPI_MCA_mpi_yield_when_idle", "HOROVOD_CYCLE_TIME"))
                     or "Horovod/Open MPI defaults", "load": [r["load_before"][0], r["load_after"][0]],
                     "predicted": p, "measured_step_s": meas,
                     "error": p["step_s"] / meas - 1, "calibration": cal["source"],
                     "predicted_cpu_inputs": p_cpu, "measured_minus_runqueue_s": meas_ded,
                     "error_dedicated": (p_cpu["step_s"] / meas_ded - 1) if meas_ded else None})
    lines = ["| run | method | H | link | settings | loadavg | compute ms | compression ms/step | wire ms/step "
             "| coordination ms/step | predicted ms | measured ms | error | dedicated-core estimate: predicted "
             "(CPU inputs) / measured - run-queue wait ms | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        p = x["predicted"]
        lines.append(f"| `{x['run']}` | {x['method']} | {x['delay']} | {x['bandwidth']} | {x['settings']} | "
                     f"{x['load'][0]:.0f}-{x['load'][1]:.0f} | {p['compute_s'] * 1e3:.1f} | "
                     f"{p['compression_s'] * 1e3:.1f} | {p['wire_s'] * 1e3:.1f} | {p['coordination_s'] * 1e3:.1f} | "
                     f"{p['step_s'] * 1e3:.1f} | {x['measured_step_s'] * 1e3:.1f} | {100 * x['error']:+.0f} % | "
                     + (f"{x['predicted_cpu_inputs']['step_s'] * 1e3:.1f} / {x['measured_minus_runqueue_s'] * 1e3:.1f} | "
                        f"{100 * x['error_dedicated']:+.0f} % |" if x["error_dedicated"] is not None else "- | - |"))
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
