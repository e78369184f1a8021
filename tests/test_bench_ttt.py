"""Time to target (hgsgc/bench_ttt.py, issue 10 item 1): the combination of a quality-vs-steps
curve with a measured step time, on fixed inputs with exact expected values. No runs, no clocks."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hgsgc import bench, bench_ttt  # noqa: E402

# per-epoch records as metrics.jsonl has them (steps = steps of that epoch)
EPOCHS = {
    "fp16": [{"epoch": 1, "steps": 50, "valid_perplexity": 900.0},
             {"epoch": 2, "steps": 50, "valid_perplexity": 420.0},
             {"epoch": 3, "steps": 50, "valid_perplexity": 400.0}],
    "topk": [{"epoch": 1, "steps": 50, "valid_perplexity": 1000.0},
             {"epoch": 2, "steps": 50, "valid_perplexity": 500.0},
             {"epoch": 3, "steps": 50, "valid_perplexity": 450.0}],   # never <= 412
    "psgd": [{"epoch": 1, "steps": 50, "valid_perplexity": 800.0},
             {"epoch": 2, "steps": 50, "valid_perplexity": 430.0},
             {"epoch": 3, "steps": 50, "valid_perplexity": 410.0}],   # reaches at epoch 3
    "sgc": [{"epoch": 1, "steps": 50, "valid_perplexity": 700.0},
            {"epoch": 2, "steps": 50, "valid_perplexity": 412.0},     # exactly the target: reached
            {"epoch": 3, "steps": 50, "valid_perplexity": 390.0}],
}
ROLES = {"fp16": "dense", "topk": "baseline", "psgd": "baseline", "sgc": "ours"}


def _cell(method, bw, mbit, step_s, eval_s, status="ok"):
    return {"method": method, "hosts": 4, "bandwidth": bw, "bandwidth_mbit": mbit, "status": status,
            "mean_step_time_s": step_s if status == "ok" else None,
            "eval_time_s": eval_s if status == "ok" else None, "load_before": [7.5, 6.0, 5.0]}


CELLS = [
    _cell("fp16", "10mbit", 10.0, 20.0, 8.0), _cell("topk", "10mbit", 10.0, 2.0, 8.0),
    _cell("psgd", "10mbit", 10.0, 1.5, 8.0), _cell("sgc", "10mbit", 10.0, 0.5, 8.0),
    _cell("fp16", "100mbit", 100.0, 2.0, 4.0), _cell("topk", "100mbit", 100.0, 0.5, 4.0),
    _cell("psgd", "100mbit", 100.0, 0.4, 4.0, status="failed"), _cell("sgc", "100mbit", 100.0, 0.4, 4.0),
]


def _combined():
    curves = {m: bench_ttt.curve_from_epochs(e, "valid_perplexity") for m, e in EPOCHS.items()}
    return bench_ttt.combine(curves, CELLS, "fp16", "min", rel=0.03, roles=ROLES)


def test_target_value():
    assert bench_ttt.target_value(400.0, "min", rel=0.03) == pytest.approx(412.0, abs=1e-12)
    assert bench_ttt.target_value(0.9, "max", abs_=0.005) == pytest.approx(0.895, abs=1e-12)
    with pytest.raises(ValueError, match="rel >= 0"):
        bench_ttt.target_value(400.0, "min")
    with pytest.raises(ValueError, match="'min' or 'max'"):
        bench_ttt.target_value(400.0, "lowest", rel=0.03)


def test_curve_is_cumulative_and_names_missing_keys():
    step_line = {"kind": "step", "step": 100, "epoch": 2, "train_loss": 6.1}
    c = bench_ttt.curve_from_epochs(list(reversed(EPOCHS["sgc"])) + [step_line], "valid_perplexity")
    assert c == [{"epoch": 1, "steps": 50, "value": 700.0}, {"epoch": 2, "steps": 100, "value": 412.0},
                 {"epoch": 3, "steps": 150, "value": 390.0}]
    with pytest.raises(KeyError, match="epoch 2: no 'valid_perplexity'"):
        bench_ttt.curve_from_epochs([{"epoch": 2, "steps": 5}], "valid_perplexity")


def test_time_to_target_exact_values():
    r = _combined()
    assert r["target"] == pytest.approx(412.0)
    assert r["reference_final"] == 400.0
    rows = {(x["method"], x["bandwidth"]): x for x in r["rows"]}
    # t(e) = steps * step_s + e * eval_s
    fp16 = rows[("fp16", "10mbit")]
    assert (fp16["epoch"], fp16["steps"]) == (3, 150)
    assert fp16["time_to_target_s"] == pytest.approx(150 * 20.0 + 3 * 8.0)        # 3024
    assert [p["time_s"] for p in fp16["wallclock"]] == pytest.approx([1008.0, 2016.0, 3024.0])
    sgc = rows[("sgc", "10mbit")]
    assert (sgc["epoch"], sgc["steps"]) == (2, 100)                                 # 412 <= 412
    assert sgc["time_to_target_s"] == pytest.approx(100 * 0.5 + 2 * 8.0)           # 66
    psgd = rows[("psgd", "10mbit")]
    assert psgd["time_to_target_s"] == pytest.approx(150 * 1.5 + 3 * 8.0)          # 249
    topk = rows[("topk", "10mbit")]
    assert topk["time_to_target_s"] is None and topk["note"] == "not reached in 3 epochs (150 steps)"
    assert topk["wallclock"][-1]["time_s"] == pytest.approx(150 * 2.0 + 3 * 8.0)
    # ratios: the other's time / this one's
    assert sgc["vs_reference"] == pytest.approx(3024.0 / 66.0)
    assert sgc["vs_best_baseline"] == pytest.approx(249.0 / 66.0)
    g10 = next(g for g in r["groups"] if g["bandwidth"] == "10mbit")
    assert (g10["best_baseline"], g10["best_baseline_time_s"]) == ("psgd", pytest.approx(249.0))
    assert g10["reference_time_s"] == pytest.approx(3024.0)
    # 100 Mbit/s: PowerSGD's cell failed, so the best baseline reaching the target is fp16 itself
    g100 = next(g for g in r["groups"] if g["bandwidth"] == "100mbit")
    assert rows[("psgd", "100mbit")]["time_to_target_s"] is None
    assert rows[("psgd", "100mbit")]["note"] == "no step time (the cell failed)"
    assert (g100["best_baseline"], g100["best_baseline_time_s"]) == ("fp16", pytest.approx(150 * 2.0 + 12.0))
    assert rows[("sgc", "100mbit")]["time_to_target_s"] == pytest.approx(100 * 0.4 + 8.0)
    assert rows[("sgc", "100mbit")]["vs_best_baseline"] == pytest.approx(312.0 / 48.0)


def test_eval_time_group_median_or_per_cell():
    curves = {m: bench_ttt.curve_from_epochs(e, "valid_perplexity") for m, e in EPOCHS.items()}
    cells = [_cell("fp16", "10mbit", 10.0, 20.0, 9.0), _cell("topk", "10mbit", 10.0, 2.0, 3.0),
             _cell("psgd", "10mbit", 10.0, 1.5, 5.0), _cell("sgc", "10mbit", 10.0, 0.5, 4.0),
             _cell("sgc", "100mbit", 100.0, 0.4, 6.0)]
    med = {r["method"] + r["bandwidth"]: r for r in
           bench_ttt.combine(curves, cells, "fp16", "min", rel=0.03, roles=ROLES)["rows"]}
    # median of 9, 3, 5, 4 = 4.5 for every method of the 10 Mbit/s group; 6 alone at 100 Mbit/s
    assert [med[k]["eval_s"] for k in ("fp1610mbit", "topk10mbit", "psgd10mbit", "sgc10mbit")] == [4.5] * 4
    assert med["sgc10mbit"]["eval_measured_s"] == 4.0
    assert med["sgc10mbit"]["time_to_target_s"] == pytest.approx(100 * 0.5 + 2 * 4.5)
    assert med["fp1610mbit"]["time_to_target_s"] == pytest.approx(150 * 20.0 + 3 * 4.5)
    assert med["sgc100mbit"]["time_to_target_s"] == pytest.approx(100 * 0.4 + 2 * 6.0)
    own = {r["method"]: r for r in bench_ttt.combine(curves, cells[:4], "fp16", "min", rel=0.03, roles=ROLES,
                                                     eval_time="cell")["rows"]}
    assert own["sgc"]["time_to_target_s"] == pytest.approx(100 * 0.5 + 2 * 4.0)
    assert own["fp16"]["time_to_target_s"] == pytest.approx(150 * 20.0 + 3 * 9.0)
    with pytest.raises(ValueError, match="eval_time must be"):
        bench_ttt.combine(curves, cells, "fp16", "min", rel=0.03, eval_time="mean")


def test_max_mode_and_missing_reference():
    curves = {"d": [{"epoch": 1, "steps": 10, "value": 0.80}, {"epoch": 2, "steps": 20, "value": 0.90}],
              "s": [{"epoch": 1, "steps": 10, "value": 0.896}]}
    cells = [_cell("d", "1gbit", 1000.0, 0.1, 1.0), _cell("s", "1gbit", 1000.0, 0.05, 1.0)]
    r = bench_ttt.combine(curves, cells, "d", "max", abs_=0.005, roles={"d": "dense", "s": "ours"})
    rows = {x["method"]: x for x in r["rows"]}
    assert rows["d"]["time_to_target_s"] == pytest.approx(20 * 0.1 + 2 * 1.0)
    assert rows["s"]["time_to_target_s"] == pytest.approx(10 * 0.05 + 1 * 1.0)
    with pytest.raises(KeyError, match="no curve for the reference method 'x'"):
        bench_ttt.combine(curves, cells, "x", "max", abs_=0.005)


def test_spec_validation_of_time_to_target():
    base = {"name": "t", "methods": [{"name": "a", "config": "configs/ptb_lstm/dense.yaml"}]}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        spec = bench.load_spec(dict(base, time_to_target={"reference": "a"}))
        t = spec["time_to_target"]
        assert (t["metric"], t["mode"], t["rel"], t["curve_hosts"], t["reuse_curves"]) == \
            ("valid_perplexity", "min", 0.03, 4, False)
        with pytest.raises(bench.SpecError, match="time_to_target.reference must name one of the methods"):
            bench.load_spec(dict(base, time_to_target={"reference": "b"}))
        with pytest.raises(bench.SpecError, match="unknown key"):
            bench.load_spec(dict(base, time_to_target={"reference": "a", "epochs": 3}))
        with pytest.raises(bench.SpecError, match="mode: min takes rel"):
            bench.load_spec(dict(base, time_to_target={"reference": "a", "abs": 0.1}))
        with pytest.raises(bench.SpecError, match="full_epoch_steps"):
            bench.load_spec(dict(base, full_epoch_steps=0))
    finally:
        os.chdir(cwd)


def test_report_and_plots(tmp_path):
    curves = {m: {"status": "ok", "curve": bench_ttt.curve_from_epochs(e, "valid_perplexity"),
                  "mean_step_time_s": 0.3, "load_before": [5.0], "load_after": [6.0]}
              for m, e in EPOCHS.items()}
    methods = [{"name": m, "role": ROLES[m]} for m in EPOCHS]
    results = {"spec": {"methods": methods, "time_to_target": {
        "metric": "valid_perplexity", "mode": "min", "rel": 0.03, "curve_hosts": 4,
        "curve_overrides": ["train.epochs=3"]}}, "curves": curves, "time_to_target": _combined()}
    text = "\n".join(bench_ttt.markdown(results))
    assert "**412.00**" in text
    assert "| sgc | ours | 0.500 | 8.0 | 8.0 | 2 | 100 | 66.0 | 45.82x | 3.77x | 390.00 | 7.5 |  |" in text
    assert "| topk | baseline | 2.000 | 8.0 | 8.0 | - | - | **not reached** |" in text
    paths = bench_ttt.plots(results, str(tmp_path), "t", bench._style)
    assert [os.path.basename(p) for p in paths] == ["t_ttt_curves.png", "t_ttt_vs_bw.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_curve_of_a_run_dir_with_budget(tmp_path):
    """A finished curve run (summary.json + metrics.jsonl, step lines mixed in) read back, longer
    than the budget: only the first budget_epochs epochs count; a missing run is recorded."""
    import json

    run = tmp_path / "runs" / "t-curve-a"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"wall_time_s": 100.0, "mean_step_time_s": 0.25,
                                                  "world_size": 4}))
    (run / "config.json").write_text(json.dumps({"run": {"seed": 42}}))
    lines = [{"kind": "step", "step": 100, "epoch": 3, "train_loss": 6.0}] + [{"epoch": e, "steps": 48, "valid_perplexity": 1000.0 / e}
                                          for e in (1, 2, 3, 4)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    t = {"metric": "valid_perplexity", "budget_epochs": 3, "reuse_curves": True, "curve_overrides": [],
         "curve_hosts": 4}
    spec = {"name": "t", "runs_dir": str(tmp_path / "runs"), "time_to_target": t,
            "methods": [{"name": "a", "overrides": []}, {"name": "b", "overrides": []}]}
    results = {"spec": spec}
    bench.load_curves(results)
    a, b = results["curves"]["a"], results["curves"]["b"]
    assert a["status"] == "ok" and a["reused"] is True and a["run_epochs"] == 4 and a["seed"] == 42
    assert [p["steps"] for p in a["curve"]] == [48, 96, 144]
    assert a["final_value"] == pytest.approx(1000.0 / 3) and a["steps"] == 144
    assert b["status"] == "failed" and b["error"].startswith("no curve run in ")
    assert a["complete"] is True and a["run_finished"] is True
    # a run stopped before the end (no summary.json): the epochs it wrote, flagged incomplete
    (run / "summary.json").unlink()
    t["budget_epochs"] = 6
    results = {"spec": spec}
    bench.load_curves(results)
    a = results["curves"]["a"]
    assert a["status"] == "ok" and a["run_finished"] is False and a["complete"] is False
    assert [p["steps"] for p in a["curve"]] == [48, 96, 144, 192]


def test_incomplete_curve_is_not_called_not_reached():
    curves = {"d": [{"epoch": 1, "steps": 10, "value": 100.0}, {"epoch": 2, "steps": 20, "value": 90.0}],
              "s": [{"epoch": 1, "steps": 10, "value": 200.0}],            # 1 of 2 epochs, not there
              "q": [{"epoch": 1, "steps": 10, "value": 92.0}]}             # 1 of 2 epochs, reached
    cells = [_cell(m, "10mbit", 10.0, 1.0, 2.0) for m in ("d", "s", "q")]
    rows = {r["method"]: r for r in bench_ttt.combine(curves, cells, "d", "min", rel=0.03,
                                                      budget_epochs=2)["rows"]}
    assert rows["s"]["time_to_target_s"] is None
    assert rows["s"]["note"] == "incomplete curve: not reached in its first 1 of 2 epochs"
    assert rows["q"]["time_to_target_s"] == pytest.approx(10 * 1.0 + 1 * 2.0)
    assert rows["d"]["time_to_target_s"] == pytest.approx(20 * 1.0 + 2 * 2.0)


def test_curve_run_reads_a_given_run_or_records_no_curve(tmp_path):
    """``curve_run: DIR`` reads that finished run (never runs it); ``curve_run: none`` records
    "no curve"; combine then gives the methods without a curve step times and no time to target;
    a curve_run without metrics.jsonl is a spec error."""
    import json

    run = tmp_path / "exp" / "dense_run"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"world_size": 4}))
    lines = [{"kind": "step", "step": 50, "epoch": 1, "train_loss": 1.6},
             {"epoch": 1, "steps": 468, "test_accuracy": 0.8394},
             {"epoch": 2, "steps": 468, "test_accuracy": 0.9048}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = os.path.join(ROOT, "configs/cifar10_resnet20/dense.yaml")
    base = {"name": "t", "runs_dir": str(tmp_path / "runs"),
            "time_to_target": {"metric": "test_accuracy", "mode": "max", "abs": 0.005, "reference": "d",
                               "budget_epochs": 2},
            "methods": [{"name": "d", "config": cfg, "role": "dense", "curve_run": str(run)},
                        {"name": "f", "config": cfg, "role": "dense", "curve_run": "none"}]}
    spec = bench.load_spec(base)
    recs = {m["name"]: bench.run_curve(m, spec) for m in spec["methods"]}
    assert recs["d"]["status"] == "ok" and recs["d"]["source"] == str(run) and recs["d"]["reused"] is True
    assert recs["d"]["curve"] == [{"epoch": 1, "steps": 468, "value": 0.8394},
                                  {"epoch": 2, "steps": 936, "value": 0.9048}]
    assert recs["f"]["status"] == "none" and recs["f"].get("curve") is None
    assert not (tmp_path / "runs").exists()  # nothing was run
    results = {"spec": dict(spec, time_to_target=dict(spec["time_to_target"], reuse_curves=True))}
    bench.load_curves(results)
    assert results["curves"]["d"]["curve"] == recs["d"]["curve"] and results["curves"]["f"]["status"] == "none"
    cells = [_cell("d", "10mbit", 10.0, 1.5, 20.0), _cell("f", "10mbit", 10.0, 0.75, 20.0)]
    curves = {m: r["curve"] for m, r in recs.items() if r["status"] == "ok"}
    rows = {r["method"]: r for r in bench_ttt.combine(curves, cells, "d", "max", abs_=0.005,
                                                      roles={"d": "dense", "f": "dense"}, budget_epochs=2)["rows"]}
    # target 0.9048 - 0.005 = 0.8998: reached at epoch 2, 936 steps x 1.5 s + 2 evaluations x 20 s
    assert rows["d"]["epoch"] == 2 and rows["d"]["time_to_target_s"] == pytest.approx(936 * 1.5 + 2 * 20.0)
    assert rows["f"]["time_to_target_s"] is None and rows["f"]["note"] == "no curve"
    assert rows["f"]["step_s"] == 0.75
    text = "\n".join(bench_ttt.markdown({"spec": results["spec"], "curves": results["curves"],
                                          "time_to_target": bench_ttt.combine(
                                              curves, cells, "d", "max", abs_=0.005, budget_epochs=2)}))
    assert "No curve (none exists for these methods; `curve_run: none` in the spec): `f`" in text
    with pytest.raises(bench.SpecError, match=r"curve_run: no metrics.jsonl in"):
        bench.load_spec(dict(base, methods=[dict(base["methods"][0], curve_run=str(tmp_path / "nope"))]))


def test_dilated_cells_use_the_emulated_clock():
    """A time-dilated cell's step and evaluation times x its factor (``step_time_dilated_s``,
    ``eval_time_dilated_s``) are what the time to target charges; the measured ones are kept."""
    curves = {m: bench_ttt.curve_from_epochs(e, "valid_perplexity") for m, e in EPOCHS.items()}
    cells = [dict(_cell("fp16", "100mbit", 100.0, 20.0, 8.0), step_time_dilated_s=1.0, eval_time_dilated_s=0.4),
             dict(_cell("sgc", "100mbit", 100.0, 0.5, 10.0), step_time_dilated_s=0.025, eval_time_dilated_s=0.5)]
    rows = {r["method"]: r for r in bench_ttt.combine(curves, cells, "fp16", "min", rel=0.03, roles=ROLES,
                                                      eval_time="cell")["rows"]}
    # fp16 reaches 412 at epoch 3 (150 steps); sgc at epoch 2 (100 steps)
    assert rows["fp16"]["time_to_target_s"] == pytest.approx(150 * 1.0 + 3 * 0.4)
    assert rows["sgc"]["time_to_target_s"] == pytest.approx(100 * 0.025 + 2 * 0.5)
    assert rows["sgc"]["step_s"] == 0.025 and rows["sgc"]["eval_measured_s"] == 0.5
    med = {r["method"]: r for r in bench_ttt.combine(curves, cells, "fp16", "min", rel=0.03, roles=ROLES)["rows"]}
    assert med["sgc"]["eval_s"] == pytest.approx(0.45)  # median of the dilated 0.4 and 0.5


def test_curve_run_reads_the_curves_of_a_results_json(tmp_path):
    """``curve_run: <results>.json`` takes ``curves[<method name>]`` of another matrix's results
    (never runs anything), cut to ``budget_epochs``; a missing file or method is a spec error."""
    import json

    stored = {"curves": {"d": {"status": "ok", "run_id": "x-curve-d", "method": "d",
                               "curve": [{"epoch": 1, "steps": 48, "value": 900.0},
                                         {"epoch": 2, "steps": 96, "value": 500.0},
                                         {"epoch": 3, "steps": 144, "value": 450.0}]},
                         "bad": {"status": "failed", "error": "x"}}}
    path = tmp_path / "res.json"
    path.write_text(json.dumps(stored))
    cfg = os.path.join(ROOT, "configs/ptb_lstm/dense.yaml")
    base = {"name": "t", "runs_dir": str(tmp_path / "runs"),
            "time_to_target": {"reference": "d", "budget_epochs": 2},
            "methods": [{"name": "d", "config": cfg, "role": "dense", "curve_run": str(path)}]}
    spec = bench.load_spec(base)
    rec = bench.run_curve(spec["methods"][0], spec)
    assert rec["status"] == "ok" and rec["reused"] is True and rec["steps"] == 96 and rec["final_value"] == 500.0
    assert rec["curve"] == stored["curves"]["d"]["curve"][:2]
    assert rec["source"] == f"{path} (curves.d, run x-curve-d)"
    assert not (tmp_path / "runs").exists()
    with pytest.raises(bench.SpecError, match=r"has no ok curve of the method 'bad'"):
        bench.load_spec(dict(base, methods=[dict(base["methods"][0], name="bad")],
                             time_to_target={"reference": "bad"}))
    with pytest.raises(bench.SpecError, match=r"nope.json not found"):
        bench.load_spec(dict(base, methods=[dict(base["methods"][0], curve_run=str(tmp_path / "nope.json"))]))


def test_eval_time_leaves_out_the_end_only_test_split():
    """train.test_every_epoch=false: the test split runs after the last epoch only, so a cell's
    per-epoch evaluation time is the rest of the wall time less that one-off split (recorded apart);
    with the default (true) every epoch's evaluation counts, as before."""
    from hgsgc import bench

    epochs = [{"epoch": 1, "epoch_time_s": 10.0, "eval_time_s": 5.0, "eval_valid_time_s": 2.0,
               "eval_test_time_s": 3.0}]
    summary = {"wall_time_s": 15.5}
    off = {"train": {"test_every_epoch": False}}
    assert bench._final_only_eval_s(off, epochs) == 3.0
    assert bench._eval_time(summary, off, epochs) == pytest.approx(2.5)
    assert bench._final_only_eval_s({"train": {"test_every_epoch": True}}, epochs) is None
    assert bench._eval_time(summary, {"train": {}}, epochs) == pytest.approx(5.5)
    two = [{"epoch": 1, "epoch_time_s": 10.0, "eval_valid_time_s": 2.0},
           {"epoch": 2, "epoch_time_s": 10.0, "eval_valid_time_s": 2.0, "eval_test_time_s": 3.0}]
    assert bench._eval_time({"wall_time_s": 27.0}, off, two) == pytest.approx(2.0)
    assert bench._eval_time(summary, off, []) is None


def test_quality_plot_draws_the_quality_the_task_reports(tmp_path):
    """The quality-vs-wall-time plot's data (not its pixels): the language model's cells report a
    perplexity (lower is better), not an accuracy, and results files written before the epochs kept
    it give one point per cell (wall time, final value); image cells keep their accuracy."""
    from hgsgc import bench

    lm = {"spec": {"time_to_target": {"metric": "valid_perplexity"}}, "cells": [
        {"method": "fp16", "hosts": 4, "bandwidth": "10mbit", "status": "ok", "wall_time_s": 171.0,
         "final_valid_perplexity": 7838.6, "final_test_accuracy": None,
         "accuracy_curve": [{"epoch": 1, "test_accuracy": None, "epoch_time_s": 85.9}]},
        {"method": "sgc", "hosts": 4, "bandwidth": "10mbit", "status": "ok", "wall_time_s": 75.0,
         "accuracy_curve": [{"epoch": 1, "test_accuracy": None, "epoch_time_s": 10.0, "valid_perplexity": 900.0},
                            {"epoch": 2, "test_accuracy": None, "epoch_time_s": 12.0, "valid_perplexity": 700.0}]},
        {"method": "bad", "hosts": 4, "bandwidth": "10mbit", "status": "failed"}]}
    q = bench.quality_series(lm)
    assert (q["metric"], q["better"]) == ("valid_perplexity", "lower")
    assert "perplexity" in q["label"] and "lower is better" in q["label"]
    assert q["series"] == [{"label": "fp16 4h 10mbit", "x": [171.0], "y": [7838.6]},
                           {"label": "sgc 4h 10mbit", "x": [10.0, 22.0], "y": [900.0, 700.0]}]
    img = {"spec": {}, "cells": [{"method": "dense", "hosts": 2, "bandwidth": "100mbit", "status": "ok",
                                  "wall_time_s": 30.0, "final_test_accuracy": 0.8,
                                  "accuracy_curve": [{"epoch": 1, "test_accuracy": 0.8, "epoch_time_s": 25.0}]}]}
    q = bench.quality_series(img)
    assert (q["metric"], q["better"], q["series"][0]["y"]) == ("test_accuracy", "higher", [0.8])
    assert bench.quality_series({"cells": [dict(img["cells"][0], accuracy_curve=[],
                                                final_test_accuracy=None)]})["series"] == []
    lm["cells"] = [dict(c, time_per_epoch_s=1.0, bandwidth_mbit=10.0) for c in lm["cells"]]
    paths = bench.plots(lm, str(tmp_path), "lm")
    assert [os.path.basename(p) for p in paths] == ["lm_epoch_time.png", "lm_accuracy.png"]
