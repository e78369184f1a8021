"""Keras' LossScaleOptimizer (mixed precision) around hgsgc.DistributedOptimizer under mpirun;
prints ``RESULT {json}`` on rank 0.

The loss is ``sum(v * c)`` times the loss scale, so the unscaled gradient is exactly ``c`` (a
per-rank constant; the scales are powers of two). At call 1 the last rank's loss overflows
(Inf gradient). Every rank must skip that call alike (weights unchanged, the scale halved on
every rank), and calls 0 and 2 must give bit-for-bit the weights and residuals of a run that
never had call 1 (before the fix, the overflowing rank skipped its exchange alone: the ranks'
collectives paired different steps and the scales diverged). With ``delay`` 2: one clear error.

``check_loss_scale.py tape``: the same overflow through ``hgsgc.DistributedGradientTape(...,
nonfinite="nan")`` in a custom loop with a LossScaleOptimizer around a plain Keras SGD, under the
``mixed_float16`` policy (what a Horovod user expects from ``hvd.DistributedGradientTape``: an
overflow on any rank reaches the scaler on every rank, whose scales halve alike). Per compression
(none, fp16, SGC, top-k, DGC, PowerSGD), eager and in a ``tf.function``: scales; the overflowing
call leaves the weights and every compression state leaf bit for bit as they were (dense ``none``
/ ``fp16``: its allreduce ran, so its byte counters and ``rng_step`` move); the next call trains
(finite, moved); ``skipped_steps`` 1 (reference 0); the same on every rank. Dense: the weights
equal the reference run without call 1 bit for bit. (Compressed ones do not: the tape exchanges
gradients of the scaled loss, so their residuals are in units of the scale, which the overflow
halved: documented in the tape's docstring.)
"""
import json
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hgsgc
from hgsgc.optimizer import _tape_exchanger

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"size": size}
SHAPES = [(6, 4), (5,)]
MODE = sys.argv[1] if len(sys.argv) > 1 else "optimizer"


def grads_for(call):
    rng = np.random.default_rng(100 * call + rank)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def flat_state(tree, prefix=""):
    """{path: numpy array} of a nested state dict (names of variables replaced by their order)."""
    res = {}
    if isinstance(tree, dict):
        for i, k in enumerate(sorted(tree)):
            res.update(flat_state(tree[k], f"{prefix}/{i if ':' in str(k) else k}"))
    else:
        res[prefix] = np.asarray(tree)
    return res


def run(comp, calls, overflow_call=None, graph=False, tape=False, momentum=None):
    """Calls ``calls`` through LossScaleOptimizer(hgsgc.DistributedOptimizer(SGD)) or, ``tape``,
    hgsgc.DistributedGradientTape(nonfinite="nan") + LossScaleOptimizer(SGD); returns (weights,
    residuals in name order, scales) or, ``tape``, (weights, scales, [(weights, flat state of the
    tape's exchanger, skipped_steps) after each call])."""
    vs = [tf.Variable(tf.ones(s)) for s in SHAPES]
    inner = tf.keras.optimizers.legacy.SGD(0.5)
    if not tape:
        inner = hgsgc.DistributedOptimizer(inner, compression=comp)
    opt = tf.keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0 ** 10)

    def step(c1, c2, blow):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
            loss = opt.get_scaled_loss(loss) * blow
        if tape:
            t = hgsgc.DistributedGradientTape(t, compression=comp, nonfinite="nan", momentum=momentum)
        g = opt.get_unscaled_gradients(t.gradient(loss, vs))
        opt.apply_gradients(zip(g, vs))

    def tape_state():
        probe = hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp, nonfinite="nan",
                                              momentum=momentum)
        probe.exchanger = _tape_exchanger(probe._comp, probe._process_set, vs, probe._momentum)
        state = probe.hgsgc_state()
        assert state.pop("skipped_steps") == probe.skipped_steps  # compared on its own
        return flat_state(state), probe.skipped_steps

    fn = tf.function(step) if graph else step
    scales, snaps = [], []
    for call in calls:
        blow = np.float32(np.inf) if (call == overflow_call and rank == size - 1) else np.float32(1.0)
        c1, c2 = (tf.constant(g) for g in grads_for(call))
        fn(c1, c2, tf.constant(blow))
        scales.append(float(opt.loss_scale))
        if tape:
            snaps.append(([v.numpy() for v in vs],) + tape_state())
    weights = [v.numpy() for v in vs]
    if not tape:
        res = inner.hgsgc_state().get("residuals") or {}
        return weights, [np.asarray(res[k]) for k in sorted(res)], scales
    return weights, scales, snaps


def spread(arrs):
    worst = 0.0
    for i, a in enumerate(arrs):
        g = hvd.allgather(tf.reshape(tf.constant(a, tf.float32), [1, -1]),
                          name=f"spread_{spread.n}_{i}").numpy()
        worst = max(worst, float(np.max(g.max(0) - g.min(0))))
    spread.n += 1
    return worst


spread.n = 0
if MODE == "optimizer":
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
else:  # tape
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    COMPS = {"none": (hgsgc.Compression.none, None), "fp16": (hgsgc.Compression.fp16, None),
             "sgc": (hgsgc.Compression.sgc(0.25, bits=32, selector="exact"), None),
             "topk": (hgsgc.Compression.topk(0.25), None),
             "dgc": (hgsgc.Compression.dgc(0.25), 0.9),
             "powersgd": (hgsgc.Compression.powersgd(2), None)}
    for name, (comp, mom) in COMPS.items():
        for graph in (False, True):
            w, sc, snaps = run(comp, [0, 1, 2], overflow_call=1, graph=graph, tape=True, momentum=mom)
            w_ref, sc_ref, snaps_ref = run(comp, [0, 2], graph=graph, tape=True, momentum=mom)
            (w0, st0, _), (w1, st1, sk1), (_, st2, sk) = snaps
            differ = sorted(k for k in set(st0) | set(st1)
                            if k not in st0 or k not in st1 or not np.array_equal(st0[k], st1[k]))
            out[f"{name}_{'graph' if graph else 'eager'}"] = {
                # the overflowing call changed neither the weights nor the compression state
                "weights_kept": all(np.array_equal(a, b) for a, b in zip(w0, w1)),
                "state_differ": differ, "n_state": len(st0),
                "weights_equal_ref": all(np.array_equal(a, b) for a, b in zip(w, w_ref)),
                "moved": not all(np.array_equal(a, b) for a, b in zip(w1, w)),
                "finite": all(np.all(np.isfinite(a)) for a in w) and all(
                    np.all(np.isfinite(a)) for a in st2.values() if a.dtype.kind == "f"),
                "scales": sc, "scales_ref": sc_ref, "skipped": [sk1, sk, snaps_ref[-1][2]],
                "spread": spread(w + [np.array(sc, np.float32), np.array([sk], np.float32)]),
            }
    tf.keras.mixed_precision.set_global_policy("float32")

if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
