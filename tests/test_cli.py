"""Command line, configuration errors and error propagation across ranks."""
import os
import subprocess

import numpy as np
import pytest

from conftest import MPIRUN, PY, ROOT, mpirun
from hgsgc.config import ConfigError, load_config
from hgsgc.data import DataError, epoch_batches, load_fashion_mnist, read_idx, shard

CFG = os.path.join(ROOT, "configs", "fashion_mnist.yaml")


def test_configs_load():
    for name in os.listdir(os.path.join(ROOT, "configs")):
        if not name.endswith(".yaml"):  # configs/bench/ holds bench specs, not train configs
            continue
        cfg = load_config(os.path.join(ROOT, "configs", name))
        assert cfg.train.epochs >= 1
    dense = load_config(os.path.join(ROOT, "configs", "fashion_mnist_dense.yaml"))
    assert dense.compression.method == "none"


@pytest.mark.parametrize("override,needle", [
    ("compression.density=0", "compression.density"),
    ("compression.density=1.5", "compression.density"),
    ("compression.delay=0", "compression.delay"),
    ("compression.bits=3", "compression.bits"),
    ("train.nonsense=1", "unknown config key 'train.nonsense'"),
    ("bogus=1", "unknown config key 'bogus'"),
    ("train.epochs=abc", "train.epochs"),
    ("compression.method=magic", "compression.method"),
    ("compression.method=fp16 compression.delay=1 compression.density=null compression.hierarchy=tree",
     "compression.hierarchy"),
    ("compression.momentum_masking=false", "compression.momentum_masking"),
])
def test_bad_config_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(CFG, override.split())


def test_topk_keeps_hierarchy_and_momentum_correction():
    from hgsgc.config import compression_from_config

    cfg = load_config(CFG, ["compression.method=topk", "compression.delay=1", "compression.hierarchy=tree",
                            "compression.momentum_correction=true"])
    comp = compression_from_config(cfg.compression)
    assert comp.method == "topk" and comp.hierarchy == "tree" and comp.momentum_correction
    assert comp.momentum_masking                        # DGC's masking unless switched off
    cfg = load_config(CFG, ["compression.delay=1", "compression.momentum_correction=true",
                            "compression.momentum_masking=false"])
    comp = compression_from_config(cfg.compression)
    assert comp.method == "sgc" and comp.momentum_correction and comp.momentum_masking is False


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml")


def _cli(args, np_=None, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [PY, "-m", "hgsgc.cli"] + args
    if np_:
        cmd = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL"] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.mpi
def test_config_error_stops_every_rank_with_one_line():
    p = _cli(["train", CFG, "compression.density=0"], np_=3)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: config error")]
    assert len(lines) == 1, p.stderr       # printed once (rank 0), not once per rank
    assert lines[0].startswith("hgsgc: config error: ")  # every rank failed: no rank list
    assert "compression.density=0.0 is invalid" in lines[0]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_config_error_on_one_rank_ends_every_rank(np_):
    p = mpirun(np_, ["tests/mpi/config_error_one_rank.py"], timeout=120)  # a hang hits the timeout
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: config error")]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("hgsgc: config error on rank 1: ")
    assert "compression.density=0.0 is invalid" in lines[0]


def test_config_error_lines_group_ranks():
    from hgsgc.cli import _config_error_lines

    assert _config_error_lines(["bad x", "bad x"]) == ["hgsgc: config error: bad x"]
    assert _config_error_lines([None, "bad x", "bad y", "bad x"]) == [
        "hgsgc: config error on ranks 1,3: bad x", "hgsgc: config error on rank 2: bad y"]
    assert _config_error_lines([None, None]) == []


@pytest.mark.mpi
def test_missing_data_ends_whole_job(tmp_path):
    p = _cli(["train", CFG, f"data.path={tmp_path}", f"run.out_dir={tmp_path}"], np_=2, timeout=180)
    assert p.returncode != 0
    assert "DataError" in p.stderr and "dataset-fashion-mnist" in p.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_error_on_one_rank_ends_job_instead_of_hanging(np_):
    p = mpirun(np_, ["tests/mpi/fail_one_rank.py"], timeout=120)  # a hang would hit the timeout
    assert p.returncode != 0
    assert "hgsgc: error on rank 1: RuntimeError: injected failure on rank 1" in p.stderr
    assert "UNREACHABLE" not in p.stdout


# ------------------------------------------------------------------ data
def _write_idx(path, arr):
    arr = np.asarray(arr, np.uint8)
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with open(path, "wb") as f:
        f.write(head + arr.tobytes())


def test_read_idx_round_trip_and_errors(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "x", a)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "x")), a)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="magic"):
        read_idx(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="not found"):
        load_fashion_mnist(str(tmp_path))


def test_corrupt_labels_and_shapes_name_the_file(tmp_path):
    imgs = np.zeros((3, 28, 28), np.uint8)
    for split in ("train", "t10k"):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte", imgs)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte", np.array([0, 9, 3], np.uint8))
    assert load_fashion_mnist(str(tmp_path)).y_test.tolist() == [0, 9, 3]
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([0, 12, 3], np.uint8))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: label 12 outside 0\.\.9"):
        load_fashion_mnist(str(tmp_path))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([0, 1, 3], np.uint8))
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((3, 784), np.uint8))
    with pytest.raises(DataError, match="train-images-idx3-ubyte: expected images"):
        load_fashion_mnist(str(tmp_path))


def test_report_on_truncated_summary_names_the_file(tmp_path):
    run = tmp_path / "run1"
    run.mkdir()
    (run / "summary.json").write_text('{"final_test_accuracy": 0.9')
    p = subprocess.run([PY, "-m", "hgsgc.cli", "report", str(run)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode != 0
    assert f"{run / 'summary.json'}: not valid JSON" in p.stderr, p.stderr


def test_real_fashion_mnist_shapes():
    d = load_fashion_mnist()
    assert d.x_train.shape == (60000, 28, 28, 1) and d.x_test.shape == (10000, 28, 28, 1)
    assert d.x_train.dtype == np.float32 and 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
    assert sorted(np.unique(d.y_train)) == list(range(10))
    assert np.bincount(d.y_test).tolist() == [1000] * 10   # the test set is balanced


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_sharding_disjoint_and_equal(size):
    parts = [epoch_batches(1000, 32, r, size, epoch=1, seed=0) for r in range(size)]
    assert len({p.shape for p in parts}) == 1 and parts[0].shape[0] == 1000 // (32 * size)
    flat = np.concatenate([p.ravel() for p in parts])
    assert len(np.unique(flat)) == flat.size     # no example on two ranks in one epoch
    ev = np.concatenate([shard(10000, r, size) for r in range(size)])
    np.testing.assert_array_equal(ev, np.arange(10000))
