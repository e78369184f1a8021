"""``DistributedOptimizer`` and ``DistributedGradientTape``: Horovod's API plus ``compression=``.

Both take the same arguments as ``horovod.tensorflow.keras.DistributedOptimizer`` /
``horovod.tensorflow.DistributedGradientTape``; ``compression`` additionally accepts
``hgsgc.Compression.topk/sgc/localsgd/dgc/terngrad/powersgd``. Gradients are averaged through
:class:`hgsgc.communicator.Exchanger`; every rank applies the identical update.

Communication delay (``delay=H > 1``, the "communication delay" of SGC and local SGD of
Lin et al. 2020): the optimizer applies each rank's own gradient locally; after every H-th
local step it exchanges ``a = (w_sync - w) + residual`` (the model delta since the last sync,
compressed with error feedback), and sets ``w = w_sync = w_sync - average(a)`` on every rank.
Ranks must start from identical weights (``hvd.broadcast_variables`` before the first step, as
with Horovod); then the weights are identical on every rank right after each sync.
"""
from __future__ import annotations

import numbers
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc.communicator import Exchanger
from hgsgc.compression import Compression, as_compression
from hgsgc.compression.wrappers import CommunicationDelay, local_clip  # noqa: F401 (re-exported)
from hgsgc.faults import NONFINITE_MODES


def _var_names(variables):
    names, seen = [], {}
    for i, v in enumerate(variables):
        base = getattr(v, "name", None) or f"tensor_{i}"
        c = seen.get(base, 0)
        seen[base] = c + 1
        names.append(base if c == 0 else f"{base}#{c}")
    return names


def _check_unsupported(op, gradient_predivide_factor, backward_passes_per_step, groups, num_groups):
    if op is not hvd.Average and op != hvd.Average:
        raise ValueError("hgsgc averages gradients: op must be hvd.Average")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor is not supported by hgsgc: leave it at 1.0")
    if backward_passes_per_step != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported: use "
                         "Compression.sgc(..., delay=H) for fewer synchronizations")
    if groups is not None or num_groups:
        raise ValueError("groups/num_groups are not supported: hgsgc sends one fused payload per step "
                         "(Compression.sgc/topk/dgc(..., buckets=B) splits it into B allgathers, "
                         "last layers first)")


class _HgsgcOptimizerMixin:
    """Methods mixed into the wrapped Keras legacy optimizer class."""

    def _hgsgc_setup(self, compression, process_set, correction_momentum=None):
        self._hgsgc_compression = as_compression(compression)
        self._hgsgc_exchanger = Exchanger(self._hgsgc_compression, process_set,
                                          momentum=correction_momentum)
        self._hgsgc_delay = CommunicationDelay(self._hgsgc_compression.delay)
        self._hgsgc_sync_fn = None
        self._hgsgc_guard_setup()

    @property
    def hgsgc_exchanger(self) -> Exchanger:
        """The :class:`Exchanger` (its ``stats`` and ``memory`` hold byte counts and residuals)."""
        return self._hgsgc_exchanger

    @property
    def hgsgc_stats(self):
        return self._hgsgc_exchanger.stats

    @property
    def _hgsgc_anchors(self):
        return self._hgsgc_delay.anchors

    @property
    def _hgsgc_local_step(self):
        return self._hgsgc_delay.local_step

    # --- reliability guards (hgsgc.faults; docs/reliability.md) -------------------------------
    def _hgsgc_guard_setup(self):
        self._hgsgc_nonfinite = "off"
        self._hgsgc_checked = set()
        with tf.init_scope():
            self._hgsgc_skipped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="hgsgc_skipped_steps")

    def hgsgc_set_nonfinite(self, mode: str):
        """What a NaN/Inf gradient does: ``"off"`` (default: no check), ``"skip"`` (the step is
        not applied, on every rank alike with delay 1 (dense exchanges: checked on the average,
        which carries any rank's NaN/Inf, no extra collective; compressed exchanges: one 4-byte
        ``allreduce(op=Min)`` per step before the exchange, which writes residuals)
        or on the rank that saw it with delay > 1 (a local step applies only the rank's own
        gradient, so no other rank has it to skip; the sync schedule is kept and the sync averages
        each rank's accepted updates, so every rank leaves it with the same weights; see
        docs/reliability.md), a warning is printed and :attr:`hgsgc_skipped_steps` counts it on
        the rank that skipped) or ``"raise"``
        (every rank stops with an error). Either way nothing non-finite enters a residual.
        Set it before the first step is traced.

        Raises:
            ValueError: another mode.
        """
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite mode must be one of {NONFINITE_MODES}, got {mode!r}")
        self._hgsgc_nonfinite = mode

    @property
    def hgsgc_skipped_steps(self) -> int:
        """Steps skipped so far because of a NaN/Inf gradient (this rank's count)."""
        return int(self._hgsgc_skipped.numpy())

    def variables(self):
        """The Keras optimizer's variables plus, with delay, the sync anchors and local step,
        so Horovod's ``BroadcastGlobalVariablesCallback`` / ``broadcast_variables(opt.variables())``
        move the anchors together with the weights (otherwise ranks that started from
        different weights keep different anchors and never agree again)."""
        extra = []
        if getattr(self, "_hgsgc_anchors", None) is not None:
            extra = list(self._hgsgc_anchors) + [self._hgsgc_local_step]
        return list(super().variables()) + extra

    def _hgsgc_guard(self, grads, variables, names, apply_fn, collective: bool, exchange_fn=None):
        """Densify, then :func:`_guard_nonfinite` with this optimizer's mode (see
        :meth:`hgsgc_set_nonfinite`): ``apply_fn(values)`` runs unless a gradient is non-finite;
        returns a scalar bool tensor (False: the step was skipped).

        ``exchange_fn`` (a dense exchange without state: no residual, no compression) runs first
        and the check runs on its average, which every rank receives alike and which carries any
        rank's NaN/Inf (NaN + x = NaN, Inf + finite = Inf, Inf - Inf = NaN), so no extra collective
        is needed; ``apply_fn`` then gets the average. Otherwise ``collective`` asks for one 4-byte
        ``allreduce(op=Min)`` of the local verdict (delay 1) or a local check (delay > 1) before
        ``apply_fn`` exchanges."""
        from hgsgc import faults

        ps = self._hgsgc_exchanger.process_set
        on_some = "on some rank:" if collective else f"on rank {hvd.rank()}:"
        return _guard_nonfinite(
            faults.densify(grads, variables), names, mode=self._hgsgc_nonfinite, process_set=ps,
            settings=_settings(self._hgsgc_compression, self._hgsgc_exchanger.momentum),
            guard={"nonfinite": self._hgsgc_nonfinite},
            checked=self._hgsgc_checked, key=tuple(names), exchange=exchange_fn,
            stateless=exchange_fn is not None, apply=apply_fn, collective=collective,
            counter=self._hgsgc_skipped,
            warning=lambda inc: ["hgsgc: warning: NaN/Inf gradient", on_some, "step",
                                 self.iterations, "skipped (faults.nonfinite=skip)"],
            warn=hvd.rank() == _lead_rank(ps) or not collective,
            raise_message=["hgsgc: NaN/Inf gradient (faults.nonfinite=raise) at optimizer step",
                           self.iterations],
            verdict_name="hgsgc_finite")

    # --- mixed precision: Keras' LossScaleOptimizer around this optimizer --------------------
    def _aggregate_gradients(self, grads_and_vars):
        """Keras calls this to average gradients before it applies them. Called by our own
        :meth:`apply_gradients` (through Keras' ``apply_gradients``) it does nothing beyond
        Keras' default; called from outside, it is Keras' ``LossScaleOptimizer`` (mixed
        precision, also added by ``model.compile`` under a ``mixed_float16`` policy), which
        aggregates here so that every rank sees the same NaN/Inf and skips the same steps (as
        Horovod's optimizer does). Then the exchange runs here, guarded: a compressed exchange
        first agrees on the ranks' finiteness (one 4-byte ``allreduce(op=Min)``) and, when any
        rank overflowed, returns all-NaN gradients on every rank without exchanging (residuals,
        velocity and byte counts untouched), so every rank's loss scale drops alike and the
        step is skipped everywhere; a dense exchange (``none`` / ``fp16``) carries any rank's
        NaN/Inf in its average. The following inner ``apply_gradients`` applies the average
        without exchanging again.

        Raises:
            ValueError: ``delay > 1`` (local steps are per rank, so a loss-scale skip on one rank
                would break the ranks' common sync schedule).
        """
        if getattr(self, "_hgsgc_applying", False):
            return super()._aggregate_gradients(grads_and_vars)
        return self._hgsgc_loss_scaled_exchange(grads_and_vars)

    def _hgsgc_loss_scaled_exchange(self, grads_and_vars):
        from hgsgc import faults

        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        if self._hgsgc_compression.delay != 1:
            raise ValueError(
                "hgsgc: a LossScaleOptimizer (mixed precision; model.compile adds one under a "
                "mixed_float16 policy) around hgsgc.DistributedOptimizer needs delay 1: a loss-scale "
                "skip happens on one rank's local step only and would break the ranks' common sync "
                f"schedule (delay is {self._hgsgc_compression.delay}); use delay=1 or float32")
        variables = [v for _, v in grads_and_vars]
        names = _var_names(variables)
        key = tuple(names)
        ex = self._hgsgc_exchanger
        # always guarded, whatever the nonfinite mode: an overflow is the loss scaler's business
        # (it halves its scale and skips), so a skip hands it all-NaN gradients on every rank
        avg = _guard_nonfinite(
            faults.densify([g for g, _ in grads_and_vars], variables), names, mode="skip",
            process_set=ex.process_set, settings=_settings(self._hgsgc_compression, ex.momentum),
            guard={"nonfinite": self._hgsgc_nonfinite, "loss_scale": True},
            checked=self._hgsgc_checked, key=key, exchange=lambda g: ex.exchange(g, names),
            stateless=ex.pipeline is None, skip_with="nan", verdict_name="hgsgc_loss_scale_finite")
        self._hgsgc_pre_averaged = key
        return list(zip(avg, variables))

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        names = _var_names(variables)
        if getattr(self, "_hgsgc_pre_averaged", None) == tuple(names):
            # the LossScaleOptimizer's aggregation exchanged these already: apply the average
            self._hgsgc_pre_averaged = None
            self._hgsgc_applying = True
            try:
                return super().apply_gradients(grads_and_vars, name=name,
                                               experimental_aggregate_gradients=False)
            finally:
                self._hgsgc_applying = False
        self._hgsgc_applying = True
        try:
            return self._hgsgc_apply_gradients(grads_and_vars, variables, names, name,
                                               experimental_aggregate_gradients)
        finally:
            self._hgsgc_applying = False

    def _hgsgc_apply_gradients(self, grads_and_vars, variables, names, name,
                               experimental_aggregate_gradients):
        delay = self._hgsgc_compression.delay
        sup = super()
        if delay == 1:
            def apply_avg(avg):
                pairs = [(g, v) for g, v in zip(avg, variables) if g is not None]
                return sup.apply_gradients(pairs, name=name,
                                           experimental_aggregate_gradients=experimental_aggregate_gradients)

            def exchange(grads):
                return self._hgsgc_exchanger.exchange(grads, names)  # clip, DGC, EF inside

            grads = [g for g, _ in grads_and_vars]
            if self._hgsgc_exchanger.pipeline is None:  # dense, stateless: check the average
                return self._hgsgc_guard(grads, variables, names, apply_avg, collective=True,
                                         exchange_fn=exchange)
            # compressed: residuals are written inside the exchange, so check before it
            return self._hgsgc_guard(grads, variables, names,
                                     lambda g: apply_avg(exchange(g)), collective=True)
        self._hgsgc_delay.build(variables)

        def apply_local(grads):
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            return sup.apply_gradients(pairs, name=name,
                                       experimental_aggregate_gradients=experimental_aggregate_gradients)

        done = self._hgsgc_guard([g for g, _ in grads_and_vars], variables, names, apply_local,
                                 collective=False)
        with tf.control_dependencies([done]):  # skipped or not: the sync schedule is the same
            step = self._hgsgc_delay.local_step.assign_add(1)
            tf.cond(tf.equal(step % delay, 0), lambda: self._hgsgc_sync(variables, names),
                    lambda: tf.constant(False))
        return done

    def _hgsgc_build_delay(self, variables):
        """Create the delay anchors and local step for ``variables`` now (checkpoint restore)."""
        self._hgsgc_delay.build(variables)

    def _hgsgc_sync(self, variables, names):
        """Exchange the model delta since the last sync; all ranks end on identical weights."""
        return self._hgsgc_delay.sync(variables, names, self._hgsgc_exchanger.exchange)

    def hgsgc_set_density(self, density: float):
        """Change the density of a sparse compression (e.g. DGC's warm-up of sparsity).

        Residuals and byte counters are kept. Payload sizes are fixed when a step is traced, so
        the caller must trace its step function again (a new ``tf.function``); the pending-sync
        function of :meth:`hgsgc_synchronize` (delay > 1) is retraced here at its next call.

        Raises:
            ValueError: the compression is dense, or ``density`` is outside (0, 1].
        """
        import dataclasses

        comp = self._hgsgc_compression
        if not hasattr(comp, "density"):
            raise ValueError(f"compression {comp.to_dict()} has no density to change")
        comp = dataclasses.replace(comp, density=float(density))
        self._hgsgc_compression = comp
        self._hgsgc_exchanger.compression = comp  # same state, new composition
        self._hgsgc_sync_fn = None  # traced with the old k: the end-of-epoch sync must use the new one

    def hgsgc_synchronize(self, variables):
        """Run the pending sync now if local steps were taken since the last one (delay > 1).

        Call it before evaluating or saving so every rank holds the same synced weights; the
        next sync then comes after another ``delay`` local steps. Every rank must call it (it is a
        collective when a sync is pending; all ranks have the same local step count).

        Returns:
            True if an exchange ran.
        """
        if self._hgsgc_compression.delay == 1 or self._hgsgc_delay.anchors is None:
            return False
        if int(self._hgsgc_delay.local_step.numpy()) % self._hgsgc_compression.delay == 0:
            return False
        variables = list(variables)
        if self._hgsgc_sync_fn is None:
            names = _var_names(variables)
            self._hgsgc_sync_fn = tf.function(lambda: self._hgsgc_sync(variables, names))
        self._hgsgc_sync_fn()
        self._hgsgc_delay.local_step.assign(0)
        return True

    def hgsgc_state(self) -> dict:
        """The full hgsgc state tree (plain nested dicts of numpy arrays and ints, for checkpoints).

        Keys: ``residuals`` ``{name: float32 array}`` (error feedback), ``rng_step`` (int, the
        random-number step of the sampled selector / TernGrad), ``stats`` ``{counter: int}``
        (the byte counters of :class:`hgsgc.comm.CommStats`), ``skipped_steps`` (int, this
        rank's :attr:`hgsgc_skipped_steps`, so a resumed run's count continues); when present
        ``velocity`` (DGC momentum correction), ``powersgd_q`` (PowerSGD warm-start factors)
        and, with delay, ``anchors`` (list of arrays, one per variable) and ``local_step`` (int).
        """
        return {**self._hgsgc_exchanger.state_dict(), **self._hgsgc_delay.state_dict(),
                "skipped_steps": int(self._hgsgc_skipped.numpy())}

    def load_hgsgc_state(self, state: dict):
        """Restore :meth:`hgsgc_state` output (anchors before the first step are kept and
        applied when they are built).

        Raises:
            ValueError: a saved array's shape differs from the existing variable's.
        """
        self._hgsgc_exchanger.load_state_dict(
            {k: v for k, v in state.items() if k not in ("anchors", "local_step", "skipped_steps")})
        self._hgsgc_delay.load_state_dict(state)
        if "skipped_steps" in state:  # checkpoints before session 9 lack it: the count restarts
            with tf.init_scope():
                self._hgsgc_skipped.assign(int(state["skipped_steps"]))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=hvd.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set,
                         scale_local_gradients=True):
    """Wrap a Keras legacy optimizer so ``apply_gradients`` averages through ``compression``.

    Same arguments as ``horovod.tensorflow.keras.DistributedOptimizer``; ``compression`` also
    accepts ``hgsgc.Compression.topk(...)``, ``.sgc(...)`` and ``.localsgd(H)``. Works with
    ``model.fit`` and custom loops (``opt.apply_gradients(zip(local_grads, vars))``).

    Args:
        optimizer: a ``tf.keras.optimizers.legacy.Optimizer`` instance (e.g. legacy ``SGD``).
        compression: how gradients (or, with delay, model deltas) are exchanged.
        process_set: Horovod process set whose ranks average together.

    Returns:
        an optimizer of a subclass of ``optimizer``'s class with the same configuration; its
        ``hgsgc_stats`` holds exact byte counts, ``hgsgc_state()`` the residuals.

    Raises:
        TypeError: ``optimizer`` is not a Keras legacy optimizer (Keras 2.15's new optimizers
            are not supported, as in Horovod 0.28), or ``compression`` is unsupported.
        ValueError: an argument hgsgc does not support (``op`` other than Average, grouping,
            pre-division, ``backward_passes_per_step > 1``).
    """
    if not isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer):
        raise TypeError(f"hgsgc.DistributedOptimizer needs a tf.keras.optimizers.legacy optimizer, "
                        f"got {type(optimizer).__name__}: use e.g. tf.keras.optimizers.legacy.SGD")
    _check_unsupported(op, gradient_predivide_factor, backward_passes_per_step, groups, num_groups)
    comp = as_compression(compression)
    base = optimizer.__class__
    cls = type(base.__name__, (_HgsgcOptimizerMixin, base), {})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    correction_momentum = None
    if getattr(comp, "momentum_correction", False):
        if "momentum" not in config:
            raise ValueError(f"momentum_correction needs an optimizer with momentum; "
                             f"{base.__name__} has none: use tf.keras.optimizers.legacy.SGD(momentum=...)")
        correction_momentum = float(config["momentum"])
        config["momentum"] = 0.0  # momentum moves before sparsification (DGC)
        if "nesterov" in config and config["nesterov"]:
            raise ValueError("momentum_correction implements plain momentum: set nesterov=False")
    new = cls.from_config(config)
    new._hgsgc_setup(comp, process_set, correction_momentum)
    return new


def _lead_rank(process_set) -> int:
    """The lowest world rank of ``process_set`` (0 for Horovod's global set, whose ``ranks`` is
    None before initialisation): the one rank that prints a warning for the whole set, so a set
    without world rank 0 (the Hourglass FC ranks) still warns, once."""
    ranks = getattr(process_set, "ranks", None)
    return min(ranks) if ranks else 0


def _settings(comp, momentum=None) -> dict:
    """``comp.to_dict()`` (JSON-like), compared across ranks by the first step's signature check,
    with ``momentum`` (the DGC correction momentum: the wrapped optimizer's, or the tape's
    ``momentum=``) when it is not None. Before session 13 the optimizer left the momentum out, so
    ranks built with ``SGD(momentum=0.9)`` and ``0.8`` trained silently."""
    to_dict = getattr(comp, "to_dict", None)
    out = dict(to_dict()) if callable(to_dict) else {"compression": repr(comp)}
    if momentum is not None:
        out["momentum"] = momentum
    return out


def _guard_nonfinite(grads, names, *, mode, process_set, settings, guard, checked, key,
                     exchange=None, stateless=False, apply=None, skip_with=None, collective=True,
                     counter=None, warning=None, warn=False, raise_message=(),
                     verdict_name="hgsgc_finite", verdict_id=None):
    """The non-finite guard of every exchange in this module: optimizer steps
    (``hgsgc_set_nonfinite``), tape ``gradient()`` calls (``nonfinite=``) and the loss-scale
    optimizer's aggregation (mixed precision). docs/reliability.md.

    1. Once per ``key`` (added to the set ``checked``): :func:`hgsgc.faults.check_same_signature`
       of ``names`` / ``grads`` / ``settings`` / ``guard`` across ``process_set`` (a collective).
    2. ``mode == "off"``: exchange (and apply), no check.
    3. The verdict, a scalar bool: ``stateless`` (a dense exchange without state, e.g. an
       allreduce) exchanges first and checks the average, which carries any rank's NaN/Inf, with
       no extra collective; otherwise, ``collective``: one 4-byte ``allreduce(op=Min)`` of the
       local verdict before the exchange (which writes residuals), the same on every rank;
       not ``collective``: the local gradients only (delay > 1's local steps).
    4. ``"raise"``: a ``tf.debugging.Assert`` with ``raise_message`` in front of the exchange.
       ``"skip"`` (and the tape's ``"nan"``): ``tf.cond`` of the exchange against a skip that
       runs no exchange (residuals, velocity, byte counts untouched) and adds 1 to ``counter``
       (if given), printing ``warning(incremented counter)`` to stderr where ``warn``.

    What a skip returns is the parameter ``apply`` / ``skip_with``:

    * ``apply`` given (the optimizer): ``apply(exchanged values)`` applies the step; the result is
      a scalar bool tensor, False when the step was skipped (nothing applied);
    * ``skip_with="zeros"`` (tape ``"skip"``) or ``"nan"`` (tape ``"nan"``, the loss-scale path: a
      loss scaler then halves its scale and skips on every rank alike): the result is the list of
      exchanged values (``None`` where ``grads`` has ``None``), on a skip all-zero / all-NaN
      tensors of the gradients' shapes and dtypes.

    Args:
        grads: list of dense tensors or ``None`` (:func:`hgsgc.faults.densify` first).
        names: their names (the signature check's). exchange: ``list -> list`` of the same
            length (default: the identity: nothing exchanged).
        verdict_name, verdict_id: the verdict allreduce is named ``f"{verdict_name}_{verdict_id}"``
            (default id: ``len(checked)``), the same on every rank of ``process_set``.

    Raises:
        ValueError: (check) a signature / setting / guard that differs across ranks; a
            ``skip_with`` other than ``"zeros"`` / ``"nan"`` without ``apply``.
        tf.errors.InvalidArgumentError: (``"raise"``, when run) a NaN/Inf gradient.
    """
    from hgsgc import faults

    if apply is None and skip_with not in ("zeros", "nan"):
        raise ValueError(f"skip_with must be 'zeros' or 'nan' without apply, got {skip_with!r}")
    if key not in checked:
        faults.check_same_signature(names, grads, process_set, settings=settings, guard=guard)
        checked.add(key)
    exchange = exchange if exchange is not None else list
    live = [i for i, g in enumerate(grads) if g is not None]
    if stateless:  # the average is what is checked: exchange first
        values = list(exchange(grads))
        step = lambda: values  # noqa: E731
    else:
        step = lambda: list(exchange(grads))  # noqa: E731

    def run():
        out = step()
        if apply is None:
            return [out[i] for i in live]
        op = apply(out)
        with tf.control_dependencies([op] if op is not None else []):
            return tf.constant(True)

    def finish(kept):
        if apply is not None:
            return kept
        out = [None] * len(grads)
        for i, t in zip(live, kept):
            out[i] = t
        return out

    if mode == "off":
        return finish(run())
    if stateless:
        ok = faults.all_finite(values)
    elif collective:
        uid = len(checked) if verdict_id is None else verdict_id
        ok = faults.all_ranks_finite(grads, process_set, name=f"{verdict_name}_{uid}")
    else:
        ok = faults.all_finite(grads)
    if mode == "raise":
        with tf.control_dependencies([tf.debugging.Assert(ok, list(raise_message))]):
            kept = run()
            return finish(kept if apply is not None else [tf.identity(t) for t in kept])

    def skip():
        deps = []
        if counter is not None:
            inc = counter.assign_add(1)
            deps.append(inc)
            if warn and warning is not None:
                deps.append(tf.print(*warning(inc), output_stream=sys.stderr))
        with tf.control_dependencies(deps):
            if apply is not None:
                return tf.constant(False)
            return [tf.zeros_like(grads[i]) if skip_with == "zeros"
                    else tf.fill(tf.shape(grads[i]), tf.constant(float("nan"), grads[i].dtype))
                    for i in live]

    return finish(tf.cond(ok, run, skip))


#: ``DistributedGradientTape(nonfinite=...)``: the optimizer's modes plus ``"nan"`` (for a
#: LossScaleOptimizer: a skipped call returns all-NaN gradients on every rank).
TAPE_NONFINITE_MODES = NONFINITE_MODES + ("nan",)
_TAPE_EXCHANGERS = {}  # (compression, id(process_set), source ids, momentum) -> (keep-alive refs, Exchanger)
_TAPE_CHECKED = set()  # (id(exchanger), names): ranks' gradient signatures compared already
_TAPE_SKIPPED = {}  # id(exchanger) -> int64 tf.Variable: gradient() calls skipped for NaN/Inf


def _tape_skipped_var(exchanger) -> tf.Variable:
    """The skipped-call counter of the tapes sharing ``exchanger`` (created on first use)."""
    key = id(exchanger)
    if key not in _TAPE_SKIPPED:
        with tf.init_scope():
            _TAPE_SKIPPED[key] = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="hgsgc_tape_skipped_steps")
    return _TAPE_SKIPPED[key]


def _tape_exchanger(comp, process_set, sources, momentum=None) -> Exchanger:
    """The Exchanger of tapes with this setting, process set and set of variables (a model)."""
    ids = tuple(id(v) if isinstance(v, tf.Variable) else None for v in sources)
    key = (comp, id(process_set), ids, momentum)
    if key not in _TAPE_EXCHANGERS:
        _TAPE_EXCHANGERS[key] = ((process_set, list(sources)),
                                 Exchanger(comp, process_set, momentum=momentum))
    return _TAPE_EXCHANGERS[key][1]


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged through ``compression``.

    Same arguments as ``horovod.tensorflow.DistributedGradientTape``, plus ``momentum`` for
    DGC. Every compression runs the same composition as through
    :func:`DistributedOptimizer` (local clipping, momentum correction, error feedback, reducer),
    except communication delay, which needs the optimizer (it exchanges model deltas after local
    steps), so ``delay`` must be 1 here.

    DGC (``Compression.dgc`` or any setting with ``momentum_correction``) needs the momentum
    ``m``: pass ``momentum=m`` and apply the returned update with an optimizer whose momentum is
    0 (the tape keeps the velocity ``u = m u + g`` and masks it, Lin et al. 2018); without
    ``momentum`` the tape refuses the setting.

    As in Horovod, a new tape is usually wrapped every step (often inside a ``tf.function``), so
    the compression state (residuals, velocity, PowerSGD's factors, the random-number step, byte
    counts) lives in one :class:`Exchanger` per (compression setting, process set, variables
    differentiated, momentum) in the process, shared by every tape built with them: two models
    keep separate state even when their layer names coincide. ``tape.exchanger`` is set by the
    first ``gradient()`` call; :meth:`hgsgc_state` / :meth:`load_hgsgc_state` save and restore
    the state tree.

    The first ``gradient()`` of a model compares every rank's gradient names, shapes and dtypes
    (one small collective, as :func:`DistributedOptimizer` does), so a model that differs across
    ranks stops every rank with the same error naming the variable.

    ``nonfinite`` (what a NaN/Inf gradient on any rank does, as ``faults.nonfinite`` of
    ``hgsgc train``): ``"off"`` (default, as Horovod: no check; with error feedback one NaN then
    stays in the residual and every later average is NaN), ``"raise"`` (every rank stops with the
    same ``InvalidArgumentError`` before the exchange writes a residual) or ``"skip"`` (on every
    rank alike, ``gradient()`` returns all-zero gradients and the exchange does not run: residuals,
    velocity, PowerSGD factors and byte counts stay as they were, a warning is printed on the
    process set's first rank and :attr:`skipped_steps` counts it). A compressed exchange costs one
    4-byte ``allreduce(op=Min)`` of the local verdict per call; a dense exchange without state
    (``Compression.none`` / ``fp16``) is checked on the average, which carries any rank's NaN/Inf,
    with no extra collective: that allreduce has run when the call is skipped, so its bytes are
    counted (the byte counters and ``rng_step`` include the skipped call; nothing else changes). Zero gradients change nothing under plain SGD, but an optimizer with
    momentum or Adam still advances its own slots: for an exact skip of the whole step use
    :func:`DistributedOptimizer` with ``hgsgc_set_nonfinite("skip")``.

    Mixed precision (dynamic loss scaling, ``tf.keras.mixed_precision.LossScaleOptimizer``): pass
    ``nonfinite="nan"``. The loss scaler lowers its scale only when it sees a non-finite gradient;
    as with Horovod's tape (whose average carries any rank's Inf/NaN), an overflow on any rank must
    reach it on every rank. ``"nan"`` does that without letting the overflow into compression
    state: when any rank's gradient is non-finite, ``gradient()`` returns all-NaN gradients on
    every rank and the exchange does not run (residuals, velocity, PowerSGD factors and byte
    counts untouched; dense ``none`` / ``fp16``: its allreduce ran, as for ``"skip"``), so
    ``apply_gradients`` of the loss scaler halves its scale and skips the step on every rank
    alike; :attr:`skipped_steps` counts these calls (no warning: overflows are how the scaler
    finds its scale). Under a float16 Keras policy (``mixed_float16``) two modes are refused
    with an error naming ``"nan"``: ``"skip"``, whose zeros look finite to the scaler, so its
    scale never drops (before the check, 2 ranks, a float16 loss overflowing at the initial scale
    2^15: 6 of 6 calls skipped, scale still 32768), and ``"off"`` with a compression that keeps
    state (error feedback, DGC, PowerSGD), which lets the overflow into it (every later average
    non-finite). ``"off"`` with ``none`` / ``fp16`` / TernGrad behaves as Horovod's tape and
    stays allowed.

    Units (``loss_scale_optimizer``): ``gradient()`` gets gradients of the *scaled* loss and the
    caller unscales its result (``opt.get_unscaled_gradients``), as with Horovod's tape. Pass the
    ``LossScaleOptimizer`` whose ``get_scaled_loss`` scaled the target as
    ``loss_scale_optimizer=opt``: a compressed exchange (every setting but ``none`` / ``fp16``)
    then runs on ``g * (1 / s)`` (``s`` = ``opt.loss_scale`` read at each call, the reciprocal and
    product as Keras' ``get_unscaled_gradients`` computes them) and returns ``average * s``, so the
    state carried across calls (error-feedback residuals, DGC velocity, PowerSGD's error buffer and
    factors) and DGC's local clipping threshold are in unscaled units whatever the scale does.
    The caller's unscaling then gives exactly the average of
    ``LossScaleOptimizer(hgsgc.DistributedOptimizer(...))``, which exchanges unscaled gradients:
    bit for bit when ``s`` is a power of two (dynamic loss scaling only uses powers of two:
    ``2^15`` at start, halved / doubled), else within two fp32 roundings (the product by ``s``
    and the caller's by ``1 / s``). Unscaling before the exchange was chosen over rescaling the
    carried state by ``s_new / s_old`` at each call: it needs no list of stateful leaves (every
    wrapper, also the dense-vector velocity, is covered), no saved "scale of the state" in a
    checkpoint (the state is always unscaled, so ``hgsgc_state()`` moves between the tape and the
    optimizer path and a resume needs only the ``LossScaleOptimizer``'s own checkpoint), and DGC's
    local clipping (not scale-equivariant) then clips the true gradient, as the optimizer path
    does. Dense ``none`` / ``fp16`` keep the scaled gradients (as Horovod: fp16 loses small
    unscaled values; fp32 averages scale exactly). Without ``loss_scale_optimizer`` the tape cannot
    know the scale: a stateful compression then keeps its state in units of the scale of the call
    that left it (a scale change makes the carried residual count twice / half against the next
    gradient, once), and under a float16 policy the tape warns, naming ``loss_scale_optimizer``.

    Raises:
        ValueError: ``compression`` with ``delay > 1``; momentum correction without
            ``momentum`` (or ``momentum`` outside [0, 1)); an unsupported Horovod argument;
            ``nonfinite`` not one of ``"off"``, ``"skip"``, ``"raise"``, ``"nan"``;
            under a float16 (``mixed_float16``) Keras policy, ``nonfinite="skip"``, or ``"off"``
            with a compression that keeps state; ``loss_scale_optimizer`` that is not a Keras
            ``LossScaleOptimizer`` (no ``loss_scale`` / ``get_unscaled_gradients``);
            (from ``gradient()``) a gradient whose shape or dtype differs across ranks.
        tf.errors.InvalidArgumentError: (from ``gradient()``, ``nonfinite="raise"``) a NaN/Inf
            gradient on some rank, on every rank alike.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=hvd.global_process_set,
                 scale_local_gradients=True, momentum=None, nonfinite="off",
                 loss_scale_optimizer=None):
        _check_unsupported(op, gradient_predivide_factor, 1, groups, num_groups)
        if not isinstance(nonfinite, str) or nonfinite not in TAPE_NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(TAPE_NONFINITE_MODES)}, got {nonfinite!r}")
        comp = as_compression(compression)
        policy = tf.keras.mixed_precision.global_policy()
        # state an overflow would poison: residuals (error feedback; DGC velocity needs it) or
        # PowerSGD's warm-started factors (TernGrad and the dense settings keep none)
        stateful = comp.compressed and (getattr(comp, "error_feedback", False)
                                        or getattr(comp, "method", None) == "powersgd")
        if policy.compute_dtype == "float16" and (nonfinite == "skip" or (
                nonfinite == "off" and stateful)):
            why = ("a skipped call returns zeros, which a LossScaleOptimizer takes for finite "
                   "gradients, so its loss scale never drops and every later step overflows again"
                   if nonfinite == "skip" else
                   f"compression {comp.to_dict().get('method')} keeps state across calls "
                   "(residuals, velocity or PowerSGD factors): a loss-scale overflow (Inf gradient) "
                   "would enter it and every later average would be non-finite")
            raise ValueError(
                f"DistributedGradientTape(nonfinite={nonfinite!r}) under the {policy.name} policy: "
                f"{why}; pass nonfinite='nan' (a NaN/Inf on any rank gives all-NaN gradients on "
                "every rank without exchanging, so the loss scaler halves its scale and skips the "
                "step everywhere) or 'raise'")
        self._nonfinite = nonfinite
        if loss_scale_optimizer is not None and not (
                hasattr(loss_scale_optimizer, "loss_scale")
                and callable(getattr(loss_scale_optimizer, "get_unscaled_gradients", None))):
            raise ValueError(
                "DistributedGradientTape(loss_scale_optimizer=...) takes the "
                "tf.keras.mixed_precision.LossScaleOptimizer whose get_scaled_loss() scaled the "
                f"target, got {type(loss_scale_optimizer).__name__}; leave it None without loss scaling")
        # state kept across calls (error feedback, DGC velocity, PowerSGD): in unscaled units only
        # if the tape knows the scale (docstring, "Units")
        if (loss_scale_optimizer is None and policy.compute_dtype == "float16" and
                (stateful or getattr(comp, "momentum_correction", False))):
            import warnings

            warnings.warn(
                f"hgsgc: DistributedGradientTape with compression {comp.to_dict().get('method')} "
                f"under the {policy.name} policy without loss_scale_optimizer: its residuals / "
                "velocity / factors are kept in units of the loss scale, so each scale change makes "
                "the carried state count twice or half; pass loss_scale_optimizer=<your "
                "LossScaleOptimizer> to keep them in unscaled units", stacklevel=2)
        self._loss_scale_opt = loss_scale_optimizer if comp.compressed else None
        if comp.delay != 1:
            raise ValueError("DistributedGradientTape exchanges every step: use "
                             "hgsgc.DistributedOptimizer for compression with delay > 1")
        if getattr(comp, "momentum_correction", False):
            if momentum is None:
                raise ValueError(
                    f"compression {comp.to_dict().get('method')} does DGC momentum correction, which "
                    "needs the momentum: pass DistributedGradientTape(..., momentum=0.9) and apply "
                    "the result with an optimizer whose momentum is 0, or use "
                    "hgsgc.DistributedOptimizer(SGD(momentum=0.9), compression=...)")
            if isinstance(momentum, bool) or not (isinstance(momentum, numbers.Real)
                                                  and 0.0 <= float(momentum) < 1.0):
                raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
            momentum = float(momentum)
        else:
            momentum = None
        self._tape = gradtape
        self._comp, self._process_set, self._momentum = comp, process_set, momentum
        self._pending_state = None
        self.exchanger = None

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """Local gradients of ``target`` w.r.t. ``sources`` (any nest), averaged over ranks."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_src = tf.nest.flatten(sources)
        self.exchanger = _tape_exchanger(self._comp, self._process_set, flat_src, self._momentum)
        if self._pending_state is not None:
            self._load_state(self._pending_state)
            self._pending_state = None
        from hgsgc import faults

        # IndexedSlices dense, unknown static shapes from the sources (as the optimizer does)
        flat_g = faults.densify(tf.nest.flatten(grads, expand_composites=False), flat_src)
        names = _var_names(flat_src)
        ex, ps, mode = self.exchanger, self._process_set, self._nonfinite
        lso, scale = self._loss_scale_opt, None
        if lso is not None:  # exchange in unscaled units (docstring, "Units")
            scale = tf.convert_to_tensor(lso.loss_scale)  # read now: apply_gradients updates it
            recip = 1.0 / scale  # as Keras' get_unscaled_gradients
            flat_g = [None if g is None else g * tf.cast(recip, g.dtype) for g in flat_g]
        avg = _guard_nonfinite(
            flat_g, names, mode=mode, process_set=ps,
            settings=_settings(self._comp, self._momentum), guard={"nonfinite": mode},
            checked=_TAPE_CHECKED, key=(id(ex), tuple(names)),  # once per model, as the optimizer
            exchange=lambda g: ex.exchange(g, names), stateless=ex.pipeline is None,
            skip_with="nan" if mode == "nan" else "zeros",
            counter=_tape_skipped_var(ex) if mode in ("skip", "nan") else None,
            warning=lambda inc: ["hgsgc: warning: NaN/Inf gradient on some rank: tape gradient() "
                                 "skipped (nonfinite='skip'), skipped so far:", inc],
            warn=mode == "skip" and hvd.rank() == _lead_rank(ps),
            raise_message=["hgsgc: NaN/Inf gradient on some rank (DistributedGradientTape "
                           "nonfinite=raise)"],
            # named after the exchanger (numbered per process set), not after the process-wide
            # count of checked tapes, which differs on a rank that also ran tapes on other sets
            verdict_name="hgsgc_tape_finite", verdict_id=ex._uid)
        if scale is not None:  # back to the units of the scaled loss: the caller unscales
            avg = [None if a is None else a * tf.cast(scale, a.dtype) for a in avg]
        return tf.nest.pack_sequence_as(grads, avg)

    @property
    def skipped_steps(self) -> int:
        """``gradient()`` calls skipped so far for a NaN/Inf gradient (``nonfinite="skip"``), the
        same count on every rank; 0 before the first call."""
        if self.exchanger is None or id(self.exchanger) not in _TAPE_SKIPPED:
            return 0
        return int(_TAPE_SKIPPED[id(self.exchanger)].numpy())

    def hgsgc_state(self) -> dict:
        """The state tree of this tape's exchanger (as ``DistributedOptimizer.hgsgc_state()``,
        without delay keys; ``skipped_steps`` (int) is :attr:`skipped_steps`); ``{}`` before the
        first ``gradient()`` call."""
        if self.exchanger is None:
            return {}
        return {**self.exchanger.state_dict(), "skipped_steps": self.skipped_steps}

    def load_hgsgc_state(self, state: dict):
        """Restore :meth:`hgsgc_state` output (before the first ``gradient()`` call it is kept
        and applied when the exchanger is found)."""
        if self.exchanger is None:
            self._pending_state = dict(state)
        else:
            self._load_state(state)

    def _load_state(self, state: dict):
        self.exchanger.load_state_dict({k: v for k, v in state.items() if k != "skipped_steps"})
        if "skipped_steps" in state:  # states saved before session 10 lack it
            with tf.init_scope():
                _tape_skipped_var(self.exchanger).assign(int(state["skipped_steps"]))

    def __getattr__(self, item):
        return getattr(self._tape, item)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)


class SynchronizeCallback(tf.keras.callbacks.Callback):
    """``model.fit`` with communication delay: run the pending sync where ``hgsgc train`` does.

    With ``delay=H > 1`` a sync follows every H-th local step, so an epoch whose step count is
    not a multiple of H ends with each rank holding its own local weights; ``hgsgc train`` then
    calls :meth:`DistributedOptimizer.hgsgc_synchronize` before evaluating. This callback does
    the same inside ``model.fit``: before every evaluation (fit's ``validation_data``, and
    ``model.evaluate(..., callbacks=[...])``), at the end of every epoch and at the end of
    training, so validation metrics, ``ModelCheckpoint`` files and the weights ``fit`` returns
    are the same on every rank. Every rank must use it (a sync is a collective). No-op for
    delay 1, for an optimizer without ``hgsgc_synchronize`` and when no local step is pending.
    Keras calls ``on_epoch_end`` in list order: put this callback **before** ``ModelCheckpoint``
    (and any other callback that reads the weights at epoch end), or those see the unsynced
    local weights of the epoch's last steps.

    Args:
        variables: the variables the optimizer trains (default: ``model.trainable_variables``).
    """

    def __init__(self, variables=None):
        super().__init__()
        self._variables = variables

    def _sync(self):
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and hasattr(opt, "hgsgc_synchronize"):
            opt.hgsgc_synchronize(self._variables if self._variables is not None
                                  else self.model.trainable_variables)

    def on_test_begin(self, logs=None):
        self._sync()

    def on_epoch_end(self, epoch, logs=None):
        self._sync()

    def on_train_end(self, logs=None):
        self._sync()
