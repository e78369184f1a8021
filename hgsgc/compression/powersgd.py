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


class PowerSGDReducer:
    """PowerSGD's exchange, Algorithm 1 of Vogels et al. 2019 (a :class:`~hgsgc.compression.base.Reducer`).

    Views: tensors that shrink at ``rank`` (:func:`matrix_shape`) as float32 ``[m, p]``
    matrices (error feedback applies), the others as they are (averaged densely, no feedback).
    Per exchange: ``P = allreduce_mean(M Q)`` (one grouped allreduce with the dense tensors),
    ``P = orthogonalize(P)``, ``Q = allreduce_mean(M^T P)`` (a second grouped allreduce),
    output ``P Q^T``; ``Q`` is kept for the next step (warm start; state ``powersgd_q``).
    Bytes: two ring allreduces, of ``4 sum m q + 4 d_dense`` and of ``4 sum p q``.
    ``contributed`` of a matrix is ``P Q^T`` (so ``e = M - P Q^T``, the paper's error feedback).

    Args:
        rank: r >= 1.
        factors: the :class:`~hgsgc.compression.memory.VariableStore` of the ``Q`` ``[p, q]``
            factors (created from :func:`initial_q` on first use).
    """

    def __init__(self, rank: int, factors):
        self.rank = rank
        self.factors = factors

    def view(self, x):
        mpq = matrix_shape(x.shape, self.rank)
        x = tf.cast(x, tf.float32)
        return x if mpq is None else tf.reshape(x, mpq[:2])

    def feedback(self, view) -> bool:
        return view.shape.rank == 2 and matrix_shape(view.shape, self.rank) is not None

    def factor(self, name: str, p: int, q: int):
        """The warm-start factor ``Q`` [p, q] of ``name``."""
        return self.factors.variable(name, [p, q], init=lambda: initial_q(name, p, q))

    def state_dict(self) -> dict:
        return {"powersgd_q": self.factors.state_dict()} if len(self.factors) else {}

    def load_state_dict(self, state: dict) -> None:
        self.factors.load_state_dict(state.get("powersgd_q", {}))

    def reduce(self, views, names, ctx):
        import horovod.tensorflow as hvd

        comm, uid = ctx.comm, ctx.uid
        mats, ms, dense = [], [], []  # mats: (position, m, p, q, name)
        for i, (v, name) in enumerate(zip(views, names)):
            mpq = matrix_shape(v.shape, self.rank) if self.feedback(v) else None
            if mpq is None:
                dense.append(i)
                continue
            m, p, q = mpq
            mats.append((i, m, p, q, name))
            ms.append(v)
        first = [tf.matmul(mat, self.factor(name, p, q)) for mat, (_, _, p, q, name) in zip(ms, mats)]
        first += [views[i] for i in dense]
        p_bytes = 4 * sum(m * q for _, m, _, q, _ in mats)
        q_bytes = 4 * sum(p * q for _, _, p, q, _ in mats)
        dense_bytes = 4 * sum(int(views[i].shape.num_elements()) for i in dense)
        first = comm.grouped_allreduce(first, op=hvd.Average, payload_bytes=p_bytes + dense_bytes,
                                       name=f"hgsgc_powersgd_p_{uid}")
        p_hat = [orthogonalize(pm) for pm in first[:len(mats)]]
        q_new = []
        if mats:
            q_new = comm.grouped_allreduce([tf.matmul(mat, ph, transpose_a=True)
                                            for mat, ph in zip(ms, p_hat)], op=hvd.Average,
                                           payload_bytes=q_bytes, name=f"hgsgc_powersgd_q_{uid}")
        comm.count(payload_bytes=p_bytes + q_bytes + dense_bytes)
        out = [None] * len(views)
        contributed = [None] * len(views)
        updates = []
        for ph, qn, (i, _, _, _, name) in zip(p_hat, q_new, mats):
            approx = tf.matmul(ph, qn, transpose_b=True)
            out[i] = approx
            contributed[i] = approx
            updates.append(self.factors.variable(name, qn.shape).assign(qn))
        for i, avg in zip(dense, first[len(mats):]):
            out[i] = avg
        with tf.control_dependencies(updates):
            return [tf.identity(o) for o in out], contributed
