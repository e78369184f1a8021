"""Session 10 break-it tests (brk10): what landed this session, used as a Horovod / Slurm user would.

* ``hgsgc.DistributedGradientTape(..., nonfinite="skip")`` (tests/mpi/brk10_tape.py) beyond the
  landed tests: an embedding (``IndexedSlices``) gradient carrying the NaN / Inf, a None gradient
  mixed in, DGC with momentum, PowerSGD, fp16, -Inf; two models and two tapes in one
  ``tf.function`` (a NaN in one skips that one only); a state saved after a skipped call and
  loaded into a fresh tape continues bit for bit with the count carried. Dense ``none`` / ``fp16``:
  the allreduce whose average is checked has run, so the skipped call's bytes are counted.
* A ``nonfinite`` mode that differs across ranks (tape and optimizer): one error on every rank
  naming it (tests/mpi/brk10_nonfinite_mismatch.py); it hung before.
"""
import pytest

from conftest import mpi_result

TAPE_SETTINGS = ("sgc", "sgc_2bit", "topk", "dgc", "powersgd", "fp16", "none")


@pytest.mark.parametrize("np_", [2, 3])
def test_tape_nonfinite_skip_with_embeddings_none_gradients_and_every_compressor(np_):
    res = mpi_result(np_, ["tests/mpi/brk10_tape.py"], timeout=600)
    for name in TAPE_SETTINGS:
        for mode in ("eager", "graph"):
            r = res[f"{name}_{mode}"]
            assert "error" not in r, (name, mode, r)
            # calls 1 and 3 as if the bad call never happened, call 2 all zeros, None stays None
            assert r["o1"] and r["o3"] and r["o2_zero"] and r["none_kept"] and r["finite"], (name, mode, r)
            assert r["state"] is True and r["skipped"] == [1, 0], (name, mode, r)
            if name in ("fp16", "none"):
                # dense: the skipped call's allreduce ran (the check is on its average), so the
                # byte counters hold 3 exchanges where the run without the call holds 2
                assert all(a * 2 == b * 3 and b > 0 for a, b in r["counters"].values()), (name, mode, r)
                assert r["rng_step"] == [3, 2], (name, mode, r)
            assert r["all_ranks_ok"], (name, mode, r)
    for mode in ("eager", "graph"):
        r = res[f"two_tapes_{mode}"]
        assert "error" not in r, (mode, r)
        assert r["a_same"] and r["b_zero_at_2"] and r["skipped"] == [[0, 1], [0, 0]], (mode, r)
        assert r["all_ranks_ok"], (mode, r)
    for name in ("sgc", "dgc", "powersgd"):
        r = res[f"resume_{name}"]
        assert "error" not in r, (name, r)
        assert r["saved_skipped"] == 1 and r["o3"] and r["skipped_after"] == 2 == r["skipped_full"], (name, r)
        assert r["all_ranks_ok"], (name, r)


@pytest.mark.parametrize("np_,entry", [(2, "tape"), (3, "optimizer")])
def test_a_nonfinite_mode_that_differs_across_ranks_stops_every_rank_naming_it(np_, entry):
    """Rank 0 with ``nonfinite="skip"``, the others ``"off"`` (library entry points; ``hgsgc
    train`` compares the whole config across ranks already): the guard's verdict allreduce ran on
    rank 0 only, so rank 0 waited in Horovod for a tensor no other rank sends and the job hung
    (killed by this test's timeout, no output). Now the first step's cross-rank check (the
    collective it runs anyway) names the setting and both values on every rank."""
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/brk10_nonfinite_mismatch.py", entry], timeout=150,
               env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    got = [ln for ln in p.stderr.splitlines() if "hgsgc: error" in ln]
    assert got == [f"hgsgc: error (all {np_} ranks): ValueError: nonfinite differs between ranks: "
                   f"'skip' on rank 0 but 'off' on rank 1: pass the same nonfinite mode on every rank"], \
        p.stderr[-3000:]
