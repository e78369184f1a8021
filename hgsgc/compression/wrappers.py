"""Wrappers around a reducer: error feedback, DGC momentum correction; local clipping and delay.

* :class:`ErrorFeedback` (Seide et al. 2014; Karimireddy et al. 2019): ``a = x + e``; reduce
  ``a``; ``e = a - contributed``, whatever the reducer (written once, for every method).
* :class:`MomentumCorrection` (Lin et al. 2018, Deep Gradient Compression, Sec. 3.2): the
  optimizer's momentum runs before compression, ``u = m u + x``; ``u`` goes to the inner
  reducer; momentum factor masking zeroes ``u`` where the contribution reached the average.
* :func:`clip_by_global_norm_local`: DGC's local gradient clipping to ``c / sqrt(n)``.
* :class:`Pipeline`: one method's composition, ``[local clip] -> view -> reducer (wrappers)``.
* :class:`CommunicationDelay`: H local steps, then the model delta since the last sync is
  exchanged (Lin et al. 2020, local SGD; SGC's communication delay); state: anchors + local step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import tensorflow as tf

from hgsgc.compression.base import Context, Reducer, Wrapper
from hgsgc.compression.memory import ResidualMemory, VariableStore


class ErrorFeedback(Wrapper):
    """Error feedback around any reducer.

    For each view ``x`` (float32) where the reducer says feedback applies:
    ``a = x + e[name]``; after the reduction ``e[name] = a - contributed`` (zero where the
    whole ``a`` reached the average). Views without feedback pass through untouched.
    State: ``{"residuals": {name: float32 array of the view's shape}}``.
    """

    def __init__(self, inner: Reducer, memory: ResidualMemory):
        super().__init__(inner)
        self.memory = memory

    def fused(self, views) -> bool:
        """Whether :meth:`reduce` takes the fused path for ``views`` (the codec compensates,
        encodes and updates the residuals in one pass: ``Allgather`` + ``compress_into``)."""
        from hgsgc.compression.reducers import Allgather

        return (isinstance(self.inner, Allgather) and hasattr(self.inner.codec, "compress_into")
                and all(self.inner.feedback(v) for v in views))

    def reduce(self, views, names, ctx: Context, momentum=None):
        """See :class:`Reducer`. ``momentum``: ``(velocities, m, masking)`` from
        :class:`MomentumCorrection` when its correction is folded into the fused path (only
        where :meth:`fused` holds): the views are then the raw tensors and the codec forms
        ``u = m v + x`` itself (``Allgather.reduce``)."""
        if self.fused(views):
            # fused path (hgsgc.ops.compress_into): compensate, encode and update the residual
            # in place in one pass over each tensor; same residuals and payloads bit for bit
            residuals = [self.memory.residual(nm, v.shape) for nm, v in zip(names, views)]
            return self.inner.reduce(views, names, ctx, residuals=residuals, momentum=momentum)
        if momentum is not None:
            raise ValueError("ErrorFeedback.reduce: momentum is folded in only on the fused "
                             "allgather path (ErrorFeedback.fused(views)); apply it before")
        feedback = [self.inner.feedback(v) for v in views]
        comp = [self.memory.compensate(nm, v) if fb else v
                for v, nm, fb in zip(views, names, feedback)]
        avgs, contributed = self.inner.reduce(comp, names, ctx)
        updates = [self.memory.update(nm, a, c)
                   for a, c, nm, fb in zip(comp, contributed, names, feedback)
                   if fb and c is not None]
        with tf.control_dependencies(updates):
            avgs = [tf.identity(a) for a in avgs]
        return avgs, [c if fb else None for c, fb in zip(contributed, feedback)]

    def own_state(self) -> dict:
        return {"residuals": self.memory.state_dict()}

    def load_own_state(self, state: dict) -> None:
        self.memory.load_state_dict(state.get("residuals", {}))


#: Fold DGC momentum correction into the compression kernel where :meth:`MomentumCorrection._fold`
#: allows it (session 11; False runs the session-10 composition: the same bits, for comparisons).
FOLD_MOMENTUM = True


class MomentumCorrection(Wrapper):
    """DGC momentum correction and momentum factor masking (Lin et al. 2018, Sec. 3.2).

    ``u[name] = m u[name] + x`` (float32, the view's shape), ``u`` is reduced by the inner
    reducer (error feedback inside), and with ``masking`` ``u`` is zeroed where ``contributed !=
    0`` (the entries that were sent; without it ``u`` is kept whole). The optimizer then applies
    the average with momentum 0.
    State: ``{"velocity": {name: float32 array}}``.

    Args:
        momentum: ``m`` in [0, 1).
        velocity: the store holding ``u``.
        masking: momentum factor masking (DGC) on or off (``SparseCompression.momentum_masking``).
    """

    def __init__(self, inner: Reducer, momentum: float, velocity: VariableStore, masking: bool = True):
        super().__init__(inner)
        self.momentum = float(momentum)
        self.velocity = velocity
        self.masking = bool(masking)

    def reduce(self, views, names, ctx: Context):
        from hgsgc.compression import kernels

        m = self.momentum
        vels = [self.velocity.variable(nm, v.shape) for v, nm in zip(views, names)]
        if self._fold(views):
            # session 11: u = m v + x, error feedback, selection, encoding and the masking in one
            # kernel per tensor (HgsgcCompressMomentum, through ErrorFeedback's fused allgather
            # path): the bits of the composed path below (tests/test_kernels11.py)
            return self.inner.reduce(list(views), names, ctx, momentum=(vels, m, self.masking))
        # u = m u + x and the masking below: one C++ pass each where the kernels are built
        # (ops/momentum_mask.cc), else TF ops; the same bits either way (tests/test_kernels10.py)
        # (m = 0 keeps the TF ops: in graphs grappler folds their 0 * v away, so a -0 / NaN of
        # v*0 would come out differently from the kernel's IEEE product)
        us = [kernels.momentum_accumulate(vel, tf.cast(v, tf.float32), m)
              if m != 0.0 and v.shape.is_fully_defined() and v.shape.rank == 1
              else m * vel + tf.cast(v, tf.float32) for v, vel in zip(views, vels)]
        avgs, contributed = self.inner.reduce(us, names, ctx)
        ops = []
        with tf.control_dependencies([a for a in avgs]):
            for u, c, vel in zip(us, contributed, vels):
                if c is None or not self.masking:
                    ops.append(vel.assign(u))
                elif u.shape.rank == 1 and c.shape == u.shape:
                    ops.append(kernels.momentum_mask(vel, u, c))
                else:
                    ops.append(vel.assign(tf.where(tf.equal(c, 0.0), u, 0.0)))
        with tf.control_dependencies([o for o in ops if o is not None]):
            return [tf.identity(a) for a in avgs], contributed

    def _fold(self, views) -> bool:
        """Whether the correction runs inside the compression kernel: the custom kernels are
        built and selected (``kernels.compress_momentum_into``), ``m != 0`` (see the comment in
        :meth:`reduce`), the inner reducer is error feedback on its fused allgather path, and
        every view is a 1-D float32 tensor of a static length."""
        from hgsgc.compression import kernels

        if not FOLD_MOMENTUM or self.momentum == 0.0 or not isinstance(self.inner, ErrorFeedback):
            return False
        if not all(v.dtype == tf.float32 and v.shape.rank == 1 and v.shape.is_fully_defined()
                   for v in views):
            return False
        return self.inner.fused(views) and kernels._compress_momentum_lib(None) is not None

    def own_state(self) -> dict:
        return {"velocity": self.velocity.state_dict()} if len(self.velocity) else {}

    def load_own_state(self, state: dict) -> None:
        self.velocity.load_state_dict(state.get("velocity", {}))


def clip_by_global_norm_local(grads, clip_norm: float, n: int) -> list:
    """Deep Gradient Compression's local gradient clipping (Lin et al. 2018, Sec. 3.2).

    Scales the floating-point entries of ``grads`` (a list; ``None`` and integer entries pass
    through unchanged) by ``min(1, c / ||g||_2)`` with ``c = clip_norm / sqrt(n)`` and
    ``||g||_2`` the global L2 norm over all of them, computed in float32 whatever their dtypes
    (the formula of ``tf.clip_by_global_norm``); each keeps its dtype. ``n`` ranks' local clips
    sum to one global clip at ``clip_norm``.
    """
    out = list(grads)
    keep = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        g = tf.convert_to_tensor(g)
        if g.dtype.is_floating:
            keep.append((i, g))
    if not keep:
        return out
    total = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for _, g in keep]))
    clip = float(clip_norm) / float(n) ** 0.5
    scale = clip / tf.maximum(total, clip)
    for i, g in keep:
        out[i] = g * tf.cast(scale, g.dtype)
    return out


def local_clip(grads, compression, n: int) -> list:
    """:func:`clip_by_global_norm_local` with ``compression.local_clip_norm`` (no-op when unset)."""
    norm = getattr(compression, "local_clip_norm", None)
    if not norm:
        return list(grads)
    return clip_by_global_norm_local(grads, norm, n)


class CommunicationDelay:
    """Communication delay H > 1: local steps, then a synchronised model delta.

    The optimizer applies each rank's own gradient locally; after every H-th local step the
    delta ``w_sync - w`` (per variable) goes through the exchanger (error feedback included)
    and every rank sets ``w = w_sync = w_sync - average``. State:
    ``{"anchors": [numpy arrays, one per variable], "local_step": int}`` once built.

    Args:
        delay: H >= 1.
    """

    def __init__(self, delay: int):
        self.delay = int(delay)
        self.anchors: Optional[List[tf.Variable]] = None
        self.local_step: Optional[tf.Variable] = None
        self._pending: Optional[dict] = None

    def build(self, variables):
        """Create the anchors (copies of ``variables``) and the local step on first use.

        Raises:
            ValueError: later calls pass a different number of variables.
        """
        if self.anchors is None:
            with tf.init_scope():
                self.local_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="hgsgc_local_step")
                self.anchors = [tf.Variable(v.read_value(), trainable=False,
                                            name="hgsgc_anchor_" + v.name.replace(":", "_"))
                                for v in variables]
            if self._pending is not None:
                state, self._pending = self._pending, None
                self.load_state_dict(state)
        if len(self.anchors) != len(variables):
            raise ValueError("with delay > 1 every apply_gradients call must pass the same variables")

    def sync(self, variables, names, exchange):
        """Exchange the model delta since the last sync through ``exchange(tensors, names)``."""
        deltas = [a - v for a, v in zip(self.anchors, variables)]
        avg = exchange(deltas, names)
        ops = []
        for a, v, d in zip(self.anchors, variables, avg):
            new = a - d
            ops.append(v.assign(new))
            ops.append(a.assign(new))
        with tf.control_dependencies(ops):
            return tf.constant(True)

    def state_dict(self) -> dict:
        if self.anchors is None:
            return {}
        return {"anchors": [a.numpy() for a in self.anchors],
                "local_step": int(self.local_step.numpy())}

    def load_state_dict(self, state: dict) -> None:
        """Restore anchors and local step (before they are built: kept and applied at build)."""
        if "anchors" in state and self.anchors is None:
            self._pending = dict(state)
            return
        if "anchors" in state:
            with tf.init_scope():
                for a, s in zip(self.anchors, state["anchors"]):
                    a.assign(s)
                self.local_step.assign(int(state["local_step"]))


class DenseVectors:
    """The dense part of a sparse setting with ``dense_vectors`` (tensors of rank < 2).

    They are averaged by one grouped fp32 ring allreduce; with DGC momentum correction on (the
    optimizer then runs with momentum 0) their momentum is applied after the average,
    ``u[name] = m u[name] + avg`` and ``u`` is returned: plain momentum SGD for these tensors,
    as Deep Gradient Compression's reference implementation does for the parameters it does not
    sparsify. State: the ``velocity`` store shared with :class:`MomentumCorrection`.

    Args:
        reducer: a :class:`hgsgc.compression.reducers.DenseAllreduce`.
        momentum: ``m`` in [0, 1), or None (no momentum here: the optimizer applies it).
        velocity: the store holding ``u`` (needed when ``momentum`` is set).
    """

    def __init__(self, reducer, momentum: Optional[float] = None, velocity: Optional[VariableStore] = None):
        self.reducer = reducer
        self.momentum = None if momentum is None else float(momentum)
        self.velocity = velocity

    def run(self, tensors: List[tf.Tensor], names: List[str], ctx: Context) -> List[tf.Tensor]:
        """Averages of ``tensors`` (float, any shape; same shapes and dtypes back)."""
        avgs = self.reducer.reduce_raw([tf.cast(t, tf.float32) for t in tensors], ctx)
        if self.momentum is None:
            return [tf.cast(a, t.dtype) for a, t in zip(avgs, tensors)]
        out = []
        for a, t, nm in zip(avgs, tensors, names):
            u = self.velocity.variable(nm, a.shape)
            new = self.momentum * u + a
            with tf.control_dependencies([u.assign(new)]):
                out.append(tf.cast(tf.identity(new), t.dtype))
        return out


@dataclass
class Pipeline:
    """One method's composition: optional local clipping, then ``reducer`` (wrappers inside).

    Attributes:
        reducer: the outermost reducer / wrapper.
        clip_norm: DGC local clipping norm (global L2, before the division by sqrt(n)) or None.
    """

    reducer: Reducer
    clip_norm: Optional[float] = None
    dense: Optional[DenseVectors] = None

    def run(self, tensors: List, names: List[str], ctx: Context) -> List:
        """Average floating, non-empty ``tensors`` (any shapes / float dtypes) over the ranks.

        With ``dense`` set, tensors of rank < 2 go to it (after local clipping, which sees all
        tensors) and the rest to ``reducer``.

        Returns:
            averages with the tensors' shapes and dtypes.
        """
        if self.clip_norm:
            tensors = clip_by_global_norm_local(tensors, self.clip_norm, ctx.comm.size)
        vec = [i for i, t in enumerate(tensors) if t.shape.rank < 2] if self.dense is not None else []
        if not vec:
            return self._reduce(tensors, names, ctx)
        mat = [i for i, t in enumerate(tensors) if t.shape.rank >= 2]
        out = [None] * len(tensors)
        for idx, fn in ((vec, self.dense.run), (mat, self._reduce)):  # dense collective first
            if idx:
                for i, a in zip(idx, fn([tensors[i] for i in idx], [names[i] for i in idx], ctx)):
                    out[i] = a
        return out

    def _reduce(self, tensors: List, names: List[str], ctx: Context) -> List:
        """``reducer`` over ``tensors`` (viewed, then back to their shapes and dtypes)."""
        views = [self.reducer.view(t) for t in tensors]
        avgs, _ = self.reducer.reduce(views, names, ctx)
        return [tf.cast(tf.reshape(a, t.shape), t.dtype) for a, t in zip(avgs, tensors)]
