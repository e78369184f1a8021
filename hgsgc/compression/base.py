"""The contracts of the compression pieces, and the registry of methods.

A compression method is a composition (docs/architecture.md)::

    Pipeline = [local clip] -> view -> [momentum correction] -> [error feedback] -> reducer
                                                                          (codec inside)

* a **codec** (:class:`Codec`) is stateless: ``encode`` one float32 vector into a uint8 payload
  whose length is known by formula (:meth:`Codec.payload_length`), ``decode`` it back;
* a **reducer** (:class:`Reducer`) is how payloads meet across ranks (dense allreduce,
  allgather, tree / node reduction, PowerSGD's two allreduces); it returns the averages and, per
  tensor, what of this rank's contribution reached the average (``contributed``), so error
  feedback is written once (:class:`hgsgc.compression.wrappers.ErrorFeedback`);
* a **wrapper** (:class:`Wrapper`) is a reducer around a reducer (error feedback, DGC momentum
  correction and masking); local clipping and communication delay act on whole steps
  (:mod:`hgsgc.compression.wrappers`, which also holds the composition,
  :class:`~hgsgc.compression.wrappers.Pipeline`).

Every stateful piece keeps its state in a :class:`~hgsgc.compression.memory.VariableStore`
under one key of the state tree (``residuals``, ``velocity``, ``powersgd_q``) and has
``state_dict()`` / ``load_state_dict()``; the random-number step is its own counter
(:class:`RandomStep`). The :class:`hgsgc.communicator.Exchanger` collects them.

A method registers itself with :func:`register` (its name, its ``Compression.<name>``
factory and how the config section builds it); ``hgsgc.config`` takes the method list and the
conversion from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple


class Stateful:
    """Something with explicit, serialisable state (plain dicts of numpy arrays / ints)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class RandomStep(Stateful):
    """The random-number step: one int64 counter per exchanger, advanced once per exchange.

    Seeds the sampled top-k threshold and TernGrad's stochastic rounding. Its own counter
    (not the byte counters), saved in the state tree as ``rng_step`` (a Python int), so a
    restored run draws the same numbers as an uninterrupted one.
    """

    def __init__(self):
        import tensorflow as tf

        with tf.init_scope():
            self.var = tf.Variable(0, dtype=tf.int64, trainable=False, name="hgsgc_rng_step")

    def value(self):
        """int64 scalar tensor: the current step (read before the exchange advances it)."""
        import tensorflow as tf

        return tf.identity(self.var)

    def advance(self):
        """Add one; returns the op."""
        return self.var.assign_add(1)

    def state_dict(self) -> dict:
        return {"rng_step": int(self.var.numpy())}

    def load_state_dict(self, state: dict) -> None:
        import tensorflow as tf

        if "rng_step" in state:
            with tf.init_scope():
                self.var.assign(int(state["rng_step"]))


@dataclass
class Context:
    """What a reducer needs for one exchange.

    Attributes:
        comm: the :class:`hgsgc.comm.Communicator` (collectives + byte ledger).
        step: int64 scalar tensor, the random-number step of this exchange.
        uid: this exchanger's number (Horovod op names, same order on every rank).
    """

    comm: object
    step: object
    uid: int


class Codec:
    """A stateless encoder of one float32 vector ``[numel]`` into a uint8 payload.

    Subclasses implement :meth:`payload_length`, :meth:`encode` and :meth:`decode`.
    """

    def payload_length(self, numel: int) -> int:
        """Exact payload bytes for a tensor of ``numel`` entries (a formula, no tensor needed)."""
        raise NotImplementedError

    def encode(self, x, ctx: Context, index: int):
        """Encode float32 ``x`` ``[numel]``.

        Args:
            ctx: the exchange's context (``ctx.step``, ``ctx.comm.rank`` seed random choices).
            index: the tensor's position in the exchange.

        Returns:
            ``(payload uint8 [payload_length(numel)], sent float32 [numel])`` where ``sent`` is
            what every receiver decodes from the payload.
        """
        raise NotImplementedError

    def decode(self, payload, numel: int):
        """uint8 ``[payload_length(numel)]`` -> float32 ``[numel]``."""
        raise NotImplementedError


class Reducer(Stateful):
    """Averages a list of float32 tensors over the ranks of ``ctx.comm``.

    :meth:`view` gives the shape a tensor is reduced in (flat for the codecs, a matrix for
    PowerSGD) and whether error feedback applies to it; :meth:`reduce` takes the views.
    """

    def view(self, x):
        """The float32 view of tensor ``x`` this reducer works on; default: flat ``[numel]``."""
        import tensorflow as tf

        return tf.reshape(tf.cast(x, tf.float32), [-1])

    def feedback(self, view) -> bool:
        """Whether error feedback applies to ``view`` (default True; PowerSGD: matrices only)."""
        return True

    def reduce(self, views: Sequence, names: Sequence[str], ctx: Context):
        """Average ``views`` over the ranks.

        Returns:
            ``(averages, contributed)``: float32 tensors of the views' shapes, identical on every
            rank; and per view what of this rank's contribution reached the average (its
            decoded payload, minus what merges dropped), or ``None`` where error feedback does
            not apply. Error feedback keeps ``view - contributed``.
        """
        raise NotImplementedError


class Wrapper(Reducer):
    """A reducer around ``inner``: same contract; the state tree merges its own and inner's."""

    def __init__(self, inner: Reducer):
        self.inner = inner

    def view(self, x):
        return self.inner.view(x)

    def feedback(self, view) -> bool:
        return self.inner.feedback(view)

    def own_state(self) -> dict:
        return {}

    def load_own_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), **self.own_state()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.load_own_state(state)


@dataclass
class BuildEnv:
    """What a setting's ``build()`` may use: the exchanger's state stores and facts.

    Attributes:
        stores: ``key -> VariableStore``; :meth:`store` creates one per key on demand and the
            exchanger saves them all (``residuals`` is always there).
        momentum: the optimizer's momentum for DGC momentum correction (None: not available).
        plan: zero-argument callable returning the tree / node schedule (built at the first
            exchange, when Horovod is initialised).
    """

    stores: Dict[str, object]
    momentum: Optional[float] = None
    plan: Optional[Callable] = None

    def store(self, key: str, prefix: Optional[str] = None):
        from hgsgc.compression.memory import VariableStore

        if key not in self.stores:
            self.stores[key] = VariableStore(prefix or "hgsgc_" + key)
        return self.stores[key]


# ---------------------------------------------------------------------------------------------
# Registry of methods.


@dataclass(frozen=True)
class Method:
    """A registered compression method.

    Attributes:
        name: ``compression.method`` value and ``Compression.<name>`` factory name.
        factory: builds the setting (the ``Compression.<name>`` function).
        from_config: builds the setting from a config ``compression`` section
            (:class:`hgsgc.config.CompressionConfig`).
        sparse: whether the method exchanges top-k payloads (uses density / bits / hierarchy).
    """

    name: str
    factory: Callable
    from_config: Callable
    sparse: bool = False
    settings: Tuple[type, ...] = field(default=())


METHODS: Dict[str, Method] = {}
_LISTENERS: List[Callable] = []  # hgsgc.compression adds Compression.<name> through one of these


def register(name: str, factory: Callable, from_config: Callable, *, sparse: bool = False,
             settings: Tuple[type, ...] = ()) -> Method:
    """Register a method: ``Compression.<name>`` becomes ``factory``, the config accepts it.

    Raises:
        ValueError: ``name`` is registered already.
    """
    if name in METHODS:
        raise ValueError(f"compression method {name!r} is registered twice")
    m = Method(name, factory, from_config, sparse, tuple(settings))
    METHODS[name] = m
    for listener in _LISTENERS:
        listener(m)
    return m


def method_names() -> Tuple[str, ...]:
    """Registered method names, in registration order."""
    return tuple(METHODS)
