"""Run under mpirun (tests/test_state9.py): the same training through every entry point.

For each compression, the same seeded model, per-rank data and optimizer take STEPS steps
through

* ``loop``: ``hgsgc.DistributedOptimizer`` in a custom ``tf.function`` step
  (``tape.gradient`` + ``opt.apply_gradients``, ``hgsgc_synchronize`` after the last step),
  the pattern ``hgsgc train`` uses;
* ``fit``: ``model.compile(optimizer=hgsgc.DistributedOptimizer(...))`` + ``model.fit``
  (``shuffle=False``, one epoch of STEPS batches, validation data, ``hgsgc.SynchronizeCallback``);
* ``tape``: ``hgsgc.DistributedGradientTape`` + a plain legacy optimizer (delay 1 only; for
  DGC ``momentum=m`` on the tape and momentum 0 on the optimizer, as documented).

Layers are named explicitly: PowerSGD's initial ``Q`` is seeded by the variable name, and Keras
names a process's second model's layers ``dense_2`` ..., so unnamed layers would start PowerSGD
from another ``Q`` for each entry point.

Every rank reports, per compression and entry point, its weights (as lists of float32 bit
patterns) and its byte counters; rank 0 gathers them and prints ``RESULT {json}``.
"""
import json
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.experimental.enable_op_determinism()
import horovod.tensorflow as hvd  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc.faults import world_comm  # noqa: E402

C = hgsgc.Compression
STEPS, B = 4, 8
CASES = {
    "none": C.none,
    "sgc": C.sgc(0.2),
    "sgc_delay2": C.sgc(0.2, delay=2),
    "sgc_delay3": C.sgc(0.2, delay=3),  # 4 steps: a sync at step 3, then a pending local step
    "dgc": C.dgc(0.2, local_clip_norm=1.0),
    "terngrad": C.terngrad(),
    "powersgd": C.powersgd(rank=1),
}


def CALLBACKS():
    return [hgsgc.SynchronizeCallback()]


_g = np.random.default_rng(12)  # the same validation batch on every rank
VALID = (_g.standard_normal((B, 6)).astype(np.float32), _g.integers(0, 3, size=B).astype(np.int32))


def data(rank):
    g = np.random.default_rng([11, rank])
    return (g.standard_normal((STEPS * B, 6)).astype(np.float32),
            g.integers(0, 3, size=STEPS * B).astype(np.int32))


def model_and_loss():
    tf.keras.utils.set_random_seed(5)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8, activation="relu", name="fc1"),
                                 tf.keras.layers.Dense(3, name="fc2")])
    return model, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def bits(model):
    return [np.asarray(v.numpy(), np.float32).view(np.uint32).ravel().tolist()
            for v in model.trainable_variables]


def run(comp, entry, x, y):
    model, loss_fn = model_and_loss()
    dgc = getattr(comp, "momentum_correction", False)
    if entry == "tape":
        opt = tf.keras.optimizers.legacy.SGD(0.1, momentum=0.0 if dgc else 0.9)
        holder = {}

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as t:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hgsgc.DistributedGradientTape(t, compression=comp, momentum=0.9 if dgc else None)
            grads = tape.gradient(loss, model.trainable_variables)
            holder["tape"] = tape
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for i in range(STEPS):
            step(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
        return bits(model), holder["tape"].exchanger.stats.snapshot(), {}
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                     compression=comp)
    if entry == "fit":  # validation after the epoch: on synced weights, as hgsgc train evaluates
        model.compile(optimizer=opt, loss=loss_fn)
        hist = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                         validation_data=VALID, callbacks=CALLBACKS())
        return bits(model), opt.hgsgc_stats.snapshot(), {"val_loss": hist.history["val_loss"]}

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as t:
            loss = loss_fn(yb, model(xb, training=True))
        grads = t.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for i in range(STEPS):
        step(tf.constant(x[i * B:(i + 1) * B]), tf.constant(y[i * B:(i + 1) * B]))
    opt.hgsgc_synchronize(model.trainable_variables)  # the end of an epoch in hgsgc train
    return bits(model), opt.hgsgc_stats.snapshot(), {}


def main():
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = data(rank)
    mine = {}
    for name in only:
        comp = CASES[name]
        entries = ["loop", "fit"] + (["tape"] if comp.delay == 1 else [])
        mine[name] = {e: run(comp, e, x, y) for e in entries}
    everyone = world_comm().gather(mine, root=0) if size > 1 else [mine]
    if rank == 0:
        print("RESULT " + json.dumps({"size": size, "ranks": everyone}), flush=True)


if __name__ == "__main__":
    main()
