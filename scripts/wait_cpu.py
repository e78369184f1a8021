"""How much CPU a rank burns while it waits for a peer in Horovod / MPI (issue 11, the CPU share's
"waiting ranks use no CPU" assumption). Run: ``mpirun -np 2 python scripts/wait_cpu.py [DELAY_S]``.

Rank 1 sleeps ``DELAY_S`` (default 2) before joining each collective, so rank 0 waits about that
long inside it. For each way of waiting, rank 0 records its process CPU seconds (all threads:
``resource.getrusage(RUSAGE_SELF)`` user + system) and wall seconds over the wait, and prints
one JSON line ``WAITCPU {...}`` with the CPU seconds per wall second (cores kept busy) of:

* ``sleep``: rank 0 sleeps (Horovod initialised: its background thread's cycle only);
* ``hvd_allreduce``: ``hvd.allreduce`` of a 1000-float tensor (Horovod's background thread
  negotiates and Open MPI's progress loop polls until the peer arrives);
* ``mpi_allreduce``: mpi4py ``comm.Allreduce`` of the same buffer (Open MPI alone, blocking);
* ``hgsgc_wait``: ``faults.wait_for_peers`` on an ``Ibarrier`` (hgsgc's own wait: ``Testall``
  polled with sleeps of 50 us doubling up to 1 ms), as the Hourglass step waits;
  ``hgsgc_wait_recv``: the same on an ``Irecv`` from the peer (the step's boundary waits);
  ``hgsgc_wait_5ms``: pauses up to 5 ms (``take_turns``).

Each wait also records the CPU seconds of each thread (``/proc/self/task/*/stat``; ``main`` is
the Python thread, the others by their names) to say which thread burns it.

The runtime defaults of hgsgc (``hgsgc.runtime.apply_defaults``: Open MPI's
``mpi_yield_when_idle=1``, Horovod's 1 ms cycle) are applied first, as in every hgsgc command.
"""
import json
import os
import resource
import sys
import time

from hgsgc.runtime import apply_defaults

apply_defaults()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hgsgc.faults import wait_for_peers  # noqa: E402

DELAY = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
world = MPI.COMM_WORLD
hvd.init(comm=world)
rank = world.Get_rank()
x = tf.ones([1000])
buf, out_buf = np.ones(1000, np.float32), np.zeros(1000, np.float32)


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu():
    """{thread name: CPU seconds} of this process's threads (/proc/self/task/*/stat utime + stime)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        key = "main" if int(tid) == os.getpid() else name
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def ways():
    return {
        "sleep": lambda: time.sleep(DELAY),
        "hvd_allreduce": lambda: float(tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))),
        "mpi_allreduce": lambda: world.Allreduce(buf, out_buf),
        "hgsgc_wait": lambda: wait_for_peers([world.Ibarrier()], None, "wait_cpu", 600.0),
        "hgsgc_wait_recv": lambda: wait_for_peers([world.Irecv(out_buf, source=1, tag=5)], [1], "wait_cpu", 600.0),
        "hgsgc_wait_5ms": lambda: wait_for_peers([world.Ibarrier()], None, "wait_cpu", 600.0, max_pause_s=5e-3),
    }


def peer(name, fn):
    """Rank 1's side of each way, after its delay."""
    if name == "sleep":
        return
    if name == "hgsgc_wait_recv":
        world.Send(buf, dest=0, tag=5)
        return
    fn()


hvd.allreduce(x, op=hvd.Sum)   # warm-up: Horovod's first collective builds its state
results = {}
for name, fn in ways().items():
    per = []
    for _ in range(REPS):
        world.Barrier()
        if rank == 1:
            time.sleep(DELAY)
            peer(name, fn)
            continue
        th0, c0, t0 = thread_cpu(), cpu_s(), time.perf_counter()
        fn()
        wall, cpu, th1 = time.perf_counter() - t0, cpu_s() - c0, thread_cpu()
        threads = {k: round(v - th0.get(k, 0.0), 3) for k, v in th1.items() if v - th0.get(k, 0.0) > 0}
        per.append({"wall_s": wall, "cpu_s": cpu, "cores": cpu / wall, "threads_cpu_s": threads})
    world.Barrier()
    results[name] = per
if rank == 0:
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    env = {k: os.environ.get(k) for k in ("OMPI_MCA_mpi_yield_when_idle", "HOROVOD_CYCLE_TIME")}
    print("WAITCPU " + json.dumps({"delay_s": DELAY, "reps": REPS, "loadavg": load, "env": env,
                                   "results": results,
                                   "median_cores": {k: float(np.median([p["cores"] for p in v]))
                                                    for k, v in results.items()}}), flush=True)
hvd.shutdown()
