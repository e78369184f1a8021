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
:func:`exchange_merges` payload decodes. Its allgather latency term is the ``n - 1`` steps of a
ring allgather (what Open MPI runs for large ``allgatherv`` payloads), a conservative figure beside
the latency-optimal ``ceil(log2 n)`` rounds the byte counters record (:func:`allgather_rounds`).

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
