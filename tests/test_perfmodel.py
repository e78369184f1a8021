"""hgsgc/perfmodel.py: the alpha-beta formulas against hand-computed values and against the
byte formulas of hgsgc.hierarchy / hgsgc.compression.codec; ``hgsgc plan`` end to end (tiny model).
No wall-clock asserts: the plan's measured times are only checked for presence and order."""
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hgsgc import costs  # noqa: E402
from hgsgc import perfmodel as pm  # noqa: E402
from hgsgc import plan as plan_mod  # noqa: E402


@pytest.mark.parametrize("text,bits", [("10gbit", 1e10), ("100mbit", 1e8), ("1.5gbit", 1.5e9),
                                       ("500kbit", 5e5), ("125mbps", 1e9), (2e6, 2e6)])
def test_parse_rate(text, bits):
    assert pm.parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["fast", "10 parsecs", "0mbit", "-5mbit", ""])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="bandwidth"):
        pm.parse_rate(text)


def test_link_time_and_validation():
    link = pm.Link(1e-4, 1e6, 0.5)
    assert link.time(1000, 2) == pytest.approx(2e-4 + 1e-3)
    assert link.time(1000, 2, pairwise=True) == pytest.approx(2e-4 + 2e-3)
    for bad in [(-1, 1e6), (0, 0), (0, 1e6, 0), (0, 1e6, 1.5)]:
        with pytest.raises(ValueError, match="Link needs"):
            pm.Link(*bad)
    em = pm.link_for("100mbit")
    assert em.beta_Bps == pytest.approx(1e8 / 8 * pm.EMULATOR["efficiency"])
    assert pm.link_for("1gbit", bidir_factor=1.0, alpha_s=0).time(1.25e8) == pytest.approx(
        1 / pm.EMULATOR["efficiency"])


def test_exchange_formulas_by_hand():
    L = pm.Link(1e-4, 1e6, 0.5)
    assert pm.exchange_s(1, 4000, "ring", L) == 0
    # Open MPI 4.1's choices: 4 ranks, 4 kB allreduce = recursive doubling (2 pairwise swaps of the
    # whole 4 kB buffer); 1 MB = Rabenseifner (4 pairwise messages, 2 (k-1)/k P bytes)
    assert pm.exchange_s(4, 4000, "ring", L) == pytest.approx(2e-4 + 8000 / 5e5)
    assert pm.exchange_s(4, 1e6, "ring", L) == pytest.approx(4e-4 + 1.5e6 / 5e5)
    assert pm.exchange_s(2, 4000, "ring", L) == pytest.approx(1e-4 + 4000 / 5e5)   # 2 ranks: one swap
    assert pm.exchange_s(5, 1e6, "ring", L) == pytest.approx(6e-4 + (1.5e6 + 1e6) / 5e5)  # 4 + fold
    # allgatherv: 3 ranks, 1 kB: neighbour exchange, odd -> ring (2 one-way steps); 4 ranks,
    # 25 kB: Bruck (2 rounds, 3 P bytes, not pairwise); 2 ranks 30 kB: two_proc (one swap)
    assert pm.exchange_s(3, 1000, "allgather", L) == pytest.approx(2e-4 + 2000 / 1e6)
    assert pm.exchange_s(4, 25000, "allgather", L) == pytest.approx(2e-4 + 75000 / 1e6)
    assert pm.exchange_s(2, 30000, "allgather", L) == pytest.approx(1e-4 + 30000 / 5e5)
    assert pm.exchange_s(5, 1000, "tree", L) == pytest.approx(4e-4 + 4000 / 5e5)  # L=2 + fold/unfold
    assert pm.exchange_s(8, 1000, "tree", L) == pytest.approx(3e-4 + 3000 / 5e5)
    shm = pm.Link(1e-6, 10e9)
    # node: the leader of a host of s ranks reduces (s-1) P in and broadcasts (s-1) P out over
    # shared memory (hgsgc.costs.node_cost), then the tree among the host leaders
    assert pm.exchange_s(8, 1000, "node", L, hosts=[4, 4]) == pytest.approx(
        shm.time(6000, 6) + pm.exchange_s(2, 1000, "tree", L))
    assert pm.exchange_s(6, 1000, "node", L, hosts=[2, 3, 1]) == pytest.approx(
        shm.time(4000, 4) + pm.exchange_s(3, 1000, "tree", L))
    assert pm.exchange_s(3, 1000, "node", L, hosts=[1, 1, 1]) == pytest.approx(pm.exchange_s(3, 1000, "tree", L))
    with pytest.raises(ValueError, match="unknown exchange algorithm"):
        pm.exchange_s(4, 1, "butterfly", L)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 9, 16, 17])
def test_tree_matches_hierarchy_byte_formulas(n):
    """The busiest rank of hgsgc.hierarchy's tree sends exactly what the model charges."""
    from hgsgc.hierarchy import tree_cost

    P = 1000
    busiest = max(tree_cost(n, r, P)["bytes_sent"] for r in range(n))
    msgs = max(tree_cost(n, r, P)["messages"] for r in range(n))
    link = pm.Link(1.0, 1.0)  # alpha 1 s, beta 1 B/s: time = messages + bytes
    assert pm.exchange_s(n, P, "tree", link) == pytest.approx(msgs + busiest)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33])
def test_costs_messages_and_merges_match_the_schedules(n):
    """hgsgc.costs' message and merge counts, which the model charges, against the tree's
    per-rank schedule (the busiest rank) and the closed forms of the module docstring."""
    busiest_msgs = max(costs.tree_cost(n, r, 1)["messages"] for r in range(n))
    busiest_recv = max(costs.tree_cost(n, r, 1)["bytes_received"] for r in range(n))
    assert costs.exchange_messages(n, "tree") == costs.exchange_messages(n, "node") == busiest_msgs
    assert costs.exchange_merges(n, "tree") == costs.exchange_merges(n, "node") == busiest_recv
    assert costs.exchange_messages(n, "ring") == (2 * (n - 1) if n > 1 else 0)
    assert costs.exchange_messages(n, "allgather") == costs.exchange_merges(n, "allgather") == max(0, n - 1)
    for bad in (costs.exchange_messages, costs.exchange_merges):
        with pytest.raises(ValueError, match="unknown exchange algorithm 'mesh'"):
            bad(n, "mesh")


def test_layout_exchange_is_the_same_formula():
    for k in (1, 2, 3, 8):
        for alg in ("ring", "allgather", "tree", "node"):
            assert pm.layout_exchange_s(k, 5000, alg, 4, 2e-4, 1e7) == pytest.approx(
                pm.exchange_s(k, 5000, alg, pm.Link(2e-4, 1e7)) / 4)


SHAPES = [(3, 3, 1, 32), (32,), (3136, 512), (512,), (512, 10), (10,)]


def test_traffic_bytes():
    from hgsgc.compression import Compression, codec, powersgd

    d = sum(math.prod(s) for s in SHAPES)
    assert pm.traffic(Compression.none, SHAPES).collectives == (("ring", 4 * d),)
    assert pm.traffic(Compression.fp16, SHAPES).collectives == (("ring", 2 * d),)
    sgc = Compression.sgc(density=0.01, delay=4, hierarchy="tree")
    t = pm.traffic(sgc, SHAPES)
    assert t.collectives == (("tree", codec.exchange_payload_bytes(sgc, SHAPES)),) and t.delay == 4
    tg = pm.traffic(Compression.terngrad(), SHAPES)
    assert tg.collectives == (("ring", 4 * len(SHAPES)),
                              ("allgather", sum(math.ceil(math.prod(s) / 4) for s in SHAPES)))
    ps = pm.traffic(Compression.powersgd(rank=4), SHAPES)
    p_b = q_b = dense = 0
    for s in SHAPES:
        mpq = powersgd.matrix_shape(s, 4)
        if mpq is None:
            dense += 4 * math.prod(s)
        else:
            p_b += 4 * mpq[0] * mpq[2]
            q_b += 4 * mpq[1] * mpq[2]
    assert ps.collectives == (("ring", p_b + dense), ("ring", q_b))


def test_predict_step_composition():
    link = pm.Link(1e-4, 1e6, 1.0)
    tr = pm.Traffic((("allgather", 1000),), delay=4)
    p = pm.predict_step(0.010, 0.004, tr, 2, link, cycle_s=0.005)
    wire = 1e-4 + 1000 / 1e6
    coord = 0.005 / 2 + 1e-4  # half a cycle + negotiation (1 swap on 2 ranks); no size exchange (cached)
    assert p["wire_s"] == pytest.approx(wire / 4)
    assert p["coordination_s"] == pytest.approx(coord / 4)
    assert p["step_s"] == pytest.approx(0.010 + (0.004 + wire + coord) / 4)
    one = pm.predict_step(0.010, 0.0, pm.Traffic((("ring", 8000),)), 1, link)
    assert one["step_s"] == pytest.approx(0.010)


def test_compression_at_and_time_to_target():
    cost = {"base_s": 0.01, "per_payload_s": 0.002}
    assert pm.compression_at(cost, 1, "allgather") == pytest.approx(0.01)
    assert pm.compression_at(cost, 8, "allgather") == pytest.approx(0.01 + 7 * 0.002)
    assert pm.compression_at(cost, 8, "tree") == pytest.approx(0.01 + 3 * 0.002)
    assert pm.compression_at(cost, 5, "tree") == pytest.approx(0.01 + 3 * 0.002)
    assert pm.time_to_target(100, 0.5, evals=2, eval_s=3) == pytest.approx(56)
    assert pm.time_to_target(None, 0.5) is None


def _hgsgc(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "hgsgc.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plan_cli_ranks_every_candidate(tmp_path):
    out = tmp_path / "plan.json"
    r = _hgsgc("plan", "configs/fashion_mnist_sgc.yaml", "model.name=tiny", "--nodes", "4",
               "--bandwidth", "100mbit", "--compute-ms", "5", "--reps", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    res = json.loads(out.read_text())
    labels = [row["method"] for row in res["rows"]]
    # every method data-parallel, and the Hourglass (tiny has a conv/FC boundary) for F = 1, 2
    assert sorted(labels) == sorted([lab for lab, _ in _candidates()] + ["hourglass_F1", "hourglass_F2"])
    per_nb = [row["s_per_global_batch"] for row in res["rows"]]
    assert per_nb == sorted(per_nb)
    assert res["inputs"]["compute_s"] == pytest.approx(0.005) and res["inputs"]["nodes"] == 4
    hi = pm.LayoutInputs(**res["hourglass_inputs"])
    for row in res["rows"]:  # each prediction is the model applied to the recorded inputs
        if row["layout"] == "data_parallel":
            assert row["compute_s"] == pytest.approx(0.005) and row["examples_per_step"] == 4 * 32
            assert row["step_s"] == pytest.approx(row["compute_s"] + row["compression_s"] + row["wire_s"]
                                                  + row["coordination_s"])
        else:
            F = row["fc_workers"]
            again = pm.predict_hourglass(pm.with_role_compression(hi, F, res["hourglass"]["conv_compression_cost"],
                                                             res["hourglass"]["fc_compression_cost"]), F)
            assert row["step_s"] == pytest.approx(again["step_s"], rel=1e-12)
            assert row["examples_per_step"] == (4 - F) * 32
            assert row["s_per_global_batch"] == pytest.approx(row["step_s"] * 4 / (4 - F), rel=1e-12)
    assert res["hourglass"]["act_codec"] == "fp32" and hi.act_bytes == 4 * res["hourglass"]["features"] + 4
    assert "hgsgc plan: tiny" in r.stdout and labels[0] in r.stdout and "hourglass inputs: split at" in r.stdout


def test_plan_cli_measures_a_setting_with_momentum_correction(tmp_path):
    # the CIFAR and speech SGC configs ship DGC momentum correction; measuring its compression
    # cost must not need the optimizer (it failed with "needs the optimizer's momentum")
    out = tmp_path / "plan.json"
    r = _hgsgc("plan", "configs/fashion_mnist_sgc.yaml", "model.name=tiny", "compression.delay=1", "compression.momentum_correction=true",
               "--nodes", "2", "--bandwidth", "100mbit", "--compute-ms", "5", "--reps", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    cfg_row = rows["config"]  # the configured setting, with momentum correction
    assert cfg_row["compression"]["momentum_correction"] is True and cfg_row["compression_s"] > 0.0, cfg_row


def _candidates():
    from hgsgc.config import load_config

    return plan_mod.plan_candidates(load_config(os.path.join(ROOT, "configs/fashion_mnist_sgc.yaml"),
                                          ["model.name=tiny"]))


@pytest.mark.parametrize("args,needle", [(["--nodes", "4", "--bandwidth", "fast"], "bandwidth 'fast'"),
                                         (["--nodes", "0", "--bandwidth", "1gbit"], "--nodes must be >= 1")])
def test_plan_cli_bad_input_is_one_line(args, needle):
    r = _hgsgc("plan", "configs/fashion_mnist_sgc.yaml", *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------
# Pinned predictions: the expected values are built here from the byte and round formulas of
# hgsgc.costs and the alpha-beta definition (time = messages * alpha + bytes / beta), so the
# same test held before perfmodel took its figures from hgsgc.costs and holds after.

PIN_LINK = pm.Link(alpha_s=2.5e-4, beta_Bps=1.175e7, bidir_factor=0.5)
PIN_KS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 64, 1024)


def _want_exchange(k, payload, alg, link=PIN_LINK):
    if k <= 1:
        return 0.0
    if alg in ("ring", "allgather"):  # what Open MPI 4.1 runs (tested in test_ompi_* below)
        c = costs.ompi_collective_cost("allreduce" if alg == "ring" else "allgatherv", k, payload)
        nbytes, msgs, pairwise = c["bytes"], c["messages"], c["pairwise"]
    else:  # hgsgc's tree: its rounds, pairwise swaps
        nbytes, msgs, pairwise = costs.tree_busiest_bytes(k, payload), costs.tree_rounds(k), True
    return msgs * link.alpha_s + nbytes / (link.beta_Bps * (link.bidir_factor if pairwise else 1.0))


@pytest.mark.parametrize("alg", ["ring", "allgather", "tree", "node"])
def test_pinned_exchange_seconds(alg):
    for k in PIN_KS:
        for P in (1.0, 4321.0, 3.3e6):
            assert pm.exchange_s(k, P, alg, PIN_LINK) == pytest.approx(_want_exchange(k, P, alg), rel=1e-12)
            assert pm.layout_exchange_s(k, P, alg, 3, PIN_LINK.alpha_s, 1e7) == pytest.approx(
                _want_exchange(k, P, alg, pm.Link(PIN_LINK.alpha_s, 1e7)) / 3, rel=1e-12)


def _want_traffic(setting, shapes):
    """The collectives of one exchange, from the setting's own byte formula (payload_bytes)."""
    from hgsgc.compression import powersgd

    total = setting.payload_bytes(shapes)
    if setting.method == "terngrad":    # allreduce(max) of one fp32 scale per tensor + allgather
        return (("ring", 4 * len(shapes)), ("allgather", total - 4 * len(shapes)))
    if setting.method == "powersgd":    # P factors with the dense tensors, then Q factors
        q = sum(4 * mpq[1] * mpq[2] for mpq in (powersgd.matrix_shape(s, setting.rank) for s in shapes) if mpq)
        return (("ring", total - q), ("ring", q))
    return ((setting.algorithm, total),)


def test_pinned_traffic_and_step_predictions():
    from hgsgc.config import load_config

    cfg = load_config(os.path.join(ROOT, "configs/fashion_mnist_sgc.yaml"), [])
    cost = {"base_s": 3e-3, "per_payload_s": 2e-4}
    seen = set()
    for label, setting in plan_mod.plan_candidates(cfg):
        tr = pm.traffic(setting, SHAPES)
        want = _want_traffic(setting, SHAPES)
        assert tr.collectives == want and tr.delay == setting.delay, label
        assert tr.payload_bytes == setting.payload_bytes(SHAPES), label
        seen.add(setting.method)
        for k in PIN_KS:
            h = setting.delay
            wire = sum(_want_exchange(k, b, alg) for alg, b in want)
            # per collective: half a 5 ms cycle + the cache bit-vector allreduce (136 B); no size exchange
            neg = costs.ompi_collective_cost("allreduce", k, 136)["messages"]
            coord = 0.0 if k <= 1 else len(want) * (0.005 / 2 + neg * PIN_LINK.alpha_s)
            alg = setting.algorithm
            merges = (max(costs.tree_cost(k, r, 1)["bytes_received"] for r in range(k))
                      if alg in ("tree", "node") else k - 1) if k > 1 else 0
            comp_s = cost["base_s"] + merges * cost["per_payload_s"]
            assert pm.compression_at(cost, k, alg) == pytest.approx(comp_s, rel=1e-12), (label, k)
            p = pm.predict_step(0.02, comp_s, tr, k, PIN_LINK, cycle_s=0.005)
            assert p["wire_s"] == pytest.approx(wire / h, rel=1e-12), (label, k)
            assert p["coordination_s"] == pytest.approx(coord / h, rel=1e-12), (label, k)
            assert p["step_s"] == pytest.approx(0.02 + (comp_s + wire + coord) / h, rel=1e-12), (label, k)
    assert {"none", "fp16", "localsgd", "topk", "sgc", "terngrad", "powersgd"} <= seen


def test_pinned_layout_predictions():
    inp = pm.LayoutInputs(world_size=6, batch_size=16, t_conv=2e-3, t_fc=5e-4, act_bytes=1200.0,
                          grad_bytes=1024.0, codec_s=2e-5, alpha=1e-4, beta=1.2e7, dp_payload=2.5e6,
                          conv_payload=9000.0, fc_payload=2.4e6, dp_algorithm="tree",
                          conv_algorithm="allgather", fc_algorithm="ring", delay=2, fc_delay=1,
                          micro_batches=4)
    link = pm.Link(inp.alpha, inp.beta)
    # the exchange terms are predict_step's: wire + Horovod coordination (cycle 0 here: the
    # negotiation allreduce of 136 B per collective; no size exchange for the allgather)
    coord = lambda k, ag=False: 0.0 if k <= 1 else costs.ompi_collective_cost("allreduce", k, 136)["messages"] * 1e-4  # noqa: E731
    dp = pm.predict_data_parallel(inp)
    assert dp["step_s"] == pytest.approx(16 * 2.5e-3 + (_want_exchange(6, 2.5e6, "tree", link) + coord(6)) / 2,
                                         rel=1e-12)
    from gpipe_reference import derived_stages, gpipe_step

    for F in (1, 2, 3):
        # the GPipe schedule's longest path on the stages derived from t_conv, t_fc (backward 2x
        # forward), each role's exchange after its last compute task (was the closed form until
        # session 6: the FC rank's exchange now overlaps the CONV ranks' backwards)
        C, M = 6 - F, 4
        m = -(-C // F)
        want, _ = gpipe_step(16, M, m, derived_stages(16, M, 2e-3, 5e-4), 2e-5, 1e-4, 1.2e7, 1200.0, 1024.0,
                             conv_post=(0.0, (_want_exchange(C, 9000.0, "allgather", link) + coord(C, True)) / 2),
                             fc_post=(0.0, _want_exchange(F, 2.4e6, "ring", link) + coord(F)))
        got = pm.predict_hourglass(inp, F)
        assert got["step_s"] == pytest.approx(want, rel=1e-12), F
        assert got["throughput"] == pytest.approx(C * 16 / want, rel=1e-12), F


#: Stages per micro-batch of the plan test (as auto.measure_pipeline_stages returns them):
#: trunk forward / backward of b / M = 16 examples, the FC rank's call and per-row seconds.
STAGES = (3e-3, 5e-3, 1e-3, 2.5e-4)


def test_plan_ranks_methods_and_layouts_by_the_model():
    """hgsgc plan's ranking on fixed inputs: every row's value from the formulas by hand (ring /
    allgather wire, Horovod coordination, GPipe pipeline), the order by seconds per N b examples."""
    from hgsgc.compression import Compression

    n, b, alpha, beta, cyc = 4, 32, 2.5e-4, 1.25e6, 0.005          # 10 Mbit/s, emulator alpha
    link = pm.Link(alpha, beta, 0.5)
    conv_shapes, fc_shapes = SHAPES[:2], SHAPES[2:]
    d_conv, d_fc = (sum(math.prod(s) for s in x) for x in (conv_shapes, fc_shapes))
    sgc = Compression.sgc(density=0.01, index_coding="fixed")  # the figures below are by hand for fixed-width indices
    cost = {"base_s": 4e-3, "per_payload_s": 1e-3}
    compute = 0.05
    rows = [plan_mod.method_row("fp32", Compression.none, SHAPES, n, link, compute, {"base_s": 0.0, "per_payload_s": 0.0}, cyc),
            plan_mod.method_row("sgc", sgc, SHAPES, n, link, compute, cost, cyc)]
    # by hand: fp32 allreduce of 4 (d_conv + d_fc) = 6.4 MB on 4 ranks: Open MPI's Rabenseifner
    # (4 pairwise messages, 1.5x the buffer, at beta / 2); SGC allgatherv of its 46 kB payload P:
    # Bruck (2 rounds, 3 P, one-way), 3 payloads decoded; each + half a cycle + the 2-message
    # negotiation allreduce (no size exchange)
    dense = 4 * (d_conv + d_fc)
    want_fp32 = compute + 4 * alpha + 1.5 * dense / (beta / 2) + (cyc / 2 + 2 * alpha)
    P = sgc.payload_bytes(SHAPES)
    assert 16384 <= P < 262144
    want_sgc = compute + (4e-3 + 3e-3) + 2 * alpha + 3 * P / beta + (cyc / 2 + 2 * alpha)
    assert rows[0]["step_s"] == pytest.approx(want_fp32, rel=1e-12)
    assert rows[1]["step_s"] == pytest.approx(want_sgc, rel=1e-12)
    # the Hourglass inputs of the same setting: the update (compute - b (t_conv + t_fc)) split by parameters
    t_conv, t_fc = 5e-4, 2e-4
    u = compute - b * (t_conv + t_fc)
    inp = pm.LayoutInputs(world_size=n, batch_size=b, t_conv=t_conv, t_fc=t_fc, act_bytes=100.0, grad_bytes=96.0,
                          codec_s=0.0, alpha=alpha, beta=beta, bidir_factor=0.5, cycle_s=cyc,
                          dp_payload=float(P), conv_payload=float(sgc.payload_bytes(conv_shapes)),
                          fc_payload=float(4 * d_fc), dp_algorithm="allgather", conv_algorithm="allgather",
                          fc_algorithm="ring", micro_batches=2, dp_compression_s=4e-3 + 3e-3,
                          t_update_conv=u * d_conv / (d_conv + d_fc), t_update_fc=u * d_fc / (d_conv + d_fc),
                          **dict(zip(("conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s"), STAGES)))
    # one model: data parallelism predicted from the Hourglass inputs is the SGC row
    assert pm.predict_data_parallel(inp)["step_s"] == pytest.approx(want_sgc, rel=1e-12)
    conv_cost, fc_cost = {"base_s": 1e-3, "per_payload_s": 5e-4}, {"base_s": 0.0, "per_payload_s": 0.0}
    at = lambda F: pm.with_role_compression(inp, F, conv_cost, fc_cost)  # noqa: E731
    fcs = plan_mod.fc_workers_to_list(at, n)
    assert fcs == [1, 2]
    want_h = {}
    from gpipe_reference import gpipe_step

    for F in fcs:
        C, M = n - F, 2
        m = -(-C // F)
        Pc = inp.conv_payload
        # CONV allgatherv of Pc = 23 B: 3 ranks: gatherv + bcast (2 + 2 messages, 2 Pc + 2 * 3 Pc,
        # one-way), negotiation by recursive doubling with a fold (3 messages); 2 ranks: one swap each
        assert Pc == 23
        wire_c, neg_c = {3: (4 * alpha + 8 * Pc / beta, 3), 2: (alpha + Pc / (beta / 2), 1)}[C]
        e_c = 1e-3 + (C - 1) * 5e-4 + wire_c + cyc / 2 + neg_c * alpha
        e_f = 0.0 if F == 1 else (2 * alpha + 4 * d_fc / (beta / 2) + cyc / 2 + alpha)   # ring of 2: pairwise
        # the GPipe schedule (longest path) on the stages per micro-batch plan measured (fixed here)
        comp_c = 1e-3 + (C - 1) * 5e-4
        want_h[F], _ = gpipe_step(b, M, m, STAGES, 0.0, alpha, beta, 100.0, 96.0,
                                  conv_post=(inp.t_update_conv + comp_c, e_c - comp_c),
                                  fc_post=(inp.t_update_fc, e_f))
        rows.append(plan_mod.hourglass_row(at(F), F, "sgc"))
        assert rows[-1]["step_s"] == pytest.approx(want_h[F], rel=1e-12), F
    ranked = plan_mod.rank_rows(rows, n, b, steps_to_target={"sgc": 1000, "hourglass_F1": None})
    per_nb = {"fp32": want_fp32, "sgc": want_sgc, "hourglass_F1": want_h[1] * 4 / 3, "hourglass_F2": want_h[2] * 4 / 2}
    assert [r["method"] for r in ranked] == sorted(per_nb, key=per_nb.get)
    for r in ranked:
        assert r["s_per_global_batch"] == pytest.approx(per_nb[r["method"]], rel=1e-12)
    by = {r["method"]: r for r in ranked}
    assert by["sgc"]["time_to_target_s"] == pytest.approx(1000 * want_sgc, rel=1e-12)
    assert by["hourglass_F1"]["time_to_target_s"] is None and by["fp32"]["steps_to_target"] is None
    text = plan_mod.format_plan({"inputs": {"config": "fixed", "parameters": d_conv + d_fc, "batch_size": b,
                                            "nodes": n, "bandwidth_bit_s": 1e7, "beta_Bps": beta, "alpha_s": alpha,
                                            "bidir_factor": 0.5, "cycle_s": cyc, "compute_s": compute},
                                 "hourglass": {"reason": "fixed inputs"}, "hourglass_inputs": None, "rows": ranked})
    assert text.splitlines()[3].split()[1] == ranked[0]["method"]


# ------------------------------------------------------------------------------------------
# Open MPI 4.1's algorithm choice (hgsgc.costs.ompi_*): the cases traced on this machine's Open
# MPI 4.1.4 (strace of every rank's TCP sends, `--mca btl tcp,self`, docs/benchmarks/perfmodel.md:
# per call, rank 0 sent the listed message sizes), and every algorithm's cost formula by hand.
@pytest.mark.parametrize("coll,n,nbytes,alg,sizes", [
    ("allgatherv", 4, 20000, "bruck", [20000, 40000]),
    ("allgatherv", 4, 6000, "ring", [6000, 6000, 6000]),
    ("allgatherv", 4, 300000, "neighbor", [300000, 600000]),
    ("allgatherv", 8, 20000, "bruck", [20000, 40000, 80000]),
    ("allgatherv", 2, 30000, "two_proc", [30000]),
    ("allreduce", 4, 1000000, "rabenseifner", [500000, 250000, 250000, 500000]),
    ("allreduce", 2, 1000000, "rabenseifner", [500000, 500000]),
    ("allreduce", 4, 4000, "recursive_doubling", [4000, 4000]),
    ("allreduce", 8, 400000, "rabenseifner", [200000, 100000, 50000, 50000, 100000, 200000]),
])
def test_ompi_choice_matches_the_traced_sends(coll, n, nbytes, alg, sizes):
    c = costs.ompi_collective_cost(coll, n, nbytes)
    assert c["algorithm"] == alg
    assert c["messages"] == len(sizes)
    assert c["bytes"] == pytest.approx(sum(sizes))


def test_ompi_cost_formulas_by_hand():
    f = costs.ompi_collective_cost
    assert f("allreduce", 1, 1e6) == {"algorithm": "none", "messages": 0, "bytes": 0.0, "pairwise": False}
    # Rabenseifner, 6 ranks (p = 4, one fold): 2*2 + 2 messages, 1.5 B + B
    assert f("allreduce", 6, 1e6) == {"algorithm": "rabenseifner", "messages": 6, "bytes": 2.5e6, "pairwise": True}
    # recursive doubling, 6 ranks, 1 kB: log2 4 + 2 messages, (2 + 1) B
    assert f("allreduce", 6, 1000) == {"algorithm": "recursive_doubling", "messages": 4, "bytes": 3000.0,
                                       "pairwise": True}
    # ring for 2-3 ranks at 4-8 kB and 16-64 kB: 2 (n-1) messages, 2 (n-1)/n B
    assert f("allreduce", 3, 6000) == {"algorithm": "ring", "messages": 4, "bytes": pytest.approx(8000.0),
                                        "pairwise": False}
    assert costs.ompi_allreduce_algorithm(3, 100000) == "segmented_ring"
    # nonoverlapping (reduce + bcast), 200 ranks, 1 kB: 2 ceil(log2 200) = 16 messages of B
    assert f("allreduce", 200, 1000) == {"algorithm": "nonoverlapping", "messages": 16, "bytes": 16000.0,
                                         "pairwise": False}
    # allgatherv: default (gatherv + bcast) 4 ranks, 100 B: 3 + 2 messages, 3 P + 2 * 4 P
    assert f("allgatherv", 4, 100) == {"algorithm": "default", "messages": 5, "bytes": 1100.0, "pairwise": False}
    # neighbour exchange, 6 ranks, 1 kB: 3 steps, 5 P; 5 ranks: odd -> ring, 4 steps
    assert f("allgatherv", 6, 1000) == {"algorithm": "neighbor", "messages": 3, "bytes": 5000.0, "pairwise": True}
    assert f("allgatherv", 5, 1000) == {"algorithm": "ring", "messages": 4, "bytes": 4000.0, "pairwise": False}
    # Bruck at 1,024 ranks below 4 kB: ceil(log2 1024) = 10 rounds; from 4 kB neighbour exchange
    assert f("allgatherv", 1024, 1000) == {"algorithm": "bruck", "messages": 10, "bytes": 1023000.0,
                                           "pairwise": False}
    assert f("allgatherv", 1024, 5000)["messages"] == 512
    with pytest.raises(ValueError, match="unknown collective"):
        f("alltoall", 4, 1)


# ------------------------------------------------------------------------------------------
# Waiting for the slowest rank: E[max over ranks of the exchange period], from measured samples.
def test_expected_max_period_exact_by_hand():
    f = pm.expected_max_period
    assert f([[1.0, 3.0], [2.0]]) == pytest.approx(2.5)            # max in {2, 3}, 1/2 each
    assert f([[1.0, 3.0], [1.0, 3.0]]) == pytest.approx(0.25 * 1 + 0.75 * 3)
    assert f([[1.0, 3.0]], h=2) == pytest.approx((2 + 4 + 4 + 6) / 4)  # one rank: the mean of the sums
    # periods {11, 13} and {12}: E[max] = (12 + 13) / 2
    assert f([[1.0, 3.0], [2.0]], [[10.0], [10.0]]) == pytest.approx(12.5)
    # h = 2 on two ranks: rank 0 sums {0, 1, 1, 2}, rank 1 {2, 2}: max = 2 always
    assert f([[0.0, 1.0], [1.0]], h=2) == pytest.approx(2.0)
    assert pm.sync_wait_s([[1.0, 3.0], [2.0]]) == pytest.approx(0.5)
    assert pm.sync_wait_s([[0.02] * 5, [0.02] * 7], [[0.01], [0.01]], h=4) == pytest.approx(0.0, abs=1e-15)
    p = pm.predict_step(0.02, 0.004, pm.Traffic((("allgather", 1000),), delay=4), 2, pm.Link(1e-4, 1e6),
                        cycle_s=0.0, wait_s=0.008)
    assert p["wait_s"] == pytest.approx(0.002)
    assert p["step_s"] == pytest.approx(0.02 + (0.004 + 0.008 + 1e-4 + 1000 / 1e6 + 1e-4) / 4)
    for bad in ([], [[]], ):
        with pytest.raises(ValueError, match="compute sample"):
            f(bad)
    with pytest.raises(ValueError, match="per rank"):
        f([[1.0], [2.0]], [[1.0]])


def test_expected_max_period_monte_carlo_matches_the_exact_value():
    # 1,100 samples, h = 2: 1.21 M sums per rank -> the deterministic Monte Carlo path. Each rank's
    # sum is 0, 1, 2 with probabilities q^2, 2 q (1-q), (1-q)^2, q = 10/11; E[max of 2 ranks] by hand
    xs = [0.0] * 1000 + [1.0] * 100
    q = 10 / 11
    cdf = {0: q * q, 1: q * q + 2 * q * (1 - q), 2: 1.0}
    want = sum(v * (cdf[v] ** 2 - (cdf[v - 1] ** 2 if v else 0.0)) for v in (0, 1, 2))
    got = pm.expected_max_period([xs, xs], h=2)
    assert got == pytest.approx(want, rel=0.02)
    assert got == pm.expected_max_period([xs, xs], h=2)             # same seed: same value


def test_measured_coordination_overhead_replaces_the_formula():
    link = pm.Link(8e-3, 1.2e7)
    assert pm.coordination_s(4, link, 2, 0.005, overhead_s=0.05) == pytest.approx(0.1)
    assert pm.coordination_s(4, link, 1, 0.005, overhead_s=-0.03) == 0.0   # hvd faster than MPI: 0
    assert pm.coordination_s(1, link, 1, 0.005, overhead_s=0.05) == 0.0
    assert pm.coordination_s(4, link, 1, 0.005) == pytest.approx(0.0025 + 2 * 8e-3)
    tr = pm.Traffic((("ring", 8000), ("ring", 4000)), delay=2)        # two dependent collectives
    p = pm.predict_step(0.02, 0.0, tr, 4, link, cycle_s=0.005, coordination_overhead_s=0.05)
    assert p["coordination_s"] == pytest.approx(2 * 0.05 / 2)
