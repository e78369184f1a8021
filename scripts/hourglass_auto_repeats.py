"""``layout: auto`` against the better layout, per repeat and as medians, from one bench results JSON
whose methods are ``sgc_dp_rK``, ``hourglass_rK`` and ``auto_rK`` (K = 1, 2, ...), e.g.
configs/bench/cifar_alexnet_4h_hourglass_auto_s11.yaml (docs/hourglass.md "Session 11").

Usage::

    python scripts/hourglass_auto_repeats.py docs/benchmarks/NAME.json [--runs runs/bench] [--out OUT.json]

Per repeat ``K``: ``better_K = min(epoch(sgc_dp_rK), epoch(hourglass_rK))`` (time per epoch, the
bench's mean step x the layout's full-epoch steps), ``auto_rK / better_K``, and ``auto_rK`` against
the explicit job of the layout it ran in that repeat. Medians: ``median_K auto / min(median_K
sgc_dp, median_K hourglass)``. The identical-job spread: ``max / min`` over the repeats of each
job. With ``--runs``, each auto cell's ``layout_choice`` is read from its run folder's
``summary.json`` (the bench keeps the choice out of its JSON): the choice, the predictions and the
start-up's own seconds (``startup``). Prints a Markdown table, then (session 12) the auto cells'
interface bytes per step with and without the start-up probes' bytes; ``--out`` writes the
figures as JSON.
"""
import argparse
import json
import os
import re
import statistics


def repeats(results: dict) -> dict:
    """``{K: {"sgc_dp": cell, "hourglass": cell, "auto": cell}}`` of the ok cells.

    Raises:
        ValueError: no method named ``<job>_r<K>``, or a repeat without all three jobs.
    """
    out = {}
    for c in results["cells"]:
        m = re.fullmatch(r"(sgc_dp|hourglass|auto)_r(\d+)", c["method"])
        if m and c.get("status") == "ok":
            out.setdefault(int(m.group(2)), {})[m.group(1)] = c
    if not out:
        raise ValueError("no ok cells named sgc_dp_rK / hourglass_rK / auto_rK in the results")
    bad = [k for k, v in out.items() if set(v) != {"sgc_dp", "hourglass", "auto"}]
    if bad:
        raise ValueError(f"repeats {bad} lack an ok sgc_dp / hourglass / auto cell")
    return dict(sorted(out.items()))


def compare(results: dict, choices: dict = None) -> dict:
    """The figures of the module docstring (epochs in s, ratios as floats)."""
    reps = repeats(results)
    rows = []
    for k, r in reps.items():
        e = {j: r[j]["time_per_epoch_s"] for j in r}
        same = "hourglass" if r["auto"]["layout"] == "hourglass" else "sgc_dp"
        better = min(("sgc_dp", "hourglass"), key=lambda j: e[j])
        row = {"repeat": k, "epoch_s": e, "step_ms": {j: r[j]["mean_step_time_s"] * 1e3 for j in r},
               "load_before": {j: (r[j].get("load_before") or [None])[0] for j in r},
               "auto_ran": r["auto"]["layout"], "better": better,
               "auto_vs_better": e["auto"] / e[better], "auto_vs_same_layout": e["auto"] / e[same],
               "launch_minus_wall_s": {j: r[j]["launch_time_s"] - r[j]["wall_time_s"] for j in r}}
        # Session 13: the epoch INCLUDING the job's start-up (launch - wall: MPI launch, imports,
        # data and model, and for auto its measurement), charged to one epoch.
        es = {j: e[j] + row["launch_minus_wall_s"][j] for j in r}
        better_s = min(("sgc_dp", "hourglass"), key=lambda j: es[j])
        row.update({"epoch_with_startup_s": es, "better_with_startup": better_s,
                    "auto_vs_better_with_startup": es["auto"] / es[better_s]})
        row["iface_tx_kB_per_step"] = {j: (r[j].get("iface_tx_bytes_per_step_per_rank") or 0.0) / 1e3 for j in r}
        wp = r["auto"].get("iface_tx_bytes_per_step_per_rank_without_probes")
        row["auto_iface_tx_kB_per_step_without_probes"] = None if wp is None else wp / 1e3
        row["auto_probe_bytes_per_rank"] = r["auto"].get("auto_probe_bytes_per_rank")
        if choices and r["auto"]["run_id"] in choices:
            ch = choices[r["auto"]["run_id"]]
            row["choice"] = {"layout": ch["layout"], "fc_workers": ch.get("fc_workers"),
                             "predicted_step_ms": {f"{p['layout']}{'' if p.get('fc_workers') is None else ' F=' + str(p['fc_workers'])}":
                                                   p["step_s"] * 1e3 for p in ch.get("predictions", [])},
                             "startup": ch.get("startup")}
        rows.append(row)
    med = {j: statistics.median(row["epoch_s"][j] for row in rows) for j in ("sgc_dp", "hourglass", "auto")}
    better = min(("sgc_dp", "hourglass"), key=lambda j: med[j])
    spread = {j: max(row["epoch_s"][j] for row in rows) / min(row["epoch_s"][j] for row in rows)
              for j in ("sgc_dp", "hourglass", "auto")}
    loads = [v for row in rows for v in row["load_before"].values() if v is not None]
    return {"name": results.get("name"), "started_utc": results.get("started_utc"), "repeats": rows,
            "median_epoch_s": med, "better_by_median": better, "auto_vs_better_median": med["auto"] / med[better],
            "within_5pct_per_repeat": sum(1 for row in rows if row["auto_vs_better"] <= 1.05),
            "within_5pct_per_repeat_with_startup": sum(1 for row in rows if row["auto_vs_better_with_startup"] <= 1.05),
            "identical_job_spread": spread, "load_range": [min(loads), max(loads)] if loads else None}


def read_choices(results: dict, runs: str) -> dict:
    """``{run_id: layout_choice}`` of the auto cells whose run folder is still there."""
    out = {}
    for c in results["cells"]:
        p = os.path.join(runs, c.get("run_id") or "", "summary.json")
        if c["method"].startswith("auto") and os.path.exists(p):
            with open(p) as f:
                out[c["run_id"]] = json.load(f).get("layout_choice")
    return out


def table(fig: dict) -> str:
    """Markdown: one row per repeat, then the medians."""
    lines = ["| repeat | DP SGC epoch s (load) | Hourglass epoch s (load) | auto epoch s (load) -> ran | "
             "auto / better | auto / same layout | auto start-up s (launch - wall: auto / explicit same layout) "
             "| with start-up, epoch s: DP / Hourglass / auto | auto / better, with start-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in fig["repeats"]:
        e, ld, lw = r["epoch_s"], r["load_before"], r["launch_minus_wall_s"]
        same = "hourglass" if r["auto_ran"] == "hourglass" else "sgc_dp"
        st = (r.get("choice") or {}).get("startup") or {}
        lines.append(f"| {r['repeat']} | {e['sgc_dp']:.1f} ({ld['sgc_dp']}) | {e['hourglass']:.1f} ({ld['hourglass']}) "
                     f"| {e['auto']:.1f} ({ld['auto']}) -> {r['auto_ran']} | {r['auto_vs_better']:.3f} "
                     f"| {r['auto_vs_same_layout']:.3f} | {st.get('total_s') or float('nan'):.1f} "
                     f"({lw['auto']:.1f} / {lw[same]:.1f}) | {r['epoch_with_startup_s']['sgc_dp']:.1f} / "
                     f"{r['epoch_with_startup_s']['hourglass']:.1f} / {r['epoch_with_startup_s']['auto']:.1f} "
                     f"| {r['auto_vs_better_with_startup']:.3f} |")
    m, s = fig["median_epoch_s"], fig["identical_job_spread"]
    lines.append(f"| median | {m['sgc_dp']:.1f} | {m['hourglass']:.1f} | {m['auto']:.1f} | "
                 f"{fig['auto_vs_better_median']:.3f} | | | | |")
    lines.append(f"| spread (max/min) | {s['sgc_dp']:.3f} | {s['hourglass']:.3f} | {s['auto']:.3f} | | | | | |")
    return "\n".join(lines)


def probe_table(fig: dict) -> str:
    """Markdown: the auto cells' interface bytes per step per rank, as measured and without the
    start-up probes' bytes (``layout_choice.startup.probe_bytes``, session 12), beside the explicit
    job of the layout auto ran; and the start-up's phases (s)."""
    lines = ["| repeat | auto iface kB/step/rank | without the probes | explicit same layout | probes MB per rank "
             "| start-up s: total; alone; together; wait CPU; link; boundary |",
             "|---|---|---|---|---|---|"]
    for r in fig["repeats"]:
        same = "hourglass" if r["auto_ran"] == "hourglass" else "sgc_dp"
        wp, pb = r.get("auto_iface_tx_kB_per_step_without_probes"), r.get("auto_probe_bytes_per_rank")
        st = (r.get("choice") or {}).get("startup") or {}
        ph = st.get("phases_s") or {}
        phases = "; ".join(f"{ph[k]:.2f}" if k in ph else "-" for k in
                           ("alone_in_turns", "together", "wait_cpu", "link", "boundary"))
        lines.append(f"| {r['repeat']} | {r['iface_tx_kB_per_step']['auto']:.1f} | "
                     f"{'-' if wp is None else f'{wp:.1f}'} | {r['iface_tx_kB_per_step'][same]:.1f} | "
                     f"{'-' if not pb else ' / '.join(f'{b / 1e6:.2f}' for b in pb)} | "
                     f"{st.get('total_s') or float('nan'):.1f}; {phases} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a bench results JSON (docs/benchmarks/NAME.json)")
    ap.add_argument("--runs", default=None, help="the bench's run folder (runs/bench) for layout_choice")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    with open(a.results) as f:
        results = json.load(f)
    fig = compare(results, read_choices(results, a.runs) if a.runs else None)
    print(table(fig))
    print()
    print(probe_table(fig))
    print(f"auto within 5 % of the better layout in {fig['within_5pct_per_repeat']} of {len(fig['repeats'])} "
          f"repeats ({fig['within_5pct_per_repeat_with_startup']} with start-up); medians: auto / better ({fig['better_by_median']}) = {fig['auto_vs_better_median']:.3f}; "
          f"load {fig['load_range']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(fig, f, indent=2)


if __name__ == "__main__":
    main()
