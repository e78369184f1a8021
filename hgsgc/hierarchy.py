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


def tree_rounds(n: int) -> int:
    """Rounds on the critical path of the tree: ``ceil(log2 n) + [n not a power of two]``."""
    if n <= 1:
        return 0
    return math.ceil(math.log2(n)) + (0 if n & (n - 1) == 0 else 1)


def allgather_rounds(n: int) -> int:
    """Rounds of a latency-optimal allgather (Bruck / recursive doubling): ``ceil(log2 n)``."""
    return 0 if n <= 1 else (n - 1).bit_length()


def allgather_cost(n: int, payload: int) -> dict:
    """Flat allgather: sent = received = ``(n - 1) P``; one collective call."""
    w = (n - 1) * payload
    return dict(bytes_sent=w, bytes_received=w, messages=1, rounds=allgather_rounds(n),
                inter_bytes_sent=w, inter_bytes_received=w)


def tree_cost(n: int, rank: int, payload: int) -> dict:
    """Closed form of the tree's per-rank cost (table in the module docstring)."""
    if n <= 1:
        return dict(bytes_sent=0, bytes_received=0, messages=0, rounds=0,
                    inter_bytes_sent=0, inter_bytes_received=0)
    m = 1 << (n.bit_length() - 1)
    e, L = n - m, m.bit_length() - 1
    if rank < e:
        sent, recv, msgs = L + 2, L + 1, L + 2
    elif rank < m:
        sent, recv, msgs = L, L, L
    else:
        sent, recv, msgs = 1, 2, 1
    return dict(bytes_sent=sent * payload, bytes_received=recv * payload, messages=msgs,
                rounds=tree_rounds(n), inter_bytes_sent=sent * payload,
                inter_bytes_received=recv * payload)


def node_cost(hosts: Sequence[Sequence[int]], rank: int, payload: int) -> dict:
    """Closed form of the node hierarchy's per-rank cost for ``hosts`` (lists of ranks)."""
    hosts = sorted((sorted(h) for h in hosts if len(h)), key=lambda h: h[0])
    big = any(len(h) > 1 for h in hosts)
    rounds = tree_rounds(len(hosts)) + (2 if big else 0)
    for hi, h in enumerate(hosts):
        if rank in h:
            s = len(h)
            if rank != h[0]:
                return dict(bytes_sent=payload, bytes_received=payload, messages=1, rounds=rounds,
                            inter_bytes_sent=0, inter_bytes_received=0)
            t = tree_cost(len(hosts), hi, payload)
            intra = (s - 1) * payload
            return dict(bytes_sent=t["bytes_sent"] + intra,
                        bytes_received=t["bytes_received"] + intra,
                        messages=t["messages"] + (s - 1), rounds=rounds,
                        inter_bytes_sent=t["bytes_sent"], inter_bytes_received=t["bytes_received"])
    raise ValueError(f"rank {rank} is on no host of {hosts}")


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


def merge(parts, k: int, numel: int, bits: int):
    """Merge partial aggregates of one tensor (see the module docstring).

    Args:
        parts: list of ``(indices int32 [k_p] ascending, values float32 [k_p])``.
        k: entries kept; numel: size of the dense tensor; bits: 2 or 32.

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
    payload, q = codec.encode(new_idx, kept, numel, bits)
    dropped = tf.logical_not(tf.scatter_nd(pos[:, None], tf.ones([k], tf.bool),
                                           tf.shape(union)[:1]))
    return payload, new_idx, q, union, contribs, dropped, kept


def exchange(tensors, names, *, compression, memory, stats, process_set, rank: int, n: int,
             plan: Plan, select, uid: int):
    """Average ``tensors`` over the process set along ``plan`` (tree or node).

    Every rank compensates, selects and encodes as for the allgather; then the plan's rounds run
    (one ``hvd.alltoall`` each), the residuals take what the local compression and this rank's
    share of the merges dropped, and the final aggregate divided by ``n`` is returned, identical
    on every rank. Counters: ``bytes_sent`` / ``bytes_received`` are the sizes of the tensors
    actually handed to / returned by Horovod (payload bytes), ``messages`` the point-to-point
    payloads sent, ``rounds`` the plan's rounds.
    """
    import tensorflow as tf

    # The graph built here depends on the rank (merge, adopt or idle per round). Inside a name
    # scope of its own it cannot shift the auto-generated names of ops built after it, which
    # Horovod ops named after their input tensors rely on being equal on every rank.
    with tf.name_scope(f"hgsgc_{plan.hierarchy}_{uid}"):
        return _exchange(tensors, names, compression, memory, stats, process_set, rank, n, plan,
                         select, uid)


def _exchange(tensors, names, compression, memory, stats, process_set, rank, n, plan, select, uid):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hgsgc.compression import codec
    from hgsgc.compression.sparsify import num_selected

    comp = compression
    bits = comp.bits
    specs, aggs, payloads, compensated, local = [], [], [], [], []
    for t, name in zip(tensors, names):
        numel = int(t.shape.num_elements())
        flat = tf.reshape(tf.cast(t, tf.float32), [-1])
        a = memory.compensate(name, flat) if comp.error_feedback else flat
        k = num_selected(numel, comp.density)
        idx, vals = select(a, k)
        payload, sent = codec.encode(idx, vals, numel, bits)
        specs.append((numel, k, int(payload.shape[0])))
        aggs.append((idx, sent))
        payloads.append(payload)
        compensated.append(a)
        local.append((idx, sent))
    P = sum(p for _, _, p in specs)
    d = sum(numel for numel, _, _ in specs)
    losses: List[List[tuple]] = [[] for _ in specs]
    sent_sizes, recv_sizes = [], []
    prev = None
    messages = 0
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
        out, _ = hvd.alltoall(x, splits=tf.constant(splits, tf.int32),
                              name=f"hgsgc_{plan.hierarchy}_{uid}_round{j}",
                              ignore_name_scope=True, process_set=process_set)
        prev = out
        messages += len(step.sends)
        sent_sizes.append(tf.size(x, out_type=tf.int64))
        recv_sizes.append(tf.size(out, out_type=tf.int64))
        if not step.recvs:
            continue
        got = tf.reshape(out, [len(step.recvs), P])
        off = 0
        for i, (numel, k, p) in enumerate(specs):
            received = [codec.decode(got[s, off:off + p], numel, k, bits)
                        for s in range(len(step.recvs))]
            if step.op == "adopt":
                aggs[i] = received[0]
                payloads[i] = got[0, off:off + p]
            elif step.op == "merge":
                parts = [aggs[i]] + received
                pay, new_idx, q, union, contribs, dropped, kept = merge(parts, k, numel, bits)
                for c, absorb in zip(contribs, step.absorb):
                    if absorb:
                        losses[i].append((union, tf.where(dropped, c, tf.zeros_like(c))))
                if step.absorb_requant and bits != 32:
                    losses[i].append((new_idx, kept - q))
                aggs[i] = (new_idx, q)
                payloads[i] = pay
            off += p
    updates = []
    if comp.error_feedback:
        for i, ((numel, k, p), name) in enumerate(zip(specs, names)):
            idx, sent = local[i]
            applied = tf.scatter_nd(idx[:, None], sent, [numel])
            if losses[i]:
                li = tf.concat([u for u, _ in losses[i]], 0)
                lv = tf.concat([v for _, v in losses[i]], 0)
                applied = applied - tf.scatter_nd(li[:, None], lv, [numel])
            updates.append(memory.update(name, compensated[i], applied))
    counted = [stats.add(exchanges=1, gradient_bytes=4 * d, payload_bytes=P, messages=messages,
                         rounds=len(plan.rounds),
                         dense_bytes=(2 * (n - 1) * 4 * d) // n if n > 1 else 0)]
    if sent_sizes:
        counted.append(stats.vars["bytes_sent"].assign_add(tf.add_n(sent_sizes)))
        counted.append(stats.vars["bytes_received"].assign_add(tf.add_n(recv_sizes)))
    results = []
    with tf.control_dependencies(updates + counted):
        for t, (numel, k, p), (idx, vals) in zip(tensors, specs, aggs):
            total = tf.scatter_nd(idx[:, None], vals, [numel])
            avg = tf.reshape(total / float(n), t.shape)
            results.append(tf.cast(avg, t.dtype))
    return results
