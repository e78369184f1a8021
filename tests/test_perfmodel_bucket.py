"""hgsgc/perfmodel.py's token-bucket link (the emulator's tbf, scripts/cluster/cluster.sh): the
burst formula, the steady-state bucket at an exchange's start and the wire time of an exchange,
against hand-computed values; ``burst_bytes = 0`` reproduces the plain alpha-beta numbers exactly.
No wall-clock asserts."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hgsgc import perfmodel as pm  # noqa: E402


@pytest.mark.parametrize("rate,burst", [("100mbit", 25000), ("1gbit", 250000), ("10mbit", 15140),
                                        ("60mbit", 15140),  # 7,500,000 // 500 = 15,000 < 10 frames
                                        ("61mbit", 15250), ("1.5gbit", 375000), (8e8, 200000)])
def test_tbf_burst_is_cluster_sh_formula(rate, burst):
    assert pm.tbf_burst_bytes(rate) == burst


def test_tbf_burst_rejects_a_non_rate():
    with pytest.raises(ValueError, match="bandwidth"):
        pm.tbf_burst_bytes("fast")


def test_link_burst_default_and_link_for():
    assert pm.Link(1e-4, 1e6).burst_bytes == 0.0
    assert pm.link_for("100mbit").burst_bytes == 0.0            # real link: no bucket
    # payload bytes: tbf counts frames, 1448 payload bytes per 1514-byte frame (not the
    # calibrated efficiency, which also holds CPU limits)
    assert pm.link_for("100mbit", efficiency=1.0, tbf=True).burst_bytes == 25000 * 1448.0 / 1514.0
    assert pm.link_for("100mbit", efficiency=0.5, tbf=True).burst_bytes == 25000 * 1448.0 / 1514.0
    assert pm.link_for("1gbit", tbf=True).burst_bytes == 250000 * 1448.0 / 1514.0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="Link needs"):
            pm.Link(1e-4, 1e6, 1.0, bad)


def test_bucket_at_start_by_hand():
    # refill I r = 1.0 s * 500 B/s = 500 >= 400 bytes per exchange: full at every start
    assert pm.bucket_at_start_bytes(1000, 1.0, 500, 400) == 1000.0
    assert pm.bucket_at_start_bytes(1000, 0.8, 500, 400) == 1000.0      # I r == S: still full
    # refill 250 < 400: the exchange empties it, 250 accrue before the next
    assert pm.bucket_at_start_bytes(1000, 0.5, 500, 400) == 250.0
    # refill 2000 < 5000 but more than the bucket: capped at the burst
    assert pm.bucket_at_start_bytes(1000, 4.0, 500, 5000) == 1000.0
    assert pm.bucket_at_start_bytes(0, 4.0, 500, 5000) == 0.0
    assert pm.bucket_at_start_bytes(1000, 0.0, 500, 400) == 0.0
    for bad in [(-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, float("nan"), 1), (1, 1, 1, -5)]:
        with pytest.raises(ValueError, match="bucket_at_start_bytes needs"):
            pm.bucket_at_start_bytes(*bad)


def test_bucket_at_start_is_the_iterated_steady_state():
    # b' = min(burst, max(0, b - S) + I r) from a full bucket, iterated: the closed form's value
    for burst, refill, S in [(1000, 500, 400), (1000, 250, 400), (1000, 2000, 5000), (300, 100, 50),
                             (300, 40, 50), (300, 600, 500)]:
        b = float(burst)
        for _ in range(200):
            b = min(burst, max(0.0, b - S) + refill)
        assert pm.bucket_at_start_bytes(burst, refill / 500.0, 500.0, S) == pytest.approx(b, rel=0, abs=1e-9)


BUCKET = pm.Link(0.001, 1000.0, 0.5, 600.0)


def test_exchange_wire_by_hand():
    # 2 ranks, 1000-byte allgatherv: Open MPI's two_proc, 1 pairwise message at 1000 * 0.5 B/s
    one = pm.Traffic((("allgather", 1000),))
    assert pm.exchange_wire_s(2, one, BUCKET, idle_s=10.0) == 0.001 + 400 / 500      # 600 B free
    assert pm.exchange_wire_s(2, one, BUCKET, idle_s=0.5) == 0.001 + 500 / 500       # 500 B refilled
    assert pm.exchange_wire_s(2, one, BUCKET, idle_s=0.0) == 0.001 + 1000 / 500      # empty bucket
    small = pm.Traffic((("allgather", 600),))
    assert pm.exchange_wire_s(2, small, BUCKET, idle_s=10.0) == 0.001                # all in the burst
    # two collectives spend one bucket in order: an 8-byte allreduce (recursive doubling on 2
    # ranks: 1 pairwise message of 8 bytes) takes 8 tokens, the allgather gets 592
    two = pm.Traffic((("ring", 8), ("allgather", 1000)))
    assert pm.exchange_wire_s(2, two, BUCKET, idle_s=10.0) == pytest.approx(0.001 + 0.001 + 408 / 500, rel=1e-12)
    # refill 0.5 s * 1000 B/s = 500 < 1008 bytes: 500 tokens at the start
    assert pm.exchange_wire_s(2, two, BUCKET, idle_s=0.5) == pytest.approx(0.001 + 0.001 + 508 / 500, rel=1e-12)
    # 4 ranks, 1000-byte allgatherv: neighbour exchange, 2 pairwise messages, 3000 bytes at 500 B/s
    assert pm.exchange_wire_s(4, one, BUCKET, idle_s=10.0) == pytest.approx(0.002 + 2400 / 500, rel=1e-12)
    with pytest.raises(ValueError, match="bucket_at_start_bytes needs"):
        pm.exchange_wire_s(2, one, BUCKET, idle_s=-1.0)
    with pytest.raises(ValueError, match="unknown exchange algorithm"):
        pm.exchange_wire_s(2, pm.Traffic((("mesh", 10),)), BUCKET, idle_s=1.0)


def test_burst_zero_reproduces_the_alpha_beta_numbers_exactly():
    plain = pm.Link(1e-4, 1e6, 0.5)
    for k, tr, hosts in [(2, pm.Traffic((("allgather", 24964),)), None),
                         (4, pm.Traffic((("ring", 4), ("allgather", 30000))), None),
                         (4, pm.Traffic((("ring", 1e6), ("ring", 5e5))), None),
                         (8, pm.Traffic((("node", 1000),)), [4, 4]),
                         (5, pm.Traffic((("tree", 1000),)), None)]:
        assert pm.exchange_wire_s(k, tr, plain, hosts, idle_s=1.0) == \
            sum(pm.exchange_s(k, b, a, plain, hosts) for a, b in tr.collectives)
        # a bucket with no refill time charges every byte: the same value up to rounding
        empty = pm.Link(1e-4, 1e6, 0.5, 5000.0)
        assert pm.exchange_wire_s(k, tr, empty, hosts, idle_s=0.0) == pytest.approx(
            pm.exchange_wire_s(k, tr, plain, hosts), rel=1e-12)


def test_predict_step_refills_in_the_non_wire_time():
    one = pm.Traffic((("allgather", 1000),))
    # coordination on 2 ranks, cycle 0: 1 collective * (0 + 1 negotiation message * alpha) = 1 ms;
    # idle = compute 0.1 + compression 0.05 + wait 0.02 + coordination 0.001 = 0.171 s -> 171 tokens
    p = pm.predict_step(0.1, 0.05, one, 2, BUCKET, cycle_s=0.0, wait_s=0.02)
    assert p["coordination_s"] == 0.001
    assert p["wire_s"] == pytest.approx(0.001 + (1000 - 171) / 500, rel=1e-12)
    # delay 4: idle = 4 * 0.1 + 0.05 + 0.02 + 0.001 = 0.471 s -> 471 tokens, per step / 4
    p4 = pm.predict_step(0.1, 0.05, pm.Traffic((("allgather", 1000),), delay=4), 2, BUCKET, cycle_s=0.0, wait_s=0.02)
    assert p4["wire_s"] == pytest.approx((0.001 + (1000 - 471) / 500) / 4, rel=1e-12)
    # idle >= S / beta = 1 s: full bucket, 600 tokens
    assert pm.predict_step(2.0, 0.0, one, 2, BUCKET, cycle_s=0.0)["wire_s"] == 0.001 + 400 / 500
    # explicit link idle time (a wire-only prediction with the step's compute elsewhere)
    assert pm.predict_step(0.0, 0.0, one, 2, BUCKET, cycle_s=0.0, link_idle_s=2.0)["wire_s"] == 0.001 + 400 / 500
    # burst 0: today's formula, whatever the idle time
    plain = pm.Link(0.001, 1000.0, 0.5)
    assert pm.predict_step(2.0, 0.0, one, 2, plain, cycle_s=0.0)["wire_s"] == pm.exchange_s(2, 1000, "allgather", plain)


def test_emulator_sgc_delay1_payload():
    # SGC delay 1, alexnet_small: 24,964 payload bytes per rank, 2 ranks (two_proc, pairwise)
    tr = pm.Traffic((("allgather", 24964),))
    em100 = pm.link_for("100mbit", tbf=True)      # burst 25,000 * 1448 / 1514 = 23,910.17 payload bytes
    burst = 25000 * 1448.0 / 1514.0
    assert em100.burst_bytes == burst
    beta2 = 12.5e6 * 0.94 * 0.5                    # EMULATOR: efficiency 0.94, put halves pairwise
    assert pm.exchange_wire_s(2, tr, em100, idle_s=0.016) == pytest.approx(250e-6 + (24964 - burst) / beta2,
                                                                           rel=1e-12)
    assert pm.exchange_wire_s(2, tr, pm.link_for("100mbit"), idle_s=0.016) == pytest.approx(
        250e-6 + 24964 / beta2, rel=1e-12)
    # 1 Gbit/s: 235,000 tokens, the payload leaves in the burst
    assert pm.exchange_wire_s(2, tr, pm.link_for("1gbit", tbf=True), idle_s=0.016) == 250e-6
