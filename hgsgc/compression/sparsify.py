"""Top-k sparsification: choose which gradient entries a rank sends.

Two selectors with the same contract, ``select(x, k) -> (indices, values)``:

* :func:`exact_topk` keeps the k entries of largest magnitude (``tf.math.top_k`` on ``|x|``;
  ties go to the lower index, as ``numpy.argsort(-|x|, kind="stable")[:k]``).
* :func:`sampled_threshold_topk` follows the sampling idea of Deep Gradient Compression
  (Lin et al., ICLR 2018, Sec. 3 "Implementation"): estimate the magnitude threshold of the
  top ``density`` fraction on a small random sample, keep the candidates above it, and pick the
  top-k among the candidates only. DGC sends every candidate (a variable count); hgsgc needs a
  fixed payload length, so it keeps exactly k. When at least k candidates pass the threshold the
  result is *identical* to :func:`exact_topk` (every true top-k entry is >= the threshold, and the
  candidates keep their index order, so ties break the same way); when the estimate is too high
  and fewer than k pass, it re-selects with :func:`exact_topk` on the whole tensor. Its accuracy
  against exact top-k is therefore exact by construction (tested); what the sampling buys is
  speed on large tensors (``scripts/bench_topk.py``).
"""
from __future__ import annotations

import math
from fractions import Fraction

import tensorflow as tf


def num_selected(numel: int, density: float) -> int:
    """Number of entries top-k keeps: ``k = min(numel, max(1, ceil(density * numel)))``.

    ``numel == 0`` gives 0 (an empty tensor passes through). The product is computed on the
    decimal value of ``density`` as written (``Fraction(repr(density))``), so ``0.07 * 100``
    gives 7, not 8 as float rounding would.

    Raises:
        ValueError: ``density`` outside (0, 1] or ``numel`` negative.
    """
    if not (0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return 0
    k = math.ceil(Fraction(repr(float(density))) * numel)
    return int(min(numel, max(1, k)))


def exact_topk(x: tf.Tensor, k: int):
    """Exact top-k by magnitude of a 1-D tensor.

    Args:
        x: float tensor, shape ``[numel]``.
        k: Python int, ``0 <= k <= numel``.

    Returns:
        ``(indices, values)``: int32 ``[k]`` sorted ascending, and ``x[indices]`` (x's dtype).
    """
    if k == 0:
        return tf.zeros([0], tf.int32), tf.zeros([0], x.dtype)
    _, idx = tf.math.top_k(tf.abs(x), k=k, sorted=False)
    idx = tf.sort(tf.cast(idx, tf.int32))
    return idx, tf.gather(x, idx)


def sampled_threshold_topk(x: tf.Tensor, k: int, sample_size: int = 1024,
                           margin: float = 1.5, seed: tf.Tensor | None = None):
    """Top-k by a sampled magnitude threshold (Deep Gradient Compression), exact result.

    Draws ``s = min(numel, sample_size)`` entries uniformly (stateless RNG, ``seed`` int32 [2]),
    sets the threshold to the ``ceil(margin * k / numel * s)``-th largest sampled magnitude
    (``margin`` > 1 lowers it so that usually >= k entries pass), takes the candidates
    ``|x| >= threshold`` and returns the exact top-k among them; if fewer than k pass, falls back
    to :func:`exact_topk`. Output is identical to :func:`exact_topk` (see module docstring).

    Args:
        x: float tensor ``[numel]``; k: Python int ``0 <= k <= numel``.
        sample_size: entries sampled to estimate the threshold.
        margin: over-selection factor of the estimate (>= 1).
        seed: int32 ``[2]`` for ``tf.random.stateless_uniform``; a fixed seed if None.

    Returns:
        ``(indices int32 [k] ascending, values [k])``.
    """
    numel = int(x.shape[0])
    if k == 0 or k == numel or numel <= sample_size:
        return exact_topk(x, k)
    if seed is None:
        seed = tf.constant([7, 11], tf.int32)
    mag = tf.abs(x)
    s = sample_size
    sample_idx = tf.random.stateless_uniform([s], seed=seed, minval=0, maxval=numel, dtype=tf.int32)
    sample = tf.gather(mag, sample_idx)
    kth = min(s, max(1, math.ceil(margin * k * s / numel)))
    thr = tf.math.top_k(sample, k=kth, sorted=True).values[kth - 1]
    cand = tf.cast(tf.reshape(tf.where(mag >= thr), [-1]), tf.int32)  # ascending

    def from_candidates():
        cmag = tf.gather(mag, cand)
        _, pos = tf.math.top_k(cmag, k=k, sorted=False)
        idx = tf.sort(tf.gather(cand, pos))
        return idx, tf.gather(x, idx)

    def fallback():
        return exact_topk(x, k)

    idx, vals = tf.cond(tf.shape(cand)[0] >= k, from_candidates, fallback)
    idx.set_shape([k])
    vals.set_shape([k])
    return idx, vals
