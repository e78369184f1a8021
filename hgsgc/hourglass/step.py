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
(:class:`hgsgc.DistributedOptimizer`). The FC ranks follow the same semantics with their own
``fc_compression`` (SGC with error feedback and delay ``H_fc``: each FC rank applies its own
``g_j`` locally, every ``H_fc`` steps the compressed head deltas are averaged among FC ranks).

Not supported: layers whose output depends on the batch composition (BatchNormalization in
training mode) in the trunk, since each CONV rank normalises its own batch.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Dict, Optional

import numpy as np
import tensorflow as tf

from hgsgc.faults import StallError, wait_for_peers
from hgsgc.hourglass.boundary import check_pair, generator_state, set_generator_state

TAG_ACT, TAG_LABEL, TAG_GRAD = 101, 102, 103
TAG_EVAL_HDR, TAG_EVAL_ACT, TAG_EVAL_LABEL = 111, 112, 113
TAG_MODEL = 121

P2P_KEYS = ("activation_bytes_sent", "label_bytes_sent", "activation_grad_bytes_received",
            "activation_bytes_received", "label_bytes_received", "activation_grad_bytes_sent",
            "p2p_messages")
WIRE_DTYPES = ("float32", "float16")
# seconds spent per phase (time.perf_counter), see HourglassTrainer.phase_times()
PHASE_KEYS = ("conv_wait_s", "fc_recv_wait_s", "fc_compute_s", "fc_apply_s", "fc_send_wait_s",
              "codec_s")
# boundary codec work per direction and operation (see HourglassTrainer.codec_times())
CODEC_KEYS = ("encode_act", "decode_act", "encode_grad", "decode_grad")
EXCHANGE_KEYS = ("exchanges", "gradient_bytes", "payload_bytes", "bytes_sent", "bytes_received",
                 "dense_bytes", "messages")


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
        fc_compression: exchange among FC ranks (dense by default; SGC with error feedback and
            delay as on the CONV side).
        broadcast: broadcast the role's initial weights from the role's first rank.
        wire_dtype: legacy shorthand for both codecs: ``"float32"`` = ``fp32`` (exact),
            ``"float16"`` = ``fp16``. Ignored where ``act_codec`` / ``grad_codec`` is given.
        act_codec, grad_codec: boundary codecs of the two directions (activations CONV -> FC,
            activation gradients FC -> CONV), spec strings or
            :class:`~hgsgc.hourglass.boundary.BoundaryCodec`: ``fp32``, ``fp16``, ``q8``, ``q4``,
            optionally ``sparse+`` (see :mod:`hgsgc.hourglass.boundary` for payload lengths and
            error bounds). Compute stays in the model's dtype on both sides.
        micro_batches: M >= 1 (at most ``batch_size``): GPipe-style pipeline. Each CONV rank runs
            the trunk forward micro-batch by micro-batch and sends each as soon as it exists, so
            the FC rank's head (forward + backward of micro-batch j, then its ``dA`` sent back)
            overlaps the CONV rank's forward of j + 1; after the last forward the CONV rank runs
            the backward passes in the same order, each as soon as its ``dA`` arrived. One
            update per step: the gradients are sums over micro-batches, so the step is the same
            SGD step (float summation order aside; dropout draws masks per micro-batch).
        codec_seed: seed of the stochastic rounding (``numpy`` generator seeded with
            ``(codec_seed, world rank)``); its state is in :meth:`rng_state` (checkpoints).
        record: keep this step's boundary tensors in ``self.recorded`` (tests: CONV ranks ``a``,
            ``g_dec``; FC ranks ``a_dec``, ``g``, ``mask``, lists over micro-batches x CONV ranks).
        stall_timeout_s: ``T`` seconds (``faults.stall_timeout_s``; 0 = wait forever). A rank
            that waits longer than ``T`` for a boundary message (FC rank: a CONV rank's
            activations; either side: a send the peer never receives) raises
            :class:`hgsgc.faults.StallError` naming the peer; waits whose message depends on
            the peer's own receives (a CONV rank waiting for activation gradients, which the FC
            rank computes once every CONV rank's activations arrived; the loss/evaluation
            allreduces) get ``1.5 T``, so the rank waiting for the stalled rank directly reports
            first. :func:`hgsgc.cli.run_guarded` prints it once and ends the job.

    Raises:
        ValueError: ``batch_size < 1``, an unsupported ``wire_dtype``, ``micro_batches`` outside
            1..batch_size.
        hgsgc.hourglass.boundary.BoundaryCodecError: an unknown codec, or ``sparse+`` on the
            gradient direction without it on the activation direction (or with a trunk that does
            not end in a ReLU).
    """

    def __init__(self, layout, split, batch_size: int, optimizer, compression=None,
                 fc_compression=None, broadcast: bool = True, wire_dtype: str = "float32",
                 micro_batches: int = 1, act_codec=None, grad_codec=None, codec_seed: int = 0,
                 record: bool = False, stall_timeout_s: float = 0.0):
        import horovod.tensorflow as hvd

        import hgsgc
        from hgsgc.compression import as_compression

        compression = as_compression(compression if compression is not None else hgsgc.Compression.none)
        fc_compression = as_compression(fc_compression if fc_compression is not None
                                        else hgsgc.Compression.none)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if str(wire_dtype) not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
        self.wire_dtype = np.dtype(str(wire_dtype))
        default = "fp16" if self.wire_dtype == np.float16 else "fp32"
        self.act_codec, self.grad_codec = check_pair(act_codec or default, grad_codec or default,
                                                     split.trunk)
        self.rng = np.random.default_rng([int(codec_seed), int(layout.rank)])
        self.record, self.recorded = bool(record), {}
        self.stall_timeout_s = max(0.0, float(stall_timeout_s or 0.0))
        self._fault = None  # a StallError raised inside the step's graph (numpy_function)
        self._pending = []
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
        self._codec_t = {k: [0, 0.0, 0.0] for k in CODEC_KEYS}  # calls, wall s, thread CPU s
        # a list to profile steps: _mark appends (label, perf_counter, process_time, thread_time,
        # thread id); scripts/profile_hourglass.py turns the marks into phases
        self.trace = None
        self.steps = 0
        self._train_loss = np.zeros(2)  # FC ranks: sum of example losses, examples
        self._build()

    # ------------------------------------------------------------------------------------
    def _build(self):
        if self.is_conv:
            trunk, opt, variables = self.net, self.opt, self.variables
            chunks = self._chunks()

            @tf.function
            def conv_step(x, y):
                # GPipe-style: every micro-batch's forward (each sent as soon as it exists, so
                # the FC rank works on micro-batch j while this rank computes j + 1), then every
                # micro-batch's backward in the same order (backward j runs while dA j+1 is
                # still on the wire), then one update.
                tok = tf.constant(0)
                acts = []
                with tf.GradientTape(persistent=len(chunks) > 1) as tape:
                    for j, (lo, hi) in enumerate(chunks):
                        with tf.control_dependencies([tok]):
                            xj = tf.identity(x[lo:hi])
                        a = trunk(xj, training=True)
                        tok = tf.numpy_function(self._conv_send, [a, y[lo:hi], tf.constant(j)],
                                                tf.int32, stateful=True)
                        acts.append(a)
                grads = None
                for j, a in enumerate(acts):
                    with tf.control_dependencies([tok]):
                        g_a = tf.numpy_function(self._conv_recv, [tf.constant(j)], a.dtype,
                                                stateful=True)
                    g_a = tf.ensure_shape(g_a, a.shape)
                    gj = tape.gradient(a, variables, output_gradients=g_a)
                    grads = gj if grads is None else [u + v for u, v in zip(grads, gj)]
                    tok = tf.reduce_sum(grads[0]) if len(acts) > 1 else tok
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
        from hgsgc.hourglass.costmodel import micro_batch_bounds

        return micro_batch_bounds(self.batch_size, self.micro_batches)

    def _mark(self, label):
        if self.trace is not None:
            self.trace.append((label, time.perf_counter(), time.process_time(), time.thread_time(),
                               threading.get_ident()))

    def _timed_codec(self, key, fn, *args, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kw)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.times["codec_s"] += t1 - t0
        rec = self._codec_t[key]
        rec[0] += 1
        rec[1] += t1 - t0
        rec[2] += c1 - c0
        return out

    def _encode(self, codec, x, mask=None):
        key = "encode_act" if self.is_conv else "encode_grad"
        return self._timed_codec(key, codec.encode, x, self.rng, mask=mask)

    def _decode(self, codec, buf, rows, mask=None):
        key = "decode_grad" if self.is_conv else "decode_act"
        return self._timed_codec(key, codec.decode, buf, rows, self.features, mask=mask)

    def codec_times(self, reset: bool = False) -> Dict[str, Dict[str, float]]:
        """This rank's boundary codec work since the last reset, per :data:`CODEC_KEYS` entry
        (CONV ranks: ``encode_act``, ``decode_grad``; FC ranks: ``decode_act``, ``encode_grad``;
        one call = one micro-batch of one CONV rank): ``{"calls": int, "wall_s": float,
        "cpu_s": float}``, wall = ``time.perf_counter``, cpu = ``time.thread_time`` of the
        calling thread (the codec is single-threaded: numpy or the C quantizers), so the CPU
        figure does not count time this process waited for a core on a loaded machine.
        Training steps only."""
        out = {k: {"calls": int(v[0]), "wall_s": float(v[1]), "cpu_s": float(v[2])}
               for k, v in self._codec_t.items()}
        if reset:
            self._codec_t = {k: [0, 0.0, 0.0] for k in CODEC_KEYS}
        return out

    def _conv_send(self, a, y, j):
        """CONV rank, micro-batch ``j``: encode and ``Isend`` its activations and labels to the FC
        rank and post the ``Irecv`` of its activation gradients (inside the step's graph, right
        after the micro-batch's forward pass). Micro-batches go as consecutive messages with the
        same tags (MPI keeps their order)."""
        j = int(j)
        self._mark(f"send_enter {j}")
        if j == 0:
            self._pending = []
        rows = a.shape[0]
        flat = np.ascontiguousarray(a, np.float32).reshape(rows, self.features)
        payload = self._encode(self.act_codec, flat)
        mask = (flat != 0) if self.grad_codec.sparse else None
        nnz = int(np.count_nonzero(mask)) if mask is not None else None
        g_buf = np.empty(self.grad_codec.length(rows, self.features, nnz, masked=True), np.uint8)
        yy = np.ascontiguousarray(y, dtype=np.int32)
        fc = self.layout.my_fc
        reqs = [self.comm.Isend(payload, dest=fc, tag=TAG_ACT),
                self.comm.Isend(yy, dest=fc, tag=TAG_LABEL),
                self.comm.Irecv(g_buf, source=fc, tag=TAG_GRAD)]
        self._pending.append((reqs, payload, yy, g_buf, mask, flat))
        c = self.counts
        c["activation_bytes_sent"] += payload.nbytes
        c["label_bytes_sent"] += yy.nbytes
        c["activation_grad_bytes_received"] += g_buf.nbytes
        c["p2p_messages"] += 3
        self._mark(f"send_exit {j}")
        return np.int32(j)

    def _conv_recv(self, j):
        """CONV rank, micro-batch ``j``: wait for its activation gradients, decode them."""
        reqs, payload, yy, g_buf, mask, flat = self._pending[int(j)]
        self._mark(f"recv_enter {int(j)}")
        t0 = time.perf_counter()
        fc = self.layout.my_fc
        try:  # the FC rank sends dA once it has every CONV rank's activations: 1.5 T
            wait_for_peers(reqs, [fc] * len(reqs), f"activation gradients (step {self.steps}, "
                           f"micro-batch {int(j)})", 1.5 * self.stall_timeout_s,
                           setting_s=self.stall_timeout_s)
        except StallError as exc:
            self._fault = exc  # TensorFlow wraps it; train_step raises it as is
            raise
        self.times["conv_wait_s"] += time.perf_counter() - t0
        self._mark(f"recv_waited {int(j)}")
        g, _ = self._decode(self.grad_codec, g_buf, flat.shape[0], mask=mask)
        if self.record:  # (micro-batch, tensor)
            self.recorded.setdefault("a", []).append((int(j), flat.copy()))
            self.recorded.setdefault("g_dec", []).append((int(j), g.copy()))
        self._mark(f"recv_exit {int(j)}")
        return g.reshape((flat.shape[0],) + self.a_shape).astype(self.a_dtype, copy=False)

    def _fc_step(self) -> float:
        """FC rank: per micro-batch, wait for it from every CONV rank, decode, run the head,
        encode and send the activation gradients back at once (they travel while the next
        micro-batch arrives); then one FC exchange + update with the summed gradients."""
        from mpi4py import MPI

        convs, f = self.layout.my_convs, self.features
        chunks = self._chunks()
        tm = self.times
        recvs = []
        for lo, hi in chunks:  # posted in order: the j-th message of a tag is chunk j
            bufs = [(np.empty(self.act_codec.max_length(hi - lo, f), np.uint8),
                     np.empty(hi - lo, np.int32)) for _ in convs]
            reqs = [r for c, (p, y) in zip(convs, bufs)
                    for r in (self.comm.Irecv(p, source=c, tag=TAG_ACT),
                              self.comm.Irecv(y, source=c, tag=TAG_LABEL))]
            recvs.append((bufs, reqs))
        sends, keep, total, grads = [], [], 0.0, None
        cnt = self.counts
        for (lo, hi), (bufs, reqs) in zip(chunks, recvs):
            rows = hi - lo
            statuses = [MPI.Status() for _ in reqs]
            self._mark(f"recv_enter {len(sends) // len(convs)}")
            t1 = time.perf_counter()
            wait_for_peers(reqs, [c for c in convs for _ in range(2)],
                           f"activations (step {self.steps}, micro-batch {len(sends) // len(convs)})",
                           self.stall_timeout_s, statuses)
            t2 = time.perf_counter()
            self._mark(f"recv_waited {len(sends) // len(convs)}")
            acts, masks, labels = [], [], []
            for i, (p, y) in enumerate(bufs):
                nbytes = statuses[2 * i].Get_count(MPI.BYTE)
                a, m = self._decode(self.act_codec, p[:nbytes], rows)
                acts.append(a)
                masks.append(m)
                labels.append(y)
                cnt["activation_bytes_received"] += nbytes
                cnt["label_bytes_received"] += y.nbytes
            a = np.concatenate(acts).reshape((-1,) + self.a_shape).astype(self.a_dtype, copy=False)
            y = np.concatenate(labels)
            self._mark(f"head_enter {len(sends) // len(convs)}")
            t3 = time.perf_counter()
            s, g_a, g = self._fc_grads(tf.constant(a), tf.constant(y))
            t4 = time.perf_counter()
            self._mark(f"head_exit {len(sends) // len(convs)}")
            g_a = g_a.numpy().reshape(-1, f)
            for i, c in enumerate(convs):
                gi = g_a[i * rows:(i + 1) * rows]
                payload = self._encode(self.grad_codec, gi, masks[i] if self.grad_codec.sparse else None)
                if self.record:  # (CONV world rank, first row, tensor)
                    self.recorded.setdefault("a_dec", []).append((c, int(lo), acts[i].copy()))
                    self.recorded.setdefault("g", []).append((c, int(lo), gi.copy()))
                keep.append(payload)
                sends.append(self.comm.Isend(payload, dest=c, tag=TAG_GRAD))
                cnt["activation_grad_bytes_sent"] += payload.nbytes
            total += float(s)
            grads = g if grads is None else [x + z for x, z in zip(grads, g)]
            tm["fc_recv_wait_s"] += t2 - t1
            tm["fc_compute_s"] += t4 - t3
        self._mark("apply_enter")
        t3 = time.perf_counter()
        self._fc_apply(grads)  # FC exchange among FC ranks overlaps the CONV backward passes
        t4 = time.perf_counter()
        self._mark("apply_exit")
        wait_for_peers(sends, [c for _ in chunks for c in convs],
                       f"CONV ranks to receive activation gradients (step {self.steps})",
                       self.stall_timeout_s)
        t5 = time.perf_counter()
        tm["fc_apply_s"] += t4 - t3
        tm["fc_send_wait_s"] += t5 - t4
        cnt["p2p_messages"] += 3 * len(convs) * len(chunks)
        n_examples = self.batch_size * len(convs)
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
            self._mark("step_start")
            try:
                self._conv_step(tf.constant(x), tf.constant(np.asarray(y, np.int32)))
            except tf.errors.OpError:
                if self._fault is not None:
                    raise self._fault from None
                raise
            self._mark("step_end")
            out = None
        else:
            self._mark("step_start")
            out = self._fc_step()
            self._mark("step_end")
        self.steps += 1
        return out

    def synchronize(self) -> bool:
        """Run the pending SGC sync now (a role with ``delay > 1`` and local steps since the last
        sync), so every CONV rank holds the same trunk and every FC rank the same head; call on
        every rank before evaluating or saving (a collective within each role).

        Returns:
            True if an exchange ran on this rank.
        """
        if hasattr(self.opt, "hgsgc_synchronize"):
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
                a = self._conv_eval(tf.constant(x[s:s + batch_size])).numpy()
                payload = self.act_codec.encode(a.reshape(len(a), -1), self.rng)
                yy = np.ascontiguousarray(y[s:s + batch_size], dtype=np.int32)
                wait_for_peers([self.comm.Isend(payload, dest=fc, tag=TAG_EVAL_ACT),
                                self.comm.Isend(yy, dest=fc, tag=TAG_EVAL_LABEL)], [fc, fc],
                               "the FC rank to receive evaluation activations", self.stall_timeout_s)
        else:
            convs = self.layout.my_convs
            hdr = [np.empty(2, np.int64) for _ in convs]
            wait_for_peers([self.comm.Irecv(h, source=c, tag=TAG_EVAL_HDR)
                            for h, c in zip(hdr, convs)], convs, "the evaluation header",
                           self.stall_timeout_s)
            lens = [int(h[0]) for h in hdr]
            ebs = [max(1, int(h[1])) for h in hdr]
            rounds = max([math.ceil(n / eb) for n, eb in zip(lens, ebs)] + [0])
            for r in range(rounds):
                acts, labels, reqs, peers = [], [], [], []
                for c, n, eb in zip(convs, lens, ebs):
                    rows = min(eb, n - r * eb)
                    if rows <= 0:
                        continue
                    a = np.empty(self.act_codec.max_length(rows, self.features), np.uint8)
                    yy = np.empty(rows, np.int32)
                    reqs += [self.comm.Irecv(a, source=c, tag=TAG_EVAL_ACT),
                             self.comm.Irecv(yy, source=c, tag=TAG_EVAL_LABEL)]
                    acts.append(a)
                    labels.append(yy)
                    peers += [c, c]
                statuses = [MPI.Status() for _ in reqs]
                wait_for_peers(reqs, peers, f"evaluation activations (round {r})",
                               self.stall_timeout_s, statuses)
                dec = [self.act_codec.decode(a[:st.Get_count(MPI.BYTE)], len(yy), self.features)[0]
                       for a, yy, st in zip(acts, labels, statuses[0::2])]
                a = np.concatenate(dec).reshape((-1,) + self.a_shape).astype(self.a_dtype, copy=False)
                l, k = self._fc_eval(tf.constant(a), tf.constant(np.concatenate(labels)))
                sums += (float(l), float(k), sum(len(t) for t in labels))
        tot = np.zeros(3)
        wait_for_peers([self.comm.Iallreduce(sums, tot, op=MPI.SUM)], None,
                       "the evaluation allreduce", 1.5 * self.stall_timeout_s,
                       setting_s=self.stall_timeout_s)
        if tot[2] == 0:
            return float("nan"), float("nan")
        return tot[0] / tot[2], tot[1] / tot[2]

    def train_loss(self, reset: bool = True) -> float:
        """Mean training loss over every example trained since the last reset (collective)."""
        from mpi4py import MPI

        tot = np.zeros(2)
        wait_for_peers([self.comm.Iallreduce(self._train_loss, tot, op=MPI.SUM)], None,
                       "the training-loss allreduce", 1.5 * self.stall_timeout_s,
                       setting_s=self.stall_timeout_s)
        if reset:
            self._train_loss[:] = 0
        return tot[0] / tot[1] if tot[1] else float("nan")

    def rng_state(self) -> dict:
        """This rank's stochastic-rounding generator state (plain ints; see
        :func:`hgsgc.hourglass.boundary.generator_state`), for checkpoints."""
        return generator_state(self.rng)

    def load_rng_state(self, state: dict) -> None:
        """Restore :meth:`rng_state` (ValueError if it belongs to another bit generator)."""
        set_generator_state(self.rng, state)

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
