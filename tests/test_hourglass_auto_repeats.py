"""scripts/hourglass_auto_repeats.py: auto against the better layout per repeat and as medians, and
the identical-job spread, on cells whose figures are worked out by hand."""
import json

import pytest

from conftest import load_script

rep = load_script("hourglass_auto_repeats.py")


def _cell(method, layout, epoch, load, launch=20.0, wall=6.0, run_id=None, status="ok"):
    return {"method": method, "layout": layout, "time_per_epoch_s": epoch, "mean_step_time_s": epoch / 100,
            "load_before": [load, 1.0, 1.0], "launch_time_s": launch, "wall_time_s": wall,
            "run_id": run_id or method, "status": status}


RESULTS = {"name": "x", "started_utc": "t", "cells": [
    _cell("sgc_dp_r1", "data_parallel", 40.0, 2.0), _cell("hourglass_r1", "hourglass", 30.0, 3.0),
    _cell("auto_r1", "hourglass", 33.0, 4.0, launch=45.0),
    _cell("hourglass_r2", "hourglass", 28.0, 2.5), _cell("auto_r2", "hourglass", 28.5, 2.0, launch=40.0),
    _cell("sgc_dp_r2", "data_parallel", 44.0, 3.5),
    _cell("auto_r3", "hourglass", 26.0, 1.5), _cell("sgc_dp_r3", "data_parallel", 42.0, 2.0),
    _cell("hourglass_r3", "hourglass", 32.0, 2.0),
    _cell("powersgd", "data_parallel", 10.0, 2.0)]}


def test_per_repeat_medians_and_spread():
    fig = rep.compare(RESULTS)
    r = {x["repeat"]: x for x in fig["repeats"]}
    assert r[1]["better"] == "hourglass" and r[1]["auto_vs_better"] == pytest.approx(33 / 30)
    assert r[2]["auto_vs_better"] == pytest.approx(28.5 / 28) and r[3]["auto_vs_better"] == pytest.approx(26 / 32)
    assert r[1]["auto_vs_same_layout"] == pytest.approx(33 / 30)
    assert r[1]["launch_minus_wall_s"] == {"sgc_dp": 14.0, "hourglass": 14.0, "auto": 39.0}
    assert r[1]["load_before"] == {"sgc_dp": 2.0, "hourglass": 3.0, "auto": 4.0}
    assert fig["median_epoch_s"] == {"sgc_dp": 42.0, "hourglass": 30.0, "auto": 28.5}
    assert fig["better_by_median"] == "hourglass" and fig["auto_vs_better_median"] == pytest.approx(28.5 / 30)
    assert fig["within_5pct_per_repeat"] == 2                       # 1.100 misses; 1.018 and 0.8125 pass
    assert fig["identical_job_spread"] == pytest.approx({"sgc_dp": 44 / 40, "hourglass": 32 / 28, "auto": 33 / 26})
    assert fig["load_range"] == [1.5, 4.0]
    md = rep.table(fig)
    # With start-up (epoch + launch - wall): repeat 1 DP 54, Hourglass 44, auto 33 + 39 = 72.
    assert r[1]["epoch_with_startup_s"] == pytest.approx({"sgc_dp": 54.0, "hourglass": 44.0, "auto": 72.0})
    assert r[1]["better_with_startup"] == "hourglass"
    assert r[1]["auto_vs_better_with_startup"] == pytest.approx(72 / 44)
    assert r[2]["auto_vs_better_with_startup"] == pytest.approx((28.5 + 34) / 42)
    assert r[3]["auto_vs_better_with_startup"] == pytest.approx(40 / 46)
    assert fig["within_5pct_per_repeat_with_startup"] == 1
    assert ("| 1 | 40.0 (2.0) | 30.0 (3.0) | 33.0 (4.0) -> hourglass | 1.100 | 1.100 | nan (39.0 / 14.0) "
            "| 54.0 / 44.0 / 72.0 | 1.636 |") in md
    assert "| median | 42.0 | 30.0 | 28.5 | 0.950 | | | | |" in md


def test_choices_from_the_run_folders(tmp_path):
    d = tmp_path / "auto_r2"
    d.mkdir()
    choice = {"layout": "hourglass", "fc_workers": 1, "startup": {"total_s": 25.5},
              "predictions": [{"layout": "data_parallel", "fc_workers": None, "step_s": 0.08},
                              {"layout": "hourglass", "fc_workers": 1, "step_s": 0.034}]}
    (d / "summary.json").write_text(json.dumps({"layout_choice": choice}))
    ch = rep.read_choices(RESULTS, str(tmp_path))
    assert ch == {"auto_r2": choice}
    fig = rep.compare(RESULTS, ch)
    row = [x for x in fig["repeats"] if x["repeat"] == 2][0]
    assert row["choice"]["predicted_step_ms"] == {"data_parallel": 80.0, "hourglass F=1": 34.0}
    assert "| 2 | 44.0 (3.5) | 28.0 (2.5) | 28.5 (2.0) -> hourglass | 1.018 | 1.018 | 25.5 (34.0 / 14.0) |" in rep.table(fig)


def test_incomplete_repeats_are_named():
    cells = [c for c in RESULTS["cells"] if c["method"] != "auto_r2"]
    with pytest.raises(ValueError, match=r"repeats \[2\] lack"):
        rep.compare({"cells": cells})
    with pytest.raises(ValueError, match="no ok cells"):
        rep.compare({"cells": [RESULTS["cells"][-1]]})
