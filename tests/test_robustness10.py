"""Session 10 break-it tests (brk10): what landed this session, used as a Horovod / Slurm user would.

* ``hgsgc.DistributedGradientTape(..., nonfinite="skip")`` (tests/mpi/brk10_tape.py) beyond the
  landed tests: an embedding (``IndexedSlices``) gradient carrying the NaN / Inf, a None gradient
  mixed in, DGC with momentum, PowerSGD, fp16, -Inf; two models and two tapes in one
  ``tf.function`` (a NaN in one skips that one only); a state saved after a skipped call and
  loaded into a fresh tape continues bit for bit with the count carried; a tape on a process set
  without rank 0 (tests/mpi/brk10_tape_process_set.py) skips on the set alone. Dense ``none`` / ``fp16``:
  the allreduce whose average is checked has run, so the skipped call's bytes are counted.
* A ``nonfinite`` mode that differs across ranks (tape and optimizer): one error on every rank
  naming it (tests/mpi/brk10_nonfinite_mismatch.py); it hung before.
* Elias-Fano by default with kr10's momentum kernels: DGC / momentum-corrected SGC through fit and
  tape equal the pure-TF path bit for bit (tests/mpi/brk10_dgc_backends.py); an Hourglass run
  checkpointed with ``fixed`` resumes under the default bit-exact (only byte counters differ).
"""
import pytest

from conftest import mpi_cases

TAPE_SETTINGS = ("sgc", "sgc_2bit", "topk", "dgc", "powersgd", "fp16", "none")
MPI_CASES = (mpi_cases("tests/mpi/brk10_tape.py", ranks=[2, 3], timeout=600)
             + mpi_cases("tests/mpi/brk10_dgc_backends.py", ranks=[2], timeout=500))


@pytest.mark.parametrize("np_", [2, 3])
def test_tape_nonfinite_skip_with_embeddings_none_gradients_and_every_compressor(np_, mpi_batch):
    res = mpi_batch.result(np_, "tests/mpi/brk10_tape.py")
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


def test_dgc_kernels_equal_the_reference_through_fit_and_tape_on_2_ranks(mpi_batch):
    """kr10's momentum kernels (ops/momentum_mask.cc) with the default Elias-Fano coding, trained
    through DistributedOptimizer + model.fit and DistributedGradientTape in a tf.function (DGC with
    buckets 2 / tree, SGC 2-bit with momentum correction on the node hierarchy, an embedding's
    IndexedSlices gradient): weights and every hgsgc state leaf bit-equal to the pure-TF path,
    every rank the same weights."""
    res = mpi_batch.result(2, "tests/mpi/brk10_dgc_backends.py")
    cases = [k for k in res if k != "size"]
    assert len(cases) == 5, res
    for k in cases:
        r = res[k]
        assert r["weights_differ"] == [] and r["state_differ"] == [] and r["n_state"] >= 16, (k, r)
        assert r["ranks_equal"] and r["moved"], (k, r)


def test_hourglass_checkpointed_with_fixed_resumes_under_the_default_bit_exact(tmp_path):
    """Hourglass (2 CONV + 2 FC ranks, SGC delay 2 on CONV, fc_method sgc): run a with
    compression.index_coding=fixed (the old default) checkpoints at step 6; run b resumes it with no
    coding given (elias_fano on both sides). Every step-10 leaf of every rank equals a's bit for bit
    except the byte counters (158 leaves, 12 counters)."""
    import os
    import shutil
    import subprocess

    from ckpt_compare import compare
    from conftest import MPIRUN, PY, ROOT

    base = ["configs/fashion_mnist.yaml", "layout=hourglass", "model.name=tiny", "train.batch_size=16",
            "hourglass.micro_batches=2", "compression.method=sgc", "compression.density=0.05",
            "compression.delay=2", "hourglass.link_bandwidth_mbps=100", "hourglass.fc_workers=2",
            "hourglass.fc_method=sgc", "data.train_limit=2000", "data.test_limit=200", "train.epochs=2",
            "train.max_steps_per_epoch=5", "train.progress=false", "train.deterministic=true",
            "checkpoint.keep=20", "train.threads=1", f"run.out_dir={tmp_path}"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", OMPI_MCA_mpi_yield_when_idle="1")

    def train(run_id, extra):
        cmd = (MPIRUN + ["-np", "4", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x",
                         "OMPI_MCA_mpi_yield_when_idle", PY, "-m", "hgsgc.cli", "train"] + base
               + [f"run.id={run_id}"] + extra)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    train("a", ["compression.index_coding=fixed", "checkpoint.every_steps=6"])
    a = tmp_path / "a" / "checkpoints"
    os.makedirs(tmp_path / "b" / "checkpoints")
    shutil.copytree(a / "step-00000006", tmp_path / "b" / "checkpoints" / "step-00000006")
    p = train("b", [])
    assert "(step 6)" in p.stdout and "'index_coding': 'elias_fano'" in p.stdout, p.stdout[-2000:]
    n, diffs = compare(str(a / "step-00000010"), str(tmp_path / "b" / "checkpoints" / "step-00000010"))
    assert n >= 150, n
    # every rank (CONV 0-1, FC 2-3) sent Elias-Fano payloads after the resume: only counters differ
    assert sorted(diffs) == sorted(f"rank {r}/optimizer/hgsgc/stats/{k}" for r in range(4)
                                   for k in ("bytes_received", "bytes_sent", "payload_bytes")), diffs


def test_perfmodel_validation_before_refuses_a_file_that_is_not_its_rows(tmp_path, capsys):
    """``--before`` given the bench results JSON instead of a rows JSON (both sit side by side in
    docs/benchmarks/) ended in ``TypeError: string indices must be integers`` inside a dict
    comprehension; a rows JSON of other cells gave 'the same 0 cells: within 15 %: 0 of 0'. Now one
    line naming the file, what it holds and the fix."""
    import json

    from conftest import ROOT, load_script

    v = load_script("cluster", "perfmodel_validation.py")
    bench = f"{ROOT}/docs/benchmarks/vgg16_2h_s10.json"
    probe = f"{ROOT}/docs/benchmarks/link_calibration_pinned_s10.json"
    with pytest.raises(SystemExit) as e:
        v.main(["--bench", f"{bench}={probe}", "--before", bench, "--json", str(tmp_path / "b.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[-1]  # argparse's prog
    assert err == (f"--before {bench}: not a rows file of "
                   "perfmodel_validation.py --json (a list of rows with 'run' and 'error'; this holds "
                   "a dict with keys name, spec, started_utc, ...): pass the --json output of an earlier run"), err
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"run": "some/other/run", "error": 0.1}]))
    with pytest.raises(SystemExit):
        v.main(["--bench", f"{bench}={probe}", "--before", str(other), "--json", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[-1]
    assert err == (f"--before {other}: none of its 1 rows is a cell of this "
                   "run (compare runs of the same cells)"), err


@pytest.mark.parametrize("np_", [3, 4])
def test_tape_nonfinite_skip_on_a_process_set_without_rank_0(np_):
    """A tape on the process set of ranks 1..n-1 (as the Hourglass FC ranks), SGC, NaN on the last
    rank at call 2: every rank of the set skips that call (zeros, skipped 1), calls 1 and 3 equal a
    run without it, world rank 0 is never blocked, and the set's first rank (1) prints the warning
    once."""
    import json

    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/brk10_tape_process_set.py"], timeout=240,
               env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "OMPI_MCA_mpi_yield_when_idle": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][0][7:])
    assert res["ranks"][0] == {"rank": 0}
    for r in res["ranks"][1:]:
        assert r["o1"] and r["o3"] and r["o2_zero"] and r["skipped"] == [1, 0], r
    assert (p.stdout + p.stderr).count("hgsgc: warning: NaN/Inf gradient on some rank: tape gradient() "
                                       "skipped (nonfinite='skip'), skipped so far: 1") == 1
