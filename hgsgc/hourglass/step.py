"""The Hourglass training step: CONV trunk on most ranks, FC head on a few, activations between.

One step (``b`` examples per CONV rank, ``C`` CONV ranks, ``F`` FC ranks, global batch
``B = C b``; FC rank ``j`` serves ``m_j`` CONV ranks):

1. CONV rank: ``A = trunk(x)``; non-blocking ``Isend(A)``, ``Isend(labels)`` to its FC rank and
   ``Irecv(dA)`` (mpi4py, on the layout's ``p2p`` communicator, a ``Dup`` of ``COMM_WORLD``).
2. FC rank ``j``: ``Irecv`` from each of its CONV ranks, concatenate (CONV rank order), run the
   head and the per-example loss ``l_s``; with ``S_j = sum over its m_j b examples of l_s``:

   * FC gradient ``g_j = (F / B) dS_j/dtheta_fc``; the FC exchanger averages over the ``F`` FC
     ranks: ``(1/F) sum_j g_j = (1/B) sum_all dl_s/dtheta_fc`` = the gradient of the mean loss
     over the union of all CONV ranks' batches, whatever the ``m_j`` are;
   * activation gradient for example ``s`` of CONV rank ``i``: ``dA_s = (C / B) dl_s/dA_s``
     (``= (1/b) dl_s/dA_s``, the gradient of rank ``i``'s own mean loss), sent back with ``Isend``
     BEFORE the FC exchange so that CONV backward overlaps it.
3. CONV rank ``i``: ``g_i = (dA/dtheta_conv)^T dA = (C/B) sum_{s in i} dl_s/dtheta_conv``; the
   CONV exchanger (SGC or any ``hgsgc.Compression``) averages over ``C`` ranks:
   ``(1/C) sum_i g_i = (1/B) sum_all dl_s/dtheta_conv``.

With ``micro_batches = M > 1`` steps 1-2 are pipelined: each CONV rank sends its batch as M
consecutive messages, and the FC rank runs the head on micro-batch j as soon as it has it from
every CONV rank and sends its ``dA`` back at once, while micro-batch j + 1 is still arriving; the
FC gradients of the M micro-batches are summed before the one FC exchange (the same sum).

So with no compression one Hourglass step is one SGD step on the mean loss over the union of the
CONV ranks' batches (tests/mpi/check_hourglass.py checks this for 2-5 ranks, uneven ``m_j``
included). With SGC communication delay ``H > 1`` on the CONV ranks each CONV rank applies its
own ``g_i`` (the gradient of its local mean loss, exactly what a data-parallel rank applies)
locally and every ``H`` steps the compressed model deltas are averaged among the CONV ranks
(:class:`hgsgc.DistributedOptimizer`); the FC head stays synchronous every step. The FC
exchange must have ``delay == 1``.

Not supported: layers whose output depends on the batch composition (BatchNormalization in
training mode) in the trunk, since each CONV rank normalises its own batch.
"""
from __future__ import annotations

import math
import time
from typing import Dict, Optional

import numpy as np
import tensorflow as tf

TAG_ACT, TAG_LABEL, TAG_GRAD = 101, 102, 103
TAG_EVAL_HDR, TAG_EVAL_ACT, TAG_EVAL_LABEL = 111, 112, 113
TAG_MODEL = 121

P2P_KEYS = ("activation_bytes_sent", "label_bytes_sent", "activation_grad_bytes_received",
            "activation_bytes_received", "label_bytes_received", "activation_grad_bytes_sent",
            "p2p_messages")
WIRE_DTYPES = ("float32", "float16")
# seconds spent per phase (time.perf_counter), see HourglassTrainer.phase_times()
PHASE_KEYS = ("conv_wait_s", "fc_recv_wait_s", "fc_compute_s", "fc_apply_s", "fc_send_wait_s")
EXCHANGE_KEYS = ("exchanges", "gradient_bytes", "payload_bytes", "bytes_sent", "bytes_received",
                 "dense_bytes", "messages")


def _raw(x: np.ndarray) -> np.ndarray:
    """A buffer MPI can type: fp16 (no MPI datatype) travels as its uint16 bit pattern."""
    return x.view(np.uint16) if x.dtype == np.float16 else x


class HourglassTrainer:
    """Trains a split model on a :class:`~hgsgc.hourglass.layout.Layout`.

    Args:
        layout: the roles (Horovod must be initialised with its process sets).
        split: :class:`~hgsgc.hourglass.split.SplitModel`; CONV ranks train ``split.trunk``,
            FC ranks ``split.head``. The model must output logits (sparse categorical
            cross-entropy from logits is the loss, as in the data-parallel main job).
        batch_size: examples per CONV rank per step (fixed: FC ranks size their buffers by it).
        optimizer: a ``tf.keras.optimizers.legacy`` optimizer; wrapped per role with
            :func:`hgsgc.DistributedOptimizer` on the role's process set.
        compression: exchange among CONV ranks (e.g. ``Compression.sgc(...)``, delay allowed).
        fc_compression: exchange among FC ranks (``delay`` must be 1; dense by default).
        broadcast: broadcast the role's initial weights from the role's first rank.
        wire_dtype: numpy dtype of the boundary activations and activation gradients on the
            wire: ``"float32"`` (exact) or ``"float16"`` (half the point-to-point bytes; values
            are rounded to fp16: relative error <= 2^-11 for |x| >= 2^-14, absolute error
            <= 2^-25 below that (subnormals), and a value above 65504 stops the job).
            Compute stays in the model's dtype on both sides.
        micro_batches: M >= 1 (at most ``batch_size``): the boundary exchange is pipelined in M
            micro-batches; the FC rank runs the head on each as soon as it arrived from every
            CONV rank and sends its activation gradients back while the next one is still on
            the wire, so the FC link carries both directions at once. The FC gradient is the sum
            over micro-batches, so the step is the same SGD step (float summation order aside;
            dropout in the head draws its masks per micro-batch).

    Raises:
        ValueError: ``fc_compression`` with ``delay > 1``, ``batch_size < 1``, or an unsupported
            ``wire_dtype``, or ``micro_batches`` outside 1..batch_size.
    """

    def __init__(self, layout, split, batch_size: int, optimizer, compression=None,
                 fc_compression=None, broadcast: bool = True, wire_dtype: str = "float32",
                 micro_batches: int = 1):
        import horovod.tensorflow as hvd

        import hgsgc
        from hgsgc.compression import as_compression

        compression = as_compression(compression if compression is not None else hgsgc.Compression.none)
        fc_compression = as_compression(fc_compression if fc_compression is not None
                                        else hgsgc.Compression.none)
        if fc_compression.delay != 1:
            raise ValueError(f"the FC exchange of the Hourglass layout runs every step: "
                             f"fc compression delay must be 1, got {fc_compression.delay}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if str(wire_dtype) not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
        self.wire_dtype = np.dtype(str(wire_dtype))
        if (not isinstance(micro_batches, (int, np.integer)) or isinstance(micro_batches, bool)
                or not 1 <= micro_batches <= batch_size):
            raise ValueError(f"micro_batches must be an integer in 1..batch_size={batch_size}, "
                             f"got {micro_batches!r}")
        self.micro_batches = int(micro_batches)
        self.layout, self.split, self.batch_size = layout, split, int(batch_size)
        self.compression, self.fc_compression = compression, fc_compression
        self.comm = layout.p2p
        self.is_conv, self.is_fc = layout.is_conv, layout.is_fc
        self.net = split.trunk if self.is_conv else split.head
        self.variables = list(self.net.trainable_variables)
        self.opt = hgsgc.DistributedOptimizer(
            optimizer, compression=compression if self.is_conv else fc_compression,
            process_set=layout.process_set)
        if broadcast and len(layout.role_ranks) > 1:
            hvd.broadcast_variables(self.variables, root_rank=layout.role_root,
                                    process_set=layout.process_set)
        self.a_shape = tuple(split.boundary_shape)
        self.a_dtype = np.dtype(split.boundary_dtype)
        self.features = split.features
        C, F = layout.n_conv, layout.n_fc
        self.global_batch = C * self.batch_size
        self.fc_scale = F / self.global_batch          # FC gradient: (F / B) dS_j/dtheta
        self.a_scale = C / self.global_batch           # dA: (C / B) dl/dA = (1 / b) dl/dA
        self.counts: Dict[str, int] = {k: 0 for k in P2P_KEYS}
        self.times: Dict[str, float] = {k: 0.0 for k in PHASE_KEYS}
        self.steps = 0
        self._train_loss = np.zeros(2)  # FC ranks: sum of example losses, examples
        self._build()

    # ------------------------------------------------------------------------------------
    def _build(self):
        if self.is_conv:
            trunk, opt, variables = self.net, self.opt, self.variables

            @tf.function
            def conv_step(x, y):
                with tf.GradientTape() as tape:
                    a = trunk(x, training=True)
                g_a = tf.numpy_function(self._conv_swap, [a, y], a.dtype, stateful=True)
                g_a = tf.ensure_shape(g_a, a.shape)
                grads = tape.gradient(a, variables, output_gradients=g_a)
                opt.apply_gradients(zip(grads, variables))
                return tf.constant(0)

            self._conv_step = conv_step
            self._conv_eval = tf.function(lambda x: trunk(x, training=False), reduce_retracing=True)
        else:
            head, opt, variables = self.net, self.opt, self.variables
            fc_scale, a_scale = float(self.fc_scale), float(self.a_scale)
            spec_a = tf.TensorSpec((None,) + self.a_shape, tf.as_dtype(self.a_dtype))
            spec_y = tf.TensorSpec((None,), tf.int32)

            @tf.function(input_signature=[spec_a, spec_y])
            def fc_grads(a, y):
                with tf.GradientTape() as tape:
                    tape.watch(a)
                    per = tf.keras.losses.sparse_categorical_crossentropy(
                        y, head(a, training=True), from_logits=True)
                    s = tf.reduce_sum(per)
                g = tape.gradient(s, variables + [a])
                return s, g[-1] * a_scale, [gi * fc_scale for gi in g[:-1]]

            @tf.function
            def fc_apply(grads):
                opt.apply_gradients(zip(grads, variables))
                return tf.constant(0)

            @tf.function(input_signature=[spec_a, spec_y])
            def fc_eval(a, y):
                logits = head(a, training=False)
                loss = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y),
                                                tf.float64))
                return tf.reduce_sum(tf.cast(loss, tf.float64)), correct

            self._fc_grads, self._fc_apply, self._fc_eval = fc_grads, fc_apply, fc_eval

    # ------------------------------------------------------------------------------------
    def _chunks(self):
        """``[(lo, hi)]``: the micro-batches' example ranges within one CONV rank's batch."""
        edges = np.linspace(0, self.batch_size, self.micro_batches + 1).astype(int)
        return list(zip(edges[:-1], edges[1:]))

    def _conv_swap(self, a, y):
        """CONV rank: send (A, labels) to the FC rank, receive dA (inside the step's graph).

        With ``micro_batches = M > 1`` the batch goes as M consecutive messages per tensor (same
        tags: MPI keeps their order), so the FC rank can start on the first while the rest are
        on the wire.
        """
        from mpi4py import MPI

        out_dtype = a.dtype
        a = self._to_wire(a)
        y = np.ascontiguousarray(y, dtype=np.int32)
        g = np.empty_like(a)
        fc = self.layout.my_fc
        t0 = time.perf_counter()
        reqs = []
        for lo, hi in self._chunks():
            reqs += [self.comm.Isend(_raw(a[lo:hi]), dest=fc, tag=TAG_ACT),
                     self.comm.Isend(y[lo:hi], dest=fc, tag=TAG_LABEL),
                     self.comm.Irecv(_raw(g[lo:hi]), source=fc, tag=TAG_GRAD)]
        MPI.Request.Waitall(reqs)
        self.times["conv_wait_s"] += time.perf_counter() - t0
        c = self.counts
        c["activation_bytes_sent"] += a.nbytes
        c["label_bytes_sent"] += y.nbytes
        c["activation_grad_bytes_received"] += g.nbytes
        c["p2p_messages"] += len(reqs)
        return g.astype(out_dtype, copy=False)

    def _to_wire(self, x: np.ndarray) -> np.ndarray:
        """``x`` as a contiguous array of the wire dtype (overflow to inf raises)."""
        w = np.ascontiguousarray(x, dtype=self.wire_dtype)
        if w.dtype != x.dtype and not np.all(np.isfinite(w)) and np.all(np.isfinite(x)):
            raise FloatingPointError(f"boundary values exceed the range of wire_dtype "
                                     f"{self.wire_dtype.name} (max |x| = {np.max(np.abs(x)):.3g}): "
                                     f"use hourglass.wire_dtype=float32")
        return w

    def _fc_step(self) -> float:
        """FC rank: per micro-batch, wait for it from every CONV rank, run the head, send the
        activation gradients back at once (they travel while the next micro-batch arrives);
        then one FC exchange + update with the summed gradients."""
        from mpi4py import MPI

        b, convs = self.batch_size, self.layout.my_convs
        acts = [np.empty((b,) + self.a_shape, self.wire_dtype) for _ in convs]
        labels = [np.empty(b, np.int32) for _ in convs]
        g_wire = [np.empty((b,) + self.a_shape, self.wire_dtype) for _ in convs]
        chunks = self._chunks()
        tm = self.times
        recvs = []
        for lo, hi in chunks:  # posted in order: the j-th message of a tag is chunk j
            recvs.append([r for c, a, y in zip(convs, acts, labels)
                          for r in (self.comm.Irecv(_raw(a[lo:hi]), source=c, tag=TAG_ACT),
                                    self.comm.Irecv(y[lo:hi], source=c, tag=TAG_LABEL))])
        sends, total, grads = [], 0.0, None
        for (lo, hi), reqs in zip(chunks, recvs):
            t1 = time.perf_counter()
            MPI.Request.Waitall(reqs)
            t2 = time.perf_counter()
            a = np.concatenate([x[lo:hi] for x in acts]).astype(self.a_dtype, copy=False)
            y = np.concatenate([x[lo:hi] for x in labels])
            s, g_a, g = self._fc_grads(tf.constant(a), tf.constant(y))
            g_a = self._to_wire(g_a.numpy())
            rows = hi - lo
            for i, c in enumerate(convs):
                g_wire[i][lo:hi] = g_a[i * rows:(i + 1) * rows]
                sends.append(self.comm.Isend(_raw(g_wire[i][lo:hi]), dest=c, tag=TAG_GRAD))
            total += float(s)
            grads = g if grads is None else [x + z for x, z in zip(grads, g)]
            tm["fc_recv_wait_s"] += t2 - t1
            tm["fc_compute_s"] += time.perf_counter() - t2
        t3 = time.perf_counter()
        self._fc_apply(grads)  # FC exchange among FC ranks overlaps the CONV backward passes
        t4 = time.perf_counter()
        MPI.Request.Waitall(sends)
        t5 = time.perf_counter()
        tm["fc_apply_s"] += t4 - t3
        tm["fc_send_wait_s"] += t5 - t4
        cnt = self.counts
        cnt["activation_bytes_received"] += sum(x.nbytes for x in acts)
        cnt["label_bytes_received"] += sum(x.nbytes for x in labels)
        cnt["activation_grad_bytes_sent"] += sum(x.nbytes for x in g_wire)
        cnt["p2p_messages"] += 3 * len(convs) * len(chunks)
        n_examples = b * len(convs)
        self._train_loss += (total, n_examples)
        return total / n_examples

    def train_step(self, x: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None):
        """One Hourglass step. CONV ranks pass their batch ``x [b, ...]``, ``y [b]``; FC ranks
        pass nothing.

        Returns:
            FC ranks: mean loss over the examples they served; CONV ranks: None.

        Raises:
            ValueError: a CONV rank without a batch of exactly ``batch_size`` examples.
        """
        if self.is_conv:
            if x is None or y is None or len(x) != self.batch_size or len(y) != self.batch_size:
                raise ValueError(f"CONV rank {self.layout.rank}: train_step needs x and y with "
                                 f"batch_size={self.batch_size} examples")
            self._conv_step(tf.constant(x), tf.constant(np.asarray(y, np.int32)))
            out = None
        else:
            out = self._fc_step()
        self.steps += 1
        return out

    def synchronize(self) -> bool:
        """Run the pending SGC sync now (CONV ranks with ``delay > 1`` and local steps since the
        last sync), so every CONV rank holds the same trunk; call on every rank before evaluating
        or saving (a collective among CONV ranks; FC ranks return at once).

        Returns:
            True if an exchange ran on this rank.
        """
        if self.is_conv and hasattr(self.opt, "hgsgc_synchronize"):
            return bool(self.opt.hgsgc_synchronize(self.variables))
        return False

    # ------------------------------------------------------------------------------------
    def evaluate(self, x: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None,
                 batch_size: int = 500):
        """Evaluate through the same split; collective over all ranks of the layout.

        CONV ranks pass their evaluation shard (any length, 0 included); FC ranks pass nothing.

        Returns:
            ``(mean loss, accuracy)`` over all CONV ranks' shards, identical on every rank.
        """
        from mpi4py import MPI

        sums = np.zeros(3)  # loss sum, correct, examples
        if self.is_conv:
            n = 0 if x is None else len(x)
            fc = self.layout.my_fc
            self.comm.Send(np.array([n, batch_size], np.int64), dest=fc, tag=TAG_EVAL_HDR)
            for s in range(0, n, batch_size):
                a = self._to_wire(self._conv_eval(tf.constant(x[s:s + batch_size])).numpy())
                yy = np.ascontiguousarray(y[s:s + batch_size], dtype=np.int32)
                MPI.Request.Waitall([self.comm.Isend(_raw(a), dest=fc, tag=TAG_EVAL_ACT),
                                     self.comm.Isend(yy, dest=fc, tag=TAG_EVAL_LABEL)])
        else:
            convs = self.layout.my_convs
            hdr = [np.empty(2, np.int64) for _ in convs]
            MPI.Request.Waitall([self.comm.Irecv(h, source=c, tag=TAG_EVAL_HDR)
                                 for h, c in zip(hdr, convs)])
            lens = [int(h[0]) for h in hdr]
            ebs = [max(1, int(h[1])) for h in hdr]
            rounds = max([math.ceil(n / eb) for n, eb in zip(lens, ebs)] + [0])
            for r in range(rounds):
                acts, labels, reqs = [], [], []
                for c, n, eb in zip(convs, lens, ebs):
                    rows = min(eb, n - r * eb)
                    if rows <= 0:
                        continue
                    a = np.empty((rows,) + self.a_shape, self.wire_dtype)
                    yy = np.empty(rows, np.int32)
                    reqs += [self.comm.Irecv(_raw(a), source=c, tag=TAG_EVAL_ACT),
                             self.comm.Irecv(yy, source=c, tag=TAG_EVAL_LABEL)]
                    acts.append(a)
                    labels.append(yy)
                MPI.Request.Waitall(reqs)
                l, k = self._fc_eval(tf.constant(np.concatenate(acts).astype(self.a_dtype, copy=False)),
                                     tf.constant(np.concatenate(labels)))
                sums += (float(l), float(k), sum(len(t) for t in labels))
        tot = np.zeros(3)
        self.comm.Allreduce(sums, tot, op=MPI.SUM)
        if tot[2] == 0:
            return float("nan"), float("nan")
        return tot[0] / tot[2], tot[1] / tot[2]

    def train_loss(self, reset: bool = True) -> float:
        """Mean training loss over every example trained since the last reset (collective)."""
        from mpi4py import MPI

        tot = np.zeros(2)
        self.comm.Allreduce(self._train_loss, tot, op=MPI.SUM)
        if reset:
            self._train_loss[:] = 0
        return tot[0] / tot[1] if tot[1] else float("nan")

    # ------------------------------------------------------------------------------------
    def snapshot(self) -> Dict[str, int]:
        """Cumulative byte counts of this rank (Python ints).

        Keys: :data:`P2P_KEYS` (activations/labels/activation gradients, by direction),
        ``exchange_*`` (this role's gradient exchange: payload, bytes sent/received, ...),
        ``bytes_sent`` / ``bytes_received`` (point-to-point + exchange), ``steps``.
        """
        out = dict(self.counts)
        ex = self.opt.hgsgc_stats.snapshot()
        out.update({f"exchange_{k}": int(ex[k]) for k in EXCHANGE_KEYS})
        out["bytes_sent"] = (out["activation_bytes_sent"] + out["label_bytes_sent"]
                             + out["activation_grad_bytes_sent"] + out["exchange_bytes_sent"])
        out["bytes_received"] = (out["activation_bytes_received"] + out["label_bytes_received"]
                                 + out["activation_grad_bytes_received"] + out["exchange_bytes_received"])
        out["steps"] = self.steps
        return out

    def phase_times(self, reset: bool = False) -> Dict[str, float]:
        """Seconds this rank spent in each phase since the last reset (:data:`PHASE_KEYS`).

        CONV ranks: ``conv_wait_s``, from posting the activation sends to holding the activation
        gradients (wire both ways + the FC rank's work + waiting for it); the rest of a CONV step
        is trunk compute and the CONV gradient exchange. FC ranks: ``fc_recv_wait_s`` (waiting for
        the CONV ranks' activations: their forward pass + the wire), ``fc_compute_s`` (head
        forward/backward), ``fc_apply_s`` (FC exchange + update), ``fc_send_wait_s`` (activation
        gradients still on the wire after that). The other role's keys stay 0.
        """
        out = dict(self.times)
        if reset:
            self.times = {k: 0.0 for k in PHASE_KEYS}
        return out

    def role_weights(self) -> np.ndarray:
        """This role's trainable weights, flattened and concatenated (for checks)."""
        return np.concatenate([v.numpy().ravel() for v in self.variables])

    def assemble_model(self, root: int = 0) -> Optional[tf.keras.Model]:
        """The whole trained model as one ordinary Keras model on world rank ``root``.

        The trunk weights come from the first CONV rank, the head weights from the first FC rank
        (point-to-point); every other rank returns None without communicating.
        """
        plan = self.layout.plan
        me = self.layout.rank
        conv_root, fc_root = plan.conv_ranks[0], plan.fc_ranks[0]
        trunk, head = self.split.trunk, self.split.head
        if me == conv_root and root != conv_root:
            self.comm.send([v.numpy() for v in trunk.weights], dest=root, tag=TAG_MODEL)
        if me == fc_root and root != fc_root:
            self.comm.send([v.numpy() for v in head.weights], dest=root, tag=TAG_MODEL + 1)
        if me != root:
            return None
        if root != conv_root:
            trunk.set_weights(self.comm.recv(source=conv_root, tag=TAG_MODEL))
        if root != fc_root:
            head.set_weights(self.comm.recv(source=fc_root, tag=TAG_MODEL + 1))
        return self.split.model
