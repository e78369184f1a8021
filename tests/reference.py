"""Numpy references the tests compare hgsgc against (written independently of hgsgc's TF code)."""
import math

import numpy as np


def topk_indices(x, k):
    """Indices of the k largest |x| (ties: lower index first), sorted ascending."""
    order = np.argsort(-np.abs(x), kind="stable")
    return np.sort(order[:k])


def quantize_2bit(v):
    """(dequantized values, codes, (lo, hi)) of the documented 2-bit scheme."""
    v = np.asarray(v, np.float32)
    if v.size == 0:
        return v, np.zeros(0, np.int32), (0.0, 0.0)
    m = np.abs(v)
    a, b = np.float32(m.min()), np.float32(m.max())
    lo = np.float32(a + (b - a) * np.float32(0.25))
    hi = np.float32(a + (b - a) * np.float32(0.75))
    upper = m >= (a + b) * np.float32(0.5)
    codes = 2 * (v < 0).astype(np.int32) + upper.astype(np.int32)
    q = np.where(upper, hi, lo).astype(np.float32)
    q = np.where(v < 0, -q, q)
    return q, codes, (lo, hi)


def payload_length(numel, k, bits):
    if k == 0:
        return 0
    w = max(1, math.ceil(math.log2(numel))) if numel > 1 else 1
    idx = math.ceil(k * w / 8)
    return 8 + idx + math.ceil(k / 4) if bits == 2 else idx + 4 * k


def k_for(numel, density):
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(round(density * numel, 9))))


def sparse_average(inputs, density, bits):
    """Average over ranks of decompress(compress(x_r)) with zero residual (first step)."""
    out = []
    for x in inputs:
        flat = np.asarray(x, np.float32).ravel()
        k = k_for(flat.size, density)
        idx = topk_indices(flat, k)
        vals = flat[idx]
        if bits == 2:
            vals = quantize_2bit(vals)[0]
        dense = np.zeros_like(flat)
        dense[idx] = vals
        out.append(dense)
    return (np.sum(out, axis=0) / len(out)).astype(np.float32)
