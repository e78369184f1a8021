"""Run under mpirun (2-4 ranks): the boundary probe of layout: auto fails on one rank only
(rank ``argv[1]``, bad input before any message) while the others probe: the job must end with
one line naming that rank, never hang (tests/test_robustness7.py).

``argv[2]``: ``cli`` (default) probes directly under :func:`hgsgc.cli.run_guarded`, as
``hgsgc train`` does; ``layout`` is a user's own ``Layout(world, "auto", cost=..., boundary=...)``
WITHOUT ``run_guarded``, the probe being its collective ``boundary`` callable."""
import sys

import numpy as np
from mpi4py import MPI

from hgsgc.cli import run_guarded
from hgsgc.hourglass import costmodel
from hgsgc.hourglass.layout import Layout

world = MPI.COMM_WORLD
bad = int(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "cli"
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


if mode == "layout":
    Layout(world, "auto", cost=cost, boundary=boundary)
else:
    run_guarded(boundary)
print("UNREACHABLE", flush=True)
