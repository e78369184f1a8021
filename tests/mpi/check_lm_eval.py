"""Run under mpirun: the language model's sharded evaluation (hgsgc.tasks.LanguageModelTask.evaluate).

Usage: ``check_lm_eval.py DATA_DIR`` (a small PTB-format corpus). Every rank evaluates its
contiguous part of the valid and test streams and the sums are added with an MPI allreduce; rank 0
also evaluates every rank's part in this one process (the same shards, the sums added in numpy).
Then the weights change (as an epoch of training would change them) and both are done again: the
cached evaluation function (traced once per task) must see the new weights. Rank 0 prints one
JSON line with both results and the spread of the results across ranks.
"""
import json
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
from mpi4py import MPI  # noqa: E402

from hgsgc.config import load_config  # noqa: E402
from hgsgc.tasks import LanguageModelTask  # noqa: E402

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
cfg = load_config("configs/ptb_lstm/dense.yaml",
                  [f"data.path={sys.argv[1]}", "data.vocab_size=40", "model.units=8", "train.batch_size=2",
                   "data.bptt=3"])
tf.random.set_seed(7)
task = LanguageModelTask(cfg)
model = task.build_model()
# train.test_every_epoch=false: the valid split only, except at the last epoch (final=True)
task_v = LanguageModelTask(load_config("configs/ptb_lstm/dense.yaml", [
    f"data.path={sys.argv[1]}", "data.vocab_size=40", "model.units=8", "train.batch_size=2", "data.bptt=3",
    "train.test_every_epoch=false"]))
task_v.units = task.units
for v in model.variables:  # the same weights on every rank
    v.assign(world.bcast(v.numpy(), root=0))


def mpi_sum(x):
    out = np.zeros_like(np.asarray(x, np.float64))
    world.Allreduce(np.asarray(x, np.float64), out, op=MPI.SUM)
    return out


def one_process():
    """Every rank's part evaluated here, the per-part sums added (a fresh task: no cached function)."""
    ref = LanguageModelTask(cfg)
    ref.units = task.units  # (build_model sets it; the model is shared)
    parts = []
    for r in range(n):
        got = {}

        def keep(v, r=r):
            got.setdefault(r, []).append(np.asarray(v, np.float64))
            return np.asarray(v, np.float64)

        ref.evaluate(model, r, n, keep)
        parts.append(got[r])
    out = {}
    for i, split in enumerate(("valid", "test")):
        s = sum(p[i] for p in parts)
        out[f"{split}_loss"] = float(s[0] / s[1])
        out[f"{split}_perplexity"] = float(np.exp(s[0] / s[1]))
        out[f"{split}_tokens"] = float(s[1])
    return out


def main():
    res = {"size": n, "rounds": []}
    for _ in range(2):
        one_round(res)
    res["traced_functions"] = int(task._eval_fn[1].experimental_get_tracing_count())
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def one_round(res):
    got = task.evaluate(model, rank, n, mpi_sum)
    every = world.gather(got, root=0)
    ref = one_process() if rank == 0 else None
    valid_only = task_v.evaluate(model, rank, n, mpi_sum, final=False)
    last = task_v.evaluate(model, rank, n, mpi_sum, final=True)
    if rank == 0:
        res["rounds"].append({"sharded": got, "one_process": ref, "valid_only": valid_only, "last": last,
                              "spread_across_ranks": max(abs(e[k] - got[k]) for e in every for k in got)})
    for v in model.trainable_variables:  # new weights, the same on every rank
        v.assign(v + 0.05 * tf.reshape(tf.sign(tf.sin(tf.range(tf.size(v), dtype=tf.float32) + 1.0)), v.shape))


try:
    main()
except BaseException:  # an error on one rank ends every rank (never a hang)
    import traceback

    traceback.print_exc()
    sys.stderr.flush()
    world.Abort(1)
