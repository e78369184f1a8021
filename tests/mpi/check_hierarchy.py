"""Run under mpirun: every multi-rank property of the tree and node hierarchies.

One launch per rank count; every rank runs the exchanges, rank 0 compares the gathered results
with the numpy reference (tests/reference_tree.py) and prints one ``RESULT {json}`` line that
tests/test_hierarchy.py asserts on.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
# graph optimisation of the (many small) traced exchanges dominates the run time on 2 cores
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
import horovod.tensorflow as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference_tree as rt  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc.communicator import Exchanger  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
SHAPES = [(12, 10), (1,), (0,)]  # 84-bit index stream (not byte aligned), k = 1, empty
NAMES = [f"t{i}" for i in range(len(SHAPES))]
LIVE = [i for i, s in enumerate(SHAPES) if int(np.prod(s))]
DENSITY = 0.1
STEPS = 3
# uneven emulated hosts per rank count (node_sizes override), plus the MPI split (one host here)
LAYOUTS = {2: [1, 1], 3: [2, 1], 4: [1, 3], 5: [3, 2], 6: [1, 3, 2], 8: [3, 1, 4]}
res = {"size": n}
import time  # noqa: E402
T0 = time.perf_counter()


def mark(label):
    if rank == 0:
        print(f"[{time.perf_counter() - T0:7.1f}s] {label}", file=sys.stderr, flush=True)


def grads(r, step, seed=0):
    g = np.random.default_rng([seed, step, r])
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


def gather(x):
    return hvd.allgather_object(x)


def run(exchangers, steps, seed=0, extra=None):
    """Run ``steps`` exchanges of every exchanger inside ONE tf.function (one trace for all);
    rank 0 gets what every rank saw. ``extra(xs)`` adds more outputs (returned from the first
    step only)."""
    def body(xs):
        outs = [ex.exchange(xs, NAMES) for ex in exchangers]
        return outs, (extra(xs) if extra else [])

    fn = tf.function(body)
    rec = [{"outs": [], "resids": [], "stats": [], "costs": ex.costs(SHAPES)} for ex in exchangers]
    extras = None
    for s in range(steps):
        before = [ex.stats.snapshot() for ex in exchangers]
        outs, ex_out = fn([tf.constant(x) for x in grads(rank, s, seed)])
        if extras is None:
            extras = ex_out
        for ex, b, r, out in zip(exchangers, before, rec, outs):
            after = ex.stats.snapshot()
            r["outs"].append([o.numpy() for o in out])
            r["resids"].append([ex.memory.residual(NAMES[i], SHAPES[i]).numpy() for i in LIVE])
            r["stats"].append({k: after[k] - b[k] for k in after})
    allr = gather(rec)
    return [[allr[r][e] for r in range(n)] for e in range(len(exchangers))], extras


def compare(allr, hierarchy, bits, hosts=None, seed=0):
    """Rank 0: compare gathered results with the numpy reference, step by step."""
    out = {"support_equal": True, "max_value_err": 0.0, "max_resid_err": 0.0,
           "identical": True, "max_mass_err": 0.0, "mass_scale": 0.0, "max_bound": 0.0,
           "bytes_equal_formula": True, "stats": allr[0]["stats"][0], "costs": allr[0]["costs"]}
    ref_res = None
    for s in range(STEPS):
        inputs = [[x.ravel() for i, x in enumerate(grads(r, s, seed)) if i in LIVE]
                  for r in range(n)]
        ref = rt.exchange(inputs, DENSITY, bits, hierarchy, hosts, ref_res)
        ref_res = ref["residuals"]
        for j, i in enumerate(LIVE):
            got0 = allr[0]["outs"][s][i].ravel()
            for r in range(n):
                if not np.array_equal(allr[r]["outs"][s][i], allr[0]["outs"][s][i]):
                    out["identical"] = False
            if not np.array_equal(np.flatnonzero(got0), np.flatnonzero(ref["avg"][j])):
                out["support_equal"] = False
            out["max_value_err"] = max(out["max_value_err"],
                                       float(np.max(np.abs(got0 - ref["avg"][j]))))
            out["max_bound"] = max([out["max_bound"]] + ref["bounds"][j])
            for r in range(n):
                out["max_resid_err"] = max(out["max_resid_err"], float(np.max(np.abs(
                    allr[r]["resids"][s][j].ravel() - ref["residuals"][r][j]))))
            # mass identity, measured on hgsgc's own numbers: sum_r a_r = n avg + sum_r e_r
            a_sum = np.sum([ref["compensated"][r][j] for r in range(n)], 0, dtype=np.float64)
            e_sum = np.sum([allr[r]["resids"][s][j].ravel() for r in range(n)], 0, dtype=np.float64)
            err = np.abs(a_sum - n * got0.astype(np.float64) - e_sum)
            out["max_mass_err"] = max(out["max_mass_err"], float(err.max()))
            out["mass_scale"] = max(out["mass_scale"], float(np.abs(a_sum).max()))
        for r in range(n):
            st, c = allr[r]["stats"][s], allr[r]["costs"]
            for key in ("bytes_sent", "bytes_received", "messages", "rounds", "payload_bytes"):
                if st[key] != c[key]:
                    out["bytes_equal_formula"] = False
                    out.setdefault("bytes_mismatch", []).append([r, s, key, st[key], c[key]])
            P = c["payload_bytes"]
            if hierarchy == "tree":
                want = rt.tree_cost(n, r, P)
            else:
                want = rt.node_cost(hosts, r, P)
            if (st["bytes_sent"], st["bytes_received"], st["messages"], st["rounds"]) != want:
                out["bytes_equal_formula"] = False
                out.setdefault("bytes_mismatch", []).append([r, s, "ref", st, list(want)])
    out["per_rank_stats"] = [allr[r]["stats"][0] for r in range(n)]
    return out


# 1. tree and node (uneven emulated hosts, and MPI's shared-memory split: all ranks on this
#    machine, one host) vs the numpy reference, 2-bit and fp32, STEPS steps with error feedback;
# 2. density 1 with fp32 values: tree and node (uneven hosts) == Horovod's dense allreduce.
#    All in one tf.function (tracing dominates the run time).
CONFIGS = [("tree", 2, None), ("tree", 32, None), ("node", 2, LAYOUTS.get(n, [n])),
           ("node_mpi_split", 2, None)]
exs = [Exchanger(hgsgc.Compression.sgc(DENSITY, bits=bits, hierarchy=h.split("_")[0]),
                 node_sizes=sizes) for h, bits, sizes in CONFIGS]
D1 = ("tree", "node")
d1 = [Exchanger(hgsgc.Compression.sgc(1.0, bits=32, hierarchy=h), node_sizes=LAYOUTS.get(n, [n]))
      for h in D1]


def density1(xs):
    dense = [hvd.allreduce(x, op=hvd.Average, name=f"dense_{i}") for i, x in enumerate(xs)
             if x.shape.num_elements()]
    return [dense] + [[o for o in ex.exchange(xs, [f"d1_{nm}" for nm in NAMES])
                       if o.shape.num_elements()] for ex in d1]


allr, extras = run(exs, STEPS, extra=density1)
mark("exchanges")
errs = gather([max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(out, extras[0]))
               for out in extras[1:]])
if rank == 0:
    for i, h in enumerate(D1):
        res[f"density1_{h}_vs_allreduce"] = max(e[i] for e in errs)
    for (h, bits, _), ex, per_rank in zip(CONFIGS, exs, allr):
        hier = h.split("_")[0]
        hosts = ex.plan().hosts if hier == "node" else None
        key = h if h == "node_mpi_split" else f"{h}_bits{bits}"
        res[key] = compare(per_rank, hier, bits, hosts)
        if hosts is not None:
            res[key]["hosts"] = [list(x) for x in hosts]
mark("density 1")
# 4. DistributedOptimizer with hierarchy="tree" (2-bit, delay 2): weights identical after syncs
#    (3 ranks only: it costs a model build and a trace)
def optimizer_check():
    from hgsgc.models import build_model

    model = build_model("tiny", seed=1)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                      compression=hgsgc.Compression.sgc(0.05, bits=2, delay=2,
                                                                        hierarchy="tree"))
    hvd.broadcast_variables(model.variables, root_rank=0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        g = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(g, model.trainable_variables))
        return loss

    g = np.random.default_rng([9, rank])
    spreads = []
    for _ in range(4):
        step(g.random((4, 28, 28, 1)).astype(np.float32), g.integers(0, 10, 4).astype(np.int32))
        flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
        allw = hvd.allgather(flat[None, :]).numpy()
        spreads.append(float(np.max(np.abs(allw - allw[0:1]))))
    if rank == 0:
        res["optimizer_tree_spreads"] = spreads
        res["optimizer_tree_exchanges"] = opt.hgsgc_stats.snapshot()["exchanges"]


if n == 3:
    optimizer_check()
mark("optimizer")
if rank == 0:
    print("RESULT " + json.dumps(res))
