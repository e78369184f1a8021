"""layout=auto: the choice follows hgsgc.perfmodel's predictions on fixed inputs (single process),
and the formulas are the documented ones (docs/hourglass.md, "layout: auto")."""
import math

import pytest

from hgsgc import perfmodel
from hgsgc.perfmodel import LayoutInputs, choose_layout, predict_data_parallel, predict_hourglass


def _inputs(**kw):
    base = dict(world_size=4, batch_size=32, t_conv=1.2e-3, t_fc=1.0e-3, act_bytes=1000.0,
                grad_bytes=800.0, codec_s=1e-5, alpha=1e-4, beta=12.5e6, dp_payload=7.0e6,
                conv_payload=75264.0, fc_payload=6.96e6, dp_algorithm="ring",
                conv_algorithm="ring", fc_algorithm="ring", delay=1, fc_delay=1, micro_batches=1)
    base.update(kw)
    return LayoutInputs(**base)


def test_data_parallel_formula():
    i = _inputs()
    p = predict_data_parallel(i)
    ex = (2 * 3 * i.alpha + 2 * 3 / 4 * i.dp_payload / i.beta)
    assert p["step_s"] == pytest.approx(32 * (i.t_conv + i.t_fc) + ex, rel=1e-12)
    assert p["throughput"] == pytest.approx(4 * 32 / p["step_s"], rel=1e-12)
    sgc = _inputs(dp_algorithm="allgather", dp_payload=3000.0, delay=4)
    assert predict_data_parallel(sgc)["exchange_s"] == pytest.approx((3 * sgc.alpha + 3 * 3000 / sgc.beta) / 4)


@pytest.mark.parametrize("M", [1, 4])
def test_hourglass_formula(M):
    i = _inputs(micro_batches=M)
    p = predict_hourglass(i, 1)
    b, m = 32, 3
    s = [(b * i.t_conv + b * i.codec_s / 2) / M, m * b * i.act_bytes / i.beta / M,
         m * b * (i.t_fc + i.codec_s / 2) / M, m * b * i.grad_bytes / i.beta / M]
    ex_c = 2 * 2 * i.alpha + 2 * 2 / 3 * i.conv_payload / i.beta    # ring among C = 3
    want = sum(s) + (M - 1) * max(s) + max(ex_c, 0.0) + 2 * M * i.alpha
    assert p["step_s"] == pytest.approx(want, rel=1e-12)
    assert p["throughput"] == pytest.approx(3 * 32 / want, rel=1e-12)
    p2 = predict_hourglass(i, 2)                                      # 2 FC ranks: m = 1, FC ring of 2
    assert p2["convs_per_fc"] == 1 and p2["fc_exchange_s"] == pytest.approx(2 * i.alpha + i.fc_payload / i.beta)


def test_choice_follows_the_model():
    slow = _inputs()                                    # 100 Mbit/s, dense 7 MB exchange: Hourglass wins
    r = choose_layout(slow)
    best = max(r["predictions"], key=lambda p: p["throughput"])
    assert r["layout"] == best["layout"] == "hourglass" and r["fc_workers"] == 1
    assert len(r["predictions"]) == 1 + 2             # data parallel + F = 1, 2
    fast = _inputs(beta=1e11, alpha=1e-7, act_bytes=5e5, grad_bytes=5e5)  # boundary huge, link free
    r = choose_layout(fast)
    assert r["layout"] == "data_parallel" and r["fc_workers"] is None
    assert r["choice"]["throughput"] == max(p["throughput"] for p in r["predictions"])
    assert choose_layout(slow, hourglass_possible=False)["layout"] == "data_parallel"
    text = perfmodel.format_layout_report(choose_layout(slow))
    assert "layout auto -> hourglass with 1 FC ranks" in text and "data parallel:" in text


def test_exchange_model_matches_the_counted_bytes():
    # bytes of the busiest rank: ring 2 (k-1)/k P, allgather (k-1) P, tree (L + 2[k>2^L]) P
    for k in (2, 3, 4, 5, 8):
        for alg, nbytes in (("ring", 2 * (k - 1) / k), ("allgather", k - 1),
                            ("tree", (k.bit_length() - 1) + (2 if k & (k - 1) else 0))):
            t = perfmodel.layout_exchange_s(k, 1000.0, alg, 1, 0.0, 1.0)
            assert math.isclose(t, nbytes * 1000.0), (k, alg)
    assert perfmodel.layout_exchange_s(1, 1e9, "ring", 1, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="unknown exchange algorithm"):
        perfmodel.layout_exchange_s(3, 1.0, "mesh", 1, 0.0, 1.0)
