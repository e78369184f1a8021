"""Multi-rank reliability under mpirun: bit-exact resume, preemption, kill -9, stalls, errors once.

Every run has a timeout, so a hang fails the test instead of stalling CI. The training runs use
the tiny model on 2,000 Fashion-MNIST images with TensorFlow op determinism
(``train.deterministic=true``); "bit-exact" compares every array of every rank's final state
(weights, optimizer slots, residuals, PowerSGD factors, DGC velocity, delay anchors, local step,
exchange counters) byte for byte.
"""
import os
import shutil
import signal
import subprocess
import time

import pytest

from ckpt_compare import compare
from conftest import MPIRUN, PY, ROOT
from hgsgc import checkpoint as ckpt

pytestmark = [pytest.mark.mpi]

BASE = ["configs/fashion_mnist_dense.yaml", "model.name=tiny", "data.train_limit=2000",
        "data.test_limit=200", "train.epochs=2", "train.max_steps_per_epoch=5",
        "train.progress=false", "train.deterministic=true", "checkpoint.keep=20", "train.threads=1"]
METHODS = {
    "sgc_delay4": ["compression.method=sgc", "compression.density=0.05", "compression.delay=4"],
    "dgc": ["compression.method=dgc", "compression.density=0.05"],
    "powersgd": ["compression.method=powersgd", "compression.powersgd_rank=2"],
}
STEPS = 10  # 2 epochs x 5 steps


def _cmd(np_, out, run_id, extra):
    return (MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY,
                      "-m", "hgsgc.cli", "train"] + BASE
            + [f"run.out_dir={out}", f"run.id={run_id}"] + list(extra))


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


def _train(np_, out, run_id, extra, timeout=420):
    p = subprocess.run(_cmd(np_, out, run_id, extra), capture_output=True, text=True,
                       timeout=timeout, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


_UNINTERRUPTED = {}


def uninterrupted(np_, method, tmp_path_factory):
    """One uninterrupted run per (ranks, method), checkpointing every 3 steps (cached)."""
    key = (np_, method)
    if key not in _UNINTERRUPTED:
        out = tmp_path_factory.mktemp(f"a_{method}_{np_}")
        _train(np_, out, "a", METHODS[method] + ["checkpoint.every_steps=3"])
        _UNINTERRUPTED[key] = out / "a" / "checkpoints"
    return _UNINTERRUPTED[key]


def _assert_bit_exact(a_dir, b_dir, min_leaves):
    n, diffs = compare(str(a_dir), str(b_dir))
    assert n >= min_leaves and not diffs, (n, diffs[:10])


# SGC delay 4 with 2 ranks resumes from an arbitrary step in the SIGTERM preemption test below;
# DGC and PowerSGD on one rank count each (session 13: both counts for both cost ~40 s of the suite)
@pytest.mark.slow
@pytest.mark.parametrize("method,np_", [("sgc_delay4", 3), ("dgc", 3), ("powersgd", 2)])
def test_resume_mid_run_is_bit_exact(np_, method, tmp_path_factory):
    """Stop after step 3 (mid-epoch; with delay 4 mid-way between syncs), resume in a new run
    from that checkpoint alone: the final state equals the uninterrupted run's bit for bit."""
    a = uninterrupted(np_, method, tmp_path_factory)
    out = tmp_path_factory.mktemp(f"b_{method}_{np_}")
    os.makedirs(out / "b" / "checkpoints")
    shutil.copytree(a / "step-00000003", out / "b" / "checkpoints" / "step-00000003")
    p = _train(np_, out, "b", METHODS[method])
    assert "resuming from" in p.stdout and "(step 3)" in p.stdout, p.stdout[-2000:]
    final_a, final_b = a / f"step-{STEPS:08d}", out / "b" / "checkpoints" / f"step-{STEPS:08d}"
    # model + Keras optimizer + hgsgc state, every rank: bitwise equal
    _assert_bit_exact(final_a, final_b, min_leaves=np_ * 10)
    man = ckpt.read_manifest(str(final_b))
    s_a = ckpt.load_rank(str(final_a), ckpt.read_manifest(str(final_a)), 0)
    s_b = ckpt.load_rank(str(final_b), man, 0)
    assert [h["test_accuracy"] for h in s_a["loop"]["history"]] == \
           [h["test_accuracy"] for h in s_b["loop"]["history"]]
    hs = s_b["optimizer"]["hgsgc"]
    if method == "sgc_delay4":
        assert "anchors" in hs and len(hs["residuals"]) > 0
    if method == "dgc":
        assert len(hs["velocity"]) > 0 and len(hs["residuals"]) > 0
    if method == "powersgd":
        assert len(hs["powersgd_q"]) > 0
    # the comparison is not vacuous: the state moved between the resume point and the end
    n, diffs = compare(str(a / "step-00000003"), str(final_a))
    assert len(diffs) > np_, diffs


HG_CODECS = {  # (ranks, extra settings): 2 ranks = 1 CONV + 1 FC, 3 ranks = 2 CONV + 1 FC
    # the demo's Hourglass codecs (configs/fashion_mnist_auto.yaml): stochastic rounding both ways, pipelined
    "sparse+q4": (3, ["hourglass.act_codec=sparse+q4", "hourglass.grad_codec=sparse+q4",
                      "hourglass.micro_batches=2"]),
    "q8": (2, ["hourglass.act_codec=q8", "hourglass.grad_codec=q8"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("codec", list(HG_CODECS))
def test_hourglass_resume_is_bit_exact(codec, tmp_path_factory):
    """Hourglass + SGC delay 4 (2 CONV ranks + 1 FC rank, or 1 + 1) with stochastically rounded
    boundary codecs (q8, sparse+q4 both ways): resumed after step 3 in a new run, the
    final state of every rank (CONV trunks, FC head, both roles' optimizers and hgsgc state, the
    codec's random-number generator) equals the uninterrupted run's bit for bit."""
    np_, extra = HG_CODECS[codec]
    args = HOURGLASS[:4] + ["train.epochs=2", "train.max_steps_per_epoch=5", "train.progress=false",
                            "train.threads=1", "hourglass.fc_workers=1", "train.deterministic=true",
                            "checkpoint.keep=20", "compression.delay=4", "compression.density=0.05"]
    env = _env()
    base = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY, "-m",
                     "hgsgc.cli", "train"] + args + extra
    out = tmp_path_factory.mktemp("hg")
    p = subprocess.run(base + [f"run.out_dir={out}", "run.id=a", "checkpoint.every_steps=3"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    a = out / "a" / "checkpoints"
    os.makedirs(out / "b" / "checkpoints")
    shutil.copytree(a / "step-00000003", out / "b" / "checkpoints" / "step-00000003")
    p = subprocess.run(base + [f"run.out_dir={out}", "run.id=b"], capture_output=True, text=True,
                       timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0 and "(step 3)" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    final_a, final_b = a / f"step-{STEPS:08d}", out / "b" / "checkpoints" / f"step-{STEPS:08d}"
    _assert_bit_exact(final_a, final_b, min_leaves=np_ * 8)
    man = ckpt.read_manifest(str(final_a))
    assert man["run"]["roles"] == {"conv": list(range(np_ - 1)), "fc": [np_ - 1]}
    conv = ckpt.load_rank(str(final_a), man, 0)
    assert "anchors" in conv["optimizer"]["hgsgc"]  # the CONV side's delay state is saved
    # every rank's codec generator state is saved, differs per rank, and moved since step 3
    start = ckpt.read_manifest(str(a / "step-00000003"))
    rng = [ckpt.load_rank(str(final_a), man, r)["trainer"]["rng"] for r in range(np_)]
    rng3 = [ckpt.load_rank(str(a / "step-00000003"), start, r)["trainer"]["rng"]
            for r in range(np_)]
    assert all(s["bit_generator"] == "PCG64" for s in rng)
    assert len({s["state"]["state"] for s in rng}) == np_
    moved = [s["state"]["state"] != s3["state"]["state"] for s, s3 in zip(rng, rng3)]
    assert all(moved), moved
    n, diffs = compare(str(a / "step-00000003"), str(final_a))
    assert len(diffs) > np_, diffs


def _rank_pids(mpirun_pid, np_, deadline_s=120):
    """World rank -> pid of the python processes under mpirun (psutil, by OMPI_COMM_WORLD_RANK)."""
    import psutil

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = {}
        for ch in psutil.Process(mpirun_pid).children(recursive=True):
            try:
                r = ch.environ().get("OMPI_COMM_WORLD_RANK")
                if r is not None and "python" in os.path.basename(ch.exe()):
                    out[int(r)] = ch.pid
            except (psutil.Error, ValueError):
                continue
        if len(out) == np_:
            return out
        time.sleep(0.2)
    raise AssertionError("rank processes not found")


def _wait_for(path_or_fn, proc, timeout=300):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (path_or_fn() if callable(path_or_fn) else os.path.exists(path_or_fn)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"job ended early: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {path_or_fn}")


@pytest.mark.slow
@pytest.mark.parametrize("np_,target,sig", [(2, "rank1", signal.SIGTERM), (3, "mpirun", signal.SIGUSR1)])
def test_preemption_signal_checkpoints_exits_75_and_resume_is_bit_exact(np_, target, sig,
                                                                        tmp_path_factory):
    """A signal to one rank (SIGTERM) or to mpirun (SIGUSR1, forwarded to every rank): all ranks
    agree on a step, write its checkpoint and exit 75; running the same command again resumes
    and ends with exactly the uninterrupted run's state."""
    a = uninterrupted(np_, "sgc_delay4", tmp_path_factory)
    out = tmp_path_factory.mktemp(f"sig_{np_}")
    cmd = _cmd(np_, out, "s", METHODS["sgc_delay4"] + ["train.epochs=2", "checkpoint.every_steps=1"])
    # the ranks wait after their first step at a file barrier of np_ + 1 (HGSGC_START_BARRIER;
    # this test is the last to arrive), are signalled there, and go on once the signalled
    # rank(s) announced it: the signal always lands mid-run (signalling after a checkpoint
    # marker raced the end of the ~50 ms run), and in step 1's agreement round, so step 2's
    # checkpoint is the preemption's
    barrier = out / "barrier"
    cmd = cmd[:len(MPIRUN)] + ["-x", "HGSGC_START_BARRIER"] + cmd[len(MPIRUN):]
    env = dict(_env(), HGSGC_START_BARRIER=f"{barrier}:{np_ + 1}:600")
    errf = open(out / "stderr.txt", "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env, cwd=ROOT)
    name = signal.Signals(sig).name
    try:
        pids = _rank_pids(proc.pid, np_)
        _wait_for(lambda: barrier.exists() and len(os.listdir(barrier)) >= np_, proc)
        os.kill(pids[1] if target == "rank1" else proc.pid, sig)
        told = 1 if target == "rank1" else np_
        _wait_for(lambda: (out / "stderr.txt").read_text().count(f": {name} received; every rank") >= told, proc)
        (barrier / "test").touch()
        stdout, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        errf.close()
    stderr = (out / "stderr.txt").read_text()
    assert proc.returncode == 75, stdout[-2000:] + stderr[-3000:]
    line = [ln for ln in stdout.splitlines() if f"{name} received: checkpoint of step" in ln]
    assert len(line) == 1, stdout[-2000:]
    step = int(line[0].split("checkpoint of step ")[1].split()[0])
    assert step == 2, line
    latest = ckpt.latest(str(out / "s" / "checkpoints"))
    assert latest.endswith(f"step-{step:08d}")
    # requeued: the same command again
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=_env(), cwd=ROOT)
    assert p.returncode == 0 and f"(step {step})" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    _assert_bit_exact(a / f"step-{STEPS:08d}", out / "s" / "checkpoints" / f"step-{STEPS:08d}",
                      min_leaves=np_ * 10)


def test_checkpoint_of_other_rank_count_refused_once(tmp_path_factory):
    """Resuming a 2-rank checkpoint with 3 ranks stops every rank with one line naming it."""
    a = uninterrupted(2, "sgc_delay4", tmp_path_factory)
    out = tmp_path_factory.mktemp("mismatch")
    p = subprocess.run(_cmd(3, out, "m", METHODS["sgc_delay4"] + [f"checkpoint.resume={a / 'step-00000003'}"]),
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if "CheckpointMismatch" in ln]
    assert len(lines) == 1, p.stderr[-3000:]
    assert "rank count: checkpoint 2, this run 3" in lines[0], lines


def test_runtime_error_on_every_rank_printed_once(tmp_path):
    p = subprocess.run(_cmd(3, tmp_path, "e", [f"data.path={tmp_path}"]), capture_output=True,
                       text=True, timeout=300, env=_env(), cwd=ROOT)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if "DataError" in ln]
    assert len(lines) == 1 and "hgsgc: error (all 3 ranks): DataError" in lines[0], p.stderr[-3000:]


@pytest.mark.parametrize("np_", [2, 3])
def test_rank_that_stops_issuing_collectives_ends_job_naming_it(np_):
    """faults.stall_timeout_s (Horovod's stall inspector): the job ends, naming the rank; the
    waiting ranks' error is printed once for the job (by the lowest-numbered waiting rank),
    naming the ranks it came from and the rank that reported nothing."""
    from conftest import mpirun

    stalled = np_ - 1
    t0 = time.monotonic()
    p = mpirun(np_, ["tests/mpi/fault_stall.py", str(stalled)], timeout=240,
               env={"STALL_TIMEOUT_S": "6"})
    took = time.monotonic() - t0
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout
    out = p.stdout + p.stderr
    assert f"Missing ranks:\n{stalled}!" in out, out[-3000:]
    assert "is stalled for longer than 6 seconds. Will shutdown." in out, out[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: error")]
    assert len(lines) == 1, p.stderr[-3000:]
    waiting = ",".join(map(str, range(np_ - 1)))
    assert lines[0].startswith(f"hgsgc: error on rank{'s' if np_ > 2 else ''} {waiting}: "), lines
    assert "Horovod has been shut down" in lines[0], lines
    assert f"[no error from rank {stalled}: it stopped issuing collectives" in lines[0], lines
    print(f"stall: job ended {took:.1f} s after start (6 s stall timeout)")


@pytest.mark.parametrize("np_,victim", [(2, 1), (3, 0), (3, 2)])
def test_stall_in_hourglass_boundary_exchange_ends_job_naming_the_peer(np_, victim):
    """A rank that stops before the Hourglass point-to-point exchange (mpi4py Isend/Irecv, not a
    Horovod collective): with faults.stall_timeout_s=6 the rank waiting for it directly (the FC
    rank for a CONV victim; the CONV ranks for the FC victim) raises StallError naming it, the
    job ends non-zero, and the error is printed once. With CONV rank 0 stalled, CONV rank 1 (which
    waits for the FC rank's activation gradients, 1.5 T) never blames the FC rank."""
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/fault_hourglass_stall.py", str(victim)], timeout=240,
               env={"STALL_TIMEOUT_S": "6"})
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"rank {victim} stalls before the boundary exchange of step 3" in p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: error")]
    assert len(lines) == 1, p.stderr[-3000:]
    fc = np_ - 1
    if victim == fc:  # every CONV rank waits for its activation gradients
        convs = list(range(fc))
        who = f"rank{'s' if len(convs) > 1 else ''} {','.join(map(str, convs))}"
        want = (f"hgsgc: error on {who}: StallError: waited 9 s for activation gradients (step 3, "
                f"micro-batch 0); rank {fc} did not answer: it has stopped or is stuck "
                f"(faults.stall_timeout_s=6); ending the job")
    else:  # the FC rank waits for the victim's activations
        want = (f"hgsgc: error on rank {fc}: StallError: waited 6 s for activations (step 3, "
                f"micro-batch 0); rank {victim} did not answer: it has stopped or is stuck "
                f"(faults.stall_timeout_s=6); ending the job")
    assert lines[0] == want, (lines, p.stderr[-3000:])


HOURGLASS = ["configs/fashion_mnist.yaml", "model.name=tiny", "data.train_limit=2000",
             "data.test_limit=200", "train.epochs=50", "train.max_steps_per_epoch=4",
             "train.progress=false", "train.threads=1", "hourglass.fc_workers=1"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,victim", [("data_parallel", 1), ("hourglass", 0),
                                           ("hourglass", 2)])
def test_kill_9_of_any_rank_ends_job_within_60s(layout, victim, tmp_path):
    """SIGKILL of one rank mid-training (Hourglass: rank 0 is a CONV rank, rank 2 the FC rank)
    ends the whole job, non-zero, within 60 s of the kill."""
    np_ = 3
    args = (HOURGLASS if layout == "hourglass"
            else BASE[:4] + ["train.epochs=50", "train.max_steps_per_epoch=4", "train.progress=false",
                             "train.threads=1"] + METHODS["sgc_delay4"])
    cmd = (MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY, "-m",
                     "hgsgc.cli", "train"] + args
           + [f"run.out_dir={tmp_path}", "run.id=k", "checkpoint.at_end=false"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT)
    try:
        pids = _rank_pids(proc.pid, np_)
        metrics = tmp_path / "k" / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc)
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        try:  # a hang fails by this timeout (no wall-clock assertion on a job that ended)
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kill -9 of rank {victim} ({layout}): the job was still running 60 s later "
                        f"(a rank hangs in a collective)", pytrace=False)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-2000:]
    print(f"kill -9 of rank {victim} ({layout}): job ended {took:.1f} s after the kill")
