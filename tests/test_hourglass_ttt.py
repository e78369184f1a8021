"""Time to target for the Hourglass (issue 11 on issue 10's machinery, hgsgc/bench_ttt.py):
``hgsgc bench`` with ``cells_from`` reads committed cells (nothing runs) and combines them with
loopback curves, a Hourglass curve included (its epochs have more steps: 3 CONV ranks of 32 examples
against 4 ranks). Exact values against the hand-computed formula ``steps * step_s + epochs * eval_s``;
bad ``cells_from`` / ``cells`` values give one error naming the key."""
import json
import os

import pytest

from hgsgc import bench


def _cell(method, step_s, eval_s, load=5.0):
    return {"method": method, "role": "other", "status": "ok", "hosts": 4, "bandwidth": "100mbit",
            "bandwidth_mbit": 100.0, "mean_step_time_s": step_s, "eval_time_s": eval_s,
            "time_per_epoch_s": step_s * 100, "final_test_accuracy": 0.1, "load_before": [load, 1.0, 1.0],
            "bytes_sent_per_step_per_rank": 1000.0, "iface_tx_bytes_per_step_per_rank": 1100.0,
            "compression_ratio": 10.0, "error": None}


def _run_dir(root, name, steps_per_epoch, accs):
    d = root / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for e, a in enumerate(accs, 1):
            f.write(json.dumps({"kind": "step", "step": e * steps_per_epoch - 1, "train_loss": 1.0}) + "\n")
            f.write(json.dumps({"epoch": e, "steps": steps_per_epoch, "test_accuracy": a}) + "\n")
    (d / "summary.json").write_text(json.dumps({"mean_step_time_s": 0.1, "world_size": 4}))
    return str(d)


@pytest.fixture
def committed(tmp_path):
    cells = [_cell("fp16", 0.700, 3.0), _cell("topk", 0.080, 4.0), _cell("hourglass", 0.050, 2.0),
             _cell("hourglass_again", 0.060, 5.0), _cell("sgc_dp", 0.090, 6.0)]
    p = tmp_path / "committed.json"
    p.write_text(json.dumps({"name": "committed", "cells": cells}))
    runs = {"fp16": _run_dir(tmp_path, "c-fp16", 10, [0.70, 0.80, 0.90]),
            "topk": _run_dir(tmp_path, "c-topk", 10, [0.60, 0.85, 0.89]),
            "hourglass": _run_dir(tmp_path, "c-hg", 14, [0.75, 0.86, 0.897]),
            "sgc_dp": _run_dir(tmp_path, "c-sgc", 10, [0.50, 0.70, 0.80])}
    return str(p), runs


def _spec(tmp_path, path, runs, **extra):
    return dict({
        "name": "hg_ttt", "hosts": [4], "bandwidths": ["100mbit"], "compute_only": False,
        "out_dir": str(tmp_path / "out"), "runs_dir": str(tmp_path / "runs"), "cells_from": path,
        "time_to_target": {"metric": "test_accuracy", "mode": "max", "reference": "fp16", "abs": 0.005,
                           "budget_epochs": 3, "reuse_curves": True},
        "methods": [
            {"name": "fp16", "config": "configs/cifar10_vgg16/dense.yaml", "role": "dense", "curve_run": runs["fp16"]},
            {"name": "topk", "config": "configs/cifar10_vgg16/dense.yaml", "role": "baseline", "curve_run": runs["topk"]},
            {"name": "hourglass", "config": "configs/cifar10_vgg16/hourglass_sgc.yaml", "role": "ours",
             "cells": ["hourglass", "hourglass_again"], "curve_run": runs["hourglass"]},
            {"name": "sgc_dp", "config": "configs/cifar10_vgg16/hourglass_sgc.yaml", "role": "ours",
             "curve_run": runs["sgc_dp"]}]}, **extra)


def test_cells_from_time_to_target_exact(tmp_path, committed):
    path, runs = committed
    logs = []
    res = bench.run_matrix(_spec(tmp_path, path, runs), log=logs.append)
    assert res["cells_from"] == path
    assert [(c["method"], c["cell_name"]) for c in res["cells"]] == [
        ("fp16", "fp16"), ("topk", "topk"), ("hourglass", "hourglass"), ("hourglass", "hourglass_again"),
        ("sgc_dp", "sgc_dp")]
    assert all(c["role"] == r for c, r in zip(res["cells"], ["dense", "baseline", "ours", "ours", "ours"]))
    assert not any("curve: loopback run" in s for s in logs)  # nothing ran
    tt = res["time_to_target"]
    assert tt["target"] == pytest.approx(0.895, abs=1e-12)  # fp16's last value 0.90 - 0.005
    eval_s = 4.0  # the median of the five cells' evaluation times (group_median)
    rows = {(r["method"], r["cell_name"]): r for r in tt["rows"]}
    # fp16 reaches 0.90 at epoch 3 (30 steps); top-k 0.89 < 0.895: not reached
    assert rows["fp16", "fp16"]["time_to_target_s"] == pytest.approx(30 * 0.700 + 3 * eval_s, rel=1e-12)
    assert rows["topk", "topk"]["time_to_target_s"] is None
    assert rows["topk", "topk"]["note"].startswith("not reached in 3 epochs")
    # the Hourglass reaches 0.897 >= 0.895 at epoch 3 after 3 x 14 steps, on each of its two cells' clocks
    assert rows["hourglass", "hourglass"]["steps"] == 42
    assert rows["hourglass", "hourglass"]["time_to_target_s"] == pytest.approx(42 * 0.050 + 3 * eval_s, rel=1e-12)
    assert rows["hourglass", "hourglass_again"]["time_to_target_s"] == pytest.approx(42 * 0.060 + 3 * eval_s,
                                                                                      rel=1e-12)
    assert rows["sgc_dp", "sgc_dp"]["time_to_target_s"] is None
    g = tt["groups"][0]
    assert g["best_baseline"] == "fp16"  # the only dense/baseline row that reaches the target
    assert rows["hourglass", "hourglass"]["vs_best_baseline"] == pytest.approx(
        (30 * 0.7 + 12.0) / (42 * 0.05 + 12.0), rel=1e-12)
    paths = bench.write_outputs(res)
    md = open(paths["md"]).read()
    assert f"Cells read from `{path}`" in md
    assert "hourglass (cell `hourglass_again`)" in md
    # re-rendering the results JSON gives the same time to target
    with open(paths["json"]) as f:
        again = json.load(f)
    bench.add_ratios(again)
    bench.load_curves(again)
    bench.add_time_to_target(again)
    assert [r["time_to_target_s"] for r in again["time_to_target"]["rows"]] == \
        [r["time_to_target_s"] for r in tt["rows"]]


def test_cells_from_errors(tmp_path, committed):
    path, runs = committed
    with pytest.raises(bench.SpecError, match=r"cells_from: .*nope.json not found"):
        bench.load_spec(_spec(tmp_path, str(tmp_path / "nope.json"), runs))
    with pytest.raises(bench.SpecError, match=r"'cells_from' must be a results JSON"):
        bench.load_spec(_spec(tmp_path, "x.yaml", runs))
    with pytest.raises(bench.SpecError, match=r"set compute_only: false"):
        bench.load_spec(_spec(tmp_path, path, runs, compute_only=True))
    s = _spec(tmp_path, path, runs)
    s["methods"][1]["cells"] = ["topk", "powersgd"]
    with pytest.raises(bench.SpecError, match=r"\(topk\)\.cells: powersgd not in .*its cells: fp16, topk, "
                                              r"hourglass, hourglass_again, sgc_dp\)"):
        bench.load_spec(s)
    s = _spec(tmp_path, path, runs)
    s["methods"][1]["cells"] = []
    with pytest.raises(bench.SpecError, match=r"\(topk\)\.cells must be a non-empty list"):
        bench.load_spec(s)


def test_spec_files_load():
    """The committed time-to-target specs of the AlexNet-style model load (cells and curve runs exist)."""
    import glob

    from conftest import ROOT

    specs = sorted(glob.glob(os.path.join(ROOT, "configs", "bench", "cifar_alexnet_4h_ttt*.yaml")))
    assert specs
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for p in specs:
            s = bench.load_spec(p)
            assert s["time_to_target"]["reference"] == "fp16"
    finally:
        os.chdir(cwd)


def test_reused_curve_run_has_no_load_of_the_render(tmp_path, committed):
    """A curve run read again (reuse_curves: nothing runs) must not carry the load average of the
    moment it was read as if it were the run's (the tables showed 'load 22.3-22.3' for every reused
    curve: the load while re-rendering)."""
    import shutil

    path, runs = committed
    s = _spec(tmp_path, path, runs)
    for m in s["methods"]:
        d = os.path.join(s["runs_dir"], f"{s['name']}-curve-{m['name']}")
        shutil.copytree(m.pop("curve_run"), d)
    res = bench.run_matrix(s, log=lambda _: None)
    for name, rec in res["curves"].items():
        assert rec["reused"] is True and rec["status"] == "ok", name
        assert rec["load_before"] is None and rec["load_after"] is None, name
    line = next(ln for ln in bench.markdown(res).splitlines() if ln.startswith("Curve runs"))
    assert "`hourglass` 100.0 ms/step, load - (reused run)" in line
