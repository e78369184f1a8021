"""Rank 1 builds a wider layer than the others (a bug in user code): the first step must stop
every rank with one error naming the variable and both shapes, never hang."""
import sys

from hgsgc.cli import run_guarded

KIND = sys.argv[1] if len(sys.argv) > 1 else "shape"


def body():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hgsgc

    hvd.init()
    width = 5 if hvd.rank() != 1 else 6
    dtype = "float64" if (KIND == "dtype" and hvd.rank() == 1) else "float32"
    model = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(4,)),
                                 tf.keras.layers.Dense(width if KIND == "shape" else 5,
                                                       dtype=dtype, name="dense")])
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                     compression=hgsgc.Compression.sgc(0.5, delay=1))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x), tf.float32))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step(tf.ones((2, 4)))
    print("UNREACHABLE", flush=True)


run_guarded(body)
