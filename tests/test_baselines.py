"""TernGrad, PowerSGD and Deep Gradient Compression's local clipping (issue 5's baselines).

Single-process checks of the building blocks against tests/reference.py, and multi-rank checks
under mpirun with 2, 3 and 4 ranks (tests/mpi/check_baselines.py).
"""
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from conftest import mpi_cases
from hgsgc.compression import Compression, PowerSGDCompression, TernGradCompression, codec
from hgsgc.compression import powersgd, terngrad
from hgsgc.config import ConfigError, compression_from_config, load_config

CFG = "configs/fashion_mnist_dense.yaml"


# ---------------------------------------------------------------------------------- TernGrad
@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1), clip=st.sampled_from([0.0, 1.0, 2.5]))
def test_terngrad_codes_match_numpy_and_round_trip(numel, seed, clip):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(numel) * rng.uniform(0.01, 10)).astype(np.float32)
    u = rng.random(numel).astype(np.float32)
    c = terngrad.clip(tf.constant(g), clip).numpy()
    np.testing.assert_allclose(c, ref.terngrad_clip(g, clip), rtol=1e-6, atol=1e-7)
    scale = float(np.max(np.abs(c))) * 1.5  # another rank may hold the larger scale
    codes = terngrad.ternarize(tf.constant(c), tf.constant(scale, tf.float32), tf.constant(u)).numpy()
    np.testing.assert_array_equal(codes, ref.ternarize(c, scale, u))
    packed = terngrad.encode(tf.constant(codes))
    assert packed.dtype == tf.uint8 and packed.shape == (terngrad.code_bytes(numel),) == (math.ceil(numel / 4),)
    np.testing.assert_array_equal(terngrad.decode(packed, numel).numpy(), codes)


def test_terngrad_keeps_tensors_whose_entries_are_all_equal():
    """std = 0 (scalars, one-element tensors, constants): clipping must not zero the gradient."""
    import horovod.tensorflow as hvd

    from hgsgc.communicator import Exchanger

    hvd.init()  # a single process: the exchange is local
    for x in (tf.constant([5.0]), tf.constant(3.0), tf.constant([[2.0]]), tf.fill([10], -0.7)):
        np.testing.assert_array_equal(terngrad.clip(x, 2.5).numpy(), x.numpy())
        # one rank: the scale is max|g| = |g|, so every entry is sent: the output is g exactly
        out = Exchanger(Compression.terngrad()).exchange([x], ["c"])[0]
        np.testing.assert_allclose(out.numpy(), x.numpy(), rtol=1e-6)


def test_terngrad_is_unbiased_and_zero_scale_sends_nothing():
    g = np.array([0.5, -0.25, 0.0, 1.0, -1.0, 0.1], np.float32)
    draws = 20000
    total = np.zeros_like(g, np.float64)
    for s in range(draws // 1000):
        u = tf.random.stateless_uniform([1000, g.size], seed=[s, 1])
        codes = terngrad.ternarize(tf.tile(tf.constant(g)[None], [1000, 1]), tf.constant(1.0), u)
        total += codes.numpy().sum(0)
    mean = total / draws
    # each code is Bernoulli(|g|) in {0, sign g}: std of the mean <= 0.5 / sqrt(draws) = 0.0035
    np.testing.assert_allclose(mean, g, atol=5 * 0.5 / math.sqrt(draws))
    assert mean[3] == 1.0 and mean[4] == -1.0 and mean[2] == 0.0  # |g| = s is sent every time
    zero = terngrad.ternarize(tf.zeros([5]), tf.constant(0.0), tf.zeros([5]))
    np.testing.assert_array_equal(zero.numpy(), np.zeros(5, np.int32))


# ---------------------------------------------------------------------------------- PowerSGD
@pytest.mark.parametrize("shape,rank,expect", [
    ((40, 30), 2, (40, 30, 2)), ((3, 3, 2, 5), 2, (18, 5, 2)), ((17,), 4, None), ((4, 4), 2, None),
    ((4, 4), 1, (4, 4, 1)), ((3, 3, 2, 5), 4, None), ((1000, 10), 20, None), ((1, 7), 1, None)])
def test_powersgd_matrix_view(shape, rank, expect):
    assert powersgd.matrix_shape(shape, rank) == expect == ref.powersgd_matrix(shape, rank)
    want = 4 * (expect[0] + expect[1]) * expect[2] if expect else 4 * math.prod(shape)
    assert powersgd.payload_bytes(shape, rank) == want
    assert codec.exchange_payload_bytes(Compression.powersgd(rank=rank), [shape]) == want


def test_powersgd_orthogonalize_and_initial_q():
    rng = np.random.default_rng(0)
    p = rng.standard_normal((50, 3)).astype(np.float32)
    q = powersgd.orthogonalize(tf.constant(p)).numpy()
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-4)  # same column space
    a = powersgd.initial_q("dense/kernel:0", 30, 2).numpy()
    np.testing.assert_array_equal(a, powersgd.initial_q("dense/kernel:0", 30, 2).numpy())
    assert not np.array_equal(a, powersgd.initial_q("conv/kernel:0", 30, 2).numpy())


def test_terngrad_payload_formula():
    shapes = [(40, 30), (17,), (0,), (3, 3, 2, 5)]
    want = sum(math.ceil(math.prod(s) / 4) + 4 for s in shapes if math.prod(s))
    assert codec.exchange_payload_bytes(Compression.terngrad(), shapes) == want


# ----------------------------------------------------------------------------- settings/config
def test_baseline_settings_validate():
    for bad in ({"rank": 0}, {"rank": 2.5}, {"rank": True}):
        with pytest.raises(ValueError, match="rank"):
            PowerSGDCompression(**bad)
    for bad in (-1.0, "2.5", True):
        with pytest.raises(ValueError, match="clip_sigma"):
            TernGradCompression(clip_sigma=bad)
    for bad in (0, -1.0, "5", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="local_clip_norm"):
            Compression.dgc(0.01, local_clip_norm=bad)
    for bad in (None, [1], float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip_sigma"):
            TernGradCompression(clip_sigma=bad)
    for bad in ("no", None, 1):
        with pytest.raises(ValueError, match="error_feedback"):
            PowerSGDCompression(error_feedback=bad)
    assert PowerSGDCompression(rank=np.int64(4)).rank == 4
    with pytest.raises(ValueError, match="error_feedback"):
        Compression.topk(0.01, momentum_correction=True, error_feedback=False)
    dgc = Compression.dgc(0.01, local_clip_norm=5.0)
    assert dgc.momentum_correction and dgc.bits == 32 and dgc.method == "dgc" and dgc.delay == 1


def test_fc_side_settings_accepted_when_the_conv_side_is_dense():
    cfg = load_config("configs/fashion_mnist_hourglass.yaml",
                      ["hourglass.fc_method=sgc", "compression.hierarchy=tree", "compression.bits=32"])
    from hgsgc.hourglass.train import fc_compression_from_config

    fc = fc_compression_from_config(cfg)
    assert fc.hierarchy == "tree" and fc.bits == 32 and cfg.compression.method == "none"


def test_config_builds_each_baseline():
    c = compression_from_config(load_config(CFG, ["compression.method=terngrad",
                                                  "compression.terngrad_clip_sigma=0"]).compression)
    assert c == TernGradCompression(clip_sigma=0.0)
    c = compression_from_config(load_config(CFG, ["compression.method=powersgd",
                                                  "compression.powersgd_rank=8"]).compression)
    assert c == PowerSGDCompression(rank=8)
    c = compression_from_config(load_config(CFG, ["compression.method=dgc", "compression.density=0.01",
                                                  "compression.local_clip_norm=5"]).compression)
    assert c.momentum_correction and c.local_clip_norm == 5.0 and c.bits == 32 and c.method == "dgc"
    # bits default per method: topk sends fp32 values, sgc 2-bit
    assert compression_from_config(load_config(CFG, ["compression.method=topk"]).compression).bits == 32
    assert compression_from_config(load_config(CFG, ["compression.method=sgc"]).compression).bits == 2
    c = compression_from_config(load_config(CFG, ["compression.method=sgc", "compression.dense_vectors=true"]).compression)
    assert c.dense_vectors and not compression_from_config(
        load_config(CFG, ["compression.method=sgc"]).compression).dense_vectors
    # payload by formula: the rank < 2 shapes count 4 bytes per entry (their ring allreduce)
    shapes = [(40, 30), (17,), (1,)]
    assert c.collectives(shapes) == (("ring", 4 * 18), ("allgather", c.codec().payload_length(1200)))
    assert c.payload_bytes(shapes) == 4 * 18 + c.codec().payload_length(1200)


@pytest.mark.parametrize("override,needle", [
    ("compression.method=terngrad compression.delay=2", "compression.delay"),
    ("compression.method=powersgd compression.powersgd_rank=0", "compression.powersgd_rank"),
    ("compression.method=terngrad compression.terngrad_clip_sigma=-1", "compression.terngrad_clip_sigma"),
    ("compression.method=powersgd compression.hierarchy=tree", "compression.hierarchy"),
    ("compression.method=none compression.local_clip_norm=5", "compression.local_clip_norm"),
    ("compression.method=dgc compression.local_clip_norm=-1", "compression.local_clip_norm"),
    ("compression.method=dgc compression.local_clip_norm=nan", "compression.local_clip_norm"),
    ("compression.method=terngrad compression.terngrad_clip_sigma=inf", "compression.terngrad_clip_sigma"),
    ("compression.method=dgc compression.error_feedback=false", "compression.error_feedback"),
    ("compression.method=topk compression.momentum_correction=true compression.error_feedback=false",
     "compression.error_feedback"),
    # a setting for another method or layout is an error, not a silent no-op
    ("compression.method=sgc compression.powersgd_rank=8", "compression.powersgd_rank"),
    ("compression.method=powersgd compression.terngrad_clip_sigma=1", "compression.terngrad_clip_sigma"),
    ("compression.method=powersgd compression.bits=2", "compression.bits"),
    ("hourglass.micro_batches=4", "hourglass.micro_batches"),
    ("hourglass.wire_dtype=float16", "hourglass.wire_dtype"),
    ("compression.method=powersgd compression.dense_vectors=true", "compression.dense_vectors"),
    # density / selector of the sparse methods: before session 21 silently ignored by the others
    ("compression.method=powersgd compression.density=0.01", "compression.density"),
    ("compression.method=none compression.density=0.005", "compression.density"),
    ("compression.method=terngrad compression.selector=exact", "compression.selector"),
    ("compression.method=topk compression.density=0", "compression.density"),
    ("compression.method=topk compression.density=1.5", "compression.density"),
    ("compression.method=sgc compression.selector=fastest", "compression.selector"),
])
def test_bad_baseline_config_names_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(CFG, override.split())


# ----------------------------------------------------------------------------- under mpirun
MPI_CASES = mpi_cases("tests/mpi/check_baselines.py", ranks=[2, 3, 4])


@pytest.fixture(scope="module", params=[2, 3, 4])
def result(request, mpi_batch):
    return mpi_batch.result(request.param, "tests/mpi/check_baselines.py")


@pytest.mark.mpi
def test_terngrad_equals_numpy_reference_on_every_rank(result):
    for r in result["ranks"]:
        assert r["terngrad_max_err"] < 1e-6 and r["terngrad_spread"] == 0.0
        for key, val in r["terngrad_formula"].items():
            assert r["terngrad_bytes"][key] == val, (key, r["terngrad_bytes"], r["terngrad_formula"])


@pytest.mark.mpi
def test_powersgd_equals_numpy_reference_with_warm_start_and_error_feedback(result):
    for r in result["ranks"]:
        assert r["powersgd_max_err"] < 1e-4 and r["powersgd_residual_err"] < 1e-4
        assert r["powersgd_spread"] == 0.0
        for key, val in r["powersgd_formula"].items():
            assert r["powersgd_bytes"][key] == val, (key, r["powersgd_bytes"], r["powersgd_formula"])


@pytest.mark.mpi
def test_local_clipping_and_models_identical_across_ranks(result):
    n = result["size"]
    for r in result["ranks"]:
        assert r["local_clip_max_err"] < 1e-6
        assert abs(r["local_clip_norm"] - 2.0 / math.sqrt(n)) < 1e-5
        for method in ("dgc", "dgc_nomask", "terngrad", "powersgd"):
            assert r["optimizer"][method]["spread"] == 0.0, method
            assert r["optimizer"][method]["moved"] > 0.0, method


@pytest.mark.mpi
def test_momentum_correction_without_masking_at_density_one_is_momentum_of_the_average(result):
    """compression.momentum_masking=false under mpirun (check_baselines.py part 5)."""
    for r in result["ranks"]:
        assert r["nomask_density1_err"] < 1e-5, r["nomask_density1_err"]


@pytest.mark.mpi
def test_dense_vectors_average_biases_densely_with_momentum_after_the_average(result):
    """DGC's reference practice: rank < 2 tensors skip sparsification (check_baselines.py part 4)."""
    for r in result["ranks"]:
        assert r["dense_vectors_vec_err"] < 1e-6, r["dense_vectors_vec_err"]
        assert r["dense_vectors_mat_err"] == 0.0
        assert r["dense_vectors_velocity"] == ["t0", "t1", "t2", "t3", "t5"]
        assert r["dense_vectors_costs"] is True
        for key, val in r["dense_vectors_formula"].items():
            assert r["dense_vectors_bytes"][key] == val, (key, r["dense_vectors_bytes"], val)


def test_density_and_selector_are_written_out_for_sparse_methods_only():
    """A sparse method gets the defaults in its config (and so in the run's config.json); the other
    methods get none, and a config file's density under a non-sparse method can be dropped with
    ``=null`` on the command line (the fix the error names)."""
    from hgsgc.compression import DEFAULT_DENSITY, DEFAULT_SELECTOR

    for method in ("topk", "sgc", "dgc"):
        c = load_config(CFG, [f"compression.method={method}"]).compression
        assert (c.density, c.selector) == (DEFAULT_DENSITY, DEFAULT_SELECTOR) == (0.005, "sampled")
        assert compression_from_config(c).density == 0.005
    for method in ("none", "fp16", "powersgd", "terngrad", "localsgd"):
        c = load_config(CFG, [f"compression.method={method}"]).compression
        assert (c.density, c.selector) == (None, None), method
    # Hourglass FC ranks with a sparse fc_method use them although the CONV method is dense
    c = load_config(CFG, ["layout=hourglass", "hourglass.fc_method=topk", "compression.density=0.02"]).compression
    assert (c.method, c.density, c.selector) == ("none", 0.02, "sampled")
    sgc_file = "configs/fashion_mnist_sgc.yaml"
    with pytest.raises(ConfigError, match=r"compression\.density=null"):
        load_config(sgc_file, ["compression.method=powersgd"])
    c = load_config(sgc_file, ["compression.method=powersgd", "compression.density=null",
                               "compression.bits=null", "compression.delay=1", "compression.selector=null"]).compression
    assert (c.method, c.density, c.selector) == ("powersgd", None, None)
    # a dense run's config.json written before session 21 holds both: one error names both and the fix
    with pytest.raises(ConfigError, match=r"compression\.density=0\.005, compression\.selector='sampled' are "
                                          r"invalid.*method is fp16.*compression\.density=null compression\.selector=null"):
        load_config(CFG, ["compression.method=fp16", "compression.density=0.005", "compression.selector=sampled"])
    # a sparse hourglass.fc_method under data parallelism: the message names the layout
    with pytest.raises(ConfigError, match=r"fc_method=topk uses them only with layout hourglass or auto \(layout "
                                          r"is data_parallel\)"):
        load_config(CFG, ["hourglass.fc_method=topk", "compression.density=0.01"])
    # DGC's warm-up schedule of a config not validated (density None) ends at the default density
    from hgsgc.config import CompressionConfig
    from hgsgc.loop import density_schedule

    sched = density_schedule(CompressionConfig(method="dgc", warmup_steps=8))
    assert [sched(s) for s in (0, 2, 4, 6, 8, 100)] == [0.25, 0.0625, 0.015625, 0.005, 0.005, 0.005]
