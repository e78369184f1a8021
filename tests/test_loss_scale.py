"""Mixed precision: Keras' LossScaleOptimizer around hgsgc.DistributedOptimizer on 2, 3 and 4
ranks (tests/mpi/check_loss_scale.py). Before, a loss-scale overflow on one rank made that rank
skip its exchange alone: the ranks' collectives then paired different steps (checked by hand on
2 ranks: rank 0's step 1 ran against rank 1's step 2, the scales diverged 32768 vs 16384, and the
job ended with 'Horovod has been shut down')."""
import pytest

from conftest import mpi_result


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_loss_scale_overflow_on_one_rank_skips_the_step_on_every_rank(np_):
    res = mpi_result(np_, ["tests/mpi/check_loss_scale.py"], timeout=400)
    for case in [f"{c}_{m}" for c in ("none", "fp16", "sgc", "topk") for m in ("eager", "graph")]:
        r = res[case]
        assert r["weights_equal_ref"] and r["residuals_equal_ref"] and r["finite"], (case, r)
        assert r["scales"] == [1024.0, 512.0, 512.0] and r["scales_ref"] == [1024.0, 1024.0], (case, r)
        assert r["spread"] == 0.0, (case, r)  # weights and scales identical on every rank
    assert "delay 1" in res["delay2"] and "LossScaleOptimizer" in res["delay2"]
    # model.fit under mixed_float16: compile wraps hgsgc's optimizer itself; 8 steps, 8 exchanges
    assert res["fit"]["wrapped"] == "LossScaleOptimizer" and res["fit"]["exchanges"] == 8, res["fit"]
    assert res["fit"]["spread"] == 0.0 and res["fit"]["finite"], res["fit"]
