"""Run under mpirun: compression.buckets (the sparse allgather split into groups) on n ranks.

Rank 0 prints one JSON line (``RESULT {...}``); tests/test_buckets.py asserts the numbers.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference as ref  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc.communicator import Exchanger  # noqa: E402
from hgsgc.compression.reducers import bucket_indices  # noqa: E402
from hgsgc.models import build_model  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (1,), (0,), (6, 50), (90, 7)]
names = [f"t{i}" for i in range(len(SHAPES))]
full = [i for i, s in enumerate(SHAPES) if int(np.prod(s))]
res = {}


def inputs_of(r, seed):
    g = np.random.default_rng([seed, r])
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


def spread(arrays):
    """Largest difference between this rank's arrays and rank 0's (0.0 = identical)."""
    flat = np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])
    allw = hvd.allgather(tf.constant(flat[None, :])).numpy()
    return float(np.max(np.abs(allw - allw[0:1])))


# 1. fp32 values, exact top-k, error feedback, 3 exchanges: every rank's output equals the numpy
#    average of what every rank sent (float32, summed in rank order), and the residuals too
D, STEPS = 0.05, (21, 22, 23)
sizes = [ref.payload_length(int(np.prod(SHAPES[i])), ref.k_for(int(np.prod(SHAPES[i])), D), 32,
                            ref.DEFAULT_CODING) for i in full]
P = sum(sizes)
for buckets in (1, 3, 7):
    ex = Exchanger(hgsgc.Compression.topk(D, bits=32, selector="exact", buckets=buckets))
    e = {(r, i): np.zeros(int(np.prod(SHAPES[i])), np.float32) for r in range(n) for i in full}
    errs = []
    for seed in STEPS:
        out = ex.exchange([tf.constant(x) for x in inputs_of(rank, seed)], names)
        for i in full:
            total = np.zeros(int(np.prod(SHAPES[i])), np.float32)
            for r in range(n):
                a = inputs_of(r, seed)[i].ravel() + e[(r, i)]
                idx = ref.topk_indices(a, ref.k_for(a.size, D))
                sent = np.zeros_like(a)
                sent[idx] = a[idx]
                e[(r, i)] = a - sent
                total = total + sent
            # the average is sum x float32(1/n) (docs/compression.md, "Compression compute (session 11)":
            # what a tf.function always computed; 1 ulp from sum / n for n = 3, 5, 6, 7)
            want = (total * (np.float32(1) / np.float32(n))).reshape(SHAPES[i])
            errs.append(float(np.max(np.abs(out[i].numpy() - want))))
        assert out[4].shape == (0,)
    res_err = max(float(np.max(np.abs(ex.memory.residual(names[i], (int(np.prod(SHAPES[i])),)).numpy()
                                      - e[(rank, i)]))) for i in full)
    st = ex.stats.snapshot()
    res[f"b{buckets}"] = {"max_err": max(errs), "residual_err": res_err, "stats": st,
                          "groups": len(bucket_indices(sizes, buckets)),
                          "costs_messages": ex.costs(SHAPES)["messages"]}
res["P"] = P

# 2. SGC's default path (sampled selector, 2-bit, fused error-feedback kernel): buckets=3 gives
#    the same outputs bit for bit as one fused payload
fused, split = Exchanger(hgsgc.Compression.sgc(0.05)), Exchanger(hgsgc.Compression.sgc(0.05, buckets=3))
diff = 0.0
for seed in (31, 32, 33):
    xs = [tf.constant(x) for x in inputs_of(rank, seed)]
    for a, b in zip(fused.exchange(xs, names), split.exchange(xs, names)):
        if a.shape.num_elements():
            diff = max(diff, float(np.max(np.abs(a.numpy() - b.numpy()))))
res["sgc_fused_vs_buckets_diff"] = diff

# 3. the optimizer in one tf.function (tiny model, SGC delay 1): models identical across ranks
#    after every step, bit for bit the same as with one payload; the first allgather does not
#    wait for the convolutions' gradients (the overlap the option is for)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train(buckets, steps=4):
    model = build_model("tiny", seed=1)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                      compression=hgsgc.Compression.sgc(0.05, buckets=buckets))
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    g = np.random.default_rng([9, rank])
    sp = []
    x = y = None
    for _ in range(steps):
        x, y = g.random((8, 28, 28, 1)).astype(np.float32), g.integers(0, 10, 8).astype(np.int32)
        step(x, y)
        sp.append(spread([v.numpy() for v in model.trainable_variables]))
    graph = step.get_concrete_function(x, y).graph
    return [v.numpy() for v in model.trainable_variables], sp, graph, model


def ancestors(op):
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        for t in list(o.inputs) + list(o.control_inputs):
            p = t.op if hasattr(t, "op") else t
            if p.name not in seen:
                seen.add(p.name)
                todo.append(p)
    return seen


w1, sp1, _, _ = train(1)
w2, sp2, graph, model = train(2)
gathers = [o for o in graph.get_operations() if o.type.startswith("HorovodAllgather")]
conv_grads = {o.name for o in graph.get_operations() if o.type == "Conv2DBackpropFilter"}
res["optimizer"] = {
    "spread_b1": max(sp1), "spread_b2": max(sp2),
    "b1_vs_b2": max(float(np.max(np.abs(a - b))) for a, b in zip(w1, w2)),
    "variables": [v.name for v in model.trainable_variables],
    "allgathers": len(gathers),
    "conv_grads": len(conv_grads),
    "conv_grads_before_each_allgather": [len(ancestors(o) & conv_grads) for o in gathers],
}

allres = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
