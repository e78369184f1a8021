"""scripts/cluster/burst_adjust.py: the wire time the emulator's tbf bucket hid, by hand.

Hand arithmetic used below: cluster.sh's bucket at 100 Mbit/s is 25,000 frame bytes (2 ms of
12.5 MB/s), 23,910.17 payload bytes (x 1448/1514); the payload rate is 12.5e6 x 1448/1514 =
11,955,085.9 B/s, so a full bucket hides exactly 2 ms. At 10 Mbit/s: 15,140 frame bytes (the
minimum), 14,480 payload bytes, 1,195,508.6 B/s: 15,140 / 1.25e6 = 12.112 ms.
"""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("burst_adjust", os.path.join(ROOT, "scripts", "cluster", "burst_adjust.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ba = _load()
BETA_100 = 12.5e6 * 1448 / 1514
BURST_100 = 25000 * 1448 / 1514


def tr(*colls, delay=1):
    from hgsgc import perfmodel as pm

    return pm.Traffic(tuple(colls), delay)


def test_links_rate_and_burst():
    real, tbf = ba.links("100mbit")
    assert real.beta_Bps == pytest.approx(BETA_100, rel=1e-12) and real.burst_bytes == 0 and real.alpha_s == 0
    assert tbf.burst_bytes == pytest.approx(BURST_100, rel=1e-12) and tbf.bidir_factor == 1.0
    assert tbf.burst_bytes / tbf.beta_Bps == pytest.approx(0.002, rel=1e-12)
    real10, tbf10 = ba.links("10mbit")
    assert tbf10.burst_bytes == pytest.approx(14480.0, rel=1e-12)
    assert tbf10.burst_bytes / tbf10.beta_Bps == pytest.approx(0.012112, rel=1e-12)


def test_payload_over_the_bucket_hides_exactly_the_bucket():
    # SGC delay 1 on 2 hosts: one allgather of 24,964 B (two ranks: P each way)
    h = ba.hidden_per_exchange(2, tr(("allgather", 24964)), "100mbit", idle_s=1.0)
    assert h["bytes"] == 24964
    assert h["real_s"] == pytest.approx(24964 / BETA_100, rel=1e-12)           # 2.0882 ms
    assert h["hidden_s"] == pytest.approx(0.002, rel=1e-9)
    assert h["busy_s"] == pytest.approx((24964 - BURST_100) / BETA_100, rel=1e-9)  # 0.088 ms left
    assert h["bucket_bytes"] == pytest.approx(BURST_100, rel=1e-12)


def test_payload_under_the_bucket_hides_all_of_it():
    h = ba.hidden_per_exchange(2, tr(("allgather", 10000)), "100mbit", idle_s=1.0)
    assert h["hidden_s"] == pytest.approx(10000 / BETA_100, rel=1e-12)          # 0.8365 ms
    assert h["busy_s"] == 0.0


def test_bucket_not_refilled_hides_only_the_refill():
    # 0.5 ms idle refills 5,977.5 B < the 24,964 B exchange: the bucket holds only the refill
    h = ba.hidden_per_exchange(2, tr(("allgather", 24964)), "100mbit", idle_s=0.0005)
    assert h["bucket_bytes"] == pytest.approx(0.0005 * BETA_100, rel=1e-12)
    assert h["hidden_s"] == pytest.approx(0.0005, rel=1e-9)


def test_ten_mbit_and_four_ranks():
    # 4 ranks, Bruck allgatherv of P = 131,296: the busiest rank sends 3 P = 393,888 B
    h = ba.hidden_per_exchange(4, tr(("allgather", 131296)), "10mbit", idle_s=10.0)
    assert h["bytes"] == 393888
    assert h["hidden_s"] == pytest.approx(0.012112, rel=1e-9)


def test_two_collectives_one_bucket_vs_ceiling():
    # PowerSGD-like: two allreduces on 2 ranks (recursive doubling: B bytes each), 10,000 + 30,000
    h = ba.hidden_per_exchange(2, tr(("ring", 10000), ("ring", 30000)), "100mbit", idle_s=1.0)
    assert h["bytes"] == 40000
    assert h["hidden_s"] == pytest.approx(0.002, rel=1e-9)                       # one bucket per exchange
    assert h["hidden_per_collective_s"] == pytest.approx(10000 / BETA_100 + 0.002, rel=1e-9)  # 2.8365 ms


def test_idle_per_exchange():
    # delay 4, mean step 20 ms over 39 timed steps holding 10 exchanges of 1 ms busy each
    assert ba.idle_per_exchange_s(0.020, 4, 39, [0.001] * 10) == pytest.approx(4 * (0.020 - 0.010 / 39), rel=1e-12)
    assert ba.idle_per_exchange_s(0.001, 1, 1, [0.002]) == 0.0


def _roles(act_s, grad_r, ex_s, ex_r, fc_in, fc_out):
    conv = {"activation_bytes_sent_per_step_per_rank": act_s, "activation_grad_bytes_received_per_step_per_rank": grad_r,
            "exchange_bytes_sent_per_step_per_rank": ex_s, "exchange_bytes_received_per_step_per_rank": ex_r}
    fc = {"activation_bytes_received_per_step_per_rank": fc_in, "activation_grad_bytes_sent_per_step_per_rank": fc_out}
    return conv, fc


def test_hourglass_small_messages_all_hidden():
    conv, fc = _roles(1000, 2000, 3000, 3000, 3000, 6000)
    for pm_ in (False, True):
        assert ba.hourglass_hidden_s("100mbit", conv, fc, 2, 3, 1, per_message=pm_) == pytest.approx(18000 / BETA_100, rel=1e-12)


def test_hourglass_large_boundary_capped():
    # FC ingress 100,000 B: one bucket per step (main) vs one per message (3 CONV ranks x 2 micro-batches)
    conv, fc = _roles(0, 0, 0, 0, 100000, 0)
    assert ba.hourglass_hidden_s("100mbit", conv, fc, 2, 3, 1) == pytest.approx(0.002, rel=1e-9)
    assert ba.hourglass_hidden_s("100mbit", conv, fc, 2, 3, 1, per_message=True) == pytest.approx(100000 / BETA_100, rel=1e-12)
    # a CONV exchange every 4 steps of 4 x 10,000 B: min(burst, 40,000) / 4 per step
    conv, fc = _roles(0, 0, 10000, 0, 0, 0)
    assert ba.hourglass_hidden_s("100mbit", conv, fc, 1, 3, 4) == pytest.approx(0.0005, rel=1e-9)


def test_ratio_rows_time_to_target():
    # two methods of one group; time to target = steps x step + epochs x eval, hidden added per step
    d = {"time_to_target": {"rows": [
        {"method": "fp16", "bandwidth": "10mbit", "step_s": 10.0, "steps": 240, "epoch": 5, "eval_s": 20.0},
        {"method": "sgc", "bandwidth": "10mbit", "step_s": 1.0, "steps": 288, "epoch": 6, "eval_s": 20.0}]}}
    rows = [{"method": "fp16", "role": "dense", "hosts": 4, "bandwidth": "10mbit", "dilation_factor": 1.0,
             "measured_step_s": 10.0, "adjusted_step_s": 10.012, "adjusted_step_ceiling_s": 10.012, "adjusted_step_small_only_s": 10.0,
             "full_epoch_steps": 1},
            {"method": "sgc", "role": "ours", "hosts": 4, "bandwidth": "10mbit", "dilation_factor": 1.0,
             "measured_step_s": 1.0, "adjusted_step_s": 1.012, "adjusted_step_ceiling_s": 1.012, "adjusted_step_small_only_s": 1.0,
             "full_epoch_steps": 1}]
    out = {r["method"]: r for r in ba.ratio_rows(d, rows)}
    before, after = out["sgc"]["ratios"]["measured_step_s"], out["sgc"]["ratios"]["adjusted_step_s"]
    assert before["value"] == pytest.approx(288 * 1.0 + 120.0) and after["value"] == pytest.approx(288 * 1.012 + 120.0)
    # time to target: "x sooner" = the other's time / this one's, as the bench prints it
    assert before["vs_dense"] == pytest.approx(2500.0 / 408.0)
    assert after["vs_dense"] == pytest.approx((240 * 10.012 + 100.0) / 411.456)
    # a dilated cell: the hidden time (measured clock) scales by the factor like the step
    rows[1]["dilation_factor"] = 0.5
    out = {r["method"]: r for r in ba.ratio_rows(d, [dict(r) for r in rows])}
    assert out["sgc"]["ratios"]["adjusted_step_s"]["value"] == pytest.approx(288 * 1.006 + 120.0)


def test_committed_clean_2h_sgc_d1():
    """End to end on the committed clean_2h.json (configs and model shapes; no run): SGC delay 1
    at 100 Mbit/s hides one full bucket, 2 ms, per step; delay 4 the same per exchange, 10
    exchanges in 39 timed steps."""
    d, rows = ba.adjust_file(os.path.join(ROOT, "docs", "benchmarks", "clean_2h.json"), {})
    by = {(r["method"], r["bandwidth"]): r for r in rows}
    r = by[("sgc_d1", "100mbit")]
    assert r["bytes_per_exchange"] == 24964 and r["hidden_per_step_s"] == pytest.approx(0.002, rel=1e-9)
    assert r["adjusted_step_s"] == pytest.approx(r["measured_step_s"] + 0.002, rel=1e-12)
    r4 = by[("sgc_d4", "100mbit")]
    assert r4["exchanges_timed"] == 10 and r4["timed_steps"] == 39
    assert r4["hidden_per_step_s"] == pytest.approx(0.002 * 10 / 39, rel=1e-9)
    g = by[("sgc_d1", "1gbit")]  # 24,964 B at 1 Gbit/s, all in the 250 kB bucket
    assert g["hidden_per_step_s"] == pytest.approx(24964 / (125e6 * 1448 / 1514), rel=1e-9)


def test_small_exchanges_only_variant():
    # the other side of the bracket: an exchange above 1.25 buckets hides nothing
    conv, fc = _roles(10000, 10000, 0, 0, 30000, 30000)   # FC messages 30,000 / (3 x 1) = 10,000 B
    assert ba.hourglass_hidden_s("100mbit", conv, fc, 1, 3, 1, small_only=True) == pytest.approx(
        (10000 + 10000 + BURST_100 + BURST_100) / BETA_100, rel=1e-12)
    conv, fc = _roles(40000, 0, 0, 0, 0, 0)               # one 40,000 B message > 1.25 x 23,910
    assert ba.hourglass_hidden_s("100mbit", conv, fc, 1, 3, 1, small_only=True) == 0.0
    d, rows = ba.adjust_file(os.path.join(ROOT, "docs", "benchmarks", "clean_2h.json"), {})
    by = {(r["method"], r["bandwidth"]): r for r in rows}
    assert by[("sgc_d1", "100mbit")]["hidden_per_step_small_only_s"] == pytest.approx(0.002, rel=1e-9)
    assert by[("topk", "100mbit")]["hidden_per_step_small_only_s"] == 0.0    # 57,882 B
