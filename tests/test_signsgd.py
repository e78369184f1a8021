"""EF-SignSGD (Karimireddy et al. 2019), the baseline added through the new architecture:
numpy references on 1 rank (through DistributedOptimizer) and on 2, 3, 4 ranks (mpirun), and
exact byte counts."""
import math

import numpy as np
import pytest

from conftest import mpi_cases

MPI_CASES = mpi_cases("tests/mpi/check_signsgd.py", ranks=[2, 3, 4])


def test_efsignsgd_optimizer_matches_numpy_on_one_rank():
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    import hgsgc

    rng = np.random.default_rng(4)
    d, lr = 37, 0.1
    w0 = rng.standard_normal(d).astype(np.float32)
    gs = [rng.standard_normal(d).astype(np.float32) for _ in range(5)]
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(lr),
                                     compression=hgsgc.Compression.efsignsgd())
    v = tf.Variable(w0)
    for g in gs:
        opt.apply_gradients([(tf.constant(g), v)])
    w, e = w0.copy(), np.zeros(d, np.float32)
    for g in gs:
        p = g + e
        scale = np.sum(np.abs(p), dtype=np.float32) / np.float32(d)
        delta = np.where(p < 0, -scale, scale).astype(np.float32)
        e = p - delta
        w = w - lr * delta
    np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.hgsgc_state()["residuals"][v.name], e, rtol=1e-5, atol=1e-6)
    stats = opt.hgsgc_stats.snapshot()
    assert stats["payload_bytes"] == 5 * (4 + math.ceil(d / 8)) and stats["bytes_sent"] == 0


def test_efsignsgd_config_and_errors():
    import hgsgc
    from hgsgc.config import ConfigError, compression_from_config, load_config

    cfg = load_config(None, ["compression.method=efsignsgd"])
    assert compression_from_config(cfg.compression) == hgsgc.Compression.efsignsgd()
    assert hgsgc.Compression.efsignsgd().to_dict() == {"error_feedback": True, "method": "efsignsgd"}
    for bad in ("compression.hierarchy=tree", "compression.delay=2", "compression.bits=2"):
        with pytest.raises(ConfigError):
            load_config(None, ["compression.method=efsignsgd", bad])
    with pytest.raises(ValueError, match="error_feedback"):
        hgsgc.Compression.efsignsgd(error_feedback="yes")


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_efsignsgd_matches_numpy_and_counts_exact_bytes(np_, mpi_batch):
    out = mpi_batch.result(np_, "tests/mpi/check_signsgd.py")
    for r in out["ranks"]:
        assert r["max_err"] < 1e-5 and r["max_resid_err"] < 1e-5
        assert r["payload_setting"] == r["payload_formula"]
        assert {k: r["stats"][k] for k in r["formula"]} == r["formula"]
        assert r["state_keys"] == ["residuals", "rng_step", "stats"]
