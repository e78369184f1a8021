"""layout=auto: the choice follows hgsgc.perfmodel's predictions on fixed inputs (single process),
and the formulas are the documented ones (docs/hourglass.md, "One performance model")."""
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


def _coord(k, alpha, cycle=0.0, allgather=False):
    """Horovod's coordination per exchange (perfmodel.coordination_s): half a cycle + the
    negotiation allreduce of 136 B (Open MPI's recursive doubling: 1 message on 2 ranks, 3 on 3
    (with the fold), 2 on 4); an allgather's sizes come from Horovod's cached response (no extra)."""
    neg = {2: 1, 3: 3, 4: 2}
    return 0.0 if k <= 1 else cycle / 2 + neg[k] * alpha


def test_data_parallel_formula():
    i = _inputs()
    p = predict_data_parallel(i)
    # 7 MB allreduce on 4 ranks: Open MPI's Rabenseifner, 4 messages, 1.5 P (hgsgc.costs.ompi_*)
    ex = (4 * i.alpha + 2 * 3 / 4 * i.dp_payload / i.beta) + _coord(4, i.alpha)
    assert p["step_s"] == pytest.approx(32 * (i.t_conv + i.t_fc) + ex, rel=1e-12)
    assert p["throughput"] == pytest.approx(4 * 32 / p["step_s"], rel=1e-12)
    sgc = _inputs(dp_algorithm="allgather", dp_payload=3000.0, delay=4, cycle_s=0.005,
                  dp_compression_s=2e-3, t_update_conv=1e-4, t_update_fc=3e-4)
    # 3 kB allgatherv on 4 ranks: neighbour exchange, 2 steps, 3 P
    want = (2e-3 + 2 * sgc.alpha + 3 * 3000 / sgc.beta + _coord(4, sgc.alpha, 0.005, True)) / 4
    got = predict_data_parallel(sgc)
    assert got["exchange_s"] == pytest.approx(want, rel=1e-12)
    assert got["step_s"] == pytest.approx(32 * (sgc.t_conv + sgc.t_fc) + 4e-4 + want, rel=1e-12)


@pytest.mark.parametrize("M", [1, 4])
def test_hourglass_formula(M):
    """The Hourglass step is the GPipe schedule on the stages derived from t_conv, t_fc
    (gpipe_reference: the longest path by hand, backward 2x forward), then each role's update +
    exchange (wire + coordination by hand)."""
    from gpipe_reference import derived_stages, gpipe_step

    i = _inputs(micro_batches=M)
    p = predict_hourglass(i, 1)
    b, m = 32, 3
    st = derived_stages(b, M, i.t_conv, i.t_fc)
    ex_c = 2 * 2 * i.alpha + 2 * 2 / 3 * i.conv_payload / i.beta + _coord(3, i.alpha)  # ring among C = 3
    want, _ = gpipe_step(b, M, m, st, i.codec_s, i.alpha, i.beta, i.act_bytes, i.grad_bytes, conv_post=(0.0, ex_c))
    assert p["stages"] == "derived" and p["model"] == "pipeline_schedule"
    assert p["step_s"] == pytest.approx(want, rel=1e-12)
    assert p["throughput"] == pytest.approx(3 * 32 / want, rel=1e-12)
    if M == 1:   # nothing overlaps: the stages in series, as the closed form of sessions 3-4 had it
        s = [b * i.t_conv + b * i.codec_s / 2, m * b * i.act_bytes / i.beta, m * b * (i.t_fc + i.codec_s / 2),
             m * b * i.grad_bytes / i.beta]
        assert want == pytest.approx(sum(s) + ex_c + 2 * i.alpha, rel=1e-12)
    p2 = predict_hourglass(i, 2)                                      # 2 FC ranks: m = 1, FC ring of 2
    assert p2["convs_per_fc"] == 1 and p2["fc_exchange_s"] == pytest.approx(
        2 * i.alpha + i.fc_payload / i.beta + _coord(2, i.alpha))
    # updates, compression and the Horovod cycle: each role's update + exchange after its own last
    # compute task (the FC rank's starts while the CONV ranks still run their backwards)
    j = _inputs(micro_batches=M, cycle_s=0.005, conv_compression_s=1e-3, fc_compression_s=4e-3,
                t_update_conv=2e-3, t_update_fc=1e-2, fc_algorithm="allgather", fc_payload=5000.0, fc_delay=2)
    q = predict_hourglass(j, 2)
    w_c = 2 * j.alpha + j.conv_payload / j.beta + _coord(2, j.alpha, 0.005)
    w_f = (j.alpha + 5000.0 / j.beta + _coord(2, j.alpha, 0.005, True)) / 2
    want2, _ = gpipe_step(b, M, 1, derived_stages(b, M, j.t_conv, j.t_fc), j.codec_s, j.alpha, j.beta,
                          j.act_bytes, j.grad_bytes, conv_post=(2e-3 + 1e-3, w_c), fc_post=(1e-2 + 4e-3 / 2, w_f))
    assert q["step_s"] == pytest.approx(want2, rel=1e-12)
    assert predict_hourglass(j, 1)["fc_exchange_s"] == 0.0          # a lone FC rank exchanges nothing


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


def test_an_integer_fc_workers_is_the_only_hourglass_candidate():
    """layout: auto with hourglass.fc_workers=F weighs data parallelism against the Hourglass with
    F FC ranks only (session 21; the integer was ignored before and F = 1 .. n/2 weighed)."""
    slow = _inputs()                                    # F = 1 wins among 1, 2 (test above)
    r = choose_layout(slow, fc_workers=2)
    assert [p["fc_workers"] for p in r["predictions"]] == [None, 2]
    assert r["predictions"][1] == predict_hourglass(slow, 2)
    best = max(r["predictions"], key=lambda p: p["throughput"])
    assert r["choice"] is best and r["fc_workers"] == best["fc_workers"]
    assert choose_layout(slow, fc_workers=1)["predictions"] == choose_layout(slow)["predictions"][:2]
    # hourglass.fc_workers: auto under layout: hourglass (hourglass_only) still weighs every F
    assert [p["fc_workers"] for p in choose_layout(slow, hourglass_only=True)["predictions"]] == [None, 1, 2]


def test_choice_margin_over_the_runner_up():
    """choose_layout's margin: the choice's predicted throughput over the next-fastest candidate's,
    minus 1, with that candidate's name; printed in the choice's log line."""
    for inp in (_inputs(), _inputs(beta=1e11, alpha=1e-7, act_bytes=5e5, grad_bytes=5e5)):
        r = choose_layout(inp)
        rest = sorted((p for p in r["predictions"] if p is not r["choice"]), key=lambda p: -p["throughput"])
        assert r["runner_up"] == perfmodel.prediction_name(rest[0])
        assert r["margin"] == pytest.approx(r["choice"]["throughput"] / rest[0]["throughput"] - 1, rel=1e-12)
        assert r["margin"] >= 0
        line = perfmodel.format_layout_report(r).splitlines()[-1]
        assert line.endswith(f"(predicted {100 * r['margin']:.1f} % more examples/s than "
                             f"{r['runner_up'].replace('_', ' ')})")
    r = choose_layout(_inputs(), hourglass_only=True)    # among the Hourglass candidates only
    assert r["runner_up"].startswith("hourglass F=") and r["runner_up"] != perfmodel.prediction_name(r["choice"])
    r = choose_layout(_inputs(), hourglass_possible=False)  # one candidate: no runner-up
    assert r["runner_up"] is None and r["margin"] is None
    assert perfmodel.format_layout_report(r).splitlines()[-1] == "layout auto -> data_parallel"


def test_exchange_model_matches_the_counted_bytes():
    # bytes of the busiest rank: allgather (k-1) P (Bruck / two_proc at 20 kB), ring 2 (k-1)/k P
    # (Open MPI's Rabenseifner for 1 MB on 2, 4, 8 ranks), tree (L + 2[k>2^L]) P
    for k in (2, 3, 4, 5, 8):
        for alg, P, nbytes in (("allgather", 2e4, k - 1),
                               ("tree", 1e3, (k.bit_length() - 1) + (2 if k & (k - 1) else 0))):
            t = perfmodel.layout_exchange_s(k, P, alg, 1, 0.0, 1.0)
            assert math.isclose(t, nbytes * P), (k, alg)
    for k in (2, 4, 8):
        assert math.isclose(perfmodel.layout_exchange_s(k, 1e6, "ring", 1, 0.0, 1.0), 2 * (k - 1) / k * 1e6)
    assert perfmodel.layout_exchange_s(1, 1e9, "ring", 1, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="unknown exchange algorithm"):
        perfmodel.layout_exchange_s(3, 1.0, "mesh", 1, 0.0, 1.0)


# ------------------------------------------------------------------------------------------
# Boundary bytes: one function (hgsgc.hourglass.costmodel.boundary_bytes) for fc_workers: auto,
# layout: auto and hgsgc plan, equal to the codecs' exact payloads.
def _relu_batch(b=6, f=10, seed=0):
    import numpy as np

    x = np.random.default_rng(seed).standard_normal((b, f)).astype("float32")
    return np.maximum(x, 0.0)


def test_boundary_bytes_by_hand():
    from hgsgc.hourglass.costmodel import boundary_bytes

    a = _relu_batch()
    b, f = a.shape
    nnz = [int((a[lo:hi] != 0).sum()) for lo, hi in ((0, 3), (3, 6))]
    # dense codecs: 4 f (fp32) / 2 f (fp16) per example, + a 4-byte label on the way in
    assert boundary_bytes("fp32", "fp32", a != 0) == (4 * f + 4, 4 * f)
    assert boundary_bytes("fp16", "fp16", a != 0, 3) == (2 * f + 4, 2 * f)
    # q8: 4 f scales per message + 1 byte per value; two messages of 3 rows
    assert boundary_bytes("q8", "q4", a != 0, 2) == pytest.approx(
        ((2 * (4 * f + 3 * f) + 4 * b) / b, 2 * (4 * f + math.ceil(3 * f / 2)) / b))
    # sparse+q8 activations: bitmap ceil(3 f / 8) + 4 f + nnz_j per message; masked gradients
    # (sparse+q4): 4 f + ceil(nnz_j / 2), no bitmap
    want_a = sum(math.ceil(3 * f / 8) + 4 * f + n for n in nnz) + 4 * b
    want_g = sum(4 * f + math.ceil(n / 2) for n in nnz)
    assert boundary_bytes("sparse+q8", "sparse+q4", a != 0, 2) == pytest.approx((want_a / b, want_g / b))
    with pytest.raises(ValueError, match="micro_batches=7"):
        boundary_bytes("fp32", "fp32", a != 0, 7)


@pytest.mark.parametrize("act,grad", [("fp32", "fp32"), ("fp16", "q8"), ("q4", "fp16"),
                                      ("sparse+q8", "sparse+q8"), ("sparse+fp16", "q4"), ("sparse", "sparse+fp32")])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_boundary_bytes_equal_the_encoded_messages(act, grad, M):
    """What the Hourglass step sends: one encoded message per micro-batch (step.py _chunks)."""
    import numpy as np

    from hgsgc.hourglass.boundary import BoundaryCodec
    from hgsgc.hourglass.costmodel import boundary_bytes, micro_batch_bounds

    a = _relu_batch(b=8, f=12, seed=M)
    ac, gc = BoundaryCodec.parse(act), BoundaryCodec.parse(grad)
    rng = np.random.default_rng(0)
    sent_a = sent_g = 0
    for lo, hi in micro_batch_bounds(8, M):
        chunk = a[lo:hi]
        pa = ac.encode(chunk, rng)
        _, mask = ac.decode(pa, hi - lo, 12)
        g = np.random.default_rng(1).standard_normal(chunk.shape).astype("float32")
        pg = gc.encode(g, rng, mask=mask if gc.sparse else None)
        sent_a += len(pa) + 4 * (hi - lo)
        sent_g += len(pg)
    assert boundary_bytes(act, grad, a != 0, M) == pytest.approx((sent_a / 8, sent_g / 8), rel=1e-15)


def test_configured_codecs():
    from types import SimpleNamespace as NS

    from hgsgc.hourglass.costmodel import configured_codecs

    name = lambda p: tuple(c.name for c in p)  # noqa: E731
    assert name(configured_codecs(NS(wire_dtype="float32", act_codec=None, grad_codec=None))) == ("fp32", "fp32")
    assert name(configured_codecs(NS(wire_dtype="float16", act_codec=None, grad_codec=None))) == ("fp16", "fp16")
    assert name(configured_codecs(NS(wire_dtype="float32", act_codec="sparse+q4", grad_codec="q8"))) == (
        "sparse+q4", "q8")


def test_fc_workers_auto_and_layout_auto_size_the_boundary_alike():
    """measure_costs (fc_workers: auto) and auto.measure (layout: auto) on the same batch and
    codecs report the same boundary bytes, boundary_bytes of the trunk's activations; and the
    configured codec, not wire_dtype, sets them."""
    import numpy as np

    from hgsgc import Compression
    from hgsgc.hourglass import auto
    from hgsgc.hourglass.costmodel import boundary_bytes, measure_costs
    from hgsgc.hourglass.split import split_model
    from hgsgc.models import build_model

    split = split_model(build_model("tiny", seed=5))
    b = 8
    x = np.random.default_rng(0).random((b,) + tuple(int(s) for s in split.trunk.inputs[0].shape[1:]),
                                         dtype=np.float32)  # the batch measure_costs draws
    nz = split.trunk(x, training=False).numpy().reshape(b, -1) != 0
    for act, grad, M in (("fp32", "fp32", 1), ("q4", "q8", 2), ("sparse+q8", "sparse+q8", 4)):
        want = boundary_bytes(act, grad, nz, M)
        inp = measure_costs(split, b, Compression.none, Compression.none, 100.0, repeats=1,
                            act_codec=act, grad_codec=grad, micro_batches=M)
        assert (inp.act_bytes, inp.grad_bytes) == want, (act, grad)
        got = auto.measure(split, x, act, grad, repeats=1, micro_batches=M)
        assert (got["act_bytes"], got["grad_bytes"]) == want, (act, grad)
    f = split.features
    assert boundary_bytes("q4", "q8", nz, 2)[0] < boundary_bytes("fp16", "fp16", nz, 2)[0] == 2 * f + 4


# ------------------------------------------------------------------------------------------
# The link of fc_workers: auto / layout: auto: the probe by default, the config value only as an
# explicit override (the probe itself runs under mpirun: tests/test_hourglass_auto_mpi.py).
def test_link_setting_is_null_by_default_and_validated():
    from hgsgc.config import ConfigError, load_config

    assert load_config(None).hourglass.link_bandwidth_mbps is None
    assert load_config("configs/fashion_mnist.yaml").hourglass.link_bandwidth_mbps is None
    assert load_config(None, ["hourglass.link_bandwidth_mbps=250"]).hourglass.link_bandwidth_mbps == 250.0
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match=r"hourglass\.link_bandwidth_mbps.*null to probe"):
            load_config(None, [f"hourglass.link_bandwidth_mbps={bad}"])


def test_link_inputs_override_and_injected_probe():
    from hgsgc.hourglass.costmodel import link_inputs

    class NoComm:  # the override must not touch the communicator
        def __getattr__(self, name):
            raise AssertionError(f"override used comm.{name}")

    assert link_inputs(NoComm(), 80.0) == {"source": "config", "alpha_s": 0.0, "beta_Bps": 1e7, "pairs": []}
    with pytest.raises(ValueError, match=r"link_bandwidth_mbps=0.*null: probe"):
        link_inputs(NoComm(), 0)
    seen = []
    fake = {"alpha_s": 3e-5, "beta_Bps": 2e6, "pairs": [[1, 3e-5, 2e6]]}
    got = link_inputs("COMM", probe=lambda c: seen.append(c) or fake)
    assert seen == ["COMM"] and got == {"source": "probe", **fake, "probe_bytes": [8, 1 << 20]}


def test_fc_workers_auto_uses_the_link_it_is_given():
    """with_link puts alpha and beta into the inputs; the prediction is predict_hourglass with
    that alpha (2 M alpha for the boundary messages, the exchanges' messages); no link: error."""
    from hgsgc.hourglass.costmodel import (CostInputs, choose_fc_workers, format_report, layout_inputs,
                                           with_link)

    base = CostInputs(t_conv=1e-3, t_fc=1e-3, batch_size=32, act_bytes=1000.0, grad_bytes=1000.0,
                      conv_payload=1e5, fc_payload=7e6, bandwidth=0.0)
    with pytest.raises(ValueError, match="probe the link"):
        choose_fc_workers(base, 4)
    slow = with_link(base, {"alpha_s": 5e-5, "beta_Bps": 12.5e6})
    assert (slow.alpha, slow.bandwidth) == (5e-5, 12.5e6) and layout_inputs(slow, 4).alpha == 5e-5
    r = choose_fc_workers(slow, 4)
    # F = 1: C = 3, m = 3, M = 1; CONV ring among 3: 2 (k-1) = 4 messages, 2 (k-1)/k P bytes, a
    # 3-message negotiation (Open MPI's recursive doubling with the fold on 3 ranks, hgsgc.costs.
    # ompi_collective_cost); no FC exchange; 2 M alpha for the boundary messages
    s = [32e-3, 96 * 1000 / 12.5e6, 96e-3, 96 * 1000 / 12.5e6]
    ex_c = 2 * 2 * 5e-5 + 2 * 2 / 3 * 1e5 / 12.5e6 + 3 * 5e-5
    assert r["candidates"][0]["step_s"] == pytest.approx(sum(s) + ex_c + 2 * 5e-5, rel=1e-12)
    assert r["fc_workers"] == 1                       # the 7 MB FC ring would cost 0.56 s at 100 Mbit/s
    assert choose_fc_workers(with_link(base, {"alpha_s": 1e-6, "beta_Bps": 1.25e10}), 4)["fc_workers"] == 2
    text = format_report({**r, "link": {"source": "probe", "pairs": [[1, 5e-5, 12.5e6]] * 3}})
    assert "link alpha 50.0 us, beta 100.0 Mbit/s (ping-pong probe rank 0 <-> 3 ranks, slowest pair)" in text
    text = format_report({**r, "link": {"source": "config"}})
    assert "(hourglass.link_bandwidth_mbps override, no probe)" in text
