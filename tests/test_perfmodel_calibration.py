"""The emulated link's measured rate in the validation (session 10, pm10; issue 10 item 5: "alpha and
beta calibrated on the emulator").

A ``scripts/cluster/calibrate_link.py`` JSON with fixed probe numbers -> ``calibration_from`` ->
``bench_rows``: the predicted step of a bench cell is exactly compute + coordination + wire with
the PROBE's rate (efficiency x nominal), its 0-byte round as alpha, and the emulator's token
bucket, not the nominal rate; the row says which probe (pinned or not) it used. ``hgsgc plan``
keeps the nominal rate x the framing efficiency (no probe: a real network)."""
import json
import os

import pytest

from conftest import ROOT

NO_PUT = ["--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum"]


def _validation():
    from conftest import load_script

    return load_script("cluster", "perfmodel_validation.py")


def _probe(tmp_path, pinned=True):
    """A calibrate_link.py result: 1 Gbit/s measured at 300 Mbit/s (CPU-bound), 100 Mbit/s at 90."""
    def flags(alpha0, beta):
        return {"alpha_s": -1e-3, "beta_Bps": beta, "mbit_s": beta * 8 / 1e6,
                "runs": [{"size": 0, "median_s": alpha0, "all_s": [alpha0], "load_before": [1.0],
                          "load_after": [1.0]},
                         {"size": 2000000, "median_s": 2e6 / beta, "all_s": [2e6 / beta],
                          "load_before": [1.0], "load_after": [1.0]}]}
    cells = [{"bandwidth": "100mbit", "rate_bit_s": 1e8, "put": flags(3e-5, 9e6), "no_put": flags(3e-5, 11.25e6),
              "efficiency": 0.9, "bidir_factor": 0.8},
             {"bandwidth": "1gbit", "rate_bit_s": 1e9, "put": flags(2e-5, 33.75e6), "no_put": flags(2e-5, 37.5e6),
              "efficiency": 0.3, "bidir_factor": 0.9}]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"hosts": 2, "mode": "sendrecv (pairwise with 2 hosts)", "rounds": 5,
                                "pinned": pinned, "cells": cells}))
    return str(path)


def _bench(tmp_path, method_mpi_args):
    spec = {"name": "t", "overrides": ["train.epochs=1"], "mpi_args": [], "pin": True,
            "methods": [{"name": "fp16", "config": os.path.join(ROOT, "configs/fashion_mnist_dense.yaml"),
                         "overrides": ["compression.method=fp16"], "mpi_args": method_mpi_args,
                         "cell_overrides": []}]}
    cell = {"method": "fp16", "status": "ok", "hosts": 2, "bandwidth": "1gbit", "steps": 40,
            "mean_step_time_s": 0.1, "load_before": [1.9], "load_after": [2.1]}
    d = {"name": "t", "spec": spec, "runtime": {"HOROVOD_CYCLE_TIME": "1"}, "cells": [cell],
         "compute_only": {"fp16": {"status": "ok", "mean_step_time_s": 0.0132}}, "compute_only_shared": {}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(d))
    return str(path)


def _fp16_bytes():
    from hgsgc.config import load_config
    from hgsgc.plan import build_plan_model

    cfg = load_config(os.path.join(ROOT, "configs/fashion_mnist_dense.yaml"),
                      ["train.epochs=1", "compression.method=fp16"])
    model, _ = build_plan_model(cfg)
    return 2 * sum(int(v.shape.num_elements()) for v in model.trainable_variables)


def test_calibration_from_takes_the_probe(tmp_path):
    v = _validation()
    p = _probe(tmp_path)
    cal = v.calibration_from(p, "1gbit", put=False)
    assert (cal["alpha_s"], cal["efficiency"], cal["bidir_factor"], cal["pinned"]) == (2e-5, 0.3, 1.0, True)
    cal = v.calibration_from(p, "1gbit", put=True)
    assert cal["bidir_factor"] == 0.9 and "pinned probe" in cal["source"]
    assert v.calibration_from(p, "100mbit", put=True)["efficiency"] == 0.9
    # an emulated rate between the probed ones takes the nearest probe
    assert v.calibration_from(p, "40mbit", put=True)["efficiency"] == 0.9
    assert v.calibration_from(_probe(tmp_path, pinned=False), "1gbit")["pinned"] is False


def test_bench_cell_is_predicted_at_the_probed_rate_exactly(tmp_path):
    from hgsgc import costs
    from hgsgc import perfmodel as pm

    v = _validation()
    (row,) = v.bench_rows(_bench(tmp_path, NO_PUT), _probe(tmp_path))
    B = _fp16_bytes()
    # by hand: 2 ranks, the fp16 buffer B; Open MPI's allreduce of B; no put: bidir 1
    c = costs.ompi_collective_cost("allreduce", 2, B)
    neg = costs.ompi_collective_cost("allreduce", 2, pm.NEGOTIATION_BYTES)["messages"]
    alpha, beta, cycle = 2e-5, 1e9 / 8 * 0.3, 1e-3      # the probe's 0-byte round and 300 Mbit/s
    coord = cycle / 2 + neg * alpha
    burst = 250000 * 1448 / 1514                         # cluster.sh's bucket at 1gbit, payload bytes
    idle = 0.0132 + coord                                # refill (idle x beta) < B: the refill is left
    b0 = min(burst, idle * beta)
    wire = c["messages"] * alpha + (c["bytes"] - b0) / beta
    p = row["predicted"]
    assert p["compute_s"] == 0.0132 and p["compression_s"] == 0.0 and p["wait_s"] == 0.0
    assert p["coordination_s"] == pytest.approx(coord, rel=1e-12)
    assert p["wire_s"] == pytest.approx(wire, rel=1e-12)
    assert p["step_s"] == pytest.approx(0.0132 + coord + wire, rel=1e-12)
    assert row["error"] == pytest.approx(p["step_s"] / 0.1 - 1, rel=1e-12)
    assert row["calibration_pinned"] is True and row["settings"].endswith(", pinned probe 300 Mbit/s")
    # the nominal rate (the framing efficiency only, as hgsgc plan charges a real 1 Gbit/s link)
    # would predict far less wire: the probe's 300 Mbit/s is what the emulated link carries
    nominal = pm.link_for("1gbit", bidir_factor=1.0)
    assert nominal.beta_Bps == pytest.approx(1e9 / 8 * pm.EMULATOR["efficiency"])
    assert p["wire_s"] > 2.9 * (c["bytes"] - b0) / nominal.beta_Bps


def test_put_cell_takes_the_probes_pairwise_factor(tmp_path):
    from hgsgc import costs
    from hgsgc import perfmodel as pm

    v = _validation()
    (row,) = v.bench_rows(_bench(tmp_path, []), _probe(tmp_path))
    B = _fp16_bytes()
    c = costs.ompi_collective_cost("allreduce", 2, B)
    assert c["pairwise"]
    neg = costs.ompi_collective_cost("allreduce", 2, pm.NEGOTIATION_BYTES)["messages"]
    alpha, beta = 2e-5, 1e9 / 8 * 0.3
    coord = 0.5e-3 + neg * alpha
    b0 = min(250000 * 1448 / 1514, (0.0132 + coord) * beta)
    assert row["predicted"]["wire_s"] == pytest.approx(c["messages"] * alpha + (c["bytes"] - b0) / (0.9 * beta),
                                                       rel=1e-12)


def test_before_and_after_table(tmp_path):
    """``--before ROWS.json``: each cell's error under the earlier run (here: no probe, the
    EMULATOR defaults) beside its error now (the probe), and both counts over the same cells."""
    v = _validation()
    bench, probe = _bench(tmp_path, NO_PUT), _probe(tmp_path)
    a, b, md = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "b.md"
    assert v.main(["--bench", bench, "--json", str(a)]) == 0
    assert v.main(["--bench", f"{bench}={probe}", "--before", str(a), "--json", str(b), "--md", str(md)]) == 0
    (ra,), (rb,) = json.load(open(a)), json.load(open(b))
    assert rb["error_before"] == ra["error"] and rb["error"] != ra["error"]
    text = md.read_text()
    assert "| error before |" in text.splitlines()[0]
    assert f"| {100 * rb['error']:+.1f} % | {100 * ra['error']:+.1f} % |" in text
    within = lambda e: int(abs(e) <= 0.15)
    assert f"the same 1 cells: within 15 %: {within(ra['error'])} of 1; now: {within(rb['error'])} of 1." in text
