"""Silent-divergence traps and per-variable faults under mpirun (2 and 3 ranks, with a timeout)."""
import numpy as np
import pytest

from conftest import mpi_cases

pytestmark = pytest.mark.mpi


MPI_CASES = mpi_cases("tests/mpi/check_reliability_traps.py", ranks=[2, 3], timeout=900)


@pytest.fixture(scope="module", params=[2, 3])
def result(request, mpi_batch):
    return mpi_batch.result(request.param, "tests/mpi/check_reliability_traps.py")


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


@pytest.mark.parametrize("tag", ["localsgd", "sgc"])
def test_nonfinite_gradient_with_delay_skips_the_local_step_and_sync_agrees(result, tag):
    """Delay 3: rank min(1, n-1) gets an Inf gradient at its 2nd local step. Local steps are
    per-rank by construction (no rank can skip another's gradient without a collective per local
    step, which is what delay removes): that rank alone skips it and counts it; the sync schedule
    is unchanged (it comes after 3 calls on every rank); after the sync every rank holds bitwise
    the same finite weights, which equal the mean of the ranks' local trajectories with the
    skipped step left out (dense local SGD: float32 averaging error only), and nothing
    non-finite entered an anchor or a residual."""
    r = result[f"nonfinite_delay3_{tag}"]
    assert r["error"] is None, r
    n = result["size"]
    assert r["skipped"] == [1 if k == min(1, n - 1) else 0 for k in range(n)], r
    assert r["local_step"] == 3 and r["spread"] == 0.0 and r["finite"], r
    if tag == "localsgd":
        assert r["max_err_vs_mean_of_local_trajectories"] < 1e-6, r


def test_nonfinite_gradient_dense_exchange_checks_the_average_without_extra_allreduce(result):
    """Compression.none (delay 1): rank min(1, n-1)'s NaN reaches every rank through the
    average itself, so every rank skips the same step (weights and iterations unchanged, bitwise
    identical weights after) and the traced step has exactly as many allreduce ops as with
    faults.nonfinite=off; a compressed exchange (top-k) keeps one more: the 4-byte
    allreduce(op=Min) of the verdict, needed because its residuals are written inside the
    exchange."""
    r, off = result["nonfinite_dense_skip"], result["nonfinite_dense_off"]
    assert r["error"] is None and off["error"] is None, (r, off)
    assert r["weights_unchanged"] and r["iterations_after_skip"] == 1 and r["skipped"] == 1, r
    assert r["weights_finite"] and r["spread"] == 0.0, r
    assert not off["weights_unchanged"] and off["skipped"] == 0, off
    assert r["allreduce_ops"] == off["allreduce_ops"] >= 1, (r, off)
    assert result["nonfinite_topk_skip_allreduce_ops"] == result["nonfinite_topk_off_allreduce_ops"] + 1


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
