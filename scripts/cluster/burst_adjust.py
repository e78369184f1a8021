#!/usr/bin/env python3
"""The wire time the emulator's ``tbf`` token bucket hid in committed bench cells, added back.

cluster.sh shapes every host link with ``tbf rate R burst max(R/8/500, 15140)`` bytes (2 ms of the
rate, at least 10 full frames; :func:`hgsgc.perfmodel.tbf_burst_bytes`), on the host's egress and
on the switch port towards it. Bytes covered by the bucket's tokens leave at veth speed, so an
exchange whose busiest rank sends at most the bucket (e.g. SGC delay 1's 25 kB allgather on 2 hosts
at 100 Mbit/s) has almost no wire time on the emulator, while a real link of rate R would charge
every byte ``bytes / (R/8 * 1448/1514)``. This script re-derives the committed cells' step times
and ratios for a real link (issue 10; docs/benchmarks.md, "The tbf bucket, charged").

Per cell (no new runs; only the committed ``docs/benchmarks/*.json``):

* the collectives of one exchange come from the cell's config and overrides
  (:func:`hgsgc.perfmodel.traffic` on the model's variable shapes, per timed step with the
  density of a sparsity warm-up, as scripts/cluster/perfmodel_validation.py does) and are checked
  against the bytes hgsgc counted in the cell;
* hidden per exchange = :func:`hgsgc.perfmodel.exchange_wire_s` on a real link (``burst 0``)
  minus the same on the emulator's bucket link (:func:`hidden_per_exchange`), both with alpha 0 and
  the payload rate ``R/8 * 1448/1514`` (the link rate; Open MPI's ``put`` halving is not charged):
  the bucket starts the exchange full if it refilled during the rest of the exchange period
  (:func:`hgsgc.perfmodel.bucket_at_start_bytes`; idle = delay x measured step - the exchange's
  time on the bucket link), so at most ``burst`` payload bytes, i.e. 2 ms at 100 Mbit/s,
  12.1 ms at 10 Mbit/s, per exchange;
* hidden per step = the timed steps' exchanges' hidden time / timed steps (the first step is not in
  a bench mean); adjusted step = measured + hidden; for dilated cells (``ptb_4h_gpu``) the link
  ran at the emulated rate and the hidden time is scaled by the dilation factor like the step;
* ratios as the bench takes them, with every cell of the group adjusted: time per epoch (or time to
  target ``steps x step + epochs x eval``) against the fastest dense / best baseline of the same
  (file, hosts, bandwidth) group, and against the compute-only step where the file has one.

Why it is an upper bound on the real-link step: the bucket is taken full at every exchange that
had time to refill (the most it can hide), and every hidden byte is charged serially at the full
link rate, as if nothing overlapped it; on a real link part of it overlaps other work (Horovod
fuses and starts allreduces during the backward pass; the emulated step already contains the
bytes' veth time). ``per_collective``: the ceiling when the bucket also refills between the
collectives of one exchange (PowerSGD's two allreduces, TernGrad's two, ``buckets=2``): each
collective hides up to ``burst``. Hourglass cells (point-to-point boundary messages, per-role
counts only): :func:`hourglass_hidden_s`, a cruder bound. ``small_only``: the other side of the
bracket, where an exchange larger than :data:`HIDE_UP_TO_BUCKETS` buckets hides nothing (the probe
below saw larger exchanges hide much less than a bucket: the TCP sender sets their pace).

``--probe RATE --pin`` measures the premise instead (root; hold /work/coord/cluster.lock): a
pairwise ``Sendrecv`` of each ``--sizes`` after an idle ``--gap`` and back to back on 2 emulated
hosts (docs/benchmarks/burst_adjusted_probe_*.json).

    .venv/bin/python scripts/cluster/burst_adjust.py --json docs/benchmarks/burst_adjusted.json \\
        --md docs/benchmarks/burst_adjusted.md
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

#: The committed bench files whose 10 / 100 Mbit/s cells docs/benchmarks.md quotes (plus their
#: 1 Gbit/s cells where the file has them: the 2-pinned-host target row quotes both rates).
FILES = ["ptb_4h_ttt", "ptb_4h_ttt_testend", "ptb_4h_ttt_testend_run2", "ptb_4h_ttt_testend_run3",
         "ptb_4h_gpu", "vgg16_4h_ttt", "resnet20_4h", "clean_2h", "clean_2h_cycle5",
         "clean_2h_buckets_r1", "clean_2h_buckets_r2", "clean_2h_buckets_r3", "clean_2h_buckets_r4",
         "fmnist_4h", "fmnist_4h_hourglass", "cifar_alexnet_4h_hourglass",
         "cifar_alexnet_4h_hourglass_auto_s7_baselines_r1", "cifar_alexnet_4h_hourglass_auto_s7_baselines_r2"]


#: The largest exchange, in buckets, that the probe (``--probe``, pinned ranks; docs/benchmarks.md,
#: "The tbf bucket, charged") saw hide most of a bucket: at 100 Mbit/s 26 / 30 kB (1.1 / 1.25
#: buckets) hid 1.35 / 1.65 ms of the 2 ms, 50 kB at most 0.4 ms, 100 kB nothing; at 10 Mbit/s
#: 18 kB (1.24 buckets) 11.9 of 12.1 ms, 25 / 50 / 100 kB 8.3 / 6.2 / 3.8 ms. The "small exchanges
#: only" variant lets larger exchanges hide nothing: the other side of the bracket.
HIDE_UP_TO_BUCKETS = 1.25


def links(rate):
    """``(real, bucket)``: :class:`hgsgc.perfmodel.Link` of ``rate`` (tc rate or bit/s) at the
    payload rate ``rate / 8 * 1448/1514``, alpha 0, no ``put`` halving; ``real`` without a bucket,
    ``bucket`` with cluster.sh's (``link_for(tbf=True)``'s payload burst)."""
    from hgsgc import perfmodel as pm

    real = pm.link_for(rate, alpha_s=0.0, efficiency=pm.FRAME_EFFICIENCY, bidir_factor=1.0)
    tbf = pm.link_for(rate, alpha_s=0.0, efficiency=pm.FRAME_EFFICIENCY, bidir_factor=1.0, tbf=True)
    return real, tbf


def hidden_per_exchange(k, tr, rate, idle_s):
    """Wire seconds the bucket hides in one exchange ``tr`` (:class:`hgsgc.perfmodel.Traffic`) of
    ``k`` ranks over a link of ``rate`` that was idle ``idle_s`` seconds since the last exchange.

    Returns ``{"bytes", "real_s", "busy_s", "bucket_bytes", "hidden_s", "hidden_per_collective_s"}``:
    the busiest rank's wire bytes (Open MPI's algorithm, :func:`hgsgc.perfmodel._exchange_parts`),
    the exchange on the real link, on the bucket link with a full bucket, the bucket at the
    exchange's start (:func:`hgsgc.perfmodel.bucket_at_start_bytes`), real minus bucket link
    (:func:`hgsgc.perfmodel.exchange_wire_s` with that idle time), and the same with every
    collective its own exchange (each finds the bucket refilled by ``idle_s``: the ceiling).
    """
    from hgsgc import perfmodel as pm

    real, tbf = links(rate)
    nbytes = sum(pm._exchange_parts(k, b, alg, real)[1] for alg, b in tr.collectives)
    real_s = pm.exchange_wire_s(k, tr, real)
    hidden = real_s - pm.exchange_wire_s(k, tr, tbf, idle_s=idle_s)
    per = 0.0
    for c in tr.collectives:
        one = pm.Traffic((c,), tr.delay)
        per += pm.exchange_wire_s(k, one, real) - pm.exchange_wire_s(k, one, tbf, idle_s=idle_s)
    return {"bytes": nbytes, "real_s": real_s, "busy_s": busy_s(k, tr, rate),
            "bucket_bytes": pm.bucket_at_start_bytes(tbf.burst_bytes, idle_s, tbf.beta_Bps, nbytes),
            "hidden_s": hidden, "hidden_per_collective_s": per}


def busy_s(k, tr, rate):
    """Seconds the exchange ``tr`` keeps the emulator's link busy with a full bucket (the bytes
    beyond the bucket at the rate): the least wire time it can have there."""
    from hgsgc import perfmodel as pm

    return pm.exchange_wire_s(k, tr, links(rate)[1], idle_s=1e9)


def idle_per_exchange_s(step_s, delay, timed_steps, busy):
    """The link's idle seconds before each exchange, in the steady state of a cell whose timed
    steps (``timed_steps`` of them, mean ``step_s``) hold exchanges keeping the link ``busy``
    seconds each (a list): the step's part that is not wire, ``step_s - sum(busy) / timed``, times
    the steps per exchange (``delay``). The busy times are the least possible (full bucket), so
    the idle time, hence the refill, is the most possible: the upper-bound side."""
    return max(0.0, int(delay) * (float(step_s) - sum(busy) / int(timed_steps)))


def hourglass_hidden_s(rate, conv, fc, micro_batches, conv_ranks, delay, per_message=False, small_only=False):
    """Wire seconds per step the bucket can hide in a 1-FC-rank Hourglass cell, from its per-role
    byte counts (``conv``, ``fc``: a cell's ``roles`` entries, per step per rank).

    Four buckets carry the boundary: a CONV host's egress (activations, and its share of the CONV
    ranks' exchange every ``delay`` steps) and ingress (activation gradients, the exchange), the FC
    host's ingress (every CONV rank's activations) and egress (their gradients). Each hides per
    step at most its bytes and one ``burst`` per refill: one refill per step (``per_message``
    False: as :func:`hidden_per_exchange` allows one per exchange), or one per message
    (``per_message``: ``micro_batches`` boundary messages on a CONV link, ``conv_ranks x
    micro_batches`` on the FC link: the ceiling). The exchange part is ``min(burst, its bytes per
    exchange) / delay``. The sum is charged serially at the payload rate, although a byte crosses
    two of the buckets (CONV egress, then FC ingress) in the same pipeline: an upper bound.
    ``small_only``: a term whose messages are larger than :data:`HIDE_UP_TO_BUCKETS` buckets
    (boundary: the bucket's bytes per message; exchange: its bytes per exchange) hides nothing.
    """
    real, tbf = links(rate)
    b, h, m = tbf.burst_bytes, max(1, int(delay)), int(micro_batches)
    conv_cap, fc_cap = (m * b, conv_ranks * m * b) if per_message else (b, b)
    ex_s, ex_r = conv["exchange_bytes_sent_per_step_per_rank"], conv["exchange_bytes_received_per_step_per_rank"]
    big = HIDE_UP_TO_BUCKETS * b

    def term(nbytes, cap, messages):
        return 0.0 if small_only and nbytes / messages > big else min(nbytes, cap)

    hidden = (term(conv["activation_bytes_sent_per_step_per_rank"], conv_cap, m)
              + term(conv["activation_grad_bytes_received_per_step_per_rank"], conv_cap, m)
              + term(ex_s * h, b, 1) / h + term(ex_r * h, b, 1) / h
              + term(fc["activation_bytes_received_per_step_per_rank"], fc_cap, conv_ranks * m)
              + term(fc["activation_grad_bytes_sent_per_step_per_rank"], fc_cap, conv_ranks * m))
    return hidden / real.beta_Bps


def _ratio(a, b):
    return a / b if a and b else None


def cell_exchanges(cell, shapes_of):
    """``(cfg, [(step, Traffic), ...], timed, shapes)``: the exchanges of a data-parallel cell's
    timed steps (``1 .. steps-1``; an exchange ends every ``delay``-th step and the epoch's last
    step, hgsgc's end-of-epoch synchronisation: e.g. 3 exchanges in 9 steps at delay 4, as the
    cell's byte count shows) with the density of its warm-up at that step."""
    import dataclasses

    from hgsgc import perfmodel as pm
    from hgsgc.config import compression_from_config, load_config, recorded_index_coding
    from hgsgc.loop import density_schedule
    from hgsgc.plan import build_plan_model

    cfg = load_config(cell["config"], cell["overrides"])
    # the settings the cell ran with (recorded by the bench): configs edited since then (e.g.
    # configs/cifar10_resnet20/sgc.yaml, delay 1 -> 2) must not change a committed cell
    fields = {f.name for f in dataclasses.fields(cfg.compression)}
    rec = {k: v for k, v in (cell.get("compression") or {}).items() if k in fields and k != "method"}
    if "rank" in (cell.get("compression") or {}):
        rec["powersgd_rank"] = cell["compression"]["rank"]
    # a cell recorded without an index coding ran fixed-width indices (the default until session
    # 10), not today's default
    rec["index_coding"] = recorded_index_coding(cell.get("compression"))
    cfg = dataclasses.replace(cfg, compression=dataclasses.replace(cfg.compression, **rec))
    key = (cfg.model.name, cfg.model.width, cfg.data.format, cfg.task if hasattr(cfg, "task") else None)
    if key not in shapes_of:
        model, _ = build_plan_model(cfg)
        shapes_of[key] = [tuple(int(x) for x in v.shape) for v in model.trainable_variables]
    shapes = shapes_of[key]
    h = max(1, int(getattr(cfg.compression, "delay", 1) or 1))
    dens = density_schedule(cfg.compression)
    timed = list(range(1, int(cell["steps"])))
    out = []
    for st in timed:
        if (st + 1) % h and st != int(cell["steps"]) - 1:
            continue
        c = cfg.compression if dens is None else dataclasses.replace(cfg.compression, density=dens(st), warmup_steps=0)
        out.append((st, pm.traffic(compression_from_config(c), shapes)))
    return cfg, out, timed, shapes


def adjust_file(path, shapes_of):
    """Rows (one per ok cell) and ratio rows (one per method of a 10 / 100 Mbit/s / 1 Gbit/s group)
    of a committed bench JSON."""
    from hgsgc import costs
    from hgsgc.config import load_config

    with open(path) as f:
        d = json.load(f)
    name = os.path.splitext(os.path.basename(path))[0]
    rows = []
    for cell in d["cells"]:
        if cell.get("status") != "ok":
            continue
        dil = cell.get("dilation") or {}
        rate = dil.get("emulated_rate") or cell["bandwidth"]
        factor = float(dil.get("factor") or 1.0)
        step = float(cell["mean_step_time_s"])
        k = int(cell["hosts"])
        row = {"file": name, "method": cell["method"], "role": cell.get("role"), "hosts": k,
               "bandwidth": cell["bandwidth"], "link_rate": rate, "dilation_factor": factor,
               "layout": cell.get("layout"), "load_before": (cell.get("load_before") or [None])[0],
               "measured_step_s": step, "steps": cell["steps"],
               "full_epoch_steps": cell.get("full_epoch_steps"),
               "counted_sent_per_step_per_rank": cell.get("bytes_sent_per_step_per_rank"),
               "counted_received_per_step_per_rank": cell.get("bytes_received_per_step_per_rank")}
        if cell.get("layout") == "hourglass":
            cfg = load_config(cell["config"], cell["overrides"])
            roles = cell.get("roles") or {}
            if len(roles.get("fc", {}).get("ranks", [])) != 1:
                row.update(kind="hourglass", note="not adjusted: more than one FC rank")
                rows.append(row)
                continue
            args_ = (rate, roles["conv"], roles["fc"], cfg.hourglass.micro_batches, len(roles["conv"]["ranks"]),
                     (cell.get("compression") or {}).get("delay", cfg.compression.delay))
            row.update(kind="hourglass", micro_batches=cfg.hourglass.micro_batches,
                       hidden_per_step_s=hourglass_hidden_s(*args_),
                       hidden_per_step_ceiling_s=hourglass_hidden_s(*args_, per_message=True),
                       hidden_per_step_small_only_s=hourglass_hidden_s(*args_, small_only=True),
                       bytes_per_exchange=None, delay=int(args_[-1]))
        else:
            cfg, exchanges, timed, shapes = cell_exchanges(cell, shapes_of)
            h = max(1, int(getattr(cfg.compression, "delay", 1) or 1))
            idle = idle_per_exchange_s(step, h, len(timed), [busy_s(k, tr, rate) for _, tr in exchanges])
            per = [hidden_per_exchange(k, tr, rate, idle) for _, tr in exchanges]
            hid = sum(p["hidden_s"] for p in per) / len(timed)
            ceil = sum(p["hidden_per_collective_s"] for p in per) / len(timed)
            big = HIDE_UP_TO_BUCKETS * links(rate)[1].burst_bytes
            small = sum(p["hidden_s"] for p in per if p["bytes"] <= big) / len(timed)
            first = exchanges[-1][1]  # the steady state (after any warm-up)
            sent = sum(costs.ompi_collective_cost("allreduce" if a == "ring" else "allgatherv", k, b)["bytes"]
                       if a in ("ring", "allgather") else costs.exchange_bytes(k, b, a) for a, b in first.collectives)
            counted = cell.get("bytes_sent_per_step_per_rank")
            row.update(kind="data-parallel", delay=h, collectives=[list(c) for c in first.collectives],
                       bytes_per_exchange=per[-1]["bytes"], exchanges_timed=len(exchanges), timed_steps=len(timed),
                       bucket_bytes=per[-1]["bucket_bytes"], idle_s=idle,
                       hidden_per_exchange_s=per[-1]["hidden_s"], hidden_per_step_s=hid,
                       hidden_per_step_ceiling_s=ceil, hidden_per_step_small_only_s=small,
                       model_sent_per_step_per_rank=sum(p["bytes"] for p in per) / int(cell["steps"])
                       * (len(exchanges) + (1 if h == 1 else 0)) / len(exchanges) if exchanges else 0.0,
                       steady_sent_per_exchange=sent)
            if counted and exchanges and abs(row["model_sent_per_step_per_rank"] / counted - 1) > 0.02 \
                    and not getattr(cfg.compression, "warmup_steps", 0):
                row["note"] = (f"perfmodel bytes {row['model_sent_per_step_per_rank']:.0f} vs counted {counted:.0f} "
                               f"per step per rank")
        row["adjusted_step_s"] = step + row["hidden_per_step_s"]
        row["adjusted_step_ceiling_s"] = step + row["hidden_per_step_ceiling_s"]
        row["adjusted_step_small_only_s"] = step + row["hidden_per_step_small_only_s"]
        co = (d.get("compute_only") or {}).get(cell["method"]) or {}
        if co.get("status") == "ok":
            row["compute_only_s"] = co["mean_step_time_s"]
        rows.append(row)
    return d, rows


def ratio_rows(d, rows):
    """Per method of each (hosts, bandwidth) group: the bench's ratios before and after the
    adjustment (time to target where the file has one, else time per epoch; the compute-only ratio
    where measured)."""
    out = []
    ttt = {(r["method"], r["bandwidth"]): r for r in (d.get("time_to_target") or {}).get("rows", [])}
    groups = {}
    for r in rows:
        if "adjusted_step_s" in r:
            groups.setdefault((r["hosts"], r["bandwidth"]), []).append(r)
    for (k, bw), rs in sorted(groups.items()):
        def metric(r, key):
            f = r["dilation_factor"]
            t = ttt.get((r["method"], bw))
            if ttt:
                if not t or t.get("steps") is None:
                    return None
                # t["step_s"] is the (dilated) mean step; the hidden time scales with it
                step = t["step_s"] if key == "measured_step_s" else t["step_s"] + (r[key] - r["measured_step_s"]) * f
                return t["steps"] * step + t["epoch"] * t["eval_s"]
            return r[key] * (r["full_epoch_steps"] or 1)

        for key in ("measured_step_s", "adjusted_step_s", "adjusted_step_ceiling_s", "adjusted_step_small_only_s"):
            vals = {r["method"]: metric(r, key) for r in rs}
            dense = [v for r in rs if r["role"] == "dense" and (v := vals[r["method"]])]
            base = [(v, r["method"]) for r in rs if r["role"] in ("dense", "baseline") and (v := vals[r["method"]])]
            for r in rs:
                v = vals[r["method"]]
                # the bench's conventions: time per epoch this / other (< 1 = faster); time to
                # target other / this ("x sooner", > 1 = sooner)
                rel = (lambda other: _ratio(other, v)) if ttt else (lambda other: _ratio(v, other))
                r.setdefault("ratios", {})[key] = {
                    "metric": "time to target (other / this)" if ttt else "time per epoch (this / other)", "value": v,
                    "vs_dense": rel(min(dense)) if dense else None,
                    "vs_best_baseline": rel(min(base)[0]) if base else None,
                    "best_baseline": min(base)[1] if base else None,
                    "vs_compute_only": _ratio(r[key], r.get("compute_only_s"))}
        out += rs
    return out


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(a, b):
    f = lambda v: "-" if v is None else f"{v:.2f}x" if v < 10 else f"{v:.1f}x"
    return f"{f(a)} -> {f(b)}"


HEADER = """# The tbf bucket, charged: committed cells on a real link

Generated by `scripts/cluster/burst_adjust.py` (docs/benchmarks.md, "The tbf bucket, charged";
no runs: the committed bench JSONs of the first column). Per cell: the busiest rank's bytes per
exchange (Open MPI's algorithm; `/ 4 steps`: one exchange per 4 steps plus the epoch-end
synchronisation), the wire time per step the emulator's `tbf` bucket hid (in brackets where
larger: the ceiling with a refill before every collective, or for the Hourglass before every
boundary message), the measured mean step, the adjusted step (measured + hidden: an upper bound
on a real link's step), and the bench's ratios before -> after, every cell of the group adjusted:
time per epoch this / other (< 1 = faster), time to target other / this (> 1 = sooner, as the
bench prints it), step / compute-only step (alone). "Small exchanges only": the other side of
the bracket, where an exchange larger than 1.25 buckets hides nothing (the probe: larger ones
hid much less than a bucket). Load: the 1-minute load average when the cell started.

"""


def markdown(rows):
    lines = ["| cell | B/exchange (busiest rank) | hidden ms/step (ceiling) | measured ms | adjusted ms | "
             "metric | vs dense | vs best baseline | vs compute-only | small exchanges only: hidden ms, "
             "vs dense, vs best baseline, vs compute-only | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ratios" not in r:
            continue
        a, b, c = (r["ratios"][k] for k in ("measured_step_s", "adjusted_step_s", "adjusted_step_small_only_s"))
        f2 = lambda v: "-" if v is None else f"{v:.2f}x" if v < 10 else f"{v:.1f}x"
        so = (f"{r['hidden_per_step_small_only_s'] * 1e3:.2f}, {f2(c['vs_dense'])}, {f2(c['vs_best_baseline'])}, "
              f"{f2(c['vs_compute_only'])}")
        vs = lambda key: _x(a[key], b[key])
        hid = f"{r['hidden_per_step_s'] * 1e3:.2f}"
        if abs(r["hidden_per_step_ceiling_s"] - r["hidden_per_step_s"]) > 1e-6:
            hid += f" ({r['hidden_per_step_ceiling_s'] * 1e3:.2f})"
        nbytes = ("Hourglass, per-role counts" if r["kind"].startswith("hourglass")
                  else f"{r['bytes_per_exchange']:,.0f}" + (f" / {r['delay']} steps" if r["delay"] > 1 else ""))
        rate = r["bandwidth"] + (f" (ran at {r['link_rate']})" if r["link_rate"] != r["bandwidth"] else "")
        lines.append(f"| `{r['file']}` {r['method']} {r['hosts']}h {rate} | {nbytes} | {hid} | "
                     f"{_ms(r['measured_step_s'])} | {_ms(r['adjusted_step_s'])} | {a['metric']} | {vs('vs_dense')} | "
                     f"{vs('vs_best_baseline')} | {vs('vs_compute_only')} | {so} | {r['load_before']} |")
    return "\n".join(lines)


def probe_rank(sizes, rounds, gap_s, pin=False):
    """One rank of the probe (run under mpirun on 2 emulated hosts): for each payload size, timed
    pairwise ``Sendrecv`` rounds (both ranks send ``size`` bytes to each other at once, as a
    2-rank allgather does), after a barrier and ``gap_s`` of idle link (the bucket refills: 2 ms
    suffice at 100 Mbit/s) and back to back (no gap: the bucket stays drained); the slowest
    rank's time per round. Rank 0 prints one JSON line."""
    import statistics
    import time

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    if pin:  # each rank on its own core (as the clean cells: hgsgc.runtime.pin_to_core)
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    out = []
    for size in sizes:
        sbuf, rbuf = np.ones(max(1, size), np.uint8)[:size], np.empty(max(1, size), np.uint8)[:size]
        for gap in (gap_s, 0.0):
            times = []
            for r in range(rounds + 1):  # the first round is a warm-up
                comm.Barrier()
                if gap:
                    time.sleep(gap)
                # a 0-byte exchange lines the two ranks up after the sleep (a few header bytes of tokens)
                comm.Sendrecv(sbuf[:0], dest=peer, recvbuf=rbuf[:0], source=peer)
                t0 = time.perf_counter()
                comm.Sendrecv(sbuf, dest=peer, recvbuf=rbuf, source=peer)
                t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if r:
                    times.append(t)
            out.append({"size": size, "gap_s": gap, "median_s": statistics.median(times), "all_s": times})
    if rank == 0:
        print(json.dumps(out), flush=True)


def probe(bandwidth, sizes, rounds, gap_s, prefix="hgtbprobe", pin=False):
    """The probe on a fresh 2-host emulated cluster at ``bandwidth`` (root; hold
    /work/coord/cluster.lock or the like around it), with Open MPI's TCP ``put`` removed. Returns
    the rows with the bucket's prediction (``max(0, bytes - burst) / rate``) and the real link's
    (``bytes / rate``) beside each measured median."""
    from hgsgc.cluster import EmulatedCluster

    real, tbf = links(bandwidth)
    with EmulatedCluster(2, bandwidth, prefix) as c:
        p = c.mpirun(["--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum", sys.executable,
                      os.path.abspath(__file__), "--probe-rank", "--sizes", *map(str, sizes),
                      "--rounds", str(rounds), "--gap", str(gap_s)] + (["--pin"] if pin else []))
    rows = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("[")][-1])
    for r in rows:
        r["bucket_model_s"] = max(0.0, r["size"] - tbf.burst_bytes) / tbf.beta_Bps if r["gap_s"] else None
        r["real_link_s"] = r["size"] / real.beta_Bps
    return {"bandwidth": bandwidth, "burst_payload_bytes": tbf.burst_bytes, "rate_Bps": real.beta_Bps,
            "rounds": rounds, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="bench JSONs (default: the committed ones docs/benchmarks.md quotes)")
    ap.add_argument("--bandwidths", default="10mbit,100mbit,1gbit", help="groups to report (tc rates, comma list)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--probe", metavar="BANDWIDTH", default=None,
                    help="measure instead (root, emulated cluster; take cluster.lock): pairwise Sendrecv of "
                         "--sizes after an idle --gap and back to back; JSON to --json")
    ap.add_argument("--probe-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", nargs="+", type=int, default=[0, 10000, 20000, 30000, 50000, 100000, 200000])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gap", type=float, default=0.05)
    ap.add_argument("--pin", action="store_true", help="probe: each rank on its own core")
    args = ap.parse_args(argv)
    if args.probe_rank:
        probe_rank(args.sizes, args.rounds, args.gap, args.pin)
        return 0
    if args.probe:
        import datetime
        load = open("/proc/loadavg").read().split()[:3]
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        res = probe(args.probe, args.sizes, args.rounds, args.gap, pin=args.pin)
        res["pinned"], res["started_utc"] = args.pin, started
        res["load_before"], res["load_after"] = load, open("/proc/loadavg").read().split()[:3]
        for r in res["rows"]:
            bm = "-" if r["bucket_model_s"] is None else f"{r['bucket_model_s'] * 1e3:.3f}"
            print(f"{r['size']:>8} B gap {r['gap_s'] * 1e3:4.0f} ms: measured {r['median_s'] * 1e3:7.3f} ms, "
                  f"bucket model {bm} ms, real link {r['real_link_s'] * 1e3:.3f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    files = args.files or [os.path.join(ROOT, "docs", "benchmarks", f + ".json") for f in FILES]
    keep = set(args.bandwidths.split(","))
    shapes_of, all_rows = {}, []
    for path in files:
        d, rows = adjust_file(path, shapes_of)
        all_rows += [r for r in ratio_rows(d, rows) if r["bandwidth"] in keep]
    text = markdown(all_rows)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(HEADER + text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": [os.path.relpath(p, ROOT) for p in files], "rows": all_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
