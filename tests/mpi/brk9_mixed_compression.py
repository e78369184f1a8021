"""The last rank passes another compression than the others (a user's rank-dependent setting):
argv[1] is the entry point (``optimizer`` or ``tape``), argv[2] the field that differs
(``index_coding`` or ``density``; ``index_coding_default``: the other ranks leave index_coding out,
the default elias_fano, the last passes fixed; ``momentum``: DGC with the wrapped SGD's momentum 0.9,
0.8 on the last rank). The first step must stop every rank with one error naming the
setting and both values, never a hang, never an internal decode error or a silently wrong average."""
import sys

from hgsgc.cli import run_guarded

ENTRY, FIELD = sys.argv[1], sys.argv[2]


def body():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hgsgc

    hvd.init()
    last = hvd.rank() == hvd.size() - 1
    kw = {"density": 0.5, "bits": 32, "index_coding": "fixed"}
    if FIELD == "index_coding_default":
        del kw["index_coding"]
        if last:
            kw["index_coding"] = "fixed"
    elif last:
        kw.update({"index_coding": "elias_fano"} if FIELD == "index_coding" else {"density": 0.25})
    comp = hgsgc.Compression.topk(**kw)
    momentum = 0.0
    if FIELD == "momentum":
        comp = hgsgc.Compression.dgc(0.5)
        momentum = 0.8 if last else 0.9
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(4, name="dense")])
    opt = tf.keras.optimizers.legacy.SGD(0.1, momentum=momentum)
    if ENTRY == "optimizer":
        opt = hgsgc.DistributedOptimizer(opt, compression=comp)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        if ENTRY == "tape":
            tape = hgsgc.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step(tf.ones((2, 4)) * (1.0 + hvd.rank()))
    print("UNREACHABLE", flush=True)


run_guarded(body)
