"""Communication complexity of the sparse exchanges: allgather vs tree vs node, n = 2..16 ranks.

For every rank count the script launches one ``mpirun -np n`` of itself (``--worker``); every
rank runs the three hierarchies on the same small gradient-like tensors (one tf.function) and
reports its measured counters (:class:`hgsgc.communicator.CommStats`: bytes sent / received,
messages, rounds per exchange) and the closed-form formulas (``Exchanger.costs``). Rank 0 also
measures the result's error against the exact dense average, for one step and accumulated over
several steps with error feedback, per hierarchy, 2-bit and fp32 values.

Writes ``docs/benchmarks/hierarchy.json``, ``hierarchy.md`` (tables) and ``hierarchy.png``.

    .venv/bin/python scripts/bench_hierarchy.py                  # n = 2..16 (slow on 2 cores)
    .venv/bin/python scripts/bench_hierarchy.py --ns 2 3 4 5 6 7 8

The node hierarchy emulates hosts of ``--ranks-per-node`` consecutive ranks (default 2; the
last host takes the remainder) through ``HGSGC_RANKS_PER_NODE``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "benchmarks")
NUMEL = (4000, 1200)     # two tensors, small (oversubscribed ranks on a 2-core machine)
DENSITY = 0.01
STEPS = 40


# ------------------------------------------------------------------------------------------------
# worker (one rank under mpirun)


def worker(args):
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    import horovod.tensorflow as hvd

    import hgsgc
    from hgsgc.communicator import Exchanger

    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    names = [f"t{i}" for i in range(len(NUMEL))]
    configs = [("allgather", 2), ("tree", 2), ("node", 2), ("allgather", 32), ("tree", 32),
               ("node", 32)]
    # fixed-width indices, pinned: docs/benchmarks/hierarchy.md was measured with them (the default
    # until session 10, now elias_fano: smaller payloads, the same averages)
    exs = [Exchanger(hgsgc.Compression.sgc(DENSITY, bits=b, hierarchy=h, index_coding="fixed")) for h, b in configs]

    @tf.function
    def step(xs):
        dense = [hvd.allreduce(x, op=hvd.Average, name=f"bench_dense_{i}")
                 for i, x in enumerate(xs)]
        return dense, [ex.exchange(xs, names) for ex in exs]

    t0 = time.perf_counter()
    sums = None
    first = None
    stats0 = None
    for s in range(STEPS):
        g = np.random.default_rng([s, rank])
        # gradient-like: a signal shared by all ranks (heavy-tailed) plus per-rank noise
        shared = np.random.default_rng([100, s])
        xs = []
        for m in NUMEL:
            sig = shared.standard_t(3, m).astype(np.float32)
            xs.append(tf.constant(sig + g.standard_normal(m).astype(np.float32)))
        before = [ex.stats.snapshot() for ex in exs]
        dense, outs = step(xs)
        if stats0 is None:
            stats0 = [{k: ex.stats.snapshot()[k] - b[k] for k in b} for ex, b in zip(exs, before)]
        flat_d = np.concatenate([d.numpy().ravel() for d in dense])
        flat_o = [np.concatenate([o.numpy().ravel() for o in out]) for out in outs]
        if first is None:
            first = (flat_d, flat_o)
        if sums is None:
            sums = (flat_d, flat_o)
        else:
            sums = (sums[0] + flat_d, [a + b for a, b in zip(sums[1], flat_o)])
    wall = time.perf_counter() - t0

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    rec = {"rank": rank, "stats": stats0, "costs": [ex.costs([(m,) for m in NUMEL]) for ex in exs],
           "hosts": [list(h) for h in exs[2].plan().hosts]}
    if rank == 0:
        ag = {b: first[1][i] for i, (h, b) in enumerate(configs) if h == "allgather"}
        # the best any k-sparse result could do: the top-k of the exact average, per tensor
        oracle, off = np.zeros_like(first[0]), 0
        for m in NUMEL:
            seg = first[0][off:off + m]
            k = max(1, math.ceil(DENSITY * m))
            top = np.argsort(-np.abs(seg), kind="stable")[:k]
            oracle[off + top] = seg[top]
            off += m
        rec["oracle_topk_step1_rel_err"] = rel(oracle, first[0])
        rec["errors"] = [{
            "hierarchy": h, "bits": b,
            "step1_rel_err_vs_dense": rel(first[1][i], first[0]),
            "step1_rel_diff_vs_allgather": rel(first[1][i], ag[b]) if h != "allgather" else 0.0,
            f"cumulative{STEPS}_rel_err_vs_dense": rel(sums[1][i], sums[0]),
        } for i, (h, b) in enumerate(configs)]
        rec["wall_s"] = wall
    allr = hvd.allgather_object(rec)
    if rank == 0:
        print("RESULT " + json.dumps({"n": n, "configs": configs, "ranks": allr}))


# ------------------------------------------------------------------------------------------------
# driver


def run_one(n, ranks_per_node, timeout):
    env = dict(os.environ)
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2",
               HGSGC_RANKS_PER_NODE=str(ranks_per_node))
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(n),
           "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "HGSGC_RANKS_PER_NODE",
           sys.executable, os.path.abspath(__file__), "--worker"]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"n={n} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-3000:]}")
    out = json.loads(line[0][7:])
    out["launch_s"] = time.perf_counter() - t
    return out


STAT_KEYS = ("bytes_sent", "bytes_received", "messages", "rounds")
COST_KEYS = STAT_KEYS + ("inter_bytes_sent", "inter_bytes_received", "payload_bytes")


def compact(out):
    """One launch's result, small enough to commit: per rank and config, the measured counters
    (STAT_KEYS) and the formulas (COST_KEYS) as lists; rank 0's error measurements."""
    r0 = out["ranks"][0]
    return {"n": out["n"], "configs": out["configs"], "launch_s": out["launch_s"],
            "wall_s": r0["wall_s"], "hosts": r0["hosts"], "errors": r0["errors"],
            "oracle_topk_step1_rel_err": r0["oracle_topk_step1_rel_err"],
            "stats": [[[st[k] for k in STAT_KEYS] for st in x["stats"]] for x in out["ranks"]],
            "costs": [[[c[k] for k in COST_KEYS] for c in x["costs"]] for x in out["ranks"]]}


def summarize(res):
    """Per n and hierarchy: max over ranks of measured and formula bytes etc."""
    rows = []
    for r in res:
        n = r["n"]
        for ci, (h, b) in enumerate(r["configs"]):
            meas = [dict(zip(STAT_KEYS, x[ci])) for x in r["stats"]]
            form = [dict(zip(COST_KEYS, x[ci])) for x in r["costs"]]
            P = form[0]["payload_bytes"]
            rows.append({
                "n": n, "hierarchy": h, "bits": b, "payload_bytes": P,
                "max_sent": max(m["bytes_sent"] for m in meas),
                "max_received": max(m["bytes_received"] for m in meas),
                "mean_sent": sum(m["bytes_sent"] for m in meas) / n,
                "max_messages": max(m["messages"] for m in meas),
                "rounds": max(m["rounds"] for m in meas),
                "formula_max_sent": max(f["bytes_sent"] for f in form),
                "formula_max_received": max(f["bytes_received"] for f in form),
                "formula_rounds": max(f["rounds"] for f in form),
                "max_inter_sent_formula": max(f["inter_bytes_sent"] for f in form),
                "measured_equals_formula": all(
                    m[k] == f[k] for m, f in zip(meas, form)
                    for k in ("bytes_sent", "bytes_received", "messages", "rounds")),
                "hosts": r["hosts"] if h == "node" else None,
            })
    return rows


def write_outputs(res, rows, args):
    from hgsgc import costs  # the allgather byte formula (the tree column is its upper bound)

    os.makedirs(OUT, exist_ok=True)
    errors = [dict(n=r["n"], **e) for r in res for e in r["errors"]]
    doc = {"numel": list(NUMEL), "density": DENSITY, "steps": STEPS,
           "ranks_per_node": args.ranks_per_node, "ns": [r["n"] for r in res],
           "rows": rows, "errors": errors, "raw": res}
    with open(os.path.join(OUT, "hierarchy.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))

    two = [r for r in rows if r["bits"] == 2]
    P = two[0]["payload_bytes"]
    lines = [
        "# Sparse exchange: allgather vs tree vs node (per rank, per exchange)",
        "",
        f"Measured with `scripts/bench_hierarchy.py` on one 2-core machine, ranks oversubscribed "
        f"(n = {', '.join(str(r['n']) for r in res)}); two float32 tensors of "
        f"{' + '.join(map(str, NUMEL))} entries, density {DENSITY}, 2-bit values: every payload is "
        f"P = {P} bytes. The node hierarchy emulates hosts of {args.ranks_per_node} consecutive "
        "ranks (`HGSGC_RANKS_PER_NODE`). *Measured* are the `CommStats` counters (the sizes of the "
        "tensors handed to and returned by Horovod), *formula* the closed forms of "
        "`hgsgc/hierarchy.py`; `max` is over ranks (the busiest rank). Horovod's own control "
        "traffic (negotiation, split sizes) is not counted.",
        "",
        "| n | allgather max sent (B) | tree max sent (B) | tree max recv (B) | node max sent (B) "
        "| node inter-host max sent (B) | (n-1) P | (floor(log2 n)+2) P "
        "| rounds allgather / tree / node | measured == formula |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["n"], r["hierarchy"]): r for r in two}
    for res_n in res:
        n = res_n["n"]
        a, t, nd = by[(n, "allgather")], by[(n, "tree")], by[(n, "node")]
        ok = all(by[(n, h)]["measured_equals_formula"] for h in ("allgather", "tree", "node"))
        lines.append(
            f"| {n} | {a['max_sent']} | {t['max_sent']} | {t['max_received']} | {nd['max_sent']} "
            f"| {nd['max_inter_sent_formula']} | {costs.allgather_bytes(n, P)} | {(int(math.log2(n)) + 2) * P} "
            f"| {a['rounds']} / {t['rounds']} / {nd['rounds']} | {'yes' if ok else 'NO'} |")
    lines += [
        "",
        "Rounds: allgather counted as a latency-optimal (Bruck) allgather, `ceil(log2 n)`; tree "
        "`ceil(log2 n) + [n not a power of two]`; node `tree(h) + 2` with `h` hosts.",
        "",
        "## Error of the result against the exact dense average",
        "",
        "Relative L2 error `||result - mean_r g_r|| / ||mean_r g_r||` of the first exchange "
        f"(zero residuals) and of the sum of {STEPS} exchanges with error feedback (what was "
        "dropped or rounded is sent later), and the first exchange's relative difference to the "
        "flat allgather with the same value bits. Rank 0's view (identical on every rank). The "
        "first column is the floor for a result with k entries per tensor: the exact top-k of "
        "the dense average (the allgather result has up to n k entries, the tree's and node's k).",
        "",
        "| n | bits | top-k of exact mean, step 1 | allgather step 1 | tree step 1 | node step 1 "
        f"| tree vs allgather | allgather {STEPS} steps | tree {STEPS} steps "
        f"| node {STEPS} steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    eb = {(e["n"], e["hierarchy"], e["bits"]): e for e in errors}
    ck = f"cumulative{STEPS}_rel_err_vs_dense"
    for res_n in res:
        n = res_n["n"]
        for b in (2, 32):
            a, t, nd = eb[(n, "allgather", b)], eb[(n, "tree", b)], eb[(n, "node", b)]
            orc = res_n["oracle_topk_step1_rel_err"]
            lines.append(
                f"| {n} | {b} | {orc:.3f} | {a['step1_rel_err_vs_dense']:.3f} "
                f"| {t['step1_rel_err_vs_dense']:.3f} "
                f"| {nd['step1_rel_err_vs_dense']:.3f} | {t['step1_rel_diff_vs_allgather']:.3f} "
                f"| {a[ck]:.3f} | {t[ck]:.3f} | {nd[ck]:.3f} |")
    lines += ["", "![bytes per rank](hierarchy.png)", ""]
    with open(os.path.join(OUT, "hierarchy.md"), "w") as f:
        f.write("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in res]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for h, style in (("allgather", "o-"), ("tree", "s-"), ("node", "^-")):
        ax.plot(ns, [by[(n, h)]["max_sent"] for n in ns], style, label=f"{h} (measured)")
    ax.plot(ns, [by[(n, "node")]["max_inter_sent_formula"] for n in ns], "^:",
            label=f"node, between hosts ({args.ranks_per_node}/host)")
    ax.plot(ns, [costs.allgather_bytes(n, P) for n in ns], "k--", lw=0.8, label="(n-1) P")
    ax.plot(ns, [(int(math.log2(n)) + 2) * P for n in ns], "k:", lw=0.8,
            label="(floor(log2 n)+2) P (tree bound)")
    ax.set_xlabel("ranks n")
    ax.set_ylabel("bytes sent per exchange, busiest rank")
    ax.set_title(f"payload P = {P} B (2-bit, density {DENSITY})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for h, style in (("allgather", "o-"), ("tree", "s-"), ("node", "^-")):
        ax.plot(ns, [by[(n, h)]["rounds"] for n in ns], style, label=h)
    ax.set_xlabel("ranks n")
    ax.set_ylabel("rounds on the critical path")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "hierarchy.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ns", type=int, nargs="+", default=list(range(2, 17)))
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    ap.add_argument("--out", default=OUT, help="output folder (default docs/benchmarks)")
    ap.add_argument("--replot", action="store_true",
                    help="rewrite hierarchy.md/.png from the saved hierarchy.json, run nothing")
    args = ap.parse_args()
    globals()["OUT"] = args.out
    if args.worker:
        return worker(args)
    if args.replot:
        with open(os.path.join(OUT, "hierarchy.json")) as f:
            doc = json.load(f)
        args.ranks_per_node = doc["ranks_per_node"]
        res = doc["raw"]
        write_outputs(res, summarize(res), args)
        return 0
    res = []
    for n in args.ns:
        r = compact(run_one(n, args.ranks_per_node, args.timeout))
        print(f"n={n}: {r['launch_s']:.0f} s", flush=True)
        res.append(r)
        rows = summarize(res)
        write_outputs(res, rows, args)   # after every n: partial results survive a timeout
    bad = [r for r in rows if not r["measured_equals_formula"]]
    print(json.dumps([{k: r[k] for k in ("n", "hierarchy", "bits", "max_sent", "formula_max_sent",
                                          "rounds")} for r in rows if r["bits"] == 2]))
    if bad:
        print("measured != formula:", bad, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
