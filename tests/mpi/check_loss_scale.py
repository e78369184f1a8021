"""Keras' LossScaleOptimizer (mixed precision) around hgsgc.DistributedOptimizer under mpirun;
prints ``RESULT {json}`` on rank 0.

The loss is ``sum(v * c)`` times the loss scale, so the unscaled gradient is exactly ``c`` (a
per-rank constant; the scales are powers of two). At call 1 the last rank's loss overflows
(Inf gradient). Every rank must skip that call alike (weights unchanged, the scale halved on
every rank), and calls 0 and 2 must give bit-for-bit the weights and residuals of a run that
never had call 1 (before the fix, the overflowing rank skipped its exchange alone: the ranks'
collectives paired different steps and the scales diverged). With ``delay`` 2: one clear error.
"""
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hgsgc

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"size": size}
SHAPES = [(6, 4), (5,)]


def grads_for(call):
    rng = np.random.default_rng(100 * call + rank)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def run(comp, calls, overflow_call=None, graph=False):
    vs = [tf.Variable(tf.ones(s)) for s in SHAPES]
    opt = tf.keras.mixed_precision.LossScaleOptimizer(
        hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.5), compression=comp),
        initial_scale=2.0 ** 10)

    def step(c1, c2, blow):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
            loss = opt.get_scaled_loss(loss) * blow
        g = opt.get_unscaled_gradients(t.gradient(loss, vs))
        opt.apply_gradients(zip(g, vs))

    fn = tf.function(step) if graph else step
    scales = []
    for call in calls:
        blow = np.float32(np.inf) if (call == overflow_call and rank == size - 1) else np.float32(1.0)
        c1, c2 = (tf.constant(g) for g in grads_for(call))
        fn(c1, c2, tf.constant(blow))
        scales.append(float(opt.loss_scale))
    inner = opt.inner_optimizer
    res = inner.hgsgc_state().get("residuals") or {}
    return [v.numpy() for v in vs], [np.asarray(res[k]) for k in sorted(res)], scales


def spread(arrs):
    worst = 0.0
    for i, a in enumerate(arrs):
        g = hvd.allgather(tf.reshape(tf.constant(a), [1, -1]), name=f"spread_{spread.n}_{i}").numpy()
        worst = max(worst, float(np.max(g.max(0) - g.min(0))))
    spread.n += 1
    return worst


spread.n = 0
COMPS = {"none": hgsgc.Compression.none, "fp16": hgsgc.Compression.fp16,
         "sgc": hgsgc.Compression.sgc(0.25, bits=32, selector="exact"),
         "topk": hgsgc.Compression.topk(0.25)}
for name, comp in COMPS.items():
    for graph in (False, True):
        w, r, sc = run(comp, [0, 1, 2], overflow_call=1, graph=graph)
        w_ref, r_ref, sc_ref = run(comp, [0, 2], graph=graph)
        out[f"{name}_{'graph' if graph else 'eager'}"] = {
            "weights_equal_ref": all(np.array_equal(a, b) for a, b in zip(w, w_ref)),
            "residuals_equal_ref": len(r) == len(r_ref) and all(np.array_equal(a, b) for a, b in zip(r, r_ref)),
            "finite": all(np.all(np.isfinite(a)) for a in w + r),
            "scales": sc, "scales_ref": sc_ref,
            "spread": spread(w + [np.array(sc, np.float32)]),
        }

try:
    run(hgsgc.Compression.sgc(0.25, bits=32, delay=2, selector="exact"), [0])
    out["delay2"] = None
except ValueError as e:
    out["delay2"] = str(e)

# model.fit under a mixed_float16 policy: model.compile wraps hgsgc's optimizer in a
# LossScaleOptimizer by itself; with a huge initial scale the first steps overflow (on every
# rank here) and the scale must come down alike while the weights stay identical across ranks
tf.keras.mixed_precision.set_global_policy("mixed_float16")
tf.keras.utils.set_random_seed(7)
model = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(6,)),
                             tf.keras.layers.Dense(8, activation="relu"),
                             tf.keras.layers.Dense(3, dtype="float32")])
hopt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05),
                                  compression=hgsgc.Compression.sgc(0.5, bits=32, selector="exact"))
model.compile(optimizer=hopt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(5 + rank)
x, y = rng.normal(size=(64, 6)).astype(np.float32), rng.integers(0, 3, size=64)
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
lso = model.optimizer
out["fit"] = {"wrapped": type(lso).__name__, "scale": float(lso.loss_scale),
              "exchanges": int(hopt.hgsgc_stats.snapshot().get("exchanges", 0))
              if hasattr(hopt.hgsgc_stats, "snapshot") else None,
              "spread": spread([w.numpy() if hasattr(w, "numpy") else np.asarray(w) for w in model.get_weights()]
                               + [np.array([float(lso.loss_scale)], np.float32)]),
              "finite": all(np.all(np.isfinite(w)) for w in model.get_weights())}
tf.keras.mixed_precision.set_global_policy("float32")

if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
