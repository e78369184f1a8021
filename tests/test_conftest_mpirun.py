"""conftest.mpirun on a timeout ends the whole job, ranks included (session 14: subprocess.run's
timeout killed mpirun alone, and its ranks went on, orphaned, burning CPU for the rest of the
suite)."""
import subprocess
import uuid

import pytest

from conftest import mpirun


def _running(token):
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout  # -ww: whole lines
    return [ln for ln in ps.splitlines() if token in ln and "ps -eo" not in ln]


@pytest.mark.mpi
def test_a_timed_out_launch_leaves_no_rank_running():
    token = uuid.uuid4().hex
    with pytest.raises(subprocess.TimeoutExpired) as err:
        # the ranks ignore nothing: a plain sleep, tagged so that ps finds exactly them
        mpirun(2, ["-c", f"import time  # {token}\ntime.sleep(600)"], timeout=8)
    assert err.value.timeout == 8
    assert _running(token) == []
