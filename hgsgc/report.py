"""``hgsgc report RUN_DIR [RUN_DIR ...]``: Markdown tables and PNG plots from finished runs.

Reads each run's ``summary.json`` and ``metrics.jsonl``; writes ``report.md``,
``accuracy.png`` (each run's test quality per epoch: accuracy, perplexity or WER) and ``loss.png`` (train/test loss per epoch) into the
first run directory (or ``out_dir``) and returns the Markdown. Several runs are compared in one
table and on the same axes.
"""
from __future__ import annotations

import json
import os
import sys
from typing import List, Optional


def _load(run_dir: str):
    sp = os.path.join(run_dir, "summary.json")
    mp = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(sp):
        raise FileNotFoundError(f"{sp} not found: is {run_dir} a finished run directory (runs/<id>)?")
    try:
        with open(sp) as f:
            summary = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{sp}: not valid JSON ({exc}): an interrupted run? rerun it") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{sp}: not an hgsgc run summary (a JSON {_kind(summary)}, expected an object)")
    for k in SUMMARY_KEYS:
        if k not in summary:
            raise ValueError(f"{sp}: not an hgsgc run summary (no {k!r})")
        if not _is_num(summary[k]):
            raise ValueError(f"{sp}: {k!r} is {summary[k]!r}, not a number")
    metrics = []
    if not os.path.exists(mp):  # the table still comes from summary.json; say what is missing
        print(f"hgsgc: report: warning: {mp} not found: {run_dir}'s per-epoch rows and curves are left out",
              file=sys.stderr)
    else:
        with open(mp) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{mp}, line {i}: not valid JSON ({exc})") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{mp}, line {i}: not an hgsgc metrics record (a JSON "
                                     f"{_kind(rec)}, expected an object)")
                if rec.get("kind") == "step":  # per-step lines (train.log_every_steps) are not epochs
                    continue
                for k, v in rec.items():  # the report formats epoch, losses, qualities, times
                    if (k == "epoch" or k.endswith(("_loss", "_accuracy", "_perplexity", "_wer", "_time_s"))) \
                            and v is not None and not _is_num(v):
                        raise ValueError(f"{mp}, line {i}: {k!r} is {v!r}, not a number")
                metrics.append(rec)
    return summary, metrics


#: summary.json entries the report's table needs
SUMMARY_KEYS = ("world_size", "mean_step_time_s", "bytes_sent_per_step_per_rank",
                "dense_bytes_per_step_per_rank", "compression_ratio", "wall_time_s")


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(v) -> str:
    return {list: "list", str: "string", int: "int", float: "number", bool: "boolean"}.get(type(v), "null")


#: each task's quality metric (``hgsgc.tasks``: image classification, language model, speech)
QUALITY = ("test_accuracy", "test_perplexity", "test_wer")


def _quality(summary) -> str:
    """The run's quality metric: the first of :data:`QUALITY` its summary has (``final_<key>``),
    else its first other ``final_test_*`` key, else ``test_loss``."""
    for k in QUALITY:
        if f"final_{k}" in summary:
            return k
    return next((k[len("final_"):] for k in sorted(summary)
                 if k.startswith("final_test_") and k != "final_test_loss"), "test_loss")


def _num(v, spec=".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def _label(summary) -> str:
    c = summary.get("compression", {})
    m = c.get("method", "?")
    if m in ("topk", "sgc"):
        m += f" d={c.get('density')} b={c.get('bits')} H={c.get('delay')}"
    return f"{summary.get('run_id', '?')} ({summary.get('layout', '?')}, {m})"


def report(run_dirs, out_dir: Optional[str] = None) -> str:
    """Build the report for one or more run directories.

    Returns:
        the Markdown text (also written to ``<out_dir>/report.md``).

    Raises:
        FileNotFoundError: a run directory has no ``summary.json``.
    """
    if isinstance(run_dirs, str):
        run_dirs = [run_dirs]
    runs = [(d, *_load(d)) for d in run_dirs]
    out_dir = out_dir or run_dirs[0]
    os.makedirs(out_dir, exist_ok=True)
    lines: List[str] = ["# hgsgc report", "",
                        "| run | world | test quality | test loss | mean step (ms) | sent/step/rank (kB) | "
                        "dense/step/rank (kB) | compression ratio | wall (s) |",
                        "|---|---|---|---|---|---|---|---|---|"]
    for _, s, _ in runs:
        q = _quality(s)
        lines.append(
            f"| {_label(s)} | {s['world_size']} | {q[len('test_'):]} {_num(s.get('final_' + q))} | "
            f"{_num(s.get('final_test_loss'))} | {s['mean_step_time_s'] * 1e3:.1f} | "
            f"{s['bytes_sent_per_step_per_rank'] / 1e3:.1f} | {s['dense_bytes_per_step_per_rank'] / 1e3:.1f} | "
            f"{s['compression_ratio']:.1f} | {s['wall_time_s']:.1f} |")
    for _, s, m in runs:
        q = _quality(s)
        lines += ["", f"## {_label(s)}", "", f"| epoch | train loss | test loss | {q.replace('_', ' ')} | "
                  "epoch time (s) |", "|---|---|---|---|---|"]
        lines += [f"| {r['epoch']} | {_num(r.get('train_loss'))} | {_num(r.get('test_loss'))} | "
                  f"{_num(r.get(q))} | {_num(r.get('epoch_time_s'), '.1f')} |" for r in m]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qualities = sorted({_quality(s) for _, s, _ in runs}, key=lambda k: (k not in QUALITY, k))
    for fname, keys, ylabel in (("accuracy.png", None, ", ".join(k.replace("_", " ") for k in qualities)),
                                ("loss.png", ["train_loss", "test_loss"], "loss")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for _, s, m in runs:
            for k in keys or [_quality(s)]:
                pts = [(r["epoch"], r[k]) for r in m if r.get(k) is not None]
                ax.plot([e for e, _ in pts], [v for _, v in pts], marker="o",
                        label=f"{_label(s)} {k if keys else ''}".strip())
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=100)
        plt.close(fig)
    lines += ["", "Plots: accuracy.png, loss.png"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    return text
