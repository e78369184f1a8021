#!/usr/bin/env python3
"""Which measured input moves ``layout: auto``'s predictions between launches of the same job
(issue 11: in session 15 two launches of one AlexNet-style cell predicted the Hourglass step at
120 and 81 ms, and the spread, not the layouts, decided the choice).

Reads the ``layout_choice`` of several ``layout: auto`` runs' ``summary.json`` (or of a bench
JSON's auto cells, through ``--runs``), re-predicts every run from its recorded inputs with
:func:`hgsgc.perfmodel.choose_layout` (checked against the recorded predictions), and prints:

* per input field: median, min, max and max/min over the runs (the fields that vary);
* one-group-at-a-time sensitivity: for every ordered pair of runs (A, B) and every group of
  fields one measurement yields (:data:`GROUPS`; e.g. ``fc_call_s`` and ``fc_row_s`` are one fit
  of the same timings, so swapping one without the other would credit each with a spread the
  pair does not have), A's inputs with that group taken from B, re-predicted; the group's
  effect is the change of each prediction (ms) against A's own, summarised as the median
  |change| over the pairs and its share of the median |B - A| of the prediction (a group can
  exceed 100 %: groups interact through the pipeline schedule's max and the CPU share's max).

The compression costs (``measured.compression_cost``) are fields too: ``cost.conv.base_s`` etc.,
entering through :func:`hgsgc.perfmodel.with_role_compression` as in ``layout: auto``.

Usage::

    python scripts/auto_prediction_spread.py runs/bench/RUN1/summary.json runs/bench/RUN2/summary.json ...
    python scripts/auto_prediction_spread.py --bench docs/benchmarks/NAME.json --runs runs/bench [--out F.json]
"""
import argparse
import copy
import dataclasses
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hgsgc import perfmodel  # noqa: E402

#: LayoutInputs fields that are settings or counts, not measurements.
FIXED_FIELDS = {"world_size", "batch_size", "dp_payload", "conv_payload", "fc_payload", "dp_algorithm",
                "conv_algorithm", "fc_algorithm", "delay", "fc_delay", "micro_batches", "cycle_s",
                "machine_of", "dp_buckets", "conv_buckets", "fc_buckets", "bidir_factor",
                # per-F values recomputed from the costs by with_role_compression
                "conv_compression_s", "fc_compression_s", "dp_compression_s"}


#: Fields one measurement yields together (:func:`hgsgc.hourglass.auto.choose`); a varying field
#: outside these is a group of its own.
GROUPS = {
    "per-example compute (t_conv, t_fc)": ("t_conv", "t_fc"),
    "trunk stages (conv_fwd_mb_s, conv_bwd_mb_s)": ("conv_fwd_mb_s", "conv_bwd_mb_s"),
    "FC stage fit (fc_call_s, fc_row_s)": ("fc_call_s", "fc_row_s"),
    "boundary (codec_s, boundary_msg_s)": ("codec_s", "boundary_msg_s"),
    "link (alpha, beta)": ("alpha", "beta"),
    "updates (t_update_conv, t_update_fc)": ("t_update_conv", "t_update_fc"),
    "compression cost.dp": ("cost.dp.base_s", "cost.dp.per_payload_s"),
    "compression cost.conv": ("cost.conv.base_s", "cost.conv.per_payload_s"),
    "compression cost.fc": ("cost.fc.base_s", "cost.fc.per_payload_s", "cost.fc.alone_s"),
}


def groups_of(fields):
    """``{group name: [fields]}`` for the varying ``fields``: :data:`GROUPS` (their varying
    members), then each other field alone."""
    out, seen = {}, set()
    for name, members in GROUPS.items():
        m = [f for f in members if f in fields]
        if m:
            out[name] = m
            seen.update(m)
    for f in fields:
        if f not in seen:
            out[f] = [f]
    return out


def load_choices(paths):
    """``[(label, layout_choice dict)]`` from summary.json paths; raises ValueError naming a file
    without ``layout_choice.inputs`` (not a ``layout: auto`` run, or a resumed one)."""
    out = []
    for p in paths:
        with open(p) as f:
            s = json.load(f)
        ch = s.get("layout_choice") or {}
        if "inputs" not in ch:
            raise ValueError(f"{p}: no layout_choice.inputs (not a measured layout: auto run); "
                             f"pass the summary.json of auto runs that measured at start-up")
        out.append((os.path.basename(os.path.dirname(p)) or p, ch))
    return out


def bench_auto_summaries(bench_json: str, runs_dir: str):
    """The summary.json paths of a bench JSON's cells whose overrides include ``layout=auto``."""
    with open(bench_json) as f:
        d = json.load(f)
    paths = []
    for c in d["cells"]:
        if "layout=auto" in (c.get("overrides") or []) and c.get("run_id"):
            p = os.path.join(runs_dir, c["run_id"], "summary.json")
            if os.path.exists(p):
                paths.append(p)
    return paths


def flat_inputs(choice: dict) -> dict:
    """The measured inputs of one choice, flat: LayoutInputs fields (lists as tuples) plus
    ``cost.<role>.<key>`` of the compression costs."""
    x = dict(choice["inputs"])
    for k in ("machine_of", "machine_cores", "dp_buckets", "conv_buckets", "fc_buckets"):
        x[k] = tuple(x.get(k) or ())
    cost = ((choice.get("measured") or {}).get("compression_cost")) or {}
    for role in ("dp", "conv", "fc"):
        for k, v in (cost.get(role) or {}).items():
            if isinstance(v, (int, float)):
                x[f"cost.{role}.{k}"] = float(v)
    return x


def predict(x: dict) -> dict:
    """``{"data_parallel": ms, "hourglass F=1": ms, ...}`` from flat inputs, as ``layout: auto``
    predicts (the compression per F from the costs)."""
    fields = {f.name for f in dataclasses.fields(perfmodel.LayoutInputs)}
    inp = perfmodel.LayoutInputs(**{k: v for k, v in x.items() if k in fields})
    costs = {role: {k.split(".", 2)[2]: v for k, v in x.items() if k.startswith(f"cost.{role}.")}
             for role in ("dp", "conv", "fc")}
    if costs["dp"]:
        inp = dataclasses.replace(inp, dp_compression_s=perfmodel.compression_at(
            costs["dp"], inp.world_size, inp.dp_algorithm))
    at = ((lambda F: perfmodel.with_role_compression(inp, F, costs["conv"], costs["fc"]))
          if costs["conv"] and costs["fc"] else None)
    rep = perfmodel.choose_layout(inp, inputs_at=at)
    return {perfmodel.prediction_name(p): 1e3 * p["step_s"] for p in rep["predictions"]}


def varying_fields(xs, rel: float = 0.02):
    """Numeric fields whose max/min over the runs exceeds ``1 + rel`` (or that differ when 0)."""
    out = []
    for k in sorted(xs[0]):
        if k in FIXED_FIELDS:
            continue
        vals = [x.get(k) for x in xs]
        if k == "machine_cores":
            if len(set(vals)) > 1:
                out.append(k)
            continue
        if not all(isinstance(v, (int, float)) for v in vals):
            continue
        lo, hi = min(vals), max(vals)
        if (lo <= 0 and hi > 0) or (lo > 0 and hi / lo > 1 + rel):
            out.append(k)
    return out


def analyse(choices) -> dict:
    """The spread table and the one-at-a-time sensitivity (see the module docstring)."""
    xs = [flat_inputs(c) for _, c in choices]
    preds = [predict(x) for x in xs]
    recorded = [{perfmodel.prediction_name(p): 1e3 * p["step_s"] for p in c["predictions"]} for _, c in choices]
    for (label, _), p, r in zip(choices, preds, recorded):
        for k in r:
            if abs(p[k] - r[k]) > 1e-6 * max(1.0, abs(r[k])):
                raise ValueError(f"{label}: re-predicted {k} {p[k]:.3f} ms != recorded {r[k]:.3f} ms "
                                 f"(this hgsgc predicts differently from the one that ran)")
    fields = varying_fields(xs)
    spread = {}
    for k in fields:
        vals = [x[k] for x in xs]
        if k == "machine_cores":
            spread[k] = {"values": [list(v) for v in vals]}
            continue
        lo, hi = min(vals), max(vals)
        spread[k] = {"values": vals, "median": float(np.median(vals)), "min": lo, "max": hi,
                     "max_over_min": (hi / lo) if lo > 0 else None}
    names = list(preds[0])
    pairs = [(a, b) for a, b in itertools.permutations(range(len(xs)), 2)]
    total = {n: float(np.median([abs(preds[b][n] - preds[a][n]) for a, b in pairs])) if pairs else 0.0
             for n in names}
    effect = {}
    for k, members in groups_of(fields).items():
        ch = {n: [] for n in names}
        for a, b in pairs:
            y = copy.copy(xs[a])
            for f in members:
                y[f] = xs[b][f]
            p = predict(y)
            for n in names:
                ch[n].append(p[n] - preds[a][n])
        effect[k] = {n: {"median_abs_ms": float(np.median(np.abs(ch[n]))),
                         "share_of_spread": (float(np.median(np.abs(ch[n]))) / total[n]) if total[n] > 0 else None}
                     for n in names}
    return {"runs": [label for label, _ in choices], "predicted_ms": preds,
            "chosen": [c.get("layout") + (f" F={c['fc_workers']}" if c.get("fc_workers") else "") for _, c in choices],
            "median_abs_pair_difference_ms": total, "spread": spread, "effect": effect}


def print_report(r: dict):
    names = list(r["predicted_ms"][0])
    print("run | " + " | ".join(names) + " | chosen")
    for label, p, ch in zip(r["runs"], r["predicted_ms"], r["chosen"]):
        print(f"{label} | " + " | ".join(f"{p[n]:.1f}" for n in names) + f" | {ch}")
    print("median |B - A| over run pairs, ms: " + ", ".join(f"{n} {v:.1f}" for n, v in
                                                             r["median_abs_pair_difference_ms"].items()))
    print("\nfield | median | min | max | max/min")
    for k, s in r["spread"].items():
        if "median" in s:
            mo = "-" if s["max_over_min"] is None else f"{s['max_over_min']:.2f}"
            print(f"{k} | {s['median']:.4g} | {s['min']:.4g} | {s['max']:.4g} | {mo}")
        else:
            print(f"{k} | {s['values']} | | |")
    print("\ngroup swapped | " + " | ".join(f"{n}: median |change| ms (share)" for n in names))
    order = sorted(r["effect"], key=lambda k: -max(e["median_abs_ms"] for e in r["effect"][k].values()))
    for k in order:
        head = k
        cells = []
        for n in names:
            e = r["effect"][k][n]
            sh = "" if e["share_of_spread"] is None else f" ({100 * e['share_of_spread']:.0f} %)"
            cells.append(f"{e['median_abs_ms']:.1f}{sh}")
        print(head + " | " + " | ".join(cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="*", help="summary.json of layout: auto runs")
    ap.add_argument("--bench", help="a bench JSON: its cells with layout=auto (with --runs)")
    ap.add_argument("--runs", default="runs/bench", help="the bench's runs directory (default runs/bench)")
    ap.add_argument("--out", help="write the analysis as JSON here")
    a = ap.parse_args(argv)
    paths = list(a.summaries) + (bench_auto_summaries(a.bench, a.runs) if a.bench else [])
    if len(paths) < 2:
        ap.error(f"need at least 2 layout: auto runs, got {len(paths)} (pass summary.json files or --bench)")
    r = analyse(load_choices(paths))
    print_report(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
