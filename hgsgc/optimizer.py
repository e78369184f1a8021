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

import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc.communicator import Exchanger
from hgsgc.compression import Compression, as_compression


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
        raise ValueError("groups/num_groups are not needed: hgsgc sends one fused payload per step")


def local_clip(grads, compression, n: int):
    """Deep Gradient Compression's local gradient clipping (Lin et al. 2018, Sec. 3.2).

    Scales the rank's floating-point gradients (a list; ``None`` and integer entries pass
    through) by ``min(1, c / ||g||_2)`` with ``c = compression.local_clip_norm / sqrt(n)`` and
    ``||g||_2`` the global L2 norm over all of them, computed in float32 whatever their dtypes
    (the formula of ``tf.clip_by_global_norm``). A no-op when the setting has no
    ``local_clip_norm``. Returns the list.
    """
    norm = getattr(compression, "local_clip_norm", None)
    if not norm:
        return list(grads)
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
    clip = float(norm) / float(n) ** 0.5
    scale = clip / tf.maximum(total, clip)
    for i, g in keep:
        out[i] = g * tf.cast(scale, g.dtype)
    return out


class _HgsgcOptimizerMixin:
    """Methods mixed into the wrapped Keras legacy optimizer class."""

    def _hgsgc_setup(self, compression, process_set, correction_momentum=0.0):
        self._hgsgc_compression = as_compression(compression)
        self._hgsgc_mc_momentum = float(correction_momentum)
        self._hgsgc_velocity = {}
        self._hgsgc_exchanger = Exchanger(self._hgsgc_compression, process_set)
        self._hgsgc_anchors = None
        self._hgsgc_local_step = None
        self._hgsgc_sync_fn = None
        self._hgsgc_guard_setup()

    @property
    def hgsgc_exchanger(self) -> Exchanger:
        """The :class:`Exchanger` (its ``stats`` and ``memory`` hold byte counts and residuals)."""
        return self._hgsgc_exchanger

    @property
    def hgsgc_stats(self):
        return self._hgsgc_exchanger.stats

    # --- reliability guards (hgsgc.faults; docs/reliability.md) -------------------------------
    def _hgsgc_guard_setup(self):
        self._hgsgc_nonfinite = "off"
        self._hgsgc_checked = set()
        with tf.init_scope():
            self._hgsgc_skipped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="hgsgc_skipped_steps")

    def hgsgc_set_nonfinite(self, mode: str):
        """What a NaN/Inf gradient does: ``"off"`` (default: no check), ``"skip"`` (the step is
        not applied, on every rank alike with delay 1 (one 4-byte ``allreduce(op=Min)`` per step)
        or on the rank that saw it with delay > 1 (local steps are local; the sync schedule is
        kept), a warning is printed and :attr:`hgsgc_skipped_steps` counts it) or ``"raise"``
        (every rank stops with an error). Either way nothing non-finite enters a residual.
        Set it before the first step is traced.

        Raises:
            ValueError: another mode.
        """
        from hgsgc.faults import NONFINITE_MODES

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

    def _hgsgc_guard(self, grads, variables, names, apply_fn, collective: bool):
        """Densify, check shapes across ranks once, then run ``apply_fn(grads)`` unless a
        gradient is non-finite (see :meth:`hgsgc_set_nonfinite`)."""
        from hgsgc import faults

        grads = faults.densify(grads, variables)
        key = tuple(names)
        if key not in self._hgsgc_checked:
            faults.check_same_signature(names, grads, self._hgsgc_exchanger.process_set)
            self._hgsgc_checked.add(key)
        mode = self._hgsgc_nonfinite
        if mode == "off":
            apply_fn(grads)
            return tf.constant(True)
        if collective:
            ok = faults.all_ranks_finite(grads, self._hgsgc_exchanger.process_set,
                                         name=f"hgsgc_finite_{len(self._hgsgc_checked)}")
        else:
            ok = faults.all_finite(grads)
        if mode == "raise":
            with tf.control_dependencies([tf.debugging.Assert(
                    ok, ["hgsgc: NaN/Inf gradient (faults.nonfinite=raise) at optimizer step",
                         self.iterations])]):
                apply_fn(grads)
                return tf.constant(True)

        def run():
            op = apply_fn(grads)
            with tf.control_dependencies([op] if op is not None else []):
                return tf.constant(True)

        def skip():
            inc = self._hgsgc_skipped.assign_add(1)
            with tf.control_dependencies([inc]):
                if hvd.rank() == 0 or not collective:
                    pr = tf.print("hgsgc: warning: NaN/Inf gradient",
                                  "on some rank:" if collective else f"on rank {hvd.rank()}:",
                                  "step", self.iterations, "skipped (faults.nonfinite=skip)",
                                  output_stream=sys.stderr)
                    with tf.control_dependencies([pr]):
                        return tf.constant(False)
                return tf.constant(False)

        return tf.cond(ok, run, skip)

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        names = _var_names(variables)
        delay = self._hgsgc_compression.delay
        sup = super()
        if delay == 1:
            def apply_synced(grads):
                grads = local_clip(grads, self._hgsgc_compression, self._hgsgc_exchanger.size)
                if getattr(self._hgsgc_compression, "momentum_correction", False):
                    avg = self._hgsgc_corrected_exchange(grads, names)
                else:
                    avg = self._hgsgc_exchanger.exchange(grads, names)
                pairs = [(g, v) for g, v in zip(avg, variables) if g is not None]
                return sup.apply_gradients(pairs, name=name,
                                           experimental_aggregate_gradients=experimental_aggregate_gradients)

            return self._hgsgc_guard([g for g, _ in grads_and_vars], variables, names,
                                     apply_synced, collective=True)
        self._hgsgc_build_delay(variables)

        def apply_local(grads):
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            return sup.apply_gradients(pairs, name=name,
                                       experimental_aggregate_gradients=experimental_aggregate_gradients)

        done = self._hgsgc_guard([g for g, _ in grads_and_vars], variables, names, apply_local,
                                 collective=False)
        with tf.control_dependencies([done]):  # skipped or not: the sync schedule is the same
            step = self._hgsgc_local_step.assign_add(1)
            tf.cond(tf.equal(step % delay, 0), lambda: self._hgsgc_sync(variables, names),
                    lambda: tf.constant(False))
        return done

    def _hgsgc_corrected_exchange(self, grads, names):
        """DGC momentum correction + momentum factor masking around the exchange."""
        m = self._hgsgc_mc_momentum
        mem = self._hgsgc_exchanger.memory
        us, r_old = [], []
        for g, name in zip(grads, names):
            if g is None:
                us.append(None)
                r_old.append(None)
                continue
            g = tf.convert_to_tensor(g)
            if name not in self._hgsgc_velocity:
                with tf.init_scope():
                    self._hgsgc_velocity[name] = tf.Variable(
                        tf.zeros(g.shape, tf.float32), trainable=False,
                        name="hgsgc_velocity/" + name.replace(":", "_"))
            u = m * self._hgsgc_velocity[name] + tf.cast(g, tf.float32)
            us.append(u)
            # the Exchanger keeps residuals flat ([numel])
            r_old.append(tf.identity(mem.residual(name, [g.shape.num_elements()]))
                         if g.dtype.is_floating and g.shape.num_elements() else None)
        avg = self._hgsgc_exchanger.exchange(us, names)
        ops = []
        with tf.control_dependencies([a for a in avg if a is not None]):
            for u, r0, name in zip(us, r_old, names):
                if u is None:
                    continue
                if r0 is None or name not in mem.names():
                    ops.append(self._hgsgc_velocity[name].assign(u))
                    continue
                # sent = (u + r_old) - r_new, exactly 0 where nothing was sent (same float ops)
                flat = tf.reshape(u, [-1])
                sent = (flat + r0) - mem.residual(name, flat.shape)
                kept = tf.reshape(tf.where(tf.equal(sent, 0.0), flat, 0.0), u.shape)
                ops.append(self._hgsgc_velocity[name].assign(kept))
        with tf.control_dependencies(ops):
            return [None if a is None else tf.identity(a) for a in avg]

    def _hgsgc_build_delay(self, variables):
        if self._hgsgc_anchors is None:
            with tf.init_scope():
                self._hgsgc_local_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                     name="hgsgc_local_step")
                self._hgsgc_anchors = [tf.Variable(v.read_value(), trainable=False,
                                                   name="hgsgc_anchor_" + v.name.replace(":", "_"))
                                       for v in variables]
        if len(self._hgsgc_anchors) != len(variables):
            raise ValueError("with delay > 1 every apply_gradients call must pass the same variables")

    def _hgsgc_sync(self, variables, names):
        """Exchange the model delta since the last sync; all ranks end on identical weights."""
        deltas = [a - v for a, v in zip(self._hgsgc_anchors, variables)]
        avg = self._hgsgc_exchanger.exchange(deltas, names)
        ops = []
        for a, v, d in zip(self._hgsgc_anchors, variables, avg):
            new = a - d
            ops.append(v.assign(new))
            ops.append(a.assign(new))
        with tf.control_dependencies(ops):
            return tf.constant(True)

    def hgsgc_set_density(self, density: float):
        """Change the density of a sparse compression (e.g. DGC's warm-up of sparsity).

        Residuals and byte counters are kept. Payload sizes are fixed when a step is traced, so
        the caller must trace its step function again (a new ``tf.function``).

        Raises:
            ValueError: the compression is dense, or ``density`` is outside (0, 1].
        """
        import dataclasses

        comp = self._hgsgc_compression
        if not hasattr(comp, "density"):
            raise ValueError(f"compression {comp.to_dict()} has no density to change")
        comp = dataclasses.replace(comp, density=float(density))
        self._hgsgc_compression = comp
        self._hgsgc_exchanger.compression = comp

    def hgsgc_synchronize(self, variables):
        """Run the pending sync now if local steps were taken since the last one (delay > 1).

        Call it before evaluating or saving so every rank holds the same synced weights; the
        next sync then comes after another ``delay`` local steps. Every rank must call it (it is a
        collective when a sync is pending; all ranks have the same local step count).

        Returns:
            True if an exchange ran.
        """
        if self._hgsgc_compression.delay == 1 or self._hgsgc_anchors is None:
            return False
        if int(self._hgsgc_local_step.numpy()) % self._hgsgc_compression.delay == 0:
            return False
        variables = list(variables)
        if self._hgsgc_sync_fn is None:
            names = _var_names(variables)
            self._hgsgc_sync_fn = tf.function(lambda: self._hgsgc_sync(variables, names))
        self._hgsgc_sync_fn()
        self._hgsgc_local_step.assign(0)
        return True

    def hgsgc_state(self) -> dict:
        """Serialisable hgsgc state: residuals (numpy), PowerSGD's warm-start factors
        (``powersgd_q``) and, with delay, the sync anchors."""
        state = {"residuals": self._hgsgc_exchanger.memory.state_dict()}
        factors = self._hgsgc_exchanger.factor_state()
        if factors:
            state["powersgd_q"] = factors
        if self._hgsgc_anchors is not None:
            state["anchors"] = [a.numpy() for a in self._hgsgc_anchors]
            state["local_step"] = int(self._hgsgc_local_step.numpy())
        return state

    def load_hgsgc_state(self, state: dict):
        """Restore :meth:`hgsgc_state` output (residuals; anchors once built)."""
        self._hgsgc_exchanger.memory.load_state_dict(state.get("residuals", {}))
        self._hgsgc_exchanger.load_factor_state(state.get("powersgd_q", {}))
        if "anchors" in state and self._hgsgc_anchors is not None:
            for a, s in zip(self._hgsgc_anchors, state["anchors"]):
                a.assign(s)
            self._hgsgc_local_step.assign(state["local_step"])


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
    correction_momentum = 0.0
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


_TAPE_EXCHANGERS = {}  # (compression, id(process_set), source ids) -> (keep-alive refs, Exchanger)


def _tape_exchanger(comp, process_set, sources) -> Exchanger:
    """The Exchanger of tapes with this setting, process set and set of variables (a model)."""
    ids = tuple(id(v) if isinstance(v, tf.Variable) else None for v in sources)
    key = (comp, id(process_set), ids)
    if key not in _TAPE_EXCHANGERS:
        _TAPE_EXCHANGERS[key] = ((process_set, list(sources)), Exchanger(comp, process_set))
    return _TAPE_EXCHANGERS[key][1]


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged through ``compression``.

    Same arguments as ``horovod.tensorflow.DistributedGradientTape``. Communication delay needs
    the optimizer (it exchanges model deltas after local steps), so ``delay`` must be 1 here.

    As in Horovod, a new tape is usually wrapped every step (often inside a ``tf.function``), so
    the compression state (residuals, PowerSGD's factors, TernGrad's draw counter, byte counts)
    lives in one :class:`Exchanger` per (compression setting, process set, variables differentiated)
    in the process, shared by every tape built with them: two models keep separate state even
    when their layer names coincide. ``tape.exchanger`` is set by the first ``gradient()`` call.

    Raises:
        ValueError: ``compression`` with ``delay > 1``, or an unsupported Horovod argument.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=hvd.global_process_set,
                 scale_local_gradients=True):
        _check_unsupported(op, gradient_predivide_factor, 1, groups, num_groups)
        comp = as_compression(compression)
        if comp.delay != 1:
            raise ValueError("DistributedGradientTape exchanges every step: use "
                             "hgsgc.DistributedOptimizer for compression with delay > 1")
        self._tape = gradtape
        self._comp, self._process_set = comp, process_set
        self.exchanger = None

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """Local gradients of ``target`` w.r.t. ``sources`` (any nest), averaged over ranks."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_src = tf.nest.flatten(sources)
        self.exchanger = _tape_exchanger(self._comp, self._process_set, flat_src)
        flat_g = local_clip(tf.nest.flatten(grads, expand_composites=False),
                            self.exchanger.compression, self.exchanger.size)
        avg = self.exchanger.exchange(flat_g, _var_names(flat_src))
        return tf.nest.pack_sequence_as(grads, avg)

    def __getattr__(self, item):
        return getattr(self._tape, item)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)
