"""The boundary message's measured cost (session 7, issue 11): ``costmodel.probe_boundary`` times
round trips on the trainer's path, ``costmodel.message_cost_s`` turns a round trip into the
seconds per message the schedule does not charge otherwise, and ``perfmodel.pipeline_schedule``
adds them to every boundary message. Fixed inputs, exact values (no wall-clock assertion)."""
import dataclasses
import math

import numpy as np
import pytest

from hgsgc import perfmodel as pm
from hgsgc.hourglass import costmodel


def test_message_cost_is_the_round_trip_minus_the_modelled_terms():
    # 16 rows, 300 + 250 B/example, 2 us/example codec, alpha 0.1 ms, 12.5 MB/s
    modelled = 2 * 1e-4 + 16 * 550.0 / 12.5e6 + 16 * 2e-6        # 0.2 + 0.704 + 0.032 = 0.936 ms
    assert costmodel.message_cost_s(5e-3, 16, 300.0, 250.0, 2e-6, 1e-4, 12.5e6) == (5e-3 - modelled) / 2
    assert costmodel.message_cost_s(5e-3, 16, 300.0, 250.0, 2e-6, 1e-4, 12.5e6) == pytest.approx(2.032e-3, rel=1e-12)
    # faster than the model says: floored at 0
    assert costmodel.message_cost_s(0.5e-3, 16, 300.0, 250.0, 2e-6, 1e-4, 12.5e6) == 0.0
    # loopback (hgsgc plan): no wire term
    assert costmodel.message_cost_s(1e-3, 16, 300.0, 250.0, 2e-6, 0.0, math.inf) == (1e-3 - 16 * 2e-6) / 2
    for bad in (dict(rows=0), dict(beta=0.0), dict(round_trip_s=-1.0), dict(alpha=-1e-6)):
        kw = dict(round_trip_s=1e-3, rows=16, act_bytes=300.0, grad_bytes=250.0, codec_s=2e-6, alpha=0.0, beta=1e6)
        kw.update(bad)
        with pytest.raises(ValueError, match="message_cost_s"):
            costmodel.message_cost_s(**kw)


def test_the_slowest_pair_counts():
    probe = {"rows": 16, "pairs": [[1, 3e-3], [2, 5e-3], [3, 4e-3]], "loopback": False, "reps": 10}
    r = costmodel.boundary_message_inputs(probe, 300.0, 250.0, 2e-6, 1e-4, 12.5e6)
    want = [costmodel.message_cost_s(rt, 16, 300.0, 250.0, 2e-6, 1e-4, 12.5e6) for _, rt in probe["pairs"]]
    assert [p[2] for p in r["per_pair"]] == want
    assert r["boundary_msg_s"] == want[1] == max(want) and r["rows"] == 16 and not r["loopback"]


def _inputs(**kw):
    base = dict(world_size=2, batch_size=32, t_conv=0.0, t_fc=0.0, act_bytes=300.0, grad_bytes=250.0,
                codec_s=2e-6, alpha=1e-4, beta=12.5e6, dp_payload=0.0, conv_payload=0.0, fc_payload=0.0)
    base.update(kw)
    return pm.LayoutInputs(**base)


def test_the_schedule_reproduces_the_round_trip_it_was_measured_from():
    """One CONV rank, one FC rank, M = 1, no compute and no exchange: the scheduled step is the
    probe's round trip of r = b rows once the measured per-message cost is in."""
    rt = 5e-3
    msg = costmodel.message_cost_s(rt, 32, 300.0, 250.0, 2e-6, 1e-4, 12.5e6)
    assert msg > 0
    with_msg = pm.predict_hourglass(_inputs(boundary_msg_s=msg), 1)
    without = pm.predict_hourglass(_inputs(), 1)
    assert with_msg["step_s"] == pytest.approx(rt, rel=1e-12)
    assert with_msg["step_s"] - without["step_s"] == pytest.approx(2 * msg, rel=1e-12)
    st = with_msg["stages_per_micro_batch_s"]
    assert st["wire_in_s"] == 1e-4 + msg + 1 * 32 * 300.0 / 12.5e6
    assert st["wire_out_s"] == 1e-4 + msg + 1 * 32 * 250.0 / 12.5e6


def test_measured_stages_with_the_message_cost_follow_the_gpipe_recursion():
    """n 4, F 1 (m 3), M 2, measured stages: the schedule equals the GPipe recursion written by
    hand (tests/gpipe_reference.py) with every boundary message alpha + msg."""
    from gpipe_reference import gpipe_step

    stages = dict(conv_fwd_mb_s=2.1e-3, conv_bwd_mb_s=3.3e-3, fc_call_s=1.2e-3, fc_row_s=9.5e-5)
    inp = _inputs(world_size=4, micro_batches=2, boundary_msg_s=0.8e-3, **stages)
    p = pm.predict_hourglass(inp, 1)
    ex = p["conv_exchange"]                                    # 3 CONV ranks: messages x alpha
    want, _ = gpipe_step(32, 2, 3, tuple(stages.values()), 2e-6, 1e-4 + 0.8e-3, 12.5e6, 300.0, 250.0,
                         conv_post=(ex["compression_s"], ex["wire_s"] + ex["coordination_s"]))
    assert p["stages"] == "measured" and p["step_s"] == pytest.approx(want, rel=1e-12)
    # and more per-message cost never makes the step shorter
    assert p["step_s"] > pm.predict_hourglass(dataclasses.replace(inp, boundary_msg_s=0.0), 1)["step_s"]


def test_negative_message_cost_is_one_clear_error():
    with pytest.raises(ValueError, match="boundary_msg_s"):
        _inputs(boundary_msg_s=-1e-3)


def test_cost_inputs_carry_the_message_cost_into_the_model():
    inp = costmodel.CostInputs(t_conv=1e-4, t_fc=1e-4, batch_size=32, act_bytes=300.0, grad_bytes=250.0,
                               conv_payload=1e3, fc_payload=1e5, bandwidth=12.5e6, boundary_msg_s=0.7e-3)
    assert costmodel.layout_inputs(inp, 4).boundary_msg_s == 0.7e-3
    a = costmodel.stage_times(inp, 4, 1)["T_step_s"]
    b = costmodel.stage_times(dataclasses.replace(inp, boundary_msg_s=0.0), 4, 1)["T_step_s"]
    assert a > b


def test_loopback_probe_runs_the_real_path_in_one_process():
    """MPI.COMM_SELF (hgsgc plan): both sides in this process; the result's shape, not its time."""
    from mpi4py import MPI

    rng = np.random.default_rng(0)
    a = np.maximum(rng.standard_normal((8, 40)), 0).astype(np.float32)
    g = rng.standard_normal((8, 40)).astype(np.float32)
    y = np.arange(8, dtype=np.int32)
    for act, grad in (("fp32", "fp32"), ("sparse+q8", "sparse+q8"), ("q8", "fp16")):
        r = costmodel.probe_boundary(MPI.COMM_SELF, act, grad, a, g, y, reps=3)
        assert r["rows"] == 8 and r["loopback"] and r["reps"] == 3
        assert [p[0] for p in r["pairs"]] == [0] and r["pairs"][0][1] > 0
    with pytest.raises(ValueError, match="probe_boundary"):
        costmodel.probe_boundary(MPI.COMM_SELF, "fp32", "fp32", a, g[:4], y)
    with pytest.raises(ValueError, match="reps"):
        costmodel.probe_boundary(MPI.COMM_SELF, "fp32", "fp32", a, g, y, reps=0)


def test_boundary_sample_is_the_first_micro_batch():
    import tensorflow as tf

    from hgsgc.hourglass.split import split_model

    inp = tf.keras.Input((6, 6, 1))
    z = tf.keras.layers.Flatten(name="flatten")(tf.keras.layers.Conv2D(4, 3, activation="relu")(inp))
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Dense(8, activation="relu", name="fc1")(z))
    split = split_model(tf.keras.Model(inp, out))
    x = np.random.default_rng(1).random((10, 6, 6, 1)).astype(np.float32)
    a, g, y = costmodel.boundary_sample(split, x, 3)
    assert a.shape == g.shape == (3, 64) and y.shape == (3,) and a.dtype == g.dtype == np.float32
    np.testing.assert_array_equal(a, split.trunk(tf.constant(x[:3]), training=False).numpy().reshape(3, -1))
    with pytest.raises(ValueError, match="micro_batches"):
        costmodel.boundary_sample(split, x, 11)
