"""nb11: the default Elias-Fano index coding through hgsgc.DistributedOptimizer on any rank count
(tests/test_robustness11.py runs it on 3 and 5), with tiny and empty variables (numel 0, 1, 2, 9,
0x4, 257) and on process sets (every other rank; every rank but 0).

For each setting the same four gradient calls (per-rank constants) run with
``index_coding="elias_fano"`` and with ``"fixed"``: weights and the whole hgsgc state tree must be
equal bit for bit except the byte counters; payload bytes are the formula
(tests/reference.payload_length, per exchange, empty tensors send nothing); the first delay-1
update equals the numpy sparse average (fp32 values, exact selection: exact; 2-bit: to 1 ulp).
Rank 0 prints ``RESULT {json}``."""
import json
import math
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

hvd.init(process_sets="dynamic")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference as ref  # noqa: E402

import hgsgc  # noqa: E402
from horovod.tensorflow.functions import allgather_object  # noqa: E402

rank, size = hvd.rank(), hvd.size()
SHAPES = [(0,), (1,), (2,), (3, 3), (0, 4), (257,)]
CALLS = 4  # delay 2 ends on a sync: identical weights on every rank
LR = 0.5
every_other = hvd.add_process_set(list(range(0, size, 2)))
not_zero = hvd.add_process_set(list(range(1, size)))
SETS = {"world": hvd.global_process_set, "every_other": every_other, "not_zero": not_zero}
C = hgsgc.Compression
CASES = {  # name: (factory(coding), bits, density, delay, momentum, numpy-checkable first step)
    "sgc": (lambda cd: C.sgc(0.2, bits=2, index_coding=cd), 2, 0.2, 1, 0.0, True),
    "sgc_tree": (lambda cd: C.sgc(0.2, bits=2, hierarchy="tree", index_coding=cd), 2, 0.2, 1, 0.0, False),
    "sgc_node": (lambda cd: C.sgc(0.2, bits=32, hierarchy="node", index_coding=cd), 32, 0.2, 1, 0.0, False),
    "sgc_buckets3": (lambda cd: C.sgc(0.2, bits=2, buckets=3, index_coding=cd), 2, 0.2, 1, 0.0, True),
    "sgc_delay2": (lambda cd: C.sgc(0.2, bits=2, delay=2, index_coding=cd), 2, 0.2, 2, 0.0, False),
    "topk_k_eq_numel": (lambda cd: C.topk(1.0, index_coding=cd), 32, 1.0, 1, 0.0, True),
    "dgc": (lambda cd: C.dgc(0.2, index_coding=cd), 32, 0.2, 1, 0.9, False),
}


def grads_for(call, r):
    g = np.random.default_rng([call, r])
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


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


def run(factory, coding, momentum, ps):
    vs = [tf.Variable(tf.ones(s), name=f"v{i}") for i, s in enumerate(SHAPES)]
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(LR, momentum=momentum),
                                     compression=factory(coding), process_set=ps)
    step = tf.function(lambda gs: opt.apply_gradients(zip(gs, vs)))
    first = None
    for call in range(CALLS):
        step([tf.constant(g) for g in grads_for(call, rank)])
        if call == 0:
            first = [v.numpy().copy() for v in vs]
    return first, [v.numpy() for v in vs], flat_state(opt.hgsgc_state()), opt.hgsgc_stats.snapshot()


rec = {"rank": rank}
for set_name, ps in SETS.items():
    members = ps.ranks if ps.ranks else list(range(size))
    if rank not in members:
        continue
    for name, (factory, bits, density, delay, momentum, checkable) in CASES.items():
        if set_name != "world" and name not in ("sgc_tree", "dgc"):
            continue
        got = {cd: run(factory, cd, momentum, ps) for cd in ("fixed", "elias_fano")}
        (f_first, f_w, f_st, f_stats), (e_first, e_w, e_st, e_stats) = got["fixed"], got["elias_fano"]
        state_diff = sorted(k for k in set(f_st) | set(e_st) if not k.startswith("/stats/")
                            and (k not in f_st or k not in e_st or not np.array_equal(f_st[k], e_st[k])))
        P = {cd: sum(ref.payload_length(math.prod(s), ref.k_for(math.prod(s), density), bits, cd)
                     for s in SHAPES) for cd in ("fixed", "elias_fano")}
        out = {"weights_equal": all(np.array_equal(a, b) for a, b in zip(f_w, e_w)),
               "state_diff": state_diff, "n_state": len(e_st),
               "payload": {"fixed": f_stats["payload_bytes"], "elias_fano": e_stats["payload_bytes"]},
               "exchanges": e_stats.get("exchanges"), "P": P, "members": len(members),
               "shapes_ok": all(a.shape == s for a, s in zip(e_w, SHAPES)),
               "w": [a.ravel().tolist() for a in e_w]}
        if checkable:  # first update vs numpy: w1 = 1 - lr * sparse_average over the set's ranks
            avg = [ref.sparse_average([grads_for(0, r)[i].ravel() for r in members], density, bits)
                   for i in range(len(SHAPES))]
            want = [(np.float32(1) - np.float32(LR) * a).reshape(s) for a, s in zip(avg, SHAPES)]
            out["first_vs_numpy"] = max([float(np.max(np.abs(a - b))) if a.size else 0.0
                                         for a, b in zip(e_first, want)])
        rec[f"{set_name}/{name}"] = out
allrecs = allgather_object(rec)
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "ranks": allrecs}), flush=True)
