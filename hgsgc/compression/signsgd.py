"""EF-SignSGD: scaled sign compression with error feedback (Karimireddy, Rebjock, Stich, Jaggi
2019, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", Algorithm 1).

Per tensor ``p`` (float32 ``[d]``, the gradient plus the residual), every rank sends
``C(p) = (||p||_1 / d) * sign(p)``: one float32 scale and one sign bit per entry (bit 1 for
``p_i < 0``; ``p_i = 0`` is sent as ``+``), keeps ``e = p - C(p)`` (error feedback) and the
ranks average their ``C(p)`` through one allgather. Payload per rank per tensor:
``4 + ceil(d / 8)`` bytes (a compression ratio of about 32 vs fp32); on the wire
``(n - 1) P`` per rank (:func:`hgsgc.costs.allgather_bytes`).

Usage: ``hgsgc.Compression.efsignsgd()`` or ``compression.method: efsignsgd`` in a config.
This file is the whole method: the setting, the codec, and its registration.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hgsgc.compression import base

SCALE_BYTES = 4  # one float32 scale per tensor


class SignCodec(base.Codec):
    """``[scale float32 (4 B) | sign bits ceil(d / 8) B]``; scale = ``sum|x| / d``."""

    def payload_length(self, numel: int) -> int:
        return SCALE_BYTES + math.ceil(numel / 8) if numel else 0

    def encode(self, x, ctx, index: int):
        """float32 ``x`` ``[d]`` -> ``(payload uint8 [4 + ceil(d / 8)], sent float32 [d])``."""
        import tensorflow as tf

        from hgsgc import ops

        d = int(x.shape[0])
        scale = tf.reduce_sum(tf.abs(x)) / float(d)
        neg = x < 0
        sent = tf.where(neg, -scale, scale)
        payload = tf.concat([tf.reshape(tf.bitcast(tf.reshape(scale, [1]), tf.uint8), [-1]),
                             ops.pack_bits(tf.cast(neg, tf.int32), 1)], 0)
        return tf.ensure_shape(payload, [self.payload_length(d)]), sent

    def decode(self, payload, numel: int):
        """uint8 payload -> float32 ``[numel]`` (``+-scale``)."""
        import tensorflow as tf

        from hgsgc import ops

        scale = tf.bitcast(tf.reshape(payload[:SCALE_BYTES], [1, 4]), tf.float32)[0]
        neg = ops.unpack_bits(payload[SCALE_BYTES:], 1, numel)
        return tf.where(tf.equal(neg, 1), -scale, scale)


@dataclass(frozen=True)
class EFSignSGDCompression:
    """EF-SignSGD setting (module docstring). ``error_feedback=False`` is plain scaled signSGD."""

    error_feedback: bool = True
    method: str = "efsignsgd"
    compressed = True
    algorithm = "allgather"

    def __post_init__(self):
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")

    @property
    def delay(self) -> int:
        return 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def payload_bytes(self, shapes) -> int:
        """``4 + ceil(numel / 8)`` per non-empty float32 tensor of ``shapes`` (bytes)."""
        codec = SignCodec()
        return sum(codec.payload_length(math.prod(int(d) for d in s)) for s in shapes)

    def build(self, env):
        from hgsgc.compression.reducers import Allgather
        from hgsgc.compression.wrappers import ErrorFeedback, Pipeline

        red = Allgather(SignCodec())
        if self.error_feedback:
            red = ErrorFeedback(red, env.stores["residuals"])
        return Pipeline(red)


def efsignsgd(error_feedback: bool = True) -> EFSignSGDCompression:
    """``Compression.efsignsgd()``: EF-SignSGD (Karimireddy et al. 2019)."""
    return EFSignSGDCompression(error_feedback=error_feedback)


base.register("efsignsgd", efsignsgd,
              lambda c, **_: EFSignSGDCompression(error_feedback=c.error_feedback),
              settings=(EFSignSGDCompression,))
