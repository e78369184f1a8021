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


class TernGradReducer:
    """TernGrad's exchange (a :class:`hgsgc.compression.base.Reducer`; no error feedback).

    Per exchange: clip each flat tensor (``clip_sigma``), one ``allreduce(op=Max)`` of the
    ``L`` per-tensor maxima (the shared scales ``s``, ``4 L`` bytes, ring model), ternarize with
    uniform draws seeded by ``(random step, rank, tensor index)``, one ``allgather`` of the packed
    codes (``C = sum ceil(numel / 4)`` bytes per rank, ``(n - 1) C`` on the wire), decode all
    ``n`` code vectors and average ``s * sum_r t_r / n``. Payload per rank: ``C + 4 L``.
    ``contributed`` is ``None`` (TernGrad is unbiased, it keeps no residual).
    """

    def __init__(self, clip_sigma: float):
        self.clip_sigma = clip_sigma

    def view(self, x):
        return tf.reshape(tf.cast(x, tf.float32), [-1])

    def feedback(self, view) -> bool:
        return False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def reduce(self, views, names, ctx):
        import horovod.tensorflow as hvd

        comm = ctx.comm
        n, rank = comm.size, comm.rank
        flats = [clip(v, self.clip_sigma) for v in views]
        local_max = tf.stack([tf.reduce_max(tf.abs(f)) for f in flats])
        scale = comm.allreduce(local_max, op=hvd.Max, name=f"hgsgc_terngrad_scale_{ctx.uid}")
        payloads, sizes = [], []
        for i, f in enumerate(flats):
            numel = int(f.shape[0])
            u = draw_uniform(numel, ctx.step, rank, i)
            payloads.append(encode(ternarize(f, scale[i], u)))
            sizes.append(code_bytes(numel))
        buf = tf.concat(payloads, 0) if len(payloads) > 1 else payloads[0]
        C = sum(sizes)
        gathered = tf.reshape(comm.allgather(buf), [n, C])
        comm.count(payload_bytes=C + SCALE_BYTES * len(flats))
        results, off = [], 0
        for i, (f, c) in enumerate(zip(flats, sizes)):
            numel = int(f.shape[0])
            total = tf.add_n([decode(gathered[r, off:off + c], numel) for r in range(n)])
            off += c
            results.append(tf.cast(total, tf.float32) * (scale[i] / float(n)))
        return results, [None] * len(views)
