import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
PY = sys.executable
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]

# Every MPI job the tests start (through mpirun() below or their own subprocess) runs with the
# Open MPI setting `hgsgc` itself applies before MPI starts (hgsgc/runtime.py): the progress loop
# yields the core while it waits. Without it, 3-5 ranks oversubscribed on 2 cores busy-poll each
# other's cores away (a 2-rank launch took 122 s instead of 24 s at load ~50, st9, session 9).
# A value already in the environment wins, as in hgsgc.runtime.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def load_script(*parts):
    """Import a file under ``scripts/`` (not a package) as a module, e.g.
    ``load_script("cluster", "perfmodel_validation.py")``."""
    import importlib.util

    path = os.path.join(ROOT, "scripts", *parts)
    spec = importlib.util.spec_from_file_location(os.path.splitext(parts[-1])[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mpirun(np_, args, timeout=300, env=None):
    """Run ``args`` (a python script and its arguments) under mpirun with np_ ranks."""
    e = dict(os.environ)
    e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    cmd = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL",
                    "-x", "OMPI_MCA_mpi_yield_when_idle"]
    for k in (env or {}):
        cmd += ["-x", k]
    cmd += [PY] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)


def mpi_result(np_, args, timeout=400):
    """Run a tests/mpi script under mpirun; return the JSON of its ``RESULT {...}`` line.

    Fails the test with the run's output when it exits non-zero or prints no result, and checks
    that the result reports ``np_`` ranks.
    """
    import json

    p = mpirun(np_, args, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["size"] == np_ and ("ranks" not in out or len(out["ranks"]) == np_)
    return out


@pytest.fixture
def run_mpi():
    return mpirun
