"""Robustness (session 8): bad input as a Horovod / Slurm user gives it (configs, data files,
checkpoint folders and manifests). Each error is one line naming the thing and the fix, raised
before training, on every rank alike; mpirun tests have a timeout so a hang fails them. Exact
values, no wall clock."""
import gzip
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import MPIRUN, PY, ROOT

TINY = ["model.name=tiny", "data.train_limit=500", "data.test_limit=100", "train.epochs=1",
        "train.max_steps_per_epoch=2", "train.progress=false", "train.threads=1"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


def _hgsgc(args, np_=None, timeout=240, cwd=ROOT):
    cmd = [PY, "-m", "hgsgc.cli"] + list(args)
    if np_:
        cmd = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL"] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)


def _error_lines(p):
    return [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: ")]


# ------------------------------------------------------------------ configs
@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999"])
def test_run_seed_out_of_range_is_a_config_error(seed):
    """run.seed=-1 (or >= 2**32) loaded, then every rank died in TensorFlow's set_random_seed
    with 'ValueError: Seed must be between 0 and 2**32 - 1', naming no key."""
    from hgsgc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"run.seed=\S+ is invalid: must be an integer in 0..4294967295"):
        load_config("configs/fashion_mnist.yaml", [f"run.seed={seed}"])
    assert load_config("configs/fashion_mnist.yaml", ["run.seed=4294967295"]).run.seed == 2 ** 32 - 1


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_empty_config_file_is_a_config_error(tmp_path, text):
    """An empty config file (a truncated copy) trained the built-in defaults without a word
    (the full Fashion-MNIST main job, 2 epochs)."""
    from hgsgc.config import ConfigError, load_config

    f = tmp_path / "empty.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"config file {f} is empty"):
        load_config(str(f), ["train.epochs=1"])
    p = _hgsgc(["train", str(f)], timeout=120)
    assert p.returncode == 2 and _error_lines(p) == [f"hgsgc: config error: config file {f} is empty "
                                                     f"(no settings): a truncated copy? Re-copy it, or "
                                                     f"give a config from configs/*.yaml"], p.stderr[-2000:]


# ------------------------------------------------------------------ data readers
def test_damaged_gzip_idx_is_a_data_error_naming_the_file(tmp_path):
    """A .gz IDX file whose deflate stream is damaged escaped read_idx as zlib.error ('Error -3
    while decompressing data: invalid block type'), naming no file."""
    from hgsgc.data import DataError, read_idx

    a = np.arange(50 * 28 * 28, dtype=np.uint32).astype(np.uint8).reshape(50, 28, 28)
    raw = bytes([0, 0, 8, 3]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()
    z = bytearray(gzip.compress(raw, mtime=0))
    z[10] ^= 0xFF  # first byte of the deflate stream: not a valid block
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(bytes(z))
    with pytest.raises(DataError, match=f"{f}: cannot read IDX data \\(Error -3 while decompressing data"):
        read_idx(str(f))


def _ptb_folder(tmp_path):
    from hgsgc.data.ptb import write_ptb

    words = [f"w{i % 37}" for i in range(3000)]
    lines = [" ".join(words[i:i + 10]) for i in range(0, len(words), 10)]
    write_ptb(str(tmp_path), {"train": lines, "valid": lines[:30], "test": lines[:30]})
    return str(tmp_path)


def test_ptb_eval_split_too_short_is_found_before_training(tmp_path):
    """valid/test too short for one evaluation batch per rank (a small data.test_limit, or many
    ranks: real PTB's 73,760 valid tokens over 128 ranks x 20 rows x 35 steps) trained the whole
    first epoch, then every rank failed in the evaluation ('lower train.batch_size', which is not
    the evaluation batch). LanguageModelTask.check_eval finds it from the token counts."""
    from hgsgc.config import load_config
    from hgsgc.data import DataError
    from hgsgc.tasks import make_task

    path = _ptb_folder(tmp_path)
    base = ["data.format=ptb", f"data.path={path}", "model.name=lstm_small", "train.batch_size=4",
            "data.bptt=5", "train.lr_decay_epochs=[]"]
    task = make_task(load_config("configs/ptb_lstm/dense.yaml", base))
    task.check_eval(4)  # 330 valid tokens / 4 = 82 per rank = 4 rows of 20 >= 5 + 1: fine
    assert task.data.rows("valid", 0, 4, 4, 5)[1] == 3  # the evaluation agrees: batches at 4 ranks
    with pytest.raises(DataError, match=r"ptb.valid.txt: 330 tokens over 16 ranks are 20 per rank, too few "
                                        r"for one evaluation batch of 4 rows x 6 tokens: lower "
                                        r"train.eval_batch_size \(default train.batch_size\) or data.bptt, "
                                        r"or use fewer ranks"):
        task.check_eval(16)
    with pytest.raises(DataError):  # ... and none at 16
        task.data.rows("valid", 0, 16, 4, 5)
    t2 = make_task(load_config("configs/ptb_lstm/dense.yaml", base + ["data.test_limit=40",
                                                                        "train.eval_batch_size=2"]))
    with pytest.raises(DataError, match=r"ptb.valid.txt: 40 tokens \(data.test_limit\) over 4 ranks.*"
                                        r"lower train.eval_batch_size or data.bptt, raise data.test_limit"):
        t2.check_eval(4)


@pytest.mark.mpi
def test_ptb_eval_split_too_short_ends_job_before_the_first_step(tmp_path):
    """2 ranks: one line for the job, and no rank trained a step (no epoch line, no checkpoint)."""
    path = _ptb_folder(tmp_path / "ptb")
    p = _hgsgc(["train", "configs/ptb_lstm/dense.yaml", f"data.path={path}", "train.batch_size=4",
                "data.bptt=5", "data.test_limit=20", "train.epochs=1", "train.progress=false",
                "train.threads=1", f"run.out_dir={tmp_path}", "run.id=r"], np_=2)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    lines = _error_lines(p)
    assert len(lines) == 1 and lines[0].startswith("hgsgc: error (all 2 ranks): DataError: ") \
        and "ptb.valid.txt: 20 tokens (data.test_limit) over 2 ranks" in lines[0], p.stderr[-2000:]
    assert "epoch 1/" not in p.stdout and not (tmp_path / "r" / "checkpoints").exists()


# ------------------------------------------------------------------ checkpoints
def _ckpt(d, step=3):
    from hgsgc import checkpoint as ckpt

    return ckpt.save(str(d), step, {"w": np.arange(3.0)}, {"world_size": 1, "model": "tiny"})


@pytest.mark.parametrize("edit,why", [
    (lambda m: m.pop("files"), "'files' is not a non-empty mapping"),
    (lambda m: m.update(files=[]), "'files' is not a non-empty mapping"),
    (lambda m: m["files"]["rank-00000.npz"].pop("sha256"), "'files' entry 'rank-00000.npz' lacks"),
    (lambda m: m.update(world_size="2"), "'step' or 'world_size' is not a count"),
    (lambda m: m.update(run=[1]), "'run' is not a mapping"),
])
def test_damaged_manifest_is_skipped_by_auto_and_named_when_explicit(tmp_path, edit, why):
    """A manifest with hgsgc's format tag but a missing or mistyped field (hand-edited, or
    another tool's) made resolve() raise KeyError / AttributeError on rank 0 alone ('hgsgc:
    error on rank 0: KeyError: 'files'', the job aborted): resume=auto now skips it like an
    incomplete checkpoint and resumes the previous one; an explicit path names the manifest."""
    from hgsgc import checkpoint as ckpt

    run = {"world_size": 1, "model": "tiny"}
    good = _ckpt(tmp_path, 3)
    bad = _ckpt(tmp_path, 5)
    mpath = os.path.join(bad, "manifest.json")
    man = json.load(open(mpath))
    edit(man)
    with open(mpath, "w") as f:
        json.dump(man, f)
    assert ckpt.latest(str(tmp_path)) == good
    assert ckpt.resolve(str(tmp_path), "auto", run)[0] == good
    with pytest.raises(ckpt.CheckpointError, match=f"{mpath} is damaged \\({why}.*remove the folder {bad}"):
        ckpt.resolve(str(tmp_path), bad, run)


def test_checkpoint_folder_is_checked_before_training(tmp_path):
    """checkpoint.dir pointing at a file (or an unwritable folder) failed only at the first
    checkpoint, by default the one after the last step: the whole run trained, then ended with
    a CheckpointError and no summary.json. check_folder (Checkpointer.resume, before the first
    step) names it; a good folder keeps no probe file, and one it created is removed again."""
    from hgsgc import checkpoint as ckpt

    f = tmp_path / "afile"
    f.write_text("x")
    # session 19: a file in the way is named (run.out_dir given a file named the derived folder only)
    with pytest.raises(ckpt.CheckpointError, match=f"cannot create checkpoint.dir {f}/ck: {f} is a file, not a "
                                                   f"folder .*check run.out_dir and checkpoint.dir") as ei:
        ckpt.check_folder(str(f / "ck"))
    assert ei.value.all_ranks
    ckpt.check_folder(str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    good = _ckpt(tmp_path / "old")
    ckpt.check_folder(str(tmp_path / "old"))
    assert sorted(os.listdir(tmp_path / "old")) == [os.path.basename(good)]

    p = _hgsgc(["train", "configs/fashion_mnist_dense.yaml"] + TINY
               + [f"run.out_dir={tmp_path}", "run.id=r", f"checkpoint.dir={f}"], timeout=180)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    lines = _error_lines(p)
    assert len(lines) == 1 and f"CheckpointError: checking the checkpoint folder failed on rank 0: " \
                               f"cannot create checkpoint.dir {f}: {f} is a file" in lines[0], p.stderr[-2000:]
    assert "epoch 1/" not in p.stdout


@pytest.mark.mpi
def test_checkpoint_folder_not_shared_by_the_ranks_ends_job_before_training(tmp_path):
    """A relative (or node-local, e.g. /tmp on each host) checkpoint.dir: each rank wrote into its
    own folder; the first save failed on rank 1 (its step folder missing) after the run had
    trained, and where the folder existed everywhere the checkpoints were written but rank 0
    never saw the other ranks' files, so resume: auto skipped them and started afresh. Two ranks
    started from different working directories (mpirun's MPMD form) stand in for two hosts."""
    a, b = tmp_path / "host_a", tmp_path / "host_b"
    for d in (a, b):
        (d / "ck").mkdir(parents=True)  # the node-local folder exists on both "hosts"
    args = ([PY, "-m", "hgsgc.cli", "train", os.path.join(ROOT, "configs/fashion_mnist_dense.yaml")] + TINY
            + [f"run.out_dir={tmp_path}/runs", "run.id=r", "checkpoint.dir=ck"])
    cmd = (MPIRUN + ["-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-np", "1", "--wdir", str(a)] + args
           + [":", "-np", "1", "--wdir", str(b)] + args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    lines = _error_lines(p)
    assert len(lines) == 1 and "CheckpointError: checking the checkpoint folder failed on rank 1: " \
                               "checkpoint.dir ck is not the folder rank 0 writes into" in lines[0], p.stderr[-2000:]
    assert "epoch 1/" not in p.stdout
    assert os.listdir(a / "ck") == [] and os.listdir(b / "ck") == []  # no probe left behind


# ------------------------------------------------------------------ preemption
def test_signal_before_the_agreement_exists_is_taken_by_the_first_agreement():
    """One process: a signal recorded by catch_early_signals reaches the first StepAgreement
    (once); release_early_signals restores the handlers that were there before."""
    import signal

    from hgsgc.faults import StepAgreement, catch_early_signals, release_early_signals

    before = signal.getsignal(signal.SIGUSR1)
    catch_early_signals()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        a = StepAgreement(None)
        assert a.after_step() == ("SIGUSR1", False)
        a.close()
        assert StepAgreement(None, install=True).after_step() == (None, False)  # taken once
    finally:
        release_early_signals()
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.mpi
@pytest.mark.parametrize("np_,target,sig", [(2, 0, "SIGUSR1"), (3, 2, "SIGTERM")])
def test_signal_during_start_up_checkpoints_after_the_first_step_and_exits_75(tmp_path, np_, target, sig):
    """SIGUSR1 / SIGTERM before the runner installed its handlers (imports, config, data check,
    layout measurement: minutes for a large JPEG tree) killed the rank by the signal: mpirun
    exited 138 / 143, which scripts/slurm/launch.sh does not requeue. hgsgc train now records
    such a signal from its first line; the first step's agreement carries it (its result is read
    one step later, as for any signal): every rank writes the checkpoint of step 2 and exits 75;
    the same command again resumes from it."""
    from hgsgc import checkpoint as ckpt

    args = (["configs/fashion_mnist_dense.yaml"] + TINY
            + ["train.max_steps_per_epoch=3", f"run.out_dir={tmp_path}", "run.id=s"])
    cmd = (MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY,
                     "tests/mpi/signal_during_startup.py", str(target), sig] + args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT)
    assert p.returncode == 75, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"hgsgc: {sig} received: checkpoint of step 2 written to" in p.stdout, p.stdout[-2000:]
    assert ckpt.latest(str(tmp_path / "s" / "checkpoints")).endswith("step-00000002")
    q = _hgsgc(["train"] + args, np_=np_)
    assert q.returncode == 0 and "(step 2)" in q.stdout and "epoch 1/1" in q.stdout, q.stdout[-2000:] + q.stderr[-2000:]


# ------------------------------------------------------------------ damaged newest checkpoint
def _flip_byte(fp):
    data = bytearray(open(fp, "rb").read())
    data[-40] ^= 0xFF  # same size: only the SHA-256 on load sees it
    open(fp, "wb").write(bytes(data))


def test_auto_resume_skips_a_checkpoint_whose_file_fails_sha256(tmp_path):
    """A complete checkpoint whose rank file was damaged in place (same size; bit rot, a copy
    gone wrong) stopped every resume with 'fails its SHA-256 check (damaged)' and no fix:
    resume: auto left the requeued job failing until someone deleted the folder by hand, though
    the previous complete checkpoint was on disk. resume: auto now says so and resumes the
    previous one; an explicit checkpoint.resume path still stops, naming the fix."""
    from hgsgc import checkpoint as ckpt
    from hgsgc.config import CheckpointConfig

    run = {"world_size": 1, "model": "tiny"}
    d = tmp_path / "ck"
    for step in (2, 4, 6):
        ckpt.save(str(d), step, {"w": np.full(64, float(step))}, run, keep=3)
    _flip_byte(d / "step-00000006" / "rank-00000.npz")
    _flip_byte(d / "step-00000004" / "rank-00000.npz")
    lines = []
    c = ckpt.Checkpointer(CheckpointConfig(dir=str(d)), str(tmp_path), run, None, lines.append)
    try:
        state = c.resume()
    finally:
        c.close()
    assert state["w"][0] == 2.0
    assert lines == [f"hgsgc: checkpoint {d}/step-00000006 is damaged (rank-00000.npz fails its SHA-256 "
                     f"check on rank 0): resuming from an older one",
                     f"hgsgc: checkpoint {d}/step-00000004 is damaged (rank-00000.npz fails its SHA-256 "
                     f"check on rank 0): resuming from an older one",
                     f"hgsgc: resuming from {d}/step-00000002 (step 2)"]
    _flip_byte(d / "step-00000002" / "rank-00000.npz")
    for resume in ("auto", str(d / "step-00000002")):
        c = ckpt.Checkpointer(CheckpointConfig(dir=str(d), resume=resume), str(tmp_path), run, None, lambda s: None)
        try:
            with pytest.raises(ckpt.CheckpointError, match=r"rank-00000.npz fails its SHA-256 check \(damaged\).* "
                                                           r"Fix: delete the folder .*step-00000002.*checkpoint.resume=never"):
                c.resume()
        finally:
            c.close()


@pytest.mark.mpi
def test_auto_resume_past_a_damaged_rank_file_on_3_ranks(tmp_path):
    """3 ranks: rank 2's file of the newest checkpoint damaged; the requeued command resumes
    from the checkpoint before it on every rank and finishes."""
    args = (["train", "configs/fashion_mnist_dense.yaml"] + TINY
            + ["train.max_steps_per_epoch=3", "checkpoint.every_steps=1", f"run.out_dir={tmp_path}", "run.id=d"])
    p = _hgsgc(args, np_=3)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = tmp_path / "d" / "checkpoints"
    assert sorted(os.listdir(d)) == ["step-00000002", "step-00000003"]
    _flip_byte(d / "step-00000003" / "rank-00002.npz")
    q = _hgsgc(args[:-1] + ["train.epochs=2", "run.id=d"], np_=3)
    assert q.returncode == 0, q.stdout[-2000:] + q.stderr[-2000:]
    assert (f"hgsgc: checkpoint {d}/step-00000003 is damaged (rank-00002.npz fails its SHA-256 check on "
            f"rank 2): resuming from an older one") in q.stdout
    assert f"hgsgc: resuming from {d}/step-00000002 (step 2)" in q.stdout and "epoch 2/2" in q.stdout


# ------------------------------------------------------------------ resume with another data order
def test_resume_with_another_data_order_is_refused_naming_it(tmp_path):
    """A checkpoint's global step is a position in the data order, a pure function of (run.seed,
    train.batch_size, steps per epoch). A requeued job whose config was edited meanwhile (another
    batch size, seed, data.train_limit or max_steps_per_epoch) resumed at that step of a different
    order without a word (compression and rank-count changes were refused). The runners' identity
    carries data_order now; checkpoints written before it still resume."""
    from hgsgc import checkpoint as ckpt

    base = {"world_size": 2, "model": "tiny", "data_order": {"seed": 42, "batch_size": 32, "steps_per_epoch": 7}}
    d = str(tmp_path)
    ckpt.save(d, 5, {"w": np.zeros(3)}, base)
    changed = dict(base, data_order={"seed": 42, "batch_size": 64, "steps_per_epoch": 3})
    with pytest.raises(ckpt.CheckpointMismatch, match=r'data order \(run.seed, train.batch_size, steps per epoch\): '
                                                      r'checkpoint .*"batch_size": 32.*this run .*"batch_size": 64'):
        ckpt.resolve(d, "auto", changed)
    assert ckpt.resolve(d, "auto", base)[0] == ckpt.step_dir(d, 5)
    old = {k: v for k, v in base.items() if k != "data_order"}
    ckpt.save(str(tmp_path / "old"), 3, {"w": np.zeros(3)}, old)  # before session 8
    assert ckpt.resolve(str(tmp_path / "old"), "auto", changed)[0] == ckpt.step_dir(str(tmp_path / "old"), 3)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["data_parallel", "hourglass"])
def test_requeued_run_with_another_batch_size_is_refused_on_2_ranks(tmp_path, layout):
    args = (["train", "configs/fashion_mnist.yaml", f"layout={layout}", "hourglass.fc_workers=1"] + TINY
            + [f"run.out_dir={tmp_path}", "run.id=o"])
    p = _hgsgc(args, np_=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    q = _hgsgc(args + ["train.batch_size=16"], np_=2)
    assert q.returncode == 1, q.stdout[-2000:] + q.stderr[-2000:]
    lines = _error_lines(q)
    assert len(lines) == 1 and "CheckpointMismatch" in lines[0] and '"batch_size": 32' in lines[0] \
        and '"batch_size": 16' in lines[0], q.stderr[-2000:]


# ------------------------------------------------------------------ hgsgc report
def _fake_run(d, summary=None):
    d.mkdir(parents=True)
    s = {"run_id": "x", "layout": "data_parallel", "compression": {"method": "none"}, "world_size": 2,
         "final_test_accuracy": 0.5, "final_test_loss": 1.0, "mean_step_time_s": 0.01,
         "bytes_sent_per_step_per_rank": 1e3, "dense_bytes_per_step_per_rank": 2e3, "compression_ratio": 1.0,
         "wall_time_s": 3.0}
    (d / "summary.json").write_text(json.dumps(summary if summary is not None else s))
    (d / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_loss": 1.2, "test_loss": 1.0,
                                                 "test_accuracy": 0.5, "epoch_time_s": 2.0}) + "\n")
    return d


@pytest.mark.parametrize("summary,metrics_line,needle", [
    ([], None, "summary.json: not an hgsgc run summary (a JSON list, expected an object)"),
    ({"world_size": 2}, None, "summary.json: not an hgsgc run summary (no 'mean_step_time_s')"),
    (None, "3", "metrics.jsonl, line 2: not an hgsgc metrics record (a JSON int, expected an object)"),
    (None, '{"epoch": "x", "test_accuracy": "a"}', "metrics.jsonl, line 2: 'epoch' is 'x', not a number"),
])
def test_report_of_a_foreign_run_directory_is_one_line(tmp_path, summary, metrics_line, needle):
    """A summary.json that is JSON but not a run summary (another tool's, a hand-edited one), or
    a metrics.jsonl line that is not a record, gave a traceback (AttributeError, KeyError) or a
    bare 'Unknown format code' naming no file."""
    run = _fake_run(tmp_path / "run", summary)
    if metrics_line is not None:
        with open(run / "metrics.jsonl", "a") as f:
            f.write(metrics_line + "\n")
    p = _hgsgc(["report", str(run)], timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines() == [f"hgsgc: report: {run}/{needle}"], p.stderr[-2000:]


def test_report_out_that_is_a_file_is_one_line(tmp_path):
    """--out naming an existing file: FileExistsError traceback."""
    run = _fake_run(tmp_path / "run")
    f = tmp_path / "afile"
    f.write_text("keep me")
    p = _hgsgc(["report", str(run), "--out", str(f)], timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        f"hgsgc: report: cannot write the report into --out {f}: File exists (errno 17): give --out a writable folder"], p.stderr
    assert f.read_text() == "keep me"
    out = tmp_path / "ünï cödé"  # a non-ASCII folder is fine
    assert _hgsgc(["report", str(run), "--out", str(out)], timeout=120).returncode == 0
    assert sorted(os.listdir(out)) == ["accuracy.png", "loss.png", "report.md"]


# ------------------------------------------------------------------ ImageNet TFRecord contents
def _records(path, examples):
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as w:
        for feats in examples:
            f = {k: (tf.train.Feature(bytes_list=tf.train.BytesList(value=[v])) if isinstance(v, bytes)
                     else tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))) for k, v in feats.items()}
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())


def _jpeg():
    import tensorflow as tf

    return tf.io.encode_jpeg(np.full((8, 8, 3), 100, np.uint8)).numpy()


@pytest.mark.parametrize("examples,needle", [
    # TensorFlow Datasets' keys, not the Inception build script's
    (lambda j: [{"image": j, "label": 3}], "record 0 has no 'image/encoded' (bytes) feature"),
    (lambda j: [{"image/encoded": j, "image/class/label": 0}],
     "record 0 has label 0, outside 1..5 (labels are 1-based by the Inception build scripts"),
    (lambda j: [{"image/encoded": j, "image/class/label": 6}], "record 0 has label 6, outside 1..5"),
    (lambda j: [{"image/encoded": b"\x89PNG\r\n" + j, "image/class/label": 2}],
     "record 0's image/encoded is not a JPEG (starts with 89504e47, expected ffd8)"),
])
def test_imagenet_tfrecord_of_another_layout_is_a_data_error_before_training(tmp_path, examples, needle):
    """Shards whose records are not Inception-style ImageNet examples (TFDS keys, 0-based labels,
    PNG bytes) passed the framing check and failed in tf.data at the first batch of every rank
    reading them (InvalidArgumentError: 'Feature: image/encoded ... is required but could not be
    found', naming no file), or trained on label -1. The first record of every shard is parsed
    when the loader is built."""
    from hgsgc.data import DataError
    from hgsgc.data.imagenet import ImageNetTFRecord, write_tfrecords

    good = tmp_path / "train-00000-of-00002"
    write_tfrecords([str(good)], [_jpeg()] * 2, [1, 5])
    bad = tmp_path / "train-00001-of-00002"
    _records(bad, examples(_jpeg()))
    with pytest.raises(DataError, match=f"{bad}: {needle}".replace("(", r"\(").replace(")", r"\)")):
        ImageNetTFRecord(str(tmp_path), "train", image_size=8, num_classes=5)
    bad.unlink()
    assert ImageNetTFRecord(str(tmp_path), "train", image_size=8, num_classes=5).n == 2


# ------------------------------------------------------------------ node-local data copies that differ
def _small_fashion_copy(dst, n_train=1000):
    from hgsgc.data import FILES, read_idx

    src = "/usr/share/datasets/fashion-mnist"
    dst.mkdir(parents=True)
    for key, stem in FILES.items():
        p = os.path.join(src, stem + ".gz")
        a = read_idx(p if os.path.exists(p) else os.path.join(src, stem))
        if key.startswith("train"):
            a = a[:n_train]
        head = bytes([0, 0, 8, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
        (dst / stem).write_bytes(head + a.tobytes())
    return str(dst)


@pytest.mark.mpi
@pytest.mark.parametrize("np_,odd,layout", [(2, 1, "data_parallel"), (3, 0, "hourglass")])
def test_data_copies_that_differ_between_nodes_end_the_job_before_training(tmp_path, np_, odd, layout):
    """data.path may differ between ranks (node-local copies, hgsgc.cli.NODE_LOCAL_KEYS). A copy
    with fewer training images on one node gave that rank fewer steps per epoch: it went on to
    the evaluation's allreduce while the others were still training, and the job hung in Horovod
    ('Missing ranks: 0: [HorovodAllreduce]') until killed (checked: 150 s timeout, 2 ranks). The
    ranks now compare their data's size before the first collective that depends on it."""
    small = _small_fashion_copy(tmp_path / "small")
    base = ([PY, "-m", "hgsgc.cli", "train", "configs/fashion_mnist.yaml", f"layout={layout}",
             "hourglass.fc_workers=1", "model.name=tiny", "train.epochs=1", "train.progress=false",
             "train.threads=1", "data.test_limit=200", f"run.out_dir={tmp_path}", "run.id=x"])
    cmd = MPIRUN + ["-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL"]
    for r in range(np_):
        cmd += (["-np", "1"] + base + ([f"data.path={small}"] if r == odd else [])
                + ([":"] if r < np_ - 1 else []))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-3000:]
    lines = _error_lines(p)
    others = ",".join(str(r) for r in range(np_) if r != odd)
    assert len(lines) == 1 and f"hgsgc: error (all {np_} ranks): DataError: the training data differs " \
                               f"between ranks (60,000 training examples, 10 classes on rank{'s' if np_ > 2 else ''} " \
                               f"{others} (/usr/share/datasets/fashion-mnist); 1,000 training examples, 10 " \
                               f"classes on rank {odd} ({small}))" in lines[0], p.stderr[-3000:]
    assert "epoch 1/" not in p.stdout


# ------------------------------------------------------------------ checkpoint.resume pointing at the wrong thing
def test_resume_from_the_checkpoints_folder_or_a_file_says_what_to_give(tmp_path):
    """checkpoint.resume=<the checkpoint.dir itself> said '... has no manifest.json: the checkpoint
    is incomplete (its writer stopped half-way)', and =<a rank file> said it 'does not exist':
    both sent the user looking for a damaged checkpoint."""
    from hgsgc import checkpoint as ckpt

    run = {"world_size": 1, "model": "tiny"}
    d = tmp_path / "ck"
    for step in (2, 4):
        path = _ckpt(d, step)
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint.resume={d} is the checkpoint folder, not one "
                                                   f"checkpoint: give one of its step folders \\(the newest "
                                                   f"complete one is {path}\\), or checkpoint.dir={d} with "
                                                   f"checkpoint.resume=auto"):
        ckpt.resolve(str(tmp_path / "elsewhere"), str(d), run)
    f = os.path.join(path, "rank-00000.npz")
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint.resume={f} is a file: give the checkpoint's "
                                                   f"folder \\({path}\\)"):
        ckpt.resolve(str(d), f, run)
    (tmp_path / "empty").mkdir()  # a folder with neither: as before
    with pytest.raises(ckpt.CheckpointError, match="has no manifest.json: the checkpoint is incomplete"):
        ckpt.resolve(str(d), str(tmp_path / "empty"), run)


def test_fashion_mnist_images_of_another_size_are_a_data_error(tmp_path):
    """IDX files of another image size (an MNIST-style 32x32 or 20x20 set put at data.path) loaded
    and failed at the first step of every rank in the model's input layer, naming no file."""
    from hgsgc.data import FILES, DataError, load_fashion_mnist

    for key, stem in FILES.items():
        n = 20
        a = np.zeros((n, 32, 32) if key.endswith("images") else (n,), np.uint8)
        head = bytes([0, 0, 8, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
        (tmp_path / stem).write_bytes(head + a.tobytes())
    with pytest.raises(DataError, match=f"{tmp_path}/train-images-idx3-ubyte: images are 32x32, Fashion-MNIST's are 28x28"):
        load_fashion_mnist(str(tmp_path))


# ------------------------------------------------------------------ layout: auto and a requeued job
@pytest.mark.mpi
def test_requeued_layout_auto_job_resumes_the_layout_of_its_checkpoint(tmp_path):
    """layout: auto measured and chose again when a preempted job was requeued; the choice is
    noisy (docs/hourglass.md: identical jobs 1.26-1.68x apart), and any other choice than the
    checkpoint's (data parallel vs Hourglass, or another fc_workers) was refused as 'written by a
    different run': the requeued job failed. auto now takes the layout of the checkpoint the
    runner will resume, without measuring. Here the checkpoint holds Hourglass with 2 FC ranks of
    4 (half the ranks on a 97 % conv tiny model: auto does not choose it here)."""
    base = (["train", "configs/fashion_mnist.yaml"] + TINY
            + [f"run.out_dir={tmp_path}", "run.id=q", "hourglass.link_bandwidth_mbps=1000"])
    p = _hgsgc(base + ["layout=hourglass", "hourglass.fc_workers=2"], np_=4)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    q = _hgsgc(base + ["layout=auto", "train.epochs=2"], np_=4, timeout=400)
    assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    ck = tmp_path / "q" / "checkpoints" / "step-00000002"
    assert (f"layout auto -> hourglass with 2 FC ranks (the layout of the checkpoint being resumed, {ck})"
            in q.stdout), q.stdout[-3000:]
    assert f"hgsgc: resuming from {ck} (step 2)" in q.stdout and "epoch 2/2" in q.stdout
    summary = json.load(open(tmp_path / "q" / "summary.json"))
    assert summary["layout_setting"] == "auto" and summary["layout_choice"]["fc_workers"] == 2


# ------------------------------------------------------------------ re-saving a step with keep=1
def test_killed_while_re_saving_a_step_keeps_that_steps_previous_checkpoint(tmp_path, monkeypatch):
    """The end-of-run checkpoint re-saves the step of a periodic checkpoint (every_steps dividing
    the run). The re-save removed the step's manifest first, so a kill before the new manifest
    left no complete checkpoint of that step; with checkpoint.keep=1 the one before had already
    been pruned, and resume: auto started the run afresh. The complete folder is now kept under a
    second name of the same step (hard links) until the new manifest is durable."""
    from hgsgc import checkpoint as ckpt

    run = {"world_size": 1, "model": "tiny"}
    d = str(tmp_path)
    ckpt.save(d, 2, {"w": np.full(4, 2.0)}, run, keep=1)
    first = ckpt.save(d, 5, {"w": np.full(4, 5.0)}, run, keep=1)
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [5]  # keep=1 pruned step 2
    real = ckpt.atomic_write

    def killed_at_manifest(path, data):
        if path.endswith(ckpt.MANIFEST):
            raise KeyboardInterrupt("killed")  # as SIGKILL would: nothing after this runs
        return real(path, data)

    monkeypatch.setattr(ckpt, "atomic_write", killed_at_manifest)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(d, 5, {"w": np.full(4, 6.0)}, run, keep=1)
    monkeypatch.setattr(ckpt, "atomic_write", real)
    back = ckpt.latest(d)
    assert back is not None and back != first and ckpt.read_manifest(back)["step"] == 5
    assert ckpt.load_rank(back, ckpt.read_manifest(back), 0)["w"][0] == 5.0  # the old state, intact
    # the next save of that step completes and removes the spare; keep counts steps as before
    assert ckpt.save(d, 5, {"w": np.full(4, 6.0)}, run, keep=1) == first
    assert [p for _, p in ckpt.list_checkpoints(d)] == [first]
    assert ckpt.load_rank(first, ckpt.read_manifest(first), 0)["w"][0] == 6.0
    ckpt.save(d, 7, {"w": np.zeros(4)}, run, keep=2)
    ckpt.save(d, 7, {"w": np.ones(4)}, run, keep=2)  # an uneventful re-save leaves no spare
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [7, 5]


@pytest.mark.parametrize("text,overrides,needle", [
    ("train: 3\n", [], "config file {f}: 'train' is a section, not a value: give its keys under it "
                       "(e.g. 'epochs: ...' indented under 'train:')"),
    ("- a\n- b\n", [], "config file {f} is a YAML list, not a mapping of sections (run, data, model, train, ...)"),
    ("train:\n  epochs: 1\n", ["train=3"], "override 'train=3': 'train' is a section, not a value: give "
                                           "one of its keys, e.g. train.epochs=..."),
    ("train:\n  epochs: 1\n", ["=3"], "override '=3' has no key (e.g. train.epochs=3)"),
])
def test_a_section_given_a_value_is_one_line_naming_it(tmp_path, text, overrides, needle):
    """A section given a scalar (train: 3 in the file, or train=3 as an override) said
    "config key '?': Merge error: int is not a subclass of TrainConfig", naming no key; a YAML
    list said 'Cannot merge incompatible container types'; '=3' was "unknown config key '?'"."""
    from hgsgc.config import ConfigError, load_config

    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(str(f), overrides)
    assert str(ei.value).startswith(needle.format(f=f)), str(ei.value)


def test_bench_missing_or_empty_spec_names_the_file(tmp_path, capsys):
    """hgsgc bench with a spec that does not exist, or with no methods: one line naming the file and
    what to give, exit 2 (it printed a raw '[Errno 2] ...' / a message without the file)."""
    from hgsgc.bench import main

    missing = str(tmp_path / "nope.yaml")
    assert main(missing) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and missing in err[0] and "cannot read the spec" in err[0] and "configs/bench/" in err[0]
    empty = tmp_path / "empty_methods.yaml"
    empty.write_text("name: x\nmethods: []\n")
    assert main(str(empty)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"hgsgc: bench: {empty}: 'methods' must list at least one method"
