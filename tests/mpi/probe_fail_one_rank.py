"""Run under mpirun (3 or 4 ranks): the boundary probe of layout: auto fails on one rank only
(rank ``argv[1]``, bad input before any message) while the others probe: the job must end with
one line naming that rank, never hang (tests/test_robustness7.py)."""
import sys

import numpy as np
from mpi4py import MPI

from hgsgc.cli import run_guarded
from hgsgc.hourglass import costmodel


def body():
    world = MPI.COMM_WORLD
    bad = int(sys.argv[1])
    rng = np.random.default_rng(0)
    a = np.maximum(rng.standard_normal((8, 32)), 0).astype(np.float32)
    g = rng.standard_normal((8, 32)).astype(np.float32)
    y = np.arange(8, dtype=np.int32)
    costmodel.probe_boundary(world, "fp32", "fp32", a, g[:3] if world.Get_rank() == bad else g, y, reps=2)
    print("UNREACHABLE", flush=True)


run_guarded(body)
