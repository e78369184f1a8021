"""Run under mpirun: compression.index_coding=elias_fano trains bit-identically to fixed coding.

SGC (2-bit, delay 1, the fused kernels) on the tiny model, 3 eager steps, hierarchy allgather
and tree, and the Exchanger with hierarchy node on uneven emulated hosts; rank 0 prints one JSON line (``RESULT {...}``); tests/test_index_coding.py asserts it.
"""
import json
import math
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
from hgsgc.compression import wire  # noqa: E402
from hgsgc.models import build_model  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DENSITY, STEPS = 0.05, 3


def spread(arrays):
    """Largest difference between this rank's arrays and rank 0's (0.0 = identical)."""
    flat = np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])
    allw = hvd.allgather(tf.constant(flat[None, :])).numpy()
    return float(np.max(np.abs(allw - allw[0:1])))


def train(hierarchy, coding):
    model = build_model("tiny", seed=1)
    opt = hgsgc.DistributedOptimizer(
        tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
        compression=hgsgc.Compression.sgc(DENSITY, hierarchy=hierarchy, index_coding=coding))
    hvd.broadcast_variables(model.variables, root_rank=0)

    def step(x, y):  # eager (no tracing: 2x faster here); the single-process test runs tf.function
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    g = np.random.default_rng([9, rank])
    for _ in range(STEPS):
        step(g.random((8, 28, 28, 1)).astype(np.float32), g.integers(0, 10, 8).astype(np.int32))
    w = [v.numpy() for v in model.trainable_variables]
    P = sum(wire.payload_length(math.prod(v.shape), ref.k_for(math.prod(v.shape), DENSITY), 2, coding)
            for v in model.trainable_variables)
    return w, opt.hgsgc_stats.snapshot(), P


res = {}
for h in ("allgather", "tree"):
    w_f, st_f, p_f = train(h, "fixed")
    w_e, st_e, p_e = train(h, "elias_fano")
    res[h] = {"fixed_vs_ef": max(float(np.max(np.abs(a - b))) for a, b in zip(w_f, w_e)),
              "spread_fixed": spread(w_f), "spread_ef": spread(w_e),
              "stats_fixed": st_f, "stats_ef": st_e, "P_fixed": p_f, "P_ef": p_e}

# hierarchy=node on uneven emulated hosts (the Exchanger, 3 exchanges of 2-bit SGC): the
# averages and residuals with elias_fano equal those with fixed coding bit for bit
from hgsgc.communicator import Exchanger  # noqa: E402

SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (90, 7)]
names = [f"t{i}" for i in range(len(SHAPES))]
sizes = {2: [1, 1], 3: [2, 1]}.get(n, [n])
outs = {}
for coding in ("fixed", "elias_fano"):
    ex = Exchanger(hgsgc.Compression.sgc(0.05, hierarchy="node", index_coding=coding), node_sizes=sizes)
    got = []
    for seed in (1, 2, 3):
        g = np.random.default_rng([seed, rank])
        got += [o.numpy() for o in ex.exchange([tf.constant(g.standard_normal(s).astype(np.float32))
                                                 for s in SHAPES], names)]
    got += [ex.memory.residual(nm, (int(np.prod(s)),)).numpy() for nm, s in zip(names, SHAPES)]
    outs[coding] = (got, ex.stats.snapshot())
res["node"] = {"fixed_vs_ef": max(float(np.max(np.abs(a - b))) for a, b in zip(outs["fixed"][0], outs["elias_fano"][0])),
               "payload_fixed": outs["fixed"][1]["payload_bytes"], "payload_ef": outs["elias_fano"][1]["payload_bytes"],
               "P_fixed": 3 * sum(wire.payload_length(int(np.prod(s)), ref.k_for(int(np.prod(s)), 0.05), 2)
                                  for s in SHAPES),
               "P_ef": 3 * sum(wire.payload_length(int(np.prod(s)), ref.k_for(int(np.prod(s)), 0.05), 2, "elias_fano")
                               for s in SHAPES)}

allres = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
