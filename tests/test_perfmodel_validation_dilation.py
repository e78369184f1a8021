"""scripts/cluster/perfmodel_validation.py on time-dilated bench cells (session 9, gr9).

A cell of ``dilation: cpu_share`` / ``gpu`` ran its links at the emulated rate (f x nominal) and
its measured step is on this machine's clock; the prediction must use that link, not the nominal
one (before this fix every dilated cell was predicted at the nominal rate)."""
import json
import os

import pytest


def _validation():
    from conftest import load_script

    return load_script("cluster", "perfmodel_validation.py")


def _bench(tmp_path, dilation):
    from conftest import ROOT

    spec = {"name": "t", "overrides": ["train.epochs=1"], "mpi_args": [], "pin": False,
            "methods": [{"name": "fp16", "config": os.path.join(ROOT, "configs/fashion_mnist_dense.yaml"),
                         "overrides": ["compression.method=fp16"], "mpi_args": [], "cell_overrides": []}]}
    cell = {"method": "fp16", "status": "ok", "hosts": 8, "bandwidth": "10mbit", "steps": 5,
            "mean_step_time_s": 2.0, "load_before": [9.0], "load_after": [11.0]}
    if dilation:
        cell["dilation"] = dilation
    d = {"name": "t", "spec": spec, "runtime": {"HOROVOD_CYCLE_TIME": "1"}, "cells": [cell],
         "compute_only": {"fp16": {"status": "ok", "mean_step_time_s": 0.05}},
         "compute_only_shared": {"fp16@8": {"status": "ok", "mean_step_time_s": 0.4}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_dilated_cell_is_predicted_on_its_emulated_link(tmp_path):
    import hgsgc
    from hgsgc import perfmodel as pm
    from hgsgc.config import load_config
    from hgsgc.plan import build_plan_model

    v = _validation()
    (row,) = v.bench_rows(_bench(tmp_path, {"mode": "cpu_share", "factor": 0.125,
                                            "emulated_rate": "1250kbit"}), None)
    (nominal,) = v.bench_rows(_bench(tmp_path, None), None)
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs/fashion_mnist_dense.yaml"),
                      ["train.epochs=1", "compression.method=fp16"])
    model, _ = build_plan_model(cfg)
    shapes = [tuple(int(x) for x in w.shape) for w in model.trainable_variables]
    cal = dict(pm.EMULATOR, cycle_s=0.001)
    traffic = pm.traffic(hgsgc.Compression.fp16, shapes)
    want = pm.predict_step(0.4, 0.0, traffic, 8, pm.link_for("1250kbit", calibration=cal, tbf=True),
                           cycle_s=0.001)
    want_nominal = pm.predict_step(0.4, 0.0, traffic, 8, pm.link_for("10mbit", calibration=cal, tbf=True),
                                   cycle_s=0.001)
    assert row["predicted"] == want and nominal["predicted"] == want_nominal
    assert row["error"] == want["step_s"] / 2.0 - 1
    # compute (the 8-at-once step) and coordination do not change with the link; the wire does,
    # by more than 4x here (8x the rate, less the token bucket's share)
    assert row["predicted"]["compute_s"] == nominal["predicted"]["compute_s"] == 0.4
    assert row["predicted"]["wire_s"] > 4 * nominal["predicted"]["wire_s"]
    assert row["bandwidth"] == "10mbit (dilated: 1250kbit)" and nominal["bandwidth"] == "10mbit"
    assert row["dilation"] == {"mode": "cpu_share", "factor": 0.125, "emulated_rate": "1250kbit"}
    assert nominal["dilation"] is None
