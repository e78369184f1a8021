"""The :class:`Exchanger`: averages lists of tensors over a process set through a setting.

It holds no algorithm of its own. It owns, for one (setting, process set):

* the :class:`hgsgc.comm.Communicator` (collectives + byte counters ``stats``);
* the state stores of the pieces (``residuals``, ``velocity``, ``powersgd_q`` ...) and the
  random-number step (:class:`hgsgc.compression.base.RandomStep`): one state tree,
  :meth:`Exchanger.state_dict` / :meth:`Exchanger.load_state_dict`;
* the setting's composition, ``setting.build(env)`` (a
  :class:`~hgsgc.compression.base.Pipeline`: local clip -> momentum correction -> error
  feedback -> reducer), rebuilt with the same state when the setting changes (DGC warm-up).

Per exchange it splits the tensors: floating, non-empty ones go through the pipeline when the
setting compresses; integer tensors and dense settings go through one Horovod grouped ring
allreduce (:class:`hgsgc.compression.reducers.DenseAllreduce`); empty ones pass through.
Each part is one exchange for the counters (``exchanges``, ``gradient_bytes`` = 4 d,
``dense_bytes`` = ring allreduce of 4 d) and advances the random-number step by one.

Bytes per rank per exchange: see :mod:`hgsgc.costs` and the reducers' docstrings.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc import costs
from hgsgc import hierarchy as hier
from hgsgc.comm import STAT_KEYS, CommStats, Communicator, _is_global  # noqa: F401  (re-exported)
from hgsgc.compression import DenseCompression, as_compression
from hgsgc.compression.base import BuildEnv, Context, RandomStep
from hgsgc.compression.memory import ResidualMemory
from hgsgc.compression.reducers import DenseAllreduce


class Exchanger:
    """Averages lists of tensors over a process set through a compression setting.

    Args:
        compression: ``hgsgc.Compression.*`` value (or Horovod's ``Compression.none/fp16``).
        process_set: Horovod process set (default: all ranks).
        memory: error-feedback memory (a new one if None); residuals are keyed by name.
        stats: byte counters (a new :class:`CommStats` if None).
        node_sizes: ``hierarchy="node"`` only: host sizes overriding MPI's shared-memory split
            (an int: hosts of that many consecutive ranks; a list: explicit sizes); default
            ``$HGSGC_RANKS_PER_NODE`` if set, else the MPI split (a collective over the process
            set at the first exchange).
        momentum: the optimizer momentum ``m`` for DGC momentum correction (``None``: a setting
            with ``momentum_correction`` is refused with a ValueError at construction).

    Raises:
        TypeError: unsupported ``compression``.
        ValueError: momentum correction without ``momentum``.
    """

    # Exchangers built so far per process set (its ranks; None: the global set): an exchanger's
    # number, in the names of its Horovod ops, must be the same on every rank of its set, also
    # when a rank has built exchangers on other sets before (a rank in several process sets):
    # a process-wide count named the set's collectives differently on its ranks (a hang)
    _instances = {}

    def __init__(self, compression=None, process_set=None, memory: Optional[ResidualMemory] = None,
                 stats: Optional[CommStats] = None, node_sizes=None, momentum: Optional[float] = None):
        self.comm = Communicator(process_set, stats)
        self.stores = {"residuals": memory if memory is not None else ResidualMemory()}
        self.rng = RandomStep()
        self.node_sizes = node_sizes
        self.momentum = momentum
        self._plan = None
        ps = self.comm.process_set
        ranks = getattr(ps, "ranks", None)
        key = None if _is_global(ps) else (tuple(ranks) if ranks else ("set", id(ps)))
        self._uid = Exchanger._instances.get(key, 0)
        Exchanger._instances[key] = self._uid + 1
        self._compression = None
        self.compression = compression if compression is not None else DenseCompression("none")

    # ---------------------------------------------------------------------------------------
    @property
    def compression(self):
        """The setting; assigning a new one rebuilds the composition with the same state."""
        return self._compression

    @compression.setter
    def compression(self, value):
        comp = as_compression(value)
        env = BuildEnv(self.stores, momentum=self.momentum, plan=self.plan)
        self.pipeline = comp.build(env) if comp.compressed else None
        self._compression = comp
        comp_dense = comp if isinstance(comp, DenseCompression) else DenseCompression("none")
        self.dense = DenseAllreduce(comp_dense.wire_bytes_per_entry, comp_dense.horovod)

    @property
    def process_set(self):
        return self.comm.process_set

    @property
    def stats(self) -> CommStats:
        return self.comm.stats

    @property
    def memory(self) -> ResidualMemory:
        """The error-feedback residuals (``state_dict()["residuals"]``)."""
        return self.stores["residuals"]

    @property
    def size(self) -> int:
        """Ranks in the process set."""
        return self.comm.size

    @property
    def rank(self) -> int:
        """This process's rank within the process set."""
        return self.comm.rank

    @property
    def hierarchy(self) -> str:
        return getattr(self._compression, "hierarchy", "allgather")

    def plan(self) -> Optional["hier.Plan"]:
        """The tree / node schedule (built once; ``None`` for the allgather and dense exchanges).

        For ``hierarchy="node"`` the first call discovers the hosts (a collective over the
        process set unless ``node_sizes`` / ``$HGSGC_RANKS_PER_NODE`` is given).
        """
        if self._plan is None and self.hierarchy in hier.HIERARCHICAL:
            if self.hierarchy == "tree":
                self._plan = hier.tree_plan(self.size)
            else:
                self._plan = hier.node_plan(hier.discover_hosts(self.comm.world_ranks, self._node_spec()))
        return self._plan

    def _node_spec(self):
        """``node_sizes``, else ``$HGSGC_RANKS_PER_NODE``, else None (discover the hosts), after
        one ``allgather_object`` over the process set has checked that every rank has the same.

        A rank with the variable skips the host discovery (an MPI collective) that a rank without
        it enters, so a variable set on some ranks only (``HGSGC_RANKS_PER_NODE=4 mpirun -H a:4,b:4``
        without ``-x``: Open MPI does not forward it to other hosts) hung the first node exchange
        (brk12); different values built different schedules.

        Raises:
            ValueError: on every rank alike, naming the ranks and their values.
        """
        import os

        env = os.environ.get(hier.ENV_RANKS_PER_NODE) or None
        mine = (None if self.node_sizes is None else repr(self.node_sizes), env)
        if self.size > 1:
            from horovod.tensorflow.functions import allgather_object

            with tf.init_scope():
                every = allgather_object(mine, process_set=self.comm.process_set)
            if any(v != every[0] for v in every):
                ranks = self.comm.world_ranks
                key = 0 if any(v[0] != every[0][0] for v in every) else 1
                what = "Exchanger(node_sizes=...)" if key == 0 else f"${hier.ENV_RANKS_PER_NODE}"
                by = {}
                for r, v in enumerate(every):
                    by.setdefault(v[key], []).append(str(ranks[r]))
                vals = "; ".join(f"{'unset' if v is None else repr(v)} on rank{'s' if len(rs) > 1 else ''} "
                                 f"{','.join(rs)}" for v, rs in by.items())
                fix = ("pass the same node_sizes on every rank" if key == 0 else
                       f"set it to the same value on every rank or on none (mpirun -x "
                       f"{hier.ENV_RANKS_PER_NODE}: Open MPI does not pass the launching shell's "
                       f"variables to ranks on other hosts)")
                raise ValueError(f"hierarchy='node': {what} differs between the ranks of the process "
                                 f"set ({vals}): {fix}")
        return self.node_sizes if self.node_sizes is not None else env

    def costs(self, shapes: Sequence[Sequence[int]]) -> dict:
        """This rank's closed-form cost of one sparse exchange of float32 ``shapes``
        (with ``dense_vectors``: the sparse collective plus one ring allreduce of the rank < 2 tensors).

        Returns:
            ``{"bytes_sent", "bytes_received", "messages", "rounds", "inter_bytes_sent",
            "inter_bytes_received", "payload_bytes"}`` from :mod:`hgsgc.costs` (``inter_*``:
            between hosts, for ``hierarchy="node"``).
        """
        comp, n, h = self._compression, self.size, self.hierarchy
        dense = sum(b for a, b in comp.collectives(shapes) if a == "ring") if getattr(comp, "dense_vectors", False) else 0
        P = self.payload_bytes(shapes) - dense
        groups = self._allgather_groups(shapes)
        if groups == 0:  # no tensor for the sparse collective: the exchange makes no such call
            out = dict.fromkeys(("bytes_sent", "bytes_received", "messages", "rounds", "inter_bytes_sent",
                                 "inter_bytes_received"), 0)
        elif h == "tree":
            out = costs.tree_cost(n, self.rank, P)
        elif h == "node":
            out = costs.node_cost(self.plan().hosts, self.rank, P)
        else:
            out = costs.allgather_cost(n, P)
            out["messages"] *= groups
            out["rounds"] *= groups
        if dense:  # dense_vectors: plus one fp32 ring allreduce of the rank < 2 tensors
            r = costs.ring_allreduce_bytes(n, dense)
            for key in ("bytes_sent", "bytes_received", "inter_bytes_sent", "inter_bytes_received"):
                out[key] += r
            out["messages"] += 1
            out["rounds"] += costs.ring_allreduce_rounds(n)
        out["payload_bytes"] = P + dense
        return out

    def _allgather_groups(self, shapes) -> int:
        """Allgathers per sparse exchange of ``shapes``: ``compression.buckets`` groups at most
        (:func:`hgsgc.compression.reducers.bucket_indices`), 1 without buckets; 0 when no tensor
        goes to the sparse collective (every one empty, or of rank < 2 with ``dense_vectors``)."""
        comp = self._compression
        if not hasattr(comp, "dense_shape"):  # not a top-k setting: one collective
            return 1
        numels = [int(math.prod(int(d) for d in s)) for s in shapes if not comp.dense_shape(s)]
        if not any(m > 0 for m in numels):  # empty tensors pass through
            return 0
        if getattr(comp, "buckets", 1) == 1:
            return 1
        from hgsgc.compression.reducers import bucket_indices

        codec = comp.codec()
        sizes = [codec.payload_length(m) for m in numels if m > 0]
        return len(bucket_indices(sizes, comp.buckets))

    def payload_bytes(self, shapes: Sequence[Sequence[int]]) -> int:
        """The rank's payload in bytes for one exchange of float32 tensors of ``shapes``."""
        return self._compression.payload_bytes(shapes)

    # ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The state tree: ``{"residuals": {name: array}, "rng_step": int, "stats": {key: int}}``
        plus, when present, ``"velocity"`` (DGC) and ``"powersgd_q"`` (PowerSGD)
        ``{name: array}``. Plain dicts of numpy float32 arrays and ints. ``stats`` are the byte
        counters (measurements, restored so a resumed run's totals continue); the algorithms'
        random numbers depend on ``rng_step`` only."""
        state = {"residuals": self.memory.state_dict()}
        for key, store in self.stores.items():
            if key != "residuals" and len(store):
                state[key] = store.state_dict()
        state.update(self.rng.state_dict())
        state["stats"] = self.stats.snapshot()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (creates the variables not built yet; safe in a trace).

        Raises:
            ValueError: a saved array's shape differs from an existing variable's.
        """
        from hgsgc.compression.memory import VariableStore

        for key, value in state.items():
            if key in ("rng_step", "stats"):
                continue
            if isinstance(value, dict):
                if key not in self.stores:
                    self.stores[key] = VariableStore("hgsgc_" + key)
                self.stores[key].load_state_dict(value)
        self.rng.load_state_dict(state)
        if "stats" in state:
            with tf.init_scope():
                for k, v in state["stats"].items():
                    self.stats.vars[k].assign(int(v))

    def factor_state(self) -> dict:
        """PowerSGD's warm-start factors ``Q`` (numpy ``[p, q]`` per tensor name; empty otherwise)."""
        store = self.stores.get("powersgd_q")
        return store.state_dict() if store is not None else {}

    def load_factor_state(self, state: dict):
        """Restore :meth:`factor_state` output."""
        self.load_state_dict({"powersgd_q": state})

    # ---------------------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert  # plain graph code: nothing for AutoGraph to do
    def exchange(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> List[tf.Tensor]:
        """Average ``tensors`` over the process set.

        Args:
            tensors: tensors of any shape; ``None`` entries pass through as ``None``.
            names: a unique name per tensor (state keys), same order on every rank.

        Returns:
            the averages, same shapes and dtypes, identical on every rank of the process set.
            Integer tensors are averaged densely (never compressed); empty tensors pass through.

        Raises:
            ValueError: ``len(tensors) != len(names)``.
        """
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        out: List[Optional[tf.Tensor]] = [None] * len(tensors)
        dense_pos, comp_pos = [], []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if isinstance(t, tf.IndexedSlices):
                t = tf.convert_to_tensor(t)
            if t.shape.num_elements() == 0:
                out[i] = t
            elif self.pipeline is not None and t.dtype.is_floating:
                comp_pos.append((i, t))
            else:
                dense_pos.append((i, t))
        if dense_pos:
            res = self._run(lambda ctx, ts: self.dense.reduce_raw(ts, ctx), [t for _, t in dense_pos])
            for (i, _), r in zip(dense_pos, res):
                out[i] = r
        if comp_pos:
            cnames = [names[i] for i, _ in comp_pos]
            res = self._run(lambda ctx, ts: self.pipeline.run(ts, cnames, ctx), [t for _, t in comp_pos])
            for (i, _), r in zip(comp_pos, res):
                out[i] = r
        return out

    def _run(self, fn, tensors):
        """One exchange: run ``fn(ctx, tensors)``, then flush the counters and advance the step."""
        n = self.size
        ctx = Context(comm=self.comm, step=self.rng.value(), uid=self._uid)
        d = sum(int(t.shape.num_elements()) for t in tensors)
        result = fn(ctx, tensors)
        self.comm.count(exchanges=1, gradient_bytes=4 * d, dense_bytes=costs.dense_bytes(n, d))
        with tf.control_dependencies([r for r in result if r is not None]):
            done = [self.comm.flush(), self.rng.advance()]
        with tf.control_dependencies(done):
            return [tf.identity(r) for r in result]
