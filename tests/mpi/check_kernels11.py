"""kr11 (session 11): DGC momentum correction folded into HgsgcCompressMomentum and the average's
``/ n`` folded into HgsgcDecodeAccumulate, trained through ``DistributedOptimizer`` + ``model.fit``
and through ``DistributedGradientTape`` inside a ``tf.function`` on every rank, three ways: the
fused kernels ("fused"), session 10's composition of kernels ("composed":
``wrappers.FOLD_MOMENTUM = False``) and the pure-TF reference path ("reference"). The final
weights and the whole hgsgc state (velocity, residuals, byte counters) must be the same bits, and
the weights the same on every rank. Rank 0 prints ``RESULT {json}``."""
import json
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc import ops  # noqa: E402
from hgsgc.compression import wrappers  # noqa: E402
from hgsgc.compression.codec import TopKCodec  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
C = hgsgc.Compression
STEPS = 3


def model_():
    tf.keras.backend.clear_session()  # the same layer names (the state's keys) in every run
    tf.keras.utils.set_random_seed(7)
    return tf.keras.Sequential([tf.keras.Input((12,)), tf.keras.layers.Dense(40, activation="relu"),
                                tf.keras.layers.Dense(30, activation="relu"), tf.keras.layers.Dense(3)])


def data():
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((STEPS * 8, 12)).astype(np.float32)
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


CALLS = {"fused": 0}
_orig = TopKCodec.compress_momentum_into


def _counting(self, *a, **kw):
    CALLS["fused"] += 1  # at trace time: the fold path was built into the step's graph
    return _orig(self, *a, **kw)


TopKCodec.compress_momentum_into = _counting  # undone at the end (tests/mpi/run_many.py runs
# other checks in the same process after this one)


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32 and b.dtype == np.float32 and a.shape == b.shape:
        return np.array_equal(a.view(np.uint32), b.view(np.uint32))
    return a.shape == b.shape and np.array_equal(a, b)


def fit(comp, momentum_in_opt=True):
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
        dt = hgsgc.DistributedGradientTape(t, compression=comp, momentum=0.9)
        holder["t"] = dt
        g = dt.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(g, m.trainable_variables))

    x, y = data()
    for s in range(STEPS):
        step(tf.constant(x[8 * s:8 * s + 8]), tf.constant(y[8 * s:8 * s + 8]))
    return [w.numpy() for w in m.weights], leaves(holder["t"].hgsgc_state())


CASES = {  # name: (setting, the fused op expected, entry points)
    "sgc2_dgc_momentum": (C.sgc(0.1, bits=2, momentum_correction=True), True, ("fit", "tape")),
    "sgc2_dgc_momentum_ef_b2": (C.sgc(0.1, bits=2, momentum_correction=True, index_coding="elias_fano",
                                      buckets=2), True, ("tape",)),
    "dgc_fp32_nomask": (C.dgc(0.1, momentum_masking=False, buckets=2), True, ("fit",)),
    "topk_div_n": (C.topk(0.1), False, ("fit",)),
}
ENTRIES = {"fit": fit, "tape": tape}
# argv: the case names to run (all when none), so the test runs each case on 2 ranks and one more
# count instead of every case on 2, 3 and 4 ranks (suite time)
WANT = sys.argv[1:] or list(CASES)
unknown = sorted(set(WANT) - set(CASES))
if unknown:
    raise SystemExit(f"check_kernels11.py: unknown case(s) {unknown}; known: {sorted(CASES)}")
out = {"size": size}
for name in WANT:
    comp, expect, entries = CASES[name]
    for entry, fn in ((e, ENTRIES[e]) for e in entries):
        res = {}
        for mode, backend, fold in (("fused", "custom", True), ("composed", "custom", False),
                                    ("reference", "reference", True)):
            ops.set_compression_backend(backend)
            wrappers.FOLD_MOMENTUM = fold
            CALLS["fused"] = 0
            res[mode] = fn(comp) + (CALLS["fused"] > 0,)
        ops.set_compression_backend("custom")
        wrappers.FOLD_MOMENTUM = True
        wa, sa, fused = res["fused"]
        wdiff, sdiff = {}, {}
        for mode in ("composed", "reference"):
            wb, sb, _ = res[mode]
            wdiff[mode] = [i for i, (a, b) in enumerate(zip(wa, wb))
                           if not same(a, b)]
            sdiff[mode] = sorted(k for k in set(sa) | set(sb) if k not in sa or k not in sb
                                 or not same(sa[k], sb[k]))[:8]
        flat = np.concatenate([w.ravel() for w in wa]).astype(np.float32)
        g = hvd.allgather(tf.constant(flat[None, :]), name=f"w_{name}_{entry}").numpy()
        start = np.concatenate([w.numpy().ravel() for w in model_().weights])
        out[f"{name}_{entry}"] = {"weights_differ": wdiff, "state_differ": sdiff, "n_state": len(sa),
                                  "ranks_equal": bool(all(np.array_equal(g[0], r) for r in g)),
                                  "moved": bool(np.any(flat != start)), "fused_op": fused,
                                  "fused_in_other_modes": [res[m][2] for m in ("composed", "reference")],
                                  "expect_fused": expect}
TopKCodec.compress_momentum_into = _orig
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
