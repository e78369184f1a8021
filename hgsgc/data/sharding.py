"""Sharding of examples across ranks, reshuffled every epoch from the run seed.

Every rank computes the same permutation ``P_e`` of ``0..n-1`` from ``(seed, epoch)``
(numpy PCG64, ``default_rng([seed, epoch])``); rank ``r`` of ``size`` takes positions
``r, r + size, r + 2 size, ...`` of ``P_e``. The shards are disjoint and together cover every
example exactly once per epoch. Training takes the same number of full batches on every rank,
``n // (size * batch)`` (collectives stay matched); the few examples past that are skipped in
that epoch only (a different few next epoch).
"""
from __future__ import annotations

import numpy as np


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``0..n-1`` (int64 ``[n]``) for one epoch, the same on every rank."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(n))


def rank_indices(n: int, rank: int, size: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Example indices (int64) of ``rank`` of ``size`` for ``epoch``.

    ``shuffle=False`` (evaluation) keeps the natural order: ``r, r + size, ...``.

    Raises:
        ValueError: ``rank`` outside ``0..size-1``.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    order = epoch_permutation(n, seed, epoch) if shuffle else np.arange(int(n), dtype=np.int64)
    return order[rank::size]


def steps_per_epoch(n: int, size: int, batch: int) -> int:
    """Full batches every rank can take per epoch: ``n // (size * batch)``."""
    return int(n) // (int(size) * int(batch))


def contiguous_range(n: int, rank: int, size: int):
    """``(start, stop)`` of rank ``rank``'s contiguous part of ``n`` items (parts differ by <= 1)."""
    bounds = np.linspace(0, n, size + 1).astype(np.int64)
    return int(bounds[rank]), int(bounds[rank + 1])
