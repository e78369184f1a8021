"""compression.buckets: the sparse allgather split into groups, last tensors first (issue 10).

Single-process checks here (grouping, validation, exact values against a numpy reference with
error feedback, the optimizer step bit for bit against one fused payload, and the traced graph's
structure); the multi-rank checks run under mpirun with 2, 3 and 4 ranks
(tests/mpi/check_buckets.py).
"""
import numpy as np
import pytest
import tensorflow as tf

import reference as ref
from conftest import mpi_cases
from hgsgc.compression import Compression, SparseCompression
from hgsgc.compression.reducers import bucket_indices
from hgsgc.config import ConfigError, compression_from_config, load_config

SGC = "configs/fashion_mnist_sgc.yaml"
# alexnet_small's 2-bit payloads at density 0.005 (conv1 k, b, conv2 k, b, fc1 k, b, fc2 k, b, logits k, b)
ALEX = [12, 10, 207, 10, 23093, 13, 1566, 11, 32, 10]


def test_bucket_indices_groups_last_tensors_first():
    assert bucket_indices(ALEX, 1) == [list(range(10))]
    # fc1's kernel alone is 92 % of the payload: the dense layers go first, the convs last
    assert bucket_indices(ALEX, 2) == [[4, 5, 6, 7, 8, 9], [0, 1, 2, 3]]
    assert bucket_indices(ALEX, 3) == [[4, 5, 6, 7, 8, 9], [3], [0, 1, 2]]
    assert bucket_indices([5, 5, 5, 5], 2) == [[2, 3], [0, 1]]
    assert bucket_indices([5, 5, 5, 5], 4) == [[3], [2], [1], [0]]
    assert bucket_indices([5, 5, 5, 5], 9) == [[3], [2], [1], [0]]  # never an empty group
    assert bucket_indices([7], 3) == [[0]]
    assert bucket_indices([], 2) == []
    assert bucket_indices([0, 0, 0], 2) == [[2], [0, 1]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bucket_indices_refuses_bad_counts(bad):
    with pytest.raises(ValueError, match="buckets must be an integer >= 1"):
        bucket_indices([1, 2], bad)
    with pytest.raises(ValueError, match="buckets must be an integer >= 1"):
        SparseCompression(0.01, buckets=bad)


def test_buckets_need_the_flat_allgather():
    with pytest.raises(ValueError, match="needs hierarchy='allgather'"):
        Compression.sgc(0.01, hierarchy="tree", buckets=2)
    assert Compression.sgc(0.01, hierarchy="tree").buckets == 1
    assert Compression.topk(0.01, buckets=3).buckets == 3
    assert Compression.dgc(0.01, buckets=2).buckets == 2


def test_config_key_compression_buckets():
    cfg = load_config(SGC, ["compression.delay=1", "compression.buckets=2"])
    assert compression_from_config(cfg.compression).buckets == 2
    assert compression_from_config(load_config(SGC, []).compression).buckets == 1
    for over, msg in ((["compression.buckets=0"], "must be an integer >= 1"),
                      (["compression.buckets=2", "compression.hierarchy=tree"], "hierarchy=allgather"),
                      (["compression.buckets=2", "compression.method=powersgd", "compression.delay=1",
                        "compression.density=null"],
                       "method topk, sgc or dgc")):
        with pytest.raises(ConfigError, match=f"compression.buckets=.*{msg}"):
            load_config(SGC, over)


SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (1,), (6, 50), (90, 7)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]


def _inputs(seed):
    g = np.random.default_rng(seed)
    return [g.standard_normal(s).astype(np.float32) for s in SHAPES]


def _ef_reference(steps, density):
    """One rank, fp32 values, exact top-k, error feedback: a = x + e; sent = a on top-k(|a|);
    e = a - sent; the average of one rank is what it sent."""
    e = [np.zeros(s, np.float32) for s in SHAPES]
    outs = []
    for seed in steps:
        xs, out = _inputs(seed), []
        for i, x in enumerate(xs):
            a = (x + e[i]).ravel()
            idx = ref.topk_indices(a, ref.k_for(a.size, density))
            sent = np.zeros_like(a)
            sent[idx] = a[idx]
            e[i] = (a - sent).reshape(x.shape)
            out.append(sent.reshape(x.shape))
        outs.append(out)
    return outs, e


@pytest.mark.parametrize("buckets", [1, 2, 3, 6, 10])
def test_bucketed_exchange_equals_numpy_error_feedback_exactly(buckets):
    import horovod.tensorflow as hvd

    from hgsgc.communicator import Exchanger

    hvd.init()  # one process: the allgathers are local, the algebra is the same
    density, steps = 0.05, (1, 2, 3)
    ex = Exchanger(Compression.topk(density, bits=32, selector="exact", buckets=buckets))
    want, e = _ef_reference(steps, density)
    for seed, w in zip(steps, want):
        out = ex.exchange([tf.constant(x) for x in _inputs(seed)], NAMES)
        for o, x in zip(out, w):
            np.testing.assert_array_equal(o.numpy(), x)
    for nm, r in zip(NAMES, e):
        np.testing.assert_array_equal(ex.memory.residual(nm, (r.size,)).numpy(), r.ravel())
    st = ex.stats.snapshot()
    groups = len(bucket_indices([ref.payload_length(int(np.prod(s)), ref.k_for(int(np.prod(s)), density), 32,
                                                    ref.DEFAULT_CODING)
                                 for s in SHAPES], buckets))
    P = sum(ref.payload_length(int(np.prod(s)), ref.k_for(int(np.prod(s)), density), 32, ref.DEFAULT_CODING)
            for s in SHAPES)
    assert st["exchanges"] == 3 and st["payload_bytes"] == 3 * P and st["messages"] == 3 * groups
    assert st["bytes_sent"] == 0  # one rank: (n - 1) P


@pytest.mark.parametrize("bits", [2, 32])
def test_bucketed_2bit_sgc_is_bit_identical_to_one_payload(bits):
    """SGC's default path (sampled selector, 2-bit values, fused error feedback kernel)."""
    import horovod.tensorflow as hvd

    from hgsgc.communicator import Exchanger

    hvd.init()
    fused = Exchanger(Compression.sgc(0.05, bits=bits))
    split = Exchanger(Compression.sgc(0.05, bits=bits, buckets=3))
    for seed in (4, 5, 6):
        xs = [tf.constant(x) for x in _inputs(seed)]
        for a, b in zip(fused.exchange(xs, NAMES), split.exchange(xs, NAMES)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    for nm, s in zip(NAMES, SHAPES):
        m = (int(np.prod(s)),)
        np.testing.assert_array_equal(fused.memory.residual(nm, m).numpy(), split.memory.residual(nm, m).numpy())


def _train(buckets, delay=1, steps=5):
    import horovod.tensorflow as hvd

    import hgsgc
    from hgsgc.models import build_model

    hvd.init()
    model = build_model("tiny", seed=3)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                      compression=Compression.sgc(0.05, delay=delay, buckets=buckets))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    g = np.random.default_rng(11)
    for _ in range(steps):
        step(g.random((8, 28, 28, 1)).astype(np.float32), g.integers(0, 10, 8).astype(np.int32))
    return [v.numpy() for v in model.trainable_variables], opt.hgsgc_stats.snapshot()


@pytest.mark.parametrize("delay", [1, 2])
def test_optimizer_with_buckets_is_bit_identical_to_one_payload(delay):
    w1, s1 = _train(1, delay)
    w2, s2 = _train(2, delay)
    for a, b in zip(w1, w2):
        np.testing.assert_array_equal(a, b)
    assert {k: v for k, v in s1.items() if k != "messages"} == {k: v for k, v in s2.items() if k != "messages"}
    assert s2["messages"] == 2 * s1["messages"] and s1["messages"] == s1["exchanges"]


def test_costs_count_one_message_per_group():
    import horovod.tensorflow as hvd

    from hgsgc.communicator import Exchanger

    hvd.init()
    # the fixed coding, pinned: the sizes and groups below are worked out by hand for it
    sizes = [ref.payload_length(int(np.prod(s)), ref.k_for(int(np.prod(s)), 0.05), 2, "fixed") for s in SHAPES]
    assert sizes == [106, 10, 15, 10, 29, 56] and bucket_indices(sizes, 3) == [[4, 5], [0, 1, 2, 3]]
    one = Exchanger(Compression.sgc(0.05, index_coding="fixed")).costs(SHAPES + [(0,)])
    ex = Exchanger(Compression.sgc(0.05, buckets=3, index_coding="fixed"))
    three = ex.costs(SHAPES + [(0,)])
    assert three["messages"] == 2 * one["messages"] == 2 and three["rounds"] == 2 * one["rounds"]
    ex.exchange([tf.constant(x) for x in _inputs(7)], NAMES)
    assert ex.stats.snapshot()["messages"] == 2
    assert {k: v for k, v in three.items() if k not in ("messages", "rounds")} == \
        {k: v for k, v in one.items() if k not in ("messages", "rounds")}


# ------------------------------------------------------------------ under mpirun: 2, 3, 4 ranks
MPI_CASES = mpi_cases("tests/mpi/check_buckets.py", ranks=[2, 3, 4], timeout=300)


@pytest.fixture(scope="module", params=[2, 3, 4])
def result(request, mpi_batch):
    return mpi_batch.result(request.param, "tests/mpi/check_buckets.py")


@pytest.mark.mpi
def test_buckets_equal_the_numpy_error_feedback_average_on_every_rank(result):
    """fp32 values, exact top-k: outputs and residuals equal numpy bit for bit for 1, 3 and 7
    buckets (1, 2 and 4 allgathers of these tensors); bytes as one payload, one message per group."""
    n = result["size"]
    for r in result["ranks"]:
        P = r["P"]
        for b, groups in (("b1", 1), ("b3", 2), ("b7", 4)):
            got = r[b]
            assert got["max_err"] == 0.0 and got["residual_err"] == 0.0, (b, got)
            assert got["groups"] == groups == got["costs_messages"]
            st = got["stats"]
            assert st["exchanges"] == 3 and st["messages"] == 3 * groups
            assert st["payload_bytes"] == 3 * P and st["bytes_sent"] == st["bytes_received"] == 3 * (n - 1) * P


@pytest.mark.mpi
def test_buckets_keep_sgc_bit_identical_and_models_identical_across_ranks(result):
    for r in result["ranks"]:
        assert r["sgc_fused_vs_buckets_diff"] == 0.0
        o = r["optimizer"]
        assert o["spread_b1"] == 0.0 and o["spread_b2"] == 0.0 and o["b1_vs_b2"] == 0.0
        # tiny: conv1, conv2, fc1, logits; group 0 = the dense layers, group 1 = the convolutions
        assert o["allgathers"] == 2 and o["conv_grads"] == 2
        assert o["conv_grads_before_each_allgather"] == [0, 2]  # the first one need not wait for them
