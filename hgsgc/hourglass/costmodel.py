"""``hourglass.fc_workers: auto``: how many FC ranks, by the project's one performance model.

``hgsgc train`` with ``hourglass.fc_workers: auto`` measures and predicts as ``layout: auto``
does (:func:`hgsgc.hourglass.auto.choose` with ``hourglass_only=True``: compression, updates,
CPU share and the stages per micro-batch, then :func:`hgsgc.perfmodel.pipeline_schedule`). This
module keeps the lower-level path of :class:`~hgsgc.hourglass.layout.Layout` ``(comm, "auto",
cost=...)`` called directly (:func:`hgsgc.perfmodel.predict_hourglass`, the same schedule, on
:class:`CostInputs`: the stages per micro-batch as given in them, else derived from ``t_conv``,
``t_fc`` by :func:`hgsgc.perfmodel.pipeline_stages`; :func:`measure_costs` measures them with
``max_convs_per_fc``; no compression, update or CPU share), and the pieces both paths share (the
link probe, boundary bytes, codecs, :func:`measure_pipeline_stages`).

Inputs (:class:`CostInputs`), measured on every rank and reduced to per-field medians:

* ``t_conv``, ``t_fc``: seconds per example of the trunk's and of the head's forward + backward
  pass (head: with the loss and the gradient with respect to the activations), timed on this
  machine with the configured per-rank batch ``b`` (:func:`stage_passes`, :func:`median_seconds`);
* ``act_bytes``: bytes per example CONV -> FC (the activations encoded by the configured
  ``hourglass.act_codec`` + an int32 label, 4), ``grad_bytes``: bytes per example FC -> CONV (the
  activation gradients encoded by ``hourglass.grad_codec``), both from :func:`boundary_bytes`, the
  codecs' exact payload lengths, which ``layout: auto`` uses too (``hourglass.wire_dtype`` is
  only the default codec: :func:`configured_codecs`); ``codec_s``: encode + decode seconds per
  example of both directions (:func:`codec_seconds`, also ``layout: auto``'s);
* ``conv_payload`` / ``fc_payload``: gradient payload of one exchange among CONV / FC ranks
  (``setting.payload_bytes``), with ``conv_exchange`` / ``fc_exchange`` the setting's collective
  (``setting.algorithm``) and ``conv_delay`` / ``fc_delay`` the communication delays ``H``;
* ``alpha`` (seconds per message) and ``bandwidth`` (``beta``, bytes per second) of the link:
  :func:`link_inputs`, by default the short point-to-point ping-pong :func:`probe_link` between
  rank 0 and every other rank (the slowest pair counts), the ONE link probe of ``fc_workers:
  auto`` and ``layout: auto``; ``hourglass.link_bandwidth_mbps`` (default null) is only an
  explicit override (no probe; ``beta = mbps * 1e6 / 8``, ``alpha = 0``);
  ``micro_batches``: ``hourglass.micro_batches``; ``cycle_s``: Horovod's cycle time;
* ``boundary_msg_s`` (session 7): seconds per boundary message that the link and codec terms do
  not cover, from round trips of one micro-batch's message on the trainer's path
  (:func:`probe_boundary`, :func:`message_cost_s`).

The prediction for each ``F`` in ``1 .. floor(n / 2)`` is :func:`hgsgc.perfmodel.predict_hourglass`
(the GPipe-style pipeline of trunk, boundary and head, then the slower of the two roles'
gradient exchanges; docs/hourglass.md) on :func:`layout_inputs` ``(inp, n)``: the same function
``layout: auto`` and ``hgsgc plan`` predict the Hourglass with. The highest throughput ``C b /
T(F)`` wins (ties go to fewer FC ranks).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, List, Optional, Tuple

from hgsgc.costs import exchange_bytes  # noqa: F401 (re-exported; the one module of cost formulas)

#: Bytes of one example's int32 label, sent CONV -> FC with its activations.
LABEL_BYTES = 4


def micro_batch_bounds(batch_size: int, micro_batches: int = 1) -> List[Tuple[int, int]]:
    """``[(lo, hi)]``: the example ranges of the ``M`` micro-batches of a CONV rank's batch of
    ``batch_size`` (``linspace(0, b, M + 1)`` rounded down; the Hourglass step sends one boundary
    message per range)."""
    import numpy as np

    edges = np.linspace(0, int(batch_size), int(micro_batches) + 1).astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]


def configured_codecs(hourglass_cfg):
    """The two boundary codecs a config runs with: ``hourglass.act_codec`` / ``grad_codec``, each
    defaulting to ``hourglass.wire_dtype``'s (``fp16`` for float16, else ``fp32``), as
    :class:`hgsgc.hourglass.step.HourglassTrainer` resolves them.

    Returns:
        ``(act, grad)`` :class:`~hgsgc.hourglass.boundary.BoundaryCodec` s.

    Raises:
        BoundaryCodecError: an unknown spec or an impossible pair (:func:`check_pair`).
    """
    from hgsgc.hourglass.boundary import check_pair

    default = "fp16" if str(getattr(hourglass_cfg, "wire_dtype", "float32")) == "float16" else "fp32"
    return check_pair(getattr(hourglass_cfg, "act_codec", None) or default,
                      getattr(hourglass_cfg, "grad_codec", None) or default)


def boundary_bytes(act_codec, grad_codec, nonzero, micro_batches: int = 1) -> Tuple[float, float]:
    """Boundary bytes per example of one CONV rank's batch under the two codecs: the ONE formula
    of ``fc_workers: auto``, ``layout: auto`` and ``hgsgc plan``.

    The batch goes as ``M`` messages (:func:`micro_batch_bounds`); message ``j`` of ``r_j`` rows,
    ``f`` features and ``nnz_j`` non-zero activations costs ``act.length(r_j, f, nnz_j) + 4 r_j``
    CONV -> FC (the codec's exact payload, :meth:`BoundaryCodec.length`, plus int32 labels) and
    ``grad.length(r_j, f, nnz_j, masked=True)`` FC -> CONV; the sums over ``j`` divided by ``b``.
    Dense codecs do not depend on ``nnz``; the quantizers' ``4 f`` scales are paid per message.

    Args:
        act_codec, grad_codec: :class:`~hgsgc.hourglass.boundary.BoundaryCodec` s or specs.
        nonzero: bool ``[b, f]`` (or any array, read as ``!= 0``): which activations of a
            representative batch are non-zero (only sparse codecs read it).
        micro_batches: ``M``, 1 .. b.

    Returns:
        ``(act_bytes, grad_bytes)`` per example (floats).

    Raises:
        ValueError: ``nonzero`` is not 2-D with at least one row, or ``M`` outside 1 .. b.
    """
    import numpy as np

    from hgsgc.hourglass.boundary import BoundaryCodec

    ac, gc = BoundaryCodec.parse(act_codec), BoundaryCodec.parse(grad_codec)
    nz = np.asarray(nonzero)
    if nz.ndim != 2 or nz.shape[0] < 1:
        raise ValueError(f"boundary_bytes needs the [batch, features] activations, got shape {nz.shape}")
    b, f = nz.shape
    if not 1 <= int(micro_batches) <= b:
        raise ValueError(f"micro_batches={micro_batches} must be in 1..{b} (the batch size)")
    act = grad = 0
    for lo, hi in micro_batch_bounds(b, micro_batches):
        nnz = int(np.count_nonzero(nz[lo:hi]))
        act += ac.length(hi - lo, f, nnz) + LABEL_BYTES * (hi - lo)
        grad += gc.length(hi - lo, f, nnz, masked=True)
    return act / b, grad / b


@dataclass(frozen=True)
class CostInputs:
    """Measured and derived inputs of ``fc_workers: auto`` (see the module docstring; seconds,
    bytes, bytes per second). ``conv_fwd_mb_s``, ``conv_bwd_mb_s``, ``fc_call_s``, ``fc_row_s``:
    the stages per micro-batch (:class:`hgsgc.perfmodel.LayoutInputs`, measured by
    :func:`hgsgc.hourglass.auto.measure_pipeline_stages`); all 0 (the default): derived from
    ``t_conv``, ``t_fc`` (:func:`hgsgc.perfmodel.pipeline_stages`). ``boundary_msg_s``: seconds
    per boundary message beyond the link and codec terms (:func:`message_cost_s` of a
    :func:`probe_boundary`; ``Layout(..., boundary=...)`` sets it; 0: none)."""

    t_conv: float
    t_fc: float
    batch_size: int
    act_bytes: float
    grad_bytes: float
    conv_payload: float
    fc_payload: float
    bandwidth: float
    conv_exchange: str = "ring"
    fc_exchange: str = "ring"
    conv_delay: int = 1
    fc_delay: int = 1
    codec_s: float = 0.0
    micro_batches: int = 1
    cycle_s: float = 0.0
    alpha: float = 0.0
    conv_fwd_mb_s: float = 0.0
    conv_bwd_mb_s: float = 0.0
    fc_call_s: float = 0.0
    fc_row_s: float = 0.0
    boundary_msg_s: float = 0.0

    @staticmethod
    def median(items: List["CostInputs"]) -> "CostInputs":
        """Per-field median of several ranks' measurements (sizes are identical anyway)."""
        vals = {}
        for f in fields(CostInputs):
            xs = sorted(getattr(i, f.name) for i in items)
            v = xs[len(xs) // 2]
            vals[f.name] = v
        return CostInputs(**vals)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------
# The link: ONE probe for ``fc_workers: auto`` and ``layout: auto`` (docs/hourglass.md).
#: Size of the latency probe's message (one float64) and of the bandwidth probe's (1 MiB).
PROBE_SMALL_BYTES = 8
PROBE_BIG_BYTES = 1 << 20


def _ping_pong(comm, first: bool, other: int, sizes, tag: int) -> list:
    """The blocking ping-pong of one pair of ranks (the probes below): for each ``(buf, reps)`` of
    ``sizes``, one untimed round trip (it warms the connection up) then ``reps`` (>= 1) timed
    ones; ``first`` sends first, ``other`` is the peer's rank in ``comm``. Returns, per size, the
    median one-way time in seconds (half a round trip, ``time.perf_counter``)."""
    import numpy as np

    res = []
    for buf, reps in sizes:
        ts = []
        for _ in range(max(1, int(reps)) + 1):
            t0 = time.perf_counter()
            if first:
                comm.Send(buf, dest=other, tag=tag)
                comm.Recv(buf, source=other, tag=tag)
            else:
                comm.Recv(buf, source=other, tag=tag)
                comm.Send(buf, dest=other, tag=tag)
            ts.append((time.perf_counter() - t0) / 2)
        res.append(float(np.median(ts[1:])))
    return res


def probe_link(comm, small_reps: int = 20, big_bytes: int = PROBE_BIG_BYTES, big_reps: int = 3) -> dict:
    """Measure ``alpha`` and ``beta`` of the links from rank 0 to every other rank of ``comm``
    by blocking ping-pong (``MPI Send``/``Recv``, tag 77); collective over ``comm``.

    For each peer in turn (a ``Barrier`` between pairs, so one pair uses the network at a
    time): one untimed round trip to warm the connection up, then ``small_reps`` round trips of
    an 8-byte message and ``big_reps`` of a ``big_bytes`` message; the one-way time of a round is
    half its wall time (``time.perf_counter``). With ``t_s``, ``t_b`` the medians of the small and
    the big rounds, the pair's ``alpha = t_s`` (seconds per message) and
    ``beta = big_bytes / (t_b - t_s)`` (bytes per second; the alpha-beta model ``t = alpha +
    s / beta``, Hockney 1994). The slowest link bounds a step, so the result is the largest
    ``alpha`` and the smallest ``beta`` over the pairs.

    Args:
        comm: an mpi4py communicator with at least 2 ranks.
        small_reps, big_reps: timed round trips per message size (>= 1).
        big_bytes: size of the bandwidth message in bytes (default 1 MiB).

    Returns:
        On every rank: ``{"alpha_s": float seconds, "beta_Bps": float bytes/s, "pairs":
        [[peer rank, alpha_s, beta_Bps], ...]}`` (``n - 1`` pairs).

    Raises:
        ValueError: fewer than 2 ranks (identically on every rank, before any message).
    """
    import numpy as np

    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        raise ValueError(f"probe_link needs at least 2 ranks, got {n}: there is no link to measure")
    small = np.zeros(PROBE_SMALL_BYTES // 8, np.float64)
    big = np.zeros(int(big_bytes), np.uint8)
    pairs = []
    for peer in range(1, n):
        comm.Barrier()
        if rank not in (0, peer):
            continue
        other = peer if rank == 0 else 0
        res = _ping_pong(comm, rank == 0, other, ((small, small_reps), (big, big_reps)), tag=77)
        if rank == 0:
            a = res[0]
            pairs.append([peer, a, int(big_bytes) / max(res[1] - a, 1e-9)])
    pairs = comm.bcast(pairs, root=0)
    return {"alpha_s": max(p[1] for p in pairs), "beta_Bps": min(p[2] for p in pairs),
            "pairs": pairs}


def pair_rounds(n: int) -> list:
    """The rounds of :func:`probe_link_pairs` for ``n`` ranks: round 1 pairs ``(0, 1), (2, 3),
    ...`` (every rank in exactly one pair, so every rank's link is measured once and no two pairs
    share a rank); with ``n`` odd, round 2 is ``[(0, n - 1)]`` for the rank left over.

    Returns:
        ``[[(a, b), ...], ...]`` (a list of rounds; ``[]`` for ``n < 2``).
    """
    n = int(n)
    if n < 2:
        return []
    rounds = [[(a, a + 1) for a in range(0, n - 1, 2)]]
    if n % 2:
        rounds.append([(0, n - 1)])
    return rounds


def probe_link_pairs(comm, small_reps: int = 20, big_bytes: int = PROBE_BIG_BYTES, big_reps: int = 3) -> dict:
    """:func:`probe_link`'s ping-pong (the same messages, repetitions, medians and alpha-beta
    fit per pair), but on DISJOINT pairs at once (:func:`pair_rounds`: ``(0, 1), (2, 3), ...``
    in one round, plus ``(0, n - 1)`` when ``n`` is odd) instead of rank 0 with every other rank
    in turn; collective over ``comm``. ``layout: auto`` uses it since session 12: with one rank
    per host every host's link is still measured (each pair's round trip crosses both its
    hosts' links), in 1 or 2 rounds instead of ``n - 1``. The pairs of a round share no rank, so
    on a switched network (and on the emulator of ``scripts/cluster/``, which shapes each host's
    own link) they do not share a link; they do share a machine's CPU where ranks share one (the
    emulator), as all ranks do in training. The slowest pair counts: the largest ``alpha``, the
    smallest ``beta``.

    Each pair: one untimed round trip per size, then ``small_reps`` round trips of 8 bytes
    (``t_s``, median one-way) and ``big_reps`` of ``big_bytes`` (``t_b``); ``alpha = t_s``,
    ``beta = big_bytes / (t_b - t_s)``. Precision: the 1 MiB message takes 84 ms one way at
    100 Mbit/s, so the emulator's 25 kB token bucket (``hgsgc.perfmodel.tbf_burst_bytes``) biases
    ``beta`` up by at most 2.4 %; the median of 3 ignores one disturbed round trip.

    Args:
        comm: an mpi4py communicator with at least 2 ranks.
        small_reps, big_reps: timed round trips per message size (>= 1); big_bytes: bytes.

    Returns:
        On every rank: ``{"alpha_s", "beta_Bps", "pairs": [[rank a, rank b, alpha_s, beta_Bps],
        ...], "scheme": "disjoint pairs at once", "rounds": number of rounds, "bytes_sent_per_rank":
        [bytes of probe messages each rank sent, by formula: (small_reps + 1) x 8 + (big_reps + 1)
        x big_bytes per pair it is in]}``.

    Raises:
        ValueError: fewer than 2 ranks (identically on every rank, before any message).
    """
    import numpy as np

    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        raise ValueError(f"probe_link_pairs needs at least 2 ranks, got {n}: there is no link to measure")
    small = np.zeros(PROBE_SMALL_BYTES // 8, np.float64)
    big = np.zeros(int(big_bytes), np.uint8)
    per_pair = (max(1, int(small_reps)) + 1) * PROBE_SMALL_BYTES + (max(1, int(big_reps)) + 1) * int(big_bytes)
    rounds = pair_rounds(n)
    mine = []
    sent = [0] * n
    for pairs in rounds:
        comm.Barrier()
        for a, b in pairs:
            sent[a] += per_pair
            sent[b] += per_pair
        pair = next(((a, b) for a, b in pairs if rank in (a, b)), None)
        if pair is None:
            continue
        first = rank == pair[0]
        other = pair[1] if first else pair[0]
        res = _ping_pong(comm, first, other, ((small, small_reps), (big, big_reps)), tag=78)
        if first:
            mine.append([pair[0], pair[1], res[0], int(big_bytes) / max(res[1] - res[0], 1e-9)])
    found = sorted((p for ps in comm.allgather(mine) for p in ps), key=lambda p: (p[0], p[1]))
    return {"alpha_s": max(p[2] for p in found), "beta_Bps": min(p[3] for p in found), "pairs": found,
            "scheme": "disjoint pairs at once", "rounds": len(rounds), "bytes_sent_per_rank": sent}


def probe_link_bytes_per_rank(n: int, small_reps: int = 20, big_bytes: int = PROBE_BIG_BYTES,
                              big_reps: int = 3) -> list:
    """Bytes each rank sends in :func:`probe_link` (rank 0 with every other rank, each side
    ``(small_reps + 1) x 8 + (big_reps + 1) x big_bytes`` per pair): rank 0 ``n - 1`` pairs, the
    others 1. A list of ``n`` ints."""
    per_pair = (max(1, int(small_reps)) + 1) * PROBE_SMALL_BYTES + (max(1, int(big_reps)) + 1) * int(big_bytes)
    return [per_pair * (int(n) - 1)] + [per_pair] * (int(n) - 1) if int(n) >= 2 else [0] * max(0, int(n))


def link_inputs(comm, link_bandwidth_mbps: Optional[float] = None,
                probe: Optional[Callable] = None) -> dict:
    """The link of the cost model: the probe, or the config's explicit override.

    ``link_bandwidth_mbps`` None (``hourglass.link_bandwidth_mbps: null``, the default): run
    ``probe(comm)`` (default :func:`probe_link`; collective over ``comm``). A number (Mbit/s,
    > 0): no probe, ``beta = mbps * 1e6 / 8`` bytes per second and ``alpha = 0`` (the override
    for reproducible choices or a link the probe cannot see; nothing collective happens).

    Returns:
        ``{"source": "probe" | "config", "alpha_s": seconds per message, "beta_Bps": bytes per
        second, "pairs": [[peer, alpha_s, beta_Bps], ...] (probe; [] for config),
        "probe_bytes": [8, 1 MiB] (probe only)}``, identical on every rank.

    Raises:
        ValueError: ``link_bandwidth_mbps`` not > 0 (names the setting), or the probe's errors.
    """
    if link_bandwidth_mbps is not None:
        if not float(link_bandwidth_mbps) > 0:
            raise ValueError(f"hourglass.link_bandwidth_mbps={link_bandwidth_mbps!r} must be > 0 "
                             f"(or null: probe the link)")
        return {"source": "config", "alpha_s": 0.0, "beta_Bps": float(link_bandwidth_mbps) * 1e6 / 8.0,
                "pairs": []}
    out = dict((probe or probe_link)(comm))
    out.setdefault("probe_bytes", [PROBE_SMALL_BYTES, PROBE_BIG_BYTES])
    return {"source": "probe", **out}


def with_link(inp: CostInputs, link: dict) -> CostInputs:
    """``inp`` with ``alpha = link["alpha_s"]`` and ``bandwidth = link["beta_Bps"]``."""
    import dataclasses

    return dataclasses.replace(inp, alpha=float(link["alpha_s"]), bandwidth=float(link["beta_Bps"]))


def describe_link(link: dict) -> str:
    """One phrase saying where the link figures came from (for the log lines)."""
    if link.get("source") == "config":
        return "hourglass.link_bandwidth_mbps override, no probe"
    if link.get("scheme") == "disjoint pairs at once":
        return (f"ping-pong probe on {len(link.get('pairs') or [])} disjoint pairs at once "
                f"({link.get('rounds')} round{'s' if link.get('rounds') != 1 else ''}), slowest pair")
    return f"ping-pong probe rank 0 <-> {len(link.get('pairs') or [])} ranks, slowest pair"


# ------------------------------------------------------------------------------------------
# The boundary message: what one micro-batch's exchange costs beyond the model's link and codec
# terms, measured on the path the pipeline runs (session 7; docs/hourglass.md).
#: Timed round trips per pair of :func:`probe_boundary` (after one untimed warm-up round trip).
BOUNDARY_PROBE_REPS = 10
#: MPI tags of the probe (apart from the link probe's 77 and the trainer's tags).
_TAG_PROBE_ACT, _TAG_PROBE_LABEL, _TAG_PROBE_GRAD = 81, 82, 83


def boundary_sample(split, x, micro_batches: int = 1):
    """One micro-batch of the boundary as the pipeline sends it: the trunk's activations of the
    first ``r = b / M`` examples of ``x`` (``micro_batch_bounds(b, M)[0]``, initial weights,
    ``training=False``) and the head's activation gradients for them (sum of sparse
    cross-entropy, labels ``0 .. classes-1`` from seed 0).

    Args:
        split: :class:`~hgsgc.hourglass.split.SplitModel`; x: one batch ``[b, ...]`` float32.
        micro_batches: ``M``, 1 .. b.

    Returns:
        ``(a, g, y)``: float32 ``[r, f]``, float32 ``[r, f]`` (flattened features), int32 ``[r]``.

    Raises:
        ValueError: ``M`` outside 1 .. b.
    """
    import numpy as np
    import tensorflow as tf

    b = len(x)
    if not 1 <= int(micro_batches) <= b:
        raise ValueError(f"micro_batches={micro_batches} must be in 1..{b} (the batch size)")
    lo, hi = micro_batch_bounds(b, micro_batches)[0]
    a = split.trunk(tf.constant(np.asarray(x[lo:hi], np.float32)), training=False)
    n_out = int(split.head.outputs[0].shape[-1])
    y = np.random.default_rng(0).integers(0, n_out, hi - lo).astype(np.int32)
    _, fc_pass = stage_passes(split)
    g = fc_pass(a, tf.constant(y))[-1]
    r = hi - lo
    return (np.ascontiguousarray(a.numpy().reshape(r, -1), np.float32),
            np.ascontiguousarray(np.asarray(g).reshape(r, -1), np.float32), y)


def probe_boundary(comm, act_codec, grad_codec, a, g, y, reps: int = BOUNDARY_PROBE_REPS,
                   timeout_s: float = 60.0) -> dict:
    """Time round trips of ONE boundary message each way on the path
    :class:`~hgsgc.hourglass.step.HourglassTrainer` runs; collective over ``comm``.

    One round trip, timed on the CONV side (``time.perf_counter``) from before the encode to
    after the decode: CONV encodes ``a`` with ``act_codec``, ``Isend`` s it and the labels ``y``
    and posts the ``Irecv`` of the gradients (as ``_conv_send``); the FC side posts its two
    ``Irecv``, waits in :func:`hgsgc.faults.wait_for_peers` (the trainer's poll loop), decodes,
    encodes ``g`` with ``grad_codec`` (masked by the decoded activations' pattern when sparse),
    ``Isend`` s it and waits (as ``_fc_step`` for one CONV rank, without the head); the CONV side
    waits in ``wait_for_peers`` and decodes (as ``_conv_recv``). With ``n >= 2`` ranks: rank 0
    is the CONV side and every other rank in turn the FC side (a ``Barrier`` between pairs, as
    :func:`probe_link`); with ``n = 1`` (``MPI.COMM_SELF``, ``hgsgc plan``): both sides in this
    process in turn (loopback: the software path, no link). One untimed round trip, then
    ``reps`` timed ones; the median counts.

    Args:
        comm: an mpi4py communicator. act_codec, grad_codec: codecs or specs.
        a, g: float32 ``[r, f]`` activations and activation gradients of one micro-batch
            (:func:`boundary_sample`); y: int32 ``[r]`` labels.
        reps: timed round trips per pair (>= 1). timeout_s: stall deadline of each wait.

    Returns:
        On every rank: ``{"rows": r, "pairs": [[peer, median round trip seconds], ...]
        ([[0, s]] for the loopback), "loopback": bool, "reps": reps, "bytes_sent_per_rank":
        [payload bytes each rank sent, warm-up round trips included; [0] for the loopback]}``.

    Raises:
        ValueError: ``a``, ``g`` not the same 2-D shape with >= 1 row, ``y`` not ``[r]``, or
            ``reps`` < 1 (identically on every rank, before any message).
        hgsgc.faults.StallError: a peer did not answer within ``timeout_s``.
    """
    import numpy as np

    from hgsgc.faults import wait_for_peers
    from hgsgc.hourglass.boundary import BoundaryCodec

    a, g, y = np.asarray(a, np.float32), np.asarray(g, np.float32), np.asarray(y, np.int32)
    if a.ndim != 2 or a.shape != g.shape or a.shape[0] < 1 or y.shape != (a.shape[0],):
        raise ValueError(f"probe_boundary needs a, g float32 [r, f] of one shape and y [r], got "
                         f"{a.shape}, {g.shape}, {y.shape}")
    if int(reps) < 1:
        raise ValueError(f"probe_boundary: reps={reps} must be >= 1")
    ac, gc = BoundaryCodec.parse(act_codec), BoundaryCodec.parse(grad_codec)
    rank, n = comm.Get_rank(), comm.Get_size()
    r, f = a.shape
    rng = np.random.default_rng(0)

    def conv_send(fc):
        payload = ac.encode(a, rng)
        mask = (a != 0) if gc.sparse else None
        nnz = int(np.count_nonzero(mask)) if mask is not None else None
        g_buf = np.empty(gc.length(r, f, nnz, masked=True), np.uint8)
        reqs = [comm.Isend(payload, dest=fc, tag=_TAG_PROBE_ACT), comm.Isend(y, dest=fc, tag=_TAG_PROBE_LABEL),
                comm.Irecv(g_buf, source=fc, tag=_TAG_PROBE_GRAD)]
        return reqs, payload, g_buf, mask

    def conv_recv(fc, state):
        reqs, _, g_buf, mask = state
        wait_for_peers(reqs, [fc] * 3, "boundary probe: activation gradients", timeout_s)
        return gc.decode(g_buf, r, f, mask=mask)[0]

    def fc_side(conv):
        from mpi4py import MPI

        p = np.empty(ac.max_length(r, f), np.uint8)
        yy = np.empty(r, np.int32)
        reqs = [comm.Irecv(p, source=conv, tag=_TAG_PROBE_ACT), comm.Irecv(yy, source=conv, tag=_TAG_PROBE_LABEL)]
        st = [MPI.Status(), MPI.Status()]
        wait_for_peers(reqs, [conv, conv], "boundary probe: activations", timeout_s, st)
        _, mask = ac.decode(p[:st[0].Get_count(MPI.BYTE)], r, f)
        out = gc.encode(g, rng, mask=mask if gc.sparse else None)
        wait_for_peers([comm.Isend(out, dest=conv, tag=_TAG_PROBE_GRAD)], [conv], "boundary probe: send", timeout_s)
        return int(out.nbytes)

    pairs = []
    if n == 1:
        ts = []
        for _ in range(int(reps) + 1):
            t0 = time.perf_counter()
            state = conv_send(0)
            fc_side(0)
            conv_recv(0, state)
            ts.append(time.perf_counter() - t0)
        pairs.append([0, float(np.median(ts[1:]))])
        sent = [0]  # loopback: nothing crosses a link
    else:
        mine = 0  # payload bytes this rank sent (activations + labels, or gradients)
        for peer in range(1, n):
            comm.Barrier()
            if rank == 0:
                ts = []
                for _ in range(int(reps) + 1):  # the first round trip warms the path up
                    t0 = time.perf_counter()
                    state = conv_send(peer)
                    mine += int(state[1].nbytes) + int(y.nbytes)
                    conv_recv(peer, state)
                    ts.append(time.perf_counter() - t0)
                pairs.append([peer, float(np.median(ts[1:]))])
            elif rank == peer:
                for _ in range(int(reps) + 1):
                    mine += fc_side(0)
        gathered = comm.allgather((pairs, mine))
        pairs, sent = gathered[0][0], [int(m) for _, m in gathered]
    return {"rows": int(r), "pairs": pairs, "loopback": n == 1, "reps": int(reps), "bytes_sent_per_rank": sent}


def message_cost_s(round_trip_s: float, rows: int, act_bytes: float, grad_bytes: float, codec_s: float,
                   alpha: float, beta: float) -> float:
    """Seconds per boundary message that the schedule does not charge otherwise: the measured
    round trip of one message each way (:func:`probe_boundary`, ``r = rows``) minus what
    :func:`hgsgc.perfmodel.pipeline_schedule` charges for it with one CONV rank per FC rank and
    no compute, halved, floored at 0::

        msg_s = max(0, (round_trip_s - 2 alpha - r (act_bytes + grad_bytes) / beta - r codec_s) / 2)

    (the schedule's ``f_j``, ``g_j`` carry ``r c / 4`` each and ``h_j`` ``r c / 2`` of codec work,
    its links ``alpha + r act / beta`` and ``alpha + r grad / beta``), so that the schedule with
    ``boundary_msg_s = msg_s`` on such a round trip reproduces the measured one when it is not
    floored: Python around MPI (buffers, ``Isend`` / ``Irecv``, ``Status``), the poll loop's
    wake-up latency, the codecs' fixed cost per call, anything of the link not in ``alpha``.

    Args:
        round_trip_s: seconds; rows: ``r`` (>= 1); act_bytes, grad_bytes: bytes per example
            (:func:`boundary_bytes`); codec_s: encode + decode seconds per example, both
            directions; alpha: seconds; beta: bytes per second (``inf``: no wire term, the
            loopback of ``hgsgc plan``).

    Raises:
        ValueError: ``rows`` < 1, ``beta`` <= 0, or a negative time or size.
    """
    if int(rows) < 1 or not float(beta) > 0:
        raise ValueError(f"message_cost_s: rows={rows!r} must be >= 1 and beta={beta!r} > 0 (bytes/s)")
    if min(float(round_trip_s), float(act_bytes), float(grad_bytes), float(codec_s), float(alpha)) < 0:
        raise ValueError("message_cost_s: round trip, bytes, codec seconds and alpha must be >= 0")
    r = int(rows)
    modelled = 2.0 * float(alpha) + r * (float(act_bytes) + float(grad_bytes)) / float(beta) + r * float(codec_s)
    return max(0.0, (float(round_trip_s) - modelled) / 2.0)


def boundary_message_inputs(probe: dict, act_bytes: float, grad_bytes: float, codec_s: float,
                            alpha: float, beta: float) -> dict:
    """:func:`message_cost_s` of every pair of a :func:`probe_boundary` result on the model's
    link (``alpha`` seconds, ``beta`` bytes per second, as :func:`link_inputs` gives them, or
    ``beta = inf`` for a loopback); the largest counts (the slowest pair bounds a step, as in
    :func:`probe_link`).

    Returns:
        ``{"boundary_msg_s": float seconds, "per_pair": [[peer, round trip s, msg_s], ...],
        "rows", "loopback", "reps", "formula"}``.
    """
    per = [[int(p), float(rt), message_cost_s(rt, probe["rows"], act_bytes, grad_bytes, codec_s, alpha, beta)]
           for p, rt in probe["pairs"]]
    return {"boundary_msg_s": max(m for _, _, m in per), "per_pair": per, "rows": probe["rows"],
            "loopback": bool(probe["loopback"]), "reps": probe["reps"],
            "formula": "max(0, (round_trip - 2 alpha - r (act + grad) / beta - r codec_s) / 2)"}

def layout_inputs(inp: CostInputs, world_size: int):
    """``inp`` as :class:`hgsgc.perfmodel.LayoutInputs` for ``world_size`` ranks (``alpha`` and
    ``beta = bandwidth`` of the link, :func:`with_link`; the stages per micro-batch as given, 0
    for derived; no data-parallel candidate, so ``dp_payload`` is the sum of the two payloads)."""
    from hgsgc import perfmodel

    return perfmodel.LayoutInputs(
        world_size=int(world_size), batch_size=inp.batch_size, t_conv=inp.t_conv, t_fc=inp.t_fc,
        act_bytes=inp.act_bytes, grad_bytes=inp.grad_bytes, codec_s=inp.codec_s, alpha=inp.alpha,
        beta=inp.bandwidth, dp_payload=inp.conv_payload + inp.fc_payload, conv_payload=inp.conv_payload,
        fc_payload=inp.fc_payload, dp_algorithm=inp.conv_exchange, conv_algorithm=inp.conv_exchange,
        fc_algorithm=inp.fc_exchange, delay=int(inp.conv_delay), fc_delay=int(inp.fc_delay),
        micro_batches=int(inp.micro_batches), cycle_s=inp.cycle_s, conv_fwd_mb_s=inp.conv_fwd_mb_s,
        conv_bwd_mb_s=inp.conv_bwd_mb_s, fc_call_s=inp.fc_call_s, fc_row_s=inp.fc_row_s,
        boundary_msg_s=inp.boundary_msg_s)


def stage_times(inp: CostInputs, world_size: int, fc_workers: int) -> dict:
    """The prediction for one ``F``: :func:`hgsgc.perfmodel.predict_hourglass` of
    :func:`layout_inputs`, with ``T_step_s`` its step time (seconds) and ``throughput``
    (examples per second)."""
    from hgsgc import perfmodel

    p = perfmodel.predict_hourglass(layout_inputs(inp, world_size), fc_workers)
    return {**p, "T_step_s": p["step_s"]}


def choose_fc_workers(inp: CostInputs, world_size: int) -> dict:
    """Pick ``F`` with the highest predicted throughput (ties: fewer FC ranks).

    Returns:
        ``{"fc_workers": F, "inputs": {...}, "candidates": [stage_times for each F]}``.

    Raises:
        ValueError: ``world_size < 2``, or no link (``inp.bandwidth <= 0``: call
            :func:`with_link` with :func:`link_inputs` first).
    """
    if world_size < 2:
        raise ValueError(f"the Hourglass layout needs at least 2 ranks, got {world_size}")
    if not inp.bandwidth > 0:
        raise ValueError(f"fc_workers=auto: link bandwidth {inp.bandwidth!r} B/s: probe the link "
                         f"(costmodel.link_inputs) or set hourglass.link_bandwidth_mbps > 0")
    cands = [stage_times(inp, world_size, F) for F in range(1, world_size // 2 + 1)]
    best = cands[0]
    for c in cands[1:]:
        if c["throughput"] > best["throughput"] * (1 + 1e-9):
            best = c
    return {"fc_workers": best["fc_workers"], "inputs": inp.to_dict(), "candidates": cands}


def format_report(report: dict) -> str:
    """Log lines: the inputs (with the link and where it came from), each ``F``'s predicted step
    (pipeline + exchanges), the choice."""
    i = report["inputs"]
    link = report.get("link") or {}
    lines = [
        f"hourglass cost model (perfmodel.predict_hourglass): t_conv {i['t_conv'] * 1e6:.1f} us/example, "
        f"t_fc {i['t_fc'] * 1e6:.1f} us/example, batch {i['batch_size']}, "
        f"activations {i['act_bytes']:.0f} + gradients {i['grad_bytes']:.0f} B/example "
        f"(codec {i.get('codec_s', 0.0) * 1e6:.1f} us/example), M {i.get('micro_batches', 1)}, "
        f"CONV payload {i['conv_payload']:.0f} B ({i['conv_exchange']}, delay {i['conv_delay']}), "
        f"FC payload {i['fc_payload']:.0f} B ({i['fc_exchange']}, delay {i.get('fc_delay', 1)}), "
        f"link alpha {i.get('alpha', 0.0) * 1e6:.1f} us, beta {i['bandwidth'] * 8 / 1e6:.1f} Mbit/s "
        f"({describe_link(link) if link else 'given'}), boundary message "
        f"{i.get('boundary_msg_s', 0.0) * 1e3:.2f} ms" + (" (probed)" if report.get("boundary_message") else "")]
    for c in report["candidates"]:
        lines.append(f"  F={c['fc_workers']} C={c['conv_workers']} (<= {c['convs_per_fc']} per FC): "
                     f"pipeline {c['pipeline_s'] * 1e3:.2f} ms, CONV exchange {c['conv_exchange_s'] * 1e3:.2f} ms, "
                     f"FC exchange {c['fc_exchange_s'] * 1e3:.2f} ms, step {c['step_s'] * 1e3:.2f} ms "
                     f"({c.get('stages', 'measured')} stages per micro-batch), "
                     f"{c['throughput']:.0f} examples/s")
    lines.append(f"hourglass cost model: fc_workers=auto -> {report['fc_workers']} FC ranks")
    return "\n".join(lines)


def payload_bytes(compression, shapes) -> int:
    """Payload of one exchange of float32 tensors of ``shapes`` under ``compression`` (bytes)."""
    from hgsgc.compression.codec import exchange_payload_bytes

    return exchange_payload_bytes(compression, shapes)



def stage_passes(split):
    """The two stages the cost models time, as ``tf.function`` s of ``split``'s models.

    ``conv_pass(x)``: trunk forward + backward with unit output gradients (x float32
    ``[b, ...input]``), returns the trunk's gradients; ``fc_pass(a, y)``: head forward, summed
    sparse cross-entropy of int32 labels ``y`` ``[b]`` and backward (a float32
    ``[b, ...boundary]``), returns the head's gradients followed by the activation gradient.
    """
    import tensorflow as tf

    trunk, head = split.trunk, split.head

    @tf.function
    def conv_pass(x):
        with tf.GradientTape() as tape:
            out = trunk(x, training=True)
        return tape.gradient(out, trunk.trainable_variables, output_gradients=tf.ones_like(out))

    @tf.function
    def fc_pass(a, y):
        with tf.GradientTape() as tape:
            tape.watch(a)
            loss = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(
                y, head(a, training=True), from_logits=True))
        return tape.gradient(loss, head.trainable_variables + [a])

    return conv_pass, fc_pass


def codec_seconds(act_codec, grad_codec, a, g, repeats: int = 3) -> float:
    """Encode + decode seconds per example of one batch through both boundary codecs: the
    activations ``a`` (float32 ``[b, f]``) CONV -> FC, then the activation gradients ``g`` (same
    shape) FC -> CONV (masked by the activations' pattern for sparse gradient codecs). One
    warm-up round, then the median of ``repeats`` timed rounds, divided by ``b``."""
    import numpy as np

    from hgsgc.hourglass.boundary import BoundaryCodec

    ac, gc = BoundaryCodec.parse(act_codec), BoundaryCodec.parse(grad_codec)
    b, f = a.shape
    rng = np.random.default_rng(0)

    def codec_round():
        pa = ac.encode(a, rng)
        _, mask = ac.decode(pa, b, f)
        pg = gc.encode(g, rng, mask=mask if gc.sparse else None)
        gc.decode(pg, b, f, mask=mask if gc.sparse else None)

    codec_round()
    ts = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        codec_round()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] / b


def cpu_per_wall(fn, args, repeats: int = 3) -> float:
    """Cores ``fn(*args)`` keeps busy: this process's CPU seconds (``time.process_time``, all its
    threads) over wall seconds (``time.perf_counter``) of ``repeats`` calls (call it after a
    warm-up; each call waits for its first output's value). The ``u`` of
    :func:`hgsgc.perfmodel.cpu_share`; with one TensorFlow thread about 1, with ``T`` intra-op
    threads at most ``T``; lower when other processes take the cores (then the CPU seconds, not
    the wall seconds, are what the share scales)."""
    import tensorflow as tf

    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(max(1, repeats)):
        out = fn(*args)
        float(tf.reduce_sum(out[0]))
    wall = time.perf_counter() - t0
    return (time.process_time() - c0) / wall if wall > 0 else 1.0


#: Where the machine identity of :func:`find_machines` is read (Linux: one value per boot of a kernel).
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def find_machines(comm, boot_id_path: str = BOOT_ID_PATH) -> dict:
    """Which ranks of ``comm`` share a machine's cores, and how many cores each machine has;
    collective over ``comm``.

    Ranks are on one machine when they report the same kernel boot id (``boot_id_path``): ranks
    in network namespaces or containers of one machine (the emulated cluster of
    ``scripts/cluster/``, whose "hosts" Open MPI sees as separate nodes) share one kernel and its
    cores. Where the boot id cannot be read, MPI's shared-memory split
    (``MPI_Comm_split_type(COMM_TYPE_SHARED)``, what Horovod's ``local_size`` counts) decides. A
    machine's cores are the union of its ranks' CPU affinity masks (``os.sched_getaffinity``;
    ``os.cpu_count()`` where there is none; cgroup CPU quotas are not seen).

    Returns:
        On every rank: ``{"machine_of": [machine index of each rank] (machines numbered in the
        order of their lowest rank), "machine_cores": [cores of each machine], "how": "boot_id"
        | "MPI shared split" (per rank), "rank_cores": [affinity size of each rank]}``.
    """
    import os

    from mpi4py import MPI

    rank = comm.Get_rank()
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    leader = shared.allreduce(rank, op=MPI.MIN)
    shared.Free()
    try:
        with open(boot_id_path) as f:
            key, how = "boot:" + f.read().strip(), "boot_id"
    except OSError:
        key, how = f"shared:{leader}", "MPI shared split"
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:  # pragma: no cover - not Linux
        cores = list(range(os.cpu_count() or 1))
    allk = comm.allgather((key, cores, how))
    index, union = {}, []
    machine_of = []
    for k, c, _ in allk:
        if k not in index:
            index[k] = len(union)
            union.append(set())
        union[index[k]].update(c)
        machine_of.append(index[k])
    return {"machine_of": machine_of, "machine_cores": [float(len(u)) for u in union],
            "how": [h for _, _, h in allk], "rank_cores": [len(c) for _, c, _ in allk]}


def take_turns(comm, machine_of, fn, timeout_s: float = 3600.0):
    """Run ``fn()`` on every rank of ``comm``, one rank of each machine at a time (ranks of
    different machines at once), so that each measures ALONE on its machine's cores; collective.

    Turn ``t`` runs ``fn`` on the ``t``-th rank (in rank order) of every machine, then every rank
    waits at an ``Ibarrier`` polled with short sleeps (:func:`hgsgc.faults.wait_for_peers`, so
    the waiting ranks leave the cores to the measuring one). An exception in ``fn`` is caught
    and returned, never left to hang the others.

    Returns:
        ``(fn's result or None, error text or None)`` on this rank.

    Raises:
        hgsgc.faults.StallError: a turn took longer than ``timeout_s`` seconds.
    """
    from hgsgc.faults import wait_for_peers

    rank = comm.Get_rank()
    mine = [r for r, m in enumerate(machine_of) if m == machine_of[rank]]
    turns = max(sum(1 for x in machine_of if x == m) for m in set(machine_of))
    result, err = None, None
    for t in range(turns):
        if t == mine.index(rank):
            try:
                result = fn()
            except Exception as exc:  # reported on every rank by the caller
                err = f"rank {rank}: {type(exc).__name__}: {exc}"
        wait_for_peers([comm.Ibarrier()], None, f"layout=auto measurement turn {t + 1} of {turns}",
                       timeout_s, max_pause_s=5e-3)
    return result, err


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall time in seconds of ``repeats`` calls of ``fn(*args)`` after one untimed
    warm-up call (graph tracing); each call waits for its first output's value."""
    import tensorflow as tf

    fn(*args)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        float(tf.reduce_sum(out[0]))  # wait for the result
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]

def measure_costs(split, batch_size: int, conv_compression, fc_compression,
                  link_bandwidth_mbps: Optional[float] = None, repeats: int = 3, act_codec="fp32",
                  grad_codec="fp32", micro_batches: int = 1, cycle_s: float = 0.0,
                  max_convs_per_fc: Optional[int] = None) -> CostInputs:
    """Time the trunk and the head on random data on this rank and build :class:`CostInputs`.

    The link is not measured here (the probe is collective, this runs on one rank):
    ``link_bandwidth_mbps`` None (default) leaves ``bandwidth = alpha = 0``, to be filled by
    :func:`with_link` (:class:`~hgsgc.hourglass.layout.Layout` does, with :func:`link_inputs`);
    a number sets ``bandwidth = mbps * 1e6 / 8`` B/s and ``alpha = 0``.

    ``act_codec`` / ``grad_codec``: the configured boundary codecs (:func:`configured_codecs`);
    ``act_bytes`` / ``grad_bytes`` are :func:`boundary_bytes` of the trunk's activations of the
    random batch (initial weights) in ``micro_batches`` messages, ``codec_s`` their
    :func:`codec_seconds`; ``cycle_s``: Horovod's cycle time (seconds).

    ``max_convs_per_fc`` (``n - 1`` for ``n`` ranks): also measure the stages per micro-batch on
    the random batch (:func:`measure_pipeline_stages`, as ``layout: auto`` and ``hgsgc plan`` do),
    so that :func:`hgsgc.perfmodel.predict_hourglass` schedules the measured stages; None (the
    default): leave them 0, derived from ``t_conv``, ``t_fc``
    (:func:`hgsgc.perfmodel.pipeline_stages`).

    One warm-up call (graph tracing) per stage, then the median of ``repeats`` timed calls.
    """
    import numpy as np
    import tensorflow as tf

    from hgsgc.compression import as_compression

    trunk, head = split.trunk, split.head
    in_shape = tuple(int(s) for s in trunk.inputs[0].shape[1:])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch_size,) + in_shape, dtype=np.float32))
    a = trunk(x, training=False)
    n_out = int(head.outputs[0].shape[-1])
    y = tf.constant(rng.integers(0, n_out, batch_size).astype(np.int32))

    conv_pass, fc_pass = stage_passes(split)

    t_conv = median_seconds(conv_pass, (x,), repeats) / batch_size
    t_fc = median_seconds(fc_pass, (a, y), repeats) / batch_size
    a2 = a.numpy().reshape(batch_size, -1)
    g2 = fc_pass(a, y)[-1].numpy().reshape(batch_size, -1)
    act_bytes, grad_bytes = boundary_bytes(act_codec, grad_codec, a2 != 0, micro_batches)
    cc, fcc = as_compression(conv_compression), as_compression(fc_compression)
    stages = {}
    if max_convs_per_fc is not None:
        stages = measure_pipeline_stages(split, x.numpy(), int(micro_batches), int(max_convs_per_fc), repeats)
    return CostInputs(
        t_conv=t_conv, t_fc=t_fc, batch_size=batch_size,
        act_bytes=act_bytes, grad_bytes=grad_bytes,
        conv_payload=float(payload_bytes(cc, [tuple(v.shape) for v in trunk.trainable_variables])),
        fc_payload=float(payload_bytes(fcc, [tuple(v.shape) for v in head.trainable_variables])),
        bandwidth=float(link_bandwidth_mbps) * 1e6 / 8.0 if link_bandwidth_mbps is not None else 0.0,
        conv_exchange=_algorithm(cc), fc_exchange=_algorithm(fcc), conv_delay=int(cc.delay),
        fc_delay=int(fcc.delay), codec_s=codec_seconds(act_codec, grad_codec, a2, g2, repeats),
        micro_batches=int(micro_batches), cycle_s=float(cycle_s), **stages)


#: The most CONV ranks' micro-batches :func:`measure_pipeline_stages` concatenates for its FC fit.
FC_FIT_MAX_CONVS = 64


def measure_pipeline_stages(split, x: np.ndarray, micro_batches: int, max_convs_per_fc: int,
                            repeats: int = 3) -> dict:
    """This rank's Hourglass stages as the pipeline of :class:`~hgsgc.hourglass.step.HourglassTrainer`
    runs them, without communication (inputs of :func:`hgsgc.perfmodel.pipeline_schedule`).

    CONV side: one ``tf.function`` built like the trainer's CONV step, on the micro-batches of
    :func:`~hgsgc.hourglass.costmodel.micro_batch_bounds` ``(b, M)``: every micro-batch's trunk
    forward under one persistent tape, each followed by a ``tf.numpy_function`` crossing (the
    send's place), then every micro-batch's backward with fixed activation gradients fetched by a
    ``tf.numpy_function`` (the receive's place) and the gradients summed; and the same function
    with the forwards only, called in adjacent pairs (forwards-only, then whole) so that both see
    the same load: ``conv_fwd_mb_s`` = median forwards-only time / ``M``, ``conv_bwd_mb_s`` =
    median over the pairs of (whole - forwards-only) / ``M`` (floored at 0: on a loaded machine
    a pair's difference can be noise-dominated for a tiny trunk).

    FC side: the FC rank's work on one micro-batch from ``k`` CONV ranks of ``r = b / M`` rows
    each, as ``_fc_step`` does it minus MPI and the codec: concatenate ``k`` arrays, convert to a
    tensor, the head's forward + backward (sum of sparse cross-entropy) in a ``tf.function`` with
    the trainer's input signature, ``dA`` back to NumPy and split into ``k`` parts; timed for
    ``k = 1`` and ``k = K = min(max(2, max_convs_per_fc), FC_FIT_MAX_CONVS)`` (64: the fit is
    linear in the rows; a plan for 100000 nodes needs no 99999 micro-batches in memory), fitted as ``fc_call_s + rows fc_row_s``
    (``fc_row_s = (t_K - t_1) / ((K - 1) r)``, ``fc_call_s = t_1 - r fc_row_s``, both >= 0).

    Each: one warm-up call (tracing), then ``repeats`` timed calls (medians).

    Args:
        split: :class:`~hgsgc.hourglass.split.SplitModel`; x: one training batch ``[b, ...]``.
        micro_batches: ``M``, 1 .. b. max_convs_per_fc: the most CONV ranks one FC rank serves
            among the candidates (``n - 1`` for ``F = 1``).

    Returns:
        ``{"conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s"}`` (seconds; per example for
        ``fc_row_s``).
    """
    import numpy as np
    import tensorflow as tf

    trunk, head = split.trunk, split.head
    b = len(x)
    chunks = micro_batch_bounds(b, micro_batches)
    M = len(chunks)
    xt = tf.constant(x)
    a_full = trunk(xt, training=False).numpy()
    rng = np.random.default_rng(0)
    dA = [rng.standard_normal(a_full[lo:hi].shape).astype(a_full.dtype) * 1e-3 for lo, hi in chunks]
    variables = trunk.trainable_variables

    def send(a, j):  # the send's place: a crossing into Python that touches the activations
        return np.int32(np.asarray(a).shape[0] + int(j) * 0)

    def recv(j):
        return dA[int(j)]

    def conv_step(x_, backward: bool):
        tok = tf.constant(0)
        acts = []
        with tf.GradientTape(persistent=M > 1) as tape:
            for j, (lo, hi) in enumerate(chunks):
                with tf.control_dependencies([tok]):
                    xj = tf.identity(x_[lo:hi])
                a = trunk(xj, training=True)
                tok = tf.numpy_function(send, [a, tf.constant(j)], tf.int32, stateful=True)
                acts.append(a)
        if not backward:
            return [tf.cast(tok, tf.float32)]
        grads = None
        for j, a in enumerate(acts):
            with tf.control_dependencies([tok]):
                g_a = tf.numpy_function(recv, [tf.constant(j)], a.dtype, stateful=True)
            g_a = tf.ensure_shape(g_a, a.shape)
            gj = tape.gradient(a, variables, output_gradients=g_a)
            grads = gj if grads is None else [u + v for u, v in zip(grads, gj)]
            tok = tf.reduce_sum(grads[0]) if M > 1 else tok
        return grads

    fwd = tf.function(lambda x_: conv_step(x_, False))
    whole = tf.function(lambda x_: conv_step(x_, True))

    def once(fn):
        t0 = time.perf_counter()
        float(tf.reduce_sum(fn(xt)[0]))
        return time.perf_counter() - t0

    once(fwd), once(whole)  # tracing
    pairs = [(once(fwd), once(whole)) for _ in range(max(1, repeats))]  # adjacent in time: alike load
    t_fwd = float(np.median([p[0] for p in pairs]))
    t_bwd = float(np.median([p[1] - p[0] for p in pairs]))

    a_shape = tuple(int(d) for d in split.boundary_shape)
    spec_a = tf.TensorSpec((None,) + a_shape, tf.float32)
    spec_y = tf.TensorSpec((None,), tf.int32)
    n_out = int(head.outputs[0].shape[-1])

    @tf.function(input_signature=[spec_a, spec_y])
    def fc_grads(a, y):
        with tf.GradientTape() as tape:
            tape.watch(a)
            s = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(
                y, head(a, training=True), from_logits=True))
        g = tape.gradient(s, head.trainable_variables + [a])
        return s, g[-1], g[:-1]

    lo, hi = chunks[0]
    r = hi - lo
    part = a_full[lo:hi].reshape(r, -1)
    labels = rng.integers(0, n_out, r).astype(np.int32)

    def fc_micro_batch(k):
        a = np.concatenate([part] * k).reshape((-1,) + a_shape)
        y = np.concatenate([labels] * k)
        s, g_a, g = fc_grads(tf.constant(a), tf.constant(y))
        g_a = g_a.numpy().reshape(k * r, -1)
        return [g_a[i * r:(i + 1) * r] for i in range(k)], float(s)

    def timed(k):
        fc_micro_batch(k)
        ts = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            fc_micro_batch(k)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    # at most FC_FIT_MAX_CONVS parts: the fit is linear in the rows, and N - 1 parts of a large N
    # (hgsgc plan --nodes 100000) would not fit in memory
    K = min(max(2, int(max_convs_per_fc)), FC_FIT_MAX_CONVS)
    t1, tK = timed(1), timed(K)
    row = max(0.0, (tK - t1) / ((K - 1) * r))
    return {"conv_fwd_mb_s": t_fwd / M, "conv_bwd_mb_s": max(0.0, t_bwd) / M,
            "fc_call_s": max(0.0, t1 - r * row), "fc_row_s": row}


def _algorithm(comp) -> str:
    """The setting's collective (``ring``, ``allgather``, ``tree`` or ``node``)."""
    return comp.algorithm
