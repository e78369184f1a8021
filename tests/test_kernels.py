"""The fused compression kernels (ops/sparse_codec.cc) against their pure-TF references, bit for bit.

Every comparison is on raw bits (float32 viewed as uint32), so -0.0 vs +0.0 and NaN payloads
count. Besides the references (today's hgsgc path: sparsify + codec + scatter_nd + add_n), the
selection is checked against a NumPy top-k (largest |x|, ties to the lower index, subnormals as 0)
and the decode against a NumPy rank-order sum.

The kernel tests skip when the library is not built, unless HGSGC_REQUIRE_CUSTOM_OPS=1 (as in
scripts/run_tests.sh), which makes them fail instead.
"""
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgsgc import ops
from hgsgc.compression import kernels
from hgsgc.compression import codec
from hgsgc.compression.sparsify import num_selected

HAVE_CUSTOM = ops.available()
REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")
pytestmark = pytest.mark.skipif(not HAVE_CUSTOM and not REQUIRE_CUSTOM,
                                reason="custom ops not built (python setup.py build_ext --inplace)")

TINY = np.float32(1e-40)  # subnormal


def bits_of(t):
    a = t.numpy() if tf.is_tensor(t) else np.asarray(t)
    return a.astype(np.float32).view(np.uint32) if a.dtype == np.float32 else a


def assert_same(a, b, what=""):
    a, b = bits_of(a), bits_of(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if not np.array_equal(a, b):
        bad = np.flatnonzero(a != b)[:5]
        raise AssertionError(f"{what}: {len(np.flatnonzero(a != b))} entries differ, first at {bad}: "
                             f"{a[bad]} vs {b[bad]}")


def np_topk(x, k):
    """Largest |x| (subnormals as 0), ties to the lower index; ascending indices."""
    key = np.abs(x).astype(np.float32)
    key[key < np.finfo(np.float32).tiny] = 0
    order = np.lexsort((np.arange(x.size), -key.astype(np.float64)))[:k]
    return np.sort(order).astype(np.int32)


def make_tensor(kind, numel, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(numel)
    elif kind == "ties":  # few distinct magnitudes: selection ties at the threshold
        x = rng.integers(-3, 4, numel).astype(np.float64)
    elif kind == "sparse":  # mostly zeros (+0 and -0): k may exceed the non-zeros
        x = np.where(rng.random(numel) < 0.05, rng.standard_normal(numel), 0.0)
        x[rng.random(numel) < 0.5] *= -1.0
    elif kind == "outliers":  # a few huge entries: the sampled estimate is too high
        x = rng.standard_normal(numel) * 1e-3
        if numel:
            x[rng.integers(0, numel, 3)] = 1e3
    elif kind == "subnormal":
        x = rng.standard_normal(numel).astype(np.float32)
        mask = rng.random(numel) < 0.3
        x[mask] = (TINY * rng.integers(-5, 6, mask.sum())).astype(np.float32)
    elif kind == "negzero":
        x = np.full(numel, -0.0)
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


KINDS = ["normal", "ties", "sparse", "outliers", "subnormal", "negzero"]


@st.composite
def cases(draw):
    numel = draw(st.one_of(st.integers(0, 40), st.integers(41, 5000),
                           st.sampled_from([65_537, 1_100_003])))
    density = draw(st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]))
    k = num_selected(numel, density) if numel else 0
    return dict(numel=numel, k=k, kind=draw(st.sampled_from(KINDS)),
                bits=draw(st.sampled_from([2, 32])),
                sample_size=draw(st.sampled_from([8, 64, 1024])),
                margin=draw(st.sampled_from([1.0, 1.5, 4.0])),
                seed=draw(st.integers(0, 2**20)))


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------
# Selection.


@SETTINGS
@given(cases())
def test_topk_select_matches_reference_and_numpy(c):
    x = make_tensor(c["kind"], c["numel"], c["seed"])
    args = dict(sample_size=c["sample_size"], margin=c["margin"], seed=c["seed"])
    idx, vals = kernels.topk_select(x, c["k"], backend="custom", **args)
    ridx, rvals = kernels.topk_select(x, c["k"], backend="reference", **args)
    assert idx.dtype == tf.int32 and vals.dtype == tf.float32
    assert_same(idx, ridx, "indices")
    assert_same(vals, rvals, "values")
    assert_same(idx, np_topk(x, c["k"]), "indices vs numpy")
    assert_same(vals, x[idx.numpy()], "values vs x[indices]")


@pytest.mark.parametrize("numel,k", [(0, 0), (1, 0), (1, 1), (2, 1), (1025, 1025), (300_000, 300),
                                     (2_000_000, 2000)])
def test_topk_select_edges(numel, k):
    x = make_tensor("normal", numel, 5)
    idx, vals = kernels.topk_select(x, k, backend="custom")
    assert_same(idx, np_topk(x, k), "indices")
    assert_same(vals, x[np_topk(x, k)], "values")


def test_topk_select_fallback_paths_are_exact():
    # Estimate far too high (fewer than k candidates) and far too low (all entries candidates).
    n = 1_200_000
    x = np.full(n, 1.0, np.float32)
    x[::6000] = 5.0  # 200 large entries; sample of 8 likely misses them all -> threshold 1.0
    for k in (100, 200, 201, 5000):
        for sample_size in (8, 1024):
            idx, _ = kernels.topk_select(x, k, sample_size=sample_size, backend="custom")
            assert_same(idx, np_topk(x, k), f"k={k} s={sample_size}")
    y = np.zeros(n, np.float32)
    y[:10] = 1.0
    idx, _ = kernels.topk_select(y, 1000, sample_size=16, backend="custom")  # threshold 0: overflow
    assert_same(idx, np.arange(1000, dtype=np.int32), "all-zero tail")


def test_topk_select_any_seed_same_result():
    x = make_tensor("ties", 100_000, 3)
    first = kernels.topk_select(x, 100, seed=0, backend="custom")[0].numpy()
    for seed in (1, 2, 12345, tf.constant([3, 4], tf.int32)):
        assert_same(kernels.topk_select(x, 100, seed=seed, backend="custom")[0], first, f"seed {seed}")


# ------------------------------------------------------------------------------------------------
# Encoding and the fused compress.


@SETTINGS
@given(cases())
def test_sparse_encode_matches_codec(c):
    x = make_tensor(c["kind"], c["numel"], c["seed"])
    idx = np_topk(x, c["k"])
    payload, sent = kernels.sparse_encode(idx, x[idx], c["numel"], c["bits"], backend="custom")
    rpayload, rsent = codec.encode(tf.constant(idx), tf.constant(x[idx]), c["numel"], c["bits"])
    assert payload.shape == (codec.payload_length(c["numel"], c["k"], c["bits"]),)
    assert_same(payload, rpayload, "payload")
    assert_same(sent, rsent, "sent")


@SETTINGS
@given(cases(), st.booleans())
def test_compress_matches_reference(c, error_feedback):
    g = make_tensor(c["kind"], c["numel"], c["seed"])
    r = make_tensor("normal", c["numel"], c["seed"] + 1) * np.float32(0.5) if error_feedback else None
    args = dict(sample_size=c["sample_size"], margin=c["margin"], seed=c["seed"])
    payload, res = kernels.compress(g, r, c["k"], c["bits"], backend="custom", **args)
    rpayload, rres = kernels.compress(g, r, c["k"], c["bits"], backend="reference", **args)
    assert_same(payload, rpayload, "payload")
    if error_feedback:
        assert_same(res, rres, "residual")
    else:
        assert res is None and rres is None


def test_compress_residual_numpy_formula():
    g = make_tensor("normal", 10_000, 1)
    r = make_tensor("normal", 10_000, 2)
    payload, res = kernels.compress(g, r, 100, 32, backend="custom")
    a = g + r
    idx = np_topk(a, 100)
    expected = a.copy()
    expected[idx] = 0.0  # bits=32 sends the values exactly
    assert_same(res, expected, "residual")
    dec_idx, dec_vals = codec.decode(payload, 10_000, 100, 32)
    assert_same(dec_idx, idx, "decoded indices")
    assert_same(dec_vals, a[idx], "decoded values")


def test_compress_inside_tf_function():
    g = tf.constant(make_tensor("normal", 50_000, 4))
    r = tf.Variable(make_tensor("normal", 50_000, 5))

    @tf.function
    def step(g, seed):
        payload, res = kernels.compress(g, r.read_value(), 50, 2, seed=seed, backend="custom")
        r.assign(res)
        return payload

    expected_payload, expected_res = kernels.compress(g, tf.constant(r.numpy()), 50, 2, backend="reference")
    assert_same(step(g, tf.constant(9, tf.int64)), expected_payload, "payload")
    assert_same(r, expected_res, "residual")


@pytest.mark.parametrize("numel,k,bits", [(0, 0, 2), (1, 1, 2), (5000, 50, 2), (1_100_000, 1100, 32)])
def test_compress_into_updates_the_variable_in_place(numel, k, bits):
    g = make_tensor("normal", numel, 11).reshape([-1, 1]) if numel else np.zeros([0, 1], np.float32)
    r0 = make_tensor("ties", numel, 12).reshape(g.shape)
    var_k, var_r = tf.Variable(r0), tf.Variable(r0)
    for step in range(3):  # residual carried over steps
        p_k = kernels.compress_into(g, var_k, k, bits, seed=step, backend="custom")
        p_r = kernels.compress_into(g, var_r, k, bits, seed=step, backend="reference")
        assert_same(p_k, p_r, f"payload step {step}")
        assert_same(var_k, var_r, f"residual step {step}")


def test_compress_into_copy_on_write_and_graph():
    g = tf.constant(make_tensor("normal", 20_000, 1))
    var = tf.Variable(make_tensor("normal", 20_000, 2))
    held = var.read_value()  # shares the buffer: the kernel must not overwrite it
    before = held.numpy().copy()
    expected_payload, expected_res = kernels.compress(g, tf.constant(before), 20, 2, backend="reference")

    @tf.function
    def step(g):
        payload = kernels.compress_into(g, var, 20, 2, backend="custom")
        return payload, var.read_value()

    payload, after = step(g)
    assert_same(held, before, "held value unchanged")
    assert_same(payload, expected_payload, "payload")
    assert_same(after, expected_res, "residual read after the update in the same graph")


# ------------------------------------------------------------------------------------------------
# Decode + accumulate.


def gathered_payloads(c, n):
    rows = []
    for rank in range(n):
        x = make_tensor(c["kind"] if rank % 2 == 0 else "normal", c["numel"], c["seed"] + 7 * rank)
        rows.append(kernels.compress(x, None, c["k"], c["bits"], backend="reference")[0].numpy())
    return np.stack(rows) if rows else np.zeros([0, 0], np.uint8)


def np_decode_sum(gathered, numel, k, bits, offset=0):
    p = codec.payload_length(numel, k, bits)
    dense = []
    for row in gathered:
        idx, vals = codec.decode(tf.constant(row[offset:offset + p]), numel, k, bits)
        d = np.zeros(numel, np.float32)
        d[idx.numpy()] += vals.numpy()  # like tf.scatter_nd: 0 + v (-0 arrives as +0)
        dense.append(d)
    total = np.zeros(numel, np.float32)
    for d in dense:  # strict rank order
        total = total + d
    return total


@SETTINGS
@given(cases(), st.integers(1, 5))
def test_decode_accumulate_matches_reference(c, n):
    g = tf.constant(gathered_payloads(c, n))
    out = kernels.decode_accumulate(g, c["numel"], c["k"], c["bits"], backend="custom")
    ref = kernels.decode_accumulate(g, c["numel"], c["k"], c["bits"], backend="reference")
    assert out.shape == (c["numel"],)
    assert_same(out, ref, "sum")
    if c["kind"] != "subnormal":  # numpy does not flush subnormals like TF's CPU kernels
        assert_same(out, np_decode_sum(g.numpy(), c["numel"], c["k"], c["bits"]), "sum vs numpy")


@pytest.mark.parametrize("n", [1, 4, 8, 9, 10, 16, 17, 26])
@pytest.mark.parametrize("bits", [2, 32])
def test_decode_accumulate_many_ranks_with_offset(n, bits):
    # strict rank order for any n (tf.add_n would group by 8 for n > 9; see ops/sparse_codec.cc)
    numel, k = 1_100_000, 2000  # > 2 chunks of the kernel's dense passes
    rows = []
    for rank in range(n):
        x = make_tensor("normal", numel, 100 + rank)
        head = np.full(13, rank, np.uint8)  # another tensor's bytes before this one's payload
        rows.append(np.concatenate([head, kernels.compress(x, None, k, bits)[0].numpy(), head]))
    g = tf.constant(np.stack(rows))
    out = kernels.decode_accumulate(g, numel, k, bits, offset=13, backend="custom")
    assert_same(out, kernels.decode_accumulate(g, numel, k, bits, offset=13, backend="reference"), "sum")
    graph = tf.function(lambda g: kernels.decode_accumulate(g, numel, k, bits, offset=13, backend="reference"))
    assert_same(out, graph(g), "sum vs reference in a graph")
    assert_same(out, np_decode_sum(g.numpy(), numel, k, bits, offset=13), "sum vs numpy")


def test_decode_accumulate_negative_zero_rules():
    # bits=32 payloads of -0.0: tf.scatter_nd adds to +0, so no -0 survives, for any n.
    numel = 8

    def payload(idx, vals):
        return codec.encode(tf.constant(idx, tf.int32), tf.constant(vals, tf.float32), numel, 32)[0].numpy()

    rows = np.stack([payload([1, 2, 3], [-0.0, -0.0, -0.0]),
                     payload([1, 2, 4], [-0.0, 0.0, -0.0]),
                     payload([1, 5, 6], [-0.0, -0.0, 1.0])])
    out = kernels.decode_accumulate(rows, numel, 3, 32, backend="custom")
    ref = kernels.decode_accumulate(rows, numel, 3, 32, backend="reference")
    assert_same(out, ref, "sum")
    assert not np.signbit(out.numpy()).any()
    single = kernels.decode_accumulate(rows[:1], numel, 3, 32, backend="custom")
    assert_same(single, kernels.decode_accumulate(rows[:1], numel, 3, 32, backend="reference"), "n=1")
    assert not np.signbit(single.numpy()).any()


def test_decode_accumulate_rejects_bad_payloads():
    numel, k = 1000, 4
    good = codec.encode(tf.constant([1, 5, 9, 700]), tf.ones([4]), numel, 32)[0].numpy()
    unsorted = codec.encode(tf.constant([5, 1, 9, 700]), tf.ones([4]), numel, 32)[0].numpy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="ascending"):
        kernels.decode_accumulate(np.stack([good, unsorted]), numel, k, 32, backend="custom")
    out_of_range = codec.encode(tf.constant([1, 5, 9, 1001]), tf.ones([4]), 1024, 32)[0].numpy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="numel"):
        kernels.decode_accumulate(out_of_range[None], numel, k, 32, backend="custom")
    with pytest.raises(ValueError, match="cannot hold"):
        kernels.decode_accumulate(good[None, :-1], numel, k, 32, backend="custom")
    with pytest.raises(ValueError, match=r"\[n, P\]"):
        kernels.decode_accumulate(good, numel, k, 32, backend="custom")


def test_bad_arguments_are_clear_errors():
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="k must be"):
        kernels.topk_select(x, 11, backend="custom")
    with pytest.raises(TypeError, match="float32"):
        kernels.topk_select(x.astype(np.float64), 1, backend="custom")
    with pytest.raises(ValueError, match="1-D"):
        kernels.compress(np.ones([2, 5], np.float32), None, 1, 2, backend="custom")
    with pytest.raises(ValueError, match="bits"):
        kernels.compress(x, None, 1, 8, backend="custom")
    with pytest.raises(ValueError, match="residual has"):
        kernels.compress(x, np.ones(9, np.float32), 1, 2, backend="custom")
    with pytest.raises(tf.errors.InvalidArgumentError, match="ascending"):
        kernels.sparse_encode([3, 1], [1.0, 2.0], 10, 2, backend="custom")


def test_auto_backend_warns_once_and_uses_reference(monkeypatch):
    monkeypatch.setattr(ops, "_LIB", None)
    monkeypatch.setattr(ops, "_LOAD_ERROR", "hgsgc custom ops library (_ops*.so) not found (test)")
    monkeypatch.setattr(ops, "_WARNED", False)
    x = make_tensor("normal", 3000, 1)
    with pytest.warns(RuntimeWarning, match="reference"):
        idx, _ = kernels.topk_select(x, 30, backend="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call does not warn again
        out = kernels.decode_accumulate(kernels.compress(x, None, 30, 2, backend="auto")[0][None], 3000, 30, 2,
                                    backend="auto")
    assert_same(idx, np_topk(x, 30), "indices")
    assert np.count_nonzero(out.numpy()) == 30
