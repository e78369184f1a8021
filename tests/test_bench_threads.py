"""Per-thread CPU per step from /proc (hgsgc.bench_threads): parsing and grouping against a fixture
/proc tree (exact values), and under mpirun (2 and 3 ranks) that every cell's summary has the
fields, non-negative."""
import json
import os
import subprocess

import pytest

from hgsgc import bench_threads as bt

PID = 4242


def _stat(tid, comm, utime, stime):
    # fields 1..52 of a real line; utime / stime are fields 14 / 15
    rest = ["S", "1", str(tid), str(tid), "0", "-1", "4194368", "100", "0", "0", "0",
            str(utime), str(stime), "0", "0", "20", "0", "7", "0", "123456"] + ["0"] * 32
    return f"{tid} ({comm}) " + " ".join(rest) + "\n"


def _write(root, tid, comm, utime, stime, ns=None, wchan="futex_do_wait", wait=555):
    d = root / str(PID) / "task" / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(_stat(tid, comm, utime, stime))
    if ns is not None:
        (d / "schedstat").write_text(f"{ns} {wait} 77\n")
    (d / "wchan").write_text(wchan)


def _remove(root, tid):
    d = root / str(PID) / "task" / str(tid)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def test_parse_stat_comm_with_spaces_and_parentheses():
    line = _stat(17, "a (b) c)", 123, 45)
    assert bt.parse_stat(line) == ("a (b) c)", 123, 45)


def test_parse_stat_of_this_process():
    comm, ut, st = bt.parse_stat(open(f"/proc/{os.getpid()}/stat").read())
    assert comm == open(f"/proc/{os.getpid()}/comm").read().strip()
    assert ut >= 0 and st >= 0


@pytest.mark.parametrize("bad", ["", "17 python S 1 2", "17 (python) S 1 2 3"])
def test_parse_stat_malformed(bad):
    with pytest.raises(ValueError):
        bt.parse_stat(bad)


def test_parse_schedstat():
    assert bt.parse_schedstat("1234567 89 10\n") == 1234567


def test_event_loop_wchan():
    assert bt.is_event_loop_wchan("poll_schedule_timeout.constprop.0")
    assert bt.is_event_loop_wchan("do_epoll_wait")
    assert bt.is_event_loop_wchan("do_select")
    assert not bt.is_event_loop_wchan("futex_do_wait")
    assert not bt.is_event_loop_wchan("0")
    assert not bt.is_event_loop_wchan(None)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _fixture(tmp_path):
    """main (tid = pid), 2 MPI event-loop threads and a TF pool thread before hvd.init; hvd.init
    starts Horovod's background thread (4300) and one more (4301)."""
    root = tmp_path
    _write(root, PID, "python", 10, 5, ns=150_000_000, wchan="0")
    _write(root, 4250, "python", 0, 0, ns=1_000, wchan="poll_schedule_timeout.constprop.0")
    _write(root, 4251, "python", 0, 0, ns=2_000, wchan="do_epoll_wait")
    _write(root, 4260, "python", 1, 0, ns=10_000_000, wchan="futex_do_wait")
    g = bt.ThreadGroups(proc=str(root), pid=PID)
    g.before_init()
    _write(root, 4300, "python", 0, 0, ns=0, wchan="0")
    _write(root, 4301, "python", 0, 0, ns=0, wchan="futex_do_wait")
    g.after_init()
    return root, g


def test_groups(tmp_path):
    root, g = _fixture(tmp_path)
    assert g.hvd == [4300, 4301]
    assert g.mpi_before == [4250, 4251]
    assert [g.group(t) for t in (PID, 4250, 4251, 4260, 4300, 4301, 9999)] == \
        ["main", "mpi", "mpi", "other", "hvd_background", "mpi", "other"]


def test_step_cpu_exact(tmp_path):
    root, g = _fixture(tmp_path)
    clock = Clock()
    sc = bt.StepCPU(g, proc=str(root), pid=PID, clock=clock)
    assert not sc.running
    sc.start()
    assert sc.running
    # 10 steps: main +20 ticks / +0.2 s, background +3 ticks / +0.031 s, mpi 4250 +1 tick / +0.004 s
    _write(root, PID, "python", 25, 10, ns=350_000_000, wchan="0")
    _write(root, 4300, "python", 2, 1, ns=31_000_000, wchan="0")
    _write(root, 4250, "python", 1, 0, ns=4_001_000, wchan="poll_schedule_timeout.constprop.0")
    _write(root, 4400, "python", 2, 0, ns=20_000_000)  # a TF thread started inside the window
    _remove(root, 4301)  # ended inside the window: its CPU is lost, counted
    clock.t = 101.5
    sc.stop(10)
    assert not sc.running
    # a second window (next epoch): 5 more steps, background +0.010 s
    clock.t = 200.0
    sc.start()
    _write(root, 4300, "python", 3, 1, ns=41_000_000, wchan="0")
    clock.t = 200.5
    sc.stop(5)
    r = sc.result(tick_s=0.01)
    assert r["steps"] == 15 and r["threads_ended"] == 1 and r["tick_s"] == 0.01
    assert r["window_s"] == pytest.approx(2.0, abs=1e-12)
    G = r["groups"]
    assert G["main"]["cpu_s_per_step"] == pytest.approx(0.2 / 15, abs=1e-15)
    assert G["main"]["stat_cpu_s_per_step"] == pytest.approx(20 * 0.01 / 15, abs=1e-15)
    assert G["hvd_background"]["cpu_s_per_step"] == pytest.approx(0.041 / 15, abs=1e-15)
    assert G["hvd_background"]["stat_cpu_s_per_step"] == pytest.approx(4 * 0.01 / 15, abs=1e-15)
    assert G["mpi"]["cpu_s_per_step"] == pytest.approx(0.004 / 15, abs=1e-15)
    assert G["mpi"]["threads"] == 2  # 4250 and 4251 (4301 ended)
    assert G["other"]["cpu_s_per_step"] == pytest.approx(0.020 / 15, abs=1e-15)
    assert G["other"]["threads"] == 2 and G["other"]["comms"] == ["python"]
    assert all(G[x]["source"] == "schedstat" for x in bt.GROUPS)
    assert r["hvd_mpi_cpu_s_per_step"] == pytest.approx(0.045 / 15, abs=1e-15)
    by_tid = {t["tid"]: t for t in r["threads"]}
    assert by_tid[4250]["wchan_at_init"] == "poll_schedule_timeout.constprop.0"
    assert by_tid[4300]["group"] == "hvd_background"


def test_runqueue_wait_exact(tmp_path):
    root, g = _fixture(tmp_path)
    sc = bt.StepCPU(g, proc=str(root), pid=PID, clock=Clock())
    sc.start()
    _write(root, PID, "python", 10, 5, ns=150_000_000, wchan="0", wait=8_000_555)  # +8 ms waiting
    _write(root, 4260, "python", 1, 0, ns=10_000_000, wait=2_000_555)  # +2 ms
    sc.stop(4)
    r = sc.result(tick_s=0.01)
    assert r["groups"]["main"]["runqueue_wait_s_per_step"] == pytest.approx(0.002, abs=1e-15)
    assert r["groups"]["other"]["runqueue_wait_s_per_step"] == pytest.approx(0.0005, abs=1e-15)
    assert r["groups"]["hvd_background"]["runqueue_wait_s_per_step"] == 0.0
    assert bt.parse_schedstat_wait("1 22 3") == 22
    c = bt.combine_ranks([r, r])
    assert c["groups"]["main"]["mean_runqueue_wait_s_per_step"] == pytest.approx(0.002, abs=1e-15)


def test_step_cpu_ticks_without_schedstat(tmp_path):
    root = tmp_path
    _write(root, PID, "python", 0, 0)
    g = bt.ThreadGroups(proc=str(root), pid=PID)
    g.before_init()
    _write(root, 4300, "hvd bg", 0, 0)
    g.after_init()
    sc = bt.StepCPU(g, proc=str(root), pid=PID, clock=Clock())
    sc.start()
    _write(root, 4300, "hvd bg", 3, 2)
    sc.stop(4)
    r = sc.result(tick_s=0.01)
    assert r["groups"]["hvd_background"]["source"] == "stat"
    assert r["groups"]["hvd_background"]["cpu_s_per_step"] == pytest.approx(0.05 / 4, abs=1e-15)
    assert r["groups"]["hvd_background"]["comms"] == ["hvd bg"]
    assert r["hvd_mpi_cpu_s_per_step"] == pytest.approx(0.0125, abs=1e-15)


def test_stop_without_start_is_a_no_op(tmp_path):
    root, g = _fixture(tmp_path)
    sc = bt.StepCPU(g, proc=str(root), pid=PID, clock=Clock())
    sc.stop(7)
    assert sc.steps == 0 and sc.per_tid == {}


def _res(main, hb, mpi, other):
    groups = {"main": main, "hvd_background": hb, "mpi": mpi, "other": other}
    return {"steps": 3, "groups": {g: {"cpu_s_per_step": v, "threads": 1, "comms": ["python"]}
                                   for g, v in groups.items()},
            "hvd_mpi_cpu_s_per_step": hb + mpi}


def test_combine_ranks_exact():
    c = bt.combine_ranks([_res(0.010, 0.002, 0.0005, 0.003), None, _res(0.012, 0.004, 0.0, 0.001)])
    assert c["steps"] == [3, 3]
    assert c["groups"]["hvd_background"]["mean_cpu_s_per_step"] == pytest.approx(0.003, abs=1e-15)
    assert c["groups"]["hvd_background"]["max_cpu_s_per_step"] == 0.004
    assert c["hvd_mpi_cpu_s_per_step"]["mean"] == pytest.approx(0.00325, abs=1e-15)
    assert c["hvd_mpi_cpu_s_per_step"]["max"] == 0.004
    assert len(c["ranks"]) == 2
    assert bt.combine_ranks([None, None]) is None


def test_bench_record_copies_thread_cpu():
    from hgsgc import bench

    tc = bt.combine_ranks([_res(0.010, 0.002, 0.0005, 0.003)])
    s = {"run_id": "x", "world_size": 1, "layout": "data_parallel", "compression": {}, "steps": 4,
         "epochs": 1, "batch_size_per_rank": 8, "mean_step_time_s": 0.5, "wall_time_s": 3.0,
         "thread_cpu": tc}
    rec = bench._record({"summary": s, "config": {}, "epochs": []}, full_epoch_steps=10)
    assert rec["hvd_mpi_cpu_s_per_step"] == 0.0025
    assert rec["hvd_mpi_cpu_s_per_step_max_rank"] == 0.0025
    assert rec["thread_cpu_s_per_step"] == {"main": 0.010, "hvd_background": 0.002, "mpi": 0.0005,
                                            "other": 0.003}
    assert rec["thread_cpu"] is tc


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_train_summary_has_thread_cpu_under_mpirun(np_, tmp_path):
    from conftest import MPIRUN, PY, ROOT

    cmd = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY, "-m", "hgsgc.cli",
                    "train", "configs/fashion_mnist_sgc.yaml", "model.name=tiny", "data.train_limit=2000",
                    "data.test_limit=200", "train.epochs=2", "train.max_steps_per_epoch=6",
                    "train.progress=false", "train.threads=1", "checkpoint.at_end=false",
                    f"run.out_dir={tmp_path}", "run.id=t"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.load(open(tmp_path / "t" / "summary.json"))
    tc = s["thread_cpu"]
    # 2 epochs x 6 steps, the first (graph tracing) not timed: 11 timed steps on every rank
    assert tc["steps"] == [11] * np_ and len(tc["ranks"]) == np_
    for g in bt.GROUPS:
        assert tc["groups"][g]["mean_cpu_s_per_step"] >= 0
        assert tc["groups"][g]["max_cpu_s_per_step"] >= tc["groups"][g]["mean_cpu_s_per_step"]
    assert tc["groups"]["main"]["threads"] == [1] * np_
    assert tc["groups"]["hvd_background"]["threads"] == [1] * np_  # Horovod's background thread
    assert tc["hvd_mpi_cpu_s_per_step"]["mean"] >= 0
    for r in tc["ranks"]:
        assert r["window_s"] > 0
        for t in r["threads"]:
            assert t["cpu_s_per_step"] >= 0 and t["stat_cpu_s_per_step"] >= 0


def test_bench_markdown_thread_cpu_table():
    from hgsgc import bench

    tc = bt.combine_ranks([_res(0.010, 0.002, 0.0005, 0.003), _res(0.012, 0.003, 0.0005, 0.001)])
    cell = {"method": "sgc_d1", "role": "ours", "status": "ok", "hosts": 2, "bandwidth": "100mbit",
            "mean_step_time_s": 0.0195, "time_per_epoch_s": 18.3, "bytes_sent_per_step_per_rank": 25000.0,
            "iface_tx_bytes_per_step_per_rank": 27000.0, "compression_ratio": 280.0,
            "final_test_accuracy": 0.5, "load_before": [2.0], "thread_cpu": tc}
    results = {"name": "t", "spec": {"overrides": [], "mpi_args": []}, "started_utc": "x",
               "machine": {"cpus": 2}, "compute_only": {}, "cells": [cell],
               "groups": [{"hosts": 2, "bandwidth": "100mbit", "dense": "-", "best_baseline": "-"}]}
    md = bench.markdown(results)
    assert "| sgc_d1 | 19.5 | 3.00 (3.50) | 2.50 | 0.50 | 11.00 | 2.00 | 3 |" in md


def _validation():
    from conftest import load_script

    return load_script("cluster", "perfmodel_validation.py")


def test_hvd_mpi_cpu_term_exact():
    v = _validation()
    t = v.hvd_mpi_cpu_term(0.0030, 0.0005, 0.0010)
    assert t["term_s"] == pytest.approx(0.0015, abs=1e-15)
    assert t["naive_term_s"] == pytest.approx(0.0025, abs=1e-15)
    assert (t["cell_s"], t["compute_only_s"], t["exchange_s"]) == (0.0030, 0.0005, 0.0010)
    # the exchange's own polling covers it all: no term; a compute-only run without the record: 0
    assert v.hvd_mpi_cpu_term(0.0030, 0.0005, 0.0100)["term_s"] == 0.0
    assert v.hvd_mpi_cpu_term(0.0030, None, 0.0)["term_s"] == 0.0030
    assert v.hvd_mpi_cpu_term(0.0001, 0.0005, 0.0)["naive_term_s"] == 0.0


def test_validation_bench_row_adds_the_measured_term(tmp_path):
    """One synthetic bench cell (SGC delay 1, 2 hosts, 100 Mbit/s): the row's prediction without
    the term is unchanged, with it = that + max(0, cell CPU - compute-only CPU - wire - coordination)."""
    from conftest import ROOT

    v = _validation()
    spec = {"name": "t", "overrides": ["train.epochs=1"], "mpi_args": [], "pin": True,
            "methods": [{"name": "sgc_d1", "config": os.path.join(ROOT, "configs/fashion_mnist_sgc.yaml"),
                         "overrides": ["compression.delay=1"], "mpi_args": [], "cell_overrides": []}]}
    cell = {"method": "sgc_d1", "status": "ok", "hosts": 2, "bandwidth": "100mbit", "steps": 40,
            "mean_step_time_s": 0.020, "load_before": [2.0, 2.0, 2.0], "load_after": [3.0, 3.0, 3.0],
            "hvd_mpi_cpu_s_per_step": 0.004, "hvd_mpi_cpu_s_per_step_max_rank": 0.005}
    d = {"name": "t", "spec": spec, "runtime": {"HOROVOD_CYCLE_TIME": "1"}, "cells": [cell],
         "compute_only": {"sgc_d1": {"status": "ok", "mean_step_time_s": 0.012,
                                     "hvd_mpi_cpu_s_per_step": 0.0005}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d))
    (row,) = v.bench_rows(str(path), None)
    base = dict(cell)
    del base["hvd_mpi_cpu_s_per_step"], base["hvd_mpi_cpu_s_per_step_max_rank"]
    path.write_text(json.dumps(dict(d, cells=[base])))
    (row0,) = v.bench_rows(str(path), None)
    assert row0["hvd_mpi_cpu"] is None
    assert row["predicted"] == row0["predicted"] and row["error"] == row0["error"]
    p, c = row["predicted"], row["hvd_mpi_cpu"]
    exch = p["wire_s"] + p["coordination_s"]
    assert c["exchange_s"] == exch and c["compute_only_recorded"] and c["cell_max_rank_s"] == 0.005
    assert c["term_s"] == max(0.0, 0.004 - 0.0005 - exch)
    assert c["predicted_cpu_term_s"] == p["step_s"] + c["term_s"]
    assert c["error"] == c["predicted_cpu_term_s"] / 0.020 - 1
    assert c["predicted_naive_cpu_term_s"] == p["step_s"] + (0.004 - 0.0005)


def test_cpu_compare_rows_exact():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("cmp", os.path.join(ROOT, "scripts", "bench_thread_cpu_compare.py"))
    cmp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmp)

    def run(wall, tf_main, tf_other, hvd, load):
        c = {"method": "sgc_d1", "hosts": 2, "bandwidth": "100mbit", "status": "ok", "load_before": [load],
             "mean_step_time_s": wall, "hvd_mpi_cpu_s_per_step": hvd,
             "thread_cpu_s_per_step": {"main": tf_main, "other": tf_other, "hvd_background": hvd, "mpi": 0.0}}
        return {"name": "r", "cells": [c, dict(c, method="x", status="failed")],
                "compute_only": {"sgc_d1": {"mean_step_time_s": wall / 2, "load_before": [load],
                                            "hvd_mpi_cpu_s_per_step": 0.0005,
                                            "thread_cpu_s_per_step": {"main": 0.002, "other": 0.010}}}}

    r = cmp.rows(run(0.100, 0.002, 0.020, 0.004, 12.0), run(0.020, 0.002, 0.018, 0.002, 2.0))
    assert [x[0] for x in r] == ["sgc_d1@2h/100mbit", "sgc_d1 compute-only (1 process)"]
    label, la, lb, fig = r[0]
    assert (la, lb) == (12.0, 2.0)
    assert fig["wall"] == (0.100, 0.020) and fig["hvd_mpi_cpu"] == (0.004, 0.002)
    assert fig["tf_cpu"] == pytest.approx((0.022, 0.020), abs=1e-15)
    md = cmp.markdown(run(0.100, 0.002, 0.020, 0.004, 12.0), run(0.020, 0.002, 0.018, 0.002, 2.0), "a", "b")
    assert "| `sgc_d1@2h/100mbit` | 12.0 / 2.0 | 100.00 / 20.00 | 0.20 | 22.00 / 20.00 | 0.91 | 4.00 / 2.00 | 0.50 |" in md


def test_validation_step_profile_row_gets_the_term_from_its_own_run(tmp_path):
    """A committed session-7 step profile (2 pinned hosts, 1 Gbit/s): the term is the step rounds'
    mean Horovod/MPI CPU (compute_no_hvd runs before hvd.init: 0) minus wire + coordination; the
    prediction without it is the one of the main table; only with --cpu-term-step-profiles."""
    from conftest import ROOT

    v = _validation()
    f = os.path.join(ROOT, "docs/benchmarks/step_profile/s7_buckets_1gbit.json")
    q = os.path.join(ROOT, "docs/benchmarks/link_calibration_quiet.json")
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    assert v.main([f"{f}={q}", "--json", str(out_a)]) == 0
    assert v.main([f"{f}={q}", "--cpu-term-step-profiles", "--json", str(out_b)]) == 0
    (a,), (b,) = json.load(open(out_a)), json.load(open(out_b))
    assert a["hvd_mpi_cpu"] is None and a["predicted"] == b["predicted"]
    s = json.load(open(f))["summary"]
    rounds = v.step_rounds(s)
    cell = sum(sum(s[x]["cpu_ms_hvd_mpi"]) / len(s[x]["cpu_ms_hvd_mpi"]) for x in rounds) / len(rounds) / 1e3
    c, p = b["hvd_mpi_cpu"], b["predicted"]
    assert c["cell_s"] == pytest.approx(cell, rel=1e-12) and c["compute_only_s"] == 0.0
    assert c["term_s"] == pytest.approx(max(0.0, cell - p["wire_s"] - p["coordination_s"]), rel=1e-12)
    assert c["error"] == pytest.approx((p["step_s"] + c["term_s"]) / b["measured_step_s"] - 1, rel=1e-12)
