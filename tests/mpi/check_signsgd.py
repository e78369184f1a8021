"""Run under mpirun: EF-SignSGD (Karimireddy et al. 2019) against a numpy reference, exact bytes.

Three exchanges of SHAPES through ``Exchanger(Compression.efsignsgd())``; every rank computes
the numpy reference of every rank's compensated input, scale, signs and residual. Rank 0 prints
one JSON line (``RESULT {...}``); tests/test_signsgd.py asserts the numbers.
"""
import json
import math

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc.communicator import Exchanger  # noqa: E402

hvd.init()
rank, n = hvd.rank(), hvd.size()
SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (1,), (0,), (9,)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]
STEPS = 3


def inputs_of(r, step):
    g = np.random.default_rng([step, r])
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


def compress(p):
    """numpy EF-SignSGD compressor: (||p||_1 / d) sign(p), sign(0) = +1."""
    scale = np.float32(np.sum(np.abs(p), dtype=np.float32) / np.float32(p.size))
    return np.where(p < 0, -scale, scale).astype(np.float32)


ex = Exchanger(hgsgc.Compression.efsignsgd())
resid = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(n)]
max_err, max_resid_err = 0.0, 0.0
for step in range(STEPS):
    outs = ex.exchange([tf.constant(x) for x in inputs_of(rank, step)], NAMES)
    for i, s in enumerate(SHAPES):
        if not int(np.prod(s)):
            assert outs[i].shape == s
            continue
        sent = []
        for r in range(n):
            p = inputs_of(r, step)[i] + resid[r][i]
            c = compress(p)
            resid[r][i] = p - c
            sent.append(c)
        want = np.sum(sent, axis=0) / np.float32(n)
        max_err = max(max_err, float(np.max(np.abs(outs[i].numpy() - want))))
        max_resid_err = max(max_resid_err, float(np.max(np.abs(
            ex.memory.residual(NAMES[i], [int(np.prod(s))]).numpy().reshape(s) - resid[rank][i]))))
live = [int(np.prod(s)) for s in SHAPES if int(np.prod(s))]
P = sum(4 + math.ceil(d / 8) for d in live)
d = sum(live)
res = {"max_err": max_err, "max_resid_err": max_resid_err, "stats": ex.stats.snapshot(),
       "formula": {"exchanges": STEPS, "payload_bytes": STEPS * P, "bytes_sent": STEPS * (n - 1) * P,
                   "bytes_received": STEPS * (n - 1) * P, "gradient_bytes": STEPS * 4 * d,
                   "dense_bytes": STEPS * ((2 * (n - 1) * 4 * d) // n), "messages": STEPS},
       "payload_formula": P, "payload_setting": hgsgc.Compression.efsignsgd().payload_bytes(SHAPES),
       "state_keys": sorted(ex.state_dict())}
allres = hvd.allgather_object(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
