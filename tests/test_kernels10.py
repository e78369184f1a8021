"""Session 10: SGC's compression compute on the kernels path, pinned bit for bit to the pure-TF path.

Each speed change of session 10 (docs/compression.md, "Compression compute (session 10)") keeps
the exchange's results identical: these tests run the same exchanges (world size 1, the
compute-only path of ``hgsgc bench``) with the C++ kernels (``ops.set_compression_backend
("custom")``) and with the pure-TF reference ops (``"reference"``: ``sparsify`` + ``wire`` +
``tf.scatter_nd``), and compare the averages, the error-feedback residuals, the DGC velocities
and the byte counters on raw bits (float32 viewed as uint32: -0.0 vs +0.0 and NaN payloads count).

The kernel tests skip when the library is not built, unless HGSGC_REQUIRE_CUSTOM_OPS=1.
"""
import os

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from hgsgc import ops
from hgsgc.communicator import Exchanger
from hgsgc.compression import Compression, kernels, wire
from hgsgc.compression.codec import TopKCodec

HAVE_CUSTOM = ops.available()
REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")
pytestmark = pytest.mark.skipif(not HAVE_CUSTOM and not REQUIRE_CUSTOM,
                                reason="custom ops not built (python setup.py build_ext --inplace)")

hvd.init()


def bits_of(a):
    a = a.numpy() if tf.is_tensor(a) else np.asarray(a)
    return a.astype(np.float32).view(np.uint32) if a.dtype == np.float32 else a


def assert_same(a, b, what=""):
    a, b = bits_of(a), bits_of(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} entries differ, first at {bad[:5]}"


@pytest.fixture
def backend():
    """Set the compression backend for one test; restored afterwards."""
    old = ops._compression_backend

    def set_(name):
        ops.set_compression_backend(name)

    yield set_
    ops.set_compression_backend(old)


def gradients(step, shapes):
    """Per-step gradients with the cases that make selection and masking delicate: ties at the
    threshold, +0/-0 runs (2-bit scales lo = hi = 0: sent values 0 and -0), subnormals."""
    rng = np.random.default_rng(100 + step)
    out = []
    for j, shape in enumerate(shapes):
        n = int(np.prod(shape))
        kind = j % 4
        if kind == 0:
            x = rng.standard_normal(n)
        elif kind == 1:
            x = rng.integers(-2, 3, n).astype(np.float64)
        elif kind == 2:
            x = np.where(rng.random(n) < 0.5, -0.0, 0.0)
            if step % 2:
                x[rng.integers(0, n, 3)] = rng.standard_normal(3)
        else:
            x = rng.standard_normal(n) * 1e-3
            x[rng.random(n) < 0.3] = np.float32(1e-40) * rng.integers(-3, 4)
        out.append(tf.constant(x.astype(np.float32).reshape(shape)))
    return out


SHAPES = [(37, 11), (400,), (16, 3, 3, 8), (1000, 7), (5,), (64, 33)]


def run_exchanges(comp, momentum, steps, graph):
    ex = Exchanger(comp, momentum=momentum)
    names = [f"t{j}" for j in range(len(SHAPES))]
    fn = tf.function(ex.exchange) if graph else ex.exchange
    outs = []
    for s in range(steps):
        outs.append([a.numpy() for a in fn(gradients(s, SHAPES), names)])
    return outs, ex.state_dict()


def compare_runs(a, b):
    (outs_a, state_a), (outs_b, state_b) = a, b
    for s, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        for j, (x, y) in enumerate(zip(oa, ob)):
            assert_same(x, y, f"step {s} average of tensor {j}")
    assert sorted(state_a) == sorted(state_b)
    for key in state_a:
        if isinstance(state_a[key], dict):
            assert sorted(state_a[key]) == sorted(state_b[key]), key
            for name in state_a[key]:
                assert_same(state_a[key][name], state_b[key][name], f"{key}[{name}]")
        else:
            assert state_a[key] == state_b[key], key


@pytest.mark.parametrize("bits,coding,masking", [(2, "fixed", True), (2, "elias_fano", True),
                                                 (32, "fixed", True), (2, "fixed", False)])
@pytest.mark.parametrize("graph", [True, False])
def test_momentum_correction_exchange_kernels_equal_reference(backend, bits, coding, masking, graph):
    """DGC momentum correction + error feedback + 2-bit / fp32 values: averages, residuals,
    velocities and byte counters of 4 exchanges are the same bits with the kernels as with the
    pure-TF ops (the masking reads the decoded own payload, which the kernels path decodes with
    HgsgcDecodeAccumulate since session 10)."""
    comp = Compression.sgc(0.05, bits=bits, momentum_correction=True, momentum_masking=masking,
                           index_coding=coding)
    backend("reference")
    ref = run_exchanges(comp, 0.9, 4, graph)
    backend("custom")
    ker = run_exchanges(comp, 0.9, 4, graph)
    compare_runs(ref, ker)
    # the masking did clear something (else the test would not pin it)
    if masking:
        vel = ker[1]["velocity"]
        assert any((v == 0).sum() > 0 for v in vel.values())


@pytest.mark.parametrize("graph", [True, False])
def test_momentum_correction_with_zero_momentum_kernels_equal_reference(backend, graph):
    """m = 0 (an SGD(momentum=0.0) optimizer with momentum correction): the same bits too."""
    comp = Compression.sgc(0.05, momentum_correction=True)
    backend("reference")
    ref = run_exchanges(comp, 0.0, 3, graph)
    backend("custom")
    ker = run_exchanges(comp, 0.0, 3, graph)
    compare_runs(ref, ker)


@pytest.mark.parametrize("comp", [Compression.sgc(0.01, bits=2), Compression.topk(0.05),
                                  Compression.sgc(0.1, bits=2, index_coding="elias_fano")])
def test_error_feedback_exchange_kernels_equal_reference(backend, comp):
    """Without momentum correction (top-k, SGC of the LM config): same bits on both paths."""
    backend("reference")
    ref = run_exchanges(comp, None, 3, True)
    backend("custom")
    ker = run_exchanges(comp, None, 3, True)
    compare_runs(ref, ker)


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("coding", ["fixed", "elias_fano"])
def test_own_payload_decode_equals_codec_decode(bits, coding):
    """The dense decode of one rank's own payload (what masking compares with 0): the
    single-row HgsgcDecodeAccumulate equals ``TopKCodec.decode`` (wire.decode + scatter_nd)
    bit for bit, sent values of -0.0 and 2-bit scales of 0 included."""
    numel, k = 300, 17
    codec = TopKCodec(k / numel, bits, index_coding=coding)
    assert codec.k(numel) == k
    rng = np.random.default_rng(3)
    cases = [rng.standard_normal(k), np.full(k, -0.0), np.zeros(k), np.r_[np.full(k - 1, -0.0), 2.0],
             np.r_[np.full(k - 2, 1.5), -1.5, np.float32(1e-40)]]
    for vals in cases:
        idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)
        payload, _ = wire.encode(tf.constant(idx), tf.constant(vals.astype(np.float32)), numel, bits, coding)
        want = codec.decode(payload, numel)
        got = kernels.decode_accumulate(tf.reshape(payload, [1, -1]), numel, k, bits,
                                        backend="custom", index_coding=coding)
        assert_same(want, got, f"values {vals[:3]}")


def tricky(n, seed):
    """float32 [n]: normal values, +0/-0, subnormals, NaN, inf, huge (the product overflows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    pick = rng.integers(0, 8, n)
    x[pick == 1] = 0.0
    x[pick == 2] = -0.0
    x[pick == 3] = np.float32(1e-40) * rng.integers(-4, 5, (pick == 3).sum())
    x[pick == 4] = np.float32(3e38) * rng.choice([-1, 1], (pick == 4).sum())
    x[pick == 5] = np.float32(1.2e-38)  # the product with m is subnormal: flushed
    x[rng.integers(0, n, 2)] = np.nan
    x[rng.integers(0, n, 2)] = np.inf
    return x


@pytest.mark.parametrize("m", [0.9, 0.99, 0.5, 1.0])
@pytest.mark.parametrize("graph", [False, True])
def test_momentum_accumulate_equals_tf_ops(m, graph):
    """m in (0, 1] (with m = 0 grappler folds the TF path's 0 * v away in graphs, so even that
    path's -0 entries differ between eager and graph: MomentumCorrection keeps the TF ops for
    m = 0, test below)."""
    n = 70_001
    v = tf.Variable(tricky(n, 1))
    g = tf.constant(tricky(n, 2))
    run = (lambda f: tf.function(f)()) if graph else (lambda f: f())
    want = run(lambda: kernels.momentum_accumulate_reference(v, g, m))
    got = run(lambda: kernels.momentum_accumulate(v, g, m, backend="custom"))
    assert_same(want, got, "u")
    assert_same(v.numpy(), tricky(n, 1), "velocity untouched")
    # a gradient of any shape (flattened), e.g. a conv kernel
    g4 = tf.reshape(g[:70_000], [10, 7, 10, 100])
    v4 = tf.Variable(tricky(70_000, 3))
    assert_same(kernels.momentum_accumulate_reference(v4, g4, m),
                kernels.momentum_accumulate(v4, g4, m, backend="custom"), "u of a 4-D grad")


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("hold_read", [False, True])
def test_momentum_mask_equals_tf_ops(graph, hold_read):
    """In place, and copy-on-write while an earlier read of the velocity is alive (that read
    keeps the old values)."""
    n = 50_003
    u = tf.constant(tricky(n, 4))
    sent = tricky(n, 5)
    sent[::3] = 0.0
    sent[1::7] = -0.0
    sent = tf.constant(sent)
    v_ref, v_ker = tf.Variable(tricky(n, 6)), tf.Variable(tricky(n, 6))
    old = v_ker.read_value() if hold_read else None

    def ker():
        kernels.momentum_mask(v_ker, u, sent, backend="custom")
        return v_ker.read_value()

    (tf.function(lambda: kernels.momentum_mask_reference(v_ref, u, sent)) if graph
     else lambda: kernels.momentum_mask_reference(v_ref, u, sent))()
    got = tf.function(ker)() if graph else ker()
    assert_same(v_ref.numpy(), v_ker.numpy(), "velocity")
    assert_same(got, v_ker.numpy(), "read after the mask")
    if hold_read:
        assert_same(old, tricky(n, 6), "the earlier read kept the old values")


def test_momentum_kernels_bad_arguments():
    v = tf.Variable(tf.zeros([5]))
    with pytest.raises(ValueError, match="velocity must be a float32 tf.Variable of 6 entries"):
        kernels.momentum_accumulate(v, tf.zeros([6]), 0.9, backend="custom")
    with pytest.raises(ValueError, match="sent has 4 entries but u has 5"):
        kernels.momentum_mask(v, tf.zeros([5]), tf.zeros([4]), backend="custom")
    with pytest.raises(ValueError, match="grad must be float32"):
        kernels.momentum_accumulate(v, tf.zeros([5], tf.float64), 0.9, backend="custom")


def test_momentum_mask_takes_over_a_dead_u_in_a_graph():
    """Inside a tf.function the u of momentum_accumulate is dead after the mask: its buffer
    becomes the velocity (only the sent entries written). Same bits as the TF ops; a later
    accumulate reads the new velocity; an input u read elsewhere afterwards is unchanged."""
    n = 40_009
    g = tf.constant(tricky(n, 7))
    sent = tricky(n, 8)
    sent[::2] = 0.0
    sent = tf.constant(sent)
    v_ref, v_ker = tf.Variable(tricky(n, 9)), tf.Variable(tricky(n, 9))

    @tf.function
    def ref():
        u = kernels.momentum_accumulate_reference(v_ref, g, 0.9)
        kernels.momentum_mask_reference(v_ref, u, sent)
        return kernels.momentum_accumulate_reference(v_ref, g, 0.9)

    @tf.function
    def ker(keep_u):
        u = kernels.momentum_accumulate(v_ker, g, 0.9, backend="custom")
        kernels.momentum_mask(v_ker, u, sent, backend="custom")
        out = kernels.momentum_accumulate(v_ker, g, 0.9, backend="custom")
        return (out, u) if keep_u else (out, out)

    want = ref()
    got, _ = ker(False)
    assert_same(v_ref.numpy(), v_ker.numpy(), "velocity after mask (u taken over)")
    assert_same(want, got, "accumulate after the mask")
    v_ref.assign(tricky(n, 9))
    v_ker.assign(tricky(n, 9))
    ref()
    _, u_kept = ker(True)  # u is an output too: it cannot be taken over, and must stay u
    assert_same(v_ref.numpy(), v_ker.numpy(), "velocity after mask (u kept)")
    v0 = tf.Variable(tricky(n, 9))
    assert_same(u_kept, kernels.momentum_accumulate_reference(v0, g, 0.9), "u returned whole")
