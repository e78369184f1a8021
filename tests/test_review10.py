"""Review of session 9's Elias-Fano index coding (session 10, before it became the default):
ops/sparse_codec.cc (EfEncode / EfDecode, the op checks, the sampled top-k it feeds). Each test
failed before its fix (a crash, an out-of-bounds read or a wrong message); results are compared
exactly with a numpy Elias-Fano coder / numpy top-k written here."""
import numpy as np
import pytest
import tensorflow as tf

from hgsgc import ops
from hgsgc.compression import kernels, wire
from test_index_coding import np_ef_encode, np_fixed_encode, np_low_bits

EF = "elias_fano"
CODINGS = ("fixed", EF)


# ------------------------------------------------------------------ numpy references
def np_index_section(idx, numel, coding):
    """The index section of a payload: fixed width ceil(log2 numel), or Elias-Fano (low l bits
    packed, then the unary high part of H = k + ((numel - 1) >> l) bits); the numpy coders of
    tests/test_index_coding.py."""
    idx = np.asarray(idx, np.int64)
    return np_fixed_encode(idx, numel) if coding == "fixed" else np_ef_encode(idx, numel)


def np_payload32(idx, vals, numel, coding):
    return np.concatenate([np_index_section(idx, numel, coding),
                           np.asarray(vals, np.float32).view(np.uint8)])


def np_topk(x, k):
    """Exact top-k by |x|, ties to the lower index, ascending indices (tf.math.top_k's rule)."""
    order = np.lexsort((np.arange(len(x)), -np.abs(x)))[:k]
    return np.sort(order).astype(np.int32)


# ------------------------------------------------------------------ HgsgcSparseEncode: numel
@pytest.mark.parametrize("coding", CODINGS)
def test_sparse_encode_refuses_a_numel_its_int32_indices_cannot_address(coding):
    """HgsgcSparseEncode took any numel >= 0: numel = 2^40 gave index width 40 (fixed) or
    l = 40 (Elias-Fano) and the kernel called entry 39 of its 32-entry packer table (a crash or
    garbage; the other ops already refused numel >= 2^31). Now one InvalidArgumentError."""
    lib = ops.load()
    for numel in (2**31, 2**32 + 1, 2**40):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"HgsgcSparseEncode: numel = {numel}; at most 2\^31 - 1 entries"):
            lib.hgsgc_sparse_encode(tf.constant([0], tf.int32), tf.constant([1.5], tf.float32),
                                    numel=numel, bits=32, index_coding=coding)
        with pytest.raises(tf.errors.InvalidArgumentError, match="at most 2\\^31 - 1 entries"):
            kernels.sparse_encode([0, 5], [1.0, -2.0], numel, 2, backend="custom", index_coding=coding)
        # the pure-TF reference: one ValueError naming numel (was 'width must be in [1, 32]' for
        # fixed, a failed int32 conversion of 2^l - 1 for elias_fano)
        with pytest.raises(ValueError, match=f"numel = {numel}: at most 2\\^31 - 1 entries"):
            kernels.sparse_encode([0, 5], [1.0, -2.0], numel, 2, backend="reference", index_coding=coding)
        with pytest.raises(ValueError, match=f"numel = {numel}: at most 2\\^31 - 1 entries"):
            wire.decode(tf.zeros([64], tf.uint8), numel, 2, 32, coding)


@pytest.mark.parametrize("coding", CODINGS)
def test_sparse_encode_at_the_largest_numel_equals_numpy(coding):
    """numel = 2^31 - 1 (l = 30 for k = 1, l = 29 for k = 2, 31-bit fixed indices): the custom
    payload is the numpy coder's, byte for byte, and the reference's."""
    numel = 2**31 - 1
    for idx in ([numel - 1], [0, numel - 1], [7, 2**30 + 3]):
        vals = np.array([1.25, -3.5][:len(idx)], np.float32)
        want = np_payload32(idx, vals, numel, coding)
        assert len(want) == wire.payload_length(numel, len(idx), 32, coding)
        for backend in ("custom", "reference"):
            p, s = kernels.sparse_encode(np.array(idx, np.int32), vals, numel, 32, backend=backend,
                                         index_coding=coding)
            np.testing.assert_array_equal(p.numpy(), want)
            np.testing.assert_array_equal(s.numpy(), vals)


# ------------------------------------------------------------------ HgsgcDecodeAccumulate: offset
@pytest.mark.parametrize("coding", CODINGS)
def test_decode_accumulate_offset_past_the_rows_is_refused_not_read(coding):
    """The row-length check computed offset + payload_length in int64: an offset near 2^63
    overflowed it to a negative 'need', the check passed and the kernel read 2^63 bytes past
    the buffer (a crash). The Python wrapper checks only static row lengths, so a tf.function
    with rows of unknown length reached the op. Now the op refuses it."""
    numel, idx, vals = 50, [3, 17, 49], np.array([0.5, -1.0, 2.0], np.float32)
    p = np_payload32(idx, vals, numel, coding)
    lib = ops.load()
    attrs = {} if coding == "fixed" else {"index_coding": coding}
    rows = tf.constant(np.stack([np.concatenate([[9, 9], p]), np.concatenate([[1, 2], p])]), tf.uint8)
    for offset in (2**63 - 1, 2**63 - len(p), 2**62, 3):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"rows of {len(p) + 2} bytes cannot hold a payload of {len(p)} "
                                 f"bytes at offset {offset}"):
            lib.hgsgc_decode_accumulate(rows, numel=numel, k=3, bits=32, offset=offset, **attrs)

    @tf.function(input_signature=[tf.TensorSpec([2, None], tf.uint8)])
    def dyn(g):
        return kernels.decode_accumulate(g, numel, 3, 32, offset=2**63 - 2, backend="custom",
                                         index_coding=coding)

    with pytest.raises(tf.errors.InvalidArgumentError, match="cannot hold a payload"):
        dyn(rows)
    want = np.zeros(numel, np.float32)
    want[idx] = vals + vals  # the payload exactly at the end of every row: read, and only it
    got = lib.hgsgc_decode_accumulate(rows, numel=numel, k=3, bits=32, offset=2, **attrs)
    np.testing.assert_array_equal(got.numpy(), want)


# ------------------------------------------------------------------ EfDecode: only H high bits
@pytest.mark.parametrize("bits", [2, 32])
def test_elias_fano_padding_bits_are_not_read_as_indices(bits):
    """The C++ decoder took set bits anywhere in the high part's last byte, the padding after
    bit H included; the reference (wire.decode_indices) reads only the H bits. A payload whose
    k-th high bit sat in the padding decoded to index ((p - i) << l) | low: here >= numel (an
    error naming a wrong cause), but for numel >= 2^30 the shift wraps around 2^32 into
    [0, numel) and a wrong index was added silently (numel = 2^30, k = 1: padding bit 4 ->
    index low | 0; checked by hand, 4 GB output, not here). Now both refuse it as a high part
    with fewer than k set bits in its H bits."""
    numel, k = 1000, 10  # l = 6, H = 10 + (999 >> 6) = 25 bits: 4 bytes, bits 25..31 padding
    idx = np.array([1, 80, 81, 200, 333, 500, 640, 700, 901, 999], np.int32)
    vals = np.linspace(-1, 1, k).astype(np.float32)
    good, _ = kernels.sparse_encode(idx, vals, numel, bits, backend="custom", index_coding=EF)
    off = 8 if bits == 2 else 0
    sec = np_index_section(idx, numel, EF)
    low_bytes = (k * 6 + 7) // 8
    np.testing.assert_array_equal(good.numpy()[off:off + len(sec)], sec)
    assert wire.ef_high_bits(numel, k) == 25 and len(sec) == low_bytes + 4
    bad = good.numpy().copy()
    high = off + low_bytes
    last = (999 >> 6) + 9  # bit of the 10th index: 24, the last bit inside H
    assert bad[high + last // 8] & (1 << (last % 8))
    bad[high + 3] = (int(bad[high + 3]) & ~(1 << (last % 8)) & 0xFF) | (1 << 6)  # to padding bit 30
    rows = tf.constant(bad[None, :])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="payload of rank 0: the Elias-Fano high part holds fewer than k = 10 "
                             "set bits in its H = 25 bits"):
        kernels.decode_accumulate(rows, numel, k, bits, backend="custom", index_coding=EF)
    with pytest.raises(tf.errors.InvalidArgumentError,  # (was a Reshape error naming no cause)
                       match="wire.decode_indices: the Elias-Fano high part holds 9 set bits, "
                             "fewer than k = 10 set bits in its H = 25 bits"):
        kernels.decode_accumulate(rows, numel, k, bits, backend="reference", index_coding=EF)
    # a padding bit set beside a well-formed high part is ignored by both, as by the numpy coder
    extra = good.numpy().copy()
    extra[high + 3] = int(extra[high + 3]) | (1 << 7)
    want = np.zeros(numel, np.float32)
    want[idx] = wire.decode(good, numel, k, bits, EF)[1].numpy()
    for backend in ("custom", "reference"):
        got = kernels.decode_accumulate(tf.constant(extra[None, :]), numel, k, bits,
                                        backend=backend, index_coding=EF)
        np.testing.assert_array_equal(got.numpy(), want)


# ------------------------------------------------------------------ reference encode: ascending
def test_reference_elias_fano_encode_refuses_indices_it_cannot_code():
    """wire.encode_indices (the pure-TF path, and hierarchy tree/node merges always) coded any
    int32 [k]: Elias-Fano needs them strictly ascending, so [9, 0] of numel 10 came back as
    [5, 4] with no error while the C++ kernel refused them. Now both refuse, naming them;
    ascending ones still equal the numpy code."""
    for idx in ([9, 0], [3, 3], [2, 10], [-1, 4]):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"wire.encode_indices \(elias_fano\): indices must be strictly "
                                 r"ascending in \[0, numel = 10\), got"):
            kernels.sparse_encode(idx, [1.0, 2.0], 10, 32, backend="reference", index_coding=EF)
        with pytest.raises(tf.errors.InvalidArgumentError, match="strictly ascending"):
            kernels.sparse_encode(idx, [1.0, 2.0], 10, 32, backend="custom", index_coding=EF)
    for idx in ([0, 9], [4, 5], [9]):
        sec = wire.encode_indices(tf.constant(idx, tf.int32), 10, EF)
        np.testing.assert_array_equal(sec.numpy(), np_index_section(idx, 10, EF))
        np.testing.assert_array_equal(wire.decode_indices(sec, 10, len(idx), EF).numpy(), idx)


# ------------------------------------------------------------------ SelectTopK: a huge margin
@pytest.mark.parametrize("n", [300, 5000])
def test_topk_with_a_huge_margin_is_still_the_exact_topk(n):
    """margin is only checked >= 1; a margin of 1e20 turned 2 margin k / n into an out-of-range
    float -> int64 conversion (undefined behaviour; the candidate reserve came out negative):
    the process died with a segmentation fault (seen with the session-9 build).
    Below sample_size (n = 300) and above it (n = 5000), top-k and the fused compress (both
    codings) now give numpy's exact top-k and the reference's payload."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    r = (rng.standard_normal(n) * 0.1).astype(np.float32)
    for k in (1, 7, n - 1):
        for margin in (1e20, 3e38):
            i, v = kernels.topk_select(tf.constant(x), k, margin=margin, seed=3, backend="custom")
            np.testing.assert_array_equal(i.numpy(), np_topk(x, k))
            np.testing.assert_array_equal(v.numpy(), x[np_topk(x, k)])
        for coding in CODINGS:
            p_c, res_c = kernels.compress(tf.constant(x), tf.constant(r), k, 32, margin=1e20, seed=3,
                                          backend="custom", index_coding=coding)
            a = x + r
            sel = np_topk(a, k)
            np.testing.assert_array_equal(p_c.numpy(), np_payload32(sel, a[sel], n, coding))
            want_res = a.copy()
            want_res[sel] = 0.0
            np.testing.assert_array_equal(res_c.numpy(), want_res)
            p_r, res_r = kernels.compress(tf.constant(x), tf.constant(r), k, 32, margin=1e20, seed=3,
                                          backend="reference", index_coding=coding)
            np.testing.assert_array_equal(p_c.numpy(), p_r.numpy())
            np.testing.assert_array_equal(res_c.numpy(), res_r.numpy())


# ------------------------------------------------------------------ lengths and bytes at the edges
def _edge_cases(max_log2):
    """(numel, k) at and around powers of two (numel / k exactly 2^l and one off either side)."""
    out = set()
    for j in range(1, max_log2 + 1):
        for numel in (2**j - 1, 2**j, 2**j + 1):
            if not 1 <= numel < 2**31:
                continue
            for k in (1, 2, 3, 7, numel // 3, numel // 2 - 1, numel // 2, numel // 2 + 1, numel - 1, numel):
                if 1 <= k <= numel:
                    out.add((numel, k))
    return sorted(out)


def test_kernel_payload_length_equals_the_formula_up_to_2_31():
    """The kernels' static payload length (their shape functions, C++ PayloadLength) equals
    wire.payload_length and the formula ceil(k l / 8) + ceil((k + ((numel - 1) >> l)) / 8)
    (+ 8 + ceil(k / 4) or + 4 k) with l from numpy, for numel up to 2^31 - 1 around every power
    of two (no tensor of that size is made: graph construction only)."""
    lib = ops.load()
    cases = _edge_cases(31)
    assert len(cases) > 700
    with tf.Graph().as_default():
        for numel, k in cases:
            low = np_low_bits(numel, k)
            ef_idx = (k * low + 7) // 8 + (k + ((numel - 1) >> low) + 7) // 8
            fixed_idx = (k * max(1, (numel - 1).bit_length()) + 7) // 8
            i = tf.compat.v1.placeholder(tf.int32, [k])
            v = tf.compat.v1.placeholder(tf.float32, [k])
            for coding, idx_bytes in (("fixed", fixed_idx), (EF, ef_idx)):
                for bits, rest in ((2, 8 + (k + 3) // 4), (32, 4 * k)):
                    p, _ = lib.hgsgc_sparse_encode(i, v, numel=numel, bits=bits, index_coding=coding)
                    assert p.shape.as_list() == [idx_bytes + rest] == \
                        [wire.payload_length(numel, k, bits, coding)], (numel, k, coding, bits)


@pytest.mark.parametrize("coding", CODINGS)
def test_kernel_bytes_equal_numpy_around_powers_of_two(coding):
    """What the kernel writes (not only its length) is the numpy code, and decode_accumulate
    gives the entries back exactly, for numel up to 2^12 + 1 around every power of two."""
    rng = np.random.default_rng(17)
    for numel, k in _edge_cases(12):
        idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)
        vals = rng.standard_normal(k).astype(np.float32)
        p, _ = kernels.sparse_encode(idx, vals, numel, 32, backend="custom", index_coding=coding)
        want = np_payload32(idx, vals, numel, coding)
        np.testing.assert_array_equal(p.numpy(), want)
        dense = np.zeros(numel, np.float32)
        dense[idx] = vals
        got = kernels.decode_accumulate(tf.constant(want[None, :]), numel, k, 32, backend="custom",
                                        index_coding=coding)
        np.testing.assert_array_equal(got.numpy(), dense)
