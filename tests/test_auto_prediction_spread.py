"""scripts/auto_prediction_spread.py: re-prediction from a summary's recorded inputs, the spread
table and the one-at-a-time sensitivity, on choices built here with hgsgc.perfmodel."""
import dataclasses
import importlib.util
import json
import os

import pytest

from hgsgc import perfmodel as pm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("auto_prediction_spread",
                                               os.path.join(ROOT, "scripts", "auto_prediction_spread.py"))
aps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aps)

COST = {"dp": {"base_s": 4e-3, "per_payload_s": 1e-4}, "conv": {"base_s": 1e-3, "per_payload_s": 2e-5},
        "fc": {"base_s": 3e-3, "per_payload_s": 8e-5, "alone_s": 2.5e-3}}


def _inputs(**kw):
    base = dict(world_size=4, batch_size=32, t_conv=1e-3, t_fc=1.5e-3, act_bytes=800.0, grad_bytes=780.0,
                codec_s=1e-5, alpha=1e-4, beta=1.2e7, dp_payload=40000.0, conv_payload=3000.0, fc_payload=37000.0,
                dp_algorithm="allgather", conv_algorithm="allgather", fc_algorithm="allgather", micro_batches=2,
                t_update_conv=1e-3, t_update_fc=4e-3, machine_of=(0, 0, 1, 1), machine_cores=(1.0, 1.0),
                wait_cpu_cores=0.05, boundary_msg_s=2e-3)
    base.update(kw)
    inp = pm.LayoutInputs(**base)
    return dataclasses.replace(inp, dp_compression_s=pm.compression_at(COST["dp"], 4, "allgather"))


def _choice(inp):
    rep = pm.choose_layout(inp, inputs_at=lambda F: pm.with_role_compression(inp, F, COST["conv"], COST["fc"]))
    rep["measured"] = {"compression_cost": COST}
    return json.loads(json.dumps(rep))  # as summary.json stores it (tuples -> lists)


def _summaries(tmp_path, inputs):
    paths = []
    for i, inp in enumerate(inputs):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"layout_choice": _choice(inp)}))
        paths.append(str(d / "summary.json"))
    return paths


def test_repredicts_recorded_predictions(tmp_path):
    a = _inputs()
    r = aps.analyse(aps.load_choices(_summaries(tmp_path, [a, a])))
    ch = _choice(a)
    for p in ch["predictions"]:
        name = "data_parallel" if p["fc_workers"] is None else f"hourglass F={p['fc_workers']}"
        assert r["predicted_ms"][0][name] == pytest.approx(1e3 * p["step_s"], rel=1e-12)
    assert r["spread"] == {} and r["effect"] == {}  # identical runs: nothing varies


def test_one_varying_field_explains_the_whole_difference(tmp_path):
    a, b = _inputs(), _inputs(boundary_msg_s=6e-3)
    r = aps.analyse(aps.load_choices(_summaries(tmp_path, [a, b])))
    assert list(r["spread"]) == ["boundary_msg_s"]
    s = r["spread"]["boundary_msg_s"]
    assert (s["min"], s["max"]) == (2e-3, 6e-3) and s["max_over_min"] == pytest.approx(3.0)
    e = r["effect"]["boundary (codec_s, boundary_msg_s)"]
    hg = 1e3 * abs(pm.predict_hourglass(pm.with_role_compression(b, 1, COST["conv"], COST["fc"]), 1)["step_s"]
                   - pm.predict_hourglass(pm.with_role_compression(a, 1, COST["conv"], COST["fc"]), 1)["step_s"])
    assert hg > 0
    assert e["hourglass F=1"]["median_abs_ms"] == pytest.approx(hg, rel=1e-9)
    assert e["hourglass F=1"]["share_of_spread"] == pytest.approx(1.0, rel=1e-9)
    assert e["data_parallel"]["median_abs_ms"] == 0.0  # DP does not send boundary messages


def test_compression_cost_is_a_field(tmp_path):
    a = _inputs()
    paths = _summaries(tmp_path, [a, a])
    s = json.loads(open(paths[1]).read())
    s["layout_choice"]["measured"]["compression_cost"] = {**COST, "fc": {**COST["fc"], "base_s": 0.2}}
    # the recorded predictions must follow the changed cost, as layout: auto's would
    s["layout_choice"] = {**_choice_with_cost(a, s["layout_choice"]["measured"]["compression_cost"])}
    open(paths[1], "w").write(json.dumps(s))
    r = aps.analyse(aps.load_choices(paths))
    assert list(r["spread"]) == ["cost.fc.base_s"]
    e = r["effect"]["compression cost.fc"]
    assert e["data_parallel"]["median_abs_ms"] == 0.0
    # one FC rank runs no FC exchange (compression_at: alone_s for k = 1), two FC ranks do
    assert e["hourglass F=1"]["median_abs_ms"] == 0.0
    assert e["hourglass F=2"]["median_abs_ms"] > 0


def test_a_fit_is_swapped_as_one_group(tmp_path):
    """fc_call_s and fc_row_s of one fit move together: B's pair with the same t_K = fc_call_s +
    3 x 16 fc_row_s (F = 1 on 4 ranks, M = 2 of 32) leaves the F = 1 prediction unchanged."""
    a = _inputs(fc_call_s=3e-3, fc_row_s=4e-5, conv_fwd_mb_s=2e-3, conv_bwd_mb_s=3e-3)
    b = _inputs(fc_call_s=3e-3 + 48 * 3e-5, fc_row_s=1e-5, conv_fwd_mb_s=2e-3, conv_bwd_mb_s=3e-3)
    r = aps.analyse(aps.load_choices(_summaries(tmp_path, [a, b])))
    assert sorted(r["spread"]) == ["fc_call_s", "fc_row_s"]
    e = r["effect"]["FC stage fit (fc_call_s, fc_row_s)"]
    assert e["hourglass F=1"]["median_abs_ms"] == pytest.approx(0.0, abs=1e-9)
    assert r["median_abs_pair_difference_ms"]["hourglass F=1"] == pytest.approx(0.0, abs=1e-9)
    assert e["hourglass F=2"]["median_abs_ms"] > 0  # 2 FC ranks serve 2 CONV ranks each: another t_k


def _choice_with_cost(inp, cost):
    rep = pm.choose_layout(inp, inputs_at=lambda F: pm.with_role_compression(inp, F, cost["conv"], cost["fc"]))
    rep["measured"] = {"compression_cost": cost}
    return json.loads(json.dumps(rep))


def test_refuses_a_summary_without_inputs_and_a_mismatch(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"layout": "data_parallel"}))
    with pytest.raises(ValueError, match="no layout_choice.inputs"):
        aps.load_choices([str(d / "summary.json")])
    paths = _summaries(tmp_path, [_inputs(), _inputs()])
    s = json.loads(open(paths[0]).read())
    s["layout_choice"]["predictions"][0]["step_s"] *= 1.5
    open(paths[0], "w").write(json.dumps(s))
    with pytest.raises(ValueError, match="re-predicted data_parallel"):
        aps.analyse(aps.load_choices(paths))
