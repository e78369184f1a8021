"""nb11: Keras' LossScaleOptimizer around hgsgc.DistributedOptimizer for the compressions
tests/mpi/check_loss_scale.py does not cover: PowerSGD, TernGrad, EF-SignSGD, DGC (momentum
correction: the velocity), SGC through the tree and node hierarchies, SGC with 2 buckets, top-k
with the fixed index coding, and SGC on a process set that leaves world rank 0 out.

At call 1 the last rank's loss overflows. Every rank must skip that call alike, and calls 0 and 2
must give bit for bit the weights and the whole hgsgc state tree (residuals, velocity, PowerSGD
factors, random-number step, byte counters) of a run that never had call 1. Rank 0 prints
``RESULT {json}`` (the set's records gathered with a world allgather_object)."""
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

hvd.init(process_sets="dynamic")
import hgsgc  # noqa: E402
from horovod.tensorflow.functions import allgather_object  # noqa: E402

rank, size = hvd.rank(), hvd.size()
sub = hvd.add_process_set(list(range(1, size)))
SHAPES = [(6, 4), (5,)]
C = hgsgc.Compression


def grads_for(call):
    rng = np.random.default_rng(100 * call + rank)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def flat_state(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k in sorted(tree):
            out.update(flat_state(tree[k], f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_state(v, f"{prefix}/{i}"))
    else:
        out[prefix] = np.asarray(tree)
    return out


def run(comp, calls, overflow_call=None, graph=False, momentum=0.0, ps=hvd.global_process_set):
    vs = [tf.Variable(tf.ones(s)) for s in SHAPES]
    opt = tf.keras.mixed_precision.LossScaleOptimizer(
        hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.5, momentum=momentum),
                                   compression=comp, process_set=ps),
        initial_scale=2.0 ** 10)

    def step(c1, c2, blow):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
            loss = opt.get_scaled_loss(loss) * blow
        g = opt.get_unscaled_gradients(t.gradient(loss, vs))
        opt.apply_gradients(zip(g, vs))

    fn = tf.function(step) if graph else step
    scales = []
    last = ps.ranks[-1] if ps.ranks else size - 1
    for call in calls:
        blow = np.float32(np.inf) if (call == overflow_call and rank == last) else np.float32(1.0)
        c1, c2 = (tf.constant(g) for g in grads_for(call))
        fn(c1, c2, tf.constant(blow))
        scales.append(float(opt.loss_scale))
    return [v.numpy() for v in vs], flat_state(opt.inner_optimizer.hgsgc_state()), scales


CASES = {
    "powersgd": (C.powersgd(rank=2), 0.0),
    "terngrad": (C.terngrad(), 0.0),
    "efsignsgd": (C.efsignsgd(), 0.0),
    "dgc": (C.dgc(0.25), 0.9),
    "sgc_tree": (C.sgc(0.25, bits=2, hierarchy="tree"), 0.0),
    "sgc_node": (C.sgc(0.25, bits=2, hierarchy="node"), 0.0),
    "sgc_buckets2": (C.sgc(0.25, bits=2, buckets=2), 0.0),
    "topk_fixed": (C.topk(0.25, index_coding="fixed"), 0.0),
}
rec = {"rank": rank}
for name, (comp, mom) in CASES.items():
    for graph in (False, True):
        w, st, sc = run(comp, [0, 1, 2], overflow_call=1, graph=graph, momentum=mom)
        w_ref, st_ref, sc_ref = run(comp, [0, 2], graph=graph, momentum=mom)
        diff_keys = sorted(k for k in set(st) | set(st_ref)
                           if k not in st or k not in st_ref or not np.array_equal(st[k], st_ref[k]))
        rec[f"{name}_{'graph' if graph else 'eager'}"] = {
            "weights_equal_ref": all(np.array_equal(a, b) for a, b in zip(w, w_ref)),
            "state_diff": diff_keys, "n_state": len(st),
            "finite": all(np.all(np.isfinite(a)) for a in w) and all(
                np.all(np.isfinite(a)) for a in st.values() if a.dtype.kind == "f"),
            "scales": sc, "scales_ref": sc_ref, "w": [a.ravel().tolist() for a in w]}
if rank != 0:  # a process set without world rank 0: rank 0 takes no part
    w, st, sc = run(C.sgc(0.25, bits=2), [0, 1, 2], overflow_call=1, graph=True, ps=sub)
    w_ref, st_ref, sc_ref = run(C.sgc(0.25, bits=2), [0, 2], graph=True, ps=sub)
    rec["subset"] = {"weights_equal_ref": all(np.array_equal(a, b) for a, b in zip(w, w_ref)),
                     "state_diff": sorted(k for k in st if not np.array_equal(st[k], st_ref.get(k))),
                     "scales": sc, "scales_ref": sc_ref, "w": [a.ravel().tolist() for a in w]}
allrecs = allgather_object(rec)
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "ranks": allrecs}), flush=True)
