"""Rank STALL stops issuing collectives (stuck in Python, e.g. a deadlocked data loader) while the
others wait in an allreduce: with faults.stall_timeout_s the job must end naming that rank."""
import os
import sys
import time

from hgsgc.cli import run_guarded
from hgsgc.faults import configure_stall_check

STALL = int(sys.argv[1]) if len(sys.argv) > 1 else 1
configure_stall_check(float(os.environ.get("STALL_TIMEOUT_S", "6")))


def body():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    for step in range(1000):
        if step == 3 and hvd.rank() == STALL:
            print(f"rank {STALL} stalls at step 3", flush=True)
            time.sleep(3600)  # the injected fault: this rank never issues the next collective
        hvd.allreduce(tf.constant([1.0]), name=f"step_{step}")
    print("UNREACHABLE", flush=True)


run_guarded(body)
