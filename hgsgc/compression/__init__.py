"""Compression settings and building blocks.

``Compression`` mirrors ``horovod.tensorflow.Compression`` so switching is one argument::

    opt = hgsgc.DistributedOptimizer(opt, compression=hgsgc.Compression.sgc(density=0.005))

Each setting below is a frozen dataclass that knows its payload by formula
(``payload_bytes(shapes)``), its collective (``algorithm``; settings that issue more than one
collective per exchange list them in ``collectives(shapes)``) and how to build its composition
(``build(env)`` -> :class:`~hgsgc.compression.wrappers.Pipeline`): codecs (:mod:`.codec` top-k +
2-bit values, :mod:`.terngrad`, :mod:`.signsgd`), reducers (:mod:`.reducers`, PowerSGD's in
:mod:`.powersgd`), wrappers (:mod:`.wrappers`: error feedback, momentum correction, local
clipping, delay). Contracts and the method registry: :mod:`.base`; docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional

HIERARCHIES = ("allgather", "tree", "node")
SELECTORS = ("exact", "sampled")
#: The index coding of a sparse setting that names none (``compression.index_coding`` of method
#: topk / sgc / dgc, :class:`SparseCompression`, ``Compression.topk/sgc/dgc``, ``TopKCodec``):
#: ``"elias_fano"``, lossless and about half the index bytes of ``"fixed"`` (the default until
#: session 10). Values and layouts: :mod:`hgsgc.compression.wire` (re-exported there).
DEFAULT_INDEX_CODING = "elias_fano"
#: density and selector of a config-built sparse method whose config leaves them out
#: (``hgsgc.config``: ``compression.density``, ``compression.selector``)
DEFAULT_DENSITY = 0.005
DEFAULT_SELECTOR = "sampled"


@dataclass(frozen=True)
class DenseCompression:
    """Dense exchange through Horovod allreduce (average), optionally fp16 on the wire.

    ``kind`` is ``"none"`` (fp32, 4 bytes per entry) or ``"fp16"`` (Horovod's
    ``Compression.fp16``, 2 bytes per entry). ``delay=H > 1`` is local SGD (Lin et al. 2020):
    H local steps, then the model delta is averaged densely.
    Usable wherever Horovod expects a compressor (``compress``/``decompress``).
    """

    kind: str = "none"
    delay: int = 1

    def __post_init__(self):
        if self.kind not in ("none", "fp16"):
            raise ValueError(f"dense compression kind must be 'none' or 'fp16', got {self.kind!r}")
        _check_delay(self.delay)

    @property
    def horovod(self):
        import horovod.tensorflow as hvd

        return hvd.Compression.fp16 if self.kind == "fp16" else hvd.Compression.none

    @property
    def wire_bytes_per_entry(self) -> int:
        return 2 if self.kind == "fp16" else 4

    def compress(self, tensor):
        if self.delay != 1:  # stock Horovod would silently average every step
            _stock_horovod_error(self)
        return self.horovod.compress(tensor)

    def decompress(self, tensor, ctx):
        return self.horovod.decompress(tensor, ctx)

    def to_dict(self) -> dict:
        return {"method": self.kind, "delay": self.delay}

    compressed = False
    algorithm = "ring"

    @property
    def method(self) -> str:
        return "localsgd" if self.delay > 1 else self.kind

    def payload_bytes(self, shapes) -> int:
        """``wire_bytes_per_entry * numel`` summed over float32 ``shapes`` (bytes)."""
        return sum(self.wire_bytes_per_entry * _numel(s) for s in shapes)

    def build(self, env):
        """Dense settings never run the compressed pipeline (the Exchanger allreduces them)."""
        return None


@dataclass(frozen=True)
class SparseCompression:
    """Top-k sparsification with error feedback, optional 2-bit values and communication delay.

    Attributes:
        density: fraction of entries each rank sends per tensor, in (0, 1];
            k = max(1, ceil(density * numel)) clamped to numel.
        bits: 32 (fp32 values) or 2 (2-bit codes + two fp32 scales per tensor).
        delay: H >= 1. H = 1 compresses gradients each step; H > 1 runs H local optimizer steps
            and then exchanges the compressed model delta since the last sync (plus residual).
        hierarchy: how payloads are exchanged: ``"allgather"`` (flat, (n - 1) P bytes per rank),
            ``"tree"`` (global top-k by recursive doubling, at most (floor(log2 n) + 2) P bytes on
            the busiest rank) or ``"node"`` (reduce within a host, tree between host leaders);
            see :mod:`hgsgc.hierarchy` and docs/compression.md.
        selector: ``"exact"`` top-k or ``"sampled"`` threshold (Deep Gradient Compression).
        error_feedback: keep what was not sent in a residual (True) or drop it (False).
        momentum_correction: Deep Gradient Compression's momentum correction and momentum factor
            masking (Lin et al. 2018, Sec. 3.2): the wrapped optimizer's momentum m is applied
            locally before sparsification (u = m u + g), u is compressed with error feedback, the
            entries that were sent are cleared from u, and the averaged update is applied with
            momentum 0. Needs delay = 1 and an optimizer with a ``momentum`` hyperparameter.
        momentum_masking: with ``momentum_correction``, clear the sent entries of ``u`` (True,
            DGC's momentum factor masking) or keep ``u`` whole (False). Without masking every
            accumulated ``u_t`` is applied exactly once, sooner or later (the sum of the applied
            updates is ``sum_t u_t - e_T``, ``e_T`` the residual left), as momentum SGD applies
            it; at density 1 it is momentum SGD. Masking drops the momentum of the entries sent
            (at density 1: SGD without momentum), which Lin et al. use against stale momentum.
            False only with ``momentum_correction``.
        local_clip_norm: Deep Gradient Compression's local gradient clipping (Lin et al. 2018,
            Sec. 3.2): before its gradient enters the residual / momentum accumulation, each
            rank clips it to global L2 norm ``local_clip_norm / sqrt(n)`` (n ranks), so the sum
            of the n local clips matches one global clip at ``local_clip_norm``. ``None``: off.
            Needs delay = 1.
        method: the name reported in summaries (``"topk"`` or ``"sgc"``).
        dense_vectors: tensors of rank < 2 (biases, batch-norm scales and offsets) skip
            sparsification and are averaged by one fp32 ring allreduce (4 bytes per entry), as in
            Deep Gradient Compression's reference implementation, which sparsifies only
            parameters with more than one dimension (Lin et al. 2018; github.com/synxlin/
            deep-gradient-compression, ``train.py``). With ``momentum_correction`` their momentum
            is applied after the average, ``u = m u + avg`` (plain momentum SGD). At density
            0.01 a 16-entry batch-norm scale would otherwise send 1 entry per step.
        buckets: ``hierarchy="allgather"`` only: the number of allgathers per exchange (>= 1).
            1 (default): every tensor's payload in one fused allgather after the whole backward
            pass. B > 1: the tensors are cut, in reverse order (the last layers' gradients
            exist first in the backward pass), into at most B contiguous groups of about equal
            payload (:func:`hgsgc.compression.reducers.bucket_indices`), each exchanged by its
            own allgather as soon as its gradients are encoded, so TensorFlow's executor can
            run the first exchanges while earlier layers' gradients are still computed. Top-k,
            error feedback and the averages are per tensor, so they are the same bit for bit
            for every B; only the number of collectives (``messages``) changes.
        index_coding: how each payload's ascending indices are coded: ``"elias_fano"``
            (default since session 10, :data:`DEFAULT_INDEX_CODING`;
            Elias 1974 / Fano 1971 / Vigna 2013: ``l = floor(log2(numel / k))`` low bits each
            plus a unary high part, ``ceil(k l / 8) + ceil((k + ((numel - 1) >> l)) / 8)``
            bytes, about ``k (l + 2) / 8``) or ``"fixed"`` (``ceil(log2 numel)`` bits each, the
            default before; layout and exact lengths in :mod:`hgsgc.compression.wire`). Both
            are lossless and of a length fixed by ``(numel, k)``, so training is bit for bit the
            same (a checkpoint of either coding resumes under the other); only the payload (and
            ``bytes_sent``) shrinks. Every hierarchy supports it.
    """

    density: float
    bits: int = 2
    delay: int = 1
    hierarchy: str = "allgather"
    selector: str = "exact"
    error_feedback: bool = True
    method: str = "sgc"
    momentum_correction: bool = False
    local_clip_norm: Optional[float] = None
    dense_vectors: bool = False
    momentum_masking: bool = True
    buckets: int = 1
    index_coding: str = DEFAULT_INDEX_CODING

    def __post_init__(self):
        if isinstance(self.density, (str, bytes, bool)):
            raise ValueError(f"density must be a number in (0, 1], got {self.density!r}")
        try:
            d = float(self.density)
        except (TypeError, ValueError):
            raise ValueError(f"density must be a number in (0, 1], got {self.density!r}") from None
        if not 0.0 < d <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}: use e.g. density=0.01")
        if self.bits not in (2, 32):
            raise ValueError(f"bits must be 2 or 32, got {self.bits!r}")
        _check_delay(self.delay)
        if self.hierarchy not in HIERARCHIES:
            raise ValueError(f"hierarchy must be one of {HIERARCHIES}, got {self.hierarchy!r}")
        if self.momentum_correction and self.delay != 1:
            raise ValueError("momentum_correction needs delay=1: with delay > 1 the optimizer's "
                             "own momentum runs the local steps")
        if self.momentum_correction and not self.error_feedback:
            raise ValueError("momentum_correction needs error_feedback=True: momentum factor "
                             "masking clears exactly the entries that were sent, which it reads "
                             "off the residual")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if not isinstance(self.momentum_masking, bool):
            raise ValueError(f"momentum_masking must be True or False, got {self.momentum_masking!r}")
        if not self.momentum_masking and not self.momentum_correction:
            raise ValueError("momentum_masking=False applies to momentum correction only: set "
                             "momentum_correction=True as well, or leave momentum_masking=True")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        if not isinstance(self.dense_vectors, bool):
            raise ValueError(f"dense_vectors must be True or False, got {self.dense_vectors!r}")
        if isinstance(self.buckets, bool) or not isinstance(self.buckets, int) or self.buckets < 1:
            raise ValueError(f"buckets must be an integer >= 1 (1 = one fused allgather), got {self.buckets!r}")
        if self.buckets > 1 and self.hierarchy != "allgather":
            raise ValueError(f"buckets={self.buckets} splits the flat allgather: it needs "
                             f"hierarchy='allgather', got {self.hierarchy!r}")
        from hgsgc.compression.wire import check_index_coding

        check_index_coding(self.index_coding)
        if self.local_clip_norm is not None:
            _check_positive("local_clip_norm", self.local_clip_norm, "e.g. local_clip_norm=5.0")
            if self.delay != 1:
                raise ValueError("local_clip_norm needs delay=1: it clips each step's gradient "
                                 "before it is accumulated")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    compressed = True

    @property
    def algorithm(self) -> str:
        """The collective: ``allgather``, ``tree`` or ``node`` (:mod:`hgsgc.costs`)."""
        return self.hierarchy

    def codec(self):
        from hgsgc.compression.codec import TopKCodec

        return TopKCodec(self.density, self.bits, self.selector, self.index_coding)

    def payload_bytes(self, shapes) -> int:
        """Sum of the top-k codec's ``payload_length`` over float32 ``shapes`` (bytes); with
        ``dense_vectors``, shapes of rank < 2 count ``4 numel`` instead (their ring allreduce)."""
        return sum(b for _, b in self.collectives(shapes))

    def dense_shape(self, shape) -> bool:
        """True when a tensor of ``shape`` is averaged densely (``dense_vectors`` and rank < 2)."""
        return self.dense_vectors and len(tuple(shape)) < 2

    def collectives(self, shapes):
        """``((algorithm, sparse payload bytes),)``, plus ``("ring", 4 x dense entries)`` first
        when ``dense_vectors`` sends some of ``shapes`` densely."""
        codec = self.codec()
        sparse = sum(codec.payload_length(_numel(s)) for s in shapes if not self.dense_shape(s))
        dense = sum(4 * _numel(s) for s in shapes if self.dense_shape(s))
        return ((("ring", dense),) if dense else ()) + ((self.algorithm, sparse),)

    def build(self, env):
        """[local clip] -> [momentum correction] -> [error feedback] -> allgather | tree | node.

        Raises:
            ValueError: momentum correction without the optimizer's momentum (``env.momentum``).
        """
        from hgsgc.compression.reducers import Allgather, Hierarchical
        from hgsgc.compression.wrappers import ErrorFeedback, MomentumCorrection, Pipeline

        codec = self.codec()
        red = (Allgather(codec, self.buckets) if self.hierarchy == "allgather"
               else Hierarchical(codec, env.plan))
        if self.error_feedback:
            red = ErrorFeedback(red, env.stores["residuals"])
        if self.momentum_correction:
            if env.momentum is None:
                raise ValueError(
                    f"compression {self.method} does momentum correction (Lin et al. 2018), which "
                    "needs the optimizer's momentum: use hgsgc.DistributedOptimizer(SGD(momentum=m), "
                    "compression=...), or DistributedGradientTape(..., momentum=m) with an optimizer "
                    "whose momentum is 0")
            red = MomentumCorrection(red, env.momentum, env.store("velocity"), masking=self.momentum_masking)
        dense = None
        if self.dense_vectors:
            from hgsgc.compression.reducers import DenseAllreduce
            from hgsgc.compression.wrappers import DenseVectors

            dense = DenseVectors(DenseAllreduce(4), env.momentum if self.momentum_correction else None,
                                 env.store("velocity") if self.momentum_correction else None)
        return Pipeline(red, self.local_clip_norm, dense)


@dataclass(frozen=True)
class TernGradCompression:
    """TernGrad: dense stochastic ternary gradients with a shared scale (Wen et al. 2017).

    Per tensor g (float32, any shape), optionally clipped to ``clip_sigma`` standard deviations
    (Sec. 3.3, c = 2.5 in the paper; ``0`` = off), every rank sends
    ``t = sign(g) * b`` with ``b_k ~ Bernoulli(|g_k| / s)`` and ``s`` the scale shared by all
    ranks, ``s = max over ranks of max|g|`` (the paper's scaler sharing, one small
    ``allreduce(op=Max)`` of one float32 per tensor). ``E[s t] = g``: the estimate is unbiased.
    Codes {-1, 0, 1} travel 2 bits each (four per byte) through one ``hvd.allgather``;
    every rank decodes all n payloads and averages ``s * sum_r t_r / n``. No error feedback
    (as in the paper). Payload per rank: ``ceil(numel / 4)`` bytes + 4 bytes (the scale) per
    tensor, a compression ratio of about 16 vs fp32.
    """

    clip_sigma: float = 2.5
    method: str = "terngrad"

    def __post_init__(self):
        if (isinstance(self.clip_sigma, bool) or not isinstance(self.clip_sigma, numbers.Real)
                or not math.isfinite(self.clip_sigma) or self.clip_sigma < 0):
            raise ValueError(f"clip_sigma must be a finite number >= 0 (0 = no clipping, the "
                             f"paper uses 2.5), got {self.clip_sigma!r}")

    @property
    def delay(self) -> int:
        return 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    compressed = True
    algorithm = "allgather"

    def payload_bytes(self, shapes) -> int:
        """``ceil(numel / 4) + 4`` per non-empty float32 tensor of ``shapes`` (bytes)."""
        from hgsgc.compression import terngrad

        return sum(terngrad.payload_bytes(_numel(s)) for s in shapes if _numel(s))

    def collectives(self, shapes):
        """The collectives of one exchange, ``(("ring", 4 t), ("allgather", payload_bytes - 4 t))``
        for ``t`` non-empty tensors: the ``allreduce(op=Max)`` of one float32 scale per tensor, then
        the allgather of the packed codes (bytes; they sum to :meth:`payload_bytes`)."""
        from hgsgc.compression import terngrad

        scales = terngrad.SCALE_BYTES * sum(1 for s in shapes if _numel(s))
        return (("ring", scales), ("allgather", self.payload_bytes(shapes) - scales))

    def build(self, env):
        from hgsgc.compression.terngrad import TernGradReducer
        from hgsgc.compression.wrappers import Pipeline

        return Pipeline(TernGradReducer(self.clip_sigma))


@dataclass(frozen=True)
class PowerSGDCompression:
    """PowerSGD: rank-r power-iteration compression with error feedback (Vogels et al. 2019).

    Each tensor with two or more dimensions is viewed as a matrix M of shape
    ``[prod(shape[:-1]), shape[-1]]`` = ``[m, p]``; with ``q = min(rank, m, p)`` it is
    compressed when ``(m + p) q < m p``. Algorithm 1 of the paper, per step:
    ``M = g + e`` (error feedback); ``P = allreduce_mean(M Q)``; ``P = orthogonalize(P)``
    (reduced QR); ``Q = allreduce_mean(M^T P)``; output ``P Q^T``; ``e = M - P Q^T``; Q is kept
    for the next step (warm start). Q starts from the same seeded normal matrix on every rank.
    Vectors and matrices that do not shrink are averaged densely in the first allreduce (as in
    the paper). Payload per rank: ``4 (m + p) q`` bytes per compressed matrix plus ``4 numel``
    per dense tensor, through two ``hvd.grouped_allreduce`` calls.
    """

    rank: int = 4
    error_feedback: bool = True
    method: str = "powersgd"

    def __post_init__(self):
        if not isinstance(self.rank, numbers.Integral) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be an integer >= 1 (e.g. rank=4), got {self.rank!r}")
        object.__setattr__(self, "rank", int(self.rank))
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")

    @property
    def delay(self) -> int:
        return 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    compressed = True
    algorithm = "ring"

    def payload_bytes(self, shapes) -> int:
        """``4 (m + p) q`` per compressed matrix, ``4 numel`` otherwise (bytes)."""
        from hgsgc.compression import powersgd

        return sum(powersgd.payload_bytes(s, self.rank) for s in shapes)

    def collectives(self, shapes):
        """The two grouped ring allreduces of one exchange: ``(("ring", 4 sum m q + 4 d_dense),
        ("ring", 4 sum p q))`` (bytes; they sum to :meth:`payload_bytes`; the second is left out
        when no tensor is compressed)."""
        from hgsgc.compression import powersgd

        q = sum(4 * mpq[1] * mpq[2] for mpq in (powersgd.matrix_shape(s, self.rank) for s in shapes) if mpq)
        return (("ring", self.payload_bytes(shapes) - q),) + ((("ring", q),) if q else ())

    def build(self, env):
        from hgsgc.compression.powersgd import PowerSGDReducer
        from hgsgc.compression.wrappers import ErrorFeedback, Pipeline

        red = PowerSGDReducer(self.rank, env.store("powersgd_q"))
        if self.error_feedback:
            red = ErrorFeedback(red, env.stores["residuals"])
        return Pipeline(red)


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape)) if len(shape) else 1


def _check_positive(name, value, fix):
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}: {fix}")


def _check_delay(delay):
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
        raise ValueError(f"delay must be an integer >= 1 (1 = synchronize every step), got {delay!r}")


class Compression:
    """Compression choices, named like ``horovod.tensorflow.Compression``.

    * ``Compression.none``: Horovod dense fp32 allreduce.
    * ``Compression.fp16``: Horovod's fp16 allreduce.
    * ``Compression.topk(density, bits=32, ...)``: top-k + error feedback, fp32 values, allgather
      (the GRACE-style baseline; Xu et al. 2021).
    * ``Compression.sgc(density, bits=2, delay=1, hierarchy="allgather", ...)``: Sparse Gradient
      Compression: top-k + error feedback + 2-bit values + communication delay. Its default
      selector is the sampled threshold, whose selection equals exact top-k and costs ~1/3.5
      of it on a 1.6 M-entry tensor (``docs/benchmarks/topk.md``).
    * ``Compression.localsgd(delay)``: local SGD, dense periodic averaging (Lin et al. 2020).
    * ``Compression.dgc(density, ...)``: Deep Gradient Compression (Lin et al. 2018): top-k
      with error feedback, momentum correction and masking, local gradient clipping (warm-up
      of sparsity is a training-loop schedule: ``compression.warmup_steps`` in the config).
    * ``Compression.terngrad(clip_sigma=2.5)``: TernGrad (Wen et al. 2017).
    * ``Compression.powersgd(rank=4)``: PowerSGD (Vogels et al. 2019).
    """

    none = DenseCompression("none")
    fp16 = DenseCompression("fp16")

    @staticmethod
    def topk(density: float, bits: int = 32, selector: str = "exact",
             error_feedback: bool = True, hierarchy: str = "allgather",
             momentum_correction: bool = False, momentum_masking: bool = True,
             buckets: int = 1, index_coding: str = DEFAULT_INDEX_CODING) -> SparseCompression:
        return SparseCompression(density=density, bits=bits, delay=1, selector=selector,
                                 error_feedback=error_feedback, method="topk",
                                 hierarchy=hierarchy, momentum_correction=momentum_correction,
                                 momentum_masking=momentum_masking, buckets=buckets,
                                 index_coding=index_coding)

    @staticmethod
    def sgc(density: float, bits: int = 2, delay: int = 1, hierarchy: str = "allgather",
            selector: str = "sampled", error_feedback: bool = True,
            momentum_correction: bool = False, momentum_masking: bool = True,
            buckets: int = 1, index_coding: str = DEFAULT_INDEX_CODING) -> SparseCompression:
        return SparseCompression(density=density, bits=bits, delay=delay, hierarchy=hierarchy,
                                 selector=selector, error_feedback=error_feedback, method="sgc",
                                 momentum_correction=momentum_correction, momentum_masking=momentum_masking,
                                 buckets=buckets, index_coding=index_coding)

    @staticmethod
    def localsgd(delay: int) -> DenseCompression:
        return DenseCompression("none", delay=delay)

    @staticmethod
    def dgc(density: float, local_clip_norm: Optional[float] = None, selector: str = "sampled",
            hierarchy: str = "allgather", momentum_masking: bool = True,
            buckets: int = 1, index_coding: str = DEFAULT_INDEX_CODING) -> SparseCompression:
        return SparseCompression(density=density, bits=32, delay=1, selector=selector,
                                 method="dgc", hierarchy=hierarchy, momentum_correction=True,
                                 local_clip_norm=local_clip_norm, momentum_masking=momentum_masking,
                                 buckets=buckets, index_coding=index_coding)

    @staticmethod
    def terngrad(clip_sigma: float = 2.5) -> TernGradCompression:
        return TernGradCompression(clip_sigma=clip_sigma)

    @staticmethod
    def powersgd(rank: int = 4, error_feedback: bool = True) -> PowerSGDCompression:
        return PowerSGDCompression(rank=rank, error_feedback=error_feedback)


def as_compression(compression):
    """Normalise a compression argument: hgsgc settings, or Horovod's ``Compression.none/fp16``.

    Raises:
        TypeError: anything else, naming the accepted values.
    """
    if isinstance(compression, COMPRESSIONS) or isinstance(compression, _registered_settings()):
        return compression
    try:
        import horovod.tensorflow as hvd

        if compression is hvd.Compression.none:
            return Compression.none
        if compression is hvd.Compression.fp16:
            return Compression.fp16
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(
        f"compression={compression!r} is not supported: use hgsgc.Compression.none, .fp16, "
        ".topk(density), .sgc(density, bits, delay), .localsgd(delay), .dgc(density), "
        ".terngrad(), .powersgd(rank) or another registered method "
        f"({', '.join(base.method_names())})")


COMPRESSIONS = (DenseCompression, SparseCompression, TernGradCompression, PowerSGDCompression)


def _stock_horovod_error(comp, *args, **kwargs):
    """Horovod's own ``DistributedOptimizer`` / ``allreduce`` call ``compression.compress(t)``:
    an hgsgc setting that Horovod cannot run fails there with a message naming the fix."""
    raise TypeError(
        f"{comp.to_dict()} is an hgsgc compression; stock Horovod (hvd.DistributedOptimizer, "
        f"hvd.DistributedGradientTape, hvd.allreduce) cannot run it and would not apply it. Use "
        f"hgsgc.DistributedOptimizer(opt, compression=...) or hgsgc.DistributedGradientTape("
        f"tape, compression=...), which take the same arguments as Horovod's")


def _registered_settings() -> tuple:
    return tuple(t for m in base.METHODS.values() for t in m.settings)


# ---------------------------------------------------------------------------------------------
# The built-in methods and how the config section builds each (hgsgc.config takes them from here).

def _bits(c, method):
    if c.bits is not None:
        return c.bits
    return 2 if method == "sgc" else 32


def _sparse_from_config(method):
    def build(c, *, delay=None, hierarchy=None):
        return SparseCompression(
            density=DEFAULT_DENSITY if c.density is None else c.density, bits=_bits(c, method), delay=c.delay if delay is None else delay,
            hierarchy=c.hierarchy if hierarchy is None else hierarchy, selector=c.selector or DEFAULT_SELECTOR,
            error_feedback=c.error_feedback, method=method,
            momentum_correction=c.momentum_correction or method == "dgc",
            local_clip_norm=c.local_clip_norm or None, dense_vectors=bool(c.dense_vectors),
            momentum_masking=bool(c.momentum_masking), buckets=getattr(c, "buckets", 1),
            index_coding=getattr(c, "index_coding", None) or DEFAULT_INDEX_CODING)
    return build


from hgsgc.compression import base  # noqa: E402


def _add_factory(method):
    if not hasattr(Compression, method.name):
        setattr(Compression, method.name, staticmethod(method.factory))


base._LISTENERS.append(_add_factory)

base.register("none", lambda: Compression.none, lambda c, **_: DenseCompression("none"),
              settings=(DenseCompression,))
base.register("fp16", lambda: Compression.fp16, lambda c, **_: DenseCompression("fp16"))
for _m in ("topk", "sgc"):
    base.register(_m, getattr(Compression, _m), _sparse_from_config(_m), sparse=True,
                  settings=(SparseCompression,))
base.register("localsgd", Compression.localsgd, lambda c, **_: Compression.localsgd(c.delay))
base.register("dgc", Compression.dgc, _sparse_from_config("dgc"), sparse=True)
base.register("terngrad", Compression.terngrad,
              lambda c, **_: Compression.terngrad(clip_sigma=c.terngrad_clip_sigma),
              settings=(TernGradCompression,))
base.register("powersgd", Compression.powersgd,
              lambda c, **_: Compression.powersgd(rank=c.powersgd_rank, error_feedback=c.error_feedback),
              settings=(PowerSGDCompression,))

# Methods in their own files register themselves on import (one line each).
from hgsgc.compression import signsgd  # noqa: E402,F401

for _cls in _registered_settings():  # compressed settings refuse to run in stock Horovod
    if _cls is not DenseCompression:
        _cls.compress = _stock_horovod_error
        _cls.decompress = _stock_horovod_error
