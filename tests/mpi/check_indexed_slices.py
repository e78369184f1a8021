"""Run under mpirun: sparse embedding gradients (tf.IndexedSlices) through every compression.

Inside a tf.function, each rank's gradient of an embedding table comes out of a tf.cond as
IndexedSlices (static dense shape unknown after the cond); hgsgc.DistributedOptimizer applies it.
For every compression, the weights after 3 steps must equal those of the same run fed the
densified gradient (same compression, fresh state), and for the exact methods (none, top-k with
density 1 and fp32 values) the numpy reference: plain SGD on the average of the ranks' dense
gradients. Rank 0 prints one RESULT line.
"""
import json

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402

import hgsgc  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
V, D, LR, STEPS = 20, 4, 0.1, 3
E0 = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)
W0 = np.random.default_rng(1).standard_normal((D, 3)).astype(np.float32)


def ids_of(r, step):
    return np.random.default_rng([r, step]).integers(0, V, 6).astype(np.int32)


def factories():
    C = hgsgc.Compression
    return {"none": lambda: C.none, "fp16": lambda: C.fp16, "topk_exact": lambda: C.topk(1.0, bits=32),
            "topk": lambda: C.topk(0.1), "sgc": lambda: C.sgc(0.1), "sgc_delay2": lambda: C.sgc(0.1, delay=2),
            "dgc": lambda: C.dgc(0.1), "terngrad": lambda: C.terngrad(), "powersgd": lambda: C.powersgd(rank=1),
            "localsgd": lambda: C.localsgd(2)}


def train(make, densify):
    E, W = tf.Variable(E0), tf.Variable(W0)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(LR), compression=make())

    @tf.function
    def step(ids, flag):
        with tf.GradientTape() as tape:
            h = tf.gather(E, ids)
            loss = tf.reduce_sum(tf.matmul(h, W) * (1.0 + rank))
        gE, gW = tape.gradient(loss, [E, W])
        # through tf.cond: the result's static dense shape is unknown
        gE = tf.cond(flag, lambda: gE, lambda: tf.IndexedSlices(gE.values * 0.5, gE.indices, gE.dense_shape))
        if densify:
            gE = tf.convert_to_tensor(gE)
        opt.apply_gradients([(gE, E), (gW, W)])

    for s in range(STEPS):
        step(tf.constant(ids_of(rank, s)), tf.constant(s % 2 == 0))
    if hasattr(opt, "hgsgc_synchronize"):
        opt.hgsgc_synchronize([E, W])
    return E.numpy(), W.numpy()


def numpy_reference():
    E, W = E0.copy().astype(np.float64), W0.copy().astype(np.float64)
    for s in range(STEPS):
        gE, gW = np.zeros_like(E), np.zeros_like(W)
        for r in range(n):
            ids = ids_of(r, s)
            c = (1.0 + r) * (1.0 if s % 2 == 0 else 0.5)
            for i in ids:  # d/dE[i] sum(E[i] @ W) = W.sum(1); repeated ids add up
                gE[i] += c * W.sum(1)
            gW += (1.0 + r) * E[ids].sum(0)[:, None] * np.ones((1, 3))
        E, W = E - LR * gE / n, W - LR * gW / n
    return E, W


res = {"size": n, "methods": {}}
ref_E, ref_W = numpy_reference()
for name, make in factories().items():
    out = {}
    try:
        Es, Ws = train(make, densify=False)
        Ed, Wd = train(make, densify=True)
        out["slices_vs_dense"] = float(max(np.abs(Es - Ed).max(), np.abs(Ws - Wd).max()))
        if name in ("none", "topk_exact"):
            out["vs_numpy"] = float(max(np.abs(Es - ref_E).max(), np.abs(Ws - ref_W).max()))
        # identical weights on every rank
        allE = hvd.allgather(tf.constant(Es[None])).numpy()
        out["rank_spread"] = float(np.abs(allE - allE[0]).max())
    except Exception as exc:  # reported, and the test fails naming the method
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    res["methods"][name] = out
if rank == 0:
    print("RESULT " + json.dumps(res), flush=True)
