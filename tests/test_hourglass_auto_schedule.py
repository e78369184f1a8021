"""The Hourglass step predicted from the stages measured per micro-batch
(perfmodel.pipeline_schedule): the GPipe schedule's dependency graph worked out by hand, the CPU
shared by processor sharing, the closed form as its special case, and the choice following it."""
import dataclasses

import numpy as np
import pytest

from hgsgc import perfmodel as pm
from hgsgc.perfmodel import LayoutInputs, choose_layout, pipeline_schedule, predict_hourglass


def _inputs(**kw):
    """4 ranks, b 32, M 2, 100 Mbit/s (beta 12.5 MB/s), stages in round milliseconds."""
    base = dict(world_size=4, batch_size=32, t_conv=300e-6, t_fc=200e-6, act_bytes=100.0, grad_bytes=80.0,
                codec_s=0.0, alpha=20e-6, beta=12.5e6, dp_payload=40000.0, conv_payload=4000.0,
                fc_payload=4.5e6, dp_algorithm="allgather", conv_algorithm="allgather", micro_batches=2,
                conv_fwd_mb_s=2e-3, conv_bwd_mb_s=4e-3, fc_call_s=1e-3, fc_row_s=150e-6)
    base.update(kw)
    return LayoutInputs(**base)


def test_schedule_is_the_longest_path_without_sharing():
    i = _inputs()
    m, r = 3, 16                                      # F = 1: 3 CONV ranks per FC rank, 16 rows each
    f, g = 2e-3, 4e-3
    h = 1e-3 + m * r * 150e-6                         # 8.2 ms
    wi = 20e-6 + m * r * 100.0 / 12.5e6               # 0.404 ms
    wo = 20e-6 + m * r * 80.0 / 12.5e6                # 0.3272 ms
    cpost, fpost = (1e-3, 2e-3), (0.5e-3, 0.0)
    f0, f1 = f, 2 * f
    i0 = f0 + wi
    i1 = max(f1, i0) + wi
    h0 = i0 + h
    h1 = max(i1, h0) + h
    o0 = h0 + wo
    o1 = max(h1, o0) + wo
    g0 = max(f1, o0) + g
    g1 = max(g0, o1) + g
    want = max(g1 + sum(cpost), h1 + sum(fpost))
    s = pipeline_schedule(i, 1, conv_post=cpost, fc_post=fpost)
    assert s["step_s"] == pytest.approx(want, rel=1e-12)
    assert s["conv_done_s"] == pytest.approx(g1, rel=1e-12) and s["fc_done_s"] == pytest.approx(h1, rel=1e-12)
    assert s["busy_s"]["fc"] == pytest.approx(2 * h + fpost[0], rel=1e-12)
    assert s["fc_idle_s"] == pytest.approx(want - 2 * h - fpost[0], rel=1e-12)
    assert s["stages_per_micro_batch_s"] == pytest.approx(
        {"conv_fwd_s": f, "wire_in_s": wi, "fc_s": h, "wire_out_s": wo, "conv_bwd_s": g}, rel=1e-12)


def test_two_ranks_on_one_core_share_it():
    # n 2 (C 1, F 1) on a machine with one core, u 1: while both compute each runs at half speed.
    # f 1, g 1, h 2 per micro-batch, no wire: f0 [0,1] alone; f1 and h0 share [1,3] (h0 done 1 of 2);
    # h0 alone [3,4]; g0 and h1 share [4,6]; h1 alone [6,7]; g1 [7,8]. The core never idles: 8 s =
    # all the work.
    i = _inputs(world_size=2, micro_batches=2, batch_size=2, conv_fwd_mb_s=1.0, conv_bwd_mb_s=1.0,
                fc_call_s=2.0, fc_row_s=0.0, alpha=0.0, act_bytes=0.0, grad_bytes=0.0,
                machine_of=(0, 0), machine_cores=(1.0,), cpu_parallelism=1.0)
    s = pipeline_schedule(i, 1)
    assert s["step_s"] == pytest.approx(8.0, rel=1e-12)
    assert s["fc_done_s"] == pytest.approx(7.0, rel=1e-12) and s["conv_done_s"] == pytest.approx(8.0, rel=1e-12)
    # with 2 cores nothing is shared: the longest path, 1 + 2 + 2 + 1 = 6
    assert pipeline_schedule(dataclasses.replace(i, machine_cores=(2.0,)), 1)["step_s"] == pytest.approx(6.0)
    # and on separate machines the same
    assert pipeline_schedule(dataclasses.replace(i, machine_of=(0, 1), machine_cores=(1.0, 1.0)), 1)[
        "step_s"] == pytest.approx(6.0)


def test_three_conv_ranks_on_two_cores_run_at_two_thirds():
    # M 1: nothing overlaps, every CONV task runs at 2 / (3 u) = 2/3 of its alone speed (u 1, 4 ranks
    # on 2 cores, the FC rank idle meanwhile), the FC rank alone at full speed.
    i = _inputs(micro_batches=1, machine_of=(0, 0, 0, 0), machine_cores=(2.0,), cpu_parallelism=1.0)
    b, m = 32, 3
    f, g = 2e-3, 4e-3                                 # measured per micro-batch = the whole batch here
    h = 1e-3 + m * b * 150e-6
    wi, wo = 20e-6 + m * b * 100.0 / 12.5e6, 20e-6 + m * b * 80.0 / 12.5e6
    want = 1.5 * f + wi + h + wo + 1.5 * g + 1.5 * 1e-3 + 2e-3
    assert pipeline_schedule(i, 1, conv_post=(1e-3, 2e-3))["step_s"] == pytest.approx(want, rel=1e-12)


def test_unmeasured_stages_are_derived_for_the_same_schedule():
    # stages per micro-batch not given (hgsgc plan from a config, Layout(..., cost=...)): the trunk
    # of b t_conv split 1 : 2 into forward and backward, the head m r t_fc without a per-call
    # cost; the prediction is the schedule on exactly those stages (no second model)
    derived = _inputs(micro_batches=1, conv_fwd_mb_s=0.0, conv_bwd_mb_s=0.0, fc_call_s=0.0, fc_row_s=0.0,
                      codec_s=2e-6, t_update_conv=1e-3, t_update_fc=0.5e-3, fc_payload=1000.0)
    given = dataclasses.replace(derived, conv_fwd_mb_s=32 * 300e-6 / 3, conv_bwd_mb_s=32 * 300e-6 * 2 / 3,
                                fc_row_s=200e-6)
    assert pm.pipeline_stages(derived) == given and pm.pipeline_stages(given) is given
    a, b_ = predict_hourglass(derived, 2), predict_hourglass(given, 2)     # F 2: C 2, m 1, FC ring of 2
    assert a["model"] == b_["model"] == "pipeline_schedule"
    assert (a["stages"], b_["stages"]) == ("derived", "measured")
    assert a["step_s"] == b_["step_s"]
    # M 1, one rank per machine, the CONV side's update + exchange the longer: the stages in series
    # (the closed form of sessions 3-4): trunk, wire in, head, wire out, CONV update + exchange
    assert a["update_conv_s"] + a["conv_exchange_s"] > a["update_fc_s"] + a["fc_exchange_s"]
    series = (32 * 300e-6 + 32 * 2e-6 / 2 + 2 * 20e-6 + 32 * (100.0 + 80.0) / 12.5e6 + 32 * (200e-6 + 1e-6)
              + 1e-3 + a["conv_exchange_s"])
    assert a["step_s"] == pytest.approx(series, rel=1e-12)
    # M 2: derived stages, checked against the GPipe recursion by hand (tests/gpipe_reference.py)
    from gpipe_reference import derived_stages, gpipe_step

    d2 = dataclasses.replace(derived, micro_batches=2)
    p = predict_hourglass(d2, 1)
    ex = p["conv_exchange"]
    want, _ = gpipe_step(32, 2, 3, derived_stages(32, 2, 300e-6, 200e-6), 2e-6, 20e-6, 12.5e6, 100.0, 80.0,
                         conv_post=(1e-3 + ex["compression_s"], ex["wire_s"] + ex["coordination_s"]),
                         fc_post=(0.5e-3, 0.0))
    assert p["step_s"] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="ratio"):
        pm.pipeline_stages(derived, ratio=-1.0)


def test_choice_follows_the_scheduled_model_on_fixed_inputs():
    one = dict(machine_of=(0, 0, 0, 0), machine_cores=(2.0,), cpu_parallelism=1.0,
               dp_compression_s=10e-3, conv_compression_s=3e-3, t_update_conv=0.4e-3, t_update_fc=1e-3)
    i = _inputs(**one)
    r = choose_layout(i)
    assert [p["layout"] for p in r["predictions"]] == ["data_parallel", "hourglass", "hourglass"]
    best = max(r["predictions"], key=lambda p: p["throughput"])
    assert (r["layout"], r["fc_workers"]) == (best["layout"], best["fc_workers"])
    hg = r["predictions"][1]
    assert hg["step_s"] == pytest.approx(pipeline_schedule(
        i, 1, conv_post=(0.4e-3 + hg["conv_exchange"]["compression_s"],
                         hg["conv_exchange"]["wire_s"] + hg["conv_exchange"]["coordination_s"]),
        fc_post=(1e-3, 0.0))["step_s"], rel=1e-12)
    # a head 4x as expensive per example makes the Hourglass lose; a free one makes it win
    slow = choose_layout(dataclasses.replace(i, fc_row_s=600e-6, fc_call_s=4e-3))
    fast = choose_layout(dataclasses.replace(i, fc_row_s=20e-6, fc_call_s=0.1e-3))
    assert slow["layout"] == "data_parallel"
    assert (fast["layout"], fast["fc_workers"]) == ("hourglass", 1)
    text = pm.format_layout_report(r)
    assert "scheduled per micro-batch: trunk fwd 2.00 + bwd 4.00 ms, head 8.20 ms" in text
    assert "Hourglass stages as the pipeline runs them, alone: trunk per micro-batch fwd 2.00 ms" in text


def test_bad_fc_workers_refused():
    with pytest.raises(ValueError, match="fc_workers=4 must be in 1..3"):
        pipeline_schedule(_inputs(), 4)


def test_measure_pipeline_stages_on_a_tiny_split():
    import tensorflow as tf

    from hgsgc.hourglass.auto import measure_pipeline_stages
    from hgsgc.hourglass.split import split_model

    inp = tf.keras.Input((6, 6, 1))
    z = tf.keras.layers.Conv2D(4, 3, activation="relu")(inp)
    z = tf.keras.layers.Flatten(name="flatten")(z)
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Dense(8, activation="relu")(z))
    split = split_model(tf.keras.Model(inp, out), "flatten")
    x = np.random.default_rng(0).random((8, 6, 6, 1)).astype(np.float32)
    w = [v.numpy().copy() for v in split.trunk.trainable_variables + split.head.trainable_variables]
    got = measure_pipeline_stages(split, x, micro_batches=2, max_convs_per_fc=3, repeats=1)
    assert set(got) == {"conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s"}
    assert got["conv_fwd_mb_s"] > 0 and min(got.values()) >= 0 and got["fc_call_s"] + got["fc_row_s"] > 0
    after = [v.numpy() for v in split.trunk.trainable_variables + split.head.trainable_variables]
    assert all(np.array_equal(a, b) for a, b in zip(w, after))            # it measures, it does not train


def test_effective_cores_from_the_slowdown():
    from hgsgc.hourglass.auto import effective_cores

    # machine 0: ranks 0, 1, 2 (slowdowns 2.0, 3.0, 2.5 -> median 2.5), 2 affinity cores, u 0.9:
    # P = 0.9 x 3 / 2.5 = 1.08; machine 1: rank 3 alone, slowdown 0.9 (none): its affinity cores
    cores, slow = effective_cores([0, 0, 0, 1], [2.0, 4.0], [1.0, 2.0, 1.0, 1.0], [2.0, 6.0, 2.5, 0.9], 0.9)
    assert slow == pytest.approx([2.5, 0.9]) and cores == pytest.approx([1.08, 4.0])
    # the share of all ranks is then the measured slowdown
    i = _inputs(machine_of=(0, 0, 0, 1), machine_cores=tuple(cores), cpu_parallelism=0.9)
    assert pm.cpu_share(i, range(4)) == pytest.approx(2.5)
    # ranks keeping half a core busy (u 0.5) slowed 1.2x together although u k = 1 fits on the 2
    # affinity cores (something else takes the cores): P = 0.5 x 2 / 1.2, the share of both 1.2
    cores2, _ = effective_cores([0, 0], [2.0], [1.0, 1.0], [1.2, 1.2], 0.5)
    assert cores2 == pytest.approx([0.5 * 2 / 1.2])
    i2 = _inputs(world_size=2, machine_of=(0, 0), machine_cores=tuple(cores2), cpu_parallelism=0.5)
    assert pm.cpu_share(i2, range(2)) == pytest.approx(1.2)


def test_waiting_ranks_burn_cpu_in_the_share():
    # the two ranks on one core of test_two_ranks_on_one_core_share_it, with a waiting rank
    # keeping w = 0.5 cores busy (perfmodel.machine_load): alone, a computing rank's machine asks
    # for 1 + 0.5 cores (rate 1 / 1.5); both computing, 2 (rate 1 / 2).
    # f0 [0, 1.5]; f1 and h0 share [1.5, 3.5] (h0 done 1 of 2); h0 with the CONV rank waiting
    # [3.5, 5]; g0 and h1 share [5, 7]; h1 [7, 8.5]; g1 [8.5, 10]
    i = _inputs(world_size=2, micro_batches=2, batch_size=2, conv_fwd_mb_s=1.0, conv_bwd_mb_s=1.0,
                fc_call_s=2.0, fc_row_s=0.0, alpha=0.0, act_bytes=0.0, grad_bytes=0.0,
                machine_of=(0, 0), machine_cores=(1.0,), cpu_parallelism=1.0, wait_cpu_cores=0.5)
    s = pipeline_schedule(i, 1)
    assert s["step_s"] == pytest.approx(10.0, rel=1e-12) and s["fc_done_s"] == pytest.approx(8.5, rel=1e-12)
    assert pm.cpu_share(i, [0]) == pytest.approx(1.5) and pm.cpu_share(i, [0, 1]) == pytest.approx(2.0)
    assert pm.machine_load(i, [1]) == {0: 1.5}
    # w = 0 is the model without the term; a rank alone on its machine never sees it
    assert pipeline_schedule(dataclasses.replace(i, wait_cpu_cores=0.0), 1)["step_s"] == pytest.approx(8.0)
    sep = dataclasses.replace(i, machine_of=(0, 1), machine_cores=(1.0, 1.0))
    assert pipeline_schedule(sep, 1)["step_s"] == pytest.approx(6.0)
    with pytest.raises(ValueError, match="wait_cpu_cores"):
        dataclasses.replace(i, wait_cpu_cores=-0.1)
