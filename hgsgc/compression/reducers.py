"""Reducers: how the ranks' payloads meet (:class:`hgsgc.compression.base.Reducer`).

Bytes per rank per exchange come from :mod:`hgsgc.costs` through the collectives of
:class:`hgsgc.comm.Communicator`; each reducer records its own payload bytes.

* :class:`DenseAllreduce`: Horovod ring allreduce (average) of the tensors as they are
  (fp32, or fp16 on the wire); payload ``w d`` (``w`` = 4 fp32, 2 fp16), sent = received =
  ``2 (n - 1) / n * w d``. Also used for integer tensors under any setting.
* :class:`Allgather`: every rank encodes with a codec, one ``allgather`` of the concatenated
  payloads (``P`` bytes per rank; sent = received = ``(n - 1) P``), every rank decodes all ``n``
  payloads, sums them in rank order and divides by ``n``.
* :class:`Hierarchical`: the top-k reduction of :mod:`hgsgc.hierarchy` (``tree`` / ``node``).

TernGrad's and PowerSGD's reducers live with their algorithms (:mod:`.terngrad`,
:mod:`.powersgd`). A C++ kernel plugs in as a codec (``encode`` / ``decode`` of
:class:`~hgsgc.compression.base.Codec`) or as a reducer with the same ``reduce`` contract.
"""
from __future__ import annotations

from typing import List, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc.compression.base import Codec, Context, Reducer


class DenseAllreduce:
    """Horovod grouped ring allreduce (average) of raw tensors (any dtype, any shape).

    Args:
        wire_bytes_per_entry: 4 (fp32) or 2 (fp16 on the wire) for floating tensors; integer
            tensors count their own item size.
        horovod_compression: ``hvd.Compression.none`` or ``.fp16``.
    """

    def __init__(self, wire_bytes_per_entry: int = 4, horovod_compression=None):
        self.per_entry = wire_bytes_per_entry
        self.hvd_comp = horovod_compression if horovod_compression is not None else hvd.Compression.none

    def payload_bytes(self, tensors) -> int:
        return sum(int(t.shape.num_elements()) * (self.per_entry if t.dtype.is_floating else t.dtype.size)
                   for t in tensors)

    def reduce_raw(self, tensors: List[tf.Tensor], ctx: Context) -> List[tf.Tensor]:
        """The averages (same shapes and dtypes); records ``payload_bytes``.

        fp16 on the wire: ``sum_r fp16(x_r / n)`` (scaled by ``1/n`` BEFORE the fp16 cast, op Sum),
        so values whose sum over ranks exceeds the float16 range (65504) but whose average does
        not stay finite (Horovod's ``Compression.fp16`` with ``op=Average`` casts first and sums
        in fp16, giving inf); integer tensors are averaged uncompressed in a second call.
        """
        payload = self.payload_bytes(tensors)
        ctx.comm.count(payload_bytes=payload)
        n = ctx.comm.size
        if self.hvd_comp is not hvd.Compression.fp16 or n == 1:
            return ctx.comm.grouped_allreduce(list(tensors), op=hvd.Average,
                                              compression=self.hvd_comp, payload_bytes=payload)
        out = list(tensors)
        fl = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
        other = [i for i, t in enumerate(tensors) if not t.dtype.is_floating]
        if fl:
            scaled = [tf.cast(tf.cast(tensors[i], tf.float32) / float(n), tf.float16) for i in fl]
            summed = ctx.comm.grouped_allreduce(scaled, op=hvd.Sum)
            for i, r in zip(fl, summed):
                out[i] = tf.cast(r, tensors[i].dtype)
        if other:
            avg = ctx.comm.grouped_allreduce([tensors[i] for i in other], op=hvd.Average)
            for i, r in zip(other, avg):
                out[i] = r
        return out


def bucket_indices(sizes: Sequence[int], buckets: int) -> List[List[int]]:
    """Cut tensors ``0..len(sizes)-1`` into at most ``buckets`` allgather groups, last tensor first.

    Walking from the last tensor to the first (the order in which a backward pass produces the
    gradients of a model whose variables are listed in forward order), a group is closed as soon
    as the payload walked so far reaches ``(g + 1) / buckets`` of the total ``P = sum(sizes)``
    (``g`` groups closed before). So every group but the last holds at least ``P / buckets``
    bytes minus the previous groups' excess, one large tensor may take several shares, and the
    first layers' tensors (ready last) end in the last, usually small, group.

    Args:
        sizes: payload bytes per tensor (ints >= 0), in the exchange's tensor order.
        buckets: the most groups (int >= 1).

    Returns:
        the groups in exchange order (group 0 = the last tensors); each a list of tensor indices
        in ascending order. Every index appears exactly once; ``buckets=1`` gives one group
        ``[0, ..., len(sizes) - 1]``; no group is empty.

    Raises:
        ValueError: ``buckets`` not an integer >= 1, or a size < 0.
    """
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"buckets must be an integer >= 1, got {buckets!r}")
    if any(int(s) < 0 for s in sizes):
        raise ValueError(f"payload sizes must be >= 0, got {list(sizes)}")
    m = len(sizes)
    if m == 0:
        return []
    if buckets == 1:
        return [list(range(m))]
    total = sum(int(s) for s in sizes)
    groups, cur, acc = [], [], 0
    for i in range(m - 1, -1, -1):
        cur.append(i)
        acc += int(sizes[i])
        if len(groups) < buckets - 1 and acc * buckets >= (len(groups) + 1) * total and i > 0:
            groups.append(sorted(cur))
            cur = []
    if cur:
        groups.append(sorted(cur))
    return groups


class Allgather(Reducer):
    """Flat exchange of codec payloads through allgathers (module docstring).

    ``contributed`` is this rank's decoded payload (``sent``), all of which is in the sum.

    Args:
        codec: encodes / decodes one tensor's payload.
        buckets: 1 (default): one allgather of every tensor's payload. B > 1: at most B
            allgathers, the tensors grouped by :func:`bucket_indices` (last tensors first), each
            issued as soon as its own payloads are encoded (no dependency on the other groups),
            so it can overlap the rest of the backward pass inside one ``tf.function``. The
            per-tensor payloads, decodes and averages do not depend on B.
    """

    def __init__(self, codec: Codec, buckets: int = 1):
        self.codec = codec
        self.buckets = buckets

    def reduce(self, views, names, ctx: Context, residuals=None, momentum=None):
        """See :class:`Reducer`. ``residuals`` (error feedback fused into the codec, from
        :class:`hgsgc.compression.wrappers.ErrorFeedback`): one float32 ``tf.Variable`` per view;
        the codec's ``compress_into`` compensates, encodes and updates them in place, and the
        views are the uncompensated tensors. ``momentum`` (with ``residuals``; DGC momentum
        correction fused in, from :class:`hgsgc.compression.wrappers.MomentumCorrection`):
        ``(velocities, m, masking)``, one float32 ``tf.Variable`` per view; the codec's
        ``compress_momentum_into`` forms ``u = m v + x``, compresses ``u`` as above and leaves
        the (masked) ``u`` in the velocity; the views are then the raw tensors ``x``."""
        n = ctx.comm.size
        payloads, sents, sizes = [], [], []
        for i, a in enumerate(views):
            if residuals is not None and momentum is not None:
                vels, m, masking = momentum
                payload = self.codec.compress_momentum_into(a, residuals[i], vels[i], m, masking, ctx)
            elif residuals is not None:
                payload = self.codec.compress_into(a, residuals[i], ctx)
            if residuals is not None:
                # the dense sent tensor (contributed; DGC's masking read it before session 11,
                # now done inside HgsgcCompressMomentum; pruned in graphs when unused):
                # the payload decoded as a one-row decode_sum (HgsgcDecodeAccumulate with the
                # kernels: one op per tensor, where codec.decode runs ~20 TF ops); the same bits
                # as codec.decode (tests/test_kernels10.py)
                sent = (self.codec.decode_sum(tf.reshape(payload, [1, -1]), int(a.shape[0]), 0)
                        if hasattr(self.codec, "decode_sum") else self.codec.decode(payload, int(a.shape[0])))
            else:
                payload, sent = self.codec.encode(a, ctx, i)
            payloads.append(payload)
            sents.append(sent)
            sizes.append(int(payload.shape[0]))
        avgs = [None] * len(views)
        for group in bucket_indices(sizes, self.buckets):
            P = sum(sizes[i] for i in group)
            buf = tf.concat([payloads[i] for i in group], 0) if len(group) > 1 else payloads[group[0]]
            gathered = tf.reshape(ctx.comm.allgather(buf), [n, P])
            ctx.comm.count(payload_bytes=P)
            off = 0
            for i in group:
                numel, p = int(views[i].shape[0]), sizes[i]
                if hasattr(self.codec, "decode_sum"):
                    # all n payloads in one pass each, and the average's scaling by float32(1/n)
                    # in the same kernel (the bits that `total / float(n)` gave inside a
                    # tf.function, where grappler folds it into that multiplication)
                    avgs[i] = self.codec.decode_sum(gathered, numel, off, divisor=n)
                else:
                    dense = [self.codec.decode(gathered[r, off:off + p], numel) for r in range(n)]
                    total = tf.add_n(dense) if n > 1 else dense[0]
                    avgs[i] = total / float(n)
                off += p
        return avgs, sents


class Hierarchical(Reducer):
    """``hierarchy="tree"`` / ``"node"``: top-k reduction along a schedule (:mod:`hgsgc.hierarchy`).

    ``contributed`` is this rank's payload minus the pieces of the merges this rank keeps
    (dropped entries, re-quantization error), so error feedback preserves the mass identity
    ``sum_r a_r = n * average + sum_r e_r'``.

    Args:
        codec: a :class:`hgsgc.compression.codec.TopKCodec`.
        plan: zero-argument callable returning the :class:`hgsgc.hierarchy.Plan`.
    """

    def __init__(self, codec, plan):
        self.codec = codec
        self.plan = plan

    def reduce(self, views, names, ctx: Context):
        from hgsgc import hierarchy

        plan = self.plan()
        return hierarchy.exchange(views, codec=self.codec, ctx=ctx, plan=plan)
