"""ONE Hourglass prediction (issue 11): ``hgsgc plan``, ``Layout(..., "auto", cost=...)`` and
``layout: auto`` (``auto.choose``) build their inputs each in their own way, then call the same
``perfmodel.predict_hourglass`` (the GPipe schedule). On the same fixed measurements they must
predict identical step times for every ``F`` (exact equality, not approximate).

Single process: the measurements are replaced by fixed values (monkeypatch), and the collective
entry points run on a fake 4-rank communicator whose ranks all report the same (rank 0's view:
allgather returns n copies, bcast returns its argument). The entry points differ in what they
measure: ``cost=`` measures no compression, update or CPU share, so the fixed compression and
update costs are 0 and each fake rank has a machine of its own (share 1)."""
import dataclasses

import pytest

from hgsgc import perfmodel as pm

N = 4
MEAS = dict(t_conv=4.1e-4, t_fc=2.3e-4, act_bytes=310.0, grad_bytes=262.5, codec_s=3.1e-6, cpu_parallelism=1.0,
            density=0.5)
STAGES = dict(conv_fwd_mb_s=2.1e-3, conv_bwd_mb_s=3.3e-3, fc_call_s=1.2e-3, fc_row_s=9.5e-5)
ZERO = {"base_s": 0.0, "per_payload_s": 0.0}
PROBE = {"rows": 8, "pairs": [[1, 4.2e-3]], "loopback": False, "reps": 10}
MSG_S = 7.5e-4
OVERRIDES = ["layout=hourglass", "model.name=tiny", "train.batch_size=16", "hourglass.micro_batches=2", "compression.method=sgc",
             "compression.density=0.05", "compression.delay=2", "hourglass.link_bandwidth_mbps=100",
             "hourglass.act_codec=sparse+q8", "hourglass.grad_codec=q8"]


class FakeComm:
    """Rank 0 of ``n`` ranks that all measure the same (no MPI)."""

    def __init__(self, n):
        self.n = n

    def Get_rank(self):
        return 0

    def Get_size(self):
        return self.n

    def allgather(self, x):
        return [x] * self.n

    def bcast(self, x, root=0):
        return x

    def Barrier(self):
        pass

    def Split(self, *a, **k):
        return self

    def Dup(self):
        return self


@pytest.fixture
def fixed(monkeypatch):
    from hgsgc.hourglass import auto, costmodel

    monkeypatch.setattr(auto, "measure", lambda *a, **k: dict(MEAS))
    monkeypatch.setattr(auto, "measure_pipeline_stages", lambda *a, **k: dict(STAGES))
    monkeypatch.setattr(auto, "measure_compression_and_update", lambda *a, **k: {
        "compression_cost": {"dp": dict(ZERO), "conv": dict(ZERO), "fc": dict(ZERO)},
        "update_conv_s": 0.0, "update_fc_s": 0.0})
    monkeypatch.setattr(auto, "measure_together", lambda comm, split, x, **k: [MEAS["t_conv"] * len(x)] * 5)
    monkeypatch.setattr(auto, "measure_wait_cpu", lambda comm, **k: 0.0)   # Layout(cost=...) has no such term
    monkeypatch.setattr(pm, "measure_compression_s", lambda *a, **k: dict(ZERO))
    # the boundary message: a fixed probe and a fixed per-message cost (plan's loopback and the
    # pair probe of the other two subtract different links; the model must be the same on the same msg)
    monkeypatch.setattr(costmodel, "boundary_sample", lambda *a, **k: (None, None, None))
    monkeypatch.setattr(costmodel, "probe_boundary", lambda comm, *a, **k: dict(PROBE))
    monkeypatch.setattr(costmodel, "boundary_message_inputs", lambda probe, *a, **k: {
        "boundary_msg_s": MSG_S, "per_pair": [], "rows": probe["rows"], "loopback": probe["loopback"],
        "reps": probe["reps"], "formula": "fixed"})
    monkeypatch.setattr(costmodel, "find_machines", lambda comm, **k: {
        "machine_of": list(range(N)), "machine_cores": [2.0] * N, "how": ["fake"] * N, "rank_cores": [2] * N})
    monkeypatch.setattr(costmodel, "take_turns", lambda comm, machine_of, fn, timeout_s=0.0: (fn(), None))
    # auto.choose shuts down a Horovod of an earlier run in this process (as layout: auto must);
    # here that is the Horovod test modules initialised at import (test_optimizer, ...), which
    # cannot be initialised again in this process: keep it (the measurements are fixed above)
    import horovod.tensorflow as hvd

    monkeypatch.setattr(hvd, "shutdown", lambda: None)


def _plan_steps(cfg):
    from hgsgc import plan as plan_mod

    b = cfg.train.batch_size
    link = pm.Link(0.0, 100e6 / 8, 1.0)            # what the override gives the auto choices
    res = plan_mod.plan(cfg, N, "100mbit", compute_s=b * (MEAS["t_conv"] + MEAS["t_fc"]), reps=1, link=link,
                        cycle_s=pm.horovod_cycle_s())
    assert res["hourglass"]["update_s"] == 0.0
    rows = sorted((r for r in res["rows"] if r["layout"] == "hourglass"), key=lambda r: r["fc_workers"])
    return [r["fc_workers"] for r in rows], [r["step_s"] for r in rows], [r["prediction"] for r in rows]


def _layout_cost_steps(cfg, split):
    """Layout(comm, "auto", cost=...): the cost callable returns the same measurements as
    CostInputs (what costmodel.measure_costs builds, with the stages per micro-batch given)."""
    from hgsgc.config import compression_from_config, fc_compression_from_config
    from hgsgc.hourglass.costmodel import CostInputs, link_inputs, payload_bytes
    from hgsgc.hourglass.layout import Layout

    cc, fcc = compression_from_config(cfg.compression), fc_compression_from_config(cfg)
    conv_shapes = [tuple(v.shape) for v in split.trunk_variables]
    fc_shapes = [tuple(v.shape) for v in split.head_variables]
    comm = FakeComm(N)

    def cost():
        return CostInputs(t_conv=MEAS["t_conv"], t_fc=MEAS["t_fc"], batch_size=cfg.train.batch_size,
                          act_bytes=MEAS["act_bytes"], grad_bytes=MEAS["grad_bytes"],
                          conv_payload=float(payload_bytes(cc, conv_shapes)),
                          fc_payload=float(payload_bytes(fcc, fc_shapes)), bandwidth=0.0,
                          conv_exchange=cc.algorithm, fc_exchange=fcc.algorithm, conv_delay=int(cc.delay),
                          fc_delay=int(fcc.delay), codec_s=MEAS["codec_s"],
                          micro_batches=int(cfg.hourglass.micro_batches), cycle_s=pm.horovod_cycle_s(), **STAGES)

    from hgsgc.hourglass import costmodel

    lay = Layout(comm, "auto", cost=cost, link=lambda: link_inputs(comm, 100.0), init_horovod=False,
                 boundary=lambda: costmodel.probe_boundary(comm, "sparse+q8", "q8", None, None, None))
    assert lay.cost_report["boundary_message"]["boundary_msg_s"] == MSG_S
    cands = lay.cost_report["candidates"]
    return [c["fc_workers"] for c in cands], [c["step_s"] for c in cands], cands


def _choose_steps(cfg, split, x):
    from hgsgc.hourglass import auto

    rep = auto.choose(FakeComm(N), split, x, cfg, hourglass_only=True)
    hg = rep["predictions"][1:]
    return [p["fc_workers"] for p in hg], [p["step_s"] for p in hg], rep


def test_plan_layout_cost_and_auto_choose_predict_identical_steps(fixed):
    import numpy as np

    from hgsgc.config import load_config
    from hgsgc.hourglass.split import split_model
    from hgsgc.plan import build_plan_model

    cfg = load_config(None, OVERRIDES)
    model, _ = build_plan_model(cfg)
    split = split_model(model, cfg.hourglass.split_layer)
    x = np.random.default_rng(0).random((16,) + tuple(int(d) for d in model.inputs[0].shape[1:])).astype(np.float32)

    fp, plan_steps, plan_preds = _plan_steps(cfg)
    fl, cost_steps, cands = _layout_cost_steps(cfg, split)
    fa, auto_steps, rep = _choose_steps(cfg, split, x)
    assert fp == fl == fa == [1, 2]
    assert plan_steps == cost_steps == auto_steps                      # exact: one function, same inputs
    assert rep["inputs"]["boundary_msg_s"] == MSG_S and all(
        p["schedule"]["stages_per_micro_batch_s"]["wire_in_s"] == 0.0 + MSG_S + 3 * 8 * 310.0 / 12.5e6
        for p in plan_preds[:1])                                        # F = 1: m = 3 CONV ranks, r = 8
    assert all(p["model"] == "pipeline_schedule" and p["stages"] == "measured" for p in plan_preds + cands)
    # the choices agree too (highest throughput, ties to fewer FC ranks)
    best = max(range(2), key=lambda k: (cands[k]["throughput"], -k))
    assert rep["fc_workers"] == fa[best]
    # and they are the schedule itself, on the inputs the auto choice recorded
    inp = pm.LayoutInputs(**rep["inputs"])
    assert [pm.predict_hourglass(pm.with_role_compression(inp, F, ZERO, ZERO), F)["step_s"] for F in (1, 2)] == auto_steps


def test_derived_stages_are_the_same_schedule_for_layout_cost(fixed):
    """A cost callable without the stages per micro-batch (costmodel.measure_costs): the stages
    derived from t_conv, t_fc (perfmodel.pipeline_stages), the same schedule."""
    from hgsgc.hourglass.costmodel import CostInputs, choose_fc_workers, layout_inputs

    inp = CostInputs(t_conv=MEAS["t_conv"], t_fc=MEAS["t_fc"], batch_size=16, act_bytes=310.0, grad_bytes=262.5,
                     conv_payload=900.0, fc_payload=5e5, bandwidth=12.5e6, codec_s=3.1e-6, micro_batches=2,
                     cycle_s=0.001)
    r = choose_fc_workers(inp, N)
    for c in r["candidates"]:
        F = c["fc_workers"]
        li = pm.pipeline_stages(layout_inputs(inp, N))
        assert c["stages"] == "derived" and li.conv_bwd_mb_s == pytest.approx(2 * li.conv_fwd_mb_s, rel=1e-15)
        assert c["step_s"] == pm.predict_hourglass(li, F)["step_s"]
        assert dataclasses.replace(li, conv_fwd_mb_s=0.0, conv_bwd_mb_s=0.0, fc_row_s=0.0) == layout_inputs(inp, N)


def test_measure_costs_measures_the_stages_when_told_the_world():
    """costmodel.measure_costs(max_convs_per_fc=n - 1) (a Layout(..., cost=...) callable) measures
    the stages per micro-batch as layout: auto and hgsgc plan do; without it they are derived."""
    import numpy as np
    import tensorflow as tf

    from hgsgc.compression import Compression
    from hgsgc.hourglass import auto
    from hgsgc.hourglass.costmodel import choose_fc_workers, measure_costs, measure_pipeline_stages, with_link
    from hgsgc.hourglass.split import split_model

    assert auto.measure_pipeline_stages is measure_pipeline_stages          # one function, re-exported
    inp = tf.keras.Input((6, 6, 1))
    z = tf.keras.layers.Flatten(name="flatten")(tf.keras.layers.Conv2D(4, 3, activation="relu")(inp))
    split = split_model(tf.keras.Model(inp, tf.keras.layers.Dense(3)(tf.keras.layers.Dense(8)(z))), "flatten")
    got = measure_costs(split, 8, Compression.none, Compression.none, 100.0, repeats=1, micro_batches=2,
                        max_convs_per_fc=3)
    assert got.conv_fwd_mb_s > 0 and got.fc_call_s + got.fc_row_s > 0
    r = choose_fc_workers(with_link(got, {"alpha_s": 0.0, "beta_Bps": 12.5e6}), 4)
    assert all(c["stages"] == "measured" for c in r["candidates"])
    plain = measure_costs(split, 8, Compression.none, Compression.none, 100.0, repeats=1, micro_batches=2)
    assert (plain.conv_fwd_mb_s, plain.conv_bwd_mb_s, plain.fc_call_s, plain.fc_row_s) == (0.0, 0.0, 0.0, 0.0)
    assert np.isfinite(r["candidates"][0]["step_s"])


def test_plan_and_auto_choose_charge_the_same_buckets(fixed):
    """``compression.buckets=2``: ``hgsgc plan`` charges one collective per bucket
    (``LayoutInputs.dp/conv/fc_buckets``); ``layout: auto`` must build the same bucket sizes from the
    same model, so both predict identical steps for every F (and the data-parallel row)."""
    import numpy as np

    from hgsgc.config import load_config
    from hgsgc.config import compression_from_config
    from hgsgc.hourglass.split import split_model
    from hgsgc.plan import build_plan_model

    cfg = load_config(None, OVERRIDES + ["compression.buckets=2"])
    model, _ = build_plan_model(cfg)
    split = split_model(model, cfg.hourglass.split_layer)
    x = np.random.default_rng(0).random((16,) + tuple(int(d) for d in model.inputs[0].shape[1:])).astype(np.float32)

    fp, plan_steps, _ = _plan_steps(cfg)
    fa, auto_steps, rep = _choose_steps(cfg, split, x)
    conv_shapes = [tuple(int(d) for d in v.shape) for v in split.trunk_variables]
    fc_shapes = [tuple(int(d) for d in v.shape) for v in split.head_variables]
    cc = compression_from_config(cfg.compression)
    want = pm.allgather_buckets(cc, conv_shapes)
    assert len(want) == 2                                               # two allgathers on the CONV side
    assert tuple(rep["inputs"]["conv_buckets"]) == want
    assert tuple(rep["inputs"]["dp_buckets"]) == pm.allgather_buckets(cc, conv_shapes + fc_shapes)
    assert fp == fa == [1, 2]
    assert plan_steps == auto_steps
