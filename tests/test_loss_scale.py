"""Mixed precision: Keras' LossScaleOptimizer around hgsgc.DistributedOptimizer on 2 and 3
ranks (tests/mpi/check_loss_scale.py). Before, a loss-scale overflow on one rank made that rank
skip its exchange alone: the ranks' collectives then paired different steps (checked by hand on
2 ranks: rank 0's step 1 ran against rank 1's step 2, the scales diverged 32768 vs 16384, and the
job ended with 'Horovod has been shut down').

The same with ``hgsgc.DistributedGradientTape(..., nonfinite="nan")`` in a custom loop
(``check_loss_scale.py tape``); under a float16 policy the tape refuses ``"skip"`` (its zeros
kept the scale at 2^15, every step skipped) and ``"off"`` with a stateful compression (the
overflow entered the residual), naming ``"nan"``."""
import pytest
import tensorflow as tf

from conftest import mpi_cases

# 2 and 3 ranks (session 13: the 4-rank runs cost ~45 s of the suite; tests/test_lossscale12.py
# runs loss scaling through the tape on 4 ranks)
MPI_CASES = (mpi_cases("tests/mpi/check_loss_scale.py", ranks=[2, 3], timeout=400)
             + mpi_cases("tests/mpi/check_loss_scale.py", "tape", ranks=[2, 3], timeout=500))


@pytest.mark.parametrize("np_", [2, 3])
def test_loss_scale_overflow_on_one_rank_skips_the_step_on_every_rank(np_, mpi_batch):
    res = mpi_batch.result(np_, "tests/mpi/check_loss_scale.py")
    for case in [f"{c}_{m}" for c in ("none", "fp16", "sgc", "topk") for m in ("eager", "graph")]:
        r = res[case]
        assert r["weights_equal_ref"] and r["residuals_equal_ref"] and r["finite"], (case, r)
        assert r["scales"] == [1024.0, 512.0, 512.0] and r["scales_ref"] == [1024.0, 1024.0], (case, r)
        assert r["spread"] == 0.0, (case, r)  # weights and scales identical on every rank
    assert "delay 1" in res["delay2"] and "LossScaleOptimizer" in res["delay2"]
    # model.fit under mixed_float16: compile wraps hgsgc's optimizer itself; 8 steps, 8 exchanges
    assert res["fit"]["wrapped"] == "LossScaleOptimizer" and res["fit"]["exchanges"] == 8, res["fit"]
    assert res["fit"]["spread"] == 0.0 and res["fit"]["finite"], res["fit"]


@pytest.mark.parametrize("np_", [2, 3])
def test_tape_nonfinite_nan_lets_a_loss_scaler_halve_and_skip_on_every_rank(np_, mpi_batch):
    """Before: ``nonfinite="nan"`` did not exist; ``"skip"`` gave zeros (scale stuck at 2^15,
    every step skipped: brk10 by hand) and ``"off"`` let SGC's residual take the Inf."""
    res = mpi_batch.result(np_, "tests/mpi/check_loss_scale.py", "tape")
    for name in ("none", "fp16", "sgc", "topk", "dgc", "powersgd"):
        for mode in ("eager", "graph"):
            r = res[f"{name}_{mode}"]
            assert r["scales"] == [1024.0, 512.0, 512.0] and r["scales_ref"] == [1024.0, 1024.0], (name, mode, r)
            # the overflowing call: weights and compression state untouched, then training goes on
            assert r["weights_kept"] and r["moved"] and r["finite"], (name, mode, r)
            assert r["skipped"] == [1, 1, 0] and r["spread"] == 0.0, (name, mode, r)
            if name in ("none", "fp16"):
                # dense: the allreduce whose average is checked ran for the skipped call too
                assert r["state_differ"] and all(k.startswith(("/stats/", "/rng_step"))
                                                 for k in r["state_differ"]), (name, mode, r)
                assert r["weights_equal_ref"], (name, mode, r)  # linear: as if call 1 never ran
            else:  # compressed: residuals, velocity, factors, counters exactly as before the call
                assert r["state_differ"] == [] and r["n_state"] >= 3, (name, mode, r)


def test_tape_refuses_skip_and_stateful_off_under_mixed_float16():
    import hgsgc

    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError) as e:
            hgsgc.DistributedGradientTape(tf.GradientTape(), nonfinite="skip")
        assert str(e.value).startswith(
            "DistributedGradientTape(nonfinite='skip') under the mixed_float16 policy: a skipped call "
            "returns zeros, which a LossScaleOptimizer takes for finite gradients, so its loss scale "
            "never drops and every later step overflows again; pass nonfinite='nan'"), str(e.value)
        for comp in (hgsgc.Compression.sgc(0.01), hgsgc.Compression.dgc(0.01),
                     hgsgc.Compression.powersgd(2)):
            with pytest.raises(ValueError, match=r"nonfinite='off'\) under the mixed_float16 policy: "
                                                 r"compression \w+ keeps state across calls .*pass "
                                                 r"nonfinite='nan'"):
                hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp, momentum=0.9)
        # allowed: dense / stateless "off" (as Horovod), "nan", "raise"
        for comp, mode in ((hgsgc.Compression.none, "off"), (hgsgc.Compression.fp16, "off"),
                           (hgsgc.Compression.terngrad(), "off"), (hgsgc.Compression.sgc(0.01), "nan"),
                           (hgsgc.Compression.sgc(0.01), "raise"),
                           (hgsgc.Compression.sgc(0.01, error_feedback=False), "off")):
            hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp, nonfinite=mode)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    hgsgc.DistributedGradientTape(tf.GradientTape(), nonfinite="skip")  # float32: as before
