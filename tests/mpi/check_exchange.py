"""Run under mpirun: every multi-rank property of the exchange; rank 0 prints one JSON line.

Each rank computes its checks and reports numbers; tests/test_mpi.py asserts them.
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
from hgsgc.models import build_model  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (1,), (0,)]
res = {}


def inputs_of(r, seed=0):
    g = np.random.default_rng([seed, r])
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


names = [f"t{i}" for i in range(len(SHAPES))]

# 1. sparse allgather == numpy average of every rank's decompressed tensor (first step)
for bits in (2, 32):
    density = 0.1
    ex = Exchanger(hgsgc.Compression.sgc(density, bits=bits))
    out = ex.exchange([tf.constant(x) for x in inputs_of(rank)], names)
    errs = []
    for i, s in enumerate(SHAPES):
        expect = ref.sparse_average([inputs_of(r)[i] for r in range(n)], density, bits).reshape(s)
        assert out[i].shape == s
        errs.append(float(np.max(np.abs(out[i].numpy() - expect))) if expect.size else 0.0)
        # same support as the reference (exact selected indices)
        res.setdefault(f"support_equal_bits{bits}", True)
        if expect.size and not np.array_equal(out[i].numpy() != 0, expect != 0):
            res[f"support_equal_bits{bits}"] = False
    res[f"allgather_max_err_bits{bits}"] = max(errs)
    st = ex.stats.snapshot()
    P = sum(ref.payload_length(int(np.prod(s)), ref.k_for(int(np.prod(s)), density), bits,
                                 ref.DEFAULT_CODING) for s in SHAPES)  # Compression.sgc's default coding
    d = sum(int(np.prod(s)) for s in SHAPES)
    res[f"bytes_bits{bits}"] = st
    res[f"bytes_formula_bits{bits}"] = {"payload_bytes": P, "bytes_sent": (n - 1) * P,
                                        "bytes_received": (n - 1) * P, "gradient_bytes": 4 * d,
                                        "dense_bytes": (2 * (n - 1) * 4 * d) // n}
    # error feedback after a second step: residual + what was sent == compensated input
    r0 = {nm: ex.memory.residual(nm, s).numpy() for nm, s in zip(names, SHAPES) if np.prod(s)}
    res[f"residual_nonzero_bits{bits}"] = bool(any(np.any(v != 0) for v in r0.values()))

# 2. density 1, fp32 values, delay 1 == Horovod dense allreduce
xs = [tf.constant(x) for x in inputs_of(rank, seed=5)]
ex = Exchanger(hgsgc.Compression.topk(1.0, bits=32))
out = ex.exchange(xs, names)
dense = [hvd.allreduce(x, op=hvd.Average) if x.shape.num_elements() else x for x in xs]
res["density1_vs_allreduce_max_err"] = max(float(np.max(np.abs(a.numpy() - b.numpy()))) if a.shape.num_elements() else 0.0
                                           for a, b in zip(out, dense))
res["density1_vs_numpy_max_err"] = max(
    float(np.max(np.abs(out[i].numpy() - np.mean([inputs_of(r, 5)[i] for r in range(n)], 0)))) if np.prod(s) else 0.0
    for i, s in enumerate(SHAPES))

# 3. Compression.none through hgsgc == hvd.allreduce; fp16 close
ex = Exchanger(hgsgc.Compression.none)
out = ex.exchange(xs, names)
res["none_vs_allreduce_max_err"] = max(float(np.max(np.abs(a.numpy() - b.numpy()))) if a.shape.num_elements() else 0.0
                                       for a, b in zip(out, dense))
res["none_bytes"] = ex.stats.snapshot()

# 4. delay H: identical weights right after each sync, different in between
H = 3
model = build_model("tiny", seed=1)
opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                  compression=hgsgc.Compression.sgc(0.05, bits=2, delay=H))
hvd.broadcast_variables(model.variables, root_rank=0)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    g = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(g, model.trainable_variables))
    return loss


def spread():
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    allw = hvd.allgather(flat[None, :]).numpy()
    return float(np.max(np.abs(allw - allw[0:1])))


g = np.random.default_rng([9, rank])
spreads = []
for s in range(1, 2 * H + 2):
    step(g.random((8, 28, 28, 1)).astype(np.float32), g.integers(0, 10, 8).astype(np.int32))
    spreads.append(spread())
res["delay_spreads"] = spreads  # index s-1: after step s
res["delay_exchanges"] = opt.hgsgc_stats.snapshot()["exchanges"]

# 5. DistributedGradientTape(topk density 1) == horovod's DistributedGradientTape
model2 = build_model("tiny", seed=2)
x = tf.constant(g.random((4, 28, 28, 1)).astype(np.float32))
y = tf.constant(g.integers(0, 10, 4).astype(np.int32))
with tf.GradientTape(persistent=True) as tape:
    loss = loss_fn(y, model2(x))
ours = hgsgc.DistributedGradientTape(tape, compression=hgsgc.Compression.topk(1.0)).gradient(
    loss, model2.trainable_variables)
theirs = hvd.DistributedGradientTape(tape).gradient(loss, model2.trainable_variables)
res["tape_max_err"] = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(ours, theirs))

allres = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
