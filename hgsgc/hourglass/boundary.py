"""Boundary codecs: how activations (CONV -> FC) and activation gradients (FC -> CONV) travel.

A boundary message is one micro-batch of one CONV rank: a float32 matrix ``x [r, f]`` (``r`` rows =
examples, ``f`` boundary features), encoded into one contiguous ``uint8`` payload whose length is
known by formula. Codecs are chosen per direction (``hourglass.act_codec``,
``hourglass.grad_codec``) by a spec string ``[sparse+]VALUES`` with ``VALUES`` one of:

========  ===========================================  =========================================
VALUES    payload of ``n`` values over ``f`` features  error of each decoded value (per entry)
========  ===========================================  =========================================
``fp32``  ``4 n``                                      0 (lossless)
``fp16``  ``2 n``                                      ``<= 2^-11 |x|`` for ``|x| >= 2^-14``,
                                                       ``<= 2^-25`` below (subnormals)
``q8``    ``4 f + n``                                  ``< Delta_j``, unbiased (see below)
``q4``    ``4 f + ceil(n / 2)``                        ``< Delta_j``, unbiased
========  ===========================================  =========================================

**Quantizers (``q8``, ``q4``, ``k`` bits, ``L = 2^k - 1`` steps): per-feature linear, stochastic
rounding.** For feature ``j`` the encoder takes ``lo_j = min``, ``hi_j = max`` of the values of
that feature in the message, rounds ``lo_j`` down and ``hi_j`` up to float16 (the two scales travel
as 2 + 2 bytes per feature: ``4 f``), sets ``Delta_j = (hi_j - lo_j) / L`` (float32, computed
identically by the decoder), and sends ``c = floor((x - lo_j) / Delta_j + u)`` with
``u ~ U[0, 1)``, clipped to ``0..L``; the receiver decodes ``lo_j + c Delta_j``. So every decoded
value is within ``Delta_j`` of ``x`` (plus float32 rounding of ``lo_j + c Delta_j``, a few ulp) and
``E[decoded] = x``: the rounding is **unbiased**. Why stochastic rounding and not deterministic
rounding with error feedback: a boundary tensor belongs to one micro-batch of examples that is
never sent again, so a residual kept for "the same tensor next step" would be added to different
examples' activations - error feedback has no tensor to feed back into. Unbiased rounding makes
the gradient of the step an unbiased (noisier) estimate instead, the property SGD needs. A value
beyond float16's range (65504) stops the job with a message naming the setting.

**Break-even: the scales are paid per message.** A quantized message of ``r`` rows carries ``4 f``
scale bytes besides its codes, so per example ``q8`` sends ``f (1 + 4 / r)`` and ``q4``
``f (1 / 2 + 4 / r)`` against fp32's ``4 f`` and fp16's ``2 f``: with one row per message
(``hourglass.micro_batches`` = the batch ``b``) ``q8`` sends ``5 f``, ``q4`` ``4.5 f``, MORE than
fp32. With ``M`` micro-batches of a batch of ``b`` (``r = b / M`` on average, ``f`` even) ``q8`` is
smaller than fp32 iff ``M < 3 b / 4`` (``r > 4 / 3``) and than fp16 iff ``M < b / 4`` (``r > 4``);
``q4`` iff ``M < 7 b / 8`` (``r > 8 / 7``) and ``M < 3 b / 8`` (``r > 8 / 3``). E.g. ``b = 32``:
``q8`` needs ``M <= 23`` to beat fp32 (``M = 24`` ties), ``q4`` ``M <= 27``. ``hgsgc plan`` says so in
one line when the configured codecs send more than fp32 (:func:`hgsgc.plan.boundary_overhead`, from
the measured activations, so it covers the ``sparse+`` bitmap too).

**Sparse (``sparse+VALUES``): post-ReLU zeros.** Activations: a bitmap of the non-zero entries,
``ceil(r f / 8)`` bytes (row-major, numpy ``packbits`` bit order), then the ``nnz`` non-zero values
encoded by ``VALUES`` (the quantizer's per-feature scales over each feature's non-zeros); zeros are
decoded exactly. Payload ``ceil(r f / 8) + V(nnz, f)``. Activation gradients: the FC rank already
knows the zero pattern (the activation bitmap it received), so ``sparse+VALUES`` on the gradient
direction sends only the gradient entries where the activation was non-zero, ``V(nnz, f)`` bytes,
no bitmap; the CONV rank puts them back at its own non-zeros and zeros elsewhere. This is exact
(adds no error) when the trunk's output gradient vanishes where the output is 0, which holds when
the trunk ends in a ReLU followed only by pooling / flatten / reshape / dropout
(:func:`masking_is_exact` checks the model; e.g. ``alexnet_small``: conv2(relu) -> pool2 ->
flatten); it needs ``sparse+...`` on the activation direction too.

Payload lengths (``P(r, f, nnz)``) are exact: the tests compare every byte counter with them.
"""
from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

VALUE_CODECS = ("fp32", "fp16", "q8", "q4")
_F16_MAX = float(np.finfo(np.float16).max)
#: Implementations of the q8 / q4 quantizers (:func:`set_codec_backend`).
CODEC_BACKENDS = ("auto", "compiled", "numpy")


def _check_codec_backend(name):
    if name not in CODEC_BACKENDS:
        raise ValueError(f"boundary codec backend must be one of {CODEC_BACKENDS}, got {name!r} "
                         f"(setting or $HGSGC_BOUNDARY_BACKEND)")
    return name


_codec_backend = _check_codec_backend(os.environ.get("HGSGC_BOUNDARY_BACKEND", "auto"))
_kernels = None  # (encode, decode) ctypes functions once loaded; False when they do not load
_kernel_error = ""


def set_codec_backend(name: str) -> None:
    """Choose how the ``q8`` / ``q4`` quantizers run in this process: ``"compiled"`` (the C
    functions of ``ops/boundary_codec.cc`` in ``hgsgc/_ops*.so``; encoding raises RuntimeError if
    the library is missing), ``"numpy"`` (whole-array numpy) or ``"auto"`` (compiled when the
    library loads, else numpy; the initial setting, or ``$HGSGC_BOUNDARY_BACKEND``). Both give the
    same payload bytes and decoded values for the same generator state (the uniforms are always
    drawn by numpy's generator, so the stochastic-rounding stream does not depend on it).

    Raises:
        ValueError: an unknown name.
    """
    global _codec_backend
    _codec_backend = _check_codec_backend(name)


def codec_backend() -> str:
    """The implementation the quantizers use now: ``"compiled"`` or ``"numpy"``."""
    return "compiled" if _quant_kernels() is not None else "numpy"


def _quant_kernels():
    """``(encode, decode)`` ctypes functions, or None (numpy); RuntimeError when the setting is
    ``"compiled"`` and the library does not load."""
    global _kernels, _kernel_error
    if _codec_backend == "numpy":
        return None
    if _kernels is None:
        try:
            from hgsgc import ops

            ops.load()  # TensorFlow registers the library's ops first (the same file)
            lib = ctypes.CDLL(ops.library_path())
            enc, dec = lib.hgsgc_bq_encode, lib.hgsgc_bq_decode
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            enc.argtypes = [ptr, ptr, i64, i64, ptr, i64, ctypes.c_int, ptr, i64]
            dec.argtypes = [ptr, i64, ptr, i64, i64, i64, ctypes.c_int, ptr]
            enc.restype = dec.restype = ctypes.c_int
            _kernels = (enc, dec)
        except (RuntimeError, OSError, AttributeError, TypeError) as exc:
            _kernels, _kernel_error = False, str(exc)
    if _kernels is False:
        if _codec_backend == "compiled":
            raise RuntimeError(f"boundary codec backend 'compiled' needs hgsgc/_ops*.so with "
                               f"hgsgc_bq_encode: {_kernel_error}")
        return None
    return _kernels


class BoundaryCodecError(ValueError):
    """An unknown codec spec, or a combination that cannot work (named in the message)."""


def _fp16_down(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow becomes inf, reported by the caller
        h = x.astype(np.float16)
        return np.where(h.astype(np.float32) > x, np.nextafter(h, np.float16(-np.inf)), h)


def _fp16_up(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
        return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


@dataclass(frozen=True)
class ValueCodec:
    """Encodes ``n`` float32 values, each tagged with its feature ``0..f-1`` (see module doc).

    Attributes:
        kind: ``"fp32"``, ``"fp16"``, ``"q8"`` or ``"q4"``.
    """

    kind: str

    def __post_init__(self):
        if self.kind not in VALUE_CODECS:
            raise BoundaryCodecError(f"unknown boundary value codec {self.kind!r}: use one of "
                                     f"{', '.join(VALUE_CODECS)} (optionally with sparse+)")

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "q8": 8, "q4": 4}[self.kind]

    @property
    def lossless(self) -> bool:
        return self.kind == "fp32"

    def length(self, n: int, f: int) -> int:
        """Payload bytes of ``n`` values over ``f`` features: ``4n`` | ``2n`` | ``4f + ceil(n k/8)``."""
        if self.kind == "fp32":
            return 4 * n
        if self.kind == "fp16":
            return 2 * n
        return 4 * f + math.ceil(n * self.bits / 8)

    def encode(self, x: np.ndarray, mask: Optional[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """``x [r, f]`` float32; ``mask [r, f]`` bool (values sent: ``x[mask]``, row-major) or
        None (all). Returns uint8 ``[length(n, f)]``.

        Raises:
            FloatingPointError: a value (fp16) or a scale (q8/q4) beyond float16's range.
        """
        if self.kind in ("fp32", "fp16"):
            v = np.compress(mask.reshape(-1), x) if mask is not None else x.reshape(-1)
            if self.kind == "fp32":
                return np.ascontiguousarray(v, np.float32).view(np.uint8)
            with np.errstate(over="ignore"):
                h = v.astype(np.float16)
            if not np.all(np.isfinite(h)) and np.all(np.isfinite(v)):
                raise FloatingPointError(
                    f"boundary values exceed float16's range (max |x| = {np.max(np.abs(v)):.3g}): "
                    f"use an fp32 boundary codec (hourglass.act_codec / grad_codec)")
            return h.view(np.uint8)
        x = np.ascontiguousarray(x, np.float32)
        if mask is not None:
            mask = np.ascontiguousarray(mask, bool)
        n = x.size if mask is None else int(np.count_nonzero(mask))
        u = rng.random(n, dtype=np.float32)  # the same draws whichever implementation runs
        kernels = _quant_kernels()
        if kernels is not None:
            out = np.empty(self.length(n, x.shape[1]), np.uint8)
            rc = kernels[0](x.ctypes.data, None if mask is None else mask.ctypes.data, x.shape[0],
                            x.shape[1], u.ctypes.data, n, self.bits, out.ctypes.data, len(out))
            if rc == 0:
                return out
            if rc == 2:
                self.scales(x, mask)  # raises the FloatingPointError naming the setting
            # rc 1 (a +0/-0 tie at a feature's min or max): numpy decides which zero, as before
        return self._encode_numpy(x, mask, u)

    def _encode_numpy(self, x: np.ndarray, mask: Optional[np.ndarray], u: np.ndarray) -> np.ndarray:
        lo, hi = self.scales(x, mask)
        delta = self.step(lo, hi)
        L = (1 << self.bits) - 1
        # t = (x - lo_j)/ Delta_j (0 where Delta_j = 0) on the whole [r, f] array with the
        # per-feature scales broadcast (the same float32 operations per entry as on the sent
        # entries alone), then the sent entries in row-major order: no index list is built
        pos = delta > 0
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # unsent entries only
            t = np.where(pos, (x - lo.astype(np.float32)) / np.where(pos, delta, 1), 0)
        t = np.compress(mask.reshape(-1), t) if mask is not None else t.reshape(-1)
        codes = np.floor(t + u)
        codes = np.clip(codes, 0, L, out=codes).astype(np.uint8)
        n = len(codes)
        out = np.empty(4 * x.shape[1] + (n * self.bits + 7) // 8, np.uint8)
        f = x.shape[1]
        out[:2 * f] = lo.view(np.uint8)
        out[2 * f:4 * f] = hi.view(np.uint8)
        if self.bits == 4:
            body = out[4 * f:]
            body[:n // 2] = codes[0:n - 1:2] | (codes[1::2] << 4)
            if n % 2:
                body[-1] = codes[-1]
        else:
            out[4 * f:] = codes
        return out

    def scales(self, x: np.ndarray, mask: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
        """Per-feature ``(lo, hi)`` float16 ``[f]``: min rounded down, max rounded up (0 for a
        feature without values)."""
        if mask is None:
            lo, hi = x.min(0), x.max(0)
        else:  # min / max over each feature's sent entries; +-inf (then 0) where there are none
            lo = np.where(mask, x, np.inf).min(0)
            hi = np.where(mask, x, -np.inf).max(0)
            empty = lo > hi  # +inf > -inf: no sent entry (NaN compares False, as a value)
            lo[empty] = 0
            hi[empty] = 0
        lo16, hi16 = _fp16_down(lo.astype(np.float32)), _fp16_up(hi.astype(np.float32))
        if not (np.all(np.isfinite(lo16)) and np.all(np.isfinite(hi16))):
            raise FloatingPointError(
                f"boundary values exceed float16's range for the {self.kind} scales "
                f"(max |x| = {max(abs(float(lo.min())), abs(float(hi.max()))):.3g} > {_F16_MAX:g}): "
                f"use an fp32 boundary codec (hourglass.act_codec / grad_codec)")
        return lo16.astype(np.float16), hi16.astype(np.float16)

    def step(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``Delta_j = (hi_j - lo_j) / (2^k - 1)`` float32 ``[f]``, the per-feature error bound."""
        return ((hi.astype(np.float32) - lo.astype(np.float32)) / np.float32((1 << self.bits) - 1)).astype(np.float32)

    def _unpack(self, buf: np.ndarray, n: int, f: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A q8/q4 payload's parts: ``lo`` float16 ``[f]``, ``Delta`` float32 ``[f]`` and the ``n``
        uint8 codes (q4: two per byte, low nibble first)."""
        lo = buf[:2 * f].view(np.float16)
        hi = buf[2 * f:4 * f].view(np.float16)
        body = buf[4 * f:]
        if self.bits == 4:
            codes = np.empty(2 * len(body), np.uint8)
            codes[0::2] = body & 15
            codes[1::2] = body >> 4
            codes = codes[:n]
        else:
            codes = body[:n]
        return lo, self.step(lo, hi), codes

    def decode(self, buf: np.ndarray, n: int, feat: np.ndarray, f: int) -> np.ndarray:
        """Inverse of :meth:`encode`: ``n`` float32 values (``feat [n]``: their features)."""
        if self.kind == "fp32":
            return buf[:4 * n].view(np.float32)
        if self.kind == "fp16":
            return buf[:2 * n].view(np.float16).astype(np.float32)
        lo, delta, codes = self._unpack(buf, n, f)
        return lo.astype(np.float32)[feat] + codes.astype(np.float32) * delta[feat]

    def decode_array(self, buf: np.ndarray, rows: int, f: int, mask: Optional[np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`encode` as a whole ``[rows, f]`` float32 array: the sent entries
        (``mask`` bool ``[rows, f]`` row-major, or all when None) decoded, the others 0.

        Same values bit for bit as scattering :meth:`decode` into zeros (the quantizers compute
        ``lo_j + c Delta_j`` on the whole array with the scales broadcast: the same float32
        operations per entry), without building the list of features.
        """
        n = rows * f if mask is None else int(np.count_nonzero(mask))
        if self.kind in ("fp32", "fp16"):
            v = buf[:4 * n].view(np.float32) if self.kind == "fp32" else buf[:2 * n].view(np.float16)
            if mask is None:
                return v.astype(np.float32).reshape(rows, f)
            out = np.zeros(rows * f, np.float32)
            out[np.flatnonzero(mask)] = v  # row-major, like the encoder's selection
            return out.reshape(rows, f)
        kernels = _quant_kernels()
        if kernels is not None:
            buf = np.ascontiguousarray(buf, np.uint8)
            if mask is not None:
                mask = np.ascontiguousarray(mask, bool)
            out = np.empty((rows, f), np.float32)
            if kernels[1](buf.ctypes.data, len(buf), None if mask is None else mask.ctypes.data,
                          rows, f, n, self.bits, out.ctypes.data):
                raise ValueError(f"{self.kind} boundary payload of {len(buf)} bytes is shorter than "
                                 f"the {self.length(n, f)} bytes of {n} values over {f} features")
            return out
        lo, delta, codes = self._unpack(buf, n, f)
        if mask is None:
            c = codes.reshape(rows, f)
        else:
            c = np.zeros(rows * f, np.uint8)
            c[np.flatnonzero(mask)] = codes  # row-major, like the encoder's selection
            c = c.reshape(rows, f)
        out = lo.astype(np.float32) + c.astype(np.float32) * delta
        return out if mask is None else np.where(mask, out, np.float32(0))


@dataclass(frozen=True)
class BoundaryCodec:
    """One direction's codec: ``values`` (:class:`ValueCodec`), optionally ``sparse``.

    ``spec``: ``"fp32"``, ``"fp16"``, ``"q8"``, ``"q4"``, or ``"sparse+"`` one of those
    (``"sparse"`` alone = ``"sparse+fp32"``). Payload length of an ``[r, f]`` message with ``nnz``
    non-zero entries (the activation bitmap's count):

    * dense: ``V(r f, f)``;
    * sparse, activations: ``ceil(r f / 8) + V(nnz, f)``;
    * sparse, activation gradients (``masked=True``, the zero pattern is the activations'):
      ``V(nnz, f)``;

    with ``V(n, f)`` = ``4 n`` (fp32), ``2 n`` (fp16), ``4 f + n`` (q8), ``4 f + ceil(n / 2)`` (q4).
    """

    values: ValueCodec
    sparse: bool = False

    @staticmethod
    def parse(spec) -> "BoundaryCodec":
        """A codec from its spec string (or return a codec unchanged).

        Raises:
            BoundaryCodecError: an unknown spec, naming the valid ones.
        """
        if isinstance(spec, BoundaryCodec):
            return spec
        s = str(spec).strip().lower()
        parts = s.split("+")
        sparse = parts[0] == "sparse"
        if sparse:
            parts = parts[1:] or ["fp32"]
        if len(parts) != 1 or parts[0] not in VALUE_CODECS:
            raise BoundaryCodecError(
                f"unknown boundary codec {spec!r}: use one of {', '.join(VALUE_CODECS)}, optionally "
                f"prefixed with sparse+ (e.g. sparse+q4)")
        return BoundaryCodec(ValueCodec(parts[0]), sparse)

    @property
    def name(self) -> str:
        return ("sparse+" if self.sparse else "") + self.values.kind

    @property
    def lossless(self) -> bool:
        """Decoding returns exactly the encoded values (fp32, with or without sparse)."""
        return self.values.lossless

    def length(self, rows: int, features: int, nnz: Optional[int] = None, masked: bool = False) -> int:
        """Exact payload bytes (class docstring); ``nnz`` is needed when ``sparse``."""
        rows, features = int(rows), int(features)
        n = rows * features
        if not self.sparse:
            return self.values.length(n, features)
        if nnz is None:
            raise ValueError("a sparse boundary codec's length needs nnz (the non-zero count)")
        bitmap = 0 if masked else math.ceil(n / 8)
        return bitmap + self.values.length(int(nnz), features)

    def max_length(self, rows: int, features: int, masked: bool = False) -> int:
        """Largest payload of an ``[rows, features]`` message (all entries non-zero)."""
        return self.length(rows, features, rows * features, masked) if self.sparse else self.length(rows, features)

    def encode(self, x: np.ndarray, rng: np.random.Generator, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Encode ``x [r, f]`` (float32) into uint8 ``[length]``.

        ``mask``: for the gradient direction of a sparse codec, the activations' non-zero pattern
        (only ``x[mask]`` is sent); None on the activation direction (the bitmap is ``x != 0``).
        """
        x = np.ascontiguousarray(x, np.float32).reshape(x.shape[0], -1)
        if not self.sparse:
            return self.values.encode(x, None, rng)
        if mask is not None:
            return self.values.encode(x, mask.reshape(x.shape), rng)
        m = x != 0
        return np.concatenate([np.packbits(m.reshape(-1)), self.values.encode(x, m, rng)])

    def decode(self, buf: np.ndarray, rows: int, features: int,
               mask: Optional[np.ndarray] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Inverse of :meth:`encode`: ``(x float32 [rows, features], mask bool [rows, features] or
        None)``; the mask is the bitmap's non-zero pattern (sparse activations) or the given one."""
        n = rows * features
        if not self.sparse:
            return self.values.decode_array(buf, rows, features, None), None
        if mask is None:
            nb = math.ceil(n / 8)
            mask = np.unpackbits(buf[:nb], count=n).view(bool).reshape(rows, features)
            buf = buf[nb:]
        else:
            mask = mask.reshape(rows, features)
        return self.values.decode_array(buf, rows, features, mask), mask

    def error_bound(self, x: np.ndarray, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Per-entry bound on ``|decode(encode(x)) - x|`` for ``x [r, f]`` (float32 ``[r, f]``).

        fp32: 0; fp16: ``2^-11 |x|`` (``2^-25`` below 2^-14); q8/q4: ``Delta_j`` of the entry's
        feature (plus 4 float32 ulp of ``max(|lo_j|, |hi_j|)`` for the decoder's arithmetic); a
        sparse codec adds nothing on its zeros / masked-out entries (these decode to exactly 0).
        """
        x = np.asarray(x, np.float32).reshape(x.shape[0], -1)
        m = (x != 0 if mask is None else mask.reshape(x.shape)) if self.sparse else None
        k = self.values.kind
        if k == "fp32":
            b = np.zeros_like(x)
        elif k == "fp16":
            b = np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25).astype(np.float32)
        else:
            lo, hi = self.values.scales(x, m)
            mag = np.maximum(np.abs(lo.astype(np.float32)), np.abs(hi.astype(np.float32)))
            b = np.broadcast_to(self.values.step(lo, hi) + 4 * np.spacing(mag), x.shape).copy()
        if m is not None:
            b[~m] = 0
        return b

    def to_dict(self) -> dict:
        return {"codec": self.name, "sparse": self.sparse, "values": self.values.kind,
                "bits": self.values.bits}


def masking_is_exact(trunk) -> bool:
    """True when the trunk's output gradient is ignored where the output is 0.

    Walks back from the trunk's last layer through Flatten / Reshape / MaxPooling / AveragePooling
    / Dropout (which keep "output 0 => every contributing input 0" after a ReLU) to the first
    other layer, and checks that it applies ReLU (``activation="relu"`` or a ReLU layer): ReLU's
    gradient is 0 where its output is 0, so zeroing ``dA`` there changes no trunk gradient.
    Only Sequential-like chains are followed; anything else returns False.
    """
    import tensorflow as tf

    passthrough = (tf.keras.layers.Flatten, tf.keras.layers.Reshape, tf.keras.layers.Dropout,
                   tf.keras.layers.MaxPooling1D, tf.keras.layers.MaxPooling2D,
                   tf.keras.layers.MaxPooling3D, tf.keras.layers.AveragePooling1D,
                   tf.keras.layers.AveragePooling2D, tf.keras.layers.AveragePooling3D)
    layers = [l for l in trunk.layers if not isinstance(l, tf.keras.layers.InputLayer)]
    for layer in reversed(layers):
        if isinstance(layer, passthrough):
            continue
        if isinstance(layer, tf.keras.layers.ReLU):
            return True
        act = getattr(layer, "activation", None)
        return act is tf.keras.activations.relu or getattr(act, "__name__", "") == "relu"
    return False


def check_pair(act, grad, trunk=None) -> Tuple[BoundaryCodec, BoundaryCodec]:
    """Parse and check the two directions' codecs.

    Raises:
        BoundaryCodecError: a sparse gradient codec without a sparse activation codec (the FC rank
            would not know the zero pattern), or with a trunk for which masking is not exact.
    """
    a, g = BoundaryCodec.parse(act), BoundaryCodec.parse(grad)
    if g.sparse and not a.sparse:
        raise BoundaryCodecError(
            f"hourglass.grad_codec={g.name} sends gradients only at the activations' non-zeros, "
            f"which the FC rank learns from a sparse activation codec: set hourglass.act_codec to "
            f"sparse+{a.values.kind} or drop sparse+ from grad_codec")
    if g.sparse and trunk is not None and not masking_is_exact(trunk):
        raise BoundaryCodecError(
            f"hourglass.grad_codec={g.name}: the trunk {trunk.name!r} does not end in a ReLU "
            f"(+ pooling/flatten), so gradients at zero activations matter: use grad_codec="
            f"{g.values.kind}")
    return a, g


def generator_state(rng: np.random.Generator) -> dict:
    """The state of the stochastic-rounding generator as a checkpointable tree (no pickle).

    ``numpy``'s ``rng.bit_generator.state`` with every numpy integer turned into a Python ``int``
    (PCG64: ``{"bit_generator": "PCG64", "state": {"state": int, "inc": int}, "has_uint32": int,
    "uinteger": int}``, 128-bit ints stored exactly by :mod:`hgsgc.checkpoint`); arrays (other
    bit generators, e.g. MT19937's ``uint32 [624]`` key) stay numpy arrays. Restoring it with
    :func:`set_generator_state` makes the generator draw the same numbers again, which a
    bit-exact resume with ``q8`` / ``q4`` boundary codecs needs.
    """
    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, (np.integer, bool, int)):
            return int(v)
        return v

    return plain(rng.bit_generator.state)


def set_generator_state(rng: np.random.Generator, state: dict) -> None:
    """Restore :func:`generator_state` into ``rng`` (in place).

    Raises:
        ValueError: ``state`` belongs to another bit generator (both names given) or is malformed.
    """
    have = type(rng.bit_generator).__name__
    got = state.get("bit_generator") if isinstance(state, dict) else None
    if got != have:
        raise ValueError(f"boundary codec generator state is for bit generator {got!r}, but this "
                         f"run's generator is {have!r}")
    try:
        rng.bit_generator.state = state
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"boundary codec generator state is malformed: {exc}") from exc
