"""Run under mpirun: TernGrad, PowerSGD and DGC local clipping against numpy references.

Rank 0 prints one JSON line (``RESULT {...}``); tests/test_baselines.py asserts the numbers.
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
from hgsgc.compression import powersgd, terngrad  # noqa: E402
from hgsgc.models import build_model  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (1,), (0,), (6, 50)]
names = [f"t{i}" for i in range(len(SHAPES))]
res = {}


def inputs_of(r, seed):
    g = np.random.default_rng([seed, r])
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


def max_err(outs, expects):
    return max((float(np.max(np.abs(np.asarray(o) - e))) if e.size else 0.0)
               for o, e in zip(outs, expects))


def spread(arrays):
    """Largest difference between this rank's arrays and rank 0's (0.0 = identical)."""
    flat = np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])
    allw = hvd.allgather(tf.constant(flat[None, :])).numpy()
    return float(np.max(np.abs(allw - allw[0:1])))


# 1. TernGrad, two exchanges: equals the numpy reference fed the same uniform draws
ex = Exchanger(hgsgc.Compression.terngrad(clip_sigma=2.5))
nonempty = [i for i, s in enumerate(SHAPES) if int(np.prod(s))]
errs, spreads = [], []
for step, seed in enumerate((3, 4)):
    out = ex.exchange([tf.constant(x) for x in inputs_of(rank, seed)], names)
    per_rank = [[inputs_of(r, seed)[i] for i in nonempty] for r in range(n)]
    uniforms = [[terngrad.draw_uniform(int(np.prod(SHAPES[i])), step, r, j).numpy()
                 for j, i in enumerate(nonempty)] for r in range(n)]
    expect = ref.terngrad_average(per_rank, uniforms, 2.5)
    errs.append(max_err([out[i].numpy() for i in nonempty], expect))
    spreads.append(spread([o.numpy() for o in out]))
    assert out[4].shape == (0,)
res["terngrad_max_err"] = max(errs)
res["terngrad_spread"] = max(spreads)
d = sum(int(np.prod(s)) for s in SHAPES)
C = sum(-(-int(np.prod(SHAPES[i])) // 4) for i in nonempty)
L = len(nonempty)
ring = (lambda b: (2 * (n - 1) * b) // n)
res["terngrad_bytes"] = ex.stats.snapshot()
res["terngrad_formula"] = {"exchanges": 2, "payload_bytes": 2 * (C + 4 * L),
                           "bytes_sent": 2 * ((n - 1) * C + ring(4 * L)),
                           "gradient_bytes": 2 * 4 * d, "messages": 4}

# 2. PowerSGD rank 2, three exchanges (warm start and error feedback carried between them)
R = 2
ex = Exchanger(hgsgc.Compression.powersgd(rank=R))
q = {}
err_mem = {}
errs, spreads = [], []
for seed in (5, 6, 7):
    xs = inputs_of(rank, seed)
    out = ex.exchange([tf.constant(x) for x in xs], names)
    expect = []
    for i, s in enumerate(SHAPES):
        mpq = ref.powersgd_matrix(s, R)
        if mpq is None:
            expect.append(np.mean([inputs_of(r, seed)[i] for r in range(n)], 0))
            continue
        m, p, qq = mpq
        if i not in q:
            q[i] = powersgd.initial_q(names[i], p, qq).numpy().astype(np.float64)
            err_mem[i] = [np.zeros((m, p)) for _ in range(n)]
        mats = [inputs_of(r, seed)[i].reshape(m, p).astype(np.float64) + err_mem[i][r] for r in range(n)]
        approx, q[i] = ref.powersgd_step(mats, q[i])
        err_mem[i] = [mt - approx for mt in mats]
        expect.append(approx.reshape(s))
    errs.append(max_err([o.numpy() for o in out], expect))
    spreads.append(spread([o.numpy() for o in out]))
res["powersgd_max_err"] = max(errs)
res["powersgd_spread"] = max(spreads)
res["powersgd_residual_err"] = max(
    float(np.max(np.abs(ex.memory.residual(names[i], err_mem[i][rank].shape).numpy() - err_mem[i][rank])))
    for i in err_mem)
comp_m = [ref.powersgd_matrix(s, R) for s in SHAPES]
pb = 4 * sum(m * qq for m, _, qq in filter(None, comp_m))
qb = 4 * sum(p * qq for _, p, qq in filter(None, comp_m))
db = 4 * sum(int(np.prod(s)) for s, c in zip(SHAPES, comp_m) if c is None)
res["powersgd_bytes"] = ex.stats.snapshot()
res["powersgd_formula"] = {"exchanges": 3, "payload_bytes": 3 * (pb + qb + db),
                           "bytes_sent": 3 * (ring(pb + db) + ring(qb)), "messages": 6,
                           "gradient_bytes": 3 * 4 * d}

# 3. DGC with local gradient clipping through DistributedOptimizer: models identical after
#    each step; the clipped gradient equals the numpy formula (clip_norm / sqrt(n))
from hgsgc.optimizer import local_clip  # noqa: E402

gs = inputs_of(rank, 8)[:3]
clipped = local_clip([tf.constant(g) for g in gs], hgsgc.Compression.dgc(0.1, local_clip_norm=2.0), n)
expect = ref.global_norm_clip(gs, 2.0 / np.sqrt(n))
res["local_clip_max_err"] = max_err([c.numpy() for c in clipped], expect)
res["local_clip_norm"] = float(np.sqrt(sum(np.sum(c.numpy().astype(np.float64) ** 2) for c in clipped)))

model = build_model("tiny", seed=1)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
g = np.random.default_rng([9, rank])
model_spreads = {}
for label, comp in (("dgc", hgsgc.Compression.dgc(0.05, local_clip_norm=1.0)),
                    ("dgc_nomask", hgsgc.Compression.dgc(0.05, local_clip_norm=1.0, momentum_masking=False)),
                    ("terngrad", hgsgc.Compression.terngrad()), ("powersgd", hgsgc.Compression.powersgd(rank=2))):
    m = build_model("tiny", seed=1)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), compression=comp)
    hvd.broadcast_variables(m.variables, root_rank=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    before = [v.numpy().copy() for v in m.trainable_variables]
    sp = []
    for _ in range(3):
        step(g.random((8, 28, 28, 1)).astype(np.float32), g.integers(0, 10, 8).astype(np.int32))
        sp.append(spread([v.numpy() for v in m.trainable_variables]))
    moved = max(float(np.max(np.abs(a - b.numpy()))) for a, b in zip(before, m.trainable_variables))
    model_spreads[label] = {"spread": max(sp), "moved": moved}
res["optimizer"] = model_spreads

# 4. DGC with dense_vectors (rank < 2 tensors averaged densely, momentum after the average):
#    vectors equal the numpy momentum formula, matrices equal the same exchange without the
#    option (their sparse path is unchanged), bytes equal the formula.
from hgsgc.compression import SparseCompression  # noqa: E402
from hgsgc.compression.codec import TopKCodec  # noqa: E402

M = 0.9
mk = lambda dv: SparseCompression(0.05, bits=32, selector="exact", method="dgc",  # noqa: E731
                                  momentum_correction=True, dense_vectors=dv)
ex_dv, ex_sp = Exchanger(mk(True), momentum=M), Exchanger(mk(False), momentum=M)
vec = [i for i, s in enumerate(SHAPES) if len(s) < 2 and int(np.prod(s))]
mat = [i for i, s in enumerate(SHAPES) if len(s) >= 2 and int(np.prod(s))]
u = {i: np.zeros(SHAPES[i], np.float64) for i in vec}
vec_err, mat_err = [], []
for seed in (10, 11):
    xs = [tf.constant(x) for x in inputs_of(rank, seed)]
    out_dv, out_sp = ex_dv.exchange(xs, names), ex_sp.exchange(xs, names)
    for i in vec:
        u[i] = M * u[i] + np.mean([inputs_of(r, seed)[i].astype(np.float64) for r in range(n)], 0)
    vec_err.append(max_err([out_dv[i].numpy() for i in vec], [u[i] for i in vec]))
    mat_err.append(max_err([out_dv[i].numpy() for i in mat], [out_sp[i].numpy() for i in mat]))
    assert out_dv[4].shape == (0,)
res["dense_vectors_vec_err"] = max(vec_err)
res["dense_vectors_mat_err"] = max(mat_err)
res["dense_vectors_velocity"] = sorted(ex_dv.state_dict().get("velocity", {}))
codec = TopKCodec(0.05, 32, "exact")
Ps = sum(codec.payload_length(int(np.prod(SHAPES[i]))) for i in mat)
Pd = 4 * sum(int(np.prod(SHAPES[i])) for i in vec)
res["dense_vectors_bytes"] = ex_dv.stats.snapshot()
res["dense_vectors_formula"] = {"exchanges": 2, "payload_bytes": 2 * (Ps + Pd),
                                "bytes_sent": 2 * ((n - 1) * Ps + ring(Pd))}
res["dense_vectors_costs"] = ex_dv.costs(SHAPES)["bytes_sent"] == (n - 1) * Ps + ring(Pd)

# 5. Momentum correction without masking at density 1: nothing stays in the residual and the
#    velocity is never cleared, so the exchange is momentum of the averaged gradient,
#    u = M u + mean_r g_r (numpy, float64), on every rank (with masking: error 2.8).
ex_nm = Exchanger(SparseCompression(1.0, bits=32, selector="exact", method="dgc", momentum_correction=True,
                                    momentum_masking=False), momentum=M)
full = [i for i, s in enumerate(SHAPES) if int(np.prod(s))]
u = {i: np.zeros(SHAPES[i], np.float64) for i in full}
nm_err = []
for seed in (12, 13, 14):
    out = ex_nm.exchange([tf.constant(x) for x in inputs_of(rank, seed)], names)
    for i in full:
        u[i] = M * u[i] + np.mean([inputs_of(r, seed)[i].astype(np.float64) for r in range(n)], 0)
    nm_err.append(max_err([out[i].numpy() for i in full], [u[i] for i in full]))
res["nomask_density1_err"] = max(nm_err)

allres = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
