"""TernGrad building blocks (Wen et al. 2017, "TernGrad: Ternary Gradients to Reduce
Communication in Distributed Deep Learning").

Per tensor: optional clipping to ``c`` standard deviations (Sec. 3.3), a scale ``s`` shared by
all ranks (``s = max_r max|g_r|``, "scaler sharing"), and stochastic ternarization
``t_k = sign(g_k) * Bernoulli(|g_k| / s)`` so that ``E[s t] = g`` (Eq. 4-5). Codes {-1, 0, 1}
are stored as {0, 1, 2} in 2 bits, four per byte (:func:`hgsgc.compression.quantize.pack_codes`).
The random draws are explicit inputs (``uniform``) so a numpy reference can reproduce them.
"""
from __future__ import annotations

import math

import tensorflow as tf

from hgsgc.compression.quantize import pack_codes, unpack_codes

SCALE_BYTES = 4  # one float32 shared scale per tensor


def clip(g: tf.Tensor, clip_sigma: float) -> tf.Tensor:
    """Clip float32 ``g`` (any shape) to ``[-c sigma, c sigma]``, sigma = std of g; c = 0: no-op.

    A tensor whose entries are all equal (sigma = 0: scalars, one-element tensors, constants) is
    left as it is: clipping it to 0 would discard its whole gradient.
    """
    g = tf.cast(g, tf.float32)
    if not clip_sigma:
        return g
    sigma = tf.math.reduce_std(g)
    bound = tf.where(sigma > 0, clip_sigma * sigma, tf.reduce_max(tf.abs(g)))
    return tf.clip_by_value(g, -bound, bound)


def ternarize(g: tf.Tensor, scale: tf.Tensor, uniform: tf.Tensor) -> tf.Tensor:
    """Stochastic ternary codes of ``g`` under the shared ``scale``.

    Args:
        g: float32 ``[d]`` (already clipped).
        scale: float32 scalar >= max|g| (the shared scale); 0 gives all-zero codes.
        uniform: float32 ``[d]`` draws from U[0, 1).

    Returns:
        int32 ``[d]`` in {-1, 0, 1}: ``sign(g_k)`` where ``uniform_k < |g_k| / scale``, else 0.
    """
    safe = tf.where(scale > 0, scale, 1.0)
    keep = tf.logical_and(uniform < tf.abs(g) / safe, scale > 0)
    return tf.where(keep, tf.cast(tf.sign(g), tf.int32), 0)


def encode(codes: tf.Tensor) -> tf.Tensor:
    """int32 ``[d]`` codes in {-1, 0, 1} -> uint8 ``[ceil(d / 4)]`` (code + 1 in 2 bits)."""
    return pack_codes(codes + 1)


def decode(packed: tf.Tensor, d: int) -> tf.Tensor:
    """Inverse of :func:`encode`: uint8 ``[ceil(d / 4)]`` -> int32 ``[d]`` in {-1, 0, 1}."""
    return unpack_codes(packed, d) - 1


def code_bytes(numel: int) -> int:
    """Bytes of one tensor's packed codes: ``ceil(numel / 4)``."""
    return math.ceil(numel / 4)


def payload_bytes(numel: int) -> int:
    """A rank's bytes for one tensor: packed codes plus its float32 scale."""
    return code_bytes(numel) + SCALE_BYTES


def uniform_seed(step, rank: int, index: int):
    """Seed of the stateless uniform draws for (exchange ``step``, ``rank``, tensor ``index``).

    Distinct per rank so the ranks' rounding noise is independent; a pure function so tests
    can redraw the same numbers.
    """
    return tf.stack([tf.cast(step, tf.int64) % (2 ** 31),
                     tf.constant(rank * 100003 + index, tf.int64)])


def draw_uniform(numel: int, step, rank: int, index: int) -> tf.Tensor:
    """float32 ``[numel]`` U[0, 1) draws for :func:`ternarize` (``tf.random.stateless_uniform``)."""
    return tf.random.stateless_uniform([numel], seed=uniform_seed(step, rank, index),
                                       dtype=tf.float32)
