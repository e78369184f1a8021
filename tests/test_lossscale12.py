"""Mixed precision with ``hgsgc.DistributedGradientTape(..., loss_scale_optimizer=opt)``: the state
a compressed exchange carries across calls (error-feedback residuals, DGC velocity, PowerSGD's
error buffer and factors) stays in unscaled units while a dynamic loss scale halves (overflow on
one rank) and doubles (``dynamic_growth_steps=2``) (tests/mpi/check_lossscale12.py, 2, 3 and 4
ranks).

Before (session 11, no ``loss_scale_optimizer``): the tape exchanged the gradients of the scaled
loss, so the residual left at scale ``s`` counted ``s_new / s`` times against the next gradient
(documented in docs/api.md as a gap): the ``old`` run of the check still shows it (its weights
differ from the run in unscaled units). Bit for bit, not within a tolerance: the scales are powers
of two, so ``g * (1 / s)``, the exchange's sums and ``average * s * (1 / s)`` are exact in fp32
(no value comes near the subnormal or overflow range here).
"""
import warnings

import pytest
import tensorflow as tf

from conftest import mpi_cases

COMPRESSED = ("sgc", "topk", "dgc", "powersgd")
SCALES = [1024.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]  # halved at call 1, doubled after 2 finite


# 2 ranks check every compression; 3 and 4 ranks split them (each compression runs on 2 ranks and
# one more count; the odd count 3 covers SGC and PowerSGD) to keep the suite time down (about 65 s
# of CPU per rank per compression)
PER_NP = {2: COMPRESSED, 3: ("sgc", "powersgd"), 4: ("topk", "dgc")}
MPI_CASES = [c for np_, names in PER_NP.items()
             for c in mpi_cases("tests/mpi/check_lossscale12.py", *names, ranks=[np_], timeout=900)]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_tape_state_stays_unscaled_across_loss_scale_changes(np_, mpi_batch):
    names = PER_NP[np_]
    res = mpi_batch.result(np_, "tests/mpi/check_lossscale12.py", *names)
    assert sorted(k.rsplit("_", 1)[0] for k in res if k != "size") == sorted(n for n in names for _ in (0, 1))
    for name in names:
        for mode in ("eager", "graph"):
            r = res[f"{name}_{mode}"]
            assert r["scales"] == SCALES, (name, mode, r)
            assert r["finite"] and r["spread"] == 0.0, (name, mode, r)  # same on every rank
            # equal to the run in unscaled units (float32, no loss scale, call 1 never ran)
            assert r["weights_equal_plain"] and r["state_differ_plain"] == [], (name, mode, r)
            assert any(k.startswith(("/residuals/", "/velocity/", "/powersgd_q/"))
                       for k in r["state_keys"]), (name, mode, r)
            if mode == "eager":
                # and to LossScaleOptimizer(hgsgc.DistributedOptimizer(...)): same state tree
                assert r["scales_opt"] == SCALES, (name, r)
                assert r["weights_equal_opt"] and r["state_differ_opt"] == [], (name, r)
                # without loss_scale_optimizer the gap is still there (the check can see it)
                assert r["scales_old"] == SCALES and not r["old_weights_equal_plain"], (name, r)
                assert r["old_max_diff"] > 1e-3, (name, r)
            else:
                # resumed after call 2 from hgsgc_state() + the LossScaleOptimizer's checkpoint
                assert r["scales_resume"] == SCALES[3:], (name, r)
                assert r["weights_equal_resume"] and r["state_differ_resume"] == [], (name, r)
    if "dgc_eager" in res:
        assert "/velocity/0" in res["dgc_eager"]["state_keys"]


def test_loss_scale_optimizer_argument_is_checked_and_warned_for():
    import hgsgc

    with pytest.raises(ValueError, match=r"loss_scale_optimizer=\.\.\.\) takes the "
                                         r"tf\.keras\.mixed_precision\.LossScaleOptimizer .*got SGD"):
        hgsgc.DistributedGradientTape(tf.GradientTape(), compression=hgsgc.Compression.sgc(0.01),
                                      loss_scale_optimizer=tf.keras.optimizers.legacy.SGD(0.1))
    lso = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.legacy.SGD(0.1))
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for comp, mom in ((hgsgc.Compression.sgc(0.01), None), (hgsgc.Compression.dgc(0.01), 0.9),
                          (hgsgc.Compression.powersgd(2), None)):
            with pytest.warns(UserWarning, match=r"without loss_scale_optimizer: its residuals .* "
                                                 r"pass loss_scale_optimizer="):
                hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp, momentum=mom,
                                              nonfinite="nan")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                t = hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp, momentum=mom,
                                                  nonfinite="nan", loss_scale_optimizer=lso)
            assert t._loss_scale_opt is lso
        # dense settings exchange the scaled gradients, as Horovod (no warning, nothing unscaled)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for comp in (hgsgc.Compression.none, hgsgc.Compression.fp16):
                t = hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp,
                                                  loss_scale_optimizer=lso)
                assert t._loss_scale_opt is None
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
