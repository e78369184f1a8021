"""``dilation: cpu_share`` with ``cpu_share_reference: <method>`` (session 10, pm10; hgsgc/bench.py).

Without a reference every method gets its own factor f = its compute-only step alone / with
``hosts`` processes at once, each measured at its own moment, so on a loaded machine the methods'
links run at different rates (ptb_8h, session 9: f 0.17-0.60 for one model). With
``cpu_share_reference: R`` every method gets R's factor: one emulated machine, every link at the
same emulated rate (as ``gpu_reference`` does for ``dilation: gpu``)."""
import os

import pytest

from conftest import ROOT
from hgsgc import bench

RES = {"compute_only": {"a": {"status": "ok", "mean_step_time_s": 0.10},
                        "b": {"status": "ok", "mean_step_time_s": 0.30}},
       "compute_only_shared": {"a@8": {"status": "ok", "mean_step_time_s": 0.40},
                               "b@8": {"status": "ok", "mean_step_time_s": 0.50},
                               "a@4": {"status": "ok", "mean_step_time_s": 0.25}}}


def test_each_method_its_own_factor_without_reference():
    spec = {"dilation": "cpu_share"}
    assert bench.dilation_factor(spec, RES, "a", 8) == pytest.approx(0.25)   # 100 / 400 ms
    assert bench.dilation_factor(spec, RES, "b", 8) == pytest.approx(0.60)   # 300 / 500 ms


def test_reference_gives_every_method_its_factor():
    spec = {"dilation": "cpu_share", "cpu_share_reference": "a"}
    for m in ("a", "b", "not_measured"):
        assert bench.dilation_factor(spec, RES, m, 8) == pytest.approx(0.25)   # a's: 100 / 400 ms
    assert bench.dilation_factor(spec, RES, "b", 4) == pytest.approx(0.40)     # a@4: 100 / 250 ms
    assert bench.dilation_factor(spec, RES, "b", 1) == 1.0
    # the reference's shared step not measured at this host count: no factor (the cell says why)
    assert bench.dilation_factor(spec, RES, "b", 2) is None
    assert bench.dilation_factor(spec, {"compute_only": {}, "compute_only_shared": {}}, "b", 8) is None
    assert bench.dilated_rate("10mbit", bench.dilation_factor(spec, RES, "b", 8)) == "2500kbit"


def test_cell_records_the_reference(monkeypatch):
    """run_cell writes the reference into the cell's ``dilation`` record (before it runs anything:
    a cell without a factor fails with a message naming the reference's measurement)."""
    spec = bench.load_spec(_spec(cpu_share_reference="a"))
    m = spec["methods"][1]
    cell = bench.run_cell(m, 8, "10mbit", spec, dilation=None)
    assert cell["status"] == "failed"
    assert cell["dilation"] == {"mode": "cpu_share", "factor": None, "reference": "a"}
    assert "compute-only" in cell["error"] and "'a'" in cell["error"]


def _spec(**extra):
    cfg = os.path.join(ROOT, "configs", "fashion_mnist.yaml")
    return {"name": "d", "hosts": [8], "bandwidths": ["10mbit"], "dilation": "cpu_share",
            "compute_only": True, "compute_only_shared": True,
            "methods": [{"name": "a", "config": cfg}, {"name": "b", "config": cfg}], **extra}


def test_valid_reference_is_accepted_and_kept():
    assert bench.load_spec(_spec(cpu_share_reference="b"))["cpu_share_reference"] == "b"
    assert bench.load_spec(_spec(compute_only=["a"], compute_only_shared=["a"],
                                 cpu_share_reference="a"))["cpu_share_reference"] == "a"
    assert bench.load_spec(_spec()).get("cpu_share_reference") is None


@pytest.mark.parametrize("extra,needle", [
    ({"cpu_share_reference": "zz"}, "cpu_share_reference must name a method"),
    ({"cpu_share_reference": "b", "compute_only": ["a"]}, "cpu_share_reference must name a method"),
    ({"cpu_share_reference": "b", "compute_only_shared": ["a"]}, "cpu_share_reference must name a method"),
    ({"cpu_share_reference": "a", "dilation": "none", "compute_only_shared": False},
     "cpu_share_reference needs dilation: cpu_share"),
    ({"cpu_share_reference": ["a"]}, "cpu_share_reference must name a method"),
])
def test_bad_reference_is_one_clear_error(extra, needle):
    with pytest.raises(bench.SpecError, match=needle):
        bench.load_spec(_spec(**extra))
