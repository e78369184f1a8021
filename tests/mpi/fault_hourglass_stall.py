"""Rank VICTIM stops before the Hourglass boundary exchange of step 3 (stuck in Python, e.g. a
deadlocked data loader) while its peers wait for its point-to-point messages (mpi4py, not a
Horovod collective): with a stall timeout the job must end, naming VICTIM, printed once.

Usage: ``fault_hourglass_stall.py VICTIM`` (world rank; the last rank is the FC rank)."""
import os
import sys
import time

from hgsgc.cli import run_guarded
from hgsgc.faults import configure_stall_check

VICTIM = int(sys.argv[1])
TIMEOUT = float(os.environ.get("STALL_TIMEOUT_S", "6"))
configure_stall_check(TIMEOUT)


def body():
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from hgsgc.hourglass import HourglassTrainer, Layout, split_model
    from hgsgc.models import build_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    layout = Layout(MPI.COMM_WORLD, 1)
    tr = HourglassTrainer(layout, split_model(build_model("tiny", seed=3)), 4,
                          tf.keras.optimizers.legacy.SGD(0.1), act_codec="sparse+q4",
                          grad_codec="sparse+q4", stall_timeout_s=TIMEOUT)
    g = np.random.default_rng(layout.rank)
    for step in range(1000):
        if step == 3 and layout.rank == VICTIM:
            print(f"rank {VICTIM} stalls before the boundary exchange of step 3", flush=True)
            time.sleep(3600)  # the injected fault: this rank never sends (or receives) again
        if layout.is_conv:
            tr.train_step(g.random((4, 28, 28, 1), dtype=np.float32),
                          g.integers(0, 10, 4).astype(np.int32))
        else:
            tr.train_step()
    print("UNREACHABLE", flush=True)


run_guarded(body)
