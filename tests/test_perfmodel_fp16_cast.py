"""The fp16 cast as a measured compression cost of the performance model (session 11, pm11).

The dense fp16 exchange (``DenseAllreduce.reduce_raw``, ``n >= 2`` ranks) casts every float32
gradient to ``float16(x / n)`` before Horovod's allreduce and the sum back to float32 after. The
bench's compute input is a world of one, which casts nothing, so until session 11 the model
charged fp16 cells no compression at all (docs/benchmarks.md, "Session 10": about 3.9 ms of the
TensorFlow threads' CPU per alexnet_small step). Now: ``perfmodel.fp16_cast_s(shapes, cal) =
sum over tensors (a + b numel)`` from a per-tensor-size calibration
(``scripts/cluster/calibrate_fp16_cast.py``, ``perfmodel.fit_fp16_cast``), charged as the fp16
cell's compression by ``scripts/cluster/perfmodel_validation.py --fp16-cast`` and measured by
``perfmodel.measure_compression_s`` (``hgsgc plan``) for fp16 settings."""
import json
import math
import os

import numpy as np
import pytest

from conftest import ROOT, load_script

from hgsgc import perfmodel as pm

#: a calibration: 5 us per tensor, 0.5 ns per element, 40 us per tf.function call (not charged)
CAL = {"call_s": 40e-6, "per_tensor_s": 5e-6, "per_element_s": 0.5e-9}


def test_fp16_cast_s_is_the_per_tensor_formula():
    shapes = [(3, 3, 1, 32), (32,), (0, 4), (1000, 10), (10,)]
    want = sum(5e-6 + 0.5e-9 * d for d in (288, 32, 10000, 10))   # the empty tensor casts nothing
    assert pm.fp16_cast_s(shapes, CAL) == pytest.approx(want, rel=1e-12)
    assert pm.fp16_cast_s([], CAL) == 0.0
    with pytest.raises(ValueError, match="per_element_s"):
        pm.fp16_cast_s(shapes, {"per_tensor_s": 1e-6})
    with pytest.raises(ValueError, match="per_tensor_s >= 0"):
        pm.fp16_cast_s(shapes, {"per_tensor_s": -1e-6, "per_element_s": 1e-9})


def test_fit_recovers_call_tensor_and_element_costs():
    pts = [(m, d, 40e-6 + m * 5e-6 + m * d * 0.5e-9) for m in (1, 8) for d in (1000, 100000, 4000000)]
    f = pm.fit_fp16_cast(pts)
    assert f["call_s"] == pytest.approx(40e-6, rel=1e-6)
    assert f["per_tensor_s"] == pytest.approx(5e-6, rel=1e-6)
    assert f["per_element_s"] == pytest.approx(0.5e-9, rel=1e-9)
    assert f["residual_rel"] < 1e-9
    with pytest.raises(ValueError, match="different tensor counts"):
        pm.fit_fp16_cast([(1, 10, 1.0), (1, 100, 2.0), (1, 1000, 3.0)])


def test_the_cast_graph_is_the_exchange_arithmetic():
    """What measure_fp16_cast_s times is reduce_raw's arithmetic: float32(float16(x / n))."""
    import tensorflow as tf

    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32) * 1e3
    (got,) = pm._fp16_cast_graph([tf.constant(x)], 3)
    assert got.dtype == tf.float32
    np.testing.assert_array_equal(got.numpy(), (x / np.float32(3)).astype(np.float16).astype(np.float32))


def test_measure_fp16_cast_times_one_call_and_compression_charges_it_only_with_peers():
    ticks = iter(range(1000))
    clock = lambda: float(next(ticks))  # noqa: E731 - every timed call lasts exactly 1 tick
    assert pm.measure_fp16_cast_s([(10, 10), (5,)], reps=3, clock=clock) == 1.0
    with pytest.raises(ValueError, match="n >= 2"):
        pm.measure_fp16_cast_s([(10,)], n=1)
    assert pm.measure_fp16_cast_s([(0, 3)]) == 0.0
    from hgsgc.compression import Compression

    ticks2 = iter(range(1000))
    cost = pm.measure_compression_s(Compression.fp16, [(10, 10)], reps=3, clock=lambda: float(next(ticks2)))
    assert cost == {"base_s": 1.0, "per_payload_s": 0.0, "alone_s": 0.0}
    assert pm.compression_at(cost, 4, "ring") == 1.0 and pm.compression_at(cost, 1, "ring") == 0.0
    assert pm.measure_compression_s(Compression.none, [(10, 10)]) == {"base_s": 0.0, "per_payload_s": 0.0}


def _bench(tmp_path):
    cfg = os.path.join(ROOT, "configs/fashion_mnist_dense.yaml")
    spec = {"name": "t", "overrides": ["train.epochs=1"], "mpi_args": [], "pin": True,
            "methods": [{"name": m, "config": cfg, "overrides": [f"compression.method={m}"], "mpi_args": [],
                         "cell_overrides": []} for m in ("fp16", "none")]}
    cells = [{"method": m, "status": "ok", "hosts": 2, "bandwidth": bw, "steps": 40, "mean_step_time_s": 0.1,
              "load_before": [1.0], "load_after": [1.0]} for m in ("fp16", "none") for bw in ("100mbit", "1gbit")]
    d = {"name": "t", "spec": spec, "runtime": {"HOROVOD_CYCLE_TIME": "1"}, "cells": cells,
         "compute_only": {m: {"status": "ok", "mean_step_time_s": 0.013} for m in ("fp16", "none")},
         "compute_only_shared": {}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(d))
    return str(path), cfg


def test_the_predicted_fp16_step_includes_the_cast_term(tmp_path):
    """bench_rows with the cast calibration: an fp16 cell's compression is sum over the model's
    tensors of (a + b numel), its predicted step = compute + that + wire + coordination; the same
    cell without the calibration is the model before (compression 0), and fp32 cells are unchanged."""
    from hgsgc.config import load_config
    from hgsgc.plan import build_plan_model

    v = load_script("cluster", "perfmodel_validation.py")
    path, cfg = _bench(tmp_path)
    model, _ = build_plan_model(load_config(cfg, ["train.epochs=1", "compression.method=fp16"]))
    numels = [math.prod(int(x) for x in w.shape) for w in model.trainable_variables]
    want_cast = len(numels) * CAL["per_tensor_s"] + sum(numels) * CAL["per_element_s"]
    with_cast = v.bench_rows(path, None, fp16_cast={"fit": CAL})
    before = v.bench_rows(path, None)
    assert [r["run"] for r in with_cast] == [r["run"] for r in before] and len(before) == 4
    for new, old in zip(with_cast, before):
        p = new["predicted"]
        if new["method"] == "fp16":
            assert p["compression_s"] == pytest.approx(want_cast, rel=1e-12) and new["fp16_cast_s"] == p["compression_s"]
            assert old["predicted"]["compression_s"] == 0.0
            assert p["step_s"] == pytest.approx(p["compute_s"] + p["compression_s"] + p["wire_s"] + p["coordination_s"],
                                                rel=1e-12)
            assert p["compute_s"] == 0.013
            # the tbf bucket is full at every start either way (idle >= 13 ms): only the cast is added
            assert p["step_s"] - old["predicted"]["step_s"] == pytest.approx(want_cast, rel=1e-9)
        else:
            assert new["predicted"] == old["predicted"] and new["fp16_cast_s"] == 0.0
