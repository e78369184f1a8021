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
# TensorFlow: the merge and the exchange.


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

    from hgsgc.compression import codec
    from hgsgc.compression.sparsify import exact_topk

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
    pos, kept = exact_topk(total, k)
    new_idx = tf.gather(union, pos)
    payload, q = codec.encode(new_idx, kept, numel, bits, index_coding)
    dropped = tf.logical_not(tf.scatter_nd(pos[:, None], tf.ones([k], tf.bool),
                                           tf.shape(union)[:1]))
    return payload, new_idx, q, union, contribs, dropped, kept


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

    from hgsgc.compression import codec as wire

    bits = codec.bits
    coding = getattr(codec, "index_coding", "fixed")
    comm, uid, rank, n = ctx.comm, ctx.uid, ctx.comm.rank, ctx.comm.size
    specs, aggs, payloads, local = [], [], [], []
    for a in views:
        numel = int(a.shape[0])
        payload, idx, sent = codec.encode_sparse(a, ctx)
        specs.append((numel, codec.k(numel), int(payload.shape[0])))
        aggs.append((idx, sent))
        payloads.append(payload)
        local.append((idx, sent))
    P = sum(p for _, _, p in specs)
    losses: List[List[tuple]] = [[] for _ in specs]
    prev = None
    for j in range(len(plan.rounds)):
        step = plan.step(j, rank)
        buf = tf.concat(payloads, 0) if len(payloads) > 1 else payloads[0]
        x = tf.tile(buf, [len(step.sends)]) if step.sends else buf[:0]
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
        off = 0
        for i, (numel, k, p) in enumerate(specs):
            received = [wire.decode(got[s, off:off + p], numel, k, bits, coding)
                        for s in range(len(step.recvs))]
            if step.op == "adopt":
                aggs[i] = received[0]
                payloads[i] = got[0, off:off + p]
            elif step.op == "merge":
                parts = [aggs[i]] + received
                pay, new_idx, q, union, contribs, dropped, kept = merge(parts, k, numel, bits, coding)
                for c, absorb in zip(contribs, step.absorb):
                    if absorb:
                        losses[i].append((union, tf.where(dropped, c, tf.zeros_like(c))))
                if step.absorb_requant and bits != 32:
                    losses[i].append((new_idx, kept - q))
                aggs[i] = (new_idx, q)
                payloads[i] = pay
            off += p
    comm.count(payload_bytes=P, rounds=len(plan.rounds))
    contributed = []
    for i, (numel, k, p) in enumerate(specs):
        idx, sent = local[i]
        applied = tf.scatter_nd(idx[:, None], sent, [numel])
        if losses[i]:
            li = tf.concat([u for u, _ in losses[i]], 0)
            lv = tf.concat([v for _, v in losses[i]], 0)
            applied = applied - tf.scatter_nd(li[:, None], lv, [numel])
        contributed.append(applied)
    results = []
    for (numel, k, p), (idx, vals) in zip(specs, aggs):
        total = tf.scatter_nd(idx[:, None], vals, [numel])
        results.append(total / float(n))
    return results, contributed
