"""brk10: rank 0 asks for ``nonfinite="skip"``, the other ranks leave the default ``"off"`` (a
per-rank branch in user code), through the entry point named by argv[1] (``tape``:
``DistributedGradientTape(nonfinite=...)``, ``optimizer``: ``hgsgc_set_nonfinite``), with SGC.
The guard adds one collective (the verdict's allreduce) on rank 0 only, so the ranks' collectives
no longer match: the first step must stop every rank with one error naming the setting, never
hang (Horovod waits forever for a tensor the other ranks never send)."""
import sys

from hgsgc.cli import run_guarded

ENTRY = sys.argv[1]


def body():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hgsgc

    hvd.init()
    mode = "skip" if hvd.rank() == 0 else "off"
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(5, name="dense")])
    comp = hgsgc.Compression.sgc(0.5)
    opt = tf.keras.optimizers.legacy.SGD(0.1)
    if ENTRY == "optimizer":
        opt = hgsgc.DistributedOptimizer(opt, compression=comp)
        opt.hgsgc_set_nonfinite(mode)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        if ENTRY == "tape":
            tape = hgsgc.DistributedGradientTape(tape, compression=comp, nonfinite=mode)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(3):
        step(tf.ones((2, 4)))
    print("UNREACHABLE", flush=True)


run_guarded(body)
