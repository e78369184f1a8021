"""Session 17: the tree / node merge's union, sum and per-tensor top-k in one C++ op
(``HgsgcSparseMergeSelect``, ops/sparse_merge.cc), pinned bit for bit to the pure-TF path it
replaces (``hierarchy._select_reference``), and ``hierarchy._merge_all`` (the whole merge round:
selection, re-encoding, the dropped mask) equal on both backends.

Values are compared on raw bits (float32 viewed as uint32: -0.0 vs +0.0 and NaN payloads count).
The kernel tests skip when the library is not built, unless HGSGC_REQUIRE_CUSTOM_OPS=1 (set by
``make test``).
"""
import os

import numpy as np
import pytest
import tensorflow as tf

from hgsgc import hierarchy, ops
from hgsgc.compression import wire

HAVE_CUSTOM = ops.available()
REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")
pytestmark = pytest.mark.skipif(not HAVE_CUSTOM and not REQUIRE_CUSTOM,
                                reason="custom ops not built (python setup.py build_ext --inplace)")


def bits_of(a):
    a = a.numpy() if tf.is_tensor(a) else np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def assert_same(a, b, what):
    a, b = bits_of(a), bits_of(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} entries differ, first at {bad[:5]}"


def _layout(numels, density, bits=2, coding="fixed"):
    from hgsgc.compression.sparsify import num_selected

    specs = []
    for n in numels:
        k = num_selected(n, density)
        specs.append((n, k, wire.payload_length(n, k, bits, coding)))
    return hierarchy.exchange_layout(specs, bits, coding)


def _part(lay, rng, values=None):
    """A rank's aggregate: k_t distinct ascending indices per tensor (global), random values."""
    idx = []
    for t in range(lay.T):
        n, k = lay.numels[t], int(lay.k[t])
        idx.append(np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64) + int(lay.base[t]))
    idx = np.concatenate(idx) if idx else np.zeros([0], np.int64)
    vals = rng.standard_normal(idx.size).astype(np.float32) if values is None else values(idx.size)
    return tf.constant(idx), tf.constant(vals)


def _kernel(parts, lay):
    return ops.load().hgsgc_sparse_merge_select(parts[0][0], parts[0][1], parts[1][0], parts[1][1],
                                               tf.constant(lay.base, tf.int64), tf.constant(lay.k, tf.int32),
                                               kept=int(lay.K))


def _check(parts, lay, what):
    union, contribs, total, pos = hierarchy._select_reference(parts, lay)
    ku, ka, kb, kt, kp = _kernel(parts, lay)
    assert_same(ku, union, f"{what} union")
    assert_same(ka, contribs[0], f"{what} contrib_a")
    assert_same(kb, contribs[1], f"{what} contrib_b")
    assert_same(kt, total, f"{what} total")
    assert_same(kp, pos, f"{what} pos")
    # the whole round (selection, re-encoding, dropped mask) on both backends
    ref = hierarchy._merge_all(parts, lay, backend="reference")
    cus = hierarchy._merge_all(parts, lay, backend="custom")
    for name, x, y in zip(("payload", "new_idx", "q", "union", "contribs", "dropped", "kept"), cus, ref):
        if name == "contribs":
            for j, (cx, cy) in enumerate(zip(x, y)):
                assert_same(cx, cy, f"{what} merge contrib {j}")
        else:
            assert_same(x, y, f"{what} merge {name}")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bits,coding", [(2, "fixed"), (32, "fixed"), (2, "elias_fano")])
def test_random_parts_match_the_reference(seed, bits, coding):
    rng = np.random.default_rng(seed)
    lay = _layout([1000, 37, 5000, 1, 300], 0.05, bits, coding)
    _check([_part(lay, rng), _part(lay, rng)], lay, f"seed {seed}")


def test_overlapping_indices_ties_and_special_values():
    """Equal magnitudes (ties: the lower position), -0.0 (+0 after the add), NaN and inf
    (NaN's bit pattern sorts above inf), subnormals (flushed to 0 by the add, as TF's)."""
    lay = _layout([64, 64], 0.25)                        # k = 16 per tensor
    rng = np.random.default_rng(5)
    specials = np.array([1.0, -1.0, 1.0, -0.0, 0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40, 2.0, -2.0],
                        np.float32)
    a = _part(lay, rng, lambda m: rng.choice(specials, m).astype(np.float32))
    b = (a[0], tf.constant(rng.choice(specials, int(a[0].shape[0])).astype(np.float32)))  # same indices
    _check([a, b], lay, "same indices")
    c = _part(lay, rng, lambda m: rng.choice(specials, m).astype(np.float32))
    _check([a, c], lay, "specials")
    _check([c, a], lay, "specials, parts swapped")
    total = bits_of(_kernel([a, b], lay)[3])
    assert (total == 0x80000000).any() and (total == 0).any()  # the draw holds -0 and +0 sums
    assert (total == 0x7f800000).any() or np.isnan(_kernel([a, b], lay)[3].numpy()).any()


def test_a_tensor_entirely_in_one_part_and_empty_tensors():
    """Tensors whose k = 0 (numel 0 is not a payload; k rounds to >= 1 for numel >= 1) and
    disjoint index sets: the union has 2 k_t entries per tensor and keeps k_t."""
    lay = _layout([10, 10, 10], 0.3)                      # k = 3 each
    a = (tf.constant(np.array([0, 1, 2, 10, 11, 12, 20, 21, 22], np.int64)),
         tf.constant(np.arange(9, dtype=np.float32)))
    b = (tf.constant(np.array([7, 8, 9, 17, 18, 19, 27, 28, 29], np.int64)),
         tf.constant(-np.arange(9, dtype=np.float32)[::-1].copy()))
    _check([a, b], lay, "disjoint")
    pos = _kernel([a, b], lay)[4].numpy()
    # union = a's 3 then b's 3 per tensor; per tensor the 3 largest |total|
    tot = np.concatenate([np.r_[a[1].numpy()[3 * t:3 * t + 3], b[1].numpy()[3 * t:3 * t + 3]] for t in range(3)])
    want = []
    for t in range(3):
        seg = np.arange(6 * t, 6 * t + 6)
        order = sorted(seg, key=lambda i: (-abs(tot[i]), i))[:3]
        want += sorted(order)
    assert pos.tolist() == want


def test_bad_inputs_raise():
    lay = _layout([10], 0.3)
    good = (tf.constant(np.array([1, 4, 7], np.int64)), tf.constant(np.ones(3, np.float32)))
    bad_order = (tf.constant(np.array([4, 1, 7], np.int64)), tf.constant(np.ones(3, np.float32)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="idx_b is not strictly ascending"):
        _kernel([good, bad_order], lay)
    short = (tf.constant(np.array([1], np.int64)), tf.constant(np.ones(1, np.float32)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="keep 1 entries in all, not the kept=3"):
        _kernel([short, short], lay)
    with pytest.raises(tf.errors.InvalidArgumentError, match="differ in length"):
        _kernel([good, (good[0], tf.constant(np.ones(2, np.float32)))], lay)


@pytest.mark.parametrize("seed", [0, 1])
def test_pack_fields_equal_the_scatter(seed):
    """hierarchy._write with the HgsgcPackFields kernel: the same bytes as the shifts + tf.scatter_nd
    path, for disjoint fields of widths 1-32 at arbitrary bit offsets (1-bit positions as a tensor,
    as the Elias-Fano unary part has them) and whole bytes after them."""
    rng = np.random.default_rng(seed)
    fields, bit = [], 0
    for W in (1, 2, 3, 7, 8, 9, 15, 17, 24, 31, 32):
        n = int(rng.integers(1, 40))
        pos = (bit + np.arange(n) * W).astype(np.int32)
        bit = int(pos[-1]) + W + int(rng.integers(0, 5))
        hi = 2 ** W
        v = rng.integers(0, min(hi, 2 ** 31 - 1), n, dtype=np.int64).astype(np.int32)
        if W == 1:
            fields.append((tf.constant(v), tf.constant(pos), 1))
        else:
            fields.append((tf.constant(v), pos, W))
    start = (bit + 7) // 8
    byts = rng.integers(0, 256, 12).astype(np.uint8)
    bpos = (start + np.arange(12)).astype(np.int32)
    P = start + 12
    ref = hierarchy._write(fields, [(tf.constant(byts), bpos)], P)
    cus = hierarchy._write(fields, [(tf.constant(byts), bpos)], P, custom=True)
    assert_same(cus, ref, "pack fields")
    assert cus.shape == (P,)


def test_pack_fields_rejects_positions_outside_the_payload():
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside the payload of 4 bytes"):
        ops.load().hgsgc_pack_fields(tf.constant([1], tf.int32), tf.constant([40], tf.int32),
                                     tf.constant([0], tf.int32), tf.zeros([0], tf.uint8),
                                     tf.zeros([0], tf.int32), length=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="byte 0 at 9 outside the payload of 4 bytes"):
        ops.load().hgsgc_pack_fields(tf.zeros([0], tf.int32), tf.zeros([0], tf.int32), tf.zeros([0], tf.int32),
                                     tf.constant([7], tf.uint8), tf.constant([9], tf.int32), length=4)
