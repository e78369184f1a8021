"""Order of the thread-CPU window's close and the epoch's data-iterator teardown, per rank.

Run as ``check_step_cpu_window.py OUT_DIR CONFIG [overrides...]`` under mpirun; every rank writes
``OUT_DIR/events_<rank>.json``, a list of: ``"start"`` (a window opens), ``["stop", n]`` (a window of ``n``
timed steps closes) and ``"teardown"`` (the epoch's batch iterator is closed: for a tf.data
pipeline cut short by ``train.max_steps_per_epoch`` this cancels its prefetch threads, measured
at 0-7 s on this machine, none of it step time). :class:`hgsgc.bench_threads.StepCPU` and the
image task's ``train_data`` are wrapped to record the events; nothing else changes.
"""
import json
import sys

from mpi4py import MPI  # noqa: F401  (MPI with thread support before Horovod, as `hgsgc train` does;
# without it the 3-rank job crashed at interpreter exit in 2 of about 6 runs)

import hgsgc.bench_threads as bt
import hgsgc.tasks as tasks

EVENTS = []


class RecordingStepCPU(bt.StepCPU):
    def start(self):
        EVENTS.append("start")
        super().start()

    def stop(self, steps):
        if self.running:
            EVENTS.append(["stop", int(steps)])
        super().stop(steps)


bt.StepCPU = RecordingStepCPU
_orig = tasks.ImageTask.train_data


def _train_data(self, rank, size, epoch):
    batches, n = _orig(self, rank, size, epoch)

    class Batches:
        """Iterable like a tf.data Dataset: each ``iter()`` is a new iterator that only the
        runner's loop holds, so it is torn down when the loop ends (break or exhaustion)."""

        def __iter__(self):
            try:
                yield from batches
            finally:
                EVENTS.append("teardown")

    return Batches(), n


tasks.ImageTask.train_data = _train_data

from hgsgc.config import load_config  # noqa: E402
from hgsgc import train  # noqa: E402

out, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
cfg = load_config(config, overrides + [f"run.out_dir={out}"])
train.run(cfg, log=lambda *a, **k: None)
import horovod.tensorflow as hvd  # noqa: E402

# one file per rank (mpirun may join lines of several ranks' stdout)
with open(f"{out}/events_{hvd.rank()}.json", "w") as f:
    json.dump(EVENTS, f)
