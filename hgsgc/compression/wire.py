"""Wire format: one sparse tensor as one contiguous uint8 payload of exactly known length.

For a tensor of ``numel`` entries with ``k`` selected entries, indices are bit-packed with
``w = index_width(numel) = max(1, ceil(log2 numel))`` bits each (a fixed-width alternative to
delta coding that keeps the length known in advance). Layout, little-endian:

* ``bits == 2``:  ``[lo, hi] float32 (8 B) | indices ceil(k w / 8) B | codes ceil(k / 4) B``
* ``bits == 32``: ``indices ceil(k w / 8) B | values float32 4 k B``
* ``k == 0``: empty payload.

So ``payload_length = ceil(k w / 8) + (8 + ceil(k / 4) if bits == 2 else 4 k)``; for comparison
the DESIGN.md figure with int32 indices is ``4k + k/4 + scales``: fixed-width packing saves
``(32 - w) k / 8`` bytes. Indices travel sorted ascending.
"""
from __future__ import annotations

import math

import tensorflow as tf

from hgsgc import ops
from hgsgc.compression import quantize

SUPPORTED_BITS = (2, 32)


def index_width(numel: int) -> int:
    """Bits per index: ``max(1, ceil(log2(numel)))`` (indices are ``0..numel-1``)."""
    return max(1, (int(numel) - 1).bit_length())


def payload_length(numel: int, k: int, bits: int) -> int:
    """Exact payload size in bytes of ``k`` entries of a ``numel``-entry tensor (see module doc).

    Raises:
        ValueError: ``bits`` not in (2, 32) or ``k`` outside ``[0, numel]``.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not 0 <= k <= numel:
        raise ValueError(f"k={k} outside [0, numel={numel}]")
    if k == 0:
        return 0
    idx_bytes = math.ceil(k * index_width(numel) / 8)
    if bits == 2:
        return quantize.SCALE_BYTES + idx_bytes + math.ceil(k / 4)
    return idx_bytes + 4 * k


def _f32_to_bytes(x):
    return tf.reshape(tf.bitcast(tf.cast(x, tf.float32), tf.uint8), [-1])


def _bytes_to_f32(b):
    return tf.bitcast(tf.reshape(b, [-1, 4]), tf.float32)


def encode(indices: tf.Tensor, values: tf.Tensor, numel: int, bits: int):
    """Encode selected entries.

    Args:
        indices: int32 ``[k]``, ascending, in ``[0, numel)``.
        values: float32 ``[k]``.
        numel: entries of the dense tensor; bits: 2 or 32.

    Returns:
        ``(payload uint8 [payload_length(numel, k, bits)], sent float32 [k])`` where ``sent`` is
        what a receiver decodes (the quantized values for bits=2), used for the residual.
    """
    k = int(indices.shape[0])
    n_bytes = payload_length(numel, k, bits)
    if k == 0:
        return tf.zeros([0], tf.uint8), tf.zeros([0], tf.float32)
    values = tf.cast(values, tf.float32)
    idx_packed = ops.pack_bits(indices, index_width(numel))
    if bits == 2:
        codes, scales = quantize.quantize_2bit(values)
        sent = quantize.dequantize_2bit(codes, scales)
        payload = tf.concat([_f32_to_bytes(scales), idx_packed, quantize.pack_codes(codes)], 0)
    else:
        sent = values
        payload = tf.concat([idx_packed, _f32_to_bytes(values)], 0)
    payload = tf.ensure_shape(payload, [n_bytes])
    return payload, sent


def decode(payload: tf.Tensor, numel: int, k: int, bits: int):
    """Inverse of :func:`encode`: uint8 ``[payload_length]`` -> ``(indices int32 [k], values float32 [k])``."""
    if k == 0:
        return tf.zeros([0], tf.int32), tf.zeros([0], tf.float32)
    w = index_width(numel)
    idx_bytes = math.ceil(k * w / 8)
    if bits == 2:
        scales = _bytes_to_f32(payload[: quantize.SCALE_BYTES])
        off = quantize.SCALE_BYTES
        indices = ops.unpack_bits(payload[off: off + idx_bytes], w, k)
        codes = quantize.unpack_codes(payload[off + idx_bytes:], k)
        values = quantize.dequantize_2bit(codes, scales)
    else:
        indices = ops.unpack_bits(payload[:idx_bytes], w, k)
        values = _bytes_to_f32(payload[idx_bytes:])
    return indices, values
