"""Wire codec: one sparse tensor as one contiguous uint8 payload of exactly known length.

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


def exchange_payload_bytes(compression, shapes) -> int:
    """A rank's payload in bytes for one exchange of float32 tensors of ``shapes``.

    The setting's own formula (``setting.payload_bytes(shapes)``): sparse settings sum
    :func:`payload_length` with ``k = num_selected(numel, density)``; TernGrad:
    ``ceil(numel / 4) + 4`` per tensor; PowerSGD: ``4 (m + p) q`` per compressed matrix, ``4 numel``
    otherwise; dense settings: ``wire_bytes_per_entry * numel`` (4 for fp32, 2 for fp16).

    Raises:
        TypeError: ``compression`` is not a supported setting.
    """
    from hgsgc.compression import as_compression

    return as_compression(compression).payload_bytes(shapes)


class TopKCodec:
    """Top-k selection + the wire codec above: a stateless :class:`hgsgc.compression.base.Codec`.

    Args:
        density: fraction kept, ``k = num_selected(numel, density)``.
        bits: 2 (2-bit codes + [lo, hi] scales) or 32 (fp32 values).
        selector: ``"exact"`` top-k or ``"sampled"`` threshold (seeded by the exchange's
            random-number step: ``[step mod 2^30, 1013]``); both select the same entries.
    """

    def __init__(self, density: float, bits: int, selector: str = "exact"):
        self.density, self.bits, self.selector = density, bits, selector

    def k(self, numel: int) -> int:
        from hgsgc.compression.sparsify import num_selected

        return num_selected(numel, self.density)

    def payload_length(self, numel: int) -> int:
        """:func:`payload_length` with ``k = num_selected(numel, density)``."""
        return payload_length(numel, self.k(numel), self.bits)

    def select(self, a, k: int, ctx):
        """``(indices int32 [k] ascending, values float32 [k])`` of float32 ``a`` ``[numel]``.

        The fused kernel ``hgsgc.ops.topk_select`` where the kernels are built (exact top-k by a
        sampled threshold and one pass, seeded by ``ctx.step``), else the selector below; all
        three select the same entries.
        """
        from hgsgc.compression.sparsify import exact_topk, sampled_threshold_topk

        if ops.use_compression_kernels():
            return ops.topk_select(a, k, seed=ctx.step, backend="custom")
        if self.selector == "sampled":
            seed = tf.stack([tf.cast(ctx.step % 2**30, tf.int32), tf.constant(1013, tf.int32)])
            return sampled_threshold_topk(a, k, seed=seed)
        return exact_topk(a, k)

    def encode_sparse(self, a, ctx):
        """``(payload, indices [k], sent values [k])`` of float32 ``a`` ``[numel]``."""
        numel = int(a.shape[0])
        idx, vals = self.select(a, self.k(numel), ctx)
        if ops.use_compression_kernels():  # fused quantize + pack (same bytes as encode())
            payload, sent = ops.sparse_encode(idx, vals, numel, self.bits, backend="custom")
        else:
            payload, sent = encode(idx, vals, numel, self.bits)
        return payload, idx, sent

    def encode(self, a, ctx, index: int):
        """``(payload uint8 [payload_length], sent float32 [numel] dense)``."""
        numel = int(a.shape[0])
        payload, idx, sent = self.encode_sparse(a, ctx)
        return payload, tf.scatter_nd(idx[:, None], sent, [numel])

    def decode(self, payload, numel: int):
        """uint8 payload -> float32 ``[numel]`` (zeros off the selection)."""
        idx, vals = decode(payload, numel, self.k(numel), self.bits)
        return tf.scatter_nd(idx[:, None], vals, [numel])

    def decode_sum(self, gathered, numel: int, offset: int):
        """Rank-order sum of every row's payload at byte ``offset`` of uint8 ``gathered``
        ``[n, P]``: float32 ``[numel]`` (``hgsgc.ops.decode_accumulate``: one pass per payload,
        no per-rank dense tensor; pure-TF reference: one ``tf.scatter_nd`` of all entries)."""
        return ops.decode_accumulate(gathered, numel, self.k(numel), self.bits, offset=offset)

    def compress_into(self, x, residual, ctx):
        """Error feedback fused with encoding: ``a = x + residual``, payload of ``a``'s top-k,
        and ``residual = a - decode(payload)`` written in place (``hgsgc.ops.compress_into``).

        Args:
            x: float32 ``[numel]``; residual: float32 ``tf.Variable`` of ``numel`` entries.

        Returns:
            uint8 ``[payload_length(numel)]`` (the bytes :meth:`encode` gives for ``a``).
        """
        numel = int(x.shape[0])
        return ops.compress_into(x, residual, self.k(numel), self.bits, seed=ctx.step)
