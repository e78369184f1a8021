"""Hourglass layout: roles, model split, cost model (single process) and the step under mpirun.

Multi-rank checks: tests/mpi/check_hourglass.py runs once per rank count (2, 3, 4, 5) in the suite's batched launch
of that count (after its other cases), rank 0 prints a RESULT JSON line and the tests below assert on it; bad layouts are three more
short launches (tests/mpi/hourglass_bad_layout.py).
"""
import json
import math
import os

import numpy as np
import pytest

import reference as ref
from conftest import mpi_cases
from hgsgc.hourglass.costmodel import CostInputs, choose_fc_workers, exchange_bytes, layout_inputs, stage_times
from hgsgc.hourglass.layout import LayoutError, check_fc_workers, plan_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------
# roles (pure)
def test_plan_layout_last_ranks_are_fc_and_mapping_is_balanced():
    for n in range(2, 13):
        for F in range(1, n // 2 + 1):
            p = plan_layout(n, F)
            C = n - F
            assert p.conv_ranks == list(range(C)) and p.fc_ranks == list(range(C, n))
            assert sorted(p.fc_of) == p.conv_ranks
            counts = [len(p.convs_of(f)) for f in p.fc_ranks]
            assert sum(counts) == C and max(counts) - min(counts) <= 1
            assert all(c >= 1 for c in counts)
    p = plan_layout(5, 2)
    assert p.fc_of == {0: 3, 1: 3, 2: 4} and p.convs_of(3) == [0, 1] and p.convs_of(4) == [2]
    assert plan_layout(4, 1).fc_of == {0: 3, 1: 3, 2: 3}


@pytest.mark.parametrize("n,fc,msg", [
    (1, 1, "at least 2 ranks"), (0, "auto", "at least 2 ranks"), (4, 0, "at least 1 FC rank"),
    (4, 3, "more than the 1 CONV ranks"), (3, 2, "more than the 1 CONV ranks"),
    (4, 4, "leaves no CONV rank"), (4, True, "is invalid"), (4, "two", "is invalid")])
def test_impossible_layouts_raise_one_clear_error(n, fc, msg):
    with pytest.raises(LayoutError, match=msg):
        check_fc_workers(n, fc)
    if fc != "auto":
        with pytest.raises(LayoutError):
            plan_layout(n, fc)


def test_possible_layouts_pass():
    for n, fc in [(2, 1), (4, 2), (5, 2), (4, "auto"), (2, "auto")]:
        check_fc_workers(n, fc)


# ------------------------------------------------------------------------------------------
# model split (single process)
@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf

    try:  # a speed setting only; an earlier test module may have started TF's runtime already
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass
    return tf


@pytest.mark.parametrize("name,features", [("tiny", 784), ("alexnet_small", 3136)])
def test_split_trunk_then_head_equals_whole_model(tf, name, features):
    from hgsgc.hourglass import split_model
    from hgsgc.models import build_model

    model = build_model(name, seed=1)
    s = split_model(model)
    assert s.boundary_layer == "fc1" and s.features == features
    assert [l.name for l in s.trunk.layers[1:]] == ["conv1", "pool1", "conv2", "pool2", "flatten"]
    assert [l.name for l in s.head.layers[1:]][0] == "fc1" and s.head.layers[-1].name == "logits"
    assert len(s.trunk_variables) + len(s.head_variables) == len(model.trainable_variables)
    x = np.random.default_rng(0).random((5, 28, 28, 1), dtype=np.float32)
    whole = model(x, training=False).numpy()
    parts = s.head(s.trunk(x, training=False), training=False).numpy()
    assert np.array_equal(whole, parts), np.max(np.abs(whole - parts))
    # shared variables: changing the trunk changes the model
    s.trunk_variables[0].assign_add(tf.ones_like(s.trunk_variables[0]))
    assert np.array_equal(model(x).numpy(), s.head(s.trunk(x)).numpy())


def test_split_functional_and_named_layer(tf):
    from hgsgc.hourglass import split_model

    L = tf.keras.layers
    inp = tf.keras.Input((12, 12, 2))
    h = L.Conv2D(4, 3, activation="relu", name="c1")(inp)
    h = L.Flatten(name="flat")(h)
    h = L.Dense(8, activation="relu", name="d1")(h)
    h = L.Dense(6, activation="relu", name="d2")(h)
    out = L.Dense(3, name="out")(h)
    model = tf.keras.Model(inp, out)
    x = np.random.default_rng(1).random((4, 12, 12, 2), dtype=np.float32)
    s = split_model(model)
    assert s.boundary_layer == "d1" and s.boundary_shape == (10 * 10 * 4,)
    assert np.array_equal(model(x).numpy(), s.head(s.trunk(x)).numpy())
    s2 = split_model(model, split_layer="d2")
    assert s2.boundary_layer == "d2" and s2.boundary_shape == (8,)
    assert np.array_equal(model(x).numpy(), s2.head(s2.trunk(x)).numpy())


def test_split_errors(tf):
    from hgsgc.hourglass import SplitError, split_model

    L = tf.keras.layers
    mlp = tf.keras.Sequential([tf.keras.Input((4,)), L.Dense(3), L.Dense(2)], name="mlp")
    with pytest.raises(SplitError, match="no convolution layer"):
        split_model(mlp)
    conv_only = tf.keras.Sequential([tf.keras.Input((8, 8, 1)), L.Conv2D(2, 3), L.Flatten()], name="c")
    with pytest.raises(SplitError, match="no Dense layer after its last convolution"):
        split_model(conv_only)
    from hgsgc.models import build_model

    with pytest.raises(SplitError, match="is not a layer"):
        split_model(build_model("tiny"), split_layer="nope")
    with pytest.raises(SplitError, match="first layer"):
        split_model(build_model("tiny"), split_layer="conv1")
    # a skip connection across the boundary: the head would need the input too
    inp = tf.keras.Input((6, 6, 1))
    c = L.Flatten()(L.Conv2D(2, 3)(inp))
    d = L.Dense(4, name="d1")(c)
    out = L.Dense(2)(L.Concatenate()([d, L.Flatten()(inp)]))
    with pytest.raises(SplitError, match="across the boundary"):
        split_model(tf.keras.Model(inp, out))


# ------------------------------------------------------------------------------------------
# cost model (pure)
def _inputs(**kw):
    base = dict(t_conv=1e-3, t_fc=1e-3, batch_size=32, act_bytes=0.0, grad_bytes=0.0,
                conv_payload=0.0, fc_payload=0.0, bandwidth=1e12)
    base.update(kw)
    return CostInputs(**base)


def test_cost_model_balances_the_stages():
    # heavy head: 3 CONV + 1 FC leaves the FC stage 3x longer; 2 + 2 balances it
    assert choose_fc_workers(_inputs(t_fc=1e-3), 4)["fc_workers"] == 2
    # light head: one FC rank keeps up with 3 CONV ranks and more CONV ranks win
    assert choose_fc_workers(_inputs(t_fc=1e-5), 4)["fc_workers"] == 1
    # 8 ranks, head a third of the trunk's time: F=2 (6 CONV, 3 per FC) is balanced
    r = choose_fc_workers(_inputs(t_fc=1e-3 / 3), 8)
    assert r["fc_workers"] == 2 and len(r["candidates"]) == 4
    assert choose_fc_workers(_inputs(), 2)["fc_workers"] == 1


def test_cost_model_formula():
    """fc_workers: auto predicts with hgsgc.perfmodel.predict_hourglass (the one model): the
    GPipe pipeline of trunk, boundary and head, then the slower role's exchange (wire +
    Horovod's negotiation, alpha 0 here, and half a cycle)."""
    inp = _inputs(t_conv=2e-3, t_fc=5e-4, batch_size=10, act_bytes=100.0, grad_bytes=96.0,
                  conv_payload=1000.0, fc_payload=4000.0, bandwidth=1e6, conv_exchange="allgather",
                  conv_delay=2, codec_s=1e-5, micro_batches=2, cycle_s=0.004)
    t = stage_times(inp, 5, 2)  # C = 3, m = 2
    assert t["conv_workers"] == 3 and t["convs_per_fc"] == 2
    M = 2
    conv = ((3 - 1) * 1000 / 1e6 + 0.004 / 2) / 2           # allgather among 3, delay 2
    fc = 2 * (2 - 1) / 2 * 4000 / 1e6 + 0.004 / 2           # ring among 2
    # the GPipe schedule on the stages derived from t_conv, t_fc (CostInputs without measured
    # stages; tests/gpipe_reference.py), each role's exchange after its last compute task
    from gpipe_reference import derived_stages, gpipe_step

    want, _ = gpipe_step(10, M, 2, derived_stages(10, M, 2e-3, 5e-4), 1e-5, 0.0, 1e6, 100.0, 96.0,
                         conv_post=(0.0, conv), fc_post=(0.0, fc))
    assert t["stages"] == "derived"
    assert math.isclose(t["T_step_s"], want, rel_tol=1e-12)
    assert math.isclose(t["conv_exchange_s"], conv, rel_tol=1e-12) and math.isclose(t["fc_exchange_s"], fc, rel_tol=1e-12)
    assert math.isclose(t["throughput"], 30 / want, rel_tol=1e-12)
    from hgsgc import perfmodel

    assert t["step_s"] == perfmodel.predict_hourglass(layout_inputs(inp, 5), 2)["step_s"]
    assert exchange_bytes(1, 123.0, "allgather") == 0.0
    assert exchange_bytes(4, 100.0, "ring") == 150.0 and exchange_bytes(4, 100.0, "allgather", 3) == 100.0
    # tree: the busiest rank of hgsgc.hierarchy's schedule
    from hgsgc.hierarchy import tree_cost

    for k in range(2, 12):
        busiest = max(tree_cost(k, r, 10)["bytes_sent"] for r in range(k))
        assert exchange_bytes(k, 10.0, "tree") == busiest, k


# ------------------------------------------------------------------------------------------
# configs
def test_wire_dtype_validated():
    from hgsgc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"hourglass\.wire_dtype"):
        load_config("configs/fashion_mnist.yaml", ["hourglass.wire_dtype=int8"])
    assert load_config("configs/fashion_mnist.yaml", ["hourglass.wire_dtype=float16"]).hourglass.wire_dtype == "float16"
    for bad in ("0", "33"):  # batch_size 32
        with pytest.raises(ConfigError, match=r"hourglass\.micro_batches"):
            load_config("configs/fashion_mnist.yaml", [f"hourglass.micro_batches={bad}"])


def test_main_job_config_is_the_hourglass_config_with_layout_auto():
    """``make demo`` (and the Slurm template's default) run configs/fashion_mnist_auto.yaml, which
    must stay configs/fashion_mnist.yaml with layout auto and the measured best codecs (session 21:
    the Hourglass forced was the slower layout for this model in every measured cell)."""
    import re
    import subprocess

    from hgsgc.config import load_config

    main = load_config(os.path.join(ROOT, "configs/fashion_mnist_auto.yaml"))
    assert main == load_config(os.path.join(ROOT, "configs/fashion_mnist.yaml"), [
        "layout=auto", "hourglass.fc_workers=auto", "run.name=fashion_mnist_auto_sgc",
        "hourglass.act_codec=sparse+q4", "hourglass.grad_codec=sparse+q4", "hourglass.micro_batches=2"])
    assert (main.layout, main.compression.method, main.compression.delay) == ("auto", "sgc", 4)
    # under `make test` MAKELEVEL / MAKEFLAGS come along: make would print "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    demo = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=env)
    assert demo.returncode == 0, demo.stderr
    (line,) = [ln for ln in demo.stdout.splitlines() if "hgsgc train" in ln]
    assert re.search(r"-np 4 .*hgsgc train configs/fashion_mnist_auto\.yaml\s*$", line), line
    with open(os.path.join(ROOT, "scripts/slurm/train.sbatch")) as f:
        assert "CONFIG=${1:-configs/fashion_mnist_auto.yaml}" in f.read()


def test_hourglass_configs():
    import yaml

    from hgsgc.config import load_config

    dense = load_config(os.path.join(ROOT, "configs/fashion_mnist_hourglass.yaml"))
    assert dense.layout == "hourglass" and dense.compression.method == "none"
    assert dense.hourglass.fc_method == "none"
    sgc = load_config(os.path.join(ROOT, "configs/fashion_mnist.yaml"))  # the main job's Hourglass
    assert sgc.layout == "hourglass" and sgc.hourglass.fc_method == "none"
    with open(os.path.join(ROOT, "configs/fashion_mnist.yaml")) as f:
        mine = yaml.safe_load(f)["compression"]
    with open(os.path.join(ROOT, "configs/fashion_mnist_sgc.yaml")) as f:
        theirs = yaml.safe_load(f)["compression"]
    assert mine == theirs
    for c in (dense, sgc):
        assert c.train.epochs == 2 and c.train.batch_size == 32 and c.run.seed == 42
        assert c.model.name == "alexnet_small"


# ------------------------------------------------------------------------------------------
# under mpirun
# one case per rank count in the batched launch (tests/conftest.py, ``mpi_batch``), after the
# launch's other cases: the Layout starts its own Horovod (session 14: 4 launches fewer)
MPI_CASES = mpi_cases("tests/mpi/check_hourglass.py", "{tmp}", ranks=[2, 3, 4, 5], timeout=600, tmp=True,
                      own_horovod=True)


@pytest.fixture(scope="module", params=[2, 3, 4, 5])
def result(request, mpi_batch):
    out = dict(mpi_batch.result(request.param, "tests/mpi/check_hourglass.py", "{tmp}"))
    out["run_dir"] = mpi_batch.tmpdir(request.param, "tests/mpi/check_hourglass.py", "{tmp}")
    return out


def _layouts(result):
    for rank, r in enumerate(result["ranks"]):
        for F, o in r["layouts"].items():
            yield rank, int(F), o


@pytest.mark.mpi
def test_roles_process_sets_and_mapping(result):
    n = result["size"]
    for rank, F, o in _layouts(result):
        plan = plan_layout(n, F)
        assert o["role"] == plan.role(rank) and o["n_fc"] == F and o["n_conv"] == n - F
        want = plan.fc_ranks if o["role"] == "fc" else plan.conv_ranks
        assert o["process_set_ranks"] == want
        if o["role"] == "conv":
            assert o["my_fc"] == plan.fc_of[rank]
        else:
            assert o["my_convs"] == plan.convs_of(rank) and o["my_convs"]


@pytest.mark.mpi
def test_one_step_equals_single_process_step_on_the_union(result):
    for rank, F, o in _layouts(result):
        assert o["moved"] > 1e-3, o["moved"]            # the steps changed the weights
        for step, err in enumerate(o["max_err_per_step"]):
            assert err < 1e-6, (rank, F, o["role"], step, err)


@pytest.mark.mpi
def test_fp16_wire_halves_p2p_bytes_and_stays_close(result):
    B = 6
    for rank, F, o in _layouts(result):
        f, got = o["features"], o["fp16_bytes"]
        m = 1 if o["role"] == "conv" else len(o["my_convs"])
        key_a, key_g = (("activation_bytes_sent", "activation_grad_bytes_received") if o["role"] == "conv"
                        else ("activation_bytes_received", "activation_grad_bytes_sent"))
        assert got[key_a] == got[key_g] == m * B * f * 2, (rank, F, got)   # 2 bytes per value
        assert got["label_bytes_sent" if o["role"] == "conv" else "label_bytes_received"] == m * B * 4
        # fp16 rounding (relative 2^-11) of activations and their gradients: a small, nonzero error
        assert o["fp16_err"] < 1e-3, (rank, F, o["role"], o["fp16_err"])


@pytest.mark.mpi
def test_pipelined_step_equals_single_process_step(result):
    B, M = 6, 3
    for rank, F, o in _layouts(result):
        assert o["pipelined_vs_fp16_ref_moved"] > 1e-3
        assert o["pipelined_err"] < 1e-6, (rank, F, o["role"], o["pipelined_err"])
        got, f = o["pipelined_bytes"], o["features"]
        m = 1 if o["role"] == "conv" else len(o["my_convs"])
        assert got["p2p_messages"] == 3 * M * m          # 3 messages per micro-batch per CONV rank
        act = "activation_bytes_sent" if o["role"] == "conv" else "activation_bytes_received"
        assert got[act] == m * B * f * 4                  # same bytes as unpipelined
        assert math.isfinite(o["pipelined_loss"])


@pytest.mark.mpi
def test_weights_identical_within_roles(result):
    for rank, F, o in _layouts(result):
        spreads = o["sparse_spreads"]  # after steps 1..4, CONV delay 2
        if o["role"] == "fc" or o["n_conv"] == 1:
            assert spreads == [0.0] * 4, (rank, spreads)
        else:
            assert spreads[1] == 0.0 and spreads[3] == 0.0, spreads   # right after each sync
            assert spreads[0] > 0 and spreads[2] > 0, spreads         # local steps in between


@pytest.mark.mpi
def test_evaluation_runs_through_the_split(result):
    for rank, F, o in _layouts(result):
        assert abs(o["eval"][0] - o["eval_ref"][0]) < 1e-5
        assert o["eval"][1] == o["eval_ref"][1]


def _ring(n, nbytes):
    return (2 * (n - 1) * nbytes) // n if n > 1 else 0


def _sparse_payload(shapes, density, bits):
    total = 0
    for s in shapes:
        numel = int(np.prod(s))
        total += ref.payload_length(numel, ref.k_for(numel, density), bits, ref.DEFAULT_CODING)
    return total


@pytest.mark.mpi
def test_byte_accounting_equals_formula(result):
    B = 6
    for rank, F, o in _layouts(result):
        C, f, dc, dfc = o["n_conv"], o["features"], o["d_conv"], o["d_fc"]
        for kind, steps, ex in (("dense", 2, 2), ("sparse", 4, None)):
            got = o[f"{kind}_bytes"]
            act, lab, grad = steps * B * f * 4, steps * B * 4, steps * B * f * 4
            if o["role"] == "conv":
                if kind == "dense":
                    payload, wire, exchanges = steps * 4 * dc, steps * _ring(C, 4 * dc), steps
                else:  # SGC 2-bit density 0.05, delay 2: one exchange every second step
                    P = _sparse_payload(o["conv_shapes"], 0.05, 2)
                    exchanges = steps // 2
                    payload, wire = exchanges * P, exchanges * (C - 1) * P
                want = {"activation_bytes_sent": act, "label_bytes_sent": lab,
                        "activation_grad_bytes_received": grad, "activation_bytes_received": 0,
                        "label_bytes_received": 0, "activation_grad_bytes_sent": 0,
                        "exchange_payload_bytes": payload, "exchange_bytes_sent": wire,
                        "exchange_bytes_received": wire, "exchange_exchanges": exchanges,
                        "exchange_gradient_bytes": exchanges * 4 * dc,
                        "p2p_messages": 3 * steps, "steps": steps}
                # FC parameters never cross a CONV rank's link: no d_fc term anywhere
                want["bytes_sent"] = act + lab + wire
                want["bytes_received"] = grad + wire
            else:
                m = len(o["my_convs"])
                if kind == "dense":
                    payload, wire = steps * 4 * dfc, steps * _ring(F, 4 * dfc)
                else:  # top-k fp32, density 0.1, every step
                    P = _sparse_payload(o["fc_shapes"], 0.1, 32)
                    payload, wire = steps * P, steps * (F - 1) * P
                want = {"activation_bytes_received": m * act, "label_bytes_received": m * lab,
                        "activation_grad_bytes_sent": m * grad, "activation_bytes_sent": 0,
                        "label_bytes_sent": 0, "activation_grad_bytes_received": 0,
                        "exchange_payload_bytes": payload, "exchange_bytes_sent": wire,
                        "exchange_bytes_received": wire, "exchange_exchanges": steps,
                        "exchange_gradient_bytes": steps * 4 * dfc,
                        "p2p_messages": 3 * m * steps, "steps": steps,
                        "bytes_sent": m * grad + wire, "bytes_received": m * (act + lab) + wire}
            for k, v in want.items():
                assert got[k] == v, (rank, F, kind, k, got[k], v)


@pytest.mark.mpi
def test_lossless_codec_and_pipeline_step_equals_single_process_step(result):
    """sparse (bitmap + fp32 non-zeros, gradients masked by the activations' zeros), pipelined in
    2 micro-batches: exactly the single-process step."""
    for rank, F, o in _layouts(result):
        c = o["codecs"]["sparse/sparse/M2"]
        assert c["lossless"] and c["act_err_over_bound"] == 0 and c["grad_err_over_bound"] == 0
        assert c["step_err_vs_lossless"] < 1e-6, (rank, F, o["role"], c)


@pytest.mark.mpi
def test_lossy_codecs_within_their_bounds(result):
    """Every decoded activation / activation gradient of the step is within the codec's per-entry
    bound of what was encoded, and the step is exactly the SGD step on the decoded tensors, so its
    distance from the lossless step is the codec error propagated through one step."""
    for rank, F, o in _layouts(result):
        for name, c in o["codecs"].items():
            assert c["act_err_over_bound"] <= 1.0 and c["grad_err_over_bound"] <= 1.0, (rank, name, c)
            assert c["step_err_vs_decoded_ref"] < 1e-6, (rank, F, name, c)
            if not c["lossless"]:
                assert 0 < c["step_err_vs_lossless"] < 0.01, (rank, F, name, c)


@pytest.mark.mpi
def test_codec_byte_counts_equal_the_formulas(result):
    B = 6
    for rank, F, o in _layouts(result):
        m = 1 if o["role"] == "conv" else len(o["my_convs"])
        for name, c in o["codecs"].items():
            got = c["bytes"]
            if o["role"] == "conv":
                a, g = got["activation_bytes_sent"], got["activation_grad_bytes_received"]
                assert got["label_bytes_sent"] == 4 * B
            else:
                a, g = got["activation_bytes_received"], got["activation_grad_bytes_sent"]
                assert got["label_bytes_received"] == 4 * B * m
            assert a == c["expected_act_bytes"] and g == c["expected_grad_bytes"], (rank, name, got, c)
            assert 0 < a <= m * c["fp32_boundary_bytes"]


@pytest.mark.mpi
@pytest.mark.parametrize("result", [5], indirect=True)  # 2 FC ranks
def test_sgc_among_fc_ranks_with_delay(result):
    seen = 0
    for rank, F, o in _layouts(result):
        if F < 2:
            continue
        seen += 1
        sp = o["fc_sgc_spreads"]
        got = o["fc_sgc_bytes"]
        if o["role"] == "fc":
            assert sp[1] == 0.0 and sp[3] == 0.0 and sp[0] > 0 and sp[2] > 0, sp  # delay 2
            P = _sparse_payload(o["fc_shapes"], 0.1, 2)
            assert got["exchange_exchanges"] == 2 and got["exchange_payload_bytes"] == 2 * P
            assert got["exchange_bytes_sent"] == got["exchange_bytes_received"] == 2 * (F - 1) * P
        else:
            assert got["exchange_bytes_sent"] == 4 * _ring(o["n_conv"], 4 * o["d_conv"])  # dense, 4 steps
    assert seen == result["size"]


@pytest.mark.mpi
@pytest.mark.parametrize("result", [4], indirect=True)  # fc_workers=auto is checked with 4 ranks
def test_auto_fc_workers_agree(result):
    assert result["size"] == 4
    choices = [r["auto"]["fc_workers"] for r in result["ranks"]]
    assert len(set(choices)) == 1 and choices[0] in (1, 2)
    for r in result["ranks"]:
        a = r["auto"]
        assert a["report_choice"] == a["fc_workers"] == a["recomputed"] and a["candidates"] == 2


@pytest.mark.mpi
@pytest.mark.parametrize("result", [4], indirect=True)
def test_layout_auto_agrees_and_follows_the_model(result):
    outs = [r["layout_auto"] for r in result["ranks"]]
    assert all(o == outs[0] for o in outs)                        # one choice, broadcast
    o = outs[0]
    assert [o["layout"], o["fc_workers"]] == o["recomputed"] and o["n_predictions"] == 3
    i = o["inputs"]
    assert i["world_size"] == 4 and i["batch_size"] == 8 and i["beta"] > 0 and i["alpha"] > 0
    f = 7 * 7 * 16                                                # tiny's boundary
    # measured with the configured codec (sparse+q8): below fp32's 4 f + 4 and 4 f
    assert 0 < i["act_bytes"] < 4 * f + 4 and 0 < i["grad_bytes"] < 4 * f


@pytest.mark.mpi
@pytest.mark.parametrize("result", [3], indirect=True)  # the short main-job run uses 3 ranks
def test_main_job_summary_and_model(result, tf):
    assert result["size"] == 3
    sums = [r["run_summary"] for r in result["ranks"]]
    s = sums[0]
    assert all(x == s for x in sums)  # same summary on every rank
    for key in ("final_test_accuracy", "final_test_loss", "epochs", "steps", "world_size", "layout",
                "compression", "mean_step_time_s", "wall_time_s", "gradient_bytes",
                "payload_bytes_per_step_per_rank", "bytes_sent_per_step_per_rank",
                "bytes_received_per_step_per_rank", "dense_bytes_per_step_per_rank",
                "compression_ratio", "roles", "total_bytes_sent_per_step"):
        assert key in s, key
    assert s["layout"] == "hourglass" and s["world_size"] == 3 and s["steps"] == 5
    conv, fc = s["roles"]["conv"], s["roles"]["fc"]
    assert conv["exchanges"] == 3  # delay 2: syncs after steps 2, 4 and the flush before evaluation
    assert conv["ranks"] == [0, 1] and fc["ranks"] == [2]
    f, b = 784, 8
    assert conv["activation_bytes_sent_per_step_per_rank"] == b * (4 * f + 4)
    assert conv["activation_grad_bytes_received_per_step_per_rank"] == b * 4 * f
    assert fc["activation_bytes_received_per_step_per_rank"] == 2 * b * (4 * f + 4)
    assert fc["exchange_bytes_sent_per_step_per_rank"] == 0  # a single FC rank exchanges nothing
    assert math.isclose(s["total_bytes_sent_per_step"],
                        sum(p["bytes_sent"] for r in ("conv", "fc") for p in s["roles"][r]["per_rank"]))
    # the headline: every byte of the step against dense data parallelism, parts beside it
    t = s["traffic"]
    parts = t["parts"]
    assert math.isclose(t["bytes_per_step"], s["total_bytes_sent_per_step"])
    assert math.isclose(t["bytes_per_step"], sum(parts[k]["bytes_per_step"] for k in (
        "activations", "labels", "activation_gradients", "conv_exchange", "fc_exchange")))
    d = s["parameters"]
    assert t["dense_data_parallel_bytes_per_step"] == 2 * (3 - 1) * 4 * d
    assert s["compression_ratio"] == t["ratio"] == t["dense_data_parallel_bytes_per_step"] / t["bytes_per_step"]
    assert parts["activations"]["bytes_per_step"] == 2 * b * 4 * f
    assert parts["activations"]["ratio"] == parts["activation_gradients"]["ratio"] == 1.0  # fp32
    assert parts["labels"]["bytes_per_step"] == 2 * b * 4
    assert parts["fc_exchange"]["bytes_per_step"] == 0
    assert s["gradient_compression_ratio"] > s["compression_ratio"]  # CONV exchange alone: not the headline
    assert s["hourglass"]["act_codec"]["codec"] == "fp32" and s["hourglass"]["pipeline"]["schedule"] == "none"
    run_dir = os.path.join(result["run_dir"], "hg")
    with open(os.path.join(run_dir, "summary.json")) as fh:
        assert json.load(fh)["final_test_accuracy"] == s["final_test_accuracy"]
    assert len(open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()) == 1
    # one ordinary Keras model (trunk from CONV rank 0, head from the FC rank): loads, predicts,
    # and scores what the split evaluation scored (the pending CONV sync ran before evaluating)
    from hgsgc.data import load_fashion_mnist

    model = tf.keras.models.load_model(os.path.join(run_dir, "model.keras"))
    data = load_fashion_mnist(test_limit=300, train_limit=10)
    logits = model.predict(data.x_test, verbose=0)
    acc = float(np.mean(np.argmax(logits, 1) == data.y_test))
    loss = float(np.mean(tf.keras.losses.sparse_categorical_crossentropy(data.y_test, logits, from_logits=True)))
    assert acc == s["final_test_accuracy"] and abs(loss - s["final_test_loss"]) < 1e-4


@pytest.mark.mpi
@pytest.mark.parametrize("cases,np_,msgs", [
    (["world1"], 1, ["LayoutError: the Hourglass layout needs at least 2 ranks"]),
    (["too_many_fc", "no_boundary"], 3, ["LayoutError: hourglass.fc_workers=2 is more than the 1 CONV ranks",
                                         "SplitError: model 'mlp' has no convolution layer"]),
])
def test_bad_layouts_fail_on_every_rank(cases, np_, msgs):
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/hourglass_bad_layout.py"] + cases, timeout=120)  # a hang times out
    assert p.returncode != 0, p.stdout + p.stderr
    for r in range(np_):
        for msg in msgs:
            assert f"hgsgc: error on rank {r}: {msg}" in p.stderr, p.stderr[-3000:]
    assert "NO ERROR" not in p.stdout


def test_phase_profile_means_per_role():
    from hgsgc.hourglass.train import phase_profile

    zero = {"conv_wait_s": 0.0, "fc_recv_wait_s": 0.0, "fc_compute_s": 0.0, "fc_apply_s": 0.0,
            "fc_send_wait_s": 0.0, "codec_s": 0.0}
    recs = [(0, "conv", {**zero, "conv_wait_s": 0.6}, [0.5, 0.5, 0.5]),       # 0.2 s/step waiting
            (1, "conv", {**zero, "conv_wait_s": 1.2}, [1.0, 1.0, 1.0, 1.0]),  # 0.3 s/step
            (2, "fc", {**zero, "fc_recv_wait_s": 0.4, "fc_compute_s": 0.2, "fc_apply_s": 0.1,
                       "fc_send_wait_s": 0.1}, [0.25, 0.25, 0.25, 0.25])]
    p = phase_profile(recs)
    assert p["conv"]["step_s"] == pytest.approx((0.5 + 1.0) / 2)
    assert p["conv"]["conv_wait_s"] == pytest.approx((0.2 + 0.3) / 2)
    assert p["conv"]["other_s"] == pytest.approx(0.75 - 0.25)
    assert p["fc"] == pytest.approx({"step_s": 0.25, "fc_recv_wait_s": 0.1, "fc_compute_s": 0.05,
                                     "fc_apply_s": 0.025, "fc_send_wait_s": 0.025, "codec_s": 0.0,
                                     "other_s": 0.05})
    assert phase_profile([(0, "conv", zero, [])]) == {}
