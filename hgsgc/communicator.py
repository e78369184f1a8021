"""Exchange of (compressed) tensors among the ranks of a Horovod process set, with byte counts.

:class:`Exchanger` takes a list of same-shaped tensors on every rank and returns their average
over the process set, identical on every rank:

* dense settings (``Compression.none`` / ``fp16``): ``hvd.grouped_allreduce(op=Average)``;
* sparse settings (``topk`` / ``sgc``): each rank compensates with its residual, selects top-k,
  encodes one contiguous uint8 payload for all tensors (``codec``), the payloads go through one
  ``hvd.allgather``, and every rank decodes all ``n`` payloads, scatters each into a dense
  tensor, sums them in rank order and divides by ``n``.

Bytes per rank per exchange (``d`` entries, ``n`` ranks, ``P`` the rank's payload bytes), the
ring model of DESIGN.md:

* dense: payload ``w d`` (w = 4 fp32, 2 fp16); sent = received = ``2 (n - 1) / n * w d``;
* allgather: sent = received = ``(n - 1) P`` (every rank's payload crosses every other link);
* TernGrad (``Compression.terngrad``): one ``allreduce(op=Max)`` of one float32 scale per tensor
  (ring model on ``4 L`` bytes) plus the allgather of the 2-bit codes, ``(n - 1) C`` with
  ``C = sum ceil(numel / 4)``;
* PowerSGD (``Compression.powersgd``): two fp32 ring allreduces, of the ``P`` factors (plus the
  uncompressed tensors) and of the ``Q`` factors: ``2 (n - 1) / n`` times each one's bytes;
* tree / node (``hierarchy=``, :mod:`hgsgc.hierarchy`): top-k reduction in
  ``ceil(log2 n) + [n not a power of two]`` rounds of one payload per message; the busiest rank
  moves ``(floor(log2 n) + 2) P``; see :mod:`hgsgc.hierarchy` for the per-rank formulas.

Counts are Python integers fixed when the exchange is built (payload lengths depend only on
shapes, density and bits) and are added to :class:`CommStats` variables each time the exchange
runs, so they stay exact inside ``tf.function``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc import hierarchy as hier
from hgsgc.compression import (DenseCompression, PowerSGDCompression, SparseCompression,
                               TernGradCompression, as_compression, codec, powersgd, terngrad)
from hgsgc.compression.memory import ResidualMemory
from hgsgc.compression.sparsify import exact_topk, num_selected, sampled_threshold_topk

_COMPRESSED = (SparseCompression, TernGradCompression, PowerSGDCompression)

STAT_KEYS = ("exchanges", "gradient_bytes", "payload_bytes", "bytes_sent", "bytes_received",
             "dense_bytes", "messages", "rounds")


class CommStats:
    """Cumulative int64 counters of one rank's exchanges (all in bytes except the counts).

    ``exchanges``: collective exchanges run; ``gradient_bytes``: fp32 size 4 d of the tensors
    exchanged; ``payload_bytes``: the rank's own encoded payload; ``bytes_sent`` /
    ``bytes_received``: what crosses the rank's link under the collective's ring model;
    ``dense_bytes``: what fp32 ring allreduce would send, 2 (n - 1) / n * 4 d; ``messages``:
    collective calls issued (dense, allgather: 1 per exchange) or, for ``hierarchy="tree"`` /
    ``"node"``, point-to-point payloads the rank sent; ``rounds``: communication rounds on the
    critical path under the algorithm's model (dense ring allreduce ``2 (n - 1)``, allgather
    ``ceil(log2 n)`` (Bruck), tree / node: the rounds of the schedule).
    """

    def __init__(self):
        with tf.init_scope():
            self.vars = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name="hgsgc_" + k)
                         for k in STAT_KEYS}

    def add(self, **amounts):
        return tf.group(*[self.vars[k].assign_add(tf.constant(int(v), tf.int64))
                          for k, v in amounts.items()])

    def snapshot(self) -> dict:
        """Current totals as Python ints."""
        return {k: int(v.numpy()) for k, v in self.vars.items()}

    def reset(self):
        for v in self.vars.values():
            v.assign(0)


def _ring_allreduce_bytes(n: int, nbytes: int) -> int:
    return (2 * (n - 1) * nbytes) // n if n > 1 else 0


def _fp16_average(tensors, n, process_set):
    """Average over ``n`` ranks with fp16 on the wire, scaling by ``1/n`` BEFORE the fp16 cast:
    ``sum_r fp16(x_r / n)``. Values whose sum over ranks exceeds the float16 range (65504) but
    whose average does not stay finite (Horovod's ``Compression.fp16`` with ``op=Average``
    casts first and sums in fp16, giving inf). Integer tensors are averaged uncompressed."""
    out = list(tensors)
    fl = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
    other = [i for i, t in enumerate(tensors) if not t.dtype.is_floating]
    if fl:
        scaled = [tf.cast(tf.cast(tensors[i], tf.float32) / float(n), tf.float16) for i in fl]
        summed = hvd.grouped_allreduce(scaled, op=hvd.Sum, process_set=process_set)
        for i, r in zip(fl, summed):
            out[i] = tf.cast(r, tensors[i].dtype)
    if other:
        avg = hvd.grouped_allreduce([tensors[i] for i in other], op=hvd.Average,
                                    process_set=process_set)
        for i, r in zip(other, avg):
            out[i] = r
    return out


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

    Raises:
        TypeError: unsupported ``compression``.
    """

    _instances = 0  # names of the tree/node rounds' Horovod ops: same order on every rank

    def __init__(self, compression=None, process_set=None, memory: Optional[ResidualMemory] = None,
                 stats: Optional[CommStats] = None, node_sizes=None):
        self.compression = as_compression(compression if compression is not None
                                          else DenseCompression("none"))
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.memory = memory if memory is not None else ResidualMemory()
        self.stats = stats if stats is not None else CommStats()
        self._seed_step = None
        self.node_sizes = node_sizes
        self._plan = None
        self._powersgd_q = {}
        self._uid = Exchanger._instances
        Exchanger._instances += 1

    @property
    def size(self) -> int:
        """Ranks in the process set."""
        ps = self.process_set
        if ps is hvd.global_process_set or getattr(ps, "process_set_id", 0) == 0:
            return hvd.size()
        return len(ps.ranks)

    @property
    def rank(self) -> int:
        """This process's rank within the process set."""
        ps = self.process_set
        if ps is hvd.global_process_set or getattr(ps, "process_set_id", 0) == 0:
            return hvd.rank()
        return list(ps.ranks).index(hvd.rank())

    @property
    def hierarchy(self) -> str:
        comp = self.compression
        return comp.hierarchy if isinstance(comp, SparseCompression) else "allgather"

    def plan(self) -> Optional["hier.Plan"]:
        """The tree / node schedule (built once; ``None`` for the allgather and dense exchanges).

        For ``hierarchy="node"`` the first call discovers the hosts (a collective over the
        process set unless ``node_sizes`` / ``$HGSGC_RANKS_PER_NODE`` is given).
        """
        if self._plan is None and self.hierarchy in hier.HIERARCHICAL:
            n = self.size
            if self.hierarchy == "tree":
                self._plan = hier.tree_plan(n)
            else:
                ps = self.process_set
                world = (list(range(hvd.size())) if ps is hvd.global_process_set
                         or getattr(ps, "process_set_id", 0) == 0 else list(ps.ranks))
                self._plan = hier.node_plan(hier.discover_hosts(world, self.node_sizes))
        return self._plan

    def costs(self, shapes: Sequence[Sequence[int]]) -> dict:
        """This rank's closed-form cost of one sparse exchange of float32 ``shapes``.

        Returns:
            ``{"bytes_sent", "bytes_received", "messages", "rounds", "inter_bytes_sent",
            "inter_bytes_received", "payload_bytes"}`` from the formulas of
            :mod:`hgsgc.hierarchy` (``inter_*``: between hosts, for ``hierarchy="node"``).
        """
        P, n, h = self.payload_bytes(shapes), self.size, self.hierarchy
        if h == "tree":
            out = hier.tree_cost(n, self.rank, P)
        elif h == "node":
            out = hier.node_cost(self.plan().hosts, self.rank, P)
        else:
            out = hier.allgather_cost(n, P)
        out["payload_bytes"] = P
        return out

    # ----------------------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert  # plain graph code: nothing for AutoGraph to do
    def exchange(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> List[tf.Tensor]:
        """Average ``tensors`` over the process set.

        Args:
            tensors: tensors of any shape; ``None`` entries pass through as ``None``.
            names: a unique name per tensor (residual keys), same order on every rank.

        Returns:
            the averages, same shapes and dtypes, identical on every rank of the process set.
            Integer tensors are averaged densely (never compressed); empty tensors pass through.
        """
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        out: List[Optional[tf.Tensor]] = [None] * len(tensors)
        dense_pos, sparse_pos = [], []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if isinstance(t, tf.IndexedSlices):
                t = tf.convert_to_tensor(t)
            if t.shape.num_elements() == 0:
                out[i] = t
            elif isinstance(self.compression, _COMPRESSED) and t.dtype.is_floating:
                sparse_pos.append((i, t))
            else:
                dense_pos.append((i, t))
        if dense_pos:
            for (i, _), r in zip(dense_pos, self._dense([t for _, t in dense_pos])):
                out[i] = r
        if sparse_pos:
            method = {TernGradCompression: self._terngrad, PowerSGDCompression: self._powersgd}.get(
                type(self.compression), self._sparse)
            res = method([t for _, t in sparse_pos], [names[i] for i, _ in sparse_pos])
            for (i, _), r in zip(sparse_pos, res):
                out[i] = r
        return out

    # ----------------------------------------------------------------------------------------
    def _dense(self, tensors):
        n = self.size
        comp = self.compression
        hvd_comp = comp.horovod if isinstance(comp, DenseCompression) else hvd.Compression.none
        per_entry = comp.wire_bytes_per_entry if isinstance(comp, DenseCompression) else 4
        d = sum(int(t.shape.num_elements()) for t in tensors)
        payload = sum(int(t.shape.num_elements()) * (per_entry if t.dtype.is_floating
                                                      else t.dtype.size) for t in tensors)
        wire = _ring_allreduce_bytes(n, payload)
        if n == 1:
            result = list(tensors)
        elif hvd_comp is hvd.Compression.fp16:
            result = _fp16_average(list(tensors), n, self.process_set)
        else:
            result = hvd.grouped_allreduce(list(tensors), op=hvd.Average, compression=hvd_comp,
                                           process_set=self.process_set)
        with tf.control_dependencies(result):
            upd = self.stats.add(exchanges=1, gradient_bytes=4 * d, payload_bytes=payload,
                                 bytes_sent=wire, bytes_received=wire,
                                 dense_bytes=_ring_allreduce_bytes(n, 4 * d), messages=1,
                                 rounds=2 * (n - 1))
        with tf.control_dependencies([upd]):
            return [tf.identity(r) for r in result]

    def _select(self, a, k):
        comp = self.compression
        if comp.selector == "sampled":
            seed = tf.stack([tf.cast(self.stats.vars["exchanges"] % 2**30, tf.int32),
                             tf.constant(1013, tf.int32)])
            return sampled_threshold_topk(a, k, seed=seed)
        return exact_topk(a, k)

    def _sparse(self, tensors, names):
        comp: SparseCompression = self.compression
        n = self.size
        if comp.hierarchy in hier.HIERARCHICAL:
            return hier.exchange(tensors, names, compression=comp, memory=self.memory,
                                 stats=self.stats, process_set=self.process_set, rank=self.rank,
                                 n=n, plan=self.plan(), select=self._select, uid=self._uid)
        specs, payloads, updates = [], [], []
        for t, name in zip(tensors, names):
            numel = int(t.shape.num_elements())
            flat = tf.reshape(tf.cast(t, tf.float32), [-1])
            a = self.memory.compensate(name, flat) if comp.error_feedback else flat
            k = num_selected(numel, comp.density)
            idx, vals = self._select(a, k)
            payload, sent = codec.encode(idx, vals, numel, comp.bits)
            if comp.error_feedback:
                sent_dense = tf.scatter_nd(idx[:, None], sent, [numel])
                updates.append(self.memory.update(name, a, sent_dense))
            specs.append((numel, k, int(payload.shape[0])))
            payloads.append(payload)
        P = sum(p for _, _, p in specs)
        d = sum(numel for numel, _, _ in specs)
        buf = tf.concat(payloads, 0) if len(payloads) > 1 else payloads[0]
        with tf.control_dependencies(updates):
            gathered = hvd.allgather(buf, process_set=self.process_set) if n > 1 else tf.identity(buf)
        gathered = tf.reshape(gathered, [n, P])
        wire = (n - 1) * P
        upd = self.stats.add(exchanges=1, gradient_bytes=4 * d, payload_bytes=P, bytes_sent=wire,
                             bytes_received=wire, dense_bytes=_ring_allreduce_bytes(n, 4 * d),
                             messages=1, rounds=hier.allgather_rounds(n))
        results, off = [], 0
        for t, (numel, k, p) in zip(tensors, specs):
            dense = []
            for r in range(n):
                idx, vals = codec.decode(gathered[r, off:off + p], numel, k, comp.bits)
                dense.append(tf.scatter_nd(idx[:, None], vals, [numel]))
            off += p
            total = tf.add_n(dense) if n > 1 else dense[0]
            avg = tf.reshape(total / float(n), t.shape)
            with tf.control_dependencies([upd]):
                results.append(tf.cast(avg, t.dtype))
        return results

    # ----------------------------------------------------------------------------------------
    def _terngrad(self, tensors, names):
        """TernGrad (Wen et al. 2017): shared-scale stochastic ternary codes, allgathered."""
        comp: TernGradCompression = self.compression
        n, ps = self.size, self.process_set
        step = tf.identity(self.stats.vars["exchanges"])
        flats = [terngrad.clip(tf.reshape(t, [-1]), comp.clip_sigma) for t in tensors]
        local_max = tf.stack([tf.reduce_max(tf.abs(f)) for f in flats])
        scale = (hvd.allreduce(local_max, op=hvd.Max, process_set=ps,
                               name=f"hgsgc_terngrad_scale_{self._uid}") if n > 1 else local_max)
        payloads, sizes = [], []
        for i, f in enumerate(flats):
            numel = int(f.shape[0])
            u = terngrad.draw_uniform(numel, step, self.rank, i)
            payloads.append(terngrad.encode(terngrad.ternarize(f, scale[i], u)))
            sizes.append(terngrad.code_bytes(numel))
        buf = tf.concat(payloads, 0) if len(payloads) > 1 else payloads[0]
        C, L = sum(sizes), len(flats)
        gathered = tf.reshape(hvd.allgather(buf, process_set=ps) if n > 1 else buf, [n, C])
        scale_bytes = terngrad.SCALE_BYTES * L
        d = sum(int(f.shape[0]) for f in flats)
        upd = self.stats.add(exchanges=1, gradient_bytes=4 * d, payload_bytes=C + scale_bytes,
                             bytes_sent=(n - 1) * C + _ring_allreduce_bytes(n, scale_bytes),
                             bytes_received=(n - 1) * C + _ring_allreduce_bytes(n, scale_bytes),
                             dense_bytes=_ring_allreduce_bytes(n, 4 * d), messages=2,
                             rounds=hier.allgather_rounds(n) + 2 * (n - 1))
        results, off = [], 0
        for i, (t, f, c) in enumerate(zip(tensors, flats, sizes)):
            numel = int(f.shape[0])
            total = tf.add_n([terngrad.decode(gathered[r, off:off + c], numel) for r in range(n)])
            off += c
            avg = tf.cast(total, tf.float32) * (scale[i] / float(n))
            with tf.control_dependencies([upd]):
                results.append(tf.cast(tf.reshape(avg, t.shape), t.dtype))
        return results

    def _powersgd_factor(self, name, p, q, value=None):
        """The warm-start factor ``Q`` [p, q] of ``name`` (created from ``value`` or the seeded
        initial matrix on first use)."""
        if name not in self._powersgd_q:
            with tf.init_scope():
                self._powersgd_q[name] = tf.Variable(
                    powersgd.initial_q(name, p, q) if value is None else tf.constant(value, tf.float32),
                    trainable=False, name="hgsgc_powersgd_q/" + name.replace(":", "_"))
        return self._powersgd_q[name]

    def factor_state(self) -> dict:
        """PowerSGD's warm-start factors ``Q`` (numpy ``[p, q]`` per tensor name; empty otherwise)."""
        return {k: v.numpy() for k, v in self._powersgd_q.items()}

    def load_factor_state(self, state: dict):
        """Restore :meth:`factor_state` output (creates the factors not built yet)."""
        for name, q in state.items():
            self._powersgd_factor(name, *q.shape, value=q).assign(q)

    def _powersgd(self, tensors, names):
        """PowerSGD (Vogels et al. 2019, Algorithm 1): rank-q power iteration, error feedback."""
        comp: PowerSGDCompression = self.compression
        n, ps = self.size, self.process_set
        mats, ms, dense = [], [], []  # mats: (position, m, p, q, name)
        for i, (t, name) in enumerate(zip(tensors, names)):
            mpq = powersgd.matrix_shape(t.shape, comp.rank)
            if mpq is None:
                dense.append(i)
                continue
            m, p, q = mpq
            mat = tf.reshape(tf.cast(t, tf.float32), [m, p])
            if comp.error_feedback:
                mat = self.memory.compensate(name, mat)
            mats.append((i, m, p, q, name))
            ms.append(mat)

        def allreduce(xs, tag):
            if n == 1 or not xs:
                return list(xs)
            return hvd.grouped_allreduce(list(xs), op=hvd.Average, process_set=ps,
                                         name=f"hgsgc_powersgd_{tag}_{self._uid}")

        first = [tf.matmul(mat, self._powersgd_factor(name, p, q))
                 for mat, (_, _, p, q, name) in zip(ms, mats)]
        first += [tf.cast(tensors[i], tf.float32) for i in dense]
        first = allreduce(first, "p")
        p_hat = [powersgd.orthogonalize(pm) for pm in first[:len(mats)]]
        q_new = allreduce([tf.matmul(mat, ph, transpose_a=True) for mat, ph in zip(ms, p_hat)], "q")
        out = [None] * len(tensors)
        updates = []
        for mat, ph, qn, (i, _, _, _, name) in zip(ms, p_hat, q_new, mats):
            approx = tf.matmul(ph, qn, transpose_b=True)
            out[i] = approx
            updates.append(self._powersgd_q[name].assign(qn))
            if comp.error_feedback:
                updates.append(self.memory.update(name, mat, approx))
        for i, avg in zip(dense, first[len(mats):]):
            out[i] = avg
        p_bytes = 4 * sum(m * q for _, m, _, q, _ in mats)
        q_bytes = 4 * sum(p * q for _, _, p, q, _ in mats)
        dense_bytes = 4 * sum(int(tensors[i].shape.num_elements()) for i in dense)
        d = sum(int(t.shape.num_elements()) for t in tensors)
        wire = _ring_allreduce_bytes(n, p_bytes + dense_bytes) + _ring_allreduce_bytes(n, q_bytes)
        calls = 1 + (1 if mats else 0)
        updates.append(self.stats.add(
            exchanges=1, gradient_bytes=4 * d, payload_bytes=p_bytes + q_bytes + dense_bytes,
            bytes_sent=wire, bytes_received=wire, dense_bytes=_ring_allreduce_bytes(n, 4 * d),
            messages=calls, rounds=calls * 2 * (n - 1)))
        with tf.control_dependencies(updates):
            return [tf.cast(tf.reshape(o, t.shape), t.dtype) for o, t in zip(out, tensors)]

    # ----------------------------------------------------------------------------------------
    def payload_bytes(self, shapes: Sequence[Sequence[int]]) -> int:
        """The rank's payload in bytes for one exchange of float32 tensors of ``shapes``."""
        return codec.exchange_payload_bytes(self.compression, shapes)
