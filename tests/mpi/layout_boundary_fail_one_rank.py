"""Run under mpirun (3 or 4 ranks), WITHOUT hgsgc.cli.run_guarded: a user's own
``Layout(world, "auto", cost=..., boundary=...)`` whose collective ``boundary`` callable fails on
one rank only (rank ``argv[1]``, bad input before any message) while the others are inside the
probe. The job must end with one line naming that rank, never hang (tests/test_robustness7.py)."""
import sys

import numpy as np
from mpi4py import MPI

from hgsgc.hourglass import costmodel
from hgsgc.hourglass.layout import Layout

world = MPI.COMM_WORLD
bad = int(sys.argv[1])
rng = np.random.default_rng(0)
a = np.maximum(rng.standard_normal((8, 32)), 0).astype(np.float32)
g = rng.standard_normal((8, 32)).astype(np.float32)
y = np.arange(8, dtype=np.int32)


def boundary():
    g_mine = g[:3] if world.Get_rank() == bad else g
    return costmodel.probe_boundary(world, "fp32", "fp32", a, g_mine, y, reps=2)


def cost():
    return costmodel.CostInputs(t_conv=1e-3, t_fc=1e-3, batch_size=8, act_bytes=1000.0,
                                grad_bytes=1000.0, conv_payload=100.0, fc_payload=100.0,
                                bandwidth=1e7)


Layout(world, "auto", cost=cost, boundary=boundary)
print("UNREACHABLE", flush=True)
