"""The boundary message probe under mpirun with 2 and 3 ranks (tests/mpi/check_boundary_probe.py):
every rank reports the same result, rank 0 pairs with every other rank in turn, and the cost the
model gets follows costmodel.message_cost_s on the reported round trips (no time asserted)."""
import pytest

from conftest import mpi_cases
from hgsgc.hourglass import costmodel

# (4 ranks: tests/test_robustness7.py)
MPI_CASES = mpi_cases("tests/mpi/check_boundary_probe.py", ranks=[2, 3], timeout=300)


@pytest.fixture(scope="module", params=[2, 3])
def result(request, mpi_batch):
    return mpi_batch.result(request.param, "tests/mpi/check_boundary_probe.py")


@pytest.mark.mpi
def test_probe_pairs_rank_0_with_every_rank_and_is_identical_everywhere(result):
    n = result["size"]
    for key in ("fp32/fp32", "sparse+q8/sparse+q8"):
        ps = [r["probes"][key] for r in result["ranks"]]
        assert all(p == ps[0] for p in ps), key                      # broadcast from rank 0
        p = ps[0]
        assert p["rows"] == 16 and p["reps"] == 5 and not p["loopback"]
        assert [q[0] for q in p["pairs"]] == list(range(1, n)) and all(q[1] > 0 for q in p["pairs"])
        m = costmodel.boundary_message_inputs(p, 300.0, 250.0, 2e-6, 1e-4, 12.5e6)
        assert m["boundary_msg_s"] == max(costmodel.message_cost_s(rt, 16, 300.0, 250.0, 2e-6, 1e-4, 12.5e6)
                                          for _, rt in p["pairs"])
    assert all("probe_boundary" in r["bad_input_error"] for r in result["ranks"])
