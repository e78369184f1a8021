"""The per-step thread CPU of ``summary.json`` (``thread_cpu``, copied into every bench cell) must
cover the timed steps only. Before this test, both runners closed the window after the epoch's
loop, i.e. after the data iterator's teardown: for a tf.data pipeline cut short by
``train.max_steps_per_epoch`` (every bench cell) that teardown took 0-7 s here (prefetch threads
cancelled on a busy core), all of it inside a window of 4-9 steps, so Horovod's polling thread
showed more CPU per step than the step's wall time. The windows now close right after the last
timed step (tests/mpi/check_step_cpu_window.py records the order on every rank)."""
import json

import pytest

from conftest import mpirun

COMMON = ["data.train_limit=1024", "data.test_limit=128", "train.epochs=2",
          "train.max_steps_per_epoch=4", "checkpoint.at_end=false", "train.progress=false",
          "faults.nonfinite='off'"]


def _events(np_, tmp_path, config, extra):
    p = mpirun(np_, ["tests/mpi/check_step_cpu_window.py", str(tmp_path), config, *COMMON, *extra],
               timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ev = {r: json.loads((tmp_path / f"events_{r}.json").read_text()) for r in range(np_)}
    return ev


# epoch 1: the first step traces (not timed), 3 timed steps; epoch 2: 4 timed steps
WANT = ["start", ["stop", 3], "teardown", "start", ["stop", 4], "teardown"]


@pytest.mark.parametrize("np_", [2, 3])
def test_data_parallel_window_closes_before_the_iterator_teardown(np_, tmp_path):
    ev = _events(np_, tmp_path, "configs/fashion_mnist_sgc.yaml", [])
    for r in range(np_):
        assert ev[r] == WANT, (r, ev[r])


def test_hourglass_window_closes_before_the_iterator_teardown(tmp_path):
    ev = _events(3, tmp_path, "configs/fashion_mnist_hourglass.yaml", ["hourglass.fc_workers=1"])
    conv = [r for r in ev if "teardown" in ev[r]]
    assert len(conv) == 2, ev  # the CONV ranks read data; the FC rank has no iterator
    for r in conv:
        assert ev[r] == WANT, (r, ev[r])
    for r in set(ev) - set(conv):
        assert ev[r] == [e for e in WANT if e != "teardown"], (r, ev[r])
