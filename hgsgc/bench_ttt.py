"""Time to target: a quality-vs-steps curve combined with a measured step time (issue 10, item 1).

The two measurements come from different runs, because the curve does not depend on the network:

* the **curve** of a method: a loopback run (``mpirun -np H`` on one machine, the same seed and
  data order for every method) that evaluates the quality metric (e.g. ``valid_perplexity``) after
  every epoch. Epoch ``e`` ends after ``s_e`` optimizer steps (cumulative) with value ``v_e``;
* the **step time** of the same method on an emulated cluster cell (``hgsgc bench``): the mean
  wall-clock step time ``t_step`` (the first step, graph tracing, left out; a delay-``D`` method's
  mean runs over whole periods, local and synchronising steps together) and the time of one
  evaluation ``t_eval`` on that cell (the run's wall time minus its epochs' step loops, divided by
  its number of evaluations).

Combination (per method and cell)::

    t(e)   = s_e * t_step + e * t_eval              # wall clock at the end of epoch e
    target = v_ref_final * (1 + rel)                # lower is better (perplexity), or
             v_ref_final - abs                      # higher is better (accuracy)
    e*     = the first epoch whose v_e meets the target (v_e <= target, or >= target)
    time to target = t(e*)  (``None``, "not reached", when no epoch of the budget meets it)

``v_ref_final`` is the last epoch's value of the reference (dense) run's own curve. Ratios are
``time of the other / time of this`` (> 1: this one is sooner). The arithmetic is
:func:`hgsgc.perfmodel.time_to_target` (``steps * step_s + evals * eval_s``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from hgsgc.perfmodel import time_to_target as _ttt


def cell_label(row: dict) -> str:
    """A table row's method name, with the stored cell's name when the cell was read under
    another name (``hgsgc bench`` ``cells_from`` with a method's ``cells``): ``"m (cell `c`)"``."""
    name = row.get("cell_name", row["method"])
    return row["method"] + (f" (cell `{name}`)" if name != row["method"] else "")


def target_value(ref_final: float, mode: str = "min", rel: Optional[float] = None,
                 abs_: Optional[float] = None) -> float:
    """The target from the reference run's final value.

    ``mode='min'`` (perplexity, loss): ``ref_final * (1 + rel)``; ``mode='max'`` (accuracy, a
    fraction): ``ref_final - abs_``.

    Raises:
        ValueError: unknown mode, or the mode's parameter missing / negative.
    """
    if mode == "min":
        if rel is None or rel < 0:
            raise ValueError(f"target_value: mode 'min' needs rel >= 0 (a fraction, 0.03 = 3 %), got {rel!r}")
        return float(ref_final) * (1.0 + float(rel))
    if mode == "max":
        if abs_ is None or abs_ < 0:
            raise ValueError(f"target_value: mode 'max' needs abs_ >= 0 (0.005 = half a point), got {abs_!r}")
        return float(ref_final) - float(abs_)
    raise ValueError(f"target_value: mode must be 'min' or 'max', got {mode!r}")


def curve_from_epochs(epochs: List[dict], metric: str) -> List[dict]:
    """``[{epoch, steps, value}]`` (``steps`` cumulative) from a run's per-epoch records
    (metrics.jsonl lines with ``epoch``, ``steps`` = steps of that epoch, and ``metric``; step
    lines, ``"kind": "step"``, are skipped).

    Raises:
        KeyError: a record lacks ``metric`` or ``steps`` (the message names the epoch and key).
    """
    out, total = [], 0
    for rec in sorted((r for r in epochs if r.get("kind") != "step"), key=lambda r: int(r["epoch"])):
        for key in ("steps", metric):
            if rec.get(key) is None:
                raise KeyError(f"epoch {rec.get('epoch')}: no '{key}' in the run's metrics.jsonl")
        total += int(rec["steps"])
        out.append({"epoch": int(rec["epoch"]), "steps": total, "value": float(rec[metric])})
    return out


def first_reaching(curve: List[dict], target: float, mode: str = "min") -> Optional[dict]:
    """The first point of ``curve`` whose value meets ``target`` (``<=`` for 'min', ``>=`` for
    'max'); ``None`` when none does."""
    for p in curve:
        if (p["value"] <= target) if mode == "min" else (p["value"] >= target):
            return p
    return None


def wallclock_curve(curve: List[dict], step_s: float, eval_s: float) -> List[dict]:
    """``[{epoch, steps, value, time_s}]``: each epoch's end on a cell's clock,
    ``time_s = steps * step_s + epoch * eval_s`` (seconds)."""
    return [dict(p, time_s=_ttt(p["steps"], step_s, p["epoch"], eval_s)) for p in curve]


def _val(x) -> str:
    """A metric value for the tables: 4 decimals below 10 (accuracy 0.7572), else 2 (perplexity 403.28)."""
    if x is None:
        return "-"
    return f"{x:.4f}" if abs(x) < 10 else f"{x:.2f}"


def _median(xs: List[float]) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def combine(curves: Dict[str, List[dict]], cells: List[dict], reference: str, mode: str = "min",
            rel: Optional[float] = None, abs_: Optional[float] = None,
            roles: Optional[Dict[str, str]] = None, eval_time: str = "group_median",
            budget_epochs: Optional[int] = None) -> dict:
    """Time to target of every method in every cell.

    Args:
        curves: method -> curve (:func:`curve_from_epochs`), from the loopback runs.
        cells: emulated cells, each a dict with ``method``, ``hosts``, ``bandwidth``,
            ``bandwidth_mbit``, ``status`` ('ok' or not), ``mean_step_time_s`` and
            ``eval_time_s`` (seconds of ONE evaluation on that cell; see the module docstring).
            A time-dilated cell's ``step_time_dilated_s`` / ``eval_time_dilated_s`` (the measured
            times x the dilation factor: the emulated machine's clock) are used instead.
        reference: the method whose curve's last value defines the target.
        roles: method -> role ('dense', 'baseline', 'ours', 'other'): ``best_baseline`` of a cell
            group is the soonest of the dense and baseline methods that reach the target.
        eval_time: ``'cell'``: each cell's own evaluation time; ``'group_median'``: the median of
            the ok cells' evaluation times in the same (hosts, bandwidth) group, for every method
            of the group (an evaluation does the same work whatever the method: a forward pass over
            the same data and a 2-number allreduce, so the cells' differences are CPU-load noise).
            Each row keeps its own measurement as ``eval_measured_s``.
        budget_epochs: the epochs of the budget; a curve shorter than that which does not reach the
            target is "not reached in its first N epochs (incomplete)", not "not reached".
    Returns:
        ``{"target", "reference_final", "rows": [...], "groups": [...]}``; a row per cell with
        ``epoch``, ``steps`` (to target, or None), ``time_to_target_s`` (None: not reached or no
        measurement), ``wallclock`` (the whole curve on that cell's clock) and ``note``; a group per
        (hosts, bandwidth) with ``reference_time_s``, ``best_baseline``, ``best_baseline_time_s``.
        Each row also gets ``vs_reference`` and ``vs_best_baseline``: the other's time / this
        row's time (``None`` where either is missing).
    Raises:
        KeyError: no curve for ``reference``.
    """
    roles = roles or {}
    if reference not in curves or not curves[reference]:
        raise KeyError(f"time to target: no curve for the reference method {reference!r}")
    if eval_time not in ("cell", "group_median"):
        raise ValueError(f"time to target: eval_time must be 'cell' or 'group_median', got {eval_time!r}")
    ref_final = curves[reference][-1]["value"]
    target = target_value(ref_final, mode, rel, abs_)
    group_eval = {}
    def ev(c):  # one evaluation on the cell's clock (the emulated machine's in a dilated cell)
        return c.get("eval_time_dilated_s", c.get("eval_time_s"))

    for c in cells:
        if c.get("status") == "ok" and ev(c) is not None:
            group_eval.setdefault((c["hosts"], c["bandwidth"]), []).append(ev(c))
    rows = []
    for c in cells:
        ok = c.get("status") == "ok" and ev(c) is not None
        eval_s = (ev(c) if eval_time == "cell"
                  else _median(group_eval.get((c["hosts"], c["bandwidth"]), []))) if ok else None
        row = {"method": c["method"], "cell_name": c.get("cell_name", c["method"]),
               "role": roles.get(c["method"], c.get("role", "other")),
               "hosts": c["hosts"], "bandwidth": c["bandwidth"], "bandwidth_mbit": c["bandwidth_mbit"],
               "step_s": c.get("step_time_dilated_s", c.get("mean_step_time_s")), "eval_s": eval_s,
               "eval_measured_s": ev(c),
               "load": c.get("load_before"), "epoch": None, "steps": None, "time_to_target_s": None,
               "final_value": None, "wallclock": [], "note": ""}
        curve = curves.get(c["method"])
        if not curve:
            row["note"] = "no curve"
        elif c.get("status") != "ok" or row["step_s"] is None or row["eval_s"] is None:
            row["note"] = "no step time (the cell failed)"
            row["final_value"] = curve[-1]["value"]
        else:
            row["final_value"] = curve[-1]["value"]
            row["wallclock"] = wallclock_curve(curve, row["step_s"], row["eval_s"])
            hit = first_reaching(curve, target, mode)
            if hit is None and budget_epochs and len(curve) < budget_epochs:
                row["note"] = (f"incomplete curve: not reached in its first {len(curve)} of {budget_epochs} "
                               f"epochs")
            elif hit is None:
                row["note"] = f"not reached in {curve[-1]['epoch']} epochs ({curve[-1]['steps']} steps)"
            else:
                row["epoch"], row["steps"] = hit["epoch"], hit["steps"]
                row["time_to_target_s"] = _ttt(hit["steps"], row["step_s"], hit["epoch"], row["eval_s"])
        rows.append(row)
    groups = []
    for key in dict.fromkeys((r["hosts"], r["bandwidth"]) for r in rows):
        g = [r for r in rows if (r["hosts"], r["bandwidth"]) == key]
        ref = next((r for r in g if r["method"] == reference), None)
        ref_t = ref["time_to_target_s"] if ref else None
        base = [r for r in g if r["role"] in ("dense", "baseline") and r["time_to_target_s"] is not None]
        best = min(base, key=lambda r: r["time_to_target_s"]) if base else None
        best_t = best["time_to_target_s"] if best else None
        for r in g:
            t = r["time_to_target_s"]
            r["vs_reference"] = ref_t / t if (t and ref_t is not None) else None
            r["vs_best_baseline"] = best_t / t if (t and best_t is not None) else None
        groups.append({"hosts": key[0], "bandwidth": key[1], "reference_time_s": ref_t,
                       "best_baseline": best["method"] if best else None, "best_baseline_time_s": best_t})
    return {"target": target, "reference": reference, "reference_final": ref_final, "mode": mode,
            "rel": rel, "abs": abs_, "eval_time": eval_time, "rows": rows, "groups": groups}


def _fmt(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def markdown(results: dict) -> List[str]:
    """The "Time to target" section of a bench report (Markdown lines); empty without one."""
    tt = results.get("time_to_target")
    spec = results["spec"]
    if not tt:
        return []
    t = spec["time_to_target"]
    if "error" in tt:
        return ["## Time to target", "", f"Not computed: {tt['error']}", ""]
    curves = results.get("curves", {})
    sign = f"x (1 + {t['rel']})" if tt["mode"] == "min" else f"- {t['abs']}"
    out = ["## Time to target", "",
           f"Target: `{t['metric']}` {'<=' if tt['mode'] == 'min' else '>='} **{_val(tt['target'])}** = "
           f"`{tt['reference']}`'s final value {_val(tt['reference_final'])} {sign}.",
           "",
           "How the two measurements are combined (hgsgc/bench_ttt.py): the curve of each method "
           f"comes from a loopback run (`mpirun -np {t['curve_hosts']}` on this machine, the same seed and "
           f"data order for all; overrides {', '.join(t['curve_overrides']) or 'none'}"
           + (f"; the first {t['budget_epochs']} epochs count" if t.get("budget_epochs") else "")
           + "); epoch e ends after "
           "s_e steps with value v_e. On each emulated cell the method's mean step time t_step (first step, "
           "graph tracing, left out) and one evaluation's time t_eval (training wall time minus the epochs' "
           "step loops, per evaluation) are measured" + (
               "; every method of a cell group is charged the median of the group's measured evaluation "
               "times (an evaluation is the same work whatever the method, so their differences are "
               "CPU-load noise)" if tt.get("eval_time") == "group_median" else "") + ". Then the end of epoch e is at "
           "`t(e) = s_e * t_step + e * t_eval` on that cell's clock, and the time to target is t(e*) for "
           "the first epoch e* whose v_e meets the target; \"not reached\" when no epoch of the budget does. "
           "Ratios: the other's time / this method's time (> 1: this one is sooner).", ""]
    if spec.get("dilation", "none") != "none":
        fs = sorted({(c.get("dilation") or {}).get("factor") for c in results.get("cells", [])
                     if (c.get("dilation") or {}).get("factor") is not None})
        out += [f"**Time-dilated cells** (`dilation: {spec['dilation']}`"
                + (f", GPU step {spec.get('gpu_step_ms')} ms, source: {spec.get('gpu_source')}"
                   if spec["dilation"] == "gpu" else "")
                + f"): each link ran at factor f x its nominal rate (f = {', '.join(f'{f:.4f}' for f in fs) or '-'}), "
                "and t_step, t_eval above and below are the measured times x f, i.e. on the emulated "
                "machine's clock (the cells' `step_time_dilated_s`, `eval_time_dilated_s`).", ""]
    out += ["### Curves (loopback)", ""]
    names = [m["name"] for m in spec["methods"] if curves.get(m["name"], {}).get("status") == "ok"]
    failed = [f"`{m}`: {r.get('error')}" for m, r in curves.items() if r.get("status") not in ("ok", "none")]
    none = [f"`{m}`" for m, r in curves.items() if r.get("status") == "none"]
    if names:
        n_ep = max(len(curves[m]["curve"]) for m in names)
        out += ["| epoch | steps | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
        for i in range(n_ep):
            steps = next((curves[m]["curve"][i]["steps"] for m in names if i < len(curves[m]["curve"])), None)
            out.append(f"| {i + 1} | {steps} | " + " | ".join(
                _val(curves[m]["curve"][i]["value"]) if i < len(curves[m]["curve"]) else "-"
                for m in names) + " |")
        out += ["", "Curve runs (loopback; their step times are NOT used): " + "; ".join(
            f"`{m}` {_fmt(curves[m].get('mean_step_time_s') and curves[m]['mean_step_time_s'] * 1e3)} ms/step, "
            f"load {_fmt((curves[m].get('load_before') or [None])[0])}"
            f"{'-' + _fmt(curves[m]['load_after'][0]) if curves[m].get('load_after') else ''}"
            f"{' (read from `' + curves[m]['source'] + '`)' if curves[m].get('source') else ' (reused run)' if curves[m].get('reused') else ''}"
            f"{'' if curves[m].get('run_finished', True) else ', run stopped after ' + str(curves[m].get('run_epochs')) + ' epochs'}"
            f"{'' if curves[m].get('complete', True) else ' (INCOMPLETE curve)'}" for m in names) + "."]
    if failed:
        out += ["", "Failed curve runs: " + "; ".join(failed)]
    if none:
        out += ["", "No curve (none exists for these methods; `curve_run: none` in the spec): " + ", ".join(none)
                + ". Their rows have step times, no time to target."]
    out.append("")
    for g in tt["groups"]:
        rows = [r for r in tt["rows"] if (r["hosts"], r["bandwidth"]) == (g["hosts"], g["bandwidth"])]
        out += [f"### {g['hosts']} hosts, {g['bandwidth']}", "",
                f"Reference `{tt['reference']}`: {_fmt(g['reference_time_s'])} s; best baseline (dense and "
                f"baseline rows reaching the target): `{g['best_baseline']}` {_fmt(g['best_baseline_time_s'])} s.", "",
                "| method | role | step s | eval s (measured) | eval s (used) | target at epoch | steps | time to target s | "
                f"vs {tt['reference']} | vs best baseline | final value | load (1 min) | note |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append("| " + " | ".join([
                cell_label(r),
                r["role"], _fmt(r["step_s"], "{:.3f}"), _fmt(r.get("eval_measured_s")),
                _fmt(r["eval_s"]), _fmt(r["epoch"], "{}"),
                _fmt(r["steps"], "{}"),
                _fmt(r["time_to_target_s"]) if r["time_to_target_s"] is not None else "**not reached**"
                if r["note"].startswith("not reached") else "-",
                _fmt(r["vs_reference"], "{:.2f}x"), _fmt(r["vs_best_baseline"], "{:.2f}x"),
                _val(r["final_value"]), _fmt((r["load"] or [None])[0]), r["note"]]) + " |")
        out.append("")
    return out


def plots(results: dict, out_dir: str, name: str, style) -> List[str]:
    """``<name>_ttt_curves.png`` (quality vs wall-clock time, one panel per cell group, one curve
    per method, the target as a line) and ``<name>_ttt_vs_bw.png`` (time to target vs bandwidth;
    methods that do not reach the target have no point there). ``style(i)``: plot kwargs."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tt = results.get("time_to_target")
    if not tt or "error" in tt or not tt["groups"]:
        return []
    metric = results["spec"]["time_to_target"]["metric"]
    methods = list(dict.fromkeys(r["method"] for r in tt["rows"]))
    paths = []
    n = len(tt["groups"])
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    for ax, g in zip(axes[0], tt["groups"]):
        for r in tt["rows"]:
            if (r["hosts"], r["bandwidth"]) != (g["hosts"], g["bandwidth"]) or not r["wallclock"]:
                continue
            ax.plot([p["time_s"] for p in r["wallclock"]], [p["value"] for p in r["wallclock"]],
                    label=r["method"], **style(methods.index(r["method"])))
        ax.axhline(tt["target"], color="k", linestyle=":", linewidth=1, label=f"target {tt['target']:.1f}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("wall-clock time on the emulated cell (s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{g['hosts']} hosts, {g['bandwidth']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{name}: {metric} vs wall-clock time (curve x measured step + eval time)")
    fig.tight_layout()
    p = os.path.join(out_dir, f"{name}_ttt_curves.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        pts = sorted((r["bandwidth_mbit"], r["time_to_target_s"]) for r in tt["rows"]
                     if r["method"] == m and r["time_to_target_s"] is not None)
        missing = [r["bandwidth"] for r in tt["rows"] if r["method"] == m and r["time_to_target_s"] is None
                   and r["note"].startswith("not reached")]
        other = [r["bandwidth"] for r in tt["rows"] if r["method"] == m and r["time_to_target_s"] is None
                 and not r["note"].startswith("not reached")]
        label = m + (f" (not reached: {', '.join(missing)})" if missing else "") + \
            (f" (no result: {', '.join(other)})" if other else "")
        if pts:
            ax.plot([q[0] for q in pts], [q[1] for q in pts], label=label, **style(methods.index(m)))
        else:
            ax.plot([], [], label=label, **style(methods.index(m)))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s)")
    ax.set_ylabel("time to target (s)")
    ax.set_title(f"{name}: time to {metric} <= {tt['target']:.1f}" if tt["mode"] == "min"
                 else f"{name}: time to {metric} >= {tt['target']:.3f}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = os.path.join(out_dir, f"{name}_ttt_vs_bw.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
