"""The boundary codec (hgsgc.hourglass.boundary: the compiled quantizers of ops/boundary_codec.cc and
the whole-array numpy path) against the previous element-list implementation kept as the
reference (hgsgc.hourglass.boundary_reference): the same
payload bytes, the same decoded float32 bits, the same masks and the same generator state after
every call (the stochastic-rounding stream that checkpoints save), on shapes and values that
exercise every branch (odd value counts for q4, features without non-zeros, constant features
with Delta_j = 0, negative values, tiny and large magnitudes, subnormal scales, +0/-0 ties)."""
import os

import numpy as np
import pytest

from hgsgc.hourglass import boundary as bd
from hgsgc.hourglass import boundary_reference as ref
from hgsgc.hourglass.boundary import BoundaryCodec

REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")


@pytest.fixture(params=["numpy", "compiled"])
def backend(request):
    """Run the test with each quantizer implementation (compiled: skipped when the library is not
    built, unless HGSGC_REQUIRE_CUSTOM_OPS=1, where a missing library fails)."""
    bd.set_codec_backend(request.param)
    try:
        if request.param == "compiled" and not REQUIRE_CUSTOM:
            try:
                bd.codec_backend()
            except RuntimeError as exc:
                pytest.skip(str(exc))
        assert bd.codec_backend() == request.param
        yield request.param
    finally:
        bd.set_codec_backend("auto")

SPECS = ["fp32", "fp16", "q8", "q4", "sparse", "sparse+fp16", "sparse+q8", "sparse+q4"]


def _cases():
    g = np.random.default_rng(11)
    for trial in range(12):
        r, f = int(g.integers(1, 18)), int(g.integers(1, 50))
        x = (g.standard_normal((r, f)) * 10.0 ** g.uniform(-6, 3)).astype(np.float32)
        if trial % 2:
            x = np.maximum(x, 0)                       # post-ReLU
        if trial % 3 == 0:
            x[:, : f // 2] = 0                         # features without non-zeros
        if trial % 4 == 1:
            x[:, -1] = x[0, -1]                        # a constant feature: Delta_j = 0
        grad = (g.standard_normal((r, f)) * 10.0 ** g.uniform(-8, 1)).astype(np.float32)
        yield trial, x, grad
    x = np.full((3, 5), 1e-7, np.float32)             # scales below float16's normal range
    x[1, 2] = -3e-8
    yield 99, x, -x
    x = np.ones((4, 3), np.float32)                    # gradients with +0/-0 at min / max
    grad = np.array([[0.0, -0.0, 1.0], [-0.0, 0.0, -0.0], [2.0, -1.0, 0.0], [0.0, -0.0, -0.0]],
                    np.float32)
    yield 98, x, grad
    x = np.array([[60000.0, -65504.0, 3.0]], np.float32)  # scales at float16's limits
    yield 97, x, x * 1e-3


def _same_f32(a, b):
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("spec", SPECS)
def test_codec_is_bit_identical_to_the_reference_with_the_same_generator_state(spec, backend):
    c = BoundaryCodec.parse(spec)
    for trial, x, grad in _cases():
        r, f = x.shape
        mine, theirs = np.random.default_rng([trial, 1]), np.random.default_rng([trial, 1])
        p = c.encode(x, mine)
        assert p.dtype == np.uint8 and np.array_equal(p, ref.encode(c, x, theirs)), (trial, "act")
        assert len(p) == c.length(r, f, int(np.count_nonzero(x)))
        d, m = c.decode(p, r, f)
        d_ref, m_ref = ref.decode(c, p, r, f)
        assert _same_f32(d, d_ref), (trial, "act decode")
        mask = None
        if c.sparse:
            assert m.dtype == bool and np.array_equal(m, m_ref) and np.array_equal(m, x != 0)
            mask = m
        else:
            assert m is None and m_ref is None
        q = c.encode(grad, mine, mask=mask)
        assert np.array_equal(q, ref.encode(c, grad, theirs, mask=mask)), (trial, "grad")
        e, _ = c.decode(q, r, f, mask=mask)
        assert _same_f32(e, ref.decode(c, q, r, f, mask=mask)[0]), (trial, "grad decode")
        # the generators drew the same numbers (n float32 uniforms per quantized message)
        assert mine.bit_generator.state == theirs.bit_generator.state
        assert mine.random() == theirs.random()


@pytest.mark.parametrize("spec", ["q8", "sparse+q4"])
def test_values_beyond_float16_raise_the_same_error_as_the_reference(spec, backend):
    c = BoundaryCodec.parse(spec)
    for bad in (np.float32(7e4), np.float32(np.inf), np.float32(np.nan)):
        x = np.ones((2, 3), np.float32)
        x[1, 1] = bad
        with pytest.raises(FloatingPointError) as mine:
            c.encode(x, np.random.default_rng(0))
        with pytest.raises(FloatingPointError) as theirs:
            ref.encode(c, x, np.random.default_rng(0))
        assert str(mine.value) == str(theirs.value) and "hourglass.act_codec" in str(mine.value)


def test_short_payload_is_a_clear_error(backend):
    c = BoundaryCodec.parse("q8")
    p = c.encode(np.ones((2, 3), np.float32), np.random.default_rng(0))
    with pytest.raises(ValueError):
        c.decode(p[:-1], 2, 3)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="numpy"):
        bd.set_codec_backend("gpu")


def test_reference_codec_wrapper_delegates_the_format():
    c = BoundaryCodec.parse("sparse+q4")
    w = ref.ReferenceCodec(c)
    assert w.sparse and w.name == "sparse+q4" and w.max_length(4, 6) == c.max_length(4, 6)
    x = np.maximum(np.random.default_rng(0).standard_normal((4, 6)), 0).astype(np.float32)
    assert np.array_equal(w.encode(x, np.random.default_rng(3)), c.encode(x, np.random.default_rng(3)))
