"""``hgsgc plan CONFIG --nodes N --bandwidth B``: methods AND layouts ranked by the performance model.

For the model and per-rank batch ``b`` of ``CONFIG`` on ``N`` ranks (one per host) whose links run
at ``B``, it predicts with :mod:`hgsgc.perfmodel` (the one model of the project):

* **data parallelism** with each method of :func:`plan_candidates`:
  :func:`hgsgc.perfmodel.predict_step` (measured compute step, measured compression cost, the
  collectives of ``setting``'s traffic, Horovod's coordination);
* **the Hourglass layout** (when the model has a conv/FC boundary, :func:`hgsgc.hourglass.split.split_model`)
  with the configured gradient compression on the CONV ranks, ``hourglass.fc_method`` among the
  FC ranks, the configured boundary codecs, for ``fc_workers`` 1 .. 4 and the model's best
  ``F`` in ``1 .. N/2``: :func:`hgsgc.perfmodel.predict_hourglass`, the function ``layout: auto``
  runs, on :class:`hgsgc.perfmodel.LayoutInputs` measured here like ``layout: auto`` measures
  them (:func:`hgsgc.hourglass.auto.measure`; the stages per micro-batch by
  :func:`hgsgc.hourglass.auto.measure_pipeline_stages`, so the prediction is the same
  :func:`hgsgc.perfmodel.pipeline_schedule`; boundary bytes by
  :func:`hgsgc.hourglass.costmodel.boundary_bytes`; the boundary message's software cost by
  :func:`hgsgc.hourglass.costmodel.probe_boundary` as a loopback on ``MPI.COMM_SELF``), with the
  link of the plan instead of a probe and no CPU share (one rank per host). The best ``F`` comes
  from :func:`best_fc_workers_fast`: the exhaustive scan that skips candidates a bound excludes,
  with the bounds in numpy (the answer of :func:`best_fc_workers` and of the exhaustive scan).

The Hourglass trains ``C b`` examples per step (``C = N - F`` CONV ranks), data parallelism
``N b``, so rows are ranked by the predicted seconds per ``N b`` examples (for data parallelism:
the step time). The time to target needs quality curves (``--steps-to-target FILE.json``:
``{label: steps or null}``, steps at the row's own global batch).

Same compute on both sides: the optimizer update, ``u = compute step - b (t_conv + t_fc)``
(clamped at 0), is split between trunk and head by their parameter counts (an SGD update costs
per parameter), so :func:`hgsgc.perfmodel.predict_data_parallel` of the Hourglass inputs equals
the data-parallel row of the configured method (tested).
"""
from __future__ import annotations

import math
import re
from typing import List, Optional, Sequence, Tuple

from hgsgc import perfmodel as pm

#: fc_workers always listed (within 1 .. N/2); the model's best F is added when not among them.
PLAN_FC_WORKERS = (1, 2, 3, 4)


def plan_candidates(cfg) -> List[Tuple[str, object]]:
    """``(label, compression)`` pairs ``hgsgc plan`` ranks: the config's own setting, Horovod fp32
    and fp16, top-k, SGC (delay 1 and 4; allgather and tree), TernGrad, PowerSGD (rank 4) and
    local SGD (4), with the config's density where it has one and the config's
    ``compression.index_coding`` (default elias_fano) for every sparse candidate."""
    from hgsgc.compression import DEFAULT_DENSITY, Compression
    from hgsgc.config import compression_from_config, resolved_index_coding

    dens = cfg.compression.density or DEFAULT_DENSITY  # None: a method without density (its default)
    own = compression_from_config(cfg.compression)
    ic = resolved_index_coding(cfg.compression)
    return [("config", own), ("fp32_allreduce", Compression.none), ("fp16_allreduce", Compression.fp16),
            ("topk", Compression.topk(density=dens, index_coding=ic)),
            ("sgc_d1", Compression.sgc(density=dens, delay=1, index_coding=ic)),
            ("sgc_d4", Compression.sgc(density=dens, delay=4, index_coding=ic)),
            ("sgc_d4_tree", Compression.sgc(density=dens, delay=4, hierarchy="tree", index_coding=ic)),
            ("terngrad", Compression.terngrad()), ("powersgd_r4", Compression.powersgd(rank=4)),
            ("localsgd_4", Compression.localsgd(4))]


def method_row(label: str, setting, shapes, nodes: int, link: pm.Link, compute_s: float, cost: dict,
               cycle_s: float) -> dict:
    """One data-parallel row: :func:`hgsgc.perfmodel.predict_step` of ``setting`` on ``nodes`` ranks
    (``cost``: :func:`hgsgc.perfmodel.measure_compression_s`'s ``{"base_s", "per_payload_s"}``)."""
    tr = pm.traffic(setting, shapes)
    alg = pm.algorithm_of(setting)
    p = pm.predict_step(compute_s, pm.compression_at(cost, nodes, alg), tr, nodes, link, cycle_s=cycle_s)
    return {"layout": "data_parallel", "fc_workers": None, "method": label,
            "compression": setting.to_dict() if hasattr(setting, "to_dict") else str(setting),
            "algorithm": alg, "delay": tr.delay, "payload_bytes": tr.payload_bytes,
            "compression_cost": cost, **p, "examples_per_step": None}


def hourglass_row(inp: pm.LayoutInputs, fc_workers: int, method: str) -> dict:
    """One Hourglass row: :func:`hgsgc.perfmodel.predict_hourglass` ``(inp, F)``; the exchange
    columns are the slower role's (its update + exchange decides the step)."""
    h = pm.predict_hourglass(inp, fc_workers)
    slow = "conv" if (inp.t_update_conv + h["conv_exchange_s"]
                      >= inp.t_update_fc + h["fc_exchange_s"]) else "fc"
    ex = h[f"{slow}_exchange"]
    return {"layout": "hourglass", "fc_workers": fc_workers, "method": f"hourglass_F{fc_workers}",
            "compression": method, "algorithm": f"{inp.conv_algorithm}/{inp.fc_algorithm}",
            "delay": inp.delay, "payload_bytes": int(round(inp.conv_payload)),
            "compute_s": h["pipeline_s"], "compression_s": ex["compression_s"], "wire_s": ex["wire_s"],
            "coordination_s": ex["coordination_s"], "step_s": h["step_s"], "slower_role": slow,
            "examples_per_step": h["examples_per_step"], "prediction": h}


def fc_workers_to_list(inputs_at, nodes: int, best_f: Optional[int] = None) -> List[int]:
    """``PLAN_FC_WORKERS`` within ``1 .. N/2``, plus the best ``F`` over ``1 .. N/2`` by
    :func:`hgsgc.perfmodel.predict_hourglass` ``(inputs_at(F), F)`` (highest throughput, ties to
    fewer FC ranks, as :func:`hgsgc.perfmodel.choose_layout`) when it is not among them; the best
    ``F`` is ``best_f`` when given (``hgsgc plan``: :func:`best_fc_workers_fast`), else
    :func:`best_fc_workers`, the exhaustive scan with provably idle candidates skipped."""
    fcs = [F for F in PLAN_FC_WORKERS if F <= nodes // 2]
    best = best_fc_workers(inputs_at, nodes) if best_f is None else best_f
    if best is not None and best not in fcs:
        fcs.append(best)
    return fcs


#: Relative margin by which :func:`best_fc_workers` lowers its lower bound of a step (the bound
#: comes from a schedule simulated without the roles' update + exchange, whose event times can
#: differ from the full simulation's in the last bits).
BOUND_MARGIN = 1e-12


def best_fc_workers(inputs_at, nodes: int, exhaustive: bool = False, stats: Optional[dict] = None) -> Optional[int]:
    """The ``F`` in ``1 .. floor(N/2)`` of highest predicted throughput ``C b / T(F)``
    (:func:`hgsgc.perfmodel.predict_hourglass` ``(inputs_at(F), F)``), with the rule of
    :func:`hgsgc.perfmodel.choose_layout`: scan ``F`` upwards, a candidate replaces the best only
    when its throughput exceeds the best's by a factor ``1 + 1e-9`` (ties: fewer FC ranks).

    The same scan, without simulating the candidates that cannot replace the best. With no CPU
    share (``machine_of`` empty, as in ``hgsgc plan``), :func:`hgsgc.perfmodel.pipeline_schedule`'s
    boundary pipeline depends on ``F`` only through ``m = ceil((N - F) / F)`` CONV ranks per FC
    rank (simulated once per ``m``, without updates or exchanges: the end of the last backward
    ``conv_done_m`` and of the last head ``fc_done_m``), and each role's update + exchange
    (:func:`hgsgc.perfmodel.role_exchange`, cheap) runs after its own last task, so::

        T(F) >= L(F) = max(conv_done_m + post_conv(N - F), fc_done_m + post_fc(F)) (1 - BOUND_MARGIN)

    (``post``: update + compression + wire + coordination, as
    :func:`hgsgc.perfmodel.predict_hourglass` adds them; equality up to rounding). A candidate
    with ``(N - F) b / L(F) <= best (1 + 1e-9)`` cannot replace the current best and is not
    simulated. Skipping only what the exhaustive scan would not pick gives its answer exactly
    (tested against it); about ``2 sqrt(N)`` schedules are simulated instead of ``N / 2``. With a
    CPU share, or ``exhaustive=True``, every ``F`` is predicted.

    Args:
        inputs_at: ``F -> LayoutInputs`` (e.g. :func:`hgsgc.perfmodel.with_role_compression`).
        nodes: ``N``; exhaustive: predict every ``F``; stats: optional dict, filled with
            ``{"predicted": full predictions, "bounds": schedules simulated for bounds,
            "candidates": N // 2}``.

    Returns:
        The best ``F``, or None when ``N < 2``.
    """
    nodes = int(nodes)
    top = nodes // 2
    st = {"predicted": 0, "bounds": 0, "candidates": top}
    best = None
    fast = top >= 1 and not exhaustive and not inputs_at(1).machine_of
    done_at = {}   # m -> (conv_done_m, fc_done_m)
    for F in range(1, top + 1):
        inp = inputs_at(F)
        if fast and best is not None:
            m = -(-(nodes - F) // F)
            if m not in done_at:
                sch = pm.pipeline_schedule(pm.pipeline_stages(inp), F)
                done_at[m] = (sch["conv_done_s"], sch["fc_done_s"])
                st["bounds"] += 1
            C = nodes - F
            ex_c = pm.role_exchange(inp, C, inp.conv_payload, inp.conv_algorithm, inp.delay, inp.conv_compression_s,
                                    inp.conv_buckets)
            ex_f = pm.role_exchange(inp, F, inp.fc_payload, inp.fc_algorithm, inp.fc_delay, inp.fc_compression_s,
                                    inp.fc_buckets)
            low = max(done_at[m][0] + inp.t_update_conv + ex_c["compression_s"] + ex_c["wire_s"] + ex_c["coordination_s"],
                      done_at[m][1] + inp.t_update_fc + ex_f["compression_s"] + ex_f["wire_s"] + ex_f["coordination_s"])
            low *= 1.0 - BOUND_MARGIN
            if low > 0 and C * inp.batch_size / low <= best["throughput"] * (1 + 1e-9):
                continue
        p = pm.predict_hourglass(inp, F)
        st["predicted"] += 1
        if best is None or p["throughput"] > best["throughput"] * (1 + 1e-9):
            best = p
    if stats is not None:
        stats.update(st)
    return best["fc_workers"] if best is not None else None


#: Ranks from which Open MPI's fixed decision no longer depends on the communicator size:
#: :func:`hgsgc.costs.ompi_allreduce_algorithm`'s last band starts at 4096 ranks,
#: :func:`hgsgc.costs.ompi_allgatherv_algorithm`'s at 1024 (tested: the choice at 4096 ranks is
#: the choice at every larger size). :func:`role_post_s` evaluates exchanges among this many
#: ranks or more with numpy, smaller ones with :func:`hgsgc.perfmodel.role_exchange`.
VECTOR_FROM_RANKS = 4096

#: F candidates per numpy chunk of :func:`best_fc_workers_fast` (bounds memory: a few arrays of
#: this many float64 values).
SCAN_CHUNK = 1 << 20


def _bit_length(k):
    """``int.bit_length`` of each element of the int64 array ``k`` (exact below 2^53: frexp's exponent)."""
    import numpy as np

    return np.frexp(k.astype(np.float64))[1].astype(np.int64)


def _ompi_cost_array(collective: str, k, nbytes: float):
    """:func:`hgsgc.costs.ompi_collective_cost` ``(collective, k, nbytes)`` for an int64 array ``k``
    of sizes ``>= VECTOR_FROM_RANKS`` (one algorithm for all of them): ``(messages, bytes,
    pairwise)`` arrays with the same expressions in the same order (so the same float64 values)."""
    import numpy as np

    from hgsgc import costs

    B = float(nbytes)
    L = _bit_length(k) - 1
    p = np.left_shift(np.int64(1), L)
    x = (p != k).astype(np.int64)
    lg = _bit_length(k - 1)
    false = np.zeros(k.shape, bool)
    if collective == "allreduce":
        alg = costs.ompi_allreduce_algorithm(VECTOR_FROM_RANKS, B)
        if alg in ("ring", "segmented_ring"):
            return 2 * (k - 1), 2 * (k - 1) / k * B, false
        if alg == "rabenseifner":
            return 2 * L + 2 * x, 2 * (p - 1) / p * B + x * B, ~false
        if alg == "recursive_doubling":
            return L + 2 * x, (L + x) * B, ~false
        if alg == "nonoverlapping":
            return 2 * lg, 2 * lg * B, false
        return 2 * (k - 1), (k - 1) * B, false   # basic_linear
    alg = costs.ompi_allgatherv_algorithm(VECTOR_FROM_RANKS, B)
    odd = (k % 2).astype(bool)
    if alg == "neighbor":   # Open MPI falls back to the ring for an odd communicator
        return np.where(odd, k - 1, k // 2), (k - 1) * B, ~odd
    if alg == "ring":
        return k - 1, (k - 1) * B, false
    if alg == "bruck":
        return lg, (k - 1) * B, false
    if alg == "two_proc":
        return np.ones_like(k), np.full(k.shape, B), ~false
    return (k - 1) + lg, (k - 1) * B + lg * k * B, false   # default: gatherv + broadcast


def role_post_s(inp: pm.LayoutInputs, ks, payload: float, algorithm: str, delay: int, cost: dict,
                t_update: float, buckets: Sequence[int] = ()):
    """Seconds a role spends after its last pipeline task when it has ``k`` ranks, for each ``k``
    of ``ks``: ``t_update + compression + wire + coordination`` of :func:`hgsgc.perfmodel.role_exchange`
    ``(inp, k, payload, algorithm, delay, compression_at(cost, k, algorithm))`` (each term divided by
    the delay ``H``, as :func:`hgsgc.perfmodel.predict_step` charges it)::

        post(k) = t_update + (base_s + merges(k) per_payload_s) / H + exchange_s(k) / H
                  + (cycle_s / 2 + m_neg(k) alpha) / H

    (with ``compression.buckets``, ``buckets`` of more than one size: ``exchange_s`` summed over
    the buckets' collectives and the coordination times their number, as
    :func:`hgsgc.perfmodel.exchange_traffic`)

    with ``merges`` :func:`hgsgc.costs.exchange_merges`, ``exchange_s``
    :func:`hgsgc.perfmodel.exchange_s` on ``inp.link`` (no token bucket) and ``m_neg`` the
    messages of Horovod's 136-byte negotiation allreduce. Sizes ``k >= VECTOR_FROM_RANKS`` are
    evaluated with numpy by the same expressions (Open MPI's choice is fixed there), smaller ones
    (and ``k <= 1``: 0 besides ``t_update``) by ``role_exchange`` itself; the two agree exactly
    (tests/test_plan_fast_search.py).

    Args:
        inp: the layout inputs (link, cycle); ks: int array of rank counts; payload: bytes of one
            exchange per rank; algorithm: ``ring`` | ``allgather`` | ``tree`` | ``node``;
            cost: :func:`hgsgc.perfmodel.measure_compression_s`'s ``{"base_s", "per_payload_s"}``.

    Returns:
        float64 array, seconds, shaped like ``ks``.

    Raises:
        ValueError: an unknown ``algorithm``.
    """
    import numpy as np

    from hgsgc import costs

    if algorithm not in costs.ALGORITHMS:
        raise ValueError(f"unknown exchange algorithm {algorithm!r}: use one of {', '.join(costs.ALGORITHMS)}")
    ks = np.asarray(ks, dtype=np.int64)
    out = np.empty(ks.shape, np.float64)
    small = ks < VECTOR_FROM_RANKS
    for i in np.flatnonzero(small):
        k = int(ks[i])
        ex = pm.role_exchange(inp, k, payload, algorithm, delay, pm.compression_at(cost, k, algorithm), buckets)
        out[i] = t_update + ex["compression_s"] + ex["wire_s"] + ex["coordination_s"]
    k = ks[~small]
    if k.size:
        h = max(1, int(delay))
        link = inp.link
        lg = _bit_length(k - 1)
        parts = pm.exchange_traffic(algorithm, payload, delay, buckets).collectives
        wire = 0
        for _, size in parts:   # perfmodel.exchange_wire_s without a token bucket: the sum in order
            if algorithm in ("tree", "node"):   # perfmodel.exchange_s without hosts: the tree
                L = _bit_length(k) - 1
                nbytes = (L + np.where(k > np.left_shift(np.int64(1), L), 2, 0)) * size
                msgs = lg + (k & (k - 1) != 0)          # tree_rounds: ceil(log2 k) + [k not a power of 2]
                wire = wire + (msgs * link.alpha_s + nbytes / (link.beta_Bps * link.bidir_factor))
            else:
                msgs, nbytes, pw = _ompi_cost_array("allreduce" if algorithm == "ring" else "allgatherv", k, size)
                wire = wire + (msgs * link.alpha_s
                               + nbytes / np.where(pw, link.beta_Bps * link.bidir_factor, link.beta_Bps * 1.0))
        merges = lg if algorithm in ("tree", "node") else k - 1
        neg, _, _ = _ompi_cost_array("allreduce", k, pm.NEGOTIATION_BYTES)
        comp = cost["base_s"] + merges * cost["per_payload_s"]
        coord = len(parts) * (inp.cycle_s / 2.0 + neg * link.alpha_s)
        out[~small] = t_update + comp / h + wire / h + coord / h
    return out


def best_fc_workers_fast(inp: pm.LayoutInputs, nodes: int, conv_cost: dict, fc_cost: dict,
                         stats: Optional[dict] = None) -> Optional[int]:
    """:func:`best_fc_workers` ``(F -> with_role_compression(inp, F, conv_cost, fc_cost), nodes)``:
    the same answer (the exhaustive scan's), with the bounds in numpy (``hgsgc plan --nodes
    10000000`` spent 259 s building inputs and exchanges for each of the 5,000,000 ``F``).

    The same scan over ``F = 1 .. floor(N/2)`` and the same rule (a candidate replaces the best
    only when its throughput exceeds the best's by a factor ``1 + 1e-9``); a candidate is
    predicted (:func:`hgsgc.perfmodel.predict_hourglass`) only when its upper bound
    ``C b / L(F)`` exceeds the current best, with::

        L(F) = max(conv_done_m + post_conv(N - F), fc_done_m + post_fc(F)) (1 - BOUND_MARGIN)

    (:func:`role_post_s` for all ``F`` of a chunk at once; ``conv_done_m``, ``fc_done_m``: the
    boundary pipeline without updates or exchanges, simulated once per ``m = ceil((N - F) / F)``,
    and only for the ``m`` whose ``F`` pass the bound with ``conv_done = fc_done = 0`` against the
    best after ``F = 1``; the best only grows, so no candidate that could replace it is skipped).
    With a CPU share (``inp.machine_of``) every ``F`` is predicted, as in :func:`best_fc_workers`.

    Args:
        inp: the Hourglass inputs of ``N`` ranks; nodes: ``N``; conv_cost, fc_cost: measured
            compression costs of the CONV / FC exchanges (:func:`hgsgc.perfmodel.with_role_compression`);
            stats: optional dict, filled with ``{"predicted", "bounds" (schedules simulated for
            bounds), "candidates": N // 2}``.

    Returns:
        The best ``F`` (a count of FC ranks), or None when ``N < 2``.

    Raises:
        ValueError: an exchange algorithm of ``inp`` that is not one of
            :data:`hgsgc.costs.ALGORITHMS`.
    """
    import numpy as np

    nodes = int(nodes)
    top = nodes // 2
    at = lambda F: pm.with_role_compression(inp, F, conv_cost, fc_cost)  # noqa: E731
    if top < 1 or inp.machine_of:
        return best_fc_workers(at, nodes, exhaustive=True, stats=stats)
    st = {"predicted": 1, "bounds": 0, "candidates": top}
    best = pm.predict_hourglass(at(1), 1)
    b = inp.batch_size
    done_at = {}   # m -> (conv_done_m, fc_done_m), as best_fc_workers
    thr0 = best["throughput"] * (1 + 1e-9)
    for lo in range(2, top + 1, SCAN_CHUNK):
        Fs = np.arange(lo, min(top, lo + SCAN_CHUNK - 1) + 1, dtype=np.int64)
        C = nodes - Fs
        post_c = role_post_s(inp, C, inp.conv_payload, inp.conv_algorithm, inp.delay, conv_cost, inp.t_update_conv,
                             inp.conv_buckets)
        post_f = role_post_s(inp, Fs, inp.fc_payload, inp.fc_algorithm, inp.fc_delay, fc_cost, inp.t_update_fc,
                             inp.fc_buckets)
        low0 = np.maximum(post_c, post_f) * (1.0 - BOUND_MARGIN)
        with np.errstate(divide="ignore"):
            keep = ~((low0 > 0) & (C * b / np.where(low0 > 0, low0, 1.0) <= thr0))
        idx = np.flatnonzero(keep)
        if not idx.size:
            continue
        m = -(-C[idx] // Fs[idx])
        starts = np.flatnonzero(np.r_[True, m[1:] != m[:-1]])
        for g, s0 in enumerate(starts):
            sel = idx[s0:starts[g + 1] if g + 1 < len(starts) else len(idx)]
            mg = int(m[s0])
            if mg not in done_at:
                F0 = int(Fs[sel[0]])
                sch = pm.pipeline_schedule(pm.pipeline_stages(at(F0)), F0)
                done_at[mg] = (sch["conv_done_s"], sch["fc_done_s"])
                st["bounds"] += 1
            dc, df = done_at[mg]
            low = np.maximum(dc + post_c[sel], df + post_f[sel]) * (1.0 - BOUND_MARGIN)
            with np.errstate(divide="ignore"):
                ub = np.where(low > 0, C[sel] * b / np.where(low > 0, low, 1.0), np.inf)
            for j in np.flatnonzero(ub > best["throughput"] * (1 + 1e-9)):
                if not ub[j] > best["throughput"] * (1 + 1e-9):   # the best grew within the group
                    continue
                F = int(Fs[sel[j]])
                p = pm.predict_hourglass(at(F), F)
                st["predicted"] += 1
                if p["throughput"] > best["throughput"] * (1 + 1e-9):
                    best = p
    if stats is not None:
        stats.update(st)
    return best["fc_workers"]


def boundary_overhead(act_codec, grad_codec, nonzero, micro_batches: int) -> dict:
    """Where a boundary codec sends MORE bytes per example than fp32 (:func:`hgsgc.hourglass.
    costmodel.boundary_bytes`, the one formula, for both).

    A ``q8`` / ``q4`` message of ``r`` rows and ``f`` features carries ``4 f`` bytes of per-feature
    scales besides its ``r f`` (q8) / ``ceil(r f / 2)`` (q4) code bytes, so with few rows per
    message (``hourglass.micro_batches`` close to the batch) it is longer than fp32's ``4 r f``:
    at one row, ``5 f`` (q8) and ``4 f + ceil(f / 2)`` (q4) against ``4 f``. A ``sparse+`` bitmap
    (``ceil(r f / 8)``) can do the same at high density. Real overhead of the codecs, not of the
    formula: the encoders send exactly these bytes (tests/test_plan_boundary_overhead.py).

    Args:
        act_codec, grad_codec: :class:`~hgsgc.hourglass.boundary.BoundaryCodec` s or specs.
        nonzero: bool ``[b, f]``: the non-zero activations of a representative batch.
        micro_batches: ``M``, 1 .. b (the configured ``hourglass.micro_batches``).

    Returns:
        ``{"act": d or None, "grad": d or None}``, None where the codec sends at most fp32's bytes;
        ``d = {"codec", "bytes", "fp32_bytes", "ratio" (bytes / fp32_bytes), "micro_batches" (M),
        "break_even_micro_batches" (the largest M' < M whose bytes per example are below fp32's,
        None when no M' in 1 .. M - 1 is)}``; bytes per example (act: labels included, as
        ``boundary_bytes``).

    Raises:
        ValueError: as :func:`hgsgc.hourglass.costmodel.boundary_bytes` (bad ``nonzero`` or ``M``).
    """
    from hgsgc.hourglass.boundary import BoundaryCodec
    from hgsgc.hourglass.costmodel import boundary_bytes

    ac, gc = BoundaryCodec.parse(act_codec), BoundaryCodec.parse(grad_codec)
    M = int(micro_batches)
    got = boundary_bytes(ac, gc, nonzero, M)
    ref = boundary_bytes("fp32", "fp32", nonzero, M)
    out = {"act": None, "grad": None}
    for i, (name, codec) in enumerate((("act", ac), ("grad", gc))):
        if got[i] <= ref[i]:
            continue
        even = None
        for m in range(M - 1, 0, -1):
            if boundary_bytes(ac, gc, nonzero, m)[i] < ref[i]:
                even = m
                break
        out[name] = {"codec": codec.name, "bytes": got[i],
                     "fp32_bytes": ref[i], "ratio": got[i] / ref[i], "micro_batches": M,
                     "break_even_micro_batches": even}
    return out


def format_boundary_overhead(over: dict, batch_size: int) -> Optional[str]:
    """One line naming each direction whose codec sends more than fp32 (:func:`boundary_overhead`),
    or None when neither does."""
    parts = []
    for name in ("act", "grad"):
        d = over.get(name) if over else None
        if not d:
            continue
        rows = batch_size / d["micro_batches"]
        fix = (f"hourglass.micro_batches <= {d['break_even_micro_batches']} makes it smaller"
               if d["break_even_micro_batches"] else "no smaller micro_batches makes it smaller: use fp32 or fp16")
        parts.append(f"{name}_codec {d['codec']} sends {d['bytes']:.1f} B/example, {d['ratio']:.2f}x fp32's "
                     f"{d['fp32_bytes']:.1f} (M {d['micro_batches']}: {rows:.3g} row(s) per message, each "
                     f"message carries its own per-feature scales / bitmap); {fix}")
    return ("hourglass boundary: MORE bytes than fp32: " + "; ".join(parts)) if parts else None


def rank_rows(rows: Sequence[dict], nodes: int, batch_size: int,
              steps_to_target: Optional[dict] = None) -> List[dict]:
    """Add ``s_per_global_batch`` (predicted seconds per ``nodes * batch_size`` examples: the step
    time scaled by ``N b / examples_per_step``; data parallelism: the step), ``steps_to_target``
    and ``time_to_target_s`` (:func:`hgsgc.perfmodel.time_to_target`, None without a curve or
    when not reached) to each row; return them fastest first."""
    nb = nodes * batch_size
    out = []
    for r in rows:
        r = dict(r)
        eps = r.get("examples_per_step") or nb
        r["examples_per_step"] = eps
        r["s_per_global_batch"] = r["step_s"] * nb / eps
        steps = (steps_to_target or {}).get(r["method"])
        r["steps_to_target"] = steps
        r["time_to_target_s"] = (pm.time_to_target(steps, r["step_s"])
                                 if steps_to_target and r["method"] in steps_to_target else None)
        out.append(r)
    out.sort(key=lambda r: r["s_per_global_batch"])
    return out


def hourglass_inputs(cfg, model, nodes: int, link: pm.Link, cycle_s: float, compute_s: float,
                     reps: int, dp_cost: dict, log=None) -> Tuple[Optional[pm.LayoutInputs], dict]:
    """Measure the :class:`hgsgc.perfmodel.LayoutInputs` of ``cfg``'s Hourglass layout on ``nodes``
    ranks (one process, a random batch; the link is the plan's).

    Returns:
        ``(inputs or None, info)``; ``info["reason"]`` says why there is no Hourglass layout
        (no conv/FC boundary, one node), else it holds the split, codecs, activation density and
        the measured compression costs of the CONV and FC exchanges (``conv_compression_cost``,
        ``fc_compression_cost``; :func:`hgsgc.perfmodel.with_role_compression` puts them into the inputs for each ``F``).
    """
    from hgsgc.config import compression_from_config, fc_compression_from_config
    from hgsgc.hourglass import auto, costmodel
    from hgsgc.hourglass.costmodel import configured_codecs
    from hgsgc.hourglass.split import SplitError, split_model

    from hgsgc.models import why_no_boundary

    if nodes < 2:
        return None, {"reason": "one node: no Hourglass layout"}
    why = why_no_boundary(cfg.model.name, cfg.hourglass.split_layer)
    if why:  # say what the model is, not how splitting fails
        return None, {"reason": f"no conv/FC boundary: model {cfg.model.name} has none ({why})"}
    try:
        split = split_model(model, cfg.hourglass.split_layer)
    except SplitError as exc:
        return None, {"reason": f"no conv/FC boundary: {exc}"}
    h = cfg.hourglass
    b = int(cfg.train.batch_size)
    act, grad = configured_codecs(h)
    x, _ = pm._random_batch(model, b)
    meas = auto.measure(split, x.numpy(), act, grad, repeats=max(1, reps), micro_batches=int(h.micro_batches))
    nonzero = split.trunk(x, training=False).numpy().reshape(b, -1) != 0
    over = boundary_overhead(act, grad, nonzero, int(h.micro_batches))
    stages = auto.measure_pipeline_stages(split, x.numpy(), int(h.micro_batches), nodes - 1, repeats=max(1, reps))
    # the boundary message's software path in this one process (loopback over MPI.COMM_SELF; the
    # link's own per-message cost is the plan link's alpha): costmodel.message_cost_s, beta = inf
    from mpi4py import MPI

    probe = costmodel.probe_boundary(MPI.COMM_SELF, act, grad,
                                     *costmodel.boundary_sample(split, x.numpy(), int(h.micro_batches)))
    msg = costmodel.boundary_message_inputs(probe, meas["act_bytes"], meas["grad_bytes"], meas["codec_s"],
                                            0.0, float("inf"))
    cc, fcc = compression_from_config(cfg.compression), fc_compression_from_config(cfg)
    conv_shapes = [tuple(int(d) for d in v.shape) for v in split.trunk_variables]
    fc_shapes = [tuple(int(d) for d in v.shape) for v in split.head_variables]
    conv_cost = pm.measure_compression_s(cc, conv_shapes, reps)
    fc_cost = pm.measure_compression_s(fcc, fc_shapes, reps)
    d_conv = sum(math.prod(s) for s in conv_shapes)
    d_fc = sum(math.prod(s) for s in fc_shapes)
    update = max(0.0, compute_s - b * (meas["t_conv"] + meas["t_fc"]))
    inp = pm.LayoutInputs(
        world_size=int(nodes), batch_size=b, t_conv=meas["t_conv"], t_fc=meas["t_fc"],
        act_bytes=meas["act_bytes"], grad_bytes=meas["grad_bytes"], codec_s=meas["codec_s"],
        alpha=link.alpha_s, beta=link.beta_Bps, bidir_factor=link.bidir_factor, cycle_s=cycle_s,
        dp_payload=float(cc.payload_bytes(conv_shapes + fc_shapes)),
        conv_payload=float(cc.payload_bytes(conv_shapes)), fc_payload=float(fcc.payload_bytes(fc_shapes)),
        dp_algorithm=cc.algorithm, conv_algorithm=cc.algorithm, fc_algorithm=fcc.algorithm,
        delay=int(cc.delay), fc_delay=int(fcc.delay), micro_batches=int(h.micro_batches),
        dp_compression_s=pm.compression_at(dp_cost, nodes, cc.algorithm),
        t_update_conv=update * d_conv / (d_conv + d_fc), t_update_fc=update * d_fc / (d_conv + d_fc),
        conv_fwd_mb_s=stages["conv_fwd_mb_s"], conv_bwd_mb_s=stages["conv_bwd_mb_s"],
        fc_call_s=stages["fc_call_s"], fc_row_s=stages["fc_row_s"], boundary_msg_s=msg["boundary_msg_s"],
        dp_buckets=pm.allgather_buckets(cc, conv_shapes + fc_shapes), conv_buckets=pm.allgather_buckets(cc, conv_shapes),
        fc_buckets=pm.allgather_buckets(fcc, fc_shapes))
    info = {"boundary_message": msg, "split_layer": split.boundary_layer,
            "features": int(split.features), "act_codec": act.name, "grad_codec": grad.name,
            "density_of_nonzero_activations": meas["density"], "conv_compression_cost": conv_cost,
            "fc_compression_cost": fc_cost, "fc_method": h.fc_method, "boundary_overhead": over,
            "update_s": update, "update_split": "by parameter count",
            "compute_minus_stages_s": compute_s - b * (meas["t_conv"] + meas["t_fc"])}
    if log:
        log(f"plan: measured hourglass stages: t_conv {meas['t_conv'] * 1e6:.1f} us/example, "
            f"t_fc {meas['t_fc'] * 1e6:.1f} us/example, boundary {meas['act_bytes']:.0f} + "
            f"{meas['grad_bytes']:.0f} B/example; per micro-batch: trunk fwd {stages['conv_fwd_mb_s'] * 1e3:.2f} "
            f"+ bwd {stages['conv_bwd_mb_s'] * 1e3:.2f} ms, FC rank {stages['fc_call_s'] * 1e3:.2f} ms + "
            f"{stages['fc_row_s'] * 1e6:.1f} us/example, boundary message {msg['boundary_msg_s'] * 1e3:.3f} ms "
            f"(loopback round trip {probe['pairs'][0][1] * 1e3:.3f} ms for {probe['rows']} rows)")
    return inp, info


def plan(cfg, nodes: int, bandwidth, compute_s: Optional[float] = None, reps: int = 5,
         link: Optional[pm.Link] = None, steps_to_target: Optional[dict] = None, log=None,
         cycle_s: float = pm.EMULATOR["cycle_s"]) -> dict:
    """Rank the methods of :func:`plan_candidates` (data parallel) and the Hourglass layouts on
    ``nodes`` ranks (one per host) with ``bandwidth`` links, for the model and batch of ``cfg``
    (an :class:`hgsgc.config.Config`); see the module docstring.

    Compute is measured here (or ``compute_s``), compression measured per method
    (:func:`hgsgc.perfmodel.measure_compression_s`), communication on ``link`` (default
    :func:`hgsgc.perfmodel.link_for` ``(bandwidth)``, the emulator's calibration).

    Returns:
        ``{"inputs": {...}, "hourglass_inputs": {...} or None, "hourglass": {...}, "rows": [...]}``;
        rows sorted by ``s_per_global_batch``.

    Raises:
        ValueError: ``nodes < 1`` or a bad bandwidth.
    """
    if int(nodes) < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    link = link or pm.link_for(bandwidth)
    model, built = build_plan_model(cfg)
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    if compute_s is None:
        why = _no_random_batch(model)
        if why:
            raise ValueError(f"cannot measure the compute step of model {cfg.model.name} on a random batch "
                             f"({why}): pass --compute-ms, e.g. 1000 x mean_step_time_s of a one-rank run's "
                             f"summary.json")
        compute_s = pm.measure_compute_s(model, cfg.train.batch_size, reps=max(reps, 3))
    rows, costs_by_label = [], {}
    for label, comp in plan_candidates(cfg):
        cost = pm.measure_compression_s(comp, shapes, reps)
        costs_by_label[label] = cost
        if log:
            log(f"plan: measured {label}: compression {cost['base_s'] * 1e3:.1f} ms "
                f"+ {cost['per_payload_s'] * 1e3:.2f} ms per payload")
        rows.append(method_row(label, comp, shapes, nodes, link, compute_s, cost, cycle_s))
    inp, info = hourglass_inputs(cfg, model, int(nodes), link, cycle_s, compute_s, reps,
                                 costs_by_label["config"], log)
    if inp is not None:
        at = lambda F: pm.with_role_compression(inp, F, info["conv_compression_cost"], info["fc_compression_cost"])  # noqa: E731
        best_f = best_fc_workers_fast(inp, int(nodes), info["conv_compression_cost"], info["fc_compression_cost"])
        for F in fc_workers_to_list(at, int(nodes), best_f):
            rows.append(hourglass_row(at(F), F, _method_name(cfg)))
    inputs = {"config": cfg.model.name, "batch_size": cfg.train.batch_size, "nodes": int(nodes),
              "bandwidth_bit_s": pm.parse_rate(bandwidth), "alpha_s": link.alpha_s,
              "beta_Bps": link.beta_Bps, "bidir_factor": link.bidir_factor,
              "cycle_s": cycle_s, "compute_s": compute_s,
              "parameters": int(sum(math.prod(s) for s in shapes)), "model_built_from": built}
    return {"inputs": inputs, "hourglass_inputs": inp.to_dict() if inp is not None else None,
            "hourglass": info, "rows": rank_rows(rows, int(nodes), cfg.train.batch_size, steps_to_target)}


def _no_random_batch(model) -> Optional[str]:
    """Why :func:`hgsgc.perfmodel.measure_compute_s` (one random batch of one fixed-shape input)
    cannot time ``model``, or None."""
    ins = list(model.inputs or [])
    if len(ins) != 1:
        return f"it takes {len(ins)} inputs"
    if any(d is None for d in ins[0].shape[1:]):
        return f"its input shape {tuple(ins[0].shape)} has variable dimensions"
    return None


def build_plan_model(cfg):
    """``(model, how)``: the config's model as training builds it (``make_task(cfg).build_model()``:
    vocabulary, input shape and width from the data and the config), or, when the data cannot be
    loaded, :func:`hgsgc.models.build_model` from the config alone (``how`` says which, and why)."""
    import tensorflow as tf

    from hgsgc.data.errors import DataError
    from hgsgc.models import build_model
    from hgsgc.tasks import make_task

    tf.keras.utils.set_random_seed(cfg.run.seed)
    try:
        return make_task(cfg).build_model(), "task"
    except (DataError, OSError) as exc:
        return (build_model(cfg.model.name, seed=cfg.run.seed, width=cfg.model.width),
                f"config only, without the data ({exc})")


def _method_name(cfg) -> str:
    c = cfg.compression
    return str(getattr(c, "method", "config"))


def format_plan(result: dict) -> str:
    """The plan as text: the inputs (of both layouts), then one line per row, fastest first."""
    i = result["inputs"]
    lines = [f"hgsgc plan: {i['config']} ({i['parameters']:,} parameters), batch {i['batch_size']} per rank, "
             f"{i['nodes']} nodes, link {i['bandwidth_bit_s'] / 1e6:g} Mbit/s (beta {i['beta_Bps'] * 8 / 1e6:.1f} "
             f"Mbit/s payload, alpha {i['alpha_s'] * 1e6:.0f} us, pairwise factor {i['bidir_factor']:g}), "
             f"Horovod cycle {i['cycle_s'] * 1e3:g} ms, compute {i['compute_s'] * 1e3:.1f} ms/step"]
    if i.get("model_built_from", "task") != "task":
        lines.append(f"model: built from the {i['model_built_from']}")
    h, hi = result.get("hourglass") or {}, result.get("hourglass_inputs")
    if hi is None:
        lines.append(f"hourglass: not ranked ({h.get('reason', 'no inputs')})")
    else:
        lines.append(
            f"hourglass inputs: split at {h['split_layer']} ({h['features']} features), "
            f"act_codec {h['act_codec']} {hi['act_bytes']:.1f} B/example (labels incl.), grad_codec "
            f"{h['grad_codec']} {hi['grad_bytes']:.1f} B/example (non-zero activations "
            f"{h['density_of_nonzero_activations']:.3f}), codec {hi['codec_s'] * 1e6:.1f} us/example, "
            f"t_conv {hi['t_conv'] * 1e6:.1f} us/example, t_fc {hi['t_fc'] * 1e6:.1f} us/example, "
            f"update {h['update_s'] * 1e3:.2f} ms/step split by parameters"
            f"{_clamped(h)}, M {hi['micro_batches']} (per micro-batch: trunk fwd "
            f"{hi.get('conv_fwd_mb_s', 0.0) * 1e3:.2f} + bwd {hi.get('conv_bwd_mb_s', 0.0) * 1e3:.2f} ms, FC rank "
            f"{hi.get('fc_call_s', 0.0) * 1e3:.2f} ms + {hi.get('fc_row_s', 0.0) * 1e6:.1f} us/example, boundary "
            f"message {hi.get('boundary_msg_s', 0.0) * 1e6:.0f} us (loopback)), "
            f"CONV exchange {hi['conv_payload']:.0f} B {hi['conv_algorithm']} H {hi['delay']}, FC exchange {h['fc_method']} "
            f"{hi['fc_payload']:.0f} B {hi['fc_algorithm']} H {hi['fc_delay']}")
        warn = format_boundary_overhead(h.get("boundary_overhead"), i["batch_size"])
        if warn:
            lines.append(warn)
    lines.append(f"{'rank':>4} {'layout / method':<20} {'algorithm':<15} {'H':>2} {'payload B':>11} {'compute':>8} "
                 f"{'compress':>9} {'wire':>9} {'coord':>7} {'step ms':>9} {'ex/step':>7} {'ms/(N b)':>9} "
                 f"{'x best':>7} {'to target':>10}")
    best = result["rows"][0]["s_per_global_batch"] if result["rows"] else 1.0
    for n, r in enumerate(result["rows"], 1):
        ttt = r.get("time_to_target_s")
        ttt = "n/a" if r.get("steps_to_target") is None and ttt is None else (
            "not reached" if ttt is None else f"{ttt:.0f} s")
        name = r["method"] if r["layout"] == "data_parallel" else f"{r['method']} ({r['compression']})"
        lines.append(f"{n:>4} {name:<20} {r['algorithm']:<15} {r['delay']:>2} {r['payload_bytes']:>11,} "
                     f"{r['compute_s'] * 1e3:>8.1f} {r['compression_s'] * 1e3:>9.2f} {r['wire_s'] * 1e3:>9.2f} "
                     f"{r['coordination_s'] * 1e3:>7.2f} {r['step_s'] * 1e3:>9.1f} {r['examples_per_step']:>7} "
                     f"{r['s_per_global_batch'] * 1e3:>9.1f} {r['s_per_global_batch'] / best:>7.2f} {ttt:>10}")
    lines.append("(ms; exchange terms divided by the delay H. Ranked by ms per N b examples: the Hourglass "
                 "trains (N - F) b per step. Hourglass rows: compute = the GPipe schedule up to the CONV ranks' last "
                 "backward (perfmodel.pipeline_schedule on the stages measured per micro-batch: trunk, head, "
                 "codecs, boundary wire), exchange columns = the slower role's; the step ends when both roles "
                 "have updated and exchanged. Time to target needs quality curves: --steps-to-target FILE.json)")
    return "\n".join(lines)


def _clamped(info: dict) -> str:
    """A note when the measured step was shorter than the timed stages (noise: the update is 0)."""
    d = info.get("compute_minus_stages_s", 0.0)
    return "" if d >= 0 else (f" (clamped: the compute step is {-d * 1e3:.1f} ms shorter than b (t_conv + t_fc), "
                              f"measurement noise)")


def plan_main(args) -> int:
    """``hgsgc plan CONFIG [overrides] --nodes N --bandwidth B``: print :func:`format_plan`
    (exit 0), or one line naming the bad input (exit 2). ``--steps-to-target`` keys that name
    no row (the method column) are listed in a warning on stderr after the plan (exit 0).

    ``plan`` is one process: it predicts ``--nodes N`` without running on them. Started as
    several processes (``mpirun -np 4 hgsgc plan ...``, ``srun`` inside a multi-task allocation),
    every rank used to measure the same step and write the same ``--json`` file; now rank 0 alone
    plans (with one note on stderr saying so) and the other ranks exit 0 at once, as a launcher
    expects of every process."""
    import json
    import os
    import sys

    from hgsgc import runtime
    from hgsgc.config import ConfigError, load_config

    size = runtime.world_size()
    if size > 1:
        # every rank initialises MPI (a collective start-up under mpirun / srun: a rank 0 that
        # initialised it alone, for Horovod, waited for the others for ever, session 19), then
        # the others leave and rank 0 measures with Horovod on itself alone
        from mpi4py import MPI  # noqa: F401 (MPI_Init on every rank)

        if runtime.world_rank() != 0:
            return 0
        print(f"hgsgc plan: started as {size} processes (mpirun / srun); plan is a single-process "
              f"command (it predicts --nodes without running on them): rank 0 alone measures, prints "
              f"and writes, the other ranks exit", file=sys.stderr)

    try:
        cfg = load_config(args.config, args.overrides)
        if re.fullmatch(r"\s*\d+(\.\d+)?\s*", str(args.bandwidth)):  # read as bit/s: ranks on 1e-05 Mbit/s
            raise ValueError(f"--bandwidth {args.bandwidth} has no unit: write e.g. {args.bandwidth.strip()}gbit "
                             f"or {args.bandwidth.strip()}mbit ({args.bandwidth.strip()}bit if you mean bit/s)")
        rate = pm.parse_rate(args.bandwidth)
        if args.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
        if args.reps < 1:
            raise ValueError(f"--reps must be >= 1 (timed repetitions per measurement), got {args.reps}")
        if args.compute_ms is not None and not (math.isfinite(args.compute_ms) and args.compute_ms > 0):
            raise ValueError(f"--compute-ms must be a number > 0 (ms per step), got {args.compute_ms}; "
                             f"leave it out to measure the step here")
        steps = None
        if args.steps_to_target:
            try:
                f = open(args.steps_to_target)
            except OSError as exc:  # named the file only ('[Errno 2] No such file or directory: ...')
                raise ValueError(f"--steps-to-target {args.steps_to_target}: cannot read it "
                                 f"({exc.strerror or exc}): give a JSON file {{method: steps or null}}") from None
            with f:
                try:
                    steps = json.load(f)
                except ValueError as exc:
                    raise ValueError(f"{args.steps_to_target} is not JSON ({exc}): expected an object "
                                     f"{{method: steps or null}}") from None
            if not isinstance(steps, dict):
                raise ValueError(f"{args.steps_to_target}: expected a JSON object {{method: steps or null}}")
            for k, v in steps.items():
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                      or not math.isfinite(v) or v < 0):
                    raise ValueError(f"{args.steps_to_target}: {k!r}: {v!r} is not a step count: each value "
                                     f"must be a number >= 0 (steps to the target) or null (not reached)")
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise ValueError(f"--json {args.json}: folder {os.path.dirname(os.path.abspath(args.json))} "
                             f"does not exist: create it or write the JSON elsewhere")
    except (ConfigError, ValueError, OSError) as exc:
        print(f"hgsgc plan: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    link = pm.link_for(rate, bidir_factor=1.0 if args.tuned else None)
    try:
        res = plan(cfg, args.nodes, rate, compute_s=None if args.compute_ms is None else args.compute_ms / 1e3,
                   reps=args.reps, link=link, steps_to_target=steps, cycle_s=pm.horovod_cycle_s())
    except ValueError as exc:
        print(f"hgsgc plan: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(format_plan(res))
    if steps:  # a misspelt method (sgc-d4 for sgc_d4) silently gave 'n/a' in every row (brk12)
        names = [r["method"] for r in res["rows"]]
        unknown = [k for k in steps if k not in names]
        if unknown:
            print(f"hgsgc plan: warning: --steps-to-target {args.steps_to_target}: no row is named "
                  f"{', '.join(map(repr, unknown))}, so those steps were not used: the keys are the "
                  f"method column's names ({', '.join(names)})", file=sys.stderr)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        except OSError as exc:
            print(f"hgsgc plan: cannot write --json {args.json}: {exc} (the plan above is complete)",
                  file=sys.stderr)
            return 1
    return 0
