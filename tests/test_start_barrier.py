"""The bench's start barrier for shared compute-only copies (hgsgc.bench_threads.start_barrier) and
the overlap of the copies' timed windows (hgsgc.bench.timed_overlap)."""
import json
import os
import subprocess
import sys

import pytest

from hgsgc import bench, bench_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import json, sys, time
from hgsgc import bench_threads
rec = bench_threads.start_barrier()
print(json.dumps({**rec, "after_unix_s": time.time()}))
"""


def test_parse_start_barrier():
    assert bench_threads.parse_start_barrier("/tmp/b:4:30") == ("/tmp/b", 4, 30.0)
    assert bench_threads.parse_start_barrier("/tmp/b:3") == ("/tmp/b", 3, 600.0)
    assert bench_threads.parse_start_barrier("/a:b/c:2:1.5") == ("/a:b/c", 2, 1.5)


@pytest.mark.parametrize("value", ["/tmp/b", "/tmp/b:x", "/tmp/b:0", ":3", "/tmp/b:2:0", "/tmp/b:2:-1"])
def test_parse_start_barrier_rejects(value):
    with pytest.raises(ValueError, match="HGSGC_START_BARRIER"):
        bench_threads.parse_start_barrier(value)


def test_start_barrier_unset_is_a_no_op(monkeypatch):
    monkeypatch.delenv(bench_threads.START_BARRIER_ENV, raising=False)
    assert bench_threads.start_barrier() is None
    assert bench_threads.start_barrier("") is None


@pytest.mark.parametrize("copies", [2, 3])
def test_start_barrier_releases_every_copy_after_the_last_arrives(tmp_path, copies):
    """Each process leaves the barrier only after every process has entered it: every release time
    is at or after the latest arrival (an ordering, not a duration)."""
    env = dict(os.environ, PYTHONPATH=ROOT,
               **{bench_threads.START_BARRIER_ENV: f"{tmp_path / 'b'}:{copies}:120"})
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(copies)]
    recs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    last_arrival = max(r["arrived_unix_s"] for r in recs)
    assert all(r["released_unix_s"] >= last_arrival for r in recs)
    assert all(r["copies"] == copies for r in recs)
    assert len(os.listdir(tmp_path / "b")) == copies


def test_start_barrier_times_out_with_a_clear_error(tmp_path):
    with pytest.raises(TimeoutError, match=r"HGSGC_START_BARRIER=.*1 of 2 processes"):
        bench_threads.start_barrier(f"{tmp_path}:2:0.05")


def test_timed_overlap_is_intersection_over_union():
    w = lambda a, b: {"released_unix_s": a, "timed_end_unix_s": b}  # noqa: E731
    assert bench.timed_overlap([w(10.0, 12.0), w(10.0, 12.0)]) == 1.0
    assert bench.timed_overlap([w(10.0, 12.0), w(11.0, 13.0)]) == pytest.approx(1.0 / 3.0)
    assert bench.timed_overlap([w(10.0, 11.0), w(12.0, 13.0), w(10.5, 12.5)]) == 0.0
    assert bench.timed_overlap([w(10.0, 14.0), w(11.0, 12.0), w(10.0, 13.0)]) == pytest.approx(0.25)
    assert bench.timed_overlap([w(10.0, 12.0), None]) is None
    assert bench.timed_overlap([w(10.0, 12.0), {"released_unix_s": 1.0, "timed_end_unix_s": None}]) is None


def _spec(**kw):
    return {"name": "t", "methods": [{"name": "a", "config": "configs/fashion_mnist_dense.yaml"}], **kw}


@pytest.mark.parametrize("bad", [1, 0, -3, 2.5, True, "4"])
def test_compute_only_steps_rejects(bad):
    with pytest.raises(bench.SpecError, match="compute_only_steps must be an integer >= 2"):
        bench.load_spec(_spec(compute_only_steps=bad))


def test_compute_only_steps_reaches_the_compute_only_run(monkeypatch, tmp_path):
    """The compute-only processes get train.max_steps_per_epoch=N after the cell's overrides (the
    last override wins), and the shared copies get the barrier variable."""
    spec = bench.load_spec(_spec(compute_only_steps=20, runs_dir=str(tmp_path),
                                 overrides=["train.max_steps_per_epoch=5"]))
    seen = []

    class Stop(Exception):
        pass

    def fake_popen(args, env=None, **kw):
        seen.append((args, env))
        raise Stop()

    monkeypatch.setattr(bench.subprocess, "Popen", fake_popen)
    rec = bench.run_compute_only(spec["methods"][0], spec, copies=3)
    assert rec["status"] == "failed" and "Stop" in rec["error"]
    args, env = seen[0]
    assert args.index("train.max_steps_per_epoch=20") > args.index("train.max_steps_per_epoch=5")
    path, n, timeout = bench_threads.parse_start_barrier(env[bench_threads.START_BARRIER_ENV])
    assert (n, timeout) == (3, float(spec["timeout_s"])) and path.startswith(str(tmp_path))
    seen.clear()
    bench.run_compute_only(spec["methods"][0], bench.load_spec(_spec(runs_dir=str(tmp_path))), copies=1)
    args, env = seen[0]
    assert not any(a.startswith("train.max_steps_per_epoch") for a in args)
    assert bench_threads.START_BARRIER_ENV not in env


def test_train_copies_wait_at_the_barrier_and_record_their_window(tmp_path):
    """Two plain `hgsgc train` processes (world of one each) with the barrier set: each summary.json
    has its window, each released after both arrived, its timed steps ending after its release, and
    the overlap of the two windows is in (0, 1]."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               **{bench_threads.START_BARRIER_ENV: f"{tmp_path / 'barrier'}:2:240"})
    for k in [k for k in env if k.startswith(("OMPI_", "PMIX_"))]:
        env.pop(k)
    args = ["configs/fashion_mnist_sgc.yaml", "model.name=tiny", "data.train_limit=1000", "data.test_limit=100",
            "train.epochs=1", "train.max_steps_per_epoch=5", "train.progress=false", "train.threads=1",
            "checkpoint.at_end=false", f"run.out_dir={tmp_path}"]
    procs = [subprocess.Popen([sys.executable, "-m", "hgsgc.cli", "train", *args, f"run.id=c{i}"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    wins = [json.load(open(tmp_path / f"c{i}" / "summary.json"))["start_barrier"] for i in range(2)]
    last_arrival = max(w["arrived_unix_s"] for w in wins)
    for w in wins:
        assert w["copies"] == 2
        assert w["released_unix_s"] >= last_arrival
        assert w["timed_end_unix_s"] > w["released_unix_s"]
    assert 0.0 < bench.timed_overlap(wins) <= 1.0


def test_bench_markdown_shows_the_overlap_of_the_shared_copies():
    cell = {"method": "m", "role": "ours", "status": "ok", "hosts": 4, "bandwidth": "100mbit",
            "mean_step_time_s": 0.1, "time_per_epoch_s": 10.0, "bytes_sent_per_step_per_rank": 1000.0,
            "iface_tx_bytes_per_step_per_rank": 1100.0, "compression_ratio": 100.0,
            "final_test_accuracy": 0.5, "load_before": [1.0], "vs_compute_only_shared": 1.25}
    results = {"name": "t", "spec": {"overrides": [], "mpi_args": []}, "started_utc": "x",
               "machine": {"cpus": 2}, "compute_only": {},
               "compute_only_shared": {"m@4": {"status": "ok", "mean_step_time_s": 0.08, "timed_overlap": 0.5}},
               "cells": [cell], "groups": [{"hosts": 4, "bandwidth": "100mbit", "dense": "-", "best_baseline": "-"}]}
    assert "| 80.0 (overlap 0.50) | 1.25x |" in bench.markdown(results)


def test_a_failed_shared_copy_stops_the_others_waiting_at_the_barrier(tmp_path):
    """One copy fails before the barrier; the others would wait there until the spec's timeout: the
    bench kills them at once and reports the failed copy's error."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/sh
case "$*" in
  *compute-*-0\\ *|*compute-*-0) echo "hgsgc: error: copy 0 cannot start" >&2; exit 2;;
esac
exec {sys.executable} -c "from hgsgc import bench_threads; bench_threads.start_barrier()"
""")
    stub.chmod(0o755)
    spec = bench.load_spec(_spec(runs_dir=str(tmp_path / "runs"), timeout_s=600))
    os.makedirs(spec["runs_dir"])
    rec = bench.run_compute_only(spec["methods"][0], spec, python=str(stub), copies=3)
    assert rec["status"] == "failed"
    assert rec["error"] == "hgsgc: error: copy 0 cannot start (the other 2 copies stopped)"
    assert not [d for d in os.listdir(spec["runs_dir"]) if d.startswith(".barrier")]  # cleaned up


def test_compute_only_factor_script(monkeypatch, capsys, tmp_path):
    """scripts/compute_only_factor.py: alone, then N copies with the requested steps; factor = alone / shared."""
    from conftest import load_script

    mod = load_script("compute_only_factor.py")
    calls = []

    def fake(method, spec, copies=1):
        calls.append((method["name"], copies, spec["compute_only_steps"]))
        return {"status": "ok", "mean_step_time_s": 0.04 if copies == 1 else 0.32, "timed_overlap": None if copies == 1
                else 0.8, "steps": 11}

    monkeypatch.setattr(bench, "run_compute_only", fake)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nruns_dir: {tmp_path}/runs\nmethods:\n"
                    "  - {name: a, config: configs/fashion_mnist_dense.yaml}\n")
    assert mod.main([str(spec), "a", "8", "--steps", "11"]) == 0
    assert calls == [("a", 1, 11), ("a", 8, 11)]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {"factor": pytest.approx(0.125)}
