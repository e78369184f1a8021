"""Which bench cells' per-thread CPU figures scripts/cluster/perfmodel_validation.py uses, and the
per-cell profile it computes from them (session 11, pm11).

Before commit a73aa81 (2026-12-02 09:13 UTC) a cell's per-step CPU window also held the data
iterator's teardown (0.1-7 s), so the session-8 Horovod/MPI CPU term read more Horovod CPU per step
than the step's wall time. A cell's figures now count only when its bench started after the fix and
its window holds the timed steps (window_s / (steps x mean step) <= 1.10, every rank)."""
import pytest

from conftest import load_script


def _v():
    return load_script("cluster", "perfmodel_validation.py")


def _cell(step=0.05, windows=((9, 0.45), (9, 0.47))):
    return {"mean_step_time_s": step,
            "thread_cpu": {"ranks": [{"steps": n, "window_s": w} for n, w in windows]},
            "thread_cpu_s_per_step": {"main": 0.002, "hvd_background": 0.007, "mpi": 0.0, "other": 0.038},
            "thread_runqueue_wait_s_per_step": {"main": 0.004, "hvd_background": 0.040, "mpi": 0.0, "other": 0.013}}


def test_window_ratio_is_the_largest_rank_window_over_its_timed_steps():
    v = _v()
    assert v.thread_window_ratio(_cell()) == pytest.approx(0.47 / (9 * 0.05), rel=1e-12)
    assert v.thread_window_ratio({"mean_step_time_s": 0.05}) is None


@pytest.mark.parametrize("started,windows,valid", [
    ("2026-12-02T11:00:00Z", ((9, 0.45), (9, 0.47)), True),     # after the fix, 1.04 x
    ("2026-12-02T08:05:00Z", ((9, 0.45), (9, 0.47)), False),    # before the fix, whatever the ratio
    ("2026-12-02T11:00:00Z", ((9, 0.45), (9, 0.60)), False),    # one rank's window 1.33 x
    (None, ((9, 0.45),), False)])
def test_thread_figures_count_only_after_the_fix_and_inside_the_steps(started, windows, valid):
    v = _v()
    ok, ratio, why = v.thread_figures_valid({"started_utc": started} if started else {}, _cell(windows=windows))
    assert ok is valid
    assert ratio == pytest.approx(max(w for _, w in windows) / (9 * 0.05), rel=1e-12)
    assert (why == "ok") is valid


def test_cell_profile_splits_the_step_by_hand():
    v = _v()
    co = {"mean_step_time_s": 0.0413,
          "thread_cpu_s_per_step": {"main": 0.0024, "hvd_background": 0.001, "mpi": 0.0, "other": 0.0393},
          "thread_runqueue_wait_s_per_step": {"main": 0.0024, "hvd_background": 0.0016, "mpi": 0.0, "other": 0.0045}}
    q = v.cell_profile(_cell(step=0.0526), co, 0.0002)
    assert q["cpu_s"] == pytest.approx(0.040) and q["co_cpu_s"] == pytest.approx(0.0417)
    assert q["d_cpu_s"] == pytest.approx(-0.0017) and q["d_wait_s"] == pytest.approx(0.017 - 0.0069)
    assert q["blocked_s"] == pytest.approx(0.0526 - 0.040 - 0.017)
    assert q["d_blocked_s"] == pytest.approx(0.0526 - 0.040 - 0.017 - 0.0002)
    assert (q["hvd_cpu_s"], q["hvd_wait_s"]) == (0.007, 0.040)
    assert v.cell_profile(_cell(), {"mean_step_time_s": 0.04}, 0.0) is None
