"""Boundary codecs of the Hourglass layout (single process): payload lengths by formula, per-entry
error bounds, unbiased stochastic rounding, exact sparse/masked encoding, and setting errors."""
import math

import numpy as np
import pytest

from hgsgc.hourglass.boundary import BoundaryCodec, BoundaryCodecError, check_pair, masking_is_exact

SPECS = ["fp32", "fp16", "q8", "q4", "sparse", "sparse+fp16", "sparse+q8", "sparse+q4"]


def _data(r=9, f=37, seed=0):
    g = np.random.default_rng(seed)
    a = np.maximum(g.normal(size=(r, f)), 0).astype(np.float32)   # post-ReLU: about half zeros
    a[:, 3] = 0                                                      # a feature with no non-zero
    return a, g.normal(scale=1e-2, size=(r, f)).astype(np.float32)


def _V(kind, n, f):
    return {"fp32": 4 * n, "fp16": 2 * n, "q8": 4 * f + n, "q4": 4 * f + math.ceil(n / 2)}[kind]


@pytest.mark.parametrize("spec", SPECS)
def test_payload_length_is_the_formula_and_error_within_bound(spec):
    c = BoundaryCodec.parse(spec)
    rng = np.random.default_rng(1)
    for r, f in ((9, 37), (1, 5), (32, 3136)):
        a, g = _data(r, f)
        nnz = int(np.count_nonzero(a))
        kind = c.values.kind
        want = (math.ceil(r * f / 8) + _V(kind, nnz, f)) if c.sparse else _V(kind, r * f, f)
        p = c.encode(a, rng)
        assert p.dtype == np.uint8 and len(p) == want == c.length(r, f, nnz)
        dec, mask = c.decode(p, r, f)
        assert np.all(np.abs(dec - a) <= c.error_bound(a))
        if c.sparse:
            assert np.array_equal(mask, a != 0) and np.all(dec[a == 0] == 0)
            pg = c.encode(g, rng, mask=a != 0)                      # gradients at the non-zeros
            assert len(pg) == _V(kind, nnz, f) == c.length(r, f, nnz, masked=True)
            dg, _ = c.decode(pg, r, f, mask=a != 0)
            assert np.all(dg[a == 0] == 0)
            assert np.all(np.abs(dg - np.where(a != 0, g, 0)) <= c.error_bound(g, a != 0))
        else:
            dg, _ = c.decode(c.encode(g, rng), r, f)
            assert np.all(np.abs(dg - g) <= c.error_bound(g))
        if c.lossless:
            assert np.array_equal(dec, a)


@pytest.mark.parametrize("spec,bits", [("q8", 8), ("q4", 4)])
def test_quantizer_bound_is_the_per_feature_step_and_rounding_is_unbiased(spec, bits):
    c = BoundaryCodec.parse(spec)
    _, g = _data(16, 11)
    lo, hi = c.values.scales(g, None)
    assert np.all(lo.astype(np.float32) <= g.min(0)) and np.all(hi.astype(np.float32) >= g.max(0))
    step = (hi.astype(np.float32) - lo.astype(np.float32)) / (2 ** bits - 1)
    b = c.error_bound(g)[0]
    assert np.all(b >= step) and np.allclose(b, step, rtol=1e-3)   # step + 4 ulp of max(|lo|, |hi|)
    rng = np.random.default_rng(2)
    n = 3000
    mean = sum(c.decode(c.encode(g, rng), 16, 11)[0] for _ in range(n)) / n
    # E[decoded] = x: the mean of n draws is within 5 standard errors (each draw's error < step)
    assert np.all(np.abs(mean - g) <= 5 * step / math.sqrt(n) + 1e-7)


def test_fp16_overflow_is_a_clear_error():
    rng = np.random.default_rng(0)
    x = np.array([[1e5, 1.0]], np.float32)
    for spec in ("fp16", "q8", "sparse+q4"):
        with pytest.raises(FloatingPointError, match="float16"):
            BoundaryCodec.parse(spec).encode(x, rng)


def test_parse_and_pair_errors():
    import tensorflow as tf

    from hgsgc.models import build_model
    from hgsgc.hourglass.split import split_model

    assert BoundaryCodec.parse("sparse").name == "sparse+fp32"
    assert BoundaryCodec.parse("SPARSE+Q4").to_dict() == {"codec": "sparse+q4", "sparse": True,
                                                          "values": "q4", "bits": 4}
    for bad in ("int8", "q2", "sparse+sparse", "fp16+q8"):
        with pytest.raises(BoundaryCodecError, match="boundary codec"):
            BoundaryCodec.parse(bad)
    with pytest.raises(BoundaryCodecError, match="act_codec to sparse"):
        check_pair("q8", "sparse+q8")
    split = split_model(build_model("tiny"))
    assert masking_is_exact(split.trunk)                      # conv2(relu) -> pool2 -> flatten
    check_pair("sparse+q4", "sparse+q4", split.trunk)
    lin = tf.keras.Sequential([tf.keras.Input((4, 4, 1)), tf.keras.layers.Conv2D(2, 3, name="c"),
                               tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
    lsplit = split_model(lin)
    assert not masking_is_exact(lsplit.trunk)
    with pytest.raises(BoundaryCodecError, match="does not end in a ReLU"):
        check_pair("sparse+q4", "sparse+q4", lsplit.trunk)


def test_codec_config_keys():
    from hgsgc.config import ConfigError, load_config

    cfg = load_config("configs/fashion_mnist.yaml", ["hourglass.act_codec=sparse+q8",
                                                     "hourglass.grad_codec=sparse+q8"])
    assert cfg.hourglass.act_codec == "sparse+q8"
    with pytest.raises(ConfigError, match=r"hourglass\.act_codec"):
        load_config("configs/fashion_mnist.yaml", ["hourglass.act_codec=int3"])
    with pytest.raises(ConfigError, match="act_codec to sparse"):
        load_config("configs/fashion_mnist.yaml", ["hourglass.grad_codec=sparse+q8"])
    with pytest.raises(ConfigError, match=r"hourglass\.wire_dtype"):
        load_config("configs/fashion_mnist.yaml", ["hourglass.act_codec=q8", "hourglass.wire_dtype=float16"])
    with pytest.raises(ConfigError, match=r"hourglass\.fc_delay"):
        load_config("configs/fashion_mnist.yaml", ["hourglass.fc_delay=2"])          # fc_method none
    assert load_config("configs/fashion_mnist.yaml", ["hourglass.fc_method=sgc",
                                                      "hourglass.fc_delay=2"]).hourglass.fc_delay == 2
    with pytest.raises(ConfigError, match=r"hourglass\.act_codec"):
        load_config("configs/fashion_mnist_sgc.yaml", ["hourglass.act_codec=q8"])    # data parallel
