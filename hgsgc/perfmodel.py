"""The one alpha-beta performance model of hgsgc (layouts, exchanges, the benchmarks).

A link moves a message of ``s`` bytes in ``alpha + s / beta`` seconds (``alpha``: seconds per
message, ``beta``: bytes per second). This module holds the formulas every part of hgsgc predicts
with: ``layout: auto`` (``hgsgc/hourglass/auto.py``) measures the inputs at start-up and calls
:func:`choose_layout`, ``hourglass.fc_workers: auto`` and ``hgsgc plan`` call the same
:func:`predict_hourglass` / :func:`predict_data_parallel` / :func:`predict_step`.

What an exchange moves comes from elsewhere, never from expressions of this module: the bytes
and messages of each collective from :mod:`hgsgc.costs` (:func:`hgsgc.costs.exchange_bytes`,
:func:`hgsgc.costs.exchange_messages`, :func:`hgsgc.costs.node_cost`,
:func:`hgsgc.costs.exchange_merges`), the payload and collective of a compression setting from
the setting itself (``setting.payload_bytes(shapes)``, ``setting.algorithm``, and
``setting.collectives(shapes)`` where one exchange issues several collectives).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Tuple

from hgsgc import costs


# ------------------------------------------------------------------------------------------
# Layout choice (``layout: auto``): data parallelism vs the Hourglass layout for each fc_workers.
# Inputs are measured at start-up by hgsgc/hourglass/auto.py; see docs/hourglass.md, "layout: auto".
@dataclass(frozen=True)
class LayoutInputs:
    """Measured inputs of :func:`choose_layout` (seconds, bytes, bytes per second).

    Attributes:
        world_size: ``n`` ranks; batch_size: ``b`` examples per rank (per CONV rank).
        t_conv, t_fc: forward + backward seconds per example of the trunk / the head.
        act_bytes, grad_bytes: boundary bytes per example CONV -> FC (labels included) / FC ->
            CONV with the configured codecs (:func:`hgsgc.hourglass.costmodel.boundary_bytes`);
            codec_s: encode + decode seconds per example (both directions).
        alpha: seconds per message; beta: link bandwidth, bytes per second; bidir_factor: the
            share of ``beta`` each direction keeps in pairwise exchanges (:class:`Link`).
        dp_payload, conv_payload, fc_payload: gradient payload of one exchange (bytes) of the
            whole model (data parallel) / the trunk / the head; *_algorithm: ``ring`` |
            ``allgather`` | ``tree`` | ``node``; delay, fc_delay: communication delays ``H``.
        micro_batches: ``M`` of the GPipe-style pipeline.
        cycle_s: Horovod's cycle time (:func:`coordination_s`; 0: only the negotiation messages).
        dp_compression_s, conv_compression_s, fc_compression_s: compression seconds of one
            exchange (encode, decode, merge) of the whole model / the trunk / the head.
        t_update_conv, t_update_fc: seconds per step of the optimizer update of the trunk's / the
            head's variables (data parallelism updates both).
        conv_fwd_mb_s, conv_bwd_mb_s, fc_call_s, fc_row_s: the Hourglass stages as the
            pipeline runs them (``layout: auto`` measures them, :func:`hgsgc.hourglass.auto.
            measure_pipeline_stages`): seconds of ONE micro-batch's trunk forward / backward
            (``b / M`` examples, the ``M`` micro-batches in one ``tf.function`` with the step's
            graph-to-Python crossings) and the FC rank's work per micro-batch of ``r`` examples
            ``fc_call_s + r fc_row_s`` (the head's forward + backward call with its Python
            around it: concatenation, tensor conversion, splitting ``dA``; codec work excluded).
            All 0 (the default): :func:`pipeline_stages` derives them from ``t_conv``, ``t_fc``
            (backward twice the forward, no per-call cost) for the same :func:`pipeline_schedule`.
        machine_of, machine_cores, cpu_parallelism: the CPU share (:func:`cpu_share`):
            ``machine_of[r]`` the machine (0-based index) of world rank ``r`` (empty: every rank
            on a machine of its own, share 1), ``machine_cores[m]`` the cores machine ``m`` gives
            its ranks, ``cpu_parallelism`` ``u`` the cores one rank keeps busy while it computes
            alone (CPU seconds per wall second, measured). Every time above that is CPU work
            (``t_conv``, ``t_fc``, ``codec_s``, compression, updates) is measured on a rank
            computing ALONE on its machine; the predictions scale it by the share.
        wait_cpu_cores: ``w``, the cores a rank keeps busy while it WAITS (not computing: in
            hgsgc's poll loop or a Horovod collective, Horovod's background thread cycling;
            CPU seconds per wall second, measured by :func:`hgsgc.hourglass.auto.measure_wait_cpu`);
            it loads the machine's cores in :func:`cpu_share` and :func:`pipeline_schedule`.
            0 (the default): waiting ranks use no CPU.
        dp_buckets, conv_buckets, fc_buckets: ``compression.buckets`` (session 8): the payload
            bytes of each allgather of the data-parallel / CONV / FC exchange
            (:func:`allgather_buckets`, summing to the payload), charged as one collective each
            (:func:`exchange_traffic`); empty (the default) or one entry: one collective.
        boundary_msg_s: seconds per boundary message beyond ``alpha + bytes / beta`` and the
            codec's per-example time (session 7): the measured round trip of one micro-batch's
            message each way on the trainer's path minus what the schedule charges for it, halved
            (:func:`hgsgc.hourglass.costmodel.message_cost_s`); added to every boundary message
            of :func:`pipeline_schedule`. 0 (the default): not measured, no such cost.

    Raises:
        ValueError: a ``machine_of`` of the wrong length, a machine without its cores, cores
            <= 0 or ``cpu_parallelism`` <= 0 (names the field).
    """

    world_size: int
    batch_size: int
    t_conv: float
    t_fc: float
    act_bytes: float
    grad_bytes: float
    codec_s: float
    alpha: float
    beta: float
    dp_payload: float
    conv_payload: float
    fc_payload: float
    dp_algorithm: str = "ring"
    conv_algorithm: str = "ring"
    fc_algorithm: str = "ring"
    delay: int = 1
    fc_delay: int = 1
    micro_batches: int = 1
    bidir_factor: float = 1.0
    cycle_s: float = 0.0
    dp_compression_s: float = 0.0
    conv_compression_s: float = 0.0
    fc_compression_s: float = 0.0
    t_update_conv: float = 0.0
    t_update_fc: float = 0.0
    machine_of: Tuple[int, ...] = ()
    machine_cores: Tuple[float, ...] = ()
    cpu_parallelism: float = 1.0
    conv_fwd_mb_s: float = 0.0
    conv_bwd_mb_s: float = 0.0
    fc_call_s: float = 0.0
    fc_row_s: float = 0.0
    wait_cpu_cores: float = 0.0
    boundary_msg_s: float = 0.0
    dp_buckets: Tuple[int, ...] = ()
    conv_buckets: Tuple[int, ...] = ()
    fc_buckets: Tuple[int, ...] = ()

    def __post_init__(self):
        mo, mc = tuple(int(m) for m in self.machine_of), tuple(float(c) for c in self.machine_cores)
        object.__setattr__(self, "machine_of", mo)
        object.__setattr__(self, "machine_cores", mc)
        for name in ("dp_buckets", "conv_buckets", "fc_buckets"):
            v = tuple(int(b) for b in getattr(self, name))
            if any(b < 0 for b in v):
                raise ValueError(f"LayoutInputs.{name}={list(v)} must be payload bytes >= 0 per allgather")
            object.__setattr__(self, name, v)
        if not float(self.cpu_parallelism) > 0:
            raise ValueError(f"LayoutInputs.cpu_parallelism={self.cpu_parallelism!r} must be > 0 "
                             f"(cores a rank keeps busy alone; 1.0 for one thread)")
        if not float(self.wait_cpu_cores) >= 0:
            raise ValueError(f"LayoutInputs.wait_cpu_cores={self.wait_cpu_cores!r} must be >= 0 "
                             f"(cores a waiting rank keeps busy; 0: none)")
        if not float(self.boundary_msg_s) >= 0:
            raise ValueError(f"LayoutInputs.boundary_msg_s={self.boundary_msg_s!r} must be >= 0 "
                             f"(seconds per boundary message; 0: none)")
        if mo:
            if len(mo) != int(self.world_size):
                raise ValueError(f"LayoutInputs.machine_of has {len(mo)} entries for world_size "
                                 f"{self.world_size}: give one machine index per rank (or none)")
            if min(mo) < 0 or max(mo) >= len(mc) or not all(c > 0 for c in mc):
                raise ValueError(f"LayoutInputs.machine_cores={list(mc)} must give > 0 cores for every "
                                 f"machine index in machine_of={list(mo)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def link(self) -> "Link":
        return Link(self.alpha, self.beta, self.bidir_factor)


def algorithm_of(compression) -> str:
    """The setting's collective, ``setting.algorithm``: ``ring`` (dense, PowerSGD), the hierarchy
    (``allgather`` / ``tree`` / ``node``) of top-k / SGC / DGC, ``allgather`` (TernGrad,
    EF-SignSGD).

    Raises:
        TypeError: not a compression setting (:func:`hgsgc.compression.as_compression`).
    """
    from hgsgc.compression import as_compression

    return as_compression(compression).algorithm


def layout_exchange_s(k: int, payload: float, algorithm: str, delay: int, alpha: float, beta: float) -> float:
    """Seconds per step the busiest of ``k`` ranks spends on the wire exchanging ``payload``
    bytes: :func:`exchange_s` on ``Link(alpha, beta)`` divided by the delay ``H`` (one exchange
    every ``H`` steps). ``k <= 1``: 0.
    """
    return exchange_s(k, payload, algorithm, Link(alpha, beta)) / max(1, delay)


def exchange_traffic(algorithm: str, payload: float, delay: int, buckets: Sequence[int] = ()) -> "Traffic":
    """The :class:`Traffic` of one exchange of ``payload`` bytes by ``algorithm``: one collective,
    or with ``compression.buckets`` (``buckets``: :func:`allgather_buckets`' sizes, more than
    one) one collective of ``algorithm`` per bucket."""
    if len(buckets) > 1:
        return Traffic(tuple((algorithm, b) for b in buckets), int(delay))
    return Traffic(((algorithm, payload),), int(delay))


def role_exchange(inp: LayoutInputs, k: int, payload: float, algorithm: str, delay: int,
                  compression_s: float, buckets: Sequence[int] = ()) -> dict:
    """One exchange among ``k`` ranks per step, as :func:`predict_step` charges it (compute 0):
    ``{"compression_s", "wire_s", "coordination_s", "exchange_s"}``, each divided by ``delay``;
    all 0 for ``k <= 1`` (a lone rank exchanges nothing). ``buckets``: :func:`exchange_traffic`."""
    if k <= 1:
        return {"compression_s": 0.0, "wire_s": 0.0, "coordination_s": 0.0, "exchange_s": 0.0}
    p = predict_step(0.0, compression_s, exchange_traffic(algorithm, payload, delay, buckets), k, inp.link,
                     cycle_s=inp.cycle_s)
    return {"compression_s": p["compression_s"], "wire_s": p["wire_s"],
            "coordination_s": p["coordination_s"], "exchange_s": p["step_s"]}


def machine_load(inp: LayoutInputs, busy) -> dict:
    """``{machine m: cores its ranks ask for}`` when the world ranks ``busy`` compute and the
    others wait: ``u |busy on m| + w (k_m - |busy on m|)`` (``u = inp.cpu_parallelism``, ``w =
    inp.wait_cpu_cores``, ``k_m`` the ranks of ``m``), for the machines holding a rank of
    ``busy``; ``{}`` without ``machine_of``."""
    if not inp.machine_of:
        return {}
    b = {int(r) for r in busy}
    out = {}
    for r, m in enumerate(inp.machine_of):
        out.setdefault(m, [0, 0])
        out[m][0 if r in b else 1] += 1
    u, w = float(inp.cpu_parallelism), float(inp.wait_cpu_cores)
    return {m: u * nb + w * nw for m, (nb, nw) in out.items() if nb > 0}


def cpu_share(inp: LayoutInputs, busy) -> float:
    """The factor by which CPU work measured on a rank computing alone grows when the world ranks
    ``busy`` compute at the same time and the others wait:

        share = max(1, max over machines m holding busy ranks of  (u |busy on m| + w |waiting on m|) / P_m)

    (``u = inp.cpu_parallelism``, ``w = inp.wait_cpu_cores``, ``P_m = inp.machine_cores[m]``,
    :func:`machine_load`; 1 without ``machine_of``).
    Assumes: co-located ranks that compute at once split their machine's cores evenly (a fair
    scheduler, work-conserving: ``k`` ranks that each keep ``u`` cores busy alone need ``k u``
    cores), a waiting rank keeps ``w`` cores busy (measured; hgsgc's own poll loop costs about
    1.5 % of a core, Horovod's background thread the rest: docs/hourglass.md, session 6; a
    computing rank's background thread is left out), the ranks of a machine are alike (one ``u``, the median), and
    communication, memory bandwidth and other processes' load are not part of the share (their
    effect is in the measured times). On a cluster with one rank per host (or per GPU with its own
    cores) ``u <= P`` and the share is 1.
    """
    load = machine_load(inp, busy)
    return max([1.0] + [load[m] / inp.machine_cores[m] for m in load])


def cpu_bound_s(inp: LayoutInputs, work_s: dict) -> float:
    """The shortest time in which the ranks' CPU work fits on their machines' cores:
    ``max over machines m of u * sum(work_s[r] for r on m) / P_m``, with ``work_s`` ``{world rank:
    seconds that rank's work takes alone}`` (a rank keeps ``u`` cores busy alone, so its work is
    ``u * seconds`` core-seconds; a machine runs ``P_m`` core-seconds per second). 0 without
    ``machine_of`` (no machine is shared)."""
    if not inp.machine_of:
        return 0.0
    per = {}
    for r, w in work_s.items():
        m = inp.machine_of[int(r)]
        per[m] = per.get(m, 0.0) + float(w)
    return max([0.0] + [inp.cpu_parallelism * w / inp.machine_cores[m] for m, w in per.items()])


def predict_data_parallel(inp: LayoutInputs) -> dict:
    """Data parallelism on ``n`` ranks: :func:`predict_step` with compute
    ``b (t_conv + t_fc) + t_update_conv + t_update_fc`` and the whole model's exchange; every rank
    computes, compresses and updates at the same time, so the CPU work is scaled by
    ``s = cpu_share(all ranks)`` (:func:`cpu_share`; 1 with one rank per machine)::

        T = s (b (t_conv + t_fc) + u_conv + u_fc) + (s c_dp + wire(n, P_dp) + coordination(n)) / H

    Throughput ``n b / T`` examples per second.
    """
    n, b = inp.world_size, inp.batch_size
    s = cpu_share(inp, range(n))
    compute = s * (b * (inp.t_conv + inp.t_fc) + inp.t_update_conv + inp.t_update_fc)
    p = predict_step(compute, s * inp.dp_compression_s,
                     exchange_traffic(inp.dp_algorithm, inp.dp_payload, inp.delay, inp.dp_buckets),
                     n, inp.link, cycle_s=inp.cycle_s)
    t = p["step_s"]
    return {"layout": "data_parallel", "fc_workers": None, "compute_s": compute,
            "compression_s": p["compression_s"], "wire_s": p["wire_s"], "coordination_s": p["coordination_s"],
            "update_s": s * (inp.t_update_conv + inp.t_update_fc), "cpu_share": {"all": s},
            "exchange_s": t - compute, "step_s": t, "examples_per_step": n * b,
            "throughput": n * b / t if t > 0 else float("inf")}


#: Backward / forward seconds of the trunk assumed by :func:`pipeline_stages` where the stages
#: per micro-batch are not measured: the backward of a convolution or dense layer runs two
#: products of the forward's size (the gradients with respect to the input and to the weights),
#: so ``2`` (the usual FLOP count, e.g. Kaplan et al. 2020). ``layout: auto`` measured 1.61 on
#: the AlexNet-style trunk (forward 2.35 + backward 3.78 ms per micro-batch, docs/hourglass.md,
#: session 5): the trunk's first layer needs no input gradient.
BWD_FWD_RATIO = 2.0


def stages_measured(inp: LayoutInputs) -> bool:
    """True when ``inp`` carries the stages per micro-batch (any of ``conv_fwd_mb_s``,
    ``conv_bwd_mb_s``, ``fc_call_s``, ``fc_row_s`` > 0), as ``layout: auto`` and ``hgsgc plan``
    measure them (:func:`hgsgc.hourglass.auto.measure_pipeline_stages`)."""
    return any(float(v) > 0 for v in (inp.conv_fwd_mb_s, inp.conv_bwd_mb_s, inp.fc_call_s, inp.fc_row_s))


def pipeline_stages(inp: LayoutInputs, ratio: float = BWD_FWD_RATIO) -> LayoutInputs:
    """``inp`` with the stages per micro-batch :func:`pipeline_schedule` runs on: unchanged when
    they are measured (:func:`stages_measured`), else derived from the fused per-example times
    ``t_conv``, ``t_fc`` (seconds per example, forward + backward) with ``M = micro_batches``:

        conv_fwd_mb_s = b t_conv / (M (1 + ratio)),   conv_bwd_mb_s = ratio b t_conv / (M (1 + ratio)),
        fc_call_s = 0,                                fc_row_s = t_fc

    Assumptions (the derived stages carry no measurement of them): the trunk's backward takes
    ``ratio`` times its forward (:data:`BWD_FWD_RATIO`, 2), ``M`` passes of ``b / M`` examples
    cost what one fused pass of ``b`` costs (no per-call overhead: session 5 measured the two
    within 1-9 % on the AlexNet-style cell), and the FC rank's work is linear in its rows with
    no fixed cost per call. Then the schedule's trunk stages sum to ``b t_conv`` and its head
    stages to ``m b t_fc`` per step, as in the measured times.

    Raises:
        ValueError: ``ratio`` < 0.
    """
    import dataclasses

    if not float(ratio) >= 0:
        raise ValueError(f"pipeline_stages: backward/forward ratio {ratio!r} must be >= 0")
    if stages_measured(inp):
        return inp
    M, b = max(1, int(inp.micro_batches)), int(inp.batch_size)
    per_mb = b * float(inp.t_conv) / M
    return dataclasses.replace(inp, conv_fwd_mb_s=per_mb / (1.0 + ratio), conv_bwd_mb_s=per_mb * ratio / (1.0 + ratio),
                               fc_call_s=0.0, fc_row_s=float(inp.t_fc))


def predict_hourglass(inp: LayoutInputs, fc_workers: int) -> dict:
    """The Hourglass step with ``F = fc_workers`` FC ranks: the ONE Hourglass prediction of hgsgc
    (``layout: auto``, ``hourglass.fc_workers: auto``, ``Layout(..., "auto", cost=...)``,
    ``hgsgc plan``).

    :func:`pipeline_schedule` (the GPipe-style schedule of ``hgsgc.hourglass.step`` simulated
    task by task, the CPU shared by processor sharing) on :func:`pipeline_stages` ``(inp)`` (the
    stages per micro-batch as measured, or derived from ``t_conv``, ``t_fc`` with the backward
    twice the forward), with each role's update + compression (CPU) and its gradient exchange's
    wire + coordination (:func:`role_exchange` among ``C = n - F`` CONV / ``F`` FC ranks, the
    exchange term of :func:`predict_step`) after its last compute task::

        T(F) = the time both roles are done (every boundary message costs alpha + bytes / beta)

    ``C b / T(F)`` examples per second. The closed form of sessions 3-4 (``S + (M - 1) max(s) +
    max(update + exchange) + 2 M alpha``) is gone: with ``M = 1``, no shared CPU and the CONV
    side's update + exchange the longer, it is this schedule on the derived stages (tested).

    Returns:
        ``{"layout": "hourglass", "fc_workers", "conv_workers", "convs_per_fc", "model":
        "pipeline_schedule", "stages": "measured" | "derived", "schedule" (:func:`pipeline_schedule`),
        "stages_per_micro_batch_s", "cpu_share", "pipeline_s" (end of the CONV ranks' last
        backward), "conv_exchange_s", "fc_exchange_s", "conv_exchange", "fc_exchange",
        "update_conv_s", "update_fc_s", "update_and_exchange_s", "step_s", "examples_per_step",
        "throughput"}`` (seconds, examples per second).

    Raises:
        ValueError: ``fc_workers`` outside ``1 .. n - 1``.
    """
    out = _hourglass_scheduled(pipeline_stages(inp), int(fc_workers))
    out["stages"] = "measured" if stages_measured(inp) else "derived"
    return out


def pipeline_schedule(inp: LayoutInputs, fc_workers: int, conv_post: Tuple[float, float] = (0.0, 0.0),
                      fc_post: Tuple[float, float] = (0.0, 0.0)) -> dict:
    """The Hourglass step as the GPipe-style schedule of ``hgsgc.hourglass.step`` runs it, simulated
    event by event on the stages measured per micro-batch (``inp.conv_fwd_mb_s``,
    ``conv_bwd_mb_s``, ``fc_call_s``, ``fc_row_s``), with the CPU shared by processor sharing.

    ``C = n - F`` CONV ranks (world ranks ``0 .. C-1``, alike, so one stands for all), ``F`` FC
    ranks each serving ``m = ceil(C / F)``; micro-batch ``j`` has ``r_j`` rows (the split of
    :func:`hgsgc.hourglass.costmodel.micro_batch_bounds`). Four resources run their tasks in order:

    * CONV rank (CPU): ``f_1 .. f_M``, then ``g_1 .. g_M``, then ``conv_post``; forward
      ``f_j = conv_fwd_mb_s r_j M / b + r_j c / 4`` (+ encoding), backward
      ``g_j = conv_bwd_mb_s r_j M / b + r_j c / 4`` (+ decoding), ``g_j`` waits for ``o_j``;
    * the FC rank's incoming link: ``i_j = alpha + msg + m r_j act / beta`` after ``f_j``;
    * FC rank (CPU): ``h_j = fc_call_s + m r_j (fc_row_s + c / 2)`` after ``i_j``, then ``fc_post``;
    * the FC rank's outgoing link: ``o_j = alpha + msg + m r_j grad / beta`` after ``h_j``;

    (``msg = boundary_msg_s``, the measured per-message cost, once per direction and micro-batch:
    the ``m`` CONV ranks' messages of one micro-batch are taken to overlap);

    ``conv_post`` / ``fc_post`` = ``(CPU seconds, wait seconds)`` after the role's last compute
    task: the update + compression (CPU), then the exchange's wire + coordination (no CPU). The
    step ends when both roles are done. CPU tasks progress at the rate ``1 / max over machines m
    holding the role's ranks of max(1, (u busy_m + w (k_m - busy_m)) / P_m)``, with ``busy_m`` the ranks of ``m`` whose
    role is in a CPU task at that moment, plus ``w`` cores for each other rank of ``m`` (waiting:
    :func:`machine_load`; the :func:`cpu_share` assumptions: fair, work-conserving); links and
    waits progress at rate 1. Without
    ``machine_of`` every rate is 1 and the step is the longest path of the schedule's
    dependency graph.

    Returns:
        ``{"step_s", "conv_done_s" (end of the last backward), "fc_done_s" (end of the last
        head), "stages_per_micro_batch_s" (micro-batch 0's f, i, h, o, g), "busy_s" {conv, fc:
        CPU seconds of wall time in tasks}, "fc_idle_s" (FC rank's wall time not in a CPU task)}``.

    Raises:
        ValueError: ``fc_workers`` outside ``1 .. n - 1``.
    """
    import numpy as np

    n, b, M, F = int(inp.world_size), int(inp.batch_size), max(1, int(inp.micro_batches)), int(fc_workers)
    if not 1 <= F <= n - 1:
        raise ValueError(f"pipeline_schedule: fc_workers={fc_workers} must be in 1..{n - 1} for {n} ranks")
    C = n - F
    m = -(-C // F)
    edges = np.linspace(0, b, M + 1).astype(int)
    rows = [int(hi - lo) for lo, hi in zip(edges[:-1], edges[1:])]
    c, msg = inp.codec_s, float(inp.boundary_msg_s)
    tasks = {"conv": [], "in": [], "fc": [], "out": []}
    for j, r in enumerate(rows):
        tasks["conv"].append((f"f{j}", "cpu", inp.conv_fwd_mb_s * r * M / b + r * c / 4, None))
        tasks["in"].append((f"i{j}", "wait", inp.alpha + msg + m * r * inp.act_bytes / inp.beta, f"f{j}"))
        tasks["fc"].append((f"h{j}", "cpu", inp.fc_call_s + m * r * (inp.fc_row_s + c / 2), f"i{j}"))
        tasks["out"].append((f"o{j}", "wait", inp.alpha + msg + m * r * inp.grad_bytes / inp.beta, f"h{j}"))
    for j, r in enumerate(rows):
        tasks["conv"].append((f"g{j}", "cpu", inp.conv_bwd_mb_s * r * M / b + r * c / 4, f"o{j}"))
    tasks["conv"] += [("conv_post_cpu", "cpu", float(conv_post[0]), None),
                      ("conv_post_wait", "wait", float(conv_post[1]), None)]
    tasks["fc"] += [("fc_post_cpu", "cpu", float(fc_post[0]), None),
                    ("fc_post_wait", "wait", float(fc_post[1]), None)]
    role_ranks = {"conv": range(C), "fc": range(C, n)}

    def rate(role, cpu_roles):
        if not inp.machine_of:
            return 1.0
        load = machine_load(inp, [r for ro in cpu_roles for r in role_ranks[ro]])
        f = max(max(1.0, load[inp.machine_of[r]] / inp.machine_cores[inp.machine_of[r]])
                for r in role_ranks[role])
        return 1.0 / f

    idx = {a: 0 for a in tasks}
    rem = {a: None for a in tasks}
    done, busy_s, t = {}, {"conv": 0.0, "fc": 0.0}, 0.0
    while any(idx[a] < len(tasks[a]) for a in tasks):
        active = []
        for a, lst in tasks.items():
            if idx[a] < len(lst) and (lst[idx[a]][3] is None or lst[idx[a]][3] in done):
                if rem[a] is None:
                    rem[a] = max(0.0, float(lst[idx[a]][2]))
                active.append(a)
        if not active:  # pragma: no cover - the dependency graph above has no cycle
            raise RuntimeError("pipeline_schedule: no task can run (dependency cycle)")
        cpu_roles = {a for a in active if tasks[a][idx[a]][1] == "cpu"}
        rates = {a: rate(a, cpu_roles) if a in cpu_roles else 1.0 for a in active}
        dt = min(rem[a] / rates[a] for a in active)
        t += dt
        for a in active:
            if a in cpu_roles:
                busy_s[a] += dt
            if rem[a] / rates[a] <= dt * (1 + 1e-12):
                done[tasks[a][idx[a]][0]] = t
                idx[a] += 1
                rem[a] = None
            else:
                rem[a] -= rates[a] * dt
    first = {name[0]: amount for name, _, amount, _ in
             (tasks["conv"][0], tasks["in"][0], tasks["fc"][0], tasks["out"][0], tasks["conv"][M])}
    return {"step_s": t, "conv_done_s": done[f"g{M - 1}"], "fc_done_s": done[f"h{M - 1}"],
            "stages_per_micro_batch_s": {"conv_fwd_s": first["f"], "wire_in_s": first["i"], "fc_s": first["h"],
                                         "wire_out_s": first["o"], "conv_bwd_s": first["g"]},
            "busy_s": busy_s, "fc_idle_s": t - busy_s["fc"]}


def _hourglass_scheduled(inp: LayoutInputs, F: int) -> dict:
    """:func:`predict_hourglass` from the stages measured per micro-batch: :func:`pipeline_schedule`
    with each role's update + compression (CPU, shared) and exchange wire + coordination after
    its last compute task."""
    n, b = inp.world_size, inp.batch_size
    C = n - F
    ex_c = role_exchange(inp, C, inp.conv_payload, inp.conv_algorithm, inp.delay, inp.conv_compression_s,
                         inp.conv_buckets)
    ex_f = role_exchange(inp, F, inp.fc_payload, inp.fc_algorithm, inp.fc_delay, inp.fc_compression_s,
                         inp.fc_buckets)
    sch = pipeline_schedule(
        inp, F, conv_post=(inp.t_update_conv + ex_c["compression_s"], ex_c["wire_s"] + ex_c["coordination_s"]),
        fc_post=(inp.t_update_fc + ex_f["compression_s"], ex_f["wire_s"] + ex_f["coordination_s"]))
    t = sch["step_s"]
    share = {"conv_stage": cpu_share(inp, range(C)), "fc_stage": cpu_share(inp, range(C, n)),
             "all": cpu_share(inp, range(n))}
    return {"layout": "hourglass", "fc_workers": F, "conv_workers": C, "convs_per_fc": -(-C // F),
            "model": "pipeline_schedule", "schedule": sch,
            "stages_per_micro_batch_s": sch["stages_per_micro_batch_s"], "cpu_share": share,
            "pipeline_s": sch["conv_done_s"], "conv_exchange_s": ex_c["exchange_s"],
            "fc_exchange_s": ex_f["exchange_s"], "conv_exchange": ex_c, "fc_exchange": ex_f,
            "update_conv_s": inp.t_update_conv, "update_fc_s": inp.t_update_fc,
            "update_and_exchange_s": t - sch["conv_done_s"], "step_s": t, "examples_per_step": C * b,
            "throughput": C * b / t if t > 0 else float("inf")}


def with_role_compression(inp: LayoutInputs, fc_workers: int, conv_cost: dict, fc_cost: dict) -> LayoutInputs:
    """``inp`` with the compression seconds of the CONV and FC exchanges among ``C = n - F`` /
    ``F`` ranks: ``conv_compression_s = compression_at(conv_cost, C, conv_algorithm)``,
    ``fc_compression_s = compression_at(fc_cost, F, fc_algorithm)`` (:func:`compression_at` of
    :func:`measure_compression_s`'s costs; they grow with the ranks of each exchange). Used by
    ``hgsgc plan`` and ``layout: auto`` alike."""
    import dataclasses

    n = inp.world_size
    return dataclasses.replace(
        inp, conv_compression_s=compression_at(conv_cost, n - fc_workers, inp.conv_algorithm),
        fc_compression_s=compression_at(fc_cost, fc_workers, inp.fc_algorithm))


def choose_layout(inp: LayoutInputs, hourglass_possible: bool = True, inputs_at=None,
                  hourglass_only: bool = False, fc_workers: Optional[int] = None) -> dict:
    """Predict data parallelism and the Hourglass for ``F = 1 .. floor(n/2)`` (only ``F =
    fc_workers`` when given: ``layout: auto`` with an integer ``hourglass.fc_workers``); pick the
    highest throughput (ties: data parallelism, then fewer FC ranks).

    ``inputs_at``: optional ``F -> LayoutInputs`` for the Hourglass candidates (e.g.
    :func:`with_role_compression`, whose compression seconds depend on ``F``); default ``inp``.
    ``hourglass_only`` (``hourglass.fc_workers: auto``): pick among the Hourglass candidates
    only; the data-parallel prediction stays first in ``predictions``, for reference.

    Raises:
        ValueError: ``hourglass_only`` with no Hourglass candidate (``n < 2`` or not possible).

    Returns:
        ``{"layout", "fc_workers", "inputs", "predictions": [...], "choice": the chosen prediction,
        "runner_up": the next-fastest candidate's name ("data_parallel" or "hourglass F=k"; None with
        one candidate), "margin": the choice's predicted throughput / the runner-up's - 1 (>= 0; None
        with one candidate)}``. The margin says how close the call is: a margin smaller than the
        spread of the predictions between launches of the same job (docs/hourglass.md, session 17:
        1.6-1.9x on 4 ranks sharing 2 cores) is a tie, and either layout is then expected within
        about that margin of the other.
    """
    preds = [predict_data_parallel(inp)]
    if hourglass_possible and inp.world_size >= 2:
        fcs = range(1, inp.world_size // 2 + 1) if fc_workers is None else [int(fc_workers)]
        preds += [predict_hourglass(inputs_at(F) if inputs_at else inp, F) for F in fcs]
    candidates = preds[1:] if hourglass_only else preds
    if not candidates:
        raise ValueError(f"no Hourglass layout for {inp.world_size} rank(s): it needs at least 2")
    best = candidates[0]
    for p in candidates[1:]:
        if p["throughput"] > best["throughput"] * (1 + 1e-9):
            best = p
    others = [p for p in candidates if p is not best]
    second = max(others, key=lambda p: p["throughput"]) if others else None
    margin = (best["throughput"] / second["throughput"] - 1.0 if second is not None and second["throughput"] > 0
              else None)
    return {"layout": best["layout"], "fc_workers": best["fc_workers"], "inputs": inp.to_dict(),
            "predictions": preds, "choice": best, "runner_up": prediction_name(second) if second else None,
            "margin": margin}


def prediction_name(p: dict) -> str:
    """``"data_parallel"`` or ``"hourglass F=k"``: a prediction of :func:`choose_layout`'s list."""
    return "data_parallel" if p["layout"] == "data_parallel" else f"hourglass F={p['fc_workers']}"


def format_layout_report(report: dict) -> str:
    """Log lines: the inputs, each prediction, the choice."""
    i = report["inputs"]
    lines = [f"layout auto: n {i['world_size']}, b {i['batch_size']}, t_conv {i['t_conv'] * 1e6:.1f} us/example, "
             f"t_fc {i['t_fc'] * 1e6:.1f} us/example, boundary {i['act_bytes']:.0f} + {i['grad_bytes']:.0f} "
             f"B/example (codec {i['codec_s'] * 1e6:.1f} us/example), link alpha {i['alpha'] * 1e6:.1f} us, "
             f"beta {i['beta'] * 8 / 1e6:.1f} Mbit/s, payload DP {i['dp_payload']:.0f} B ({i['dp_algorithm']}, "
             f"H {i['delay']}), CONV {i['conv_payload']:.0f} B, FC {i['fc_payload']:.0f} B ({i['fc_algorithm']}), "
             f"M {i['micro_batches']}, Horovod cycle {i.get('cycle_s', 0.0) * 1e3:g} ms"]
    if i.get("conv_fwd_mb_s", 0.0) > 0 or i.get("conv_bwd_mb_s", 0.0) > 0:
        lines.append(f"layout auto: Hourglass stages as the pipeline runs them, alone: trunk per micro-batch "
                     f"fwd {i['conv_fwd_mb_s'] * 1e3:.2f} ms + bwd {i['conv_bwd_mb_s'] * 1e3:.2f} ms, FC rank per "
                     f"micro-batch {i['fc_call_s'] * 1e3:.2f} ms + {i['fc_row_s'] * 1e6:.1f} us/example"
                     f", boundary message {i.get('boundary_msg_s', 0.0) * 1e3:.2f} ms (measured beyond alpha, "
                     f"bytes / beta and the codec)")
    if "dp_compression_s" in i:
        mo = i.get("machine_of") or []
        lines.append(f"layout auto: measured alone: compression DP {i['dp_compression_s'] * 1e3:.2f} ms, "
                     f"update trunk {i.get('t_update_conv', 0.0) * 1e3:.2f} ms + head "
                     f"{i.get('t_update_fc', 0.0) * 1e3:.2f} ms; CPU: "
                     + (f"{len(i.get('machine_cores') or [])} machines, cores {list(i.get('machine_cores') or [])}, "
                        f"rank -> machine {list(mo)}, u {i.get('cpu_parallelism', 1.0):.2f} cores/rank"
                        if mo else "one rank per machine (share 1)"))
    for p in report["predictions"]:
        name = "data parallel" if p["layout"] == "data_parallel" else f"hourglass F={p['fc_workers']}"
        sh = ", ".join(f"{k} {v:.2f}" for k, v in (p.get("cpu_share") or {}).items())
        if p["layout"] == "data_parallel":
            parts = (f"compute+update {p['compute_s'] * 1e3:.2f} ms, compression {p['compression_s'] * 1e3:.2f} ms, "
                     f"wire {p['wire_s'] * 1e3:.2f} ms, coordination {p['coordination_s'] * 1e3:.2f} ms")
        else:
            parts = (f"pipeline {p['pipeline_s'] * 1e3:.2f} ms, update+exchange {p['update_and_exchange_s'] * 1e3:.2f} ms "
                     f"(CONV compression {p['conv_exchange']['compression_s'] * 1e3:.2f} ms)")
            if p.get("model") == "pipeline_schedule":
                st = p["stages_per_micro_batch_s"]
                parts += (f"; scheduled per micro-batch: trunk fwd {st['conv_fwd_s'] * 1e3:.2f} + bwd "
                          f"{st['conv_bwd_s'] * 1e3:.2f} ms, head {st['fc_s'] * 1e3:.2f} ms, wire "
                          f"{st['wire_in_s'] * 1e3:.2f} + {st['wire_out_s'] * 1e3:.2f} ms, FC idle "
                          f"{p['schedule']['fc_idle_s'] * 1e3:.2f} ms")
        lines.append(f"  {name}: step {p['step_s'] * 1e3:.2f} ms for {p['examples_per_step']} examples, "
                     f"{p['throughput']:.0f} examples/s ({parts}; CPU share {sh or '1'})")
    c = report["choice"]
    m = report.get("margin")
    why = (f"; predicted {100 * m:.1f} % more examples/s than {report['runner_up'].replace('_', ' ')}"
           if m is not None and report.get("runner_up") else "")
    if report.get("setting") == "fc_workers=auto":
        lines.append(f"hourglass.fc_workers auto -> {c['fc_workers']} FC ranks (the fastest Hourglass candidate{why})")
    else:
        lines.append(f"layout auto -> {report['layout']}" + (f" with {c['fc_workers']} FC ranks" if c["fc_workers"] else "")
                     + (f" ({why[2:]})" if why else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Links, collectives, methods and the data-parallel step with measured compute and compression
# (issue 10). layout_exchange_s above is exchange_s on a Link(alpha, beta) divided by the delay.
#: TCP payload bytes per L2 byte on a 1500-byte-MTU link with TCP timestamps (1448 / 1514); tbf
#: limits L2 bytes, so a rate of R bit/s carries at most R / 8 * 1448 / 1514 payload bytes/s.
FRAME_EFFICIENCY = 1448.0 / 1514.0

#: The emulated cluster (scripts/cluster/), calibrated by scripts/cluster/calibrate_link.py (the
#: fit and its data: docs/benchmarks/link_calibration.json, docs/benchmarks/perfmodel.md):
#: alpha_s: seconds per MPI message round; efficiency: payload rate / nominal rate;
#: bidir_factor: the rate each direction keeps when two ranks send to each other at once under
#: Open MPI 4.1's TCP ``put`` protocol (docs/cluster.md: 46-48 of 95 Mbit/s), 1.0 without it;
#: cycle_s: HOROVOD_CYCLE_TIME as hgsgc sets it (hgsgc/runtime.py).
EMULATOR = {"alpha_s": 250e-6, "efficiency": 0.94, "bidir_factor": 0.5, "cycle_s": 0.001,
            "source": "efficiency and bidir_factor: docs/cluster.md, quiet machine (95 of 100 Mbit/s; "
                      "pairwise 46-48 Mbit/s under put); alpha_s: assumed (TCP through veth + MPI), "
                      "not measured quietly: under load 37-42 a 0-byte round took 9-33 ms "
                      "(docs/benchmarks/link_calibration.json)"}

_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_RATE_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text) -> float:
    """A link rate in bit/s from a tc rate (``10gbit``, ``100mbit``, ``1.5gbit``; ``...bps``
    suffixes are bytes per second, as in tc) or a number of bit/s.

    Raises:
        ValueError: not a positive finite rate (the message shows the accepted forms).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        v = float(text)
    else:
        m = _RATE.fullmatch(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _RATE_UNITS:
            raise ValueError(f"bandwidth {text!r} is not a rate: write e.g. 10gbit, 100mbit, 1.5gbit")
        v = float(m.group(1)) * _RATE_UNITS[unit]
    if not v > 0:
        raise ValueError(f"bandwidth {text!r} must be > 0")
    if not math.isfinite(v):  # '1' and 400 zeros: float() overflows (plan ranked on 'link inf Mbit/s')
        raise ValueError(f"bandwidth {text!r} is not a finite rate: write e.g. 10gbit, 100mbit, 1.5gbit")
    return v


@dataclass(frozen=True)
class Link:
    """A host link under the alpha-beta (Hockney) model: ``m`` bytes take ``alpha_s + m / beta_Bps``.

    Attributes:
        alpha_s: seconds per message (latency + MPI software), >= 0.
        beta_Bps: payload bytes per second, one direction (links are full duplex), > 0.
        bidir_factor: fraction of ``beta_Bps`` each direction keeps when both ends of a
            connection send at once (pairwise exchanges); 1 on a tuned cluster, 0.5 under
            Open MPI 4.1's TCP ``put`` protocol (docs/cluster.md).
        burst_bytes: payload bytes of a token bucket in front of the link, >= 0: 0 for a real
            link (the default, and what ``hgsgc plan`` uses); the emulator's ``tbf`` bucket
            otherwise (:func:`tbf_burst_bytes`, :func:`link_for` ``(tbf=True)``). Bytes the
            bucket holds tokens for leave at once; :meth:`time` ignores it, the collectives of a
            step are charged with it by :func:`exchange_wire_s`.

    Raises:
        ValueError: a value outside those ranges.
    """

    alpha_s: float
    beta_Bps: float
    bidir_factor: float = 1.0
    burst_bytes: float = 0.0

    def __post_init__(self):
        if not (self.alpha_s >= 0 and self.beta_Bps > 0 and 0 < self.bidir_factor <= 1
                and self.burst_bytes >= 0 and math.isfinite(self.burst_bytes)):
            raise ValueError(f"Link needs alpha_s >= 0, beta_Bps > 0, 0 < bidir_factor <= 1 and finite "
                             f"burst_bytes >= 0, got {self}")

    def time(self, nbytes: float, messages: int = 1, pairwise: bool = False) -> float:
        """Seconds for ``messages`` sequential messages carrying ``nbytes`` bytes in all."""
        beta = self.beta_Bps * (self.bidir_factor if pairwise else 1.0)
        return messages * self.alpha_s + nbytes / beta


#: The emulator's tbf bucket (scripts/cluster/cluster.sh ``up``): ``burst = max(rate_Bps / 500,
#: 15140)`` bytes, i.e. 2 ms of the rate and at least 10 full 1514-byte frames, on both ends of
#: every link (the host's egress and the switch port towards the host).
TBF_BURST_DIVISOR = 500
TBF_BURST_MIN_BYTES = 15140


def tbf_burst_bytes(bandwidth) -> int:
    """Bytes (Ethernet frames as tbf counts them) of the bucket ``scripts/cluster/cluster.sh``
    gives a link of ``bandwidth`` (tc rate or bit/s), with cluster.sh's integer arithmetic::

        rate_Bps = int(rate_bit_s / 8);  burst = max(rate_Bps // 500, 15140)

    e.g. 25,000 at 100mbit, 250,000 at 1gbit, 15,140 at 10mbit. Not fitted: the configuration.

    Raises:
        ValueError: ``bandwidth`` not a positive rate (:func:`parse_rate`).
    """
    rate_Bps = int(parse_rate(bandwidth) / 8.0)
    return max(rate_Bps // TBF_BURST_DIVISOR, TBF_BURST_MIN_BYTES)


def link_for(bandwidth, alpha_s: Optional[float] = None, efficiency: Optional[float] = None,
             bidir_factor: Optional[float] = None, calibration: Optional[dict] = None,
             tbf: bool = False) -> Link:
    """The :class:`Link` of a host whose link runs at ``bandwidth`` (tc rate or bit/s):
    ``beta = rate / 8 * efficiency``; unset arguments come from ``calibration`` (default
    :data:`EMULATOR`; for a tuned cluster pass ``bidir_factor=1``).

    ``tbf``: the link is the emulator's (``cluster.sh up --bandwidth``), a token bucket of
    ``burst_bytes = tbf_burst_bytes(bandwidth) * FRAME_EFFICIENCY`` payload bytes (tbf counts
    frame bytes; 1448 of every 1514 are TCP payload: framing only, not the calibrated
    ``efficiency``, which also holds CPU limits, e.g. 0.44 at 1 Gbit/s here); default False: a
    real link, ``burst_bytes = 0``.

    Raises:
        ValueError: ``bandwidth`` not a rate, or a :class:`Link` value out of range.
    """
    cal = EMULATOR if calibration is None else calibration
    eff = cal["efficiency"] if efficiency is None else efficiency
    return Link(alpha_s=cal["alpha_s"] if alpha_s is None else alpha_s,
                beta_Bps=parse_rate(bandwidth) / 8.0 * eff,
                bidir_factor=cal.get("bidir_factor", 1.0) if bidir_factor is None else bidir_factor,
                burst_bytes=tbf_burst_bytes(bandwidth) * FRAME_EFFICIENCY if tbf else 0.0)


ALGORITHMS = costs.ALGORITHMS


def exchange_s(k: int, payload: float, algorithm: str, link: Link, hosts: Optional[Sequence[int]] = None) -> float:
    """Seconds the busiest of ``k`` ranks spends in one collective over ``link``.

    ``ring`` (Horovod's allreduce = ``MPI_Allreduce`` of the ``payload``-byte buffer) and
    ``allgather`` (Horovod's allgather = ``MPI_Allgatherv`` of ``payload`` bytes per rank) are
    charged as Open MPI 4.1 runs them (:func:`hgsgc.costs.ompi_collective_cost`: the algorithm its
    coll/tuned fixed decision picks for ``k`` and the size, traced on this machine's 4.1.4): e.g.
    on 4 ranks a 1 MB allreduce is Rabenseifner's, ``2 log2 k = 4`` messages carrying
    ``2 (k-1)/k P``, and a 25 kB allgatherv is Bruck's, ``ceil(log2 k) = 2`` messages carrying
    ``(k-1) P`` (not the ``2 (k-1)`` and ``k - 1`` steps of the ring schedules). Time:
    ``messages * alpha + bytes / beta'`` with ``beta' = beta * bidir_factor`` for algorithms whose
    steps exchange with one peer in both directions at once (``pairwise``).
    tree (:mod:`hgsgc.hierarchy`, busiest rank) ``r P`` in
    ``r = floor(log2 k) + 2 [k not a power of two]`` pairwise swaps. ``node`` with ``hosts``
    (ranks per host, consecutive): the tree among ``len(hosts)`` leaders over ``link`` plus the
    leader's intra-host share of :func:`hgsgc.costs.node_cost` (``(s-1) P`` in, reduce, and
    ``(s-1) P`` out, broadcast, for the largest host of ``s`` ranks; ``2 (s-1)`` messages) over
    shared memory (1 us, 10 GB/s); without ``hosts``, the tree over ``k``.

    Raises:
        ValueError: unknown algorithm (valid: :data:`hgsgc.costs.ALGORITHMS`).
    """
    if algorithm not in costs.ALGORITHMS:
        raise ValueError(f"unknown exchange algorithm {algorithm!r}: use one of {', '.join(costs.ALGORITHMS)}")
    if k <= 1:
        return 0.0
    if algorithm == "node" and hosts:
        sizes = [int(h) for h in hosts]
        layout, start = [], 0
        for size in sizes:
            layout.append(list(range(start, start + size)))
            start += size
        big = layout[sizes.index(max(sizes))]
        c = costs.node_cost(layout, big[0], payload)
        intra_bytes = (c["bytes_sent"] - c["inter_bytes_sent"]) + (c["bytes_received"] - c["inter_bytes_received"])
        intra = Link(1e-6, 10e9).time(intra_bytes, 2 * (len(big) - 1)) if len(big) > 1 else 0.0
        return intra + exchange_s(len(sizes), payload, "tree", link)
    if algorithm in ("ring", "allgather"):
        c = costs.ompi_collective_cost("allreduce" if algorithm == "ring" else "allgatherv", k, payload)
        return link.time(c["bytes"], c["messages"], pairwise=c["pairwise"])
    return link.time(costs.exchange_bytes(k, payload, algorithm), costs.exchange_messages(k, algorithm),
                     pairwise=True)


def _exchange_parts(k: int, payload: float, algorithm: str, link: Link, hosts=None) -> Tuple[float, float, float]:
    """``(fixed_s, wire_bytes, rate_Bps)`` of one collective over ``link`` such that
    :func:`exchange_s` = ``fixed_s + wire_bytes / rate_Bps`` (``fixed_s``: the messages' alpha
    and, for ``node``, the intra-host share; ``rate_Bps``: beta, times bidir_factor if pairwise)."""
    if algorithm not in costs.ALGORITHMS:
        raise ValueError(f"unknown exchange algorithm {algorithm!r}: use one of {', '.join(costs.ALGORITHMS)}")
    if k <= 1:
        return 0.0, 0.0, link.beta_Bps
    if algorithm == "node" and hosts:
        sizes = [int(h) for h in hosts]
        intra = exchange_s(k, payload, "node", link, hosts) - exchange_s(len(sizes), payload, "tree", link)
        fixed, nbytes, rate = _exchange_parts(len(sizes), payload, "tree", link)
        return intra + fixed, nbytes, rate
    if algorithm in ("ring", "allgather"):
        c = costs.ompi_collective_cost("allreduce" if algorithm == "ring" else "allgatherv", k, payload)
        m, nbytes, pw = c["messages"], c["bytes"], c["pairwise"]
    else:
        m, nbytes, pw = costs.exchange_messages(k, algorithm), costs.exchange_bytes(k, payload, algorithm), True
    return m * link.alpha_s, float(nbytes), link.beta_Bps * (link.bidir_factor if pw else 1.0)


def bucket_at_start_bytes(burst_bytes: float, idle_s: float, refill_Bps: float, exchange_bytes: float) -> float:
    """Payload bytes of tokens in a token bucket when an exchange starts, in the steady state of
    a training where every exchange sends ``exchange_bytes`` and the link then stays idle for
    ``idle_s`` seconds, refilling at ``refill_Bps`` (capped at ``burst_bytes``).

    Assumptions: tokens accrue only while the link is idle (during the transfer the rate's
    tokens are spent at once), none during the exchange's own message latencies (conservative),
    and the bucket is full when training starts. Iterating ``b' = min(burst, max(0, b - S) + I r)``
    (``S`` the exchange's bytes, ``I r`` the refill) from a full bucket converges to::

        b = burst                  if I r >= S    (refills within the step: full at each start)
        b = min(burst, I r)        otherwise      (the exchange empties it; only the refill is left)

    Raises:
        ValueError: a negative or non-finite argument.
    """
    vals = (burst_bytes, idle_s, refill_Bps, exchange_bytes)
    if not all(math.isfinite(v) and v >= 0 for v in vals):
        raise ValueError(f"bucket_at_start_bytes needs finite values >= 0, got burst_bytes={burst_bytes}, "
                         f"idle_s={idle_s}, refill_Bps={refill_Bps}, exchange_bytes={exchange_bytes}")
    if burst_bytes == 0:
        return 0.0
    refill = idle_s * refill_Bps
    return float(burst_bytes) if refill >= exchange_bytes else min(float(burst_bytes), refill)


def exchange_wire_s(k: int, tr: "Traffic", link: Link, hosts: Optional[Sequence[int]] = None,
                    idle_s: float = 0.0) -> float:
    """Seconds the busiest of ``k`` ranks spends in the collectives of one exchange ``tr`` over
    ``link``, with the link's token bucket (:attr:`Link.burst_bytes`).

    ``burst_bytes == 0`` (a real link): ``sum(exchange_s(...))`` over the collectives, exactly.
    Otherwise the bucket starts the exchange with ``b0`` = :func:`bucket_at_start_bytes` ``(burst,
    idle_s, beta, S)`` payload bytes (``S``: the bytes the busiest rank sends in the exchange,
    ``idle_s``: the seconds per exchange its link is idle) and the collectives, in order, spend
    it: a collective of ``m`` messages, ``B`` bytes at rate ``beta'`` (:func:`exchange_s`) takes::

        m alpha + max(0, B - b) / beta',    b <- max(0, b - B)

    (bytes covered by tokens leave at veth speed, charged 0 s; no refill between the messages of
    one exchange). The emulator has a bucket on both ends of a link with the same rate and burst:
    the second passes what the first lets through (the burst at once, the rest at the rate), so
    the pair acts as one.

    Raises:
        ValueError: unknown algorithm, or ``idle_s`` negative.
    """
    if link.burst_bytes == 0:
        return sum(exchange_s(k, b, alg, link, hosts) for alg, b in tr.collectives)
    parts = [_exchange_parts(k, b, alg, link, hosts) for alg, b in tr.collectives]
    avail = bucket_at_start_bytes(link.burst_bytes, float(idle_s), link.beta_Bps, sum(p[1] for p in parts))
    total = 0.0
    for fixed, nbytes, rate in parts:
        free = min(avail, nbytes)
        avail -= free
        total += fixed + (nbytes - free) / rate
    return total


#: Bytes of Horovod's per-cycle negotiation allreduce with the response cache on (its default):
#: the cache bit vector (capacity 1024 -> 16 words) + one word of status flags, 8 bytes a word.
NEGOTIATION_BYTES = 136


def horovod_cycle_s() -> float:
    """Horovod's cycle time in seconds: ``HOROVOD_CYCLE_TIME`` (ms) from the environment, which
    ``hgsgc.runtime.apply_defaults`` sets where unset, else :data:`EMULATOR` ``["cycle_s"]``."""
    import os

    v = os.environ.get("HOROVOD_CYCLE_TIME")
    try:
        return float(v) / 1e3 if v else EMULATOR["cycle_s"]
    except ValueError:
        return EMULATOR["cycle_s"]


def coordination_s(k: int, link: Link, collectives: int, cycle_s: float = EMULATOR["cycle_s"],
                   allgathers: int = 0, overhead_s: Optional[float] = None) -> float:
    """Horovod's time per exchange besides the data (docs/benchmarks/step_profile.md): each
    collective of an exchange (they depend on each other, so each needs its own background cycle)
    waits on average half a cycle (``cycle_s / 2``; Horovod's background loop does not wake up
    when a tensor is enqueued) and one negotiation: the response cache's bit-vector allreduce of
    :data:`NEGOTIATION_BYTES` bytes (``messages * alpha`` of
    :func:`hgsgc.costs.ompi_collective_cost`, e.g. 2 recursive-doubling messages on 4 ranks)::

        coordination = collectives * (cycle_s / 2 + m_neg * alpha)

    No size exchange for an allgather: Horovod takes the sizes from the negotiated response, which
    the response cache keeps while a tensor's shape does not change (hgsgc's payloads have a fixed
    length), so ``allgathers`` is accepted for compatibility and adds nothing.

    ``overhead_s``: a MEASURED per-collective Horovod overhead replaces the formula
    (``coordination = collectives * overhead_s``): one ``hvd.allgather`` minus one ``MPI_Allgather``
    of the same bytes with known sizes (``step_profile.py``'s ``allgather_hvd`` and
    ``allgather_mpi`` phases), i.e. queueing, cycle wait and negotiation as they run on the machine
    (on a loaded machine Horovod's background thread waits for a core at every hop: 48-66 ms per
    collective at load 15-19 here, docs/benchmarks/perfmodel.md). Negative values count as 0.
    """
    if k <= 1:
        return 0.0
    if overhead_s is not None:
        return collectives * max(0.0, float(overhead_s))
    neg = costs.ompi_collective_cost("allreduce", k, NEGOTIATION_BYTES)["messages"]
    return collectives * (cycle_s / 2.0 + neg * link.alpha_s)


@dataclass(frozen=True)
class Traffic:
    """The collectives of one exchange: ``((algorithm, bytes), ...)`` (ring: the allreduce buffer
    per rank; allgather / tree / node: the rank's payload) and ``delay`` (steps per exchange)."""

    collectives: Tuple[Tuple[str, int], ...]
    delay: int = 1

    @property
    def payload_bytes(self) -> int:
        return int(sum(b for _, b in self.collectives))


def traffic(compression, shapes: Sequence[Sequence[int]]) -> Traffic:
    """The collectives :class:`hgsgc.communicator.Exchanger` issues for one exchange of float32
    tensors of ``shapes`` under ``compression`` (an ``hgsgc.Compression`` value), as the setting
    states them: ``setting.collectives(shapes)`` where it issues several (TernGrad: a ring
    allreduce of the 4-byte scales, an allgather of the codes; PowerSGD: two ring allreduces, P
    factors + uncompressed tensors, then Q factors), else one collective
    ``(setting.algorithm, setting.payload_bytes(shapes))`` (dense: ring of ``w d`` bytes, w = 4
    fp32, 2 fp16; top-k / SGC / DGC: its ``hierarchy``; EF-SignSGD: allgather); the delay is
    ``setting.delay``. The bytes always sum to ``setting.payload_bytes(shapes)``.

    ``compression.buckets = B`` (session 8): the sparse allgather is issued as the ``B`` (at most)
    allgathers of :func:`allgather_buckets`, so :func:`predict_step` charges each its own
    coordination (:func:`coordination_s`: half a cycle + the negotiation allreduce) and its own
    collective (:func:`exchange_s`: Open MPI's algorithm for that bucket's size, ``messages *
    alpha`` + its bytes): the fixed per-collective costs ``B`` times, the same payload bytes. The
    overlap of the first buckets with the rest of the backward pass, which is what buckets are
    for, is NOT modelled (measured: it gained nothing on the emulator, docs/benchmarks.md).

    Raises:
        TypeError: not a compression setting (:func:`hgsgc.compression.as_compression`).
    """
    from hgsgc.compression import as_compression

    comp = as_compression(compression)
    shapes = [tuple(int(x) for x in s) for s in shapes]
    several = getattr(comp, "collectives", None)
    colls = several(shapes) if several is not None else ((comp.algorithm, comp.payload_bytes(shapes)),)
    groups = allgather_buckets(comp, shapes)
    if len(groups) > 1:  # compression.buckets: the one allgather entry becomes one per bucket
        colls = tuple(c for c in colls if c[0] != "allgather") + tuple(("allgather", g) for g in groups)
    return Traffic(tuple((str(a), int(b)) for a, b in colls), int(comp.delay))


def allgather_buckets(compression, shapes: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    """Payload bytes of each allgather one exchange of float32 tensors of ``shapes`` issues under
    ``compression.buckets = B`` (top-k / SGC / DGC with ``hierarchy: allgather``), in issue order.

    As :class:`hgsgc.compression.reducers.Allgather` cuts them: the tensors that go to the sparse
    collective (not ``dense_vectors``' rank < 2 ones, not empty), each of
    ``codec.payload_length(numel)`` bytes, grouped by
    :func:`hgsgc.compression.reducers.bucket_indices` ``(sizes, B)`` (last tensors first, at most
    ``B`` groups; the count ``hgsgc.communicator.Exchanger`` charges). The groups sum to the
    sparse payload: bucketing moves the same bytes in more collectives.

    Returns:
        ``()`` for a setting without buckets (dense, PowerSGD, TernGrad, tree / node) or
        ``B = 1``; else one size per allgather (bytes, ints), possibly fewer than ``B``.
    """
    from hgsgc.compression import as_compression

    comp = as_compression(compression)
    B = int(getattr(comp, "buckets", 1) or 1)
    if B <= 1 or getattr(comp, "algorithm", None) != "allgather" or not hasattr(comp, "dense_shape"):
        return ()
    from hgsgc.compression.reducers import bucket_indices

    codec = comp.codec()
    numels = [int(math.prod(int(d) for d in s)) for s in shapes if not comp.dense_shape(s)]
    sizes = [int(codec.payload_length(m)) for m in numels if m > 0]
    return tuple(sum(sizes[i] for i in g) for g in bucket_indices(sizes, B))


def _period_values(compute: Sequence[float], compression: Optional[Sequence[float]], h: int):
    """All equally likely values of one rank's exchange period (``h`` compute draws + one
    compression draw, with replacement) as a flat numpy array, or None when there are more than
    10^6 of them."""
    import numpy as np

    c = np.asarray(compute, dtype=np.float64)
    size = len(c) ** h * (len(compression) if compression is not None and len(compression) else 1)
    if size > 10 ** 6:
        return None
    v = c
    for _ in range(h - 1):
        v = np.add.outer(v, c).ravel()
    if compression is not None and len(compression):
        v = np.add.outer(v, np.asarray(compression, dtype=np.float64)).ravel()
    return v


def expected_max_period(compute_samples: Sequence[Sequence[float]],
                        compression_samples: Optional[Sequence[Sequence[float]]] = None,
                        h: int = 1, draws: int = 200_000, seed: int = 0) -> float:
    """``E[max_r T_r]``: the expected longest exchange period over the ranks, where rank ``r``'s
    period ``T_r`` is the sum of ``h`` independent draws from its measured compute times
    ``compute_samples[r]`` plus one draw from its compression times ``compression_samples[r]``
    (seconds; the empirical distributions, draws with replacement, ranks independent).

    A synchronous exchange starts when the last rank arrives, so a period costs the maximum, not
    the mean, of the ranks' periods (the straggler effect; Dutta et al., AISTATS 2018, "Slow and
    stale gradients can win the race"). Exact (the product of the ranks' empirical CDFs over all
    ``n^h m`` sums) when each rank has at most 10^6 such sums, else a Monte Carlo estimate with
    ``draws`` draws from ``numpy.random.default_rng(seed)`` (deterministic).

    Raises:
        ValueError: no ranks, a rank without samples, ``h < 1``, or compression samples for a
            different number of ranks.
    """
    import numpy as np

    if not compute_samples or any(len(x) == 0 for x in compute_samples) or int(h) < 1:
        raise ValueError("expected_max_period needs >= 1 compute sample per rank and h >= 1")
    if compression_samples is not None and len(compression_samples) != len(compute_samples):
        raise ValueError(f"expected_max_period: compression samples for {len(compression_samples)} ranks, "
                         f"compute samples for {len(compute_samples)}: give both per rank")
    h = int(h)
    comp = compression_samples or [None] * len(compute_samples)
    vals = [_period_values(c, z, h) for c, z in zip(compute_samples, comp)]
    if all(v is not None for v in vals):
        vals = [np.sort(v) for v in vals]
        grid = np.unique(np.concatenate(vals))
        cdf = np.ones_like(grid)
        for v in vals:
            cdf *= np.searchsorted(v, grid, side="right") / len(v)
        prob = np.diff(np.concatenate(([0.0], cdf)))
        return float(np.sum(grid * prob))
    rng = np.random.default_rng(seed)
    best = np.full(draws, -np.inf)
    for c, z in zip(compute_samples, comp):
        c = np.asarray(c, dtype=np.float64)
        t = c[rng.integers(0, len(c), size=(draws, h))].sum(axis=1)
        if z is not None and len(z):
            z = np.asarray(z, dtype=np.float64)
            t = t + z[rng.integers(0, len(z), size=draws)]
        best = np.maximum(best, t)
    return float(best.mean())


def sync_wait_s(compute_samples: Sequence[Sequence[float]],
                compression_samples: Optional[Sequence[Sequence[float]]] = None, h: int = 1, **kw) -> float:
    """Seconds per exchange that ranks wait for the slowest: :func:`expected_max_period` minus the
    ranks' mean period ``h mean(compute) + mean(compression)`` (means over all ranks' samples);
    the ``wait_s`` input of :func:`predict_step`. 0 for identical, constant ranks."""
    import numpy as np

    mean_c = float(np.mean([np.mean(c) for c in compute_samples]))
    mean_z = float(np.mean([np.mean(z) for z in compression_samples])) if compression_samples else 0.0
    return max(0.0, expected_max_period(compute_samples, compression_samples, h, **kw) - (h * mean_c + mean_z))


def predict_step(compute_s: float, compression_s: float, tr: Traffic, k: int, link: Link,
                 hosts: Optional[Sequence[int]] = None, cycle_s: float = EMULATOR["cycle_s"],
                 wait_s: float = 0.0, coordination_overhead_s: Optional[float] = None,
                 link_idle_s: Optional[float] = None) -> dict:
    """Predicted mean seconds per data-parallel step on ``k`` ranks.

    ``step = compute + (compression + wait + sum of the collectives + coordination) / delay``,
    with compute (forward + backward + update) and compression (selection, encoding, decoding and
    summing the ``k`` payloads) measured, ``wait`` the time per exchange the ranks wait for the
    slowest one (:func:`sync_wait_s` from the measured per-rank compute and compression times; 0
    when the ranks are identical and constant), each collective of ``tr`` by
    :func:`exchange_s`, Horovod's coordination by :func:`coordination_s` (with
    ``coordination_overhead_s``: the measured per-collective overhead instead of the formula). No
    overlap of communication with compute (hgsgc exchanges one fused payload after the backward
    pass).

    The collectives are charged by :func:`exchange_wire_s`: with a token-bucket link
    (``link.burst_bytes > 0``, the emulator) the bucket refills while the link is idle, by default
    ``link_idle_s = delay * compute + compression + wait + coordination`` seconds per exchange
    (everything but the collectives); pass ``link_idle_s`` when ``compute_s`` is not the step's
    (e.g. a wire-only prediction with ``compute_s = 0``). Unused when ``burst_bytes == 0``.

    Returns:
        ``{"compute_s", "compression_s", "wait_s", "wire_s", "coordination_s", "step_s"}``, each
        already divided by the delay where it happens once per exchange.
    Raises:
        ValueError: an unknown algorithm in ``tr``, or ``link_idle_s < 0`` on a bucket link.
    """
    h = max(1, int(tr.delay))
    n_ag = sum(1 for alg, _ in tr.collectives if alg == "allgather")
    coord = coordination_s(k, link, len(tr.collectives), cycle_s, n_ag, coordination_overhead_s)
    if link_idle_s is None:
        link_idle_s = max(0.0, h * float(compute_s) + float(compression_s) + float(wait_s) + coord)
    wire = exchange_wire_s(k, tr, link, hosts, link_idle_s)
    out = {"compute_s": float(compute_s), "compression_s": float(compression_s) / h,
           "wait_s": float(wait_s) / h, "wire_s": wire / h, "coordination_s": coord / h}
    out["step_s"] = sum(out.values())
    return out


def time_to_target(steps: Optional[int], step_s: float, evals: int = 0, eval_s: float = 0.0) -> Optional[float]:
    """Seconds to reach a quality target: ``steps * step_s + evals * eval_s``; ``None`` (not
    reached) when ``steps`` is None. ``steps`` comes from a quality-vs-steps curve (which does
    not depend on the network), ``step_s`` from a measurement or :func:`predict_step`."""
    if steps is None:
        return None
    return steps * step_s + evals * eval_s


# ------------------------------------------------------------------------------------------
# Measured inputs (``hgsgc plan``, hgsgc/plan.py, and the benchmark scripts)
def _timed_median(fn, reps: int, warmup: int = 2, clock=None) -> float:
    import time

    clock = clock or time.perf_counter
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def _random_batch(model, batch_size: int, seed: int = 0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    inp = model.inputs[0]
    shape = [batch_size] + [int(d) for d in inp.shape[1:]]
    if inp.dtype.is_integer:
        x = tf.constant(rng.integers(0, 10, shape), dtype=inp.dtype)
    else:
        x = tf.constant(rng.random(shape, dtype=np.float32))
    out = model.outputs[0]
    yshape = [batch_size] + [int(d) for d in out.shape[1:-1]]
    y = tf.constant(rng.integers(0, int(out.shape[-1]), yshape).astype(np.int32))
    return x, y


def measure_compute_s(model, batch_size: int, reps: int = 10, clock=None) -> float:
    """Median seconds of one forward + backward + SGD update of ``model`` on a random batch of
    ``batch_size`` (one process, no communication): the compute term of :func:`predict_step`.
    ``clock``: default wall time (``time.perf_counter``); ``time.process_time`` measures the
    process's CPU time instead (with one TensorFlow thread: the step on a dedicated core, whatever
    else loads the machine)."""
    import tensorflow as tf

    x, y = _random_batch(model, batch_size)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.legacy.SGD(0.01)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return _timed_median(lambda: step().numpy(), reps, clock=clock)


def measure_compression_s(compression, shapes, reps: int = 5, clock=None) -> dict:
    """Measured compression cost of one exchange of float32 tensors of ``shapes``.

    Returns ``{"base_s", "per_payload_s"}``: ``base_s`` = the exchange in a process set of one rank
    (selection / quantisation / factorisation, encoding, decoding the rank's own payload; no
    collective), ``per_payload_s`` = what one more rank's sparse payload costs the exchange
    (:func:`_measure_per_payload_s`: with the allgather the fused decode-and-add kernel the
    exchange runs per payload, with tree / node one decode and two-part merge per tensor; 0 for
    dense, PowerSGD and TernGrad, whose decoding does not grow with the ranks in this model). fp32 dense:
    both 0. fp16 dense (session 11): ``base_s`` = :func:`measure_fp16_cast_s` (the cast to float16
    before Horovod's allreduce and back after, which a world of one skips: ``"alone_s": 0.0``, see
    :func:`compression_at`). The cost of
    an exchange among ``k`` ranks is ``base_s + (k - 1) per_payload_s`` (allgather) or
    ``base_s + rounds * per_payload_s`` (tree / node: one merge per round).
    Needs Horovod initialised (if it is not, ``hvd.init(comm=MPI.COMM_SELF)``: this process
    alone, a world of size 1, also under a launcher). ``clock``:
    as in :func:`measure_compute_s`.
    """
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    from hgsgc.communicator import Exchanger
    from hgsgc.compression import SparseCompression, as_compression

    comp = as_compression(compression)
    if getattr(comp, "kind", None) == "fp16":  # the casts around Horovod's allreduce (none alone)
        return {"base_s": measure_fp16_cast_s(shapes, reps=reps, clock=clock), "per_payload_s": 0.0,
                "alone_s": 0.0}
    if not comp.compressed:  # fp32 dense: Horovod's allreduce, nothing to encode
        return {"base_s": 0.0, "per_payload_s": 0.0}
    if not hvd.is_initialized():  # this process alone: under mpirun / srun hvd.init() on the
        from mpi4py import MPI      # world is collective (hgsgc plan's rank 0 hung in it)

        hvd.init(comm=MPI.COMM_SELF)
    rng = np.random.default_rng(1)
    tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    names = [f"plan_{i}" for i in range(len(shapes))]
    # DGC momentum correction keeps a velocity per tensor; its cost does not depend on the
    # momentum value, so any m in [0, 1) measures it (without one the setting refuses to build)
    ex = Exchanger(comp, momentum=0.9 if getattr(comp, "momentum_correction", False) else None)

    @tf.function
    def once():
        return tf.add_n([tf.reduce_sum(t) for t in ex.exchange(tensors, names)])

    base = _timed_median(lambda: once().numpy(), reps, clock=clock)
    per = 0.0
    if isinstance(comp, SparseCompression):
        per = _measure_per_payload_s(comp, tensors, reps, clock)
    return {"base_s": base, "per_payload_s": per}


#: Rows of the second timing of the allgather's per-payload cost (:func:`_measure_per_payload_s`).
PER_PAYLOAD_ROWS = 9


def _measure_per_payload_s(comp, tensors, reps: int, clock=None) -> float:
    """Median seconds one more rank's payload of every tensor in ``tensors`` costs an exchange of
    the sparse setting ``comp`` (:func:`measure_compression_s`'s ``per_payload_s``), timed on the
    path the exchange itself runs:

    * ``hierarchy="allgather"``: the exchange decodes the gathered ``[n, P]`` buffer with
      ``codec.decode_sum`` (:func:`hgsgc.compression.kernels.decode_accumulate`, one pass per
      row), so one more rank is one more row: timed here as ``decode_sum`` (one op per tensor) of
      ``[1, P]`` and of ``[R, P]`` (``R`` = :data:`PER_PAYLOAD_ROWS`) buffers, row ``r`` holding
      the payloads of every tensor rolled by ``r / R`` of its length (other entries, as other
      ranks'), ``(t_R - t_1) / (R - 1)`` (at least 0), so that the output's allocation and
      zeroing, once per exchange, stays out of the per-row figure (session 14, ``alexnet_small``'s
      shapes at 1 % density: 0.67 ms for 1 row, about 0.12 ms per further row up to 33). Up to
      session 13 this was timed as ``codec.decode`` + ``tf.scatter_nd`` in pure TF (about 20 ops
      per tensor), which the exchange does not run: 1.7-4.5 ms for the same payloads, and most
      of ``layout: auto``'s compression start-up was tracing it.
    * ``"tree"`` / ``"node"``: one merge round as the exchange runs it
      (:func:`hgsgc.hierarchy.merge_received`, every tensor at once since session 14): decode the
      partner's payload and merge it with this rank's (union, sum, top-k, re-encode), the
      partner's payload being the top-k of every tensor rolled by half its length (a union of up
      to ``2 k`` entries).

    ``tensors``: float32 tensors (any shapes). The payloads are the exact top-k of each tensor at
    ``comp.density`` in ``comp.bits`` and ``comp.index_coding``; two warm-up calls, then ``reps``
    timed ones (``clock``: as in :func:`measure_compute_s`).
    """
    import numpy as np
    import tensorflow as tf

    from hgsgc.compression import kernels
    from hgsgc.compression.sparsify import exact_topk, num_selected

    cd = comp.codec()
    items = []  # (payload, indices, values, numel, k) per tensor
    for t in tensors:
        numel = int(np.prod(t.shape))
        k = num_selected(numel, comp.density)
        idx, vals = exact_topk(tf.reshape(t, [-1]), k)
        # the fused kernel's bytes are codec.encode's (one op instead of ~20 run eagerly)
        payload, q = kernels.sparse_encode(idx, vals, numel, comp.bits, index_coding=comp.index_coding)
        items.append((payload, idx, q, numel, k))

    def rolled_payload(t, numel, k, shift):
        """The payload of ``t`` rolled by ``shift`` entries: other indices, as another rank's."""
        pidx, pvals = exact_topk(tf.roll(tf.reshape(t, [-1]), shift, 0), k)
        return kernels.sparse_encode(pidx, pvals, numel, comp.bits, index_coding=comp.index_coding)[0]

    if comp.hierarchy == "allgather":  # TopKCodec: the exchange decodes with decode_sum
        # row r: every tensor rolled by r / R of its length, so each row selects other entries
        # (the payload length depends on numel and k only)
        rows = [tf.concat([it[0] if r == 0 else rolled_payload(t, it[3], it[4], r * it[3] // PER_PAYLOAD_ROWS)
                           for t, it in zip(tensors, items)], 0) for r in range(PER_PAYLOAD_ROWS)]

        def rows_graph(r):
            gathered = tf.stack(rows[:r])  # the buffers of r ranks

            @tf.function(autograph=False)  # plain Python loops: nothing for autograph to convert
            def decode():
                out, off = [], 0
                for payload, _, _, numel, _ in items:
                    out.append(tf.reduce_sum(cd.decode_sum(gathered, numel, off)))
                    off += int(payload.shape[0])
                return tf.add_n(out)
            return decode

        # the slope between 1 and PER_PAYLOAD_ROWS rows: what a row adds, without the output's
        # allocation and zeroing (once per exchange, whatever n: in base_s)
        one, many = rows_graph(1), rows_graph(PER_PAYLOAD_ROWS)
        t_one = _timed_median(lambda: one().numpy(), reps, clock=clock)
        t_many = _timed_median(lambda: many().numpy(), reps, clock=clock)
        return max(0.0, (t_many - t_one) / (PER_PAYLOAD_ROWS - 1))
    # tree / node: one merge round as the exchange runs it, every tensor at once
    from hgsgc import hierarchy

    lay = hierarchy.exchange_layout([(it[3], it[4], int(it[0].shape[0])) for it in items], comp.bits,
                                    comp.index_coding)
    base = np.concatenate([[0], np.cumsum([it[3] for it in items])[:-1]]).astype(np.int64)
    # this rank's aggregate in global indices; the partner's payload: every tensor rolled by half
    # its length, so its k indices differ from this rank's (a union of up to 2 k entries)
    agg = (tf.concat([tf.cast(it[1], tf.int64) + int(b) for it, b in zip(items, base)], 0),
           tf.concat([it[2] for it in items], 0))
    partner = tf.concat([rolled_payload(t, it[3], it[4], it[3] // 2 + 1) for t, it in zip(tensors, items)], 0)

    @tf.function(autograph=False)
    def one_more():
        merged = hierarchy.merge_received(agg, [(partner, "")], lay)
        return tf.reduce_sum(merged[2]) + tf.cast(tf.reduce_sum(merged[1]), tf.float32)

    return _timed_median(lambda: one_more().numpy(), reps, clock=clock)


def measure_update_s(shapes, momentum: float = 0.0, reps: int = 5, clock=None) -> float:
    """Median seconds of one optimizer update of float32 variables of ``shapes``: the
    ``tf.keras.optimizers.legacy.SGD(momentum=momentum).apply_gradients`` hgsgc's runners apply
    (``v <- m v - lr g; w <- w + v``, Sutskever et al. 2013), with fixed random gradients, in one
    ``tf.function`` (two warm-up calls, then ``reps`` timed ones); the ``t_update_*`` inputs of
    :class:`LayoutInputs`. ``clock``: as in :func:`measure_compute_s`. 0 for no variables.

    Raises:
        ValueError: ``momentum`` outside ``[0, 1)``.
    """
    import numpy as np
    import tensorflow as tf

    if not 0.0 <= float(momentum) < 1.0:
        raise ValueError(f"measure_update_s: momentum={momentum!r} must be in [0, 1) (train.momentum)")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if not shapes:
        return 0.0
    rng = np.random.default_rng(2)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    grads = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    opt = tf.keras.optimizers.legacy.SGD(0.01, momentum=float(momentum))

    @tf.function
    def update():
        opt.apply_gradients(zip(grads, variables))
        return tf.add_n([tf.reduce_sum(tf.reshape(v, [-1])[:1]) for v in variables])  # after the update

    return _timed_median(lambda: update().numpy(), reps, clock=clock)


def compression_at(cost: dict, k: int, algorithm: str) -> float:
    """:func:`measure_compression_s`'s cost for an exchange among ``k`` ranks:
    ``base_s + costs.exchange_merges(k, algorithm) * per_payload_s`` (``k - 1`` payloads to decode
    and add; ``ceil(log2 k)`` for tree / node); ``cost["alone_s"]`` instead for ``k <= 1`` where
    the cost says what a world of one runs (fp16: no cast, 0)."""
    if int(k) <= 1 and "alone_s" in cost:
        return float(cost["alone_s"])
    return cost["base_s"] + costs.exchange_merges(k, algorithm) * cost["per_payload_s"]


# ------------------------------------------------------------------------------------------
# The fp16 cast of the dense fp16 allreduce (session 11): a compression cost like the others'.
def _fp16_cast_graph(tensors, n: int):
    """The casts ``hgsgc.compression.reducers.DenseAllreduce.reduce_raw`` runs around Horovod's
    allreduce for fp16 on ``n >= 2`` ranks, with the allreduce left out (its output replaced by its
    input): ``h = cast(cast(x, float32) / n, float16)`` per tensor before, ``cast(h, float32)``
    after. Returns the float32 tensors."""
    import tensorflow as tf

    return [tf.cast(tf.cast(tf.cast(t, tf.float32) / float(n), tf.float16), t.dtype) for t in tensors]


def measure_fp16_cast_s(shapes, reps: int = 5, clock=None, n: int = 2) -> float:
    """Median seconds of the fp16 casts of one exchange of float32 tensors of ``shapes``
    (:func:`_fp16_cast_graph`: divide by ``n``, cast to float16, cast back), all tensors in one
    ``tf.function`` as the training step runs them (two warm-up calls, then ``reps`` timed ones;
    the function returns the cast tensors, so nothing else is timed but the call). ``clock``: as in
    :func:`measure_compute_s`. 0 for no tensors; the call's own overhead (tens of us) is included.

    Raises:
        ValueError: ``n < 2`` (a world of one casts nothing).
    """
    import numpy as np
    import tensorflow as tf

    if int(n) < 2:
        raise ValueError(f"measure_fp16_cast_s: n={n!r} ranks: the fp16 exchange casts only for n >= 2")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    shapes = [s for s in shapes if math.prod(s) > 0]
    if not shapes:
        return 0.0
    rng = np.random.default_rng(3)
    tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]

    @tf.function
    def casts():
        return _fp16_cast_graph(tensors, int(n))

    return _timed_median(casts, reps, clock=clock)


def fp16_cast_s(shapes, cal: dict) -> float:
    """Seconds one rank spends in the fp16 casts of one dense fp16 exchange of float32 tensors of
    ``shapes`` (:func:`_fp16_cast_graph`), from a per-tensor-size calibration ``cal`` =
    ``{"per_tensor_s": a, "per_element_s": b}`` (:func:`fit_fp16_cast`)::

        cast_s = sum over tensors with d = numel > 0 of  (a + b d)

    ``a``: the three ops' fixed cost per tensor (divide, cast to float16, cast back), ``b``: their
    seconds per element (reading 4 + 2 bytes, writing 2 + 4, one division). The call overhead of
    a separate ``tf.function`` (``cal["call_s"]``) is not charged: in training the casts run inside
    the step's graph. A compression cost of the step like the sparse methods' (:func:`predict_step`'s
    ``compression_s``, once per exchange); 0 in a world of one (no cast there).

    Raises:
        ValueError: ``a`` or ``b`` negative or missing.
    """
    a, b = cal.get("per_tensor_s"), cal.get("per_element_s")
    if a is None or b is None or not (float(a) >= 0 and float(b) >= 0):
        raise ValueError(f"fp16_cast_s: cal needs per_tensor_s >= 0 and per_element_s >= 0 (fit_fp16_cast), "
                         f"got per_tensor_s={a!r}, per_element_s={b!r}")
    ds = [math.prod(int(x) for x in s) for s in shapes]
    return sum(float(a) + float(b) * d for d in ds if d > 0)


def fit_fp16_cast(points) -> dict:
    """Least-squares fit of measured fp16 cast calls ``points`` = ``[(m, d, seconds), ...]`` (one
    ``tf.function`` call casting ``m`` tensors of ``d`` elements each, :func:`measure_fp16_cast_s`)
    to ``seconds = c + m a + m d b``: ``{"call_s": c, "per_tensor_s": a, "per_element_s": b,
    "residual_rel": max |fit / measured - 1|}`` (numpy ``lstsq`` on the rows divided by the measured
    seconds, i.e. least squares of the RELATIVE residuals, so calls of microseconds and of
    milliseconds weigh alike; ``c`` the call's overhead, not charged by :func:`fp16_cast_s`; a
    negative ``a`` or ``c`` is kept as fitted and reported).

    Raises:
        ValueError: fewer than 3 points, or all points with the same ``m`` (``c`` and ``a`` then
            cannot be told apart).
    """
    import numpy as np

    pts = [(int(m), int(d), float(t)) for m, d, t in points]
    if len(pts) < 3 or len({m for m, _, _ in pts}) < 2:
        raise ValueError(f"fit_fp16_cast needs >= 3 points with >= 2 different tensor counts m, got {pts}")
    A = np.array([[1.0, m, m * d] for m, d, _ in pts])
    y = np.array([t for _, _, t in pts])
    if not np.all(y > 0):
        raise ValueError(f"fit_fp16_cast needs measured seconds > 0, got {pts}")
    (c, a, b), *_ = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)
    fit = A @ np.array([c, a, b])
    return {"call_s": float(c), "per_tensor_s": float(a), "per_element_s": float(b),
            "residual_rel": float(np.max(np.abs(fit / y - 1.0)))}
