"""brk12: ``$HGSGC_RANKS_PER_NODE`` (the node hierarchy's host sizes) set on some ranks only, or
to different values on different ranks. Realistic: ``HGSGC_RANKS_PER_NODE=4 mpirun -H a:4,b:4``
without ``-x HGSGC_RANKS_PER_NODE``: Open MPI does not forward the launching shell's variables
to ranks started on other hosts.

Cases, in one process (the variable is read when an exchanger first plans its node exchange):
``unset`` (every rank discovers the hosts), ``same`` (every rank has 1), ``missing`` (only the
last rank has 1), ``differs`` (rank 0 has 1, the others the world size), then ``after`` (unset
again: the job still works after the refused cases). Each case trains 2 steps of SGC with
``hierarchy="node"`` in a tf.function on a fresh optimizer and records this rank's weights or
the error. Rank 0 prints ``RESULT {json}`` with every rank's outcomes (an MPI gather), so a hang
shows as a timeout."""
import json
import os

from mpi4py import MPI  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd.init()
import hgsgc  # noqa: E402

rank, size = hvd.rank(), hvd.size()
SHAPES = [(6, 4), (5,)]
ENV = {"unset": None, "same": "1", "missing": "1" if rank == size - 1 else None,
       "differs": "1" if rank == 0 else str(size), "after": None}


def train(case):
    os.environ.pop("HGSGC_RANKS_PER_NODE", None)
    if ENV[case] is not None:
        os.environ["HGSGC_RANKS_PER_NODE"] = ENV[case]
    vs = [tf.Variable(tf.ones(s), name=f"w{i}") for i, s in enumerate(SHAPES)]
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.5),
                                     compression=hgsgc.Compression.sgc(0.25, bits=32, hierarchy="node"))
    step = tf.function(lambda gs: opt.apply_gradients(zip(gs, vs)))
    try:
        for call in range(2):
            rng = np.random.default_rng(100 * call + rank)
            step([tf.constant(rng.normal(size=s).astype(np.float32)) for s in SHAPES])
    except Exception as exc:  # noqa: BLE001
        # the last line: a tf.function trace wraps the message in its "in user code" traceback
        last = str(exc).strip().splitlines()[-1].strip()
        return {"error": last if last.startswith("ValueError: ") else f"{type(exc).__name__}: {last}"}
    return {"w": [float(x) for v in vs for x in v.numpy().ravel()],
            "hosts": [list(h) for h in opt.hgsgc_exchanger.plan().hosts]}


out = {"rank": rank, **{case: train(case) for case in ENV}}
got = MPI.COMM_WORLD.gather(out, root=0)
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "ranks": got}), flush=True)
