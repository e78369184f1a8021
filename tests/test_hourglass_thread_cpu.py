"""The Hourglass runner writes the CPU per timed step of each thread (``thread_cpu``,
hgsgc.bench_threads) into summary.json, as the data-parallel ``hgsgc train`` does
(tests/test_bench_threads.py), for every rank and per role (CONV, FC): exact per-role combination
against a fixture, and under mpirun with 2, 3 and 4 ranks (1 FC rank) the recorded fields."""
import json
import os
import subprocess

import pytest

from hgsgc import bench_threads as bt
from hgsgc.hourglass.train import thread_cpu_by_role


def _res(main, hb, mpi, other, steps=3):
    groups = {"main": main, "hvd_background": hb, "mpi": mpi, "other": other}
    return {"steps": steps, "groups": {g: {"cpu_s_per_step": v, "threads": 1, "comms": ["python"]}
                                       for g, v in groups.items()},
            "hvd_mpi_cpu_s_per_step": hb + mpi}


def test_thread_cpu_by_role_exact():
    per_rank = [_res(0.010, 0.002, 0.0005, 0.003), _res(0.012, 0.004, 0.0, 0.001),
                _res(0.020, 0.001, 0.0025, 0.005, steps=4)]
    tc = thread_cpu_by_role(per_rank, conv_ranks=[0, 1], fc_ranks=[2])
    # all ranks: exactly bench_threads.combine_ranks (the keys hgsgc bench reads)
    assert {k: v for k, v in tc.items() if k != "roles"} == bt.combine_ranks(per_rank)
    conv, fc = tc["roles"]["conv"], tc["roles"]["fc"]
    assert conv["world_ranks"] == [0, 1] and fc["world_ranks"] == [2]
    assert "ranks" not in conv and "ranks" not in fc
    assert conv["steps"] == [3, 3] and fc["steps"] == [4]
    assert conv["groups"]["main"]["mean_cpu_s_per_step"] == pytest.approx(0.011, abs=1e-15)
    assert conv["groups"]["main"]["max_cpu_s_per_step"] == 0.012
    assert conv["hvd_mpi_cpu_s_per_step"]["mean"] == pytest.approx(0.00325, abs=1e-15)
    assert fc["groups"]["main"]["mean_cpu_s_per_step"] == 0.020
    assert fc["hvd_mpi_cpu_s_per_step"] == {"mean": 0.0035, "max": 0.0035}


def test_thread_cpu_by_role_missing_ranks():
    tc = thread_cpu_by_role([None, _res(0.01, 0.0, 0.0, 0.0), None], conv_ranks=[0, 1], fc_ranks=[2])
    assert tc["roles"]["conv"]["world_ranks"] == [1]
    assert tc["roles"]["fc"] is None
    assert thread_cpu_by_role([None, None], conv_ranks=[0], fc_ranks=[1]) is None


def test_bench_record_reads_hourglass_thread_cpu():
    from hgsgc import bench

    tc = thread_cpu_by_role([_res(0.010, 0.002, 0.0005, 0.003), _res(0.020, 0.004, 0.0015, 0.001)],
                            conv_ranks=[0], fc_ranks=[1])
    s = {"run_id": "x", "world_size": 2, "layout": "hourglass", "compression": {}, "steps": 4,
         "epochs": 1, "batch_size_per_rank": 8, "mean_step_time_s": 0.5, "wall_time_s": 3.0,
         "thread_cpu": tc}
    rec = bench._record({"summary": s, "config": {}, "epochs": []}, full_epoch_steps=10)
    assert rec["hvd_mpi_cpu_s_per_step"] == pytest.approx(0.004, abs=1e-15)
    assert rec["hvd_mpi_cpu_s_per_step_max_rank"] == 0.0055
    assert rec["thread_cpu_s_per_step"]["main"] == pytest.approx(0.015, abs=1e-15)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_hourglass_summary_has_thread_cpu_under_mpirun(np_, tmp_path):
    from conftest import MPIRUN, PY, ROOT

    cmd = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY, "-m", "hgsgc.cli",
                    "train", "configs/fashion_mnist.yaml", "layout=hourglass", "model.name=tiny",
                    "train.batch_size=16", "hourglass.micro_batches=2", "data.train_limit=2000",
                    "data.test_limit=200", "train.epochs=2", "train.max_steps_per_epoch=6",
                    "train.progress=false", "train.threads=1", "checkpoint.at_end=false",
                    f"run.out_dir={tmp_path}", "run.id=t"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.load(open(tmp_path / "t" / "summary.json"))
    assert s["layout"] == "hourglass"
    tc = s["thread_cpu"]
    # 2 epochs x 6 steps, the first (graph tracing) not timed: 11 timed steps on every rank,
    # CONV and FC alike
    assert tc["steps"] == [11] * np_ and len(tc["ranks"]) == np_
    conv_ranks, fc_ranks = list(range(np_ - 1)), [np_ - 1]
    assert s["hourglass"]["conv_ranks"] == conv_ranks and s["hourglass"]["fc_ranks"] == fc_ranks
    assert tc["roles"]["conv"]["world_ranks"] == conv_ranks
    assert tc["roles"]["fc"]["world_ranks"] == fc_ranks
    assert tc["roles"]["conv"]["steps"] == [11] * (np_ - 1) and tc["roles"]["fc"]["steps"] == [11]
    for g in bt.GROUPS:
        assert tc["groups"][g]["mean_cpu_s_per_step"] >= 0
        assert tc["groups"][g]["max_cpu_s_per_step"] >= tc["groups"][g]["mean_cpu_s_per_step"]
        # the FC role's figure is the FC rank's own record
        assert tc["roles"]["fc"]["groups"][g]["mean_cpu_s_per_step"] == \
            tc["ranks"][np_ - 1]["groups"][g]["cpu_s_per_step"]
    assert tc["groups"]["main"]["threads"] == [1] * np_
    assert tc["groups"]["hvd_background"]["threads"] == [1] * np_  # Horovod's background thread
    for r in tc["ranks"]:
        assert r["window_s"] > 0
        assert r["groups"]["main"]["cpu_s_per_step"] > 0  # every role's main thread computes its steps
        for t in r["threads"]:
            assert t["cpu_s_per_step"] >= 0 and t["stat_cpu_s_per_step"] >= 0
