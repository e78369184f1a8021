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
