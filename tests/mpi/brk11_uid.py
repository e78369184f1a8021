"""nb11: Horovod op names must agree across the ranks of a process set even when the ranks have
built different numbers of hgsgc exchangers before (one rank also trains something on a process
set of its own, as a rank in several process sets does).

Sequence on every rank: (1) the global set's exchanges R1: SGC through the tree and the node
hierarchy, TernGrad, PowerSGD (optimizer, 2 steps each) and an SGC tape with nonfinite="skip";
(2) the last rank alone builds an optimizer (SGC tree) on a process set of its own and steps it,
and a guarded tape on it; (3) the same global exchanges again, R2. R2 must equal R1 bit for bit and
be identical on every rank. Before the fix the op names carried a process-wide count of exchangers
(tree/node rounds, TernGrad's scale, PowerSGD's P/Q) and of checked tapes (the tape's verdict), so
in (3) the last rank named its collectives differently from the others and the job hung.
Rank 0 prints ``RESULT {json}``."""
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

hvd.init(process_sets="dynamic")
import hgsgc  # noqa: E402

rank, size = hvd.rank(), hvd.size()
solo = hvd.add_process_set([size - 1])
SHAPES = [(6, 4), (5,)]
C = hgsgc.Compression
SETTINGS = {"sgc_tree": C.sgc(0.25, bits=2, hierarchy="tree"), "sgc_node": C.sgc(0.25, bits=2, hierarchy="node"),
            "terngrad": C.terngrad(), "powersgd": C.powersgd(rank=2)}


def grads(call):
    rng = np.random.default_rng(100 * call + rank)
    return [tf.constant(rng.normal(size=s).astype(np.float32)) for s in SHAPES]


def train(comp, ps=hvd.global_process_set):
    vs = [tf.Variable(tf.ones(s), name=f"w{i}") for i, s in enumerate(SHAPES)]
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.5), compression=comp, process_set=ps)
    step = tf.function(lambda gs: opt.apply_gradients(zip(gs, vs)))
    for call in range(2):
        step(grads(call))
    return np.concatenate([v.numpy().ravel() for v in vs])


def tape(ps=hvd.global_process_set):
    vs = [tf.Variable(tf.ones(s), name=f"t{i}") for i, s in enumerate(SHAPES)]

    @tf.function
    def step(c1, c2):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
        dt = hgsgc.DistributedGradientTape(t, compression=C.sgc(0.25, bits=32, selector="exact"),
                                           process_set=ps, nonfinite="skip")
        return dt.gradient(loss, vs)

    return np.concatenate([np.concatenate([g.numpy().ravel() for g in step(*grads(call))]) for call in range(2)])


def everything():
    out = {name: train(comp) for name, comp in SETTINGS.items()}
    out["tape"] = tape()
    return out


r1 = everything()
if rank == size - 1:  # this rank alone: a model of its own on a process set of one
    train(C.sgc(0.25, bits=2, hierarchy="tree"), ps=solo)
    tape(ps=solo)
r2 = everything()
res = {}
for name in r1:
    allw = hvd.allgather(tf.constant(r2[name][None]), name=f"brk11_uid_{name}").numpy()
    res[name] = {"r2_equals_r1": bool(np.array_equal(r1[name], r2[name])),
                 "spread": float(np.max(allw.max(0) - allw.min(0))) if name != "tape" else
                 float(np.max(np.abs(allw - allw[0:1])))}
res = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "ranks": res}), flush=True)
