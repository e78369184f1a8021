"""Run under mpirun: compression.index_coding=elias_fano vs fixed through the Exchanger, for the
sparse methods x hierarchies x bits not covered by tests/mpi/check_index_coding.py (top-k, DGC,
SGC fp32; buckets=2, tree, node on uneven emulated hosts), on tensors with numel 1, 5, 17, 1001
(not powers of two) at density 0.05 and 1.0 (k == numel), with the C++ kernels and the pure-TF
reference. Rank 0 prints ``RESULT {...}``: per case the largest difference of every output against
(custom, fixed), the payload byte counters and the formula (tests/test_robustness9.py asserts)."""
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

from hgsgc import ops  # noqa: E402
from hgsgc.communicator import Exchanger  # noqa: E402
from hgsgc.compression import SparseCompression, wire  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
SHAPES = [(1,), (5,), (17,), (7, 11, 13)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]
SIZES = {2: [1, 1], 3: [2, 1], 4: [3, 1], 5: [2, 3]}.get(n, [n])
STEPS = 2
CASES = [("topk", 32, "allgather", 2, 0.05), ("sgc", 2, "tree", 1, 1.0), ("dgc", 32, "node", 1, 0.05),
         ("sgc", 32, "allgather", 1, 1.0), ("topk", 2, "node", 1, 1.0), ("dgc", 32, "tree", 1, 1.0)]
res = []
for method, bits, hier, buckets, density in CASES:
    outs = {}
    for backend in ("custom", "reference"):
        ops.set_compression_backend(backend)
        for coding in ("fixed", "elias_fano"):
            c = SparseCompression(density=density, bits=bits, method=method, hierarchy=hier, buckets=buckets,
                                  index_coding=coding, momentum_correction=method == "dgc",
                                  selector="exact" if method == "topk" else "sampled")
            ex = Exchanger(c, node_sizes=SIZES if hier == "node" else None,
                           momentum=0.9 if method == "dgc" else None)
            got = []
            for seed in range(STEPS):
                g = np.random.default_rng([seed, rank])
                got += [o.numpy() for o in ex.exchange(
                    [tf.constant(g.standard_normal(s).astype(np.float32)) for s in SHAPES], NAMES)]
            got += [ex.memory.residual(nm, (math.prod(s),)).numpy() for nm, s in zip(NAMES, SHAPES)]
            outs[f"{backend}/{coding}"] = (got, ex.stats.snapshot())
    base = outs["custom/fixed"][0]
    flat = np.concatenate([a.ravel() for a in outs["custom/elias_fano"][0][:STEPS * len(SHAPES)]])
    allw = hvd.allgather(tf.constant(flat[None, :])).numpy()
    res.append({"case": [method, bits, hier, buckets, density],
                "diff": {k: max(float(np.max(np.abs(a - b))) for a, b in zip(base, got)) for k, (got, _) in outs.items()},
                "spread": float(np.max(np.abs(allw - allw[0:1]))),
                "payload": {k: st["payload_bytes"] for k, (_, st) in outs.items()},
                "sent": {k: st["bytes_sent"] for k, (_, st) in outs.items()},
                "P": {cd: sum(wire.payload_length(math.prod(s), ref.k_for(math.prod(s), density), bits, cd)
                              for s in SHAPES) for cd in ("fixed", "elias_fano")}})
# DGC's warm-up of sparsity through hgsgc.DistributedOptimizer: k changes between steps
# (hgsgc_set_density, as hgsgc train does), the payload length follows it
import hgsgc  # noqa: E402

ops.set_compression_backend("custom")
DENSITIES = [0.25, 0.0625, 0.01, 0.01]
warm = {}
for coding in ("fixed", "elias_fano"):
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((37,)), tf.keras.layers.Dense(29), tf.keras.layers.Dense(3)])
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9),
                                     compression=hgsgc.Compression.dgc(DENSITIES[0], index_coding=coding))
    for i, d in enumerate(DENSITIES):
        opt.hgsgc_set_density(d)
        g = np.random.default_rng([i, rank])
        x = tf.constant(g.standard_normal((4, 37)).astype(np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    sizes = [math.prod(v.shape) for v in model.trainable_variables]
    warm[coding] = {"w": [v.numpy() for v in model.trainable_variables],
                    "payload": opt.hgsgc_stats.snapshot()["payload_bytes"],
                    "P": sum(wire.payload_length(m, ref.k_for(m, d), 32, coding) for d in DENSITIES for m in sizes)}
res.append({"case": ["dgc_warmup"], "diff": max(float(np.max(np.abs(a - b))) for a, b in
                                                zip(warm["fixed"]["w"], warm["elias_fano"]["w"])),
            "payload": {k: v["payload"] for k, v in warm.items()}, "P": {k: v["P"] for k, v in warm.items()}})
allres = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
