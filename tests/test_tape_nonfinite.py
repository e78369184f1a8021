"""``hgsgc.DistributedGradientTape(..., nonfinite="skip" | "raise")`` on 2, 3 and 4 ranks
(tests/mpi/check_tape_nonfinite.py): a NaN on one rank skips the call on every rank with the
residuals untouched (equal to a run that never saw the call) or raises on every rank; the
default ``"off"`` lets the NaN into SGC's residual (the guard is what prevents it)."""
import pytest

from conftest import mpi_cases

MPI_CASES = mpi_cases("tests/mpi/check_tape_nonfinite.py", ranks=[2, 3, 4], timeout=400)

CASES = [f"{c}_{m}" for c in ("none", "sgc", "topk") for m in ("eager", "graph")]


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_tape_nonfinite_skip_and_raise_on_every_rank(np_, mpi_batch):
    res = mpi_batch.result(np_, "tests/mpi/check_tape_nonfinite.py")
    for case in CASES:
        r = res[case]
        assert r["o1"] and r["o3"], (case, r)  # calls around the skipped one: as if it never happened
        assert r["o2_zero"] and r["finite"], (case, r)
        assert r["state"], (case, r)  # residuals exactly those of the run without the NaN call
        assert r["skipped"] == 1 and r["skipped_clean"] == 0 and r["state_has_count"], (case, r)
        assert r["raise_errors"] == [True] and r["raise_state"], (case, r)
        assert r["all_ranks_ok"], (case, r)  # every rank saw the same, not only rank 0
        if case.startswith("none"):
            assert r["o3_vs_numpy"] <= 1e-6, (case, r)
    assert res["off_sgc"] == {"third_finite": False, "skipped": 0}
    assert "nonfinite" in res["bad_mode"] and "skip" in res["bad_mode"] and "'ignore'" in res["bad_mode"]
