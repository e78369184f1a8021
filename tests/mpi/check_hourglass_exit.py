"""Run under mpirun: a rank that ends while the others still use Horovod must not end their
process sets (Horovod's shutdown is global; hgsgc.hourglass.layout.Layout.close waits for every
rank first, explicitly or at exit). Rank 0 prints one ``RESULT {...}`` JSON line.

Usage: ``check_hourglass_exit.py close|atexit``. The FC ranks have nothing left to do: they tell
rank 0 so (a point-to-point message) and end, with ``layout.close()`` (``close``) or by simply
returning (``atexit``: the exit hook). Only then do the CONV ranks run ``N`` allreduces on their
process set, so without the wait the FC ranks' shutdown reaches them first ("Process set
provided does not exist"). tests/test_hourglass_auto_mpi.py asserts on the result.
"""
import json
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hgsgc.hourglass.layout import Layout  # noqa: E402

N = 50
mode = sys.argv[1]
world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
layout = Layout(world, 1)
if layout.is_fc:
    world.send("done", dest=0, tag=91)
    if mode == "close":
        layout.close()
    sys.exit(0)  # atexit: Layout's exit hook, then Horovod's shutdown
if rank == 0:
    world.recv(source=layout.plan.fc_ranks[0], tag=91)
layout.role_comm.Barrier()  # every CONV rank starts after the FC rank ended its work
sums, err = [], None
try:
    for i in range(N):
        sums.append(float(hvd.allreduce(tf.constant([float(rank + i)]), op=hvd.Sum,
                                        process_set=layout.process_set, name=f"exit_check_{i}")[0]))
except Exception as exc:  # what the bug looked like
    err = f"{type(exc).__name__}: {exc}"
C = layout.n_conv
want = [float(sum(range(C)) + C * i) for i in range(N)]
out = {"rank": rank, "ok": err is None and np.allclose(sums, want), "count": len(sums), "error": err}
every = layout.role_comm.gather(out, root=0)
if mode == "close":
    layout.close()
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "mode": mode, "conv": every}), flush=True)
