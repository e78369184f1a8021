"""Numpy references of the tree and node hierarchies (written independently of hgsgc's TF code).

Same algorithm as ``hgsgc/hierarchy.py``, described block-wise instead of rank-wise: recursive
doubling with a fold is computed as a binary merge tree over aligned blocks, each merge done
once; the residual rules assign each merge's loss to block leaders (lowest rank of a block).
"""
import math

import numpy as np

from reference import k_for, quantize_2bit, topk_indices

F32 = np.float32


def compress(a, k, bits):
    """Local top-k + quantization: (indices ascending, dequantized values)."""
    idx = topk_indices(a, k)
    vals = a[idx].astype(F32)
    return idx, (quantize_2bit(vals)[0] if bits == 2 else vals)


def merge(parts, k, bits):
    """Union, sum in part order, top-k of |sum| (ties: lower index), re-quantize.

    Returns (indices, values, union, contributions per part, dropped mask, kept sums, bound)
    where bound is the documented re-quantization bound (max - min of |kept|) / 4.
    """
    union = np.unique(np.concatenate([np.asarray(p[0]) for p in parts]))
    contribs = []
    for idx, vals in parts:
        c = np.zeros(union.size, F32)
        c[np.searchsorted(union, idx)] = vals
        contribs.append(c)
    total = contribs[0].copy()
    for c in contribs[1:]:
        total = (total + c).astype(F32)
    keep = np.sort(np.argsort(-np.abs(total), kind="stable")[:k])
    kept = total[keep]
    q = quantize_2bit(kept)[0] if bits == 2 else kept
    dropped = np.ones(union.size, bool)
    dropped[keep] = False
    m = np.abs(kept)
    bound = float((m.max() - m.min()) / 4) if (bits == 2 and m.size) else 0.0
    return union[keep], q, union, contribs, dropped, kept, bound


class _Loss:
    def __init__(self, n, numel):
        self.v = [np.zeros(numel, np.float64) for _ in range(n)]

    def add(self, rank, idx, vals):
        np.add.at(self.v[rank], idx, vals)


def _merge_into(loss, parts, leaders, block_leader, k, bits, bounds):
    """Merge parts; part p's dropped entries go to leaders[p]; requant error to block_leader."""
    idx, q, union, contribs, dropped, kept, bound = merge(parts, k, bits)
    for c, r in zip(contribs, leaders):
        loss.add(r, union[dropped], c[dropped])
    if bits == 2:
        loss.add(block_leader, idx, kept - q)
    bounds.append(bound)
    return idx, q


def tree_reduce(aggs, members, k, bits, loss, bounds):
    """Global top-k of aggs[members[i]] by recursive doubling with a fold; returns (idx, vals)."""
    h = len(members)
    if h == 1:
        return aggs[members[0]]
    m = 2 ** int(math.floor(math.log2(h)))
    e = h - m
    cur = []
    for i in range(m):
        if i < e:
            lo, hi = members[i], members[i + m]
            cur.append(_merge_into(loss, [aggs[lo], aggs[hi]], [lo, hi], lo, k, bits, bounds))
        else:
            cur.append(aggs[members[i]])
    size = 1
    while size < m:
        nxt = []
        for base in range(0, m, 2 * size):
            L, R = cur[base], cur[base + size]
            merged = _merge_into(loss, [L, R], [members[base], members[base + size]],
                                 members[base], k, bits, bounds)
            nxt += [merged] * (2 * size)
        cur = nxt
        size *= 2
    return cur[0]


def exchange(inputs, density, bits, hierarchy="tree", hosts=None, residuals=None):
    """One exchange of every rank's tensors.

    Args:
        inputs: inputs[r][t] flat float32 arrays (rank r, tensor t).
        residuals: residuals[r][t] before the step (zeros if None).
        hierarchy: "tree" or "node" (then ``hosts``: lists of ranks).

    Returns:
        dict with ``avg`` (per tensor), ``residuals`` (new, per rank per tensor), ``compensated``
        (a_r), ``support`` (final indices per tensor) and ``bounds`` (re-quantization bounds of
        every merge, per tensor).
    """
    n = len(inputs)
    T = len(inputs[0])
    if residuals is None:
        residuals = [[np.zeros_like(x, dtype=F32) for x in inputs[r]] for r in range(n)]
    out = {"avg": [], "residuals": [[None] * T for _ in range(n)], "compensated": [], "support": [],
           "bounds": []}
    comp = [[(np.asarray(inputs[r][t], F32) + residuals[r][t]).astype(F32) for t in range(T)]
            for r in range(n)]
    out["compensated"] = comp
    for t in range(T):
        numel = comp[0][t].size
        k = k_for(numel, density)
        local = {r: compress(comp[r][t], k, bits) for r in range(n)}
        loss = _Loss(n, numel)
        bounds = []
        if hierarchy == "tree":
            final = tree_reduce(local, list(range(n)), k, bits, loss, bounds)
        elif hierarchy == "node":
            hs = sorted((sorted(h) for h in hosts), key=lambda h: h[0])
            lead = {}
            for h in hs:
                if len(h) > 1:
                    lead[h[0]] = _merge_into(loss, [local[r] for r in h], [h[0]] * len(h), h[0],
                                             k, bits, bounds)
                else:
                    lead[h[0]] = local[h[0]]
            final = tree_reduce(lead, [h[0] for h in hs], k, bits, loss, bounds)
        else:
            raise ValueError(hierarchy)
        dense = np.zeros(numel, F32)
        dense[final[0]] = final[1]
        out["avg"].append((dense / F32(n)).astype(F32))
        out["support"].append(np.asarray(final[0]))
        out["bounds"].append(bounds)
        for r in range(n):
            q = np.zeros(numel, np.float64)
            q[local[r][0]] = local[r][1]
            out["residuals"][r][t] = (comp[r][t] - q + loss.v[r]).astype(F32)
    return out


# ------------------------------------------------------------------------------------------------
# Closed forms, written out again (tests compare hgsgc's counters against these).


def tree_cost(n, rank, P):
    """(sent, received, messages, rounds) of the tree for one rank."""
    if n == 1:
        return 0, 0, 0, 0
    m = 2 ** int(math.floor(math.log2(n)))
    e, L = n - m, int(math.log2(m))
    rounds = math.ceil(math.log2(n)) + (1 if e else 0)
    if rank < e:
        return (L + 2) * P, (L + 1) * P, L + 2, rounds
    if rank < m:
        return L * P, L * P, L, rounds
    return P, 2 * P, 1, rounds


def node_cost(hosts, rank, P):
    hs = sorted((sorted(h) for h in hosts), key=lambda h: h[0])
    big = any(len(h) > 1 for h in hs)
    for i, h in enumerate(hs):
        if rank in h:
            s, t = len(h), tree_cost(len(hs), i, P)
            rounds = t[3] + (2 if big else 0)
            if rank != h[0]:
                return P, P, 1, rounds
            return t[0] + (s - 1) * P, t[1] + (s - 1) * P, t[2] + s - 1, rounds
    raise ValueError(rank)
