"""Rank 1 builds a wider layer than the others (a bug in user code), trained through the entry
point named by argv[1] (``optimizer`` or ``tape``): the first step must stop every rank with one
error naming the variable and both shapes, whatever the entry point, never hang."""
import sys

from hgsgc.cli import run_guarded

ENTRY = sys.argv[1]


def body():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hgsgc

    hvd.init()
    width = 5 if hvd.rank() != 1 else 6
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(width, name="dense")])
    comp = hgsgc.Compression.sgc(0.5)
    opt = tf.keras.optimizers.legacy.SGD(0.1)
    if ENTRY == "optimizer":
        opt = hgsgc.DistributedOptimizer(opt, compression=comp)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        if ENTRY == "tape":
            tape = hgsgc.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step(tf.ones((2, 4)))
    print("UNREACHABLE", flush=True)


run_guarded(body)
