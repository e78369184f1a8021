"""hgsgc/perfmodel.py charges ``compression.buckets = B`` (the fused sparse allgather split into at
most B allgathers, hgsgc/compression/reducers.py): B collectives, each with its own Horovod
coordination (half a cycle + the negotiation allreduce) and Open MPI collective, the same payload
bytes. Exact values on fixed inputs, no wall clock."""
import pytest

from hgsgc import perfmodel as pm
from hgsgc.compression import Compression
from hgsgc.compression.reducers import bucket_indices

# payload per tensor (top-k, density 0.01, bits 32): (100, 100) and (1000, 10): k = 100 of 10,000,
# 14-bit indices -> ceil(1400 / 8) + 4 * 100 = 575 B; (100,) and (10,): k = 1 -> 1 + 4 = 5 B
SHAPES = [(100, 100), (100,), (1000, 10), (10,)]
SIZES = [575, 5, 575, 5]
# the sizes above and every figure below are worked out by hand for the fixed-width index coding,
# pinned here (the default is elias_fano since session 10; its bytes: tests/test_index_coding.py)
FIXED = "fixed"


def test_bucket_payloads_by_hand():
    assert [Compression.topk(0.01, index_coding=FIXED).codec().payload_length(n) for n in (10000, 100, 10000, 10)] == SIZES
    assert pm.allgather_buckets(Compression.topk(0.01, index_coding=FIXED), SHAPES) == ()                 # B = 1
    # B = 2: from the last tensor, 5 + 575 = 580 reaches half of 1160 -> (580, 580)
    assert pm.allgather_buckets(Compression.topk(0.01, buckets=2, index_coding=FIXED), SHAPES) == (580, 580)
    # B = 3: 580 >= 1160 / 3 closes the first group, 585 < 2 * 1160 / 3 and the first tensor ends
    # the walk: 2 allgathers, not 3
    assert pm.allgather_buckets(Compression.topk(0.01, buckets=3, index_coding=FIXED), SHAPES) == (580, 580)
    # B = 4: 580 >= 290, 585 >= 580, then the rest
    assert pm.allgather_buckets(Compression.topk(0.01, buckets=4, index_coding=FIXED), SHAPES) == (580, 5, 575)
    assert [sum(SIZES[i] for i in g) for g in bucket_indices(SIZES, 4)] == [580, 5, 575]
    # empty tensors pass through (not in any allgather); dense_vectors' rank < 2 tensors go to the ring
    assert pm.allgather_buckets(Compression.topk(0.01, buckets=4, index_coding=FIXED), SHAPES + [(0,)]) == (580, 5, 575)
    for other in (Compression.none, Compression.fp16, Compression.powersgd(rank=4), Compression.terngrad(),
                  Compression.sgc(0.01, hierarchy="tree", index_coding=FIXED)):
        assert pm.allgather_buckets(other, SHAPES) == ()


def test_traffic_has_one_allgather_per_bucket_and_the_same_bytes():
    one = pm.traffic(Compression.topk(0.01, index_coding=FIXED), SHAPES)
    four = pm.traffic(Compression.topk(0.01, buckets=4, index_coding=FIXED), SHAPES)
    assert one.collectives == (("allgather", 1160),)
    assert four.collectives == (("allgather", 580), ("allgather", 5), ("allgather", 575))
    assert one.payload_bytes == four.payload_bytes == 1160
    sgc = pm.traffic(Compression.sgc(0.01, delay=4, buckets=2, index_coding=FIXED), SHAPES)
    assert sgc.delay == 4 and len(sgc.collectives) == 2 and sgc.payload_bytes == pm.traffic(
        Compression.sgc(0.01, delay=4, index_coding=FIXED), SHAPES).payload_bytes


def test_dense_vectors_ring_stays_first():
    from hgsgc.compression import SparseCompression

    c = SparseCompression(density=0.01, bits=32, method="topk", dense_vectors=True, buckets=2,
                          index_coding=FIXED)
    # the vectors (100,), (10,) are averaged densely: one ring of 4 * 110 bytes, then the two
    # 575-byte matrices: 575 reaches half of 1150 at the last one -> (575, 575)
    assert pm.traffic(c, SHAPES).collectives == (("ring", 440), ("allgather", 575), ("allgather", 575))


def test_predict_step_charges_coordination_and_latency_per_bucket():
    link = pm.Link(1e-4, 1e6, 0.5)
    cyc = 2e-3
    # 4 ranks: the negotiation allreduce of 136 B is recursive doubling, 2 messages: coordination
    # per collective = cycle / 2 + 2 alpha = 1.2 ms
    coord1 = 1e-3 + 2e-4
    # Open MPI allgatherv on 4 ranks: 1160 and 580 / 575 B -> neighbour exchange (256 <= P < 4096):
    # n / 2 = 2 pairwise messages, 3 P bytes at beta / 2; 5 B -> default (gatherv + bcast):
    # 3 + 2 = 5 messages, 3 * 5 + 2 * 4 * 5 = 55 bytes at beta
    w1160 = 2e-4 + 3480 / 5e5
    w580, w575 = 2e-4 + 1740 / 5e5, 2e-4 + 1725 / 5e5
    w5 = 5e-4 + 55 / 1e6
    p1 = pm.predict_step(0.05, 0.004, pm.traffic(Compression.topk(0.01, index_coding=FIXED), SHAPES), 4, link, cycle_s=cyc)
    p4 = pm.predict_step(0.05, 0.004, pm.traffic(Compression.topk(0.01, buckets=4, index_coding=FIXED), SHAPES), 4, link, cycle_s=cyc)
    assert p1["coordination_s"] == coord1
    assert p4["coordination_s"] == pytest.approx(3 * coord1, rel=1e-15)
    assert p1["wire_s"] == w1160
    assert p4["wire_s"] == pytest.approx(w580 + w5 + w575, rel=1e-15)
    assert p4["compute_s"] == p1["compute_s"] == 0.05 and p4["compression_s"] == p1["compression_s"] == 0.004
    assert p4["step_s"] - p1["step_s"] == pytest.approx(2 * coord1 + (w580 + w5 + w575 - w1160), rel=1e-12)
    # B = 2 on 2 ranks (two_proc / ring by size): 2 collectives, 1 negotiation message each
    p2 = pm.predict_step(0.0, 0.0, pm.traffic(Compression.topk(0.01, buckets=2, index_coding=FIXED), SHAPES), 2, link, cycle_s=cyc)
    assert p2["coordination_s"] == pytest.approx(2 * (1e-3 + 1e-4), rel=1e-15)
    # 580 B on 2 ranks: Open MPI's ring (< 2048 B): 1 message, 580 B, pairwise (2 ranks)
    assert p2["wire_s"] == pytest.approx(2 * (1e-4 + 580 / 5e5), rel=1e-15)
    # delay 4 divides every term per step
    p4d = pm.predict_step(0.0, 0.0, pm.traffic(Compression.sgc(0.01, bits=32, delay=4, buckets=4, index_coding=FIXED), SHAPES), 4,
                          link, cycle_s=cyc)
    assert p4d["coordination_s"] == pytest.approx(3 * coord1 / 4, rel=1e-15)
    assert p4d["wire_s"] == pytest.approx((w580 + w5 + w575) / 4, rel=1e-15)


def _layout(**kw):
    base = dict(world_size=5, batch_size=16, t_conv=1e-3, t_fc=2e-4, act_bytes=100.0, grad_bytes=96.0, codec_s=0.0,
                alpha=1e-4, beta=1e6, bidir_factor=0.5, cycle_s=2e-3, dp_payload=1160.0, conv_payload=1160.0,
                fc_payload=1160.0, dp_algorithm="allgather", conv_algorithm="allgather", fc_algorithm="allgather")
    return pm.LayoutInputs(**{**base, **kw})


def test_layout_inputs_charge_buckets_data_parallel_and_hourglass():
    """LayoutInputs.dp_buckets / conv_buckets / fc_buckets (hgsgc plan fills them from the setting):
    predict_data_parallel and predict_hourglass's role exchanges charge one collective per bucket."""
    link = pm.Link(1e-4, 1e6, 0.5)
    b3 = (580, 5, 575)
    one, three = _layout(), _layout(dp_buckets=b3, conv_buckets=b3, fc_buckets=b3)
    tr3 = pm.Traffic(tuple(("allgather", b) for b in b3))
    # data parallel on 5 ranks: the step of predict_step with the three allgathers
    want = pm.predict_step(1.0 * (16 * (1e-3 + 2e-4) + 0.0 + 0.0), 0.0, tr3, 5, link, cycle_s=2e-3)["step_s"]
    assert pm.predict_data_parallel(three)["step_s"] == want
    assert pm.predict_data_parallel(one)["step_s"] == pm.predict_step(
        1.0 * (16 * (1e-3 + 2e-4) + 0.0 + 0.0), 0.0, pm.Traffic((("allgather", 1160.0),)), 5, link, cycle_s=2e-3)["step_s"]
    # 4 CONV ranks (F = 1): coordination 3 x (1 ms + 2 negotiation messages x 100 us)
    h = pm.predict_hourglass(three, 1)
    assert h["conv_exchange"]["coordination_s"] == pytest.approx(3 * 1.2e-3, rel=1e-15)
    assert h["conv_exchange"]["wire_s"] == pytest.approx(2e-4 + 1740 / 5e5 + 5e-4 + 55 / 1e6 + 2e-4 + 1725 / 5e5,
                                                         rel=1e-15)
    assert pm.predict_hourglass(one, 1)["conv_exchange"]["coordination_s"] == 1 * (2e-3 / 2.0 + 2 * 1e-4)
    assert h["fc_exchange"]["exchange_s"] == 0.0                   # one FC rank exchanges nothing
    # F = 2: 2 FC ranks, three allgathers of 580, 5, 575 B (two_proc / ring: 1 message each, pairwise)
    h2 = pm.predict_hourglass(three, 2)
    assert h2["fc_exchange"]["coordination_s"] == pytest.approx(3 * (1e-3 + 1e-4), rel=1e-15)
    # one bucket (or none) is one collective: the inputs without buckets
    assert pm.predict_hourglass(_layout(conv_buckets=(1160,)), 1)["step_s"] == pm.predict_hourglass(one, 1)["step_s"]
    # JSON round trip (lists) and bad sizes
    assert _layout(conv_buckets=[580, 5, 575]).conv_buckets == b3
    with pytest.raises(ValueError, match="conv_buckets"):
        _layout(conv_buckets=(-1, 5))


@pytest.mark.parametrize("algorithm", ["allgather", "ring", "tree"])
def test_role_post_s_with_buckets_equals_role_exchange(algorithm):
    import numpy as np

    from hgsgc import plan as plan_mod

    inp = _layout(cycle_s=3e-3, alpha=1.7e-4)
    cost = {"base_s": 2e-3, "per_payload_s": 3e-7}
    ks = np.array(list(range(0, 40)) + list(range(4090, 4200)) + [10 ** 6 + 1, 2 ** 22, 9_999_999], dtype=np.int64)
    got = plan_mod.role_post_s(inp, ks, 40000.0, algorithm, 2, cost, 1e-3, (30000, 9000, 1000))
    want = []
    for k in ks:
        ex = pm.role_exchange(inp, int(k), 40000.0, algorithm, 2, pm.compression_at(cost, int(k), algorithm),
                              (30000, 9000, 1000))
        want.append(1e-3 + ex["compression_s"] + ex["wire_s"] + ex["coordination_s"])
    assert got.tolist() == want
    # 3 collectives: 3 coordinations where the exchange happens
    ex = pm.role_exchange(inp, 4, 40000.0, algorithm, 2, 0.0, (30000, 9000, 1000))
    ex1 = pm.role_exchange(inp, 4, 40000.0, algorithm, 2, 0.0)
    assert ex["coordination_s"] == pytest.approx(3 * ex1["coordination_s"], rel=1e-15)
