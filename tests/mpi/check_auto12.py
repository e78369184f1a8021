"""Run under mpirun (2-5 ranks): session 12's shorter ``layout: auto`` start-up; rank 0 prints one
``RESULT {...}`` JSON line, tests/test_auto12.py asserts on it.

* every rank: :func:`hgsgc.hourglass.costmodel.probe_link_pairs` (disjoint pairs at once, small
  messages so the test is quick) and :func:`~hgsgc.hourglass.costmodel.probe_boundary` (fp32
  codecs, a fixed micro-batch): what each rank got, with the bytes each rank sent;
* :func:`hgsgc.hourglass.auto.choose` on the tiny model with its per-rank measurements replaced by
  FIXED, rank-dependent figures (every rank's own value differs) and fake machines of 2 ranks
  each (``machine_of = [r // 2]``): which ranks measured, the report, for two fixed links (a slow
  and a fast probe result, injected) and with ``one_per_machine=False`` (every rank measures).
"""
import json

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
from mpi4py import MPI  # noqa: E402

from hgsgc.hourglass import auto, costmodel  # noqa: E402

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
out = {}

# 1. the link probe on disjoint pairs, and the boundary probe, for real (small messages)
out["link"] = costmodel.probe_link_pairs(world, small_reps=3, big_bytes=1 << 16, big_reps=2)
r_rows, feats = 4, 6
a = np.arange(r_rows * feats, dtype=np.float32).reshape(r_rows, feats) + 1.0
g = -a / 10.0
y = np.arange(r_rows, dtype=np.int32) % 3
out["boundary"] = costmodel.probe_boundary(world, "fp32", "fp32", a, g, y, reps=2, timeout_s=60.0)

# 2. choose() on fixed, rank-dependent measurements and fake machines of 2 ranks each
from hgsgc.config import load_config  # noqa: E402
from hgsgc.hourglass.split import split_model  # noqa: E402
from hgsgc.models import build_model  # noqa: E402

calls = []
MACHINE_OF = [r // 2 for r in range(n)]


def fake_measure(split, x, act_codec, grad_codec, repeats=3, micro_batches=1):
    calls.append(("measure", repeats))
    return {"t_conv": 1e-4 * (1 + rank), "t_fc": 2e-5 * (1 + rank), "act_bytes": 900.0 + rank,
            "grad_bytes": 800.0 + rank, "codec_s": 1e-6, "cpu_parallelism": 1.0, "density": 0.5}


def fake_stages(split, x, micro_batches, max_convs_per_fc, repeats=3):
    calls.append(("stages", repeats))
    return {"conv_fwd_mb_s": 1e-3 * (1 + rank), "conv_bwd_mb_s": 2e-3, "fc_call_s": 1e-4, "fc_row_s": 1e-6}


def fake_cu(conv_shapes, fc_shapes, compression, fc_compression, momentum, repeats=3):
    calls.append(("compression", repeats))
    z = {"base_s": 1e-3 * (1 + rank), "per_payload_s": 1e-4}
    return {"compression_cost": {"dp": dict(z), "conv": dict(z), "fc": {"base_s": 0.0, "per_payload_s": 0.0}},
            "update_conv_s": 1e-4, "update_fc_s": 5e-4}


auto.measure = fake_measure
auto.measure_pipeline_stages = fake_stages
auto.measure_compression_and_update = fake_cu
auto.measure_together = lambda comm, split, x, **k: [1e-4 * (1 + rank) * len(x)] * auto.TOGETHER_WINDOWS
auto.measure_wait_cpu = lambda comm, **k: 0.1
costmodel.find_machines = lambda comm, **k: {
    "machine_of": list(MACHINE_OF), "machine_cores": [2.0] * (max(MACHINE_OF) + 1),
    "how": ["fake"] * n, "rank_cores": [2] * n}

cfg = load_config(None, ["layout=auto", "model.name=tiny", "train.batch_size=8", "compression.method=sgc",
                         "compression.density=0.05"])
split = split_model(build_model("tiny", seed=5))
xb = np.random.default_rng(3).random((8, 28, 28, 1), dtype=np.float32)
SLOW = {"alpha_s": 1e-3, "beta_Bps": 1.25e5, "pairs": [[0, 1, 1e-3, 1.25e5]], "bytes_sent_per_rank": [7 * r for r in range(n)]}
FAST = {"alpha_s": 1e-6, "beta_Bps": 1.25e10, "pairs": [[0, 1, 1e-6, 1.25e10]], "bytes_sent_per_rank": [0] * n}
for name, link, opm in (("slow", SLOW, True), ("fast", FAST, True), ("all_ranks", SLOW, False)):
    calls.clear()
    rep = auto.choose(world, split, xb, cfg, link_probe=lambda c, lk=link: dict(lk), one_per_machine=opm)
    out[name] = {"report": rep, "calls": list(calls)}

ranks = world.gather(out, root=0)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": ranks}), flush=True)
