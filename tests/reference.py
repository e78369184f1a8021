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


#: hgsgc's default index coding of a sparse setting (compression.index_coding; session 10)
DEFAULT_CODING = "elias_fano"


def ef_index_bytes(numel, k):
    """Elias-Fano index section: l = the largest l with k 2^l <= numel (floor(log2(numel / k)),
    found by doubling, no logs), ceil(k l / 8) low bytes + ceil((k + ((numel - 1) >> l)) / 8)
    bytes of the unary high part (docs/compression.md)."""
    low = 0
    while k << (low + 1) <= numel:
        low += 1
    return math.ceil(k * low / 8) + math.ceil((k + ((numel - 1) >> low)) / 8)


def payload_length(numel, k, bits, index_coding):
    """Bytes of one sparse payload: [8 B scales] + index section + values (2-bit codes or fp32);
    ``index_coding`` "fixed" (ceil(log2 numel) bits per index) or "elias_fano"."""
    if k == 0:
        return 0
    if index_coding == "fixed":
        w = max(1, math.ceil(math.log2(numel))) if numel > 1 else 1
        idx = math.ceil(k * w / 8)
    else:
        assert index_coding == "elias_fano", index_coding
        idx = ef_index_bytes(numel, k)
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


def terngrad_clip(g, clip_sigma):
    """TernGrad's clipping to c standard deviations (Wen et al. 2017, Sec. 3.3); c = 0: none."""
    g = np.asarray(g, np.float32)
    if not clip_sigma or g.size == 0 or np.all(g == g.flat[0]):
        return g  # all entries equal (std 0): left as they are
    bound = np.float32(clip_sigma) * np.float32(np.std(g, dtype=np.float64))
    return np.clip(g, -bound, bound)


def ternarize(g, scale, uniform):
    """sign(g) where uniform < |g| / scale, else 0 (int32)."""
    g = np.asarray(g, np.float32)
    if scale <= 0:
        return np.zeros(g.shape, np.int32)
    keep = np.asarray(uniform, np.float32) < np.abs(g) / np.float32(scale)
    return np.where(keep, np.sign(g), 0).astype(np.int32)


def terngrad_average(per_rank, uniforms, clip_sigma):
    """Average over ranks of TernGrad's decoded tensors: per_rank[r], uniforms[r] lists of arrays."""
    n = len(per_rank)
    out = []
    for i in range(len(per_rank[0])):
        clipped = [terngrad_clip(per_rank[r][i].ravel(), clip_sigma) for r in range(n)]
        scale = max(float(np.max(np.abs(c))) if c.size else 0.0 for c in clipped)
        codes = sum(ternarize(clipped[r], scale, uniforms[r][i]) for r in range(n))
        out.append((codes.astype(np.float32) * np.float32(scale / n)).reshape(per_rank[0][i].shape))
    return out


def powersgd_matrix(shape, rank):
    """(m, p, q) of PowerSGD's matrix view, or None when the tensor is sent uncompressed."""
    if len(shape) < 2:
        return None
    p, m = shape[-1], int(np.prod(shape[:-1]))
    q = min(rank, m, p)
    return (m, p, q) if (m + p) * q < m * p else None


def powersgd_step(mats, q0):
    """One step of PowerSGD's Algorithm 1 over ranks (Vogels et al. 2019).

    Args: mats: per-rank [m, p] float64 matrices (gradient + error); q0: the shared [p, q].
    Returns: (approximation P Q^T [m, p], new Q [p, q]).
    """
    p_avg = np.mean([m @ q0 for m in mats], axis=0)
    p_hat, _ = np.linalg.qr(p_avg)
    q_new = np.mean([m.T @ p_hat for m in mats], axis=0)
    return p_hat @ q_new.T, q_new


def global_norm_clip(grads, clip_norm):
    """tf.clip_by_global_norm's formula: g * clip / max(clip, ||(g_1, ..., g_L)||_2)."""
    norm = np.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads))
    return [np.asarray(g, np.float64) * clip_norm / max(clip_norm, norm) for g in grads]
