"""Multi-rank behaviour under mpirun with 2, 3 and 4 ranks (odd counts included)."""
import pytest

from conftest import mpi_cases

pytestmark = pytest.mark.mpi
MPI_CASES = mpi_cases("tests/mpi/check_exchange.py", ranks=[2, 3, 4])


@pytest.fixture(scope="module", params=[2, 3, 4])
def result(request, mpi_batch):
    return mpi_batch.result(request.param, "tests/mpi/check_exchange.py")


def test_sparse_allgather_equals_numpy_average(result):
    for r in result["ranks"]:
        assert r["support_equal_bits32"] and r["support_equal_bits2"]
        assert r["allgather_max_err_bits32"] < 1e-6
        # 2-bit: same codes and scales as the reference, float rounding only
        assert r["allgather_max_err_bits2"] < 1e-5
        assert r["residual_nonzero_bits2"] and r["residual_nonzero_bits32"]


def test_byte_counts_equal_formula(result):
    n = result["size"]
    for r in result["ranks"]:
        for bits in (2, 32):
            got, want = r[f"bytes_bits{bits}"], r[f"bytes_formula_bits{bits}"]
            for key, val in want.items():
                assert got[key] == val, (bits, key, got, want)
            assert got["exchanges"] == 1 and got["messages"] == 1
        d = 40 * 30 + 17 + 90 + 1
        assert r["none_bytes"]["payload_bytes"] == 4 * d
        assert r["none_bytes"]["bytes_sent"] == 2 * (n - 1) * 4 * d // n


def test_density_one_reproduces_dense_allreduce(result):
    for r in result["ranks"]:
        assert r["density1_vs_allreduce_max_err"] < 1e-6
        assert r["density1_vs_numpy_max_err"] < 1e-6
        assert r["none_vs_allreduce_max_err"] < 1e-6   # grouped vs single allreduce: rounding
        assert r["tape_max_err"] < 1e-6


def test_delay_weights_identical_after_each_sync(result):
    H = 3
    for r in result["ranks"]:
        spreads = r["delay_spreads"]
        for s, spread in enumerate(spreads, start=1):
            if s % H == 0:
                assert spread == 0.0, (s, spreads)      # bitwise identical right after a sync
            else:
                assert spread > 0.0, (s, spreads)       # local steps on different data diverge
        assert r["delay_exchanges"] == len(spreads) // H
