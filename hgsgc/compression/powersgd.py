"""PowerSGD building blocks (Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank
Gradient Compression for Distributed Optimization", Algorithm 1).

A tensor of shape ``[..., p]`` with ``m = prod(shape[:-1])`` is viewed as an ``[m, p]`` matrix
and approximated by ``P Q^T`` with ``P`` ``[m, q]`` orthonormal and ``Q`` ``[p, q]``,
``q = min(rank, m, p)``; one power-iteration step per training step, warm-started from the
previous ``Q``.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional, Tuple

import tensorflow as tf


def matrix_shape(shape, rank: int) -> Optional[Tuple[int, int, int]]:
    """``(m, p, q)`` if a tensor of ``shape`` is compressed at ``rank``, else ``None``.

    Compressed when it has >= 2 dimensions and ``(m + p) q < m p`` (it shrinks).
    """
    shape = [int(s) for s in shape]
    if len(shape) < 2:
        return None
    p = shape[-1]
    m = math.prod(shape[:-1])
    q = min(rank, m, p)
    if q < 1 or (m + p) * q >= m * p:
        return None
    return m, p, q


def payload_bytes(shape, rank: int) -> int:
    """A rank's float32 bytes for one tensor: ``4 (m + p) q`` compressed, else ``4 numel``."""
    mpq = matrix_shape(shape, rank)
    if mpq is None:
        return 4 * math.prod(int(s) for s in shape)
    m, p, q = mpq
    return 4 * (m + p) * q


def initial_q(name: str, p: int, q: int) -> tf.Tensor:
    """float32 ``[p, q]`` standard normal, seeded by ``name`` (crc32): identical on every rank."""
    seed = zlib.crc32(name.encode("utf-8"))
    return tf.random.stateless_normal([p, q], seed=[seed, 7919], dtype=tf.float32)


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """Orthonormal basis ``[m, q]`` of the columns of float32 ``p`` ``[m, q]`` (reduced QR).

    Deterministic for identical input, so every rank holding the same averaged ``p`` gets the
    same basis. Degenerate (zero) input yields an orthonormal matrix spanning some q columns.
    """
    qmat, _ = tf.linalg.qr(p, full_matrices=False)
    return qmat
