"""Review of session 8's code (session 9): hgsgc/bench_threads.py, hgsgc/checkpoint.py
(check_folder, resume past a damaged rank file, re-save via hard links), hgsgc/plan.py
(best_fc_workers_fast). Each test failed before its fix. Exact values, no wall clock."""
import json
import os
import subprocess
import sys

import pytest

from hgsgc import bench_threads as bt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PID = 4242


def _write_thread(root, tid, utime, stime, ns):
    d = root / str(PID) / "task" / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    rest = ["S", "1", str(tid), str(tid), "0", "-1", "4194368", "100", "0", "0", "0",
            str(utime), str(stime)] + ["0"] * 39
    (d / "stat").write_text(f"{tid} (python) " + " ".join(rest) + "\n")
    (d / "schedstat").write_text(f"{ns} 0 1\n")
    (d / "wchan").write_text("0")


# ------------------------------------------------------------------ bench_threads without /proc
def test_thread_cpu_without_proc_measures_nothing_and_does_not_raise(tmp_path):
    """``hgsgc train`` calls ThreadGroups.before_init/after_init around hvd.init() and
    StepCPU.start/stop around the timed steps on every platform; without a readable
    /proc/<pid>/task (macOS, a sandbox that hides it) os.listdir raised FileNotFoundError /
    PermissionError and ended the training before its first step. Now nothing is measured
    (no thread_cpu in the summary) and the reason is kept."""
    missing = str(tmp_path / "no_proc")
    g = bt.ThreadGroups(proc=missing, pid=PID)
    g.before_init()
    g.after_init()
    assert g.hvd == [] and g.mpi_before == [] and g.group(PID) == "main"
    sc = bt.StepCPU(g, proc=missing, pid=PID)
    sc.start()
    assert not sc.running
    sc.stop(5)
    sc.start()
    sc.stop(3)
    assert sc.steps == 0 and sc.per_tid == {} and sc.window_s == 0.0
    assert sc.unavailable.startswith(os.path.join(missing, str(PID), "task") + ": ")


def test_thread_cpu_window_whose_end_cannot_be_read_is_dropped(tmp_path):
    """/proc readable when a window starts, gone when it stops: that window is left out (its
    steps too), the windows before it stay, and the next start() does nothing."""
    import shutil

    _write_thread(tmp_path, PID, 0, 0, 1_000)
    g = bt.ThreadGroups(proc=str(tmp_path), pid=PID)
    g.before_init()
    g.after_init()
    sc = bt.StepCPU(g, proc=str(tmp_path), pid=PID)
    sc.start()
    _write_thread(tmp_path, PID, 2, 1, 9_001_000)
    sc.stop(3)
    sc.start()
    shutil.rmtree(tmp_path / str(PID))
    sc.stop(4)
    assert sc.steps == 3 and sc.per_tid[PID]["ns"] == 9_000_000 and not sc.running
    assert sc.unavailable is not None
    sc.start()
    assert not sc.running
    assert sc.result(tick_s=0.01)["groups"]["main"]["cpu_s_per_step"] == pytest.approx(0.003, abs=1e-15)


def test_train_runs_without_proc(tmp_path):
    """One process, /proc/<pid>/task made unreadable for hgsgc.bench_threads: the training ends
    normally and its summary has no thread_cpu (it ended with FileNotFoundError before)."""
    code = ("import sys; from hgsgc import bench_threads as bt\n"
            "bt.task_dir = lambda proc='/proc', pid=None: '/nonexistent/proc/task'\n"
            "from hgsgc.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    args = ["train", "configs/fashion_mnist_dense.yaml", "model.name=tiny", "data.train_limit=500",
            "data.test_limit=100", "train.epochs=1", "train.max_steps_per_epoch=3", "train.progress=false",
            "train.threads=1", "checkpoint.at_end=false", f"run.out_dir={tmp_path}", "run.id=p"]
    p = subprocess.run([sys.executable, "-c", code] + args, capture_output=True, text=True, timeout=240,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.load(open(tmp_path / "p" / "summary.json"))
    assert "thread_cpu" not in s and s["steps"] == 3


# ------------------------------------------------------------------ checkpoint re-save without a spare
def test_re_save_whose_spare_cannot_be_made_keeps_the_steps_checkpoint(tmp_path, monkeypatch):
    """Re-saving a step (the end-of-run checkpoint after a periodic one of the same step): when
    the complete copy under the second name (hard links, copies where there are none) could not
    be made, save() went on as before session 8: it removed the step's manifest first, so a full
    disk (the re-save failing) or a kill left no complete checkpoint with checkpoint.keep=1,
    while the error said 'the previous checkpoint <that step> is intact'. Now the re-save stops
    before touching it, on every rank, naming the folder and the fix; the checkpoint stays."""
    import errno

    import numpy as np

    from hgsgc import checkpoint as ckpt

    run = {"world_size": 1, "model": "tiny"}
    d = str(tmp_path)
    ckpt.save(d, 3, {"w": np.full(4, 3.0)}, run, keep=1)
    first = ckpt.save(d, 5, {"w": np.full(4, 5.0)}, run, keep=1)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_links(*a, **k):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))  # a file system without hard links

    monkeypatch.setattr(ckpt.os, "link", no_links)
    monkeypatch.setattr(ckpt.shutil, "copy2", no_space)
    monkeypatch.setattr(ckpt, "atomic_write", no_space)  # the disk is full
    spare = os.path.join(d, "step-000000005")
    with pytest.raises(ckpt.CheckpointError, match=f"cannot keep a complete copy of {first} under {spare} "
                                                   f"while re-saving it: No space left on device "
                                                   f"\\(errno 28\\); the previous checkpoint {first} is "
                                                   f"intact. Fix: .*free disk space") as ei:
        ckpt.save(d, 5, {"w": np.full(4, 6.0)}, run, keep=1)
    assert ei.value.all_ranks
    monkeypatch.undo()
    assert ckpt.latest(d) == first and not os.path.exists(spare)
    assert ckpt.load_rank(first, ckpt.read_manifest(first), 0)["w"][0] == 5.0


# ------------------------------------------------------------------ temp files of a killed write
def test_step_folder_left_by_a_killed_write_keeps_no_temp_file_when_saved_again(tmp_path):
    """A writer killed inside atomic_write (SIGKILL after the scheduler's grace period, the OOM
    killer) leaves '.rank-RRRRR.npz.tmp-<pid>', a whole rank file, in a step folder without a
    manifest; resume: auto takes the checkpoint before it, and when the run saves that step again
    the folder was completed around the stale files: the finished checkpoint kept a rank file's
    size of garbage per rank (until pruned; never for the last one). Now an incomplete step
    folder is emptied before the step is written again."""
    import numpy as np

    from hgsgc import checkpoint as ckpt

    run = {"world_size": 1, "model": "tiny"}
    d = str(tmp_path)
    ckpt.save(d, 2, {"w": np.full(4, 2.0)}, run, keep=2)
    left = os.path.join(d, "step-00000004")
    os.makedirs(left)
    with open(os.path.join(left, ".rank-00000.npz.tmp-99999"), "wb") as f:
        f.write(b"\0" * 4096)  # the killed writer's half-written rank file
    with open(os.path.join(left, "rank-00000.npz"), "wb") as f:
        f.write(b"\1" * 10)  # and an old rank file of that write
    assert ckpt.latest(d).endswith("step-00000002")
    path = ckpt.save(d, 4, {"w": np.full(4, 4.0)}, run, keep=2)
    assert path == left and sorted(os.listdir(left)) == ["manifest.json", "rank-00000.npz"]
    assert ckpt.load_rank(left, ckpt.verify(left, hashes=True), 0)["w"][0] == 4.0
