"""A real single-node Slurm (Debian's slurmctld, slurmd, munge) on localhost: the templates in
scripts/slurm/ are submitted with sbatch and run 2-rank jobs to completion, once with direct
launch (srun --mpi=pmix) and once with mpirun inside the allocation. The daemons are stopped by
PID even when the test fails (tests/slurm_local.py)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from slurm_local import local_slurm, missing_tools, wait_job

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _sbatch(env, template, args, out, extra_env=None):
    e = dict(env, **(extra_env or {}))
    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
           "--time=00:15:00", f"--output={out}", template] + args
    r = subprocess.run(cmd, env=e, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().split(";")[0]


def test_sbatch_templates_run_two_rank_jobs(tmp_path):
    assert not missing_tools(), f"missing {missing_tools()}: run scripts/install.sh (Debian slurmctld slurmd slurm-client munge)"
    assert os.geteuid() == 0, "the local Slurm test starts munged/slurmctld/slurmd and needs root (as make test runs)"
    from hgsgc.data.ptb import write_ptb

    ptb = tmp_path / "ptb"
    lines = [" ".join(f"w{(i * 5 + j) % 17}" for j in range(8)) for i in range(60)]
    write_ptb(str(ptb), {"train": lines, "valid": lines[:10], "test": lines[10:20]})
    runs = tmp_path / "runs"
    env = dict(os.environ, HGSGC_VENV=os.path.dirname(os.path.dirname(sys.executable)),
               PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    with local_slurm(tmp_path / "slurm") as senv:
        env.update(SLURM_CONF=senv["SLURM_CONF"])
        # the main job's config (the template's default; layout auto measures under srun --mpi=pmix)
        a = _sbatch(env, "scripts/slurm/train.sbatch",
                    ["configs/fashion_mnist_auto.yaml", "model.name=tiny", "data.train_limit=640",
                     "data.test_limit=200", "train.epochs=1", f"run.out_dir={runs}", "run.id=srun",
                     "train.progress=false"], tmp_path / "srun.out")
        b = _sbatch(env, "scripts/slurm/ptb.sbatch",
                    ["configs/ptb_lstm/dense.yaml", f"data.path={ptb}", "model.units=16", "data.bptt=5",
                     "train.batch_size=4", "train.epochs=1", f"run.out_dir={runs}", "run.id=mpirun",
                     "train.progress=false"], tmp_path / "mpirun.out", {"LAUNCH": "mpirun"})
        states = {j: wait_job(env, j, timeout=900) for j in (a, b)}
    for job, name, log in ((a, "srun", "srun.out"), (b, "mpirun", "mpirun.out")):
        text = (tmp_path / log).read_text()
        assert "JobState=COMPLETED" in states[job] and "ExitCode=0:0" in states[job], states[job] + text[-3000:]
        assert f"launch {name}" in text, text[-3000:]
        s = json.loads((runs / name / "summary.json").read_text())
        assert s["world_size"] == 2 and s["epochs"] == 1, s
    s = json.loads((runs / "srun" / "summary.json").read_text())
    assert s["layout_setting"] == "auto" and s["layout"] == s["layout_choice"]["layout"], s
    trunk_ranks = 2 if s["layout"] == "data_parallel" else 1      # the Hourglass on 2 ranks: 1 CONV + 1 FC
    assert s["steps"] == 640 // (trunk_ranks * 32) and s["model"] == "tiny" and 0.1 < s["final_test_accuracy"] <= 1.0
    p = json.loads((runs / "mpirun" / "summary.json").read_text())
    # 60 lines x 9 tokens (8 words + <eos>) = 540 tokens; 270 per rank; 4 rows of 67; (67 - 1) // 5 = 13 steps
    assert p["steps"] == 13 and p["task"] == "ptb" and p["final_test_perplexity"] > 1.0
