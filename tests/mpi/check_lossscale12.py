"""Mixed precision with ``hgsgc.DistributedGradientTape(..., loss_scale_optimizer=opt)``: the
state carried across calls is in unscaled units while the loss scale changes. Under mpirun;
prints ``RESULT {json}`` on rank 0.

The loss is ``sum(v * c)`` (``c`` a per-rank, per-call constant), times the loss scale, so the
gradient of the scaled loss is exactly ``c * s`` (powers of two). A ``LossScaleOptimizer`` with
``initial_scale=2^10`` and ``dynamic_growth_steps=2`` around a plain Keras SGD(0.5); at call 1
the last rank's loss overflows (Inf), so calls 0-5 run at scales 1024, 512 (halved, skipped),
512, 1024 (doubled after 2 finite steps), 1024, 2048 (doubled). Per compression (SGC 2-bit with
the sampled selector, top-k, DGC with momentum 0.9 and local clipping that bites, PowerSGD rank
2), eager and in a ``tf.function``, four runs on the same calls:

* ``tape``: the tape with ``loss_scale_optimizer``;
* ``opt``: ``LossScaleOptimizer(hgsgc.DistributedOptimizer(SGD))`` (the optimizer path, which
  exchanges unscaled gradients);
* ``plain``: the tape without loss scaling, float32 policy, on calls 0, 2, 3, 4, 5 (call 1 never
  happened: the run in unscaled units);
* ``old``: the tape without ``loss_scale_optimizer`` (state in units of the scale: the gap).

``tape`` must equal ``plain`` (eager and graph) and ``opt`` (eager) bit for bit (weights, every
state leaf but ``skipped_steps``), ``old`` (eager) must not (it shows the check sees the gap).
``resume`` (graph): the ``tape`` run stopped after call 2 (inside the halved-scale stretch), its
tape state and the ``LossScaleOptimizer``'s checkpoint saved, restored into new variables,
optimizer and tape, and calls 3-5 run: the same bits as without the stop. (Each case runs a
subset of the comparisons to keep the CPU time of the check down: ``cpu_s`` per case.)
"""
import json
import os
import sys
import tempfile
import time
import warnings

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hgsgc
from hgsgc.optimizer import _tape_exchanger

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"size": size}
SHAPES = [(6, 4), (5,)]
CALLS = [0, 1, 2, 3, 4, 5]
OVERFLOW = 1


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


def tape_state(comp, vs, momentum):
    with warnings.catch_warnings():  # the probe only reads the state: no loss scale needed
        warnings.simplefilter("ignore")
        probe = hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp,
                                              momentum=momentum, nonfinite="nan")
    probe.exchanger = _tape_exchanger(probe._comp, probe._process_set, vs, probe._momentum)
    return probe.hgsgc_state()


def run(kind, comp, momentum, graph, calls=CALLS, start=None, save_after=None):
    """Run ``calls``; returns (weights, flat state without skipped_steps, scales, extra).

    ``start``: (weights, tape state, checkpoint path) to resume from; ``save_after``: a call
    after which the weights, tape state and LossScaleOptimizer checkpoint are kept in ``extra``."""
    vs = [tf.Variable(tf.ones(s)) for s in SHAPES]
    sgd = tf.keras.optimizers.legacy.SGD(0.5, momentum=momentum or 0.0) if kind == "opt" \
        else tf.keras.optimizers.legacy.SGD(0.5)
    inner = hgsgc.DistributedOptimizer(sgd, compression=comp) if kind == "opt" else sgd
    lso = None
    if kind != "plain":
        lso = tf.keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0 ** 10,
                                                          dynamic_growth_steps=2)
    opt = lso or inner
    if start is not None:
        for v, w in zip(vs, start[0]):
            v.assign(w)
        tf.train.Checkpoint(opt=lso).read(start[2]).assert_existing_objects_matched()

    def step(c1, c2, blow):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
            if lso is not None:
                loss = lso.get_scaled_loss(loss) * blow
        if kind != "opt":
            t = hgsgc.DistributedGradientTape(t, compression=comp, nonfinite="nan", momentum=momentum,
                                              loss_scale_optimizer=lso if kind == "tape" else None)
            if start is not None and not step.loaded:
                t.load_hgsgc_state(start[1])  # kept until the first gradient() call
                step.loaded = True
        g = t.gradient(loss, vs)
        if lso is not None:
            g = lso.get_unscaled_gradients(g)
        opt.apply_gradients(zip(g, vs))

    step.loaded = False
    fn = tf.function(step) if graph else step
    scales, extra = [], None
    for call in calls:
        blow = np.float32(np.inf) if (call == OVERFLOW and rank == size - 1) else np.float32(1.0)
        c1, c2 = (tf.constant(g) for g in grads_for(call))
        fn(c1, c2, tf.constant(blow))
        scales.append(float(lso.loss_scale) if lso is not None else 1.0)
        if call == save_after:
            path = os.path.join(tempfile.mkdtemp(prefix=f"lossscale12_r{rank}_"), "lso")
            path = tf.train.Checkpoint(opt=lso).write(path)
            extra = ([v.numpy() for v in vs], tape_state(comp, vs, momentum), path)
    state = inner.hgsgc_state() if kind == "opt" else tape_state(comp, vs, momentum)
    state.pop("skipped_steps", None)
    return [v.numpy() for v in vs], flat_state(state), scales, extra


def same(a, b):
    """Bit-for-bit equality of two lists of arrays / two flat state dicts (NaNs compare equal)."""
    if isinstance(a, dict):
        return sorted(a) == sorted(b) and all(same([a[k]], [b[k]]) for k in a)
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and
                                    x.tobytes() == y.tobytes()
                                    for x, y in zip(map(np.asarray, a), map(np.asarray, b)))


def differing(a, b):
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same([a[k]], [b[k]]))


def spread(arrs):
    worst = 0.0
    for i, a in enumerate(arrs):
        g = hvd.allgather(tf.reshape(tf.constant(a, tf.float32), [1, -1]),
                          name=f"spread_{spread.n}_{i}").numpy()
        worst = max(worst, float(np.max(g.max(0) - g.min(0))))
    spread.n += 1
    return worst


spread.n = 0
COMPS = {"sgc": (hgsgc.Compression.sgc(0.25), None),
         "topk": (hgsgc.Compression.topk(0.25), None),
         "dgc": (hgsgc.Compression.dgc(0.25, local_clip_norm=2.0), 0.9),
         "powersgd": (hgsgc.Compression.powersgd(2), None)}
only = sys.argv[1:] or list(COMPS)
for name in only:
    comp, mom = COMPS[name]
    for graph in (False, True):
        t0 = time.process_time()
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        w, st, sc, saved = run("tape", comp, mom, graph, save_after=None if not graph else 2)
        r = {"scales": sc, "n_state": len(st), "state_keys": sorted(st),
             "finite": all(np.all(np.isfinite(a)) for a in w) and all(
                 np.all(np.isfinite(a)) for a in st.values() if a.dtype.kind == "f"),
             "spread": spread(w + [np.array(sc, np.float32)])}
        if graph:  # stopped after call 2, resumed from the saved state and scale
            w_res, st_res, r["scales_resume"], _ = run("tape", comp, mom, graph, calls=CALLS[3:],
                                                       start=saved)
            r["weights_equal_resume"] = same(w, w_res)
            r["state_differ_resume"] = differing(st, st_res)
        else:  # the optimizer path, and the tape without loss_scale_optimizer (the gap)
            w_opt, st_opt, r["scales_opt"], _ = run("opt", comp, mom, graph)
            r["weights_equal_opt"], r["state_differ_opt"] = same(w, w_opt), differing(st, st_opt)
            w_old, _, r["scales_old"], _ = run("old", comp, mom, graph)
        tf.keras.mixed_precision.set_global_policy("float32")
        w_pl, st_pl, _, _ = run("plain", comp, mom, graph, calls=[c for c in CALLS if c != OVERFLOW])
        r["weights_equal_plain"], r["state_differ_plain"] = same(w, w_pl), differing(st, st_pl)
        if not graph:
            r["old_weights_equal_plain"] = same(w_old, w_pl)
            r["old_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(w_old, w_pl))
        r["cpu_s"] = round(time.process_time() - t0, 1)
        out[f"{name}_{'graph' if graph else 'eager'}"] = r

if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
