"""Silent-divergence traps and per-variable faults under mpirun (2 and 3 ranks, with a timeout)."""
import numpy as np
import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[2, 3])
def result(request):
    from conftest import mpi_result

    return mpi_result(request.param, ["tests/mpi/check_reliability_traps.py"], timeout=900)


def test_delay_anchors_follow_broadcast_in_model_fit(result):
    """Horovod's BroadcastGlobalVariablesCallback broadcasts after the first batch, i.e. after a
    local step from different initial weights: with the anchors among opt.variables() they are
    broadcast too, and after the last sync every rank holds bitwise the same weights."""
    assert result["fit_sgc_spread"] == 0.0
    assert result["fit_localsgd_spread"] == 0.0


def test_delay_anchors_follow_broadcast_after_first_step_in_custom_loop(result):
    assert result["loop_broadcast_after_first_step_spread"] == 0.0


def test_fp16_average_of_values_whose_sum_overflows_is_finite(result):
    got, want = np.array(result["fp16_avg"]), np.array(result["fp16_want"])
    assert result["fp16_finite"]
    assert abs(want[0]) * result["size"] > 65504  # the sum is beyond float16's range
    # one fp16 rounding of x / n per rank plus fp16 sums: relative error within a few ulps (2^-11)
    assert np.all(np.abs(got - want) <= 4 * 2.0 ** -11 * np.abs(want) + 1e-6), (got, want)


def test_indexed_slices_of_unknown_static_shape_exchanged(result):
    assert result["indexed_slices_error"] is None, result["indexed_slices_error"]
    assert result["indexed_slices_max_err"] < 1e-6


def test_nonfinite_gradient_skips_step_on_every_rank(result):
    r = result["nonfinite_skip"]
    assert r["error"] is None, r
    assert r["weights_unchanged"] and r["residuals_unchanged"]  # nothing applied, nothing kept
    assert r["iterations_after_skip"] == 1 and r["skipped"] == 1
    assert r["residuals_finite"] and r["weights_finite"] and r["spread"] == 0.0


def test_nonfinite_gradient_raise_mode_stops(result):
    r = result["nonfinite_raise"]
    assert r["error"] is not None and r["error_names_setting"], r


def test_hgsgc_compression_in_stock_horovod_fails_naming_hgsgc_optimizer(result):
    err = result["stock_horovod_error"]
    assert err is not None and "TypeError" in err and "hgsgc.DistributedOptimizer" in err, err


@pytest.mark.parametrize("np_,kind", [(2, "shape"), (3, "shape"), (2, "dtype")])
def test_shape_or_dtype_differs_across_ranks_error_names_variable_once(np_, kind):
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/fault_shape_mismatch.py", kind], timeout=300)  # a hang times out
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout
    lines = [ln for ln in p.stderr.splitlines() if "hgsgc: error" in ln]
    assert len(lines) == 1, p.stderr[-3000:]
    if kind == "shape":
        assert "variable 'dense/kernel:0': shape [4, 5] float32 on rank 0" in lines[0], lines
        assert "shape [4, 6] float32 on rank 1" in lines[0], lines
    else:
        assert "shape [4, 5] float32 on rank 0" in lines[0] and "float64 on rank 1" in lines[0], lines
