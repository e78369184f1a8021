"""Run under mpirun (2 or 3 ranks): :func:`hgsgc.hourglass.costmodel.probe_boundary`, the boundary
message's round trip on the trainer's path, rank 0 (CONV side) <-> every other rank (FC side);
rank 0 prints one ``RESULT {...}`` JSON line, tests/test_hourglass_boundary_message_mpi.py asserts on it."""
import json

import numpy as np
from mpi4py import MPI

from hgsgc.hourglass import costmodel

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
rng = np.random.default_rng(0)
a = np.maximum(rng.standard_normal((16, 64)), 0).astype(np.float32)
g = rng.standard_normal((16, 64)).astype(np.float32)
y = np.arange(16, dtype=np.int32)
out = {"probes": {}}
for act, grad in (("fp32", "fp32"), ("sparse+q8", "sparse+q8")):
    out["probes"][f"{act}/{grad}"] = costmodel.probe_boundary(world, act, grad, a, g, y, reps=5)
err = None
try:  # bad input: one clear error on every rank, before any message
    costmodel.probe_boundary(world, "fp32", "fp32", a, g[:3], y)
except ValueError as exc:
    err = str(exc)
out["bad_input_error"] = err
world.Barrier()
gathered = world.gather(out, root=0)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": gathered}), flush=True)
