"""The first (pure, element-list) boundary codec, kept as the bit-exact reference.

:mod:`hgsgc.hourglass.boundary` encodes and decodes on whole ``[r, f]`` arrays (no index lists);
these functions are its previous implementation, unchanged, so that tests and
``scripts/profile_hourglass.py`` can check that the two give the same bytes and the same decoded
values for the same generator state, and time them side by side. Not used in training.

Both take the :class:`~hgsgc.hourglass.boundary.BoundaryCodec` whose format they implement
(payload layout, lengths, error bounds: see that module).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

__all__ = ["encode", "decode", "ReferenceCodec"]


def _scales(vc, x: np.ndarray, mask: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    from hgsgc.hourglass.boundary import _F16_MAX, _fp16_down, _fp16_up

    if mask is None:
        lo, hi = x.min(0), x.max(0)
    else:
        lo = np.where(mask, x, np.inf).min(0)
        hi = np.where(mask, x, -np.inf).max(0)
        empty = ~mask.any(0)
        lo[empty] = 0
        hi[empty] = 0
    lo16, hi16 = _fp16_down(lo.astype(np.float32)), _fp16_up(hi.astype(np.float32))
    if not (np.all(np.isfinite(lo16)) and np.all(np.isfinite(hi16))):
        raise FloatingPointError(
            f"boundary values exceed float16's range for the {vc.kind} scales "
            f"(max |x| = {max(abs(float(lo.min())), abs(float(hi.max()))):.3g} > {_F16_MAX:g}): "
            f"use an fp32 boundary codec (hourglass.act_codec / grad_codec)")
    return lo16.astype(np.float16), hi16.astype(np.float16)


def _values_encode(vc, x: np.ndarray, mask: Optional[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    v = x[mask] if mask is not None else x.reshape(-1)
    f = x.shape[1]
    if vc.kind == "fp32":
        return np.ascontiguousarray(v, np.float32).view(np.uint8)
    if vc.kind == "fp16":
        with np.errstate(over="ignore"):
            h = v.astype(np.float16)
        if not np.all(np.isfinite(h)) and np.all(np.isfinite(v)):
            raise FloatingPointError(
                f"boundary values exceed float16's range (max |x| = {np.max(np.abs(v)):.3g}): "
                f"use an fp32 boundary codec (hourglass.act_codec / grad_codec)")
        return h.view(np.uint8)
    lo, hi = _scales(vc, x, mask)
    delta = vc.step(lo, hi)
    L = (1 << vc.bits) - 1
    feat = np.nonzero(mask)[1] if mask is not None else np.tile(np.arange(f), x.shape[0])
    d = delta[feat]
    t = np.where(d > 0, (v - lo.astype(np.float32)[feat]) / np.where(d > 0, d, 1), 0)
    codes = np.clip(np.floor(t + rng.random(t.shape, dtype=np.float32)), 0, L).astype(np.uint8)
    if vc.bits == 4:
        if len(codes) % 2:
            codes = np.append(codes, np.uint8(0))
        codes = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return np.concatenate([lo.view(np.uint8), hi.view(np.uint8), codes])


def _values_decode(vc, buf: np.ndarray, n: int, feat: np.ndarray, f: int) -> np.ndarray:
    if vc.kind == "fp32":
        return buf[:4 * n].view(np.float32)
    if vc.kind == "fp16":
        return buf[:2 * n].view(np.float16).astype(np.float32)
    lo = buf[:2 * f].view(np.float16)
    hi = buf[2 * f:4 * f].view(np.float16)
    delta = vc.step(lo, hi)
    body = buf[4 * f:]
    if vc.bits == 4:
        codes = np.empty(2 * len(body), np.uint8)
        codes[0::2] = body & 15
        codes[1::2] = body >> 4
        codes = codes[:n]
    else:
        codes = body[:n]
    return lo.astype(np.float32)[feat] + codes.astype(np.float32) * delta[feat]


def encode(codec, x: np.ndarray, rng: np.random.Generator, mask: Optional[np.ndarray] = None) -> np.ndarray:
    """Reference of :meth:`BoundaryCodec.encode` (same arguments, same uint8 payload and the same
    draws from ``rng``: ``n`` float32 uniforms for a quantizer, none otherwise)."""
    x = np.ascontiguousarray(x, np.float32).reshape(x.shape[0], -1)
    if not codec.sparse:
        return _values_encode(codec.values, x, None, rng)
    if mask is not None:
        return _values_encode(codec.values, x, mask.reshape(x.shape), rng)
    m = x != 0
    return np.concatenate([np.packbits(m.reshape(-1)), _values_encode(codec.values, x, m, rng)])


def decode(codec, buf: np.ndarray, rows: int, features: int,
           mask: Optional[np.ndarray] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Reference of :meth:`BoundaryCodec.decode`: ``(x float32 [rows, features], mask or None)``."""
    n = rows * features
    if not codec.sparse:
        feat = np.tile(np.arange(features), rows)
        return _values_decode(codec.values, buf, n, feat, features).reshape(rows, features), None
    if mask is None:
        nb = math.ceil(n / 8)
        mask = np.unpackbits(buf[:nb], count=n).astype(bool).reshape(rows, features)
        buf = buf[nb:]
    else:
        mask = mask.reshape(rows, features)
    out = np.zeros((rows, features), np.float32)
    feat = np.nonzero(mask)[1]
    out[mask] = _values_decode(codec.values, buf, len(feat), feat, features)
    return out, mask


class ReferenceCodec:
    """A :class:`~hgsgc.hourglass.boundary.BoundaryCodec` whose ``encode`` / ``decode`` are the
    reference functions above (lengths, name, flags delegated); drop-in for the trainer's
    ``act_codec`` / ``grad_codec`` when timing the two implementations side by side."""

    def __init__(self, codec):
        self.codec = codec

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def encode(self, x, rng, mask=None):
        return encode(self.codec, x, rng, mask=mask)

    def decode(self, buf, rows, features, mask=None):
        return decode(self.codec, buf, rows, features, mask=mask)
