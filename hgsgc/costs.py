"""The ONE place of communication cost formulas (bytes, messages, rounds per rank per exchange).

Pure Python, no TensorFlow or Horovod: the byte counters (:mod:`hgsgc.comm`), the reducers
(:mod:`hgsgc.compression.reducers`), the summaries (``hgsgc/train.py``,
``hgsgc/hourglass/train.py``), the Hourglass cost model (:mod:`hgsgc.hourglass.costmodel`) and
the performance model all take their figures from here. Notation: ``n`` ranks in the
collective, ``P`` (``payload``) bytes a rank contributes, all sizes in bytes.

=========================  ===========================  =========================================
collective                 sent = received per rank      rounds on the critical path
=========================  ===========================  =========================================
ring allreduce             ``2 (n - 1) / n * P``         ``2 (n - 1)`` (reduce-scatter + allgather)
allgather                  ``(n - 1) P``                 ``ceil(log2 n)`` (Bruck / recursive doubling)
tree (top-k reduction)     see :func:`tree_cost`         ``ceil(log2 n) + [n not a power of two]``
node (host hierarchy)      see :func:`node_cost`         ``tree_rounds(hosts) + 2 [a host has > 1 rank]``
=========================  ===========================  =========================================

The alpha-beta performance model (:mod:`hgsgc.perfmodel`) charges the busiest rank
:func:`exchange_bytes` bytes in :func:`exchange_messages` sequential messages per exchange, and
:func:`exchange_merges` payload decodes, except for Horovod's allreduce (``ring``) and allgather,
whose bytes and messages it takes from :func:`ompi_collective_cost`: what Open MPI 4.1 actually
runs (its coll/tuned algorithm choice, traced on this machine; e.g. Bruck's ``ceil(log2 n)``
rounds for a 16-256 kB allgatherv on 4-7 ranks, Rabenseifner's ``2 log2 n`` messages for a large
allreduce). The counters' figures here (``k - 1`` ring steps, ``2 (k - 1)`` ring rounds) are
the schedules hgsgc asks for, not what the MPI library runs.

The ring allreduce figure is Patarasuk & Yuan 2009 (bandwidth-optimal allreduce); the tree and
node schedules are those of :mod:`hgsgc.hierarchy` (recursive doubling with a fold).
"""
from __future__ import annotations

import math
from typing import Sequence

ALGORITHMS = ("ring", "allgather", "tree", "node")


def ring_allreduce_bytes(n: int, nbytes: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce of ``nbytes``: ``floor(2 (n-1) nbytes / n)``.

    Integer (floor) form, what the int64 byte counters add per collective call; ``0`` for
    ``n <= 1``. Use :func:`ring_allreduce_bytes_f` for the unrounded figure.
    """
    return (2 * (n - 1) * int(nbytes)) // n if n > 1 else 0


def ring_allreduce_bytes_f(n: int, nbytes: float) -> float:
    """Unrounded ring allreduce bytes per rank, ``2 (n - 1) / n * nbytes`` (float; 0.0 for ``n <= 1``).

    The figure of summary.json's ``dense_bytes_per_step_per_rank`` (DESIGN.md) and of the models.
    """
    return 2 * (n - 1) * nbytes / n if n > 1 else 0.0


def ring_allreduce_rounds(n: int) -> int:
    """Rounds of a ring allreduce: ``2 (n - 1)`` (``n - 1`` reduce-scatter + ``n - 1`` allgather)."""
    return 2 * (n - 1) if n > 1 else 0


def dense_bytes(n: int, numel: int) -> int:
    """What an fp32 ring allreduce of ``numel`` entries sends per rank: ``ring_allreduce_bytes(n, 4 numel)``."""
    return ring_allreduce_bytes(n, 4 * int(numel))


def allgather_bytes(n: int, payload: int) -> int:
    """Bytes one rank sends (= receives) in an allgather of ``payload`` bytes per rank: ``(n - 1) P``."""
    return (n - 1) * int(payload) if n > 1 else 0


def allgather_rounds(n: int) -> int:
    """Rounds of a latency-optimal allgather (Bruck / recursive doubling): ``ceil(log2 n)``."""
    return 0 if n <= 1 else (n - 1).bit_length()


def allgather_cost(n: int, payload: int) -> dict:
    """Flat allgather: sent = received = ``(n - 1) P``; one collective call.

    Returns:
        ``{"bytes_sent", "bytes_received", "messages", "rounds", "inter_bytes_sent",
        "inter_bytes_received"}`` (ints).
    """
    w = allgather_bytes(n, payload)
    return dict(bytes_sent=w, bytes_received=w, messages=1, rounds=allgather_rounds(n),
                inter_bytes_sent=w, inter_bytes_received=w)


def tree_rounds(n: int) -> int:
    """Rounds on the critical path of the tree: ``ceil(log2 n) + [n not a power of two]``."""
    if n <= 1:
        return 0
    return math.ceil(math.log2(n)) + (0 if n & (n - 1) == 0 else 1)


def tree_cost(n: int, rank: int, payload: int) -> dict:
    """Per-rank cost of the ``hierarchy="tree"`` exchange (recursive doubling with a fold).

    With ``m = 2^floor(log2 n)``, ``e = n - m`` and ``L = log2 m``: ranks ``i < e`` send
    ``(L + 2) P`` and receive ``(L + 1) P`` in ``L + 2`` messages; ranks ``e <= i < m`` send and
    receive ``L P`` in ``L`` messages; folded ranks ``i >= m`` send ``P`` and receive ``2 P``.

    Returns:
        the keys of :func:`allgather_cost` (ints; ``inter_*`` equal the totals).
    """
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


def tree_busiest_bytes(n: int, payload: float) -> float:
    """Bytes the busiest rank of the tree sends: ``(L + 2 [n > 2^L]) P`` with ``L = floor(log2 n)``.

    Equals ``max over ranks of tree_cost(n, rank, P)["bytes_sent"]`` (tested).
    """
    if n <= 1:
        return 0 * payload
    L = n.bit_length() - 1
    return (L + (2 if n > (1 << L) else 0)) * payload


def node_cost(hosts: Sequence[Sequence[int]], rank: int, payload: int) -> dict:
    """Per-rank cost of the ``hierarchy="node"`` exchange for ``hosts`` (lists of ranks).

    A non-leader sends and receives ``P`` inside its host; the leader of a host of ``s`` ranks
    moves ``(s - 1) P`` inside the host plus its :func:`tree_cost` share among the host leaders
    (the ``inter_*`` figures).

    Raises:
        ValueError: ``rank`` is on no host.
    """
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


def exchange_bytes(k: int, payload: float, algorithm: str = "ring", delay: int = 1) -> float:
    """Bytes the busiest rank sends per step in an exchange among ``k`` ranks (float).

    ``ring``: :func:`ring_allreduce_bytes_f`; ``allgather``: ``(k - 1) P`` (:func:`allgather_bytes`,
    unrounded); ``tree`` / ``node``:
    :func:`tree_busiest_bytes` (``node`` modelled as ``tree``); divided by the communication
    delay ``delay`` (one exchange every ``delay`` steps).

    Raises:
        ValueError: an unknown ``algorithm`` (valid: :data:`ALGORITHMS`).
    """
    if k <= 1:
        return 0.0
    if algorithm == "ring":
        per = ring_allreduce_bytes_f(k, payload)
    elif algorithm == "allgather":
        per = (k - 1) * payload
    elif algorithm in ("tree", "node"):
        per = tree_busiest_bytes(k, payload)
    else:
        raise ValueError(f"unknown exchange algorithm {algorithm!r}: use one of {ALGORITHMS}")
    return per / delay


def exchange_messages(k: int, algorithm: str = "ring") -> int:
    """Sequential messages (latency terms) of the busiest rank in one exchange among ``k`` ranks.

    ``ring``: :func:`ring_allreduce_rounds` ``2 (k - 1)``; ``allgather``: ``k - 1`` (the steps of
    a ring allgather; see the module docstring); ``tree`` / ``node``: :func:`tree_rounds` (equal
    to ``floor(log2 k) + 2 [k not a power of two]``, the busiest rank's message count). ``0`` for
    ``k <= 1``.

    Raises:
        ValueError: an unknown ``algorithm`` (valid: :data:`ALGORITHMS`).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown exchange algorithm {algorithm!r}: use one of {ALGORITHMS}")
    if k <= 1:
        return 0
    if algorithm == "ring":
        return ring_allreduce_rounds(k)
    if algorithm == "allgather":
        return k - 1
    return tree_rounds(k)


def exchange_merges(k: int, algorithm: str = "allgather") -> int:
    """Payloads the busiest rank decodes and adds in one exchange among ``k`` ranks.

    ``tree`` / ``node``: ``ceil(log2 k)``, the most payloads a rank of the tree receives
    (``max over ranks of tree_cost(k, rank, 1)["bytes_received"]``, tested); every other
    algorithm: the ``k - 1`` other ranks' payloads. ``0`` for ``k <= 1``.

    Raises:
        ValueError: an unknown ``algorithm`` (valid: :data:`ALGORITHMS`).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown exchange algorithm {algorithm!r}: use one of {ALGORITHMS}")
    if k <= 1:
        return 0
    if algorithm in ("tree", "node"):
        return allgather_rounds(k)  # ceil(log2 k)
    return k - 1


# ------------------------------------------------------------------------------------------
# What Open MPI 4.1 actually runs (coll/tuned fixed decision), for the performance model.
# Horovod 0.28 on CPU calls MPI_Allreduce on its fused buffer and MPI_Allgatherv on its fused
# allgather buffer (sizes from the negotiated, cached response); Open MPI's coll/tuned module
# picks the algorithm from the communicator size and the message size
# (ompi/mca/coll/tuned/coll_tuned_decision_fixed.c). The ranges used by hgsgc's cells were
# checked on this machine's Open MPI 4.1.4 by tracing the TCP sends of each rank
# (docs/benchmarks/perfmodel.md, "Which algorithm Open MPI runs").
OMPI_ALLREDUCE = ("basic_linear", "nonoverlapping", "recursive_doubling", "ring", "segmented_ring",
                  "rabenseifner")
OMPI_ALLGATHERV = ("default", "bruck", "ring", "neighbor", "two_proc")


def _pick(table, x):
    """The algorithm of the first ``(limit, alg)`` of ``table`` with ``x < limit`` (last: no limit)."""
    for limit, alg in table:
        if limit is None or x < limit:
            return alg
    raise AssertionError("table without a final entry")


def ompi_allreduce_algorithm(n: int, nbytes: float) -> str:
    """Open MPI 4.1's fixed choice for a commutative ``MPI_Allreduce`` of ``nbytes`` among ``n``
    ranks (coll/tuned ``allreduce_intra_dec_fixed``): one of :data:`OMPI_ALLREDUCE`.

    E.g. 4 ranks: recursive doubling below 8 kB, Rabenseifner (recursive halving reduce-scatter +
    recursive doubling allgather) from 8 kB; 2 ranks: Rabenseifner from 256 kB.
    """
    x = float(nbytes)
    if n < 4:
        t = [(8, "ring"), (4096, "recursive_doubling"), (8192, "ring"), (16384, "recursive_doubling"),
             (65536, "ring"), (262144, "segmented_ring"), (None, "rabenseifner")]
    elif n < 8:
        t = [(16, "ring"), (8192, "recursive_doubling"), (None, "rabenseifner")]
    elif n < 16:
        t = [(8192, "recursive_doubling"), (None, "rabenseifner")]
    elif n < 32:
        t = [(64, "segmented_ring"), (4096, "recursive_doubling"), (None, "rabenseifner")]
    elif n < 64:
        t = [(128, "segmented_ring"), (None, "rabenseifner")]
    elif n < 128:
        t = [(262144, "recursive_doubling"), (None, "rabenseifner")]
    elif n < 256:
        t = [(131072, "nonoverlapping"), (262144, "recursive_doubling"), (None, "rabenseifner")]
    elif n < 512:
        t = [(4096, "nonoverlapping"), (None, "rabenseifner")]
    elif n < 2048:
        t = [(2048, "nonoverlapping"), (16384, "recursive_doubling"), (None, "rabenseifner")]
    elif n < 4096:
        t = [(2048, "nonoverlapping"), (4096, "segmented_ring"), (16384, "recursive_doubling"),
             (None, "rabenseifner")]
    else:
        t = [(2048, "nonoverlapping"), (16384, "segmented_ring"), (32768, "recursive_doubling"),
             (None, "rabenseifner")]
    return _pick(t, x)


def ompi_allgatherv_algorithm(n: int, per_rank_bytes: float) -> str:
    """Open MPI 4.1's fixed choice for ``MPI_Allgatherv`` of ``per_rank_bytes`` per rank (total /
    n) among ``n`` ranks (coll/tuned ``allgatherv_intra_dec_fixed``): one of :data:`OMPI_ALLGATHERV`.

    E.g. 4 ranks: ring for 4-8 kB, Bruck (``ceil(log2 n)`` rounds) for 16-256 kB, neighbour
    exchange (``n / 2`` rounds) from 256 kB; 8-15 ranks: Bruck from 1 kB.
    """
    x = float(per_rank_bytes)
    if n == 2:
        t = [(2048, "ring"), (4096, "two_proc"), (8192, "ring"), (None, "two_proc")]
    elif n < 8:
        t = [(256, "default"), (4096, "neighbor"), (8192, "ring"), (16384, "neighbor"),
             (262144, "bruck"), (None, "neighbor")]
    elif n < 16:
        t = [(1024, "default"), (None, "bruck")]
    elif n < 32:
        t = [(128, "default"), (262144, "bruck"), (None, "ring")]
    elif n < 64:
        t = [(256, "default"), (8192, "bruck"), (None, "ring")]
    elif n < 128:
        t = [(256, "default"), (4096, "bruck"), (None, "ring")]
    elif n < 256:
        t = [(1024, "bruck"), (65536, "neighbor"), (None, "ring")]
    elif n < 512:
        t = [(1024, "bruck"), (None, "ring")]
    elif n < 1024:
        t = [(512, "bruck"), (1024, "default"), (4096, "bruck"), (1048576, "neighbor"), (None, "ring")]
    else:
        t = [(4096, "bruck"), (None, "neighbor")]
    return _pick(t, x)


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


def ompi_collective_cost(collective: str, n: int, nbytes: float) -> dict:
    """The busiest rank's cost of one Open MPI collective among ``n`` ranks, as its algorithm
    (:func:`ompi_allreduce_algorithm` / :func:`ompi_allgatherv_algorithm`) runs it.

    ``collective``: ``"allreduce"`` (``nbytes`` = the buffer) or ``"allgatherv"`` (``nbytes`` =
    one rank's contribution ``P``). With ``p = 2^floor(log2 n)`` and ``x = [n not a power of 2]``
    (the extra fold step of the recursive algorithms):

    ==================  ====================================  ================================
    algorithm           messages (sequential)                 bytes sent
    ==================  ====================================  ================================
    ring / seg. ring    ``2 (n-1)``                           ``2 (n-1)/n B``
    rabenseifner        ``2 log2 p + 2x``                     ``2 (p-1)/p B + x B``
    recursive doubling  ``log2 p + 2x``                       ``(log2 p + x) B``
    nonoverlapping      ``2 ceil(log2 n)`` (reduce + bcast)   ``2 ceil(log2 n) B``
    basic_linear        ``2 (n-1)`` (at the root)             ``(n-1) B``
    allgatherv ring     ``n-1``                               ``(n-1) P``
    bruck               ``ceil(log2 n)``                      ``(n-1) P``
    neighbor            ``n/2`` (n even; odd n: ring)         ``(n-1) P``
    two_proc            ``1``                                 ``P``
    default             ``(n-1) + ceil(log2 n)`` (gatherv     ``(n-1) P + ceil(log2 n) n P``
                        to the root, then its broadcast)
    ==================  ====================================  ================================

    ``pairwise``: every step exchanges with ONE peer in both directions at once (recursive
    doubling, Rabenseifner, neighbour exchange, two_proc, and any algorithm of 2 ranks); those run
    at the pairwise rate of a link (Open MPI's TCP ``put`` protocol halves it, docs/cluster.md).

    Returns:
        ``{"algorithm", "messages", "bytes", "pairwise"}``; all 0 / False for ``n <= 1``.
    Raises:
        ValueError: unknown ``collective``.
    """
    if collective not in ("allreduce", "allgatherv"):
        raise ValueError(f"unknown collective {collective!r}: use 'allreduce' or 'allgatherv'")
    if n <= 1:
        return {"algorithm": "none", "messages": 0, "bytes": 0.0, "pairwise": False}
    B = float(nbytes)
    L = _log2_floor(n)
    p = 1 << L
    x = 0 if p == n else 1
    lg = (n - 1).bit_length()  # ceil(log2 n)
    if collective == "allreduce":
        alg = ompi_allreduce_algorithm(n, B)
        if alg in ("ring", "segmented_ring"):
            m, b, pw = 2 * (n - 1), 2 * (n - 1) / n * B, n == 2
        elif alg == "rabenseifner":
            m, b, pw = 2 * L + 2 * x, 2 * (p - 1) / p * B + x * B, True
        elif alg == "recursive_doubling":
            m, b, pw = L + 2 * x, (L + x) * B, True
        elif alg == "nonoverlapping":
            m, b, pw = 2 * lg, 2 * lg * B, n == 2
        else:  # basic_linear
            m, b, pw = 2 * (n - 1), (n - 1) * B, n == 2
    else:
        alg = ompi_allgatherv_algorithm(n, B)
        if alg == "neighbor" and n % 2:
            alg = "ring"  # Open MPI falls back to the ring for an odd communicator
        if alg == "ring":
            m, b, pw = n - 1, (n - 1) * B, n == 2
        elif alg == "bruck":
            m, b, pw = lg, (n - 1) * B, n == 2
        elif alg == "neighbor":
            m, b, pw = n // 2, (n - 1) * B, True
        elif alg == "two_proc":
            m, b, pw = 1, B, True
        else:  # default: gatherv to rank 0 + broadcast of the n P bytes
            m, b, pw = (n - 1) + lg, (n - 1) * B + lg * n * B, n == 2
    return {"algorithm": alg, "messages": int(m), "bytes": float(b), "pairwise": bool(pw)}
