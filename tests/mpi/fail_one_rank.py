"""Rank 1 raises while the other ranks wait in an allreduce: the job must end, not hang."""
import horovod.tensorflow as hvd
import tensorflow as tf

from hgsgc.cli import run_guarded


def body():
    hvd.init()
    if hvd.rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    hvd.allreduce(tf.constant([1.0]), name="never_completes")  # rank 1 never joins
    print("UNREACHABLE", flush=True)


run_guarded(body)
