"""Communication layer: the collectives of one Horovod process set, and their byte accounting.

:class:`Communicator` is the only place in the compression path that calls Horovod collectives
(``grouped_allreduce``, ``allreduce``, ``allgather``, ``alltoall``). Each call records what it
moves in a per-exchange *ledger* using the formulas of :mod:`hgsgc.costs`; the exchange ends
with :meth:`Communicator.flush`, which adds the ledger to the int64 :class:`CommStats`
variables in one graph op. Counts are Python ints fixed when the graph is built (payload
lengths depend only on shapes and settings), except the point-to-point rounds of the tree /
node reducers, whose sizes are read off the tensors handed to Horovod; so they stay exact
inside ``tf.function``.

With ``n == 1`` no collective runs (the input is returned), but the call is still counted as
one message with zero bytes, like the collective it stands for.
"""
from __future__ import annotations

from typing import List, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc import costs

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
    critical path under the algorithm's model (:mod:`hgsgc.costs`).

    These are measurements, not algorithm state: the random-number step of the sampled selector
    and TernGrad is its own counter (:class:`hgsgc.compression.base.RandomStep`).
    """

    def __init__(self):
        with tf.init_scope():
            self.vars = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name="hgsgc_" + k)
                         for k in STAT_KEYS}

    def add(self, **amounts):
        """Add Python ints or int64 scalar tensors to the named counters; returns the op."""
        ops = []
        for k, v in amounts.items():
            if isinstance(v, (tf.Tensor, tf.Variable)):
                ops.append(self.vars[k].assign_add(tf.cast(v, tf.int64)))
            else:
                ops.append(self.vars[k].assign_add(tf.constant(int(v), tf.int64)))
        return tf.group(*ops)

    def snapshot(self) -> dict:
        """Current totals as Python ints."""
        return {k: int(v.numpy()) for k, v in self.vars.items()}

    def reset(self):
        for v in self.vars.values():
            v.assign(0)


def _is_global(ps) -> bool:
    return ps is hvd.global_process_set or getattr(ps, "process_set_id", 0) == 0


class Communicator:
    """Collectives over one Horovod process set, each one counted (see the module docstring).

    Args:
        process_set: Horovod process set (default: all ranks).
        stats: the :class:`CommStats` the ledger is flushed into (a new one if None).

    Attributes:
        size, rank: ranks in the set and this process's position in it.
        world_ranks: the Horovod (world) ranks of the set, in set order.
    """

    def __init__(self, process_set=None, stats: CommStats = None):
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.stats = stats if stats is not None else CommStats()
        self._ledger: List[dict] = []

    @property
    def size(self) -> int:
        return hvd.size() if _is_global(self.process_set) else len(self.process_set.ranks)

    @property
    def rank(self) -> int:
        if _is_global(self.process_set):
            return hvd.rank()
        return list(self.process_set.ranks).index(hvd.rank())

    @property
    def world_ranks(self) -> List[int]:
        if _is_global(self.process_set):
            return list(range(hvd.size()))
        return list(self.process_set.ranks)

    # ---------------------------------------------------------------------------------------
    def count(self, **amounts):
        """Record amounts (Python ints or int64 scalar tensors) for the next :meth:`flush`."""
        self._ledger.append(amounts)

    def flush(self):
        """Add everything recorded since the last flush to :attr:`stats`; returns the op."""
        total, tensors = {}, {}
        for entry in self._ledger:
            for k, v in entry.items():
                if isinstance(v, (tf.Tensor, tf.Variable)):
                    tensors.setdefault(k, []).append(v)
                else:
                    total[k] = total.get(k, 0) + int(v)
        self._ledger = []
        for k, ts in tensors.items():
            total[k] = tf.add_n(ts) + total.get(k, 0) if k in total else tf.add_n(ts)
        return self.stats.add(**total)

    # ---------------------------------------------------------------------------------------
    def grouped_allreduce(self, tensors: Sequence[tf.Tensor], op=hvd.Average,
                          compression=hvd.Compression.none, payload_bytes: int = None,
                          name: str = None) -> List[tf.Tensor]:
        """Ring allreduce of a list of tensors (one Horovod call); counts ``ring_allreduce_bytes``.

        Args:
            tensors: any shapes and dtypes Horovod reduces.
            op: ``hvd.Average`` / ``hvd.Sum`` / ``hvd.Max`` ...
            compression: Horovod's wire compressor (``none`` / ``fp16``).
            payload_bytes: the rank's bytes on the wire (default: the tensors' own size).
            name: Horovod op name (must be the same on every rank when given).

        Returns:
            the reduced tensors (the inputs themselves when ``size == 1``).
        """
        n = self.size
        if payload_bytes is None:
            payload_bytes = sum(int(t.shape.num_elements()) * t.dtype.size for t in tensors)
        wire = costs.ring_allreduce_bytes(n, payload_bytes)
        self.count(bytes_sent=wire, bytes_received=wire, messages=1,
                   rounds=costs.ring_allreduce_rounds(n))
        if n == 1 or not tensors:
            return list(tensors)
        kw = {"name": name} if name else {}
        return hvd.grouped_allreduce(list(tensors), op=op, compression=compression,
                                     process_set=self.process_set, **kw)

    def allreduce(self, tensor: tf.Tensor, op=hvd.Average, name: str = None) -> tf.Tensor:
        """Ring allreduce of one tensor; counted like :meth:`grouped_allreduce`."""
        n = self.size
        wire = costs.ring_allreduce_bytes(n, int(tensor.shape.num_elements()) * tensor.dtype.size)
        self.count(bytes_sent=wire, bytes_received=wire, messages=1,
                   rounds=costs.ring_allreduce_rounds(n))
        if n == 1:
            return tensor
        kw = {"name": name} if name else {}
        return hvd.allreduce(tensor, op=op, process_set=self.process_set, **kw)

    def allgather(self, buf: tf.Tensor) -> tf.Tensor:
        """Allgather of a 1-D uint8 payload of the same length ``P`` on every rank.

        Returns:
            uint8 ``[n * P]`` (rank order); counts ``(n - 1) P`` sent and received.
        """
        n = self.size
        w = costs.allgather_bytes(n, int(buf.shape[0]))
        self.count(bytes_sent=w, bytes_received=w, messages=1, rounds=costs.allgather_rounds(n))
        if n == 1:
            return tf.identity(buf)
        return hvd.allgather(buf, process_set=self.process_set)

    def alltoall(self, x: tf.Tensor, splits: Sequence[int], name: str) -> tf.Tensor:
        """Point-to-point round as one ``hvd.alltoall``: ``splits[r]`` bytes of ``x`` go to rank r.

        Counts the sizes of the tensors actually handed to / returned by Horovod (payload bytes,
        not Horovod's control traffic) and one message per non-zero split.
        """
        out, _ = hvd.alltoall(x, splits=tf.constant(list(splits), tf.int32), name=name,
                              ignore_name_scope=True, process_set=self.process_set)
        self.count(bytes_sent=tf.size(x, out_type=tf.int64),
                   bytes_received=tf.size(out, out_type=tf.int64),
                   messages=sum(1 for s in splits if s))
        return out
