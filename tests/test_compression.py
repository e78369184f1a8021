"""Single-process tests of the compression building blocks against numpy references."""
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from hgsgc.compression import Compression, SparseCompression, codec, quantize
from hgsgc.compression.memory import ResidualMemory
from hgsgc.compression.sparsify import exact_topk, num_selected, sampled_threshold_topk


# ------------------------------------------------------------------ k and top-k
def test_num_selected_clamping():
    assert num_selected(0, 0.5) == 0          # empty tensor passes through
    assert num_selected(1, 1e-6) == 1         # at least one entry
    assert num_selected(1, 1.0) == 1
    assert num_selected(10, 1.0) == 10        # never more than numel
    assert num_selected(100, 0.07) == 7       # decimal density, not float-rounded 8
    assert num_selected(1000, 0.001) == 1
    assert num_selected(1001, 0.001) == 2     # ceil
    assert num_selected(3, 0.5) == 2
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            num_selected(10, bad)


@pytest.mark.parametrize("numel,k", [(1, 1), (7, 3), (100, 1), (1000, 10), (1000, 1000), (5000, 37)])
def test_exact_topk_matches_numpy(numel, k):
    rng = np.random.default_rng(numel + k)
    x = rng.standard_normal(numel).astype(np.float32)
    idx, vals = exact_topk(tf.constant(x), k)
    np.testing.assert_array_equal(idx.numpy(), ref.topk_indices(x, k))
    np.testing.assert_array_equal(vals.numpy(), x[ref.topk_indices(x, k)])


def test_exact_topk_ties_break_to_lower_index():
    x = np.array([1, -3, 3, 2, -3, 0.5], np.float32)
    idx, _ = exact_topk(tf.constant(x), 2)
    np.testing.assert_array_equal(idx.numpy(), [1, 2])
    np.testing.assert_array_equal(idx.numpy(), ref.topk_indices(x, 2))


def test_exact_topk_empty():
    idx, vals = exact_topk(tf.zeros([0]), 0)
    assert idx.shape == (0,) and vals.shape == (0,)


@pytest.mark.parametrize("margin", [1.5, 0.05])  # 0.05 forces the exact re-selection fallback
def test_sampled_threshold_equals_exact(margin):
    rng = np.random.default_rng(3)
    for numel, k in [(20000, 100), (50000, 25), (4096, 400)]:
        x = rng.standard_normal(numel).astype(np.float32) * rng.exponential(1, numel).astype(np.float32)
        idx, vals = sampled_threshold_topk(tf.constant(x), k, sample_size=512, margin=margin,
                                           seed=tf.constant([1, 2]))
        np.testing.assert_array_equal(idx.numpy(), ref.topk_indices(x, k))
        np.testing.assert_array_equal(vals.numpy(), x[idx.numpy()])


# ------------------------------------------------------------------ 2-bit quantization
@pytest.mark.parametrize("k", [1, 2, 5, 64, 1001])
def test_quantize_matches_reference_and_bound(k):
    rng = np.random.default_rng(k)
    v = (rng.standard_normal(k) * 3).astype(np.float32)
    codes, scales = quantize.quantize_2bit(tf.constant(v))
    q = quantize.dequantize_2bit(codes, scales).numpy()
    q_ref, codes_ref, (lo, hi) = ref.quantize_2bit(v)
    np.testing.assert_array_equal(codes.numpy(), codes_ref)
    np.testing.assert_allclose(scales.numpy(), [lo, hi], rtol=1e-6)
    np.testing.assert_allclose(q, q_ref, rtol=1e-6)
    bound = quantize.error_bound_2bit(v)
    assert np.all(np.abs(v - q) <= bound * (1 + 1e-6) + 1e-7)
    assert np.all(np.sign(q) == np.sign(v))


def test_pack_codes_round_trip_exact():
    codes = np.random.default_rng(0).integers(0, 4, 1003).astype(np.int32)
    packed = quantize.pack_codes(tf.constant(codes))
    assert packed.shape == (251,) and packed.dtype == tf.uint8      # four codes per byte
    np.testing.assert_array_equal(quantize.unpack_codes(packed, 1003).numpy(), codes)
    # first byte: codes 0..3 little-endian 2-bit fields
    c = codes[:4]
    assert int(packed[0]) == int(c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6)


# ------------------------------------------------------------------ wire codec
@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("numel,k", [(1, 1), (2, 1), (9, 4), (1000, 5), (1 << 16, 300), ((1 << 16) + 1, 300), (1_605_632, 8029)])
def test_payload_length_formula(numel, k, bits):
    # the wire functions' own default is the fixed layout; settings default to elias_fano
    assert codec.payload_length(numel, k, bits) == ref.payload_length(numel, k, bits, "fixed")
    for coding in ("fixed", "elias_fano"):
        assert codec.payload_length(numel, k, bits, coding) == ref.payload_length(numel, k, bits, coding)


@pytest.mark.parametrize("coding", ["fixed", "elias_fano"])
@pytest.mark.parametrize("bits", [2, 32])
def test_codec_round_trip(bits, coding):
    rng = np.random.default_rng(bits)
    numel, k = 12345, 77
    x = rng.standard_normal(numel).astype(np.float32)
    idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)
    payload, sent = codec.encode(tf.constant(idx), tf.constant(x[idx]), numel, bits, coding)
    assert payload.dtype == tf.uint8 and payload.shape == (ref.payload_length(numel, k, bits, coding),)
    didx, dvals = codec.decode(payload, numel, k, bits, coding)
    np.testing.assert_array_equal(didx.numpy(), idx)
    expect = x[idx] if bits == 32 else ref.quantize_2bit(x[idx])[0]
    np.testing.assert_allclose(dvals.numpy(), expect, rtol=1e-6)
    np.testing.assert_array_equal(dvals.numpy(), sent.numpy())


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 5000), density=st.floats(1e-4, 1.0), bits=st.sampled_from([2, 32]),
       seed=st.integers(0, 2**31 - 1), coding=st.sampled_from(["fixed", "elias_fano"]))
def test_codec_property_round_trip(numel, density, bits, seed, coding):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(numel).astype(np.float32)
    k = num_selected(numel, density)
    idx, vals = exact_topk(tf.constant(x), k)
    payload, sent = codec.encode(idx, vals, numel, bits, coding)
    assert int(payload.shape[0]) == ref.payload_length(numel, k, bits, coding)
    didx, dvals = codec.decode(payload, numel, k, bits, coding)
    np.testing.assert_array_equal(didx.numpy(), ref.topk_indices(x, k))
    np.testing.assert_array_equal(dvals.numpy(), sent.numpy())


def test_codec_rejects_bad_bits():
    with pytest.raises(ValueError, match="bits"):
        codec.payload_length(10, 2, 8)


# ------------------------------------------------------------------ error feedback
@pytest.mark.parametrize("bits", [2, 32])
def test_error_feedback_identity(bits):
    """decompress(compress(a)) + residual == a, for a = x + previous residual, over 3 steps."""
    mem = ResidualMemory()
    rng = np.random.default_rng(bits)
    numel, k = 4000, 40
    for step in range(3):
        x = rng.standard_normal(numel).astype(np.float32)
        a = mem.compensate("w", tf.constant(x))
        idx, vals = exact_topk(a, k)
        _, sent = codec.encode(idx, vals, numel, bits)
        sent_dense = tf.scatter_nd(idx[:, None], sent, [numel])
        mem.update("w", a, sent_dense)
        r = mem.residual("w", [numel]).numpy()
        np.testing.assert_allclose(sent_dense.numpy() + r, a.numpy(), rtol=0, atol=1e-6)
        if bits == 32:  # selected entries sent exactly: their residual is zero
            assert np.all(r[idx.numpy()] == 0)
    state = mem.state_dict()
    mem2 = ResidualMemory()
    mem2.load_state_dict(state)
    np.testing.assert_array_equal(mem2.residual("w", [numel]).numpy(), state["w"])


# ------------------------------------------------------------------ settings
def test_compression_settings_validate():
    assert Compression.sgc(0.01).bits == 2
    assert Compression.topk(0.01).bits == 32
    for kw, msg in [({"density": 0}, "density"), ({"density": 2}, "density"),
                    ({"density": 0.1, "delay": 0}, "delay"), ({"density": 0.1, "bits": 3}, "bits"),
                    ({"density": 0.1, "hierarchy": "ring"}, "hierarchy"),
                    ({"density": "0.01"}, "density")]:
        with pytest.raises(ValueError, match=msg):
            SparseCompression(**kw)
    assert Compression.sgc(0.01, delay=4).to_dict()["delay"] == 4
