"""Hierarchical exchange of top-k payloads: ``hierarchy="tree"`` and ``hierarchy="node"``.

The flat baseline (``hierarchy="allgather"``, in :mod:`hgsgc.communicator`) makes every rank
receive the ``n - 1`` payloads of the others: ``(n - 1) P`` bytes per rank. The two hierarchies
here instead *reduce* payloads on the way, keeping the top-k of every partial sum, so that every
message stays one payload of ``P`` bytes (the same codec, the same ``k`` entries per tensor) and a
rank handles ``O(log n)`` of them.

Merge (the reduction operator)
------------------------------
A merge takes the partial aggregates ``A_1 .. A_m`` (each ``k`` (index, value) pairs per tensor,
values already dequantized), forms the union ``U`` of their indices (ascending), sums the values at
equal indices in part order (``((A_1 + A_2) + A_3) ...``, an absent index contributes ``0``),
keeps the ``k`` entries of ``U`` of largest ``|sum|`` (ties: the lower index, as
:func:`hgsgc.compression.sparsify.exact_topk`), and re-encodes them with
:mod:`hgsgc.compression.codec`: with ``bits=2`` the kept sums are **re-quantized** to two
magnitude levels (new scales ``[lo, hi]`` from their own min/max), with ``bits=32`` they travel
as fp32. Two-part merges are commutative bit for bit (IEEE ``a + b == b + a``), so the two
partners of an exchange compute the identical aggregate.

``hierarchy="tree"``: recursive doubling with a fold (any ``n``)
-----------------------------------------------------------------
Let ``m = 2^floor(log2 n)`` and ``e = n - m`` (the ranks beyond the largest power of two).

1. fold (only if ``e > 0``): ranks ``i < e`` and ``i + m`` swap payloads and both merge;
2. ``log2 m`` recursive-doubling rounds among ranks ``0 .. m-1``: in round ``j`` rank ``i`` swaps
   its aggregate with rank ``i XOR 2^j`` and both merge. After round ``j`` every member of an
   aligned block of ``2^(j+1)`` ranks holds the same aggregate of that block (and of the folded
   ranks attached to it); after the last round ranks ``0 .. m-1`` hold the global top-k;
3. unfold (only if ``e > 0``): rank ``i < e`` sends the final payload to ``i + m``, which adopts
   it (no re-quantization: the bytes are forwarded).

The reduction itself takes ``1 + log2 m = ceil(log2 n)`` rounds for every ``n`` that is not a
power of two and ``log2 n`` otherwise; delivering the result to the folded ranks adds one round:
``rounds = ceil(log2 n) + [n not a power of two]`` on the critical path (every round depends on
the previous one). Per rank per exchange, with ``L = log2 m`` and ``P`` the payload bytes:

====================  ==================  ==================  =========
rank                  sent                received            messages
====================  ==================  ==================  =========
``i < e``             ``(L + 2) P``       ``(L + 1) P``       ``L + 2``
``e <= i < m``        ``L P``             ``L P``             ``L``
``i >= m`` (folded)   ``P``               ``2 P``             ``1``
====================  ==================  ==================  =========

so the busiest rank moves ``(floor(log2 n) + 2) P`` bytes at most, against ``(n - 1) P`` for the
allgather. (A binomial reduce to rank 0 plus a binomial broadcast would need ``2 ceil(log2 n)``
rounds; the fold costs at most one extra round over the ``ceil(log2 n)`` lower bound.)

``hierarchy="node"``: reduce inside each host, tree between hosts
------------------------------------------------------------------
Hosts are the shared-memory domains of MPI (``MPI_Comm_split_type(COMM_TYPE_SHARED)`` on the
process set's ranks, via mpi4py; ``socket.gethostname()`` if mpi4py is missing), or, to emulate
several hosts on one machine, the override ``node_sizes`` (``Exchanger(node_sizes=...)``) or the
environment variable ``HGSGC_RANKS_PER_NODE``: ``"4"`` (hosts of 4 consecutive ranks, the last
one takes the remainder) or ``"3,2,1"`` (explicit sizes, consecutive ranks, summing to ``n``).
The leader of a host is its lowest rank; hosts are ordered by their leader.

1. intra (only if some host has ``s > 1`` ranks): every non-leader sends its payload to its
   leader, which merges its own and the ``s - 1`` received payloads (one ``s``-way merge);
2. the ``h`` leaders run the tree above among themselves (``h`` = number of hosts);
3. intra: every leader sends the final payload to its ``s - 1`` ranks, which adopt it.

``rounds = tree_rounds(h) + 2 [max s > 1]``. A non-leader sends and receives ``P`` (inside its
host); the leader of a host of ``s`` ranks sends and receives ``(s - 1) P`` inside the host plus
its tree share among ``h`` leaders between hosts. Only the tree share crosses host links: with
``s`` ranks per host the inter-host bytes per host are those of a tree over ``n / s`` ranks.

Residuals (error feedback) and the mass identity
------------------------------------------------
Rank ``r`` compensates ``a_r = g_r + e_r``, selects and encodes its payload, whose dequantized
values are ``q_r`` (dense, zero off the selection). Each merge ``B`` with input aggregates
``A_1..A_m`` and output ``A_B`` loses ``L_B = sum_p A_p - A_B``: the entries of the union that
were not kept, plus the re-quantization error on the kept ones. Exactly one rank keeps each piece:

* the dropped entries of part ``p`` go to the rank that *leads* part ``p``: in a fold or in
  round 0 that is the rank that selected them (a rank's own entries that do not survive go back
  into its own residual); later, part ``p`` is the aggregate of an aligned block of ranks and its
  leader is the block's lowest rank; in a node merge the host leader keeps all parts;
* the re-quantization error goes to the leader of the merged block (its lowest rank).

The new residual is ``e_r' = a_r - q_r + sum of the pieces rank r keeps``. Summed over ranks the
pieces telescope along the merge tree (leaves ``q_r``, root the final aggregate ``u``), so with
``u / n`` the update applied on every rank::

    sum_r a_r  ==  n * (u / n)  +  sum_r e_r'          (exactly, up to float32 rounding)

Nothing is lost: what a merge drops or rounds away is sent at a later step. (The flat allgather
satisfies the same identity with no merge terms.)

Re-quantization error
---------------------
Each 2-bit merge moves every kept value by at most ``(b_B - a_B) / 4`` (``a_B``, ``b_B`` the
min and max ``|sum|`` of the kept entries, the bound of :mod:`hgsgc.compression.quantize`), so
a final value differs from the exact sum of the leaf values that reached it by at most the sum of
those bounds over the merges on its path (``<= ceil(log2 n) + 1`` merges for the tree,
``+ 1`` for the node merge). The error is not lost (residuals above); its effect on one step
against the flat allgather is measured by ``scripts/bench_hierarchy.py``
(``docs/benchmarks/hierarchy.md``).

Transport
---------
Each round is one ``horovod.tensorflow.alltoall`` on the exchanger's process set in which every
rank passes ``splits`` that are ``P`` for the ranks it sends to and ``0`` elsewhere (an idle rank
passes an empty tensor). This keeps everything inside the TensorFlow graph with Horovod's
ordering and naming (no second MPI progress thread, no deadlock between graphs), at the price of
Horovod's control traffic per round (its negotiation and an exchange of the ``n`` int32 split
sizes), which the byte counters do not include: they count payload bytes, like the allgather's.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

HIERARCHICAL = ("tree", "node")
ENV_RANKS_PER_NODE = "HGSGC_RANKS_PER_NODE"


# ------------------------------------------------------------------------------------------------
# Schedules (pure Python; shared by the TensorFlow exchange, the formulas and the benchmark).


@dataclass(frozen=True)
class Step:
    """What one rank does in one round.

    Attributes:
        sends: ranks (process-set ranks) that receive this rank's current aggregate, one payload
            of ``P`` bytes each.
        recvs: ranks whose payloads arrive this round, ascending.
        op: ``"merge"`` (aggregate <- merge(own, received...)), ``"adopt"`` (aggregate <-
            received[0]) or ``"none"``.
        absorb: for ``"merge"``: per part (own first, then ``recvs``) whether this rank keeps that
            part's dropped entries in its residual.
        absorb_requant: for ``"merge"``: whether this rank keeps the re-quantization error.
        phase: ``"intra"`` (inside a host) or ``"inter"`` (between hosts / flat tree).
    """

    sends: Tuple[int, ...] = ()
    recvs: Tuple[int, ...] = ()
    op: str = "none"
    absorb: Tuple[bool, ...] = ()
    absorb_requant: bool = False
    phase: str = "inter"


IDLE = Step()


@dataclass(frozen=True)
class Plan:
    """A hierarchy's schedule for ``n`` ranks: ``rounds[j][rank]`` is a :class:`Step`."""

    hierarchy: str
    n: int
    rounds: Tuple[Dict[int, Step], ...]
    hosts: Tuple[Tuple[int, ...], ...] = ()

    def step(self, j: int, rank: int) -> Step:
        return self.rounds[j].get(rank, IDLE)

    def costs(self, rank: int, payload: int) -> dict:
        """Bytes and messages of ``rank`` per exchange, counted off the schedule.

        Returns:
            ``{"bytes_sent", "bytes_received", "messages", "rounds", "inter_bytes_sent",
            "inter_bytes_received"}`` (``inter_*``: the share between hosts).
        """
        out = dict(bytes_sent=0, bytes_received=0, messages=0, rounds=len(self.rounds),
                   inter_bytes_sent=0, inter_bytes_received=0)
        for j in range(len(self.rounds)):
            s = self.step(j, rank)
            out["bytes_sent"] += len(s.sends) * payload
            out["bytes_received"] += len(s.recvs) * payload
            out["messages"] += len(s.sends)
            if s.phase == "inter":
                out["inter_bytes_sent"] += len(s.sends) * payload
                out["inter_bytes_received"] += len(s.recvs) * payload
        return out


def _tree_rounds(members: Sequence[int]) -> List[Dict[int, Step]]:
    """Recursive doubling with a fold among ``members`` (ranks, in tree order)."""
    h = len(members)
    if h <= 1:
        return []
    m = 1 << (h.bit_length() - 1)
    e = h - m
    rounds: List[Dict[int, Step]] = []
    if e:
        rnd = {}
        for i in range(e):
            lo, hi = members[i], members[i + m]
            rnd[lo] = Step(sends=(hi,), recvs=(hi,), op="merge", absorb=(True, False),
                           absorb_requant=True)
            rnd[hi] = Step(sends=(lo,), recvs=(lo,), op="merge", absorb=(True, False),
                           absorb_requant=False)
        rounds.append(rnd)
    for j in range(m.bit_length() - 1):
        bit = 1 << j
        rnd = {}
        for i in range(m):
            p = members[i ^ bit]
            rnd[members[i]] = Step(sends=(p,), recvs=(p,), op="merge",
                                   absorb=(i % bit == 0, False),
                                   absorb_requant=(i % (2 * bit) == 0))
        rounds.append(rnd)
    if e:
        rnd = {}
        for i in range(e):
            lo, hi = members[i], members[i + m]
            rnd[lo] = Step(sends=(hi,))
            rnd[hi] = Step(recvs=(lo,), op="adopt")
        rounds.append(rnd)
    return rounds


def tree_plan(n: int) -> Plan:
    """The ``hierarchy="tree"`` schedule for ``n`` ranks (see the module docstring)."""
    return Plan("tree", n, tuple(_tree_rounds(list(range(n)))))


def node_plan(hosts: Sequence[Sequence[int]]) -> Plan:
    """The ``hierarchy="node"`` schedule for ``hosts`` (lists of ranks, each ascending).

    Raises:
        ValueError: hosts that do not partition ``0 .. n-1``.
    """
    hosts = tuple(tuple(sorted(int(r) for r in h)) for h in hosts if len(h))
    hosts = tuple(sorted(hosts, key=lambda h: h[0]))
    n = sum(len(h) for h in hosts)
    if sorted(r for h in hosts for r in h) != list(range(n)):
        raise ValueError(f"hosts {hosts} do not partition ranks 0..{n - 1}")
    rounds: List[Dict[int, Step]] = []
    big = any(len(h) > 1 for h in hosts)
    if big:
        rnd = {}
        for h in hosts:
            if len(h) > 1:
                rnd[h[0]] = Step(recvs=h[1:], op="merge", absorb=(True,) * len(h),
                                 absorb_requant=True, phase="intra")
                for r in h[1:]:
                    rnd[r] = Step(sends=(h[0],), phase="intra")
        rounds.append(rnd)
    rounds += _tree_rounds([h[0] for h in hosts])
    if big:
        rnd = {}
        for h in hosts:
            if len(h) > 1:
                rnd[h[0]] = Step(sends=h[1:], phase="intra")
                for r in h[1:]:
                    rnd[r] = Step(recvs=(h[0],), op="adopt", phase="intra")
        rounds.append(rnd)
    return Plan("node", n, tuple(rounds), hosts)


# ------------------------------------------------------------------------------------------------
# Closed-form costs (the formulas the counters are checked against).


# The formulas live in hgsgc.costs (the one module of cost formulas); re-exported here.
from hgsgc.costs import (allgather_cost, allgather_rounds, node_cost, tree_cost,  # noqa: E402,F401
                         tree_rounds)


# ------------------------------------------------------------------------------------------------
# Hosts.


def parse_node_sizes(spec, n: int) -> List[int]:
    """Host sizes from an override: an int ``s`` / ``"s"`` (hosts of ``s`` consecutive ranks, the
    last one takes the remainder) or a sequence / ``"a,b,c"`` of sizes summing to ``n``.

    Raises:
        ValueError: a size < 1 or sizes that do not sum to ``n``.
    """
    if isinstance(spec, str):
        parts = [p for p in spec.replace(" ", "").split(",") if p]
        try:
            vals = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{ENV_RANKS_PER_NODE}/node_sizes must be an integer or a comma "
                             f"list of integers, got {spec!r}") from None
        spec = vals[0] if len(vals) == 1 else vals
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"ranks per node must be >= 1, got {spec}")
        sizes = [spec] * (n // spec) + ([n % spec] if n % spec else [])
    else:
        sizes = [int(s) for s in spec]
        if any(s < 1 for s in sizes) or sum(sizes) != n:
            raise ValueError(f"node sizes {sizes} must be >= 1 and sum to the {n} ranks")
    return sizes


def hosts_from_sizes(sizes: Sequence[int]) -> List[List[int]]:
    out, r = [], 0
    for s in sizes:
        out.append(list(range(r, r + s)))
        r += s
    return out


def discover_hosts(world_ranks: Sequence[int], node_sizes=None) -> List[List[int]]:
    """Hosts as lists of process-set ranks (``0 .. n-1``, in the order of ``world_ranks``).

    ``node_sizes`` (or ``$HGSGC_RANKS_PER_NODE``) overrides; otherwise this is a collective over
    the process set's ranks: ``MPI_Comm_create_group`` + ``MPI_Comm_split_type(COMM_TYPE_SHARED)``
    through mpi4py (every rank of the set must call it), falling back to a Horovod allgather of
    host names when mpi4py is not installed.
    """
    n = len(world_ranks)
    spec = node_sizes if node_sizes is not None else os.environ.get(ENV_RANKS_PER_NODE) or None
    if spec is not None:
        return hosts_from_sizes(parse_node_sizes(spec, n))
    if n == 1:
        return [[0]]
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - mpi4py is installed with hgsgc
        return _hosts_by_hostname(world_ranks)
    world = MPI.COMM_WORLD
    if list(world_ranks) == list(range(world.Get_size())):
        comm = world.Dup()
    else:
        group = world.Get_group().Incl(list(world_ranks))
        comm = world.Create_group(group)
        group.Free()
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    host_id = shared.allreduce(comm.Get_rank(), op=MPI.MIN)
    ids = comm.allgather(host_id)
    shared.Free()
    comm.Free()
    hosts: Dict[int, List[int]] = {}
    for r, h in enumerate(ids):
        hosts.setdefault(h, []).append(r)
    return [hosts[h] for h in sorted(hosts)]


def _hosts_by_hostname(world_ranks):  # pragma: no cover - fallback without mpi4py
    import horovod.tensorflow as hvd
    import tensorflow as tf

    ps = hvd.global_process_set
    if list(world_ranks) != list(range(hvd.size())):
        ps = hvd.ProcessSet(list(world_ranks))
    with tf.init_scope():
        names = hvd.allgather_object(socket.gethostname(), process_set=ps)
    hosts: Dict[str, List[int]] = {}
    for r, h in enumerate(names):
        hosts.setdefault(h, []).append(r)
    return sorted(hosts.values(), key=lambda h: h[0])


# ------------------------------------------------------------------------------------------------
# TensorFlow: the merge and the exchange, batched over every tensor of the exchange.
#
# The exchange handles all its tensors at once: a tensor's entry ``i`` is the *global* index
# ``base_t + i`` (``base_t`` the entries of the tensors before it, int64), so the concatenation
# of the tensors' ascending index lists is one ascending list, and the payload of the exchange
# (the tensors' payloads back to back, the wire format of :mod:`hgsgc.compression.wire`) is read
# and written with one set of ops whatever the number of tensors: the fields' bit positions are
# static (``_Layout``), the per-tensor top-k is one sort by (tensor, |sum| descending, index).
# The arithmetic per entry is that of the per-tensor code (the same float32 operations on the
# same operands, ties broken the same way), so the results are the same bit for bit; the graph
# has ``O(rounds)`` ops instead of ``O(rounds x tensors)`` (docs/benchmarks.md, "The tree's
# first step").


class _Layout:
    """Static positions of every field of an exchange's payload (numpy, built while tracing).

    Args:
        specs: per tensor ``(numel, k, payload bytes)``; bits: 2 or 32; coding: ``"fixed"`` or
            ``"elias_fano"``.
    """

    def __init__(self, specs, bits: int, coding: str):
        import numpy as np

        from hgsgc.compression import wire

        self.bits, self.coding = bits, coding
        numel = np.array([s[0] for s in specs], np.int64)
        k = np.array([s[1] for s in specs], np.int64)
        p = np.array([s[2] for s in specs], np.int64)
        T = len(specs)
        self.T, self.K, self.P = T, int(k.sum()), int(p.sum())
        self.numels = [int(x) for x in numel]
        self.N = int(numel.sum())
        self.base = np.concatenate([[0], np.cumsum(numel)[:-1]]).astype(np.int64)
        self.k = k.astype(np.int32)
        koff = np.concatenate([[0], np.cumsum(k)[:-1]])
        boff = np.concatenate([[0], np.cumsum(p)[:-1]])
        seg = np.repeat(np.arange(T), k)
        j = np.arange(self.K) - koff[seg]                  # entry number inside its tensor
        self.seg = seg.astype(np.int32)
        self.j = j.astype(np.int32)
        self.base_e = self.base[seg]
        self.numel_e = numel[seg].astype(np.int32)
        live = [t for t in range(T) if k[t] > 0]
        self.live_e = np.searchsorted(live, seg).astype(np.int32)  # entry -> its tensor among live
        idx_start = boff + (8 if bits == 2 else 0)          # byte where the index section starts
        ibytes = np.array([wire.index_bytes(int(numel[t]), int(k[t]), coding) for t in range(T)],
                          np.int64)
        if coding == "fixed":
            w = np.array([wire.index_width(int(x)) for x in numel], np.int64)
            self.w_e = w[seg].astype(np.int32)
            self.W = int(self.w_e.max()) if self.K else 1
            self.idx_pos = (8 * idx_start[seg] + j * w[seg]).astype(np.int32)
        else:
            low = np.array([wire.ef_low_bits(int(numel[t]), int(k[t])) if k[t] else 0
                            for t in range(T)], np.int64)
            high = np.array([wire.ef_high_bits(int(numel[t]), int(k[t])) if k[t] else 0
                             for t in range(T)], np.int64)
            self.l_e = low[seg].astype(np.int32)
            self.L = int(self.l_e.max()) if self.K else 0
            self.low_pos = (8 * idx_start[seg] + j * low[seg]).astype(np.int32)
            ustart = 8 * (idx_start + (k * low + 7) // 8)      # first bit of the unary part
            self.ustart_e = ustart[seg].astype(np.int32)
            # the bytes of every unary part (whole bytes: each starts on a byte boundary) and,
            # in their bits, the H bits of each tensor (padding bits left out)
            ub = (high + 7) // 8
            self.unary_bytes = np.concatenate(
                [np.arange(ustart[t] // 8, ustart[t] // 8 + ub[t]) for t in range(T)] or [[]]
            ).astype(np.int32)
            ubcum = np.concatenate([[0], np.cumsum(ub)[:-1]])
            self.unary_bits = np.concatenate(
                [8 * ubcum[t] + np.arange(high[t]) for t in range(T)] or [[]]).astype(np.int32)
            ucum = np.concatenate([[0], np.cumsum(high)[:-1]])
            self.ucum = ucum.astype(np.int32)                # start of tensor t in unary_bits
            self.ucum_e = ucum[seg].astype(np.int32)
            self.ucum_live = ucum[live].astype(np.int32)
        val_start = idx_start + ibytes                        # codes (bits 2) or fp32 values
        if bits == 2:
            self.code_pos = (8 * val_start[seg] + 2 * j).astype(np.int32)
            self.scale_bytes = (boff[live][:, None] + np.arange(8)).reshape(-1).astype(np.int32)
        else:
            self.value_bytes = (val_start[seg][:, None] + 4 * j[:, None]
                                + np.arange(4)).reshape(-1).astype(np.int32)


def _span(pos, W: int) -> int:
    """Bytes a field of at most ``W`` bits starting at bit ``pos % 8`` of a byte can touch."""
    import numpy as np

    first = int(np.max(np.asarray(pos) % 8)) if np.size(pos) else 0
    return (first + W + 7) // 8


def _read_fields(payload64, pos, width, W: int):
    """Fields of ``width`` bits (int32 [F] or int, <= ``W`` <= 32) at the static bit positions
    ``pos`` (int32 [F]) of the payload (int64 [P], one byte each): int32 [F]. Bit ``b`` of a
    field is bit ``pos + b`` of the stream, bit ``j`` of the stream bit ``j % 8`` of byte
    ``j // 8`` (the layout of :func:`hgsgc.ops.pack_bits`)."""
    import numpy as np
    import tensorflow as tf

    P = int(payload64.shape[0])
    S = _span(pos, W)
    at = np.minimum((np.asarray(pos) >> 3)[:, None] + np.arange(S), P - 1).astype(np.int32)
    wide = tf.reduce_sum(tf.bitwise.left_shift(tf.gather(payload64, at),
                                               tf.constant(8 * np.arange(S), tf.int64)), 1)
    mask = (np.left_shift(np.int64(1), np.asarray(width, np.int64)) - 1).astype(np.int64)
    val = tf.bitwise.bitwise_and(tf.bitwise.right_shift(wide, tf.constant(
        (np.asarray(pos) & 7).astype(np.int64))), tf.constant(mask))
    return tf.cast(val, tf.int32)


def _write(fields, byte_fields, P: int, custom: bool = False):
    """A payload of ``P`` bytes from bit fields and whole bytes (none overlapping; bits that no
    field covers are 0).

    Args:
        fields: ``(values int32 [F] in [0, 2^W), bit positions, W)``; positions are static (numpy
            int32 [F]) or, for ``W == 1`` only, an int32 tensor.
        byte_fields: ``(bytes uint8 [B], static byte positions int32 [B])``.
        custom: one ``HgsgcPackFields`` op (ops/sparse_merge.cc, session 17) instead of the
            shifts, masks and ``tf.scatter_nd`` below; the same bytes (tests/test_kernels17.py).
    """
    import numpy as np
    import tensorflow as tf

    if custom:
        from hgsgc import ops

        vs, ps, ss = [], [], []
        for v, pos, W in fields:
            vs.append(tf.cast(v, tf.int32))
            if W == 1:
                ps.append(tf.cast(pos, tf.int32))
                ss.append(tf.zeros_like(ps[-1]))
            else:
                ps.append(tf.constant(np.asarray(pos, np.int32)))
                ss.append(tf.fill(tf.shape(ps[-1]), _span(pos, W)))
        bys = [tf.cast(b, tf.uint8) for b, _ in byte_fields]
        bps = [tf.constant(np.asarray(bp, np.int32)) for _, bp in byte_fields]
        cat = lambda xs, dt: tf.concat(xs, 0) if xs else tf.zeros([0], dt)  # noqa: E731
        return ops.load().hgsgc_pack_fields(cat(vs, tf.int32), cat(ps, tf.int32), cat(ss, tf.int32),
                                            cat(bys, tf.uint8), cat(bps, tf.int32), length=int(P))
    at, vals = [], []
    for v, pos, W in fields:
        if W == 1:   # one byte each, positions may be a tensor
            at.append(tf.bitwise.right_shift(pos, 3))
            vals.append(tf.bitwise.left_shift(v, tf.bitwise.bitwise_and(pos, 7)))
            continue
        S = _span(pos, W)
        wide = tf.bitwise.left_shift(tf.cast(v, tf.int64),
                                     tf.constant((np.asarray(pos) & 7).astype(np.int64)))
        parts = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
            wide[:, None], tf.constant(8 * np.arange(S), tf.int64)), 255)
        at.append(tf.constant(np.minimum((np.asarray(pos) >> 3)[:, None] + np.arange(S), P - 1)
                              .reshape(-1).astype(np.int32)))
        vals.append(tf.cast(tf.reshape(parts, [-1]), tf.int32))
    for byts, pos in byte_fields:
        at.append(tf.constant(pos))
        vals.append(tf.cast(byts, tf.int32))
    # disjoint bit fields: the sum of a byte's parts is their bitwise or
    out = tf.scatter_nd(tf.concat(at, 0)[:, None], tf.concat(vals, 0), [P])
    return tf.cast(out, tf.uint8)


def _encode_all(gidx, vals, lay: _Layout, custom: bool = False):
    """Encode every tensor's kept entries: global indices int64 [K] (ascending, ``k_t`` per
    tensor) and float32 values [K] -> ``(payload uint8 [P], decoded values float32 [K])``:
    the bytes of :func:`hgsgc.compression.wire.encode` per tensor, back to back. ``custom``: the
    fields packed by the ``HgsgcPackFields`` kernel (:func:`_write`)."""
    import tensorflow as tf

    from hgsgc.compression.wire import _f32_to_bytes

    local = tf.cast(gidx - tf.constant(lay.base_e), tf.int32)
    fields, byte_fields = [], []
    if lay.coding == "fixed":
        fields.append((local, lay.idx_pos, lay.W))
    else:
        lo_mask = tf.bitwise.left_shift(1, tf.constant(lay.l_e)) - 1
        if lay.L > 0:
            fields.append((tf.bitwise.bitwise_and(local, lo_mask), lay.low_pos, lay.L))
        upos = (tf.constant(lay.ustart_e) + tf.bitwise.right_shift(local, tf.constant(lay.l_e))
                + tf.constant(lay.j))
        fields.append((tf.ones_like(local), upos, 1))
    if lay.bits == 2:
        seg = tf.constant(lay.seg)
        mag = tf.abs(vals)
        a = tf.math.unsorted_segment_min(mag, seg, lay.T)
        b = tf.math.unsorted_segment_max(mag, seg, lay.T)
        lo = a + (b - a) * 0.25                         # quantize.quantize_2bit, per tensor
        hi = a + (b - a) * 0.75
        ae, be = tf.gather(a, seg), tf.gather(b, seg)
        upper = tf.cast(mag >= (ae + be) * 0.5, tf.int32)
        neg = tf.cast(vals < 0, tf.int32)
        codes = 2 * neg + upper
        qmag = tf.where(tf.equal(codes % 2, 1), tf.gather(hi, seg), tf.gather(lo, seg))
        q = tf.where(codes >= 2, -qmag, qmag)           # quantize.dequantize_2bit
        fields.append((codes, lay.code_pos, 2))
        live = sorted(set(lay.seg.tolist()))
        scales = tf.gather(tf.stack([lo, hi], 1), live)
        byte_fields.append((_f32_to_bytes(scales), lay.scale_bytes))
    else:
        q = vals
        byte_fields.append((_f32_to_bytes(vals), lay.value_bytes))
    return _write(fields, byte_fields, lay.P, custom=custom), q


def _decode_all(payload, lay: _Layout, what: str):
    """Inverse of :func:`_encode_all`: uint8 [P] -> ``(global indices int64 [K], values
    float32 [K])`` (bits=2: dequantized), as :func:`hgsgc.compression.wire.decode` per tensor.

    Raises:
        tf.errors.InvalidArgumentError (when run): indices that are not strictly ascending in
            ``[0, numel)`` inside a tensor, or an Elias-Fano high part whose set bits are not
            ``k`` per tensor (a corrupt payload, or ranks with other compression settings).
    """
    import tensorflow as tf

    from hgsgc.compression.wire import _bytes_to_f32

    K, P = lay.K, lay.P
    pb = tf.cast(payload, tf.int64)
    checks = []
    if lay.coding == "fixed":
        local = _read_fields(pb, lay.idx_pos, lay.w_e, lay.W)
    else:
        ubytes = tf.cast(tf.gather(payload, tf.constant(lay.unary_bytes)), tf.int32)
        ub = tf.gather(tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(
            ubytes[:, None], tf.range(8, dtype=tf.int32)), 1), [-1]), tf.constant(lay.unary_bits))
        setp = tf.cast(tf.where(tf.not_equal(ub, 0))[:, 0], tf.int32)
        count = tf.debugging.Assert(tf.equal(tf.size(setp), K), [tf.strings.format(
            f"hierarchy exchange: {what}the Elias-Fano high parts hold {{}} set bits, not the "
            f"{K} of the k of its tensors (not an index_coding=elias_fano payload of these "
            "tensors? every rank must use the same compression settings)", tf.size(setp))])
        with tf.control_dependencies([count]):
            setp = tf.reshape(setp, [K])
        owner = tf.searchsorted(tf.constant(lay.ucum_live), setp, side="right",
                                out_type=tf.int32) - 1
        checks.append(tf.reduce_all(tf.equal(owner, tf.constant(lay.live_e))))
        high = setp - tf.constant(lay.ucum_e) - tf.constant(lay.j)
        local = tf.bitwise.left_shift(high, tf.constant(lay.l_e))
        if lay.L > 0:
            local = tf.bitwise.bitwise_or(local, _read_fields(pb, lay.low_pos, lay.l_e, lay.L))
    first = tf.constant(lay.j == 0)
    prev = tf.concat([[-1], local[:-1]], 0)
    checks.append(tf.reduce_all(tf.logical_and(
        local < tf.constant(lay.numel_e),
        tf.logical_and(local >= 0, tf.logical_or(first, local > prev)))))
    check = tf.debugging.Assert(tf.reduce_all(tf.stack(checks)), [
        f"hierarchy exchange: {what}indices not strictly ascending in [0, numel) inside a tensor "
        "(a corrupt payload, or ranks with other compression settings)"])
    with tf.control_dependencies([check]):
        gidx = tf.cast(local, tf.int64) + tf.constant(lay.base_e)
    if lay.bits == 2:
        sc = tf.reshape(_bytes_to_f32(tf.gather(payload, tf.constant(lay.scale_bytes))), [-1, 2])
        codes = _read_fields(pb, lay.code_pos, 2, 2)
        live = tf.constant(lay.live_e)
        mag = tf.where(tf.equal(codes % 2, 1), tf.gather(sc[:, 1], live), tf.gather(sc[:, 0], live))
        vals = tf.where(codes >= 2, -mag, mag)
    else:
        vals = _bytes_to_f32(tf.gather(payload, tf.constant(lay.value_bytes)))
    return gidx, tf.reshape(vals, [K])


def _merge_all(parts, lay: _Layout, backend=None):
    """:func:`merge` of every tensor at once; ``parts``: ``(global indices int64 [m_p] ascending,
    values float32 [m_p])``. Returns the tuple of :func:`merge` in global indices.

    Two parts (every round of the tree, most of the node hierarchy's) with the custom kernels in
    use (``backend``: None = :func:`hgsgc.ops.use_compression_kernels`'s setting, ``"custom"``,
    ``"reference"``): the union, sum and per-tensor top-k run in one C++ op,
    ``HgsgcSparseMergeSelect`` (``ops/sparse_merge.cc``, session 17), bit for bit the pure-TF
    path of :func:`_select_reference` (tests/test_kernels17.py); otherwise that path."""
    import tensorflow as tf

    from hgsgc import ops

    custom = (ops.use_compression_kernels() if backend is None else ops._resolve_compression(backend) == "custom")
    if len(parts) == 2 and custom:
        union, ca, cb, total, pos = ops.load().hgsgc_sparse_merge_select(
            parts[0][0], parts[0][1], parts[1][0], parts[1][1], tf.constant(lay.base, tf.int64),
            tf.constant(lay.k, tf.int32), kept=int(lay.K))
        contribs = [ca, cb]
        pos = tf.reshape(pos, [lay.K])
    else:
        union, contribs, total, pos = _select_reference(parts, lay)
    new_idx = tf.gather(union, pos)
    kept = tf.gather(total, pos)
    payload, q = _encode_all(new_idx, kept, lay, custom=custom)
    dropped = tf.logical_not(tf.scatter_nd(pos[:, None], tf.ones([lay.K], tf.bool),
                                           tf.shape(union)[:1]))
    return payload, new_idx, q, union, contribs, dropped, kept


def _select_reference(parts, lay: _Layout):
    """The pure-TF union, sum and per-tensor top-k of :func:`_merge_all`: ``(union int64 [u]
    ascending, contributions float32 [u] per part (0 where absent), total float32 [u] (their sum
    in part order), pos int32 [K] ascending positions of the kept entries)``: :func:`_union_sum`
    then :func:`_select_top`."""
    union, contribs, total = _union_sum(parts)
    return union, contribs, total, _select_top(union, total, lay)


def _union_sum(parts):
    """The sorted union of the parts' indices, each part's values at it (0 where absent) and their
    sum in part order: ``(union int64 [u], contributions [float32 [u]], total float32 [u])``."""
    import tensorflow as tf

    union = tf.unique(tf.sort(tf.concat([p[0] for p in parts], 0))).y
    contribs = []
    for idx, vals in parts:
        pos = tf.searchsorted(idx, union, side="left", out_type=tf.int32)
        pos = tf.minimum(pos, tf.size(idx) - 1)
        present = tf.equal(tf.gather(idx, pos), union)
        contribs.append(tf.where(present, tf.gather(vals, pos), tf.zeros_like(union, tf.float32)))
    total = contribs[0]
    for c in contribs[1:]:
        total = total + c
    return union, contribs, total


def _select_top(union, total, lay: _Layout):
    """Per tensor, the ``k`` largest ``|total|`` (ties: the lower index), as sparsify.exact_topk:
    one descending sort by (tensor ascending, ``|total|`` as its bit pattern, ties by position).
    Returns int32 [K], ascending positions in ``union``."""
    import tensorflow as tf

    seg = tf.searchsorted(tf.constant(lay.base), union, side="right", out_type=tf.int32) - 1
    mag = tf.cast(tf.bitcast(tf.abs(total), tf.int32), tf.int64)
    key = tf.bitwise.left_shift(tf.cast(lay.T - 1 - seg, tf.int64), 32) + mag
    size = tf.size(union)
    order = tf.math.top_k(key, k=size, sorted=True).indices
    start = tf.cumsum(tf.math.unsorted_segment_sum(tf.ones_like(seg), seg, lay.T), exclusive=True)
    oseg = tf.gather(seg, order)
    keep = tf.range(size) - tf.gather(start, oseg) < tf.gather(tf.constant(lay.k), oseg)
    return tf.reshape(tf.sort(tf.boolean_mask(order, keep)), [lay.K])


def exchange_layout(specs, bits: int, index_coding: str = "fixed") -> _Layout:
    """The static layout of an exchange's payload: ``specs`` per tensor ``(numel, k, payload
    bytes)`` (:func:`hgsgc.compression.wire.payload_length`), ``bits`` 2 or 32, ``index_coding``
    ``"fixed"`` or ``"elias_fano"``; what :func:`merge_received` takes."""
    return _Layout(specs, bits, index_coding)


def merge_received(agg, received, lay: _Layout):
    """One merge of a round of the exchange, for every tensor at once: decode each received
    payload (uint8 ``[lay.P]``, with the text its errors name: ``(payload, what)``) and merge
    them with this rank's aggregate ``agg`` (global indices int64 ``[K]`` ascending, float32
    values ``[K]``) in part order. Returns :func:`merge`'s tuple in global indices (payload
    uint8 ``[lay.P]``). ``hgsgc.perfmodel`` times one call of it as the tree's per-payload cost."""
    return _merge_all([agg] + [_decode_all(p, lay, what) for p, what in received], lay)


def merge(parts, k: int, numel: int, bits: int, index_coding: str = "fixed"):
    """Merge partial aggregates of one tensor (see the module docstring).

    Args:
        parts: list of ``(indices int32 [k_p] ascending, values float32 [k_p])``.
        k: entries kept; numel: size of the dense tensor; bits: 2 or 32; index_coding:
        ``"fixed"`` or ``"elias_fano"`` (:mod:`hgsgc.compression.wire`).

    Returns:
        ``(payload uint8, indices int32 [k] ascending, values float32 [k] as decoded,
        union int32 [u], contributions list of float32 [u] per part, dropped bool [u],
        kept_sums float32 [k] before re-quantization)``.
    """
    import tensorflow as tf

    from hgsgc.compression import wire

    lay = _Layout([(numel, k, wire.payload_length(numel, k, bits, index_coding))], bits,
                  index_coding)
    parts = [(tf.cast(i, tf.int64), tf.convert_to_tensor(v, tf.float32)) for i, v in parts]
    payload, new_idx, q, union, contribs, dropped, kept = _merge_all(parts, lay)
    return (payload, tf.cast(new_idx, tf.int32), q, tf.cast(union, tf.int32), contribs, dropped,
            kept)


def exchange(views, *, codec, ctx, plan: Plan):
    """Average flat float32 ``views`` (already error-compensated) along ``plan`` (tree or node).

    Every rank selects and encodes with ``codec`` (a :class:`hgsgc.compression.codec.TopKCodec`)
    as for the allgather; then the plan's rounds run (one ``hvd.alltoall`` each through
    ``ctx.comm``), and the final aggregate divided by ``n`` is returned, identical on every rank.

    Returns:
        ``(averages, contributed)``: float32 ``[numel]`` each; ``contributed`` is this rank's
        decoded payload minus the merge pieces this rank keeps (module docstring), so error
        feedback ``e' = a - contributed`` satisfies the mass identity. Counters (through
        ``ctx.comm``): ``payload_bytes`` P, ``bytes_sent`` / ``bytes_received`` the sizes of the
        tensors handed to / returned by Horovod, ``messages`` the payloads sent, ``rounds`` the
        plan's rounds.
    """
    import tensorflow as tf

    # The graph built here depends on the rank (merge, adopt or idle per round). Inside a name
    # scope of its own it cannot shift the auto-generated names of ops built after it, which
    # Horovod ops named after their input tensors rely on being equal on every rank.
    with tf.name_scope(f"hgsgc_{plan.hierarchy}_{ctx.uid}"):
        return _exchange(views, codec, ctx, plan)


def _exchange(views, codec, ctx, plan):
    import tensorflow as tf

    bits = codec.bits
    coding = getattr(codec, "index_coding", "fixed")
    comm, uid, rank, n = ctx.comm, ctx.uid, ctx.comm.rank, ctx.comm.size
    specs, gidx, sent, payloads = [], [], [], []
    for a in views:
        numel = int(a.shape[0])
        payload, idx, s = codec.encode_sparse(a, ctx)
        specs.append((numel, codec.k(numel), int(payload.shape[0])))
        gidx.append(idx)
        sent.append(s)
        payloads.append(payload)
    lay = _Layout(specs, bits, coding)
    P = lay.P
    # this rank's entries in global indices (int64 [K], ascending) and their decoded values
    local = (tf.concat([tf.cast(i, tf.int64) + int(lay.base[t]) for t, i in enumerate(gidx)], 0),
             tf.concat(sent, 0))
    agg = local
    payload = tf.concat(payloads, 0) if len(payloads) > 1 else payloads[0]
    losses: List[tuple] = []
    prev = None
    for j in range(len(plan.rounds)):
        step = plan.step(j, rank)
        x = tf.tile(payload, [len(step.sends)]) if step.sends else payload[:0]
        if prev is not None:
            with tf.control_dependencies([prev]):
                x = tf.identity(x)
        splits = [0] * n
        for dst in step.sends:
            splits[dst] = P
        out = comm.alltoall(x, splits, name=f"hgsgc_{plan.hierarchy}_{uid}_round{j}")
        prev = out
        if not step.recvs:
            continue
        got = tf.reshape(out, [len(step.recvs), P])
        if step.op == "adopt":
            agg = _decode_all(got[0], lay, f"payload of rank {step.recvs[0]} (round {j}): ")
            payload = got[0]
        elif step.op == "merge":
            payload, new_idx, q, union, contribs, dropped, kept = merge_received(
                agg, [(got[s], f"payload of rank {src} (round {j}): ") for s, src in enumerate(step.recvs)], lay)
            for c, absorb in zip(contribs, step.absorb):
                if absorb:
                    losses.append((union, tf.where(dropped, c, tf.zeros_like(c))))
            if step.absorb_requant and bits != 32:
                losses.append((new_idx, kept - q))
            agg = (new_idx, q)
    comm.count(payload_bytes=P, rounds=len(plan.rounds))
    N = lay.N
    applied = tf.scatter_nd(local[0][:, None], local[1], [N])
    if losses:
        li = tf.concat([u for u, _ in losses], 0)
        lv = tf.concat([v for _, v in losses], 0)
        applied = applied - tf.scatter_nd(li[:, None], lv, [N])
    total = tf.scatter_nd(agg[0][:, None], agg[1], [N]) / float(n)
    return tf.split(total, lay.numels), tf.split(applied, lay.numels)
