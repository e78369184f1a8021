"""2-bit quantization of the values top-k selected.

Scheme (deterministic, sign + one magnitude bit, two per-tensor scales):
for the selected values ``v`` (float32 ``[k]``) let ``a = min|v|`` and ``b = max|v|``; the two
magnitude levels are the midpoints of the lower and upper half of ``[a, b]``::

    lo = a + (b - a) / 4,    hi = a + 3 (b - a) / 4
    code = 2 * [v < 0] + [|v| >= (a + b) / 2]          (codes 0..3, four packed per byte)
    q(v) = sign(v) * (hi if |v| >= (a + b) / 2 else lo)

Error bound: ``|v - q(v)| <= (b - a) / 4`` for every selected value (each magnitude is within a
quarter of the range from the midpoint of its half). Because top-k keeps the largest magnitudes,
``[a, b]`` is narrow relative to ``b`` far more often than the full gradient range; the error is
not lost either way: the error-feedback residual (``memory.py``) keeps ``v - q(v)`` and sends it
later. The scheme is in the spirit of TernGrad (Wen et al., NeurIPS 2017) and the 2-bit
quantization of the study this project implements, without stochastic rounding (error feedback
replaces unbiasedness).

Wire form: two float32 scales ``[lo, hi]`` (8 bytes) + ``ceil(k / 4)`` bytes of codes.
"""
from __future__ import annotations

import tensorflow as tf

from hgsgc import ops

SCALE_BYTES = 8  # two float32 scales per tensor


def quantize_2bit(v: tf.Tensor):
    """Quantize selected values to 2-bit codes.

    Args:
        v: float32 ``[k]``.

    Returns:
        ``(codes int32 [k] in 0..3, scales float32 [2] = [lo, hi])``. For ``k == 0`` the scales
        are zeros.
    """
    v = tf.convert_to_tensor(v, tf.float32)
    mag = tf.abs(v)
    k = tf.size(v)
    a = tf.cond(k > 0, lambda: tf.reduce_min(mag), lambda: tf.constant(0.0))
    b = tf.cond(k > 0, lambda: tf.reduce_max(mag), lambda: tf.constant(0.0))
    lo = a + (b - a) * 0.25
    hi = a + (b - a) * 0.75
    upper = tf.cast(mag >= (a + b) * 0.5, tf.int32)
    neg = tf.cast(v < 0, tf.int32)
    codes = 2 * neg + upper
    return codes, tf.stack([lo, hi])


def dequantize_2bit(codes: tf.Tensor, scales: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`quantize_2bit`: int32 codes ``[k]`` + float32 ``[2]`` -> float32 ``[k]``."""
    codes = tf.convert_to_tensor(codes, tf.int32)
    mag = tf.where(tf.equal(codes % 2, 1), scales[1], scales[0])
    return tf.where(codes >= 2, -mag, mag)


def error_bound_2bit(v) -> float:
    """The documented bound ``(max|v| - min|v|) / 4`` for values ``v`` (numpy or tensor)."""
    import numpy as np

    m = np.abs(np.asarray(v, dtype=np.float32))
    return 0.0 if m.size == 0 else float((m.max() - m.min()) / 4.0)


def pack_codes(codes: tf.Tensor) -> tf.Tensor:
    """Pack int32 codes ``[k]`` (0..3) four per byte -> uint8 ``[ceil(k / 4)]``."""
    return ops.pack_bits(codes, 2)


def unpack_codes(packed: tf.Tensor, k: int) -> tf.Tensor:
    """Unpack uint8 ``[ceil(k / 4)]`` -> int32 codes ``[k]``."""
    return ops.unpack_bits(packed, 2, k)
