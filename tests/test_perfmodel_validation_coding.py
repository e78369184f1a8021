"""scripts/cluster/perfmodel_validation.py predicts a sparse cell with the index coding it RAN with
(session 10, pm10).

``bench_rows`` rebuilds each cell's compression from the results JSON's stored spec, which names
only the overrides given, so the library's current default filled the rest: once the default
index coding changes (fixed -> Elias-Fano), every committed cell that ran with fixed indices would
be predicted with the other coding's bytes. The cell's own record (``compression.index_coding``;
absent in cells from before session 9: those ran ``fixed``) decides. alexnet_small, SGC density
0.005, 2-bit: 24,964 B per exchange with fixed indices, 12,812 B with Elias-Fano (docs/compression.md)."""
import json
import os

import pytest

from conftest import ROOT


def _validation():
    from conftest import load_script

    return load_script("cluster", "perfmodel_validation.py")


def _bench(tmp_path, coding, delay=1, name="b.json"):
    spec = {"name": "t", "overrides": ["train.epochs=1"], "mpi_args": [], "pin": True,
            "methods": [{"name": "sgc", "config": os.path.join(ROOT, "configs/fashion_mnist_sgc.yaml"),
                         "overrides": [f"compression.delay={delay}"], "mpi_args": [], "cell_overrides": []}]}
    comp = {"density": 0.005, "bits": 2, "delay": delay, "hierarchy": "allgather", "method": "sgc"}
    if coding is not None:
        comp["index_coding"] = coding
    cell = {"method": "sgc", "status": "ok", "hosts": 2, "bandwidth": "100mbit", "steps": 40,
            "mean_step_time_s": 0.02, "load_before": [1.0], "load_after": [1.0], "compression": comp}
    d = {"name": "t", "spec": spec, "runtime": {"HOROVOD_CYCLE_TIME": "1"}, "cells": [cell],
         "compute_only": {"sgc": {"status": "ok", "mean_step_time_s": 0.018}}, "compute_only_shared": {}}
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("coding,payload", [(None, 24964), ("fixed", 24964), ("elias_fano", 12812)])
def test_sparse_cell_is_predicted_with_its_recorded_coding(tmp_path, coding, payload):
    v = _validation()
    (row,) = v.bench_rows(_bench(tmp_path, coding), None)
    assert row["payload_bytes_model"] == payload
    assert row["index_coding"] == (coding or "fixed")


def test_delay_keeps_the_payload_per_exchange(tmp_path):
    v = _validation()
    (row,) = v.bench_rows(_bench(tmp_path, "elias_fano", delay=4), None)
    assert row["payload_bytes_model"] == 12812 and row["delay"] == 4


def test_the_two_codings_differ_only_in_the_wire(tmp_path):
    """Same cell, two recorded codings: compute and coordination equal, the wire differs (100 Mbit/s
    emulated link: both payloads fit the tbf bucket after 18 ms of idle, so it is 0 for both), and a
    real link (no bucket) charges the 12,152 B difference at the link's rate."""
    from hgsgc import perfmodel as pm

    v = _validation()
    (a,) = v.bench_rows(_bench(tmp_path, "fixed", name="a.json"), None, tbf=False)
    (b,) = v.bench_rows(_bench(tmp_path, "elias_fano", name="b.json"), None, tbf=False)
    assert a["predicted"]["compute_s"] == b["predicted"]["compute_s"] == 0.018
    assert a["predicted"]["coordination_s"] == b["predicted"]["coordination_s"]
    beta = 1e8 / 8 * pm.EMULATOR["efficiency"] * pm.EMULATOR["bidir_factor"]   # 2 ranks: pairwise
    assert a["predicted"]["wire_s"] - b["predicted"]["wire_s"] == pytest.approx((24964 - 12812) / beta, rel=1e-9)


def test_step_profile_rows_take_fixed_indices_when_none_recorded(tmp_path):
    """A committed session-7 step profile (SGC delay 1, alexnet_small, density 0.005; no coding
    recorded: it ran fixed) is predicted with the fixed coding's 24,964 B, whatever the default."""
    v = _validation()
    f = os.path.join(ROOT, "docs/benchmarks/step_profile/s7_buckets_1gbit.json")
    out = tmp_path / "rows.json"
    assert v.main([f, "--json", str(out)]) == 0
    (row,) = json.load(open(out))
    assert (row["index_coding"], row["payload_bytes_model"]) == ("fixed", 24964)
