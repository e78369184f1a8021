"""layout: auto with compression, update and the CPU share (perfmodel.cpu_share): the formulas
of docs/hourglass.md by hand, and the choice flipping when a term is added (single process)."""
import dataclasses

import pytest

from hgsgc import perfmodel as pm
from hgsgc.perfmodel import LayoutInputs, choose_layout, cpu_share, predict_data_parallel, predict_hourglass


def _alexnet(**kw):
    """The inputs of the AlexNet-style cell's start-up in session 3 (docs/hourglass.md, "Why
    layout: auto chose wrongly"): 4 ranks, b 32, SGC 1 % 2-bit allgather, sparse+q8, M 2."""
    base = dict(world_size=4, batch_size=32, t_conv=414.8e-6, t_fc=230.8e-6, act_bytes=88.6,
                grad_bytes=76.6, codec_s=2.6e-6, alpha=19.9e-6, beta=12.18e6, dp_payload=34132.0,
                conv_payload=4200.0, fc_payload=4505640.0, dp_algorithm="allgather",
                conv_algorithm="allgather", fc_algorithm="ring", micro_batches=2, cycle_s=0.005)
    base.update(kw)
    return LayoutInputs(**base)


ONE_MACHINE = dict(machine_of=(0, 0, 0, 0), machine_cores=(2.0,))


def test_cpu_share_formula():
    i = _alexnet(cpu_parallelism=1.5, **ONE_MACHINE)
    assert cpu_share(i, range(4)) == pytest.approx(1.5 * 4 / 2)      # u k / P
    assert cpu_share(i, range(3)) == pytest.approx(1.5 * 3 / 2)
    assert cpu_share(i, [3]) == 1.0                                   # 0.75 < 1: never below 1
    two = _alexnet(cpu_parallelism=1.0, machine_of=(0, 0, 0, 1), machine_cores=(2.0, 1.0))
    assert cpu_share(two, range(4)) == pytest.approx(1.5)             # the busiest machine counts
    assert cpu_share(_alexnet(), range(4)) == 1.0                     # one rank per machine


def test_bad_machine_inputs_are_refused():
    with pytest.raises(ValueError, match="machine_of has 3 entries for world_size 4"):
        _alexnet(machine_of=(0, 0, 0), machine_cores=(2.0,))
    with pytest.raises(ValueError, match="machine_cores"):
        _alexnet(machine_of=(0, 0, 1, 1), machine_cores=(2.0,))
    with pytest.raises(ValueError, match="cpu_parallelism"):
        _alexnet(cpu_parallelism=0.0)


def test_data_parallel_scales_cpu_work_not_the_wire():
    base = _alexnet(dp_compression_s=11.2e-3, t_update_conv=0.2e-3, t_update_fc=1.5e-3)
    shared = dataclasses.replace(base, cpu_parallelism=1.0, **ONE_MACHINE)
    p0, p1 = predict_data_parallel(base), predict_data_parallel(shared)
    s = 2.0                                                           # 4 ranks x u 1 on 2 cores
    cpu0 = 32 * (414.8e-6 + 230.8e-6) + 0.2e-3 + 1.5e-3 + 11.2e-3
    assert p0["step_s"] - p0["wire_s"] - p0["coordination_s"] == pytest.approx(cpu0, rel=1e-12)
    assert p1["step_s"] - p1["wire_s"] - p1["coordination_s"] == pytest.approx(s * cpu0, rel=1e-12)
    assert (p1["wire_s"], p1["coordination_s"]) == (p0["wire_s"], p0["coordination_s"])
    assert p1["cpu_share"] == {"all": s} and p1["update_s"] == pytest.approx(s * 1.7e-3)


def test_hourglass_shares_the_cpu_in_the_schedule():
    """The shared CPU in the Hourglass step: processor sharing in perfmodel.pipeline_schedule on
    the derived stages (the closed form's per-stage shares are gone since session 6). M 1 and no
    FC update: nothing overlaps, so every CONV task runs at 1 / share(CONV ranks) = 1 / 1.8
    (3 ranks x u 1.2 on 2 cores) and the FC rank's head at full speed (1.2 x 1 / 2 < 1)."""
    i = _alexnet(micro_batches=1, cpu_parallelism=1.2, conv_compression_s=1e-3, t_update_conv=0.2e-3,
                 **ONE_MACHINE)
    p = predict_hourglass(i, 1)
    b, m, s_conv = 32, 3, 1.2 * 3 / 2
    ex_c = pm.role_exchange(i, 3, i.conv_payload, "allgather", 1, 1e-3)
    want = (s_conv * (b * i.t_conv + b * i.codec_s / 2) + i.alpha + m * b * i.act_bytes / i.beta
            + m * b * (i.t_fc + i.codec_s / 2) + i.alpha + m * b * i.grad_bytes / i.beta
            + s_conv * (0.2e-3 + 1e-3) + ex_c["wire_s"] + ex_c["coordination_s"])
    assert p["step_s"] == pytest.approx(want, rel=1e-12)
    assert p["cpu_share"] == pytest.approx({"conv_stage": s_conv, "fc_stage": 1.0, "all": 1.2 * 4 / 2})
    assert p["conv_exchange"]["compression_s"] == pytest.approx(1e-3, rel=1e-12)   # scaled in the schedule
    # M 2 with the FC update: the schedule of the derived stages; sharing makes it longer than the
    # same machine with a core per rank, never longer than all CPU work in series
    j = dataclasses.replace(i, micro_batches=2, t_update_fc=1.5e-3)
    q = predict_hourglass(j, 1)
    ex = q["conv_exchange"]
    assert q["step_s"] == pm.pipeline_schedule(
        pm.pipeline_stages(j), 1, conv_post=(0.2e-3 + ex["compression_s"], ex["wire_s"] + ex["coordination_s"]),
        fc_post=(1.5e-3, 0.0))["step_s"]
    free = predict_hourglass(dataclasses.replace(j, machine_cores=(8.0,)), 1)["step_s"]
    assert free < q["step_s"]


def test_role_compression_per_F():
    i = _alexnet()
    conv_cost, fc_cost = {"base_s": 2e-3, "per_payload_s": 5e-4}, {"base_s": 3e-3, "per_payload_s": 0.0}
    j = pm.with_role_compression(i, 1, conv_cost, fc_cost)
    assert j.conv_compression_s == pytest.approx(2e-3 + 2 * 5e-4)     # allgather among C = 3: 2 payloads
    assert j.fc_compression_s == pytest.approx(3e-3)
    r = choose_layout(i, inputs_at=lambda F: pm.with_role_compression(i, F, conv_cost, fc_cost))
    assert r["predictions"][1] == predict_hourglass(j, 1)


def test_adding_compression_and_update_flips_the_choice():
    """Session 3's inputs (no compression, no update, own CPU per rank): data parallelism (as auto
    chose there); with the measured compression of the whole 1.28 M-parameter model on every
    rank and the head update the Hourglass wins, which pays them on the trunk / once."""
    plain = _alexnet()
    r0 = choose_layout(plain)
    assert r0["layout"] == "data_parallel"
    conv_cost, fc_cost = {"base_s": 1.5e-3, "per_payload_s": 1e-4}, {"base_s": 0.0, "per_payload_s": 0.0}
    full = dataclasses.replace(plain, dp_compression_s=pm.compression_at({"base_s": 11.2e-3, "per_payload_s": 1e-3},
                                                                         4, "allgather"),
                               t_update_conv=0.2e-3, t_update_fc=1.5e-3)
    r1 = choose_layout(full, inputs_at=lambda F: pm.with_role_compression(full, F, conv_cost, fc_cost))
    assert (r1["layout"], r1["fc_workers"]) == ("hourglass", 1)
    best = max(r1["predictions"], key=lambda p: p["throughput"])
    assert r1["choice"] == best
    dp = r1["predictions"][0]
    assert dp["compression_s"] == pytest.approx(11.2e-3 + 3 * 1e-3)   # base + (n - 1) payloads


def test_the_cpu_share_alone_flips_the_choice():
    """Same inputs, no compression or update: 4 ranks of 2 busy threads each (u = 2) on one
    2-core machine make data parallelism pay 4 forward/backward passes at a quarter of the
    cores each (share 4); the Hourglass's head stage runs while the CONV ranks wait."""
    plain = _alexnet()
    assert choose_layout(plain)["layout"] == "data_parallel"
    shared = dataclasses.replace(plain, cpu_parallelism=2.0, **ONE_MACHINE)
    r = choose_layout(shared)
    assert (r["layout"], r["fc_workers"]) == ("hourglass", 1)
    dp, hg = r["predictions"][0], r["predictions"][1]
    assert dp["compute_s"] == pytest.approx(4 * 32 * (414.8e-6 + 230.8e-6), rel=1e-12)
    assert hg["cpu_share"]["conv_stage"] == 3.0 and hg["cpu_share"]["fc_stage"] == 1.0
    assert hg["throughput"] > dp["throughput"]
    text = pm.format_layout_report(r)
    assert "CPU share all 4.00" in text and "layout auto -> hourglass with 1 FC ranks" in text
    # with u = 1 (one busy thread per rank) the share alone does not flip it on these inputs
    assert choose_layout(dataclasses.replace(shared, cpu_parallelism=1.0))["layout"] == "data_parallel"


def test_measure_update_s_checks_momentum_and_times_an_update():
    with pytest.raises(ValueError, match="momentum=1.5 must be in"):
        pm.measure_update_s([(3,)], momentum=1.5)
    assert pm.measure_update_s([], 0.9) == 0.0
    assert pm.measure_update_s([(64, 32), (32,)], 0.9, reps=2) > 0.0
