"""Process settings hgsgc chooses for Horovod and Open MPI (applied before ``hvd.init()``).

Measured on the emulated cluster (``docs/benchmarks/step_profile.md``): with Horovod's default
cycle of 1 ms, its background thread runs one negotiation collective per cycle even when no
tensor is pending, and Open MPI busy-polls while it waits for the other ranks. On a rank that has
one core, that thread took 12-13 ms of CPU per 15-16 ms of TensorFlow compute in steps that
exchange nothing (local steps of SGC with delay, or any step's compute phase). Two settings
remove it:

* ``OMPI_MCA_mpi_yield_when_idle=1``: Open MPI's progress loop yields the core
  (``sched_yield``) when it finds nothing to do, so a waiting collective no longer competes with
  TensorFlow for the core (the thread's CPU per idle step fell from ~12.5 ms to ~0.7 ms).
* ``HOROVOD_CYCLE_TIME=1`` (ms, Horovod 0.28's own default, set explicitly so that the
  performance model reads the same value, :func:`hgsgc.perfmodel.horovod_cycle_s`). An earlier
  version set 5 ms to cut idle negotiation rounds; with ``yield_when_idle`` that buys nothing:
  on 2 pinned emulated hosts with dedicated cores (load ~2, docs/benchmarks/step_profile.md,
  "Quiet machine") the background thread's CPU per idle 16 ms compute step was 0.36-0.45 ms at
  5 ms and 0.37-0.48 ms at 1 ms, while every collective waits on average half a cycle: the SGC
  delay-1 training step took 24.3-26.3 ms at 5 ms and 21.4-24.8 ms at 1 ms (same link, minutes
  apart; 1.5-4 ms less per step).

Both cut CPU; on the shared 2-core benchmark machine the wall-clock effect was mixed (one pair
of runs was slower with them: a yielding thread also hands the core to other processes), so the
wall-clock gain is established only where ranks have dedicated cores; see step_profile.md.

:func:`apply_defaults` sets each only where the environment does not already (a user's or a
launcher's own value always wins), and only has an effect before MPI is initialised: Open MPI
reads ``OMPI_MCA_*`` and Horovod reads ``HOROVOD_*`` from the process environment in
``hvd.init()``. ``hgsgc`` commands call it first; library users call it before ``hvd.init()``
(or export the variables). ``HGSGC_RUNTIME_DEFAULTS=0`` turns it off.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, MutableMapping, Optional

DEFAULTS: Dict[str, str] = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "HOROVOD_CYCLE_TIME": "1",
}


def horovod_initialized() -> bool:
    """True if Horovod (and so MPI) is already initialised in this process."""
    mod = sys.modules.get("horovod.tensorflow")
    if mod is None:
        return False
    try:
        return bool(mod.is_initialized())
    except Exception:  # pragma: no cover - a Horovod without is_initialized
        return False


def apply_defaults(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set :data:`DEFAULTS` in ``environ`` (default ``os.environ``) where not already set.

    Returns:
        ``{name: value}`` of the variables this call set (empty if all were set already, if
        ``HGSGC_RUNTIME_DEFAULTS=0``, or if Horovod is already initialised, when setting them
        would have no effect).
    """
    env = os.environ if environ is None else environ
    if env.get("HGSGC_RUNTIME_DEFAULTS", "1") == "0":
        return {}
    if environ is None and horovod_initialized():
        return {}
    done = {}
    for k, v in DEFAULTS.items():
        if k not in env:
            env[k] = v
            done[k] = v
    return done


def _launcher_int(names, environ, default: int) -> int:
    """The first of the variables ``names`` set to an integer in ``environ`` (default
    ``os.environ``), else ``default``."""
    env = os.environ if environ is None else environ
    for var in names:
        try:
            return int(env[var])
        except (KeyError, ValueError):
            continue
    return default


def world_rank(environ: Optional[MutableMapping[str, str]] = None) -> int:
    """This process's MPI rank from the launcher's environment (Open MPI, PMI, PMIx, Slurm); 0."""
    return _launcher_int(("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"), environ, 0)


def world_size(environ: Optional[MutableMapping[str, str]] = None) -> int:
    """How many processes the launcher started (Open MPI, PMI, PMIx, Slurm), from its environment;
    1 outside a launcher."""
    return max(1, _launcher_int(("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"), environ, 1))


def pin_to_core(environ: Optional[MutableMapping[str, str]] = None) -> Optional[int]:
    """With ``HGSGC_PIN_CORES=1``: pin this process to core ``rank % cores`` (of the cores it may
    use) and return that core; otherwise None.

    For the "clean" benchmark cells (issue 10): each emulated host's rank on a core of its own, as
    ``taskset -c`` would do. Call it before TensorFlow, Horovod or MPI start threads (they inherit
    the mask); ``hgsgc`` commands call it right after :func:`apply_defaults`. Pair it with
    ``train.threads=1``.
    """
    env = os.environ if environ is None else environ
    if env.get("HGSGC_PIN_CORES", "0") != "1" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[world_rank(env) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core
