"""brk19 (session 19): defects a hostile but realistic user found, each pinned by a test that
failed before its fix (said so in each docstring)."""
import json
import os
import signal

import numpy as np
import pytest

from conftest import mpirun

CFG = "configs/fashion_mnist_sgc.yaml"
TINY = ["model.name=tiny", "data.train_limit=500", "data.test_limit=100", "train.max_steps_per_epoch=3",
        "train.progress=false", "train.threads=1"]
RUN = {"world_size": 1, "model": "tiny"}


def _hgsgc(args, np_, timeout=300):
    """``hgsgc ARGS`` under mpirun (conftest.mpirun: on a timeout the whole process group goes,
    so a hung rank does not outlive its test)."""
    return mpirun(np_, ["-m", "hgsgc.cli"] + list(args), timeout=timeout)


def _checkpointer(d, tmp_path, resume="auto", lines=None):
    from hgsgc import checkpoint as ckpt
    from hgsgc.config import CheckpointConfig

    return ckpt.Checkpointer(CheckpointConfig(dir=str(d), resume=resume), str(tmp_path), RUN, None,
                             (lines if lines is not None else []).append)


# ------------------------------------------------------------------ resume: never
def test_resume_never_sets_the_earlier_checkpoints_aside(tmp_path):
    """Before: ``checkpoint.resume=never`` trained afresh BESIDE the earlier run's checkpoints,
    which stayed the newest, so the next ``resume: auto`` (the Slurm requeue of the same job)
    resumed the earlier run's step 10 instead of this run's step 5, exit 0, no word. Now
    ``never`` moves them to ``<dir>.set-aside-<UTC time>`` first (nothing deleted) and says so."""
    from hgsgc import checkpoint as ckpt

    d = tmp_path / "ck"
    ckpt.save(str(d), 10, {"w": np.full(4, 10.0)}, RUN)
    lines = []
    c = _checkpointer(d, tmp_path, "never", lines)
    try:
        assert c.resume() is None
        c.save(5, lambda: {"w": np.full(4, 5.0)})
    finally:
        c.close()
    aside = [p for p in os.listdir(tmp_path) if p.startswith("ck.set-aside-")]
    assert len(aside) == 1, os.listdir(tmp_path)
    assert ckpt.list_checkpoints(str(tmp_path / aside[0]))[0][0] == 10  # kept, intact
    assert lines == [f"hgsgc: checkpoint.resume=never: moved the 1 earlier checkpoint folder(s) (newest "
                     f"step 10) from {d} to {tmp_path / aside[0]}; this run starts afresh"]
    c = _checkpointer(d, tmp_path, "auto")
    try:
        assert c.resume()["w"][0] == 5.0  # this run's, not the earlier run's
    finally:
        c.close()
    # a second `never` sets this run's aside too, under another name
    c = _checkpointer(d, tmp_path, "never")
    try:
        assert c.resume() is None
    finally:
        c.close()
    assert len([p for p in os.listdir(tmp_path) if p.startswith("ck.set-aside-")]) == 2
    # an empty or absent folder: nothing to move
    assert ckpt.set_aside(str(tmp_path / "none")) is None


@pytest.mark.mpi
def test_resume_never_then_requeue_resumes_this_run_on_2_ranks(tmp_path):
    """The user's sequence, 2 ranks: a finished 2-epoch run; the same run id again with
    ``resume=never`` and 1 epoch (step 3); then ``resume: auto`` with 2 epochs must resume step
    3 of the second run (before: the first run's step 6, its results reported as the new run's)."""
    base = [CFG] + TINY + [f"run.out_dir={tmp_path}", "run.id=r", "train.deterministic=true"]
    p = _hgsgc(["train"] + base + ["train.epochs=2", "train.lr=0.05"], 2)
    assert p.returncode == 0, p.stderr[-2000:]
    p = _hgsgc(["train"] + base + ["train.epochs=1", "train.lr=0.01", "checkpoint.resume=never"], 2)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "checkpoint.resume=never: moved the 1 earlier checkpoint folder(s) (newest step 6)" in p.stdout, p.stdout
    p = _hgsgc(["train"] + base + ["train.epochs=2", "train.lr=0.01"], 2)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "(step 3)" in p.stdout and "(step 6)" not in p.stdout, p.stdout[-2000:]


# ------------------------------------------------------------------ damaged, only checkpoint
def _truncate(fp, size=1000):
    with open(fp, "r+b") as f:
        f.truncate(size)


def test_auto_resume_of_a_truncated_only_checkpoint_stops_instead_of_starting_afresh(tmp_path):
    """Before: a rank file truncated after its checkpoint completed (manifest present) made
    ``resume: auto`` skip it like an interrupted write; with no older checkpoint the run trained
    from step 0, exit 0, without a word (all progress lost). Now it stops with one error naming
    the folder and the fix; with an older checkpoint it says which one it passed over."""
    from hgsgc import checkpoint as ckpt

    d = tmp_path / "ck"
    ckpt.save(str(d), 6, {"w": np.arange(5000.0)}, RUN, keep=3)
    _truncate(d / "step-00000006" / "rank-00000.npz")
    c = _checkpointer(d, tmp_path)
    try:
        with pytest.raises(ckpt.CheckpointError) as ei:
            c.resume()
    finally:
        c.close()
    msg = str(ei.value)
    assert msg.startswith(f"checkpoint {d}/step-00000006 is damaged (rank-00000.npz has 1000 bytes, the "
                          f"manifest says "), msg
    assert "no older complete checkpoint is left" in msg and "would silently start from step 0" in msg, msg
    # an older complete one: resumed, with a line naming the damaged one
    ckpt.save(str(d), 3, {"w": np.full(4, 3.0)}, RUN, keep=3)
    os.remove(d / "step-00000006" / "rank-00000.npz")
    lines = []
    c = _checkpointer(d, tmp_path, lines=lines)
    try:
        assert c.resume()["w"][0] == 3.0
    finally:
        c.close()
    assert lines == [f"hgsgc: checkpoint {d}/step-00000006 is damaged (rank-00000.npz is missing): "
                     f"resuming from an older one",
                     f"hgsgc: resuming from {d}/step-00000003 (step 3)"]
    # an interrupted write (no manifest) is still skipped silently
    os.remove(d / "step-00000006" / ckpt.MANIFEST)
    lines.clear()
    c = _checkpointer(d, tmp_path, lines=lines)
    try:
        assert c.resume()["w"][0] == 3.0
    finally:
        c.close()
    assert lines == [f"hgsgc: resuming from {d}/step-00000003 (step 3)"]


# ------------------------------------------------------------------ fewer epochs than the checkpoint
def test_resume_past_the_runs_end_is_refused_naming_train_epochs(tmp_path):
    """Before: a 3-epoch run resumed with ``train.epochs=1`` loaded step 15, wrote a summary
    saying 1 epoch / 5 steps with epoch 3's accuracy and 3x the bytes per step, and a checkpoint
    'step 5' holding step 15's state (exit 0). Now every rank stops with one error naming
    ``train.epochs`` and the epochs needed; resuming exactly at the end stays allowed."""
    from hgsgc import checkpoint as ckpt

    d = tmp_path / "ck"
    ckpt.save(str(d), 15, {"w": np.ones(3)}, RUN)
    c = _checkpointer(d, tmp_path)
    try:
        with pytest.raises(ckpt.CheckpointError) as ei:
            c.resume(end_step=5, steps_per_epoch=5)
        assert c.resume(end_step=15, steps_per_epoch=5) is not None
    finally:
        c.close()
    msg = str(ei.value)
    assert msg.startswith(f"checkpoint {d}/step-00000015 is at step 15, past the end of this run (step 5: "), msg
    assert "Fix: raise train.epochs to at least 3," in msg, msg


@pytest.mark.mpi
def test_resume_with_fewer_epochs_is_one_error_on_3_ranks(tmp_path):
    base = [CFG] + TINY + [f"run.out_dir={tmp_path}", "run.id=e"]
    p = _hgsgc(["train"] + base + ["train.epochs=2"], 3)
    assert p.returncode == 0, p.stderr[-2000:]
    p = _hgsgc(["train"] + base + ["train.epochs=1"], 3)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if "past the end of this run" in ln]
    assert len(lines) == 1 and "raise train.epochs to at least 2" in lines[0], p.stderr[-3000:]
    summary = json.load(open(tmp_path / "e" / "summary.json"))
    assert summary["steps"] == 6  # the 2-epoch run's summary, not overwritten


# ------------------------------------------------------------------ a signal after the run
def test_a_signal_after_the_run_is_announced_and_ignored(capfd):
    """Before: ``hgsgc train`` restored the default SIGUSR1 / SIGTERM handlers when the run
    returned, so a preemption signal in the ~0.7 s of MPI finalize and TensorFlow teardown killed
    the rank (mpirun exit 138) and Slurm marked a finished job FAILED. As a command it now keeps
    a handler that announces and ignores the signal."""
    from hgsgc import faults

    before = signal.getsignal(signal.SIGUSR1)
    faults.catch_early_signals()
    faults.release_early_signals(late=True)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # would end this process with the default handler
        assert signal.getsignal(signal.SIGUSR1) is faults._late_handler
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert capfd.readouterr().err.endswith(
        "SIGUSR1 received after the run ended (its results are written): ignored\n")
    # called in a caller's process (late=False): the previous handlers come back, as before
    faults.catch_early_signals()
    faults.release_early_signals()
    assert signal.getsignal(signal.SIGUSR1) is before


# ------------------------------------------------------------------ hgsgc plan under a launcher
@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_plan_under_mpirun_plans_on_rank_0_and_ends(np_, tmp_path):
    """Before: ``mpirun -np 2 hgsgc plan ...`` hung for ever: the other ranks left at once and
    rank 0's ``hvd.init()`` (measuring the compression cost) waited for them on COMM_WORLD; an
    MPI start-up on rank 0 alone hangs the same way. Now every rank starts MPI, the others leave,
    and rank 0 measures with Horovod on itself alone."""
    out = tmp_path / "plan.json"
    p = _hgsgc(["plan", CFG, "model.name=tiny", "--nodes", "4", "--bandwidth", "1gbit", "--compute-ms", "5",
                "--reps", "2", "--json", str(out)], np_, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count(f"hgsgc plan: started as {np_} processes") == 1, p.stderr[-2000:]
    plan = json.load(open(out))
    assert plan and p.stdout.count("hourglass_F1") == 1, p.stdout[-2000:]


# ------------------------------------------------------------------ config bounds and forms
@pytest.mark.parametrize("override,words", [
    ("compression.delay=100000000000000000000", "compression.delay=100000000000000000000 is invalid: must be <= 2147483647"),
    ("train.threads=100000", "train.threads=100000 is invalid: must be <= 4096"),
    ("run.id=../../escape", "run.id='../../escape' is invalid: is the run's folder name under run.out_dir"),
    ("run.id=a/b", "run.id='a/b' is invalid"),
    ("checkpoint.resume=no", "checkpoint.resume='False' is invalid: YAML reads an unquoted no"),
])
def test_values_that_ended_in_c_code_or_elsewhere_are_config_errors(override, words):
    """Before: a 21-digit delay ended in 'OverflowError: Python int too large to convert to C
    long' naming no key; train.threads=100000 aborted inside TensorFlow (exit 134, C stack);
    run.id=../../escape wrote the run outside run.out_dir; checkpoint.resume: no (YAML: false)
    became 'checkpoint False does not exist' at resume. Each is one ConfigError naming the key."""
    from hgsgc.config import ConfigError, load_config

    over = [override] + (["compression.method=sgc"] if "delay" in override else [])
    with pytest.raises(ConfigError) as ei:
        load_config(CFG, over)
    assert words in str(ei.value), str(ei.value)
    assert load_config(CFG, ["run.id=my-run_1", "train.threads=8"]).run.id == "my-run_1"


def test_plan_bandwidth_without_a_unit_is_refused(capsys):
    """Before: ``--bandwidth 10`` was read as 10 bit/s and every method was ranked on a
    '1e-05 Mbit/s' link, exit 0. Now one line asks for a unit (``10bit`` still means bit/s)."""
    from hgsgc.cli import main

    rc = main(["plan", CFG, "model.name=tiny", "--nodes", "4", "--bandwidth", "10", "--compute-ms", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["hgsgc plan: --bandwidth 10 has no unit: write e.g. 10gbit or 10mbit (10bit "
                               "if you mean bit/s)"], err


def test_checkpoint_folder_check_names_the_unwritable_case_apart(tmp_path):
    """An unwritable folder (not a file in the way) keeps the errno message and the fix."""
    from hgsgc import checkpoint as ckpt

    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o500)
    try:
        if os.access(d, os.W_OK):  # root ignores the mode bits: a file in the way instead
            (tmp_path / "f").write_text("x")
            with pytest.raises(ckpt.CheckpointError, match=f"{tmp_path}/f is a file, not a folder"):
                ckpt.check_folder(str(tmp_path / "f" / "a" / "b"))
        else:
            with pytest.raises(ckpt.CheckpointError, match="cannot write into checkpoint.dir .*Fix: point"):
                ckpt.check_folder(str(d / "ck"))
    finally:
        os.chmod(d, 0o700)


def test_report_of_a_run_without_metrics_warns_once(tmp_path, capsys):
    """Before: ``hgsgc report`` on a run folder without ``metrics.jsonl`` printed an empty
    per-epoch table, exit 0, without a word. The table still comes from summary.json; one
    warning line names the missing file."""
    from hgsgc.cli import main
    from test_robustness import _fake_run

    _fake_run(tmp_path / "img", None, [{"test_loss": 0.5, "test_accuracy": 0.875}])
    os.remove(tmp_path / "img" / "metrics.jsonl")
    assert main(["report", str(tmp_path / "img"), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hgsgc: report: warning: {tmp_path / 'img' / 'metrics.jsonl'} not found: {tmp_path / 'img'}'s "
                   f"per-epoch rows and curves are left out"], err
