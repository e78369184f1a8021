"""scripts/cluster/netbench.py's allreduce mode and --pin (loopback, no emulated cluster): the
bytes formula, and a pinned 2-rank run (the script checks the sum itself)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "cluster"))
import netbench  # noqa: E402
from conftest import mpirun  # noqa: E402


def test_allreduce_bytes_formula():
    assert netbench.formula("allreduce", 2, 1000) == (1000, 1000)  # 2 ranks: the buffer each way
    assert netbench.formula("allreduce", 4, 1000) == (1500, 1500)  # 2 (n - 1) / n
    assert netbench.formula("allreduce", 1, 1000) == (0, 0)


def test_allreduce_mode_runs_pinned_under_mpirun():
    p = mpirun(2, [os.path.join(ROOT, "scripts", "cluster", "netbench.py"), "--mode", "allreduce",
                   "--size", "4000", "--rounds", "2", "--pin"], timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    s = res["modes"]["allreduce"]
    assert res["world_size"] == 2 and s["bytes_sent_per_rank_per_round"] == 4000
    assert len(s["time_per_round_s"]["all"]) == 2
