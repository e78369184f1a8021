"""brk10: DGC (momentum correction + masking, session 10's C++ kernels ops/momentum_mask.cc) and
the default Elias-Fano index coding, trained through ``DistributedOptimizer`` + ``model.fit`` and
through ``DistributedGradientTape`` inside a ``tf.function``, on every rank, with the C++ kernels
and with the pure-TF reference path: the final weights and the whole hgsgc state (velocity,
residuals, counters) must be the same bit for bit. Hierarchies allgather (buckets 2), tree and
node (uneven emulated hosts). Rank 0 prints ``RESULT {json}``."""
import json
import os

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc import ops  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
C = hgsgc.Compression
STEPS = 3


def model_():
    tf.keras.backend.clear_session()  # the same layer names (the state's keys) in every run
    tf.keras.utils.set_random_seed(7)
    return tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Embedding(50, 4, input_length=6),
                                tf.keras.layers.Flatten(), tf.keras.layers.Dense(9, activation="relu"),
                                tf.keras.layers.Dense(3)])


def data():
    rng = np.random.default_rng(100 + rank)
    x = rng.integers(0, 50, (STEPS * 8, 6)).astype(np.int32)
    y = rng.integers(0, 3, STEPS * 8).astype(np.int32)
    return x, y


def leaves(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k in sorted(tree):
            out.update(leaves(tree[k], f"{prefix}/{k}"))
    else:
        out[prefix] = np.asarray(tree)
    return out


def fit(comp):
    m = model_()
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), compression=comp)
    m.compile(opt, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in m.weights], leaves(opt.hgsgc_state())


def tape(comp):
    m = model_()
    opt = tf.keras.optimizers.legacy.SGD(0.1, momentum=0.0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    holder = {}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as t:
            loss = loss_fn(y, m(x))
        dt = hgsgc.DistributedGradientTape(t, compression=comp, momentum=0.9, nonfinite="skip")
        holder["t"] = dt
        g = dt.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(g, m.trainable_variables))

    x, y = data()
    for s in range(STEPS):
        step(tf.constant(x[8 * s:8 * s + 8]), tf.constant(y[8 * s:8 * s + 8]))
    return [w.numpy() for w in m.weights], leaves(holder["t"].hgsgc_state())


CASES = {"dgc_allgather_b2": C.dgc(0.1, buckets=2), "dgc_tree": C.dgc(0.1, hierarchy="tree"),
         "sgc_2bit_momentum_corr_node": hgsgc.compression.SparseCompression(
             0.1, bits=2, method="sgc", momentum_correction=True, hierarchy="node", local_clip_norm=1.0)}
out = {"size": size}
for name, comp in CASES.items():
    for entry, fn in (("fit", fit), ("tape", tape)) if name != "dgc_tree" else (("tape", tape),):
        res = {}
        for backend in ("custom", "reference"):
            ops.set_compression_backend(backend)
            res[backend] = fn(comp)
        ops.set_compression_backend("custom")
        (wa, sa), (wb, sb) = res["custom"], res["reference"]
        diff_w = [i for i, (a, b) in enumerate(zip(wa, wb)) if not np.array_equal(a, b)]
        diff_s = sorted(k for k in set(sa) | set(sb) if k not in sa or k not in sb
                        or not np.array_equal(sa[k], sb[k]))
        # the same weights on every rank
        flat = np.concatenate([w.ravel() for w in wa]).astype(np.float32)
        g = hvd.allgather(tf.constant(flat[None, :]), name=f"w_{name}_{entry}").numpy()
        out[f"{name}_{entry}"] = {"weights_differ": diff_w, "state_differ": diff_s[:8],
                                  "n_state": len(sa), "ranks_equal": bool(all(np.array_equal(g[0], r) for r in g)),
                                  "moved": bool(np.any(flat != np.concatenate([w.numpy().ravel() for w in
                                                                               model_().weights])))}
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
