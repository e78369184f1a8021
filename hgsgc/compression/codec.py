"""Top-k codec: :class:`TopKCodec` selects a tensor's top-k entries and encodes them in the wire
format of :mod:`hgsgc.compression.wire` (layout and exact ``payload_length`` formula there; its
functions ``encode``, ``decode``, ``payload_length`` and ``index_width`` are re-exported here), with
the fused kernels of :mod:`hgsgc.compression.kernels` where they are built.
"""
from __future__ import annotations

import tensorflow as tf

from hgsgc import ops
from hgsgc.compression import kernels
# the wire format lives in .wire (imported by the kernels' references too); names kept here
from hgsgc.compression.wire import (DEFAULT_INDEX_CODING, SUPPORTED_BITS,  # noqa: F401
                                    _bytes_to_f32, _f32_to_bytes, decode, encode, index_width,
                                    payload_length)


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
    """Top-k selection + the wire format (:mod:`.wire`): a stateless :class:`hgsgc.compression.base.Codec`.

    Args:
        density: fraction kept, ``k = num_selected(numel, density)``.
        bits: 2 (2-bit codes + [lo, hi] scales) or 32 (fp32 values).
        selector: ``"exact"`` top-k or ``"sampled"`` threshold (seeded by the exchange's
            random-number step: ``[step mod 2^30, 1013]``); both select the same entries.
        index_coding: ``"elias_fano"`` (default, :data:`.wire.DEFAULT_INDEX_CODING`) or
            ``"fixed"`` (``ceil(log2 numel)`` bits per index) (:mod:`.wire`); lossless either
            way, only the payload length differs.
    """

    def __init__(self, density: float, bits: int, selector: str = "exact",
                 index_coding: str = DEFAULT_INDEX_CODING):
        from hgsgc.compression.wire import check_index_coding

        self.density, self.bits, self.selector = density, bits, selector
        self.index_coding = check_index_coding(index_coding)

    def k(self, numel: int) -> int:
        from hgsgc.compression.sparsify import num_selected

        return num_selected(numel, self.density)

    def payload_length(self, numel: int) -> int:
        """:func:`payload_length` with ``k = num_selected(numel, density)`` and this codec's
        ``index_coding``."""
        return payload_length(numel, self.k(numel), self.bits, self.index_coding)

    def select(self, a, k: int, ctx):
        """``(indices int32 [k] ascending, values float32 [k])`` of float32 ``a`` ``[numel]``.

        The fused kernel ``hgsgc.compression.kernels.topk_select`` where the kernels are built (exact top-k by a
        sampled threshold and one pass, seeded by ``ctx.step``), else the selector below; all
        three select the same entries.
        """
        from hgsgc.compression.sparsify import exact_topk, sampled_threshold_topk

        if ops.use_compression_kernels():
            return kernels.topk_select(a, k, seed=ctx.step, backend="custom")
        if self.selector == "sampled":
            seed = tf.stack([tf.cast(ctx.step % 2**30, tf.int32), tf.constant(1013, tf.int32)])
            return sampled_threshold_topk(a, k, seed=seed)
        return exact_topk(a, k)

    def encode_sparse(self, a, ctx):
        """``(payload, indices [k], sent values [k])`` of float32 ``a`` ``[numel]``."""
        numel = int(a.shape[0])
        idx, vals = self.select(a, self.k(numel), ctx)
        if ops.use_compression_kernels():  # fused quantize + pack (same bytes as encode())
            payload, sent = kernels.sparse_encode(idx, vals, numel, self.bits, backend="custom",
                                                  index_coding=self.index_coding)
        else:
            payload, sent = encode(idx, vals, numel, self.bits, self.index_coding)
        return payload, idx, sent

    def encode(self, a, ctx, index: int):
        """``(payload uint8 [payload_length], sent float32 [numel] dense)``."""
        numel = int(a.shape[0])
        payload, idx, sent = self.encode_sparse(a, ctx)
        return payload, tf.scatter_nd(idx[:, None], sent, [numel])

    def decode(self, payload, numel: int):
        """uint8 payload -> float32 ``[numel]`` (zeros off the selection)."""
        idx, vals = decode(payload, numel, self.k(numel), self.bits, self.index_coding)
        return tf.scatter_nd(idx[:, None], vals, [numel])

    def decode_sum(self, gathered, numel: int, offset: int, divisor: int = 1):
        """Rank-order sum of every row's payload at byte ``offset`` of uint8 ``gathered``
        ``[n, P]``: float32 ``[numel]`` (``hgsgc.compression.kernels.decode_accumulate``: one pass per payload,
        no per-rank dense tensor; pure-TF reference: one ``tf.scatter_nd`` of all entries),
        times float32 ``1 / divisor`` when ``divisor > 1`` (the average, scaled by the kernel
        per entry right after its sum: ``kernels.decode_accumulate``)."""
        return kernels.decode_accumulate(gathered, numel, self.k(numel), self.bits, offset=offset,
                                         index_coding=self.index_coding, divisor=divisor)

    def compress_into(self, x, residual, ctx):
        """Error feedback fused with encoding: ``a = x + residual``, payload of ``a``'s top-k,
        and ``residual = a - decode(payload)`` written in place (``hgsgc.compression.kernels.compress_into``).

        Args:
            x: float32 ``[numel]``; residual: float32 ``tf.Variable`` of ``numel`` entries.

        Returns:
            uint8 ``[payload_length(numel)]`` (the bytes :meth:`encode` gives for ``a``).
        """
        numel = int(x.shape[0])
        return kernels.compress_into(x, residual, self.k(numel), self.bits, seed=ctx.step,
                                     index_coding=self.index_coding)

    def compress_momentum_into(self, x, residual, velocity, momentum: float, masking: bool, ctx):
        """DGC momentum correction fused with :meth:`compress_into`: ``u = m v + x``,
        ``v = u`` (masked at the sent entries with ``masking``), the payload of ``u + residual``
        (``hgsgc.compression.kernels.compress_momentum_into``).

        Args:
            x: float32 ``[numel]``; residual, velocity: float32 ``tf.Variable`` of ``numel``
                entries each; momentum: ``m`` (float); masking: bool.

        Returns:
            uint8 ``[payload_length(numel)]``.
        """
        numel = int(x.shape[0])
        return kernels.compress_momentum_into(x, residual, velocity, momentum, self.k(numel),
                                              self.bits, masking, seed=ctx.step,
                                              index_coding=self.index_coding)
