"""Run under mpirun (tests/test_state9.py): every compressor's state through a checkpoint.

``check_state9.py full OUT K M``: for every case, train K steps, write checkpoint K with
:mod:`hgsgc.checkpoint` (``model_state`` + ``optimizer_state``, as ``hgsgc train`` does), train M
more steps in the same process (the uninterrupted run), write checkpoint K + M.
``check_state9.py resume OUT K M``: in a fresh process, restore checkpoint K of every case
(``load_model_state`` + ``load_optimizer_state``), train the same M steps, write checkpoint K + M
under ``OUT/resumed``. The test compares the two step-(K + M) checkpoints leaf by leaf, bit for bit
(weights, Keras optimizer slots and iterations, the whole hgsgc state tree) plus ``observed``:
what the process reports after the last step (skipped-step counter, byte counters).

Each rank trains on its own data (seeded by step and rank); every case starts from the same
seeded weights on every rank. Rank 0 prints ``RESULT {json}``.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.experimental.enable_op_determinism()
import horovod.tensorflow as hvd  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc import checkpoint as ckpt  # noqa: E402
from hgsgc.compression import SparseCompression  # noqa: E402
from hgsgc.faults import world_comm  # noqa: E402
from hgsgc.loop import _schedule_class  # noqa: E402

C = hgsgc.Compression


def sgd(lr=0.1, momentum=0.9):
    return tf.keras.optimizers.legacy.SGD(lr, momentum=momentum)


# name -> (compression, optimizer factory, options)
CASES = {
    "sgc_2bit": (C.sgc(0.2), sgd, {}),
    "sgc_2bit_exact_tree": (C.sgc(0.2, selector="exact", hierarchy="tree"), sgd, {}),
    "sgc_buckets3": (C.sgc(0.2, buckets=3), sgd, {}),
    # delay 4, checkpoint after step 6: mid-way between the syncs of steps 4 and 8; with a
    # learning-rate warm-up over 8 steps (iterations counts local steps), also mid-warm-up
    "sgc_delay4_lr_warmup": (C.sgc(0.2, delay=4),
                             lambda: sgd(_schedule_class()(0.1, warmup_steps=8)), {}),
    "dgc": (C.dgc(0.2, local_clip_norm=1.0), sgd, {}),
    "dgc_dense_vectors": (SparseCompression(0.2, bits=32, method="dgc", momentum_correction=True,
                                            dense_vectors=True), sgd, {}),
    "terngrad": (C.terngrad(), sgd, {}),
    "powersgd": (C.powersgd(rank=1), sgd, {}),
    "efsignsgd": (C.efsignsgd(), sgd, {}),
    "localsgd4": (C.localsgd(4), sgd, {}),
    # a NaN gradient on the last rank at step 1 (delay 1: skipped on every rank)
    "sgc_nonfinite_skip": (C.sgc(0.2), sgd, {"nonfinite": "skip", "nan_step": 1}),
    # the tape path: its exchanger's state saved next to the (plain) optimizer's
    "tape_dgc": (C.dgc(0.2), lambda: sgd(momentum=0.0), {"tape_momentum": 0.9}),
}


def batch(step, rank, nan=False):
    g = np.random.default_rng([7, step, rank])
    x = g.standard_normal((8, 6)).astype(np.float32)
    if nan:
        x[0, 0] = np.nan
    return tf.constant(x), tf.constant(g.integers(0, 3, size=8).astype(np.int32))


def build(name):
    comp, opt_fn, o = CASES[name]
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8, activation="relu", name="fc1"),
                                 tf.keras.layers.Dense(3, name="fc2")])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tape_mode = o.get("tape_momentum") is not None
    opt = opt_fn() if tape_mode else hgsgc.DistributedOptimizer(opt_fn(), compression=comp)
    if "nonfinite" in o:
        opt.hgsgc_set_nonfinite(o["nonfinite"])
    holder = {"tape": None, "pending": None}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as t:
            loss = loss_fn(y, model(x, training=True))
        if tape_mode:
            tape = hgsgc.DistributedGradientTape(t, compression=comp, momentum=o.get("tape_momentum"))
            if holder["pending"] is not None:  # restore before the first gradient() (trace time)
                tape.load_hgsgc_state(holder["pending"])
                holder["pending"] = None
            grads = tape.gradient(loss, model.trainable_variables)
            holder["tape"] = tape
        else:
            grads = t.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def state():
        s = {"model": ckpt.model_state(model), "optimizer": ckpt.optimizer_state(opt)}
        if tape_mode:
            s["tape"] = holder["tape"].hgsgc_state()
        return s

    def restore(saved):
        ckpt.load_model_state(model, saved["model"])
        ckpt.load_optimizer_state(opt, model.trainable_variables, saved["optimizer"])
        if tape_mode:
            holder["pending"] = saved["tape"]

    def observed():
        if tape_mode:
            return {"stats": holder["tape"].exchanger.stats.snapshot()}
        return {"skipped": int(opt.hgsgc_skipped_steps), "stats": opt.hgsgc_stats.snapshot()}

    return step, state, restore, observed, o


def main():
    mode, out, K, M = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    only = sys.argv[5].split(",") if len(sys.argv) > 5 else list(CASES)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    comm = world_comm()
    for name in only:
        step, state, restore, observed, o = build(name)
        run = {"case": name, "world_size": size}
        if mode == "full":
            first = 0
        else:
            path = ckpt.step_dir(os.path.join(out, "full", name), K)
            restore(ckpt.load_rank(path, ckpt.read_manifest(path), rank))
            first = K
        for s in range(first, K + M):
            step(*batch(s, rank, nan=(s == o.get("nan_step") and rank == size - 1)))
            if mode == "full" and s + 1 == K:
                ckpt.save(os.path.join(out, "full", name), K, state(), run, comm, keep=5)
        final = dict(state(), observed=observed())
        ckpt.save(os.path.join(out, "full" if mode == "full" else "resumed", name), K + M, final,
                  run, comm, keep=5)
    if rank == 0:
        print("RESULT " + json.dumps({"size": size, "mode": mode, "cases": only}), flush=True)


if __name__ == "__main__":
    main()
