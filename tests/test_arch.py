"""The composable compression architecture (issue 12): the four defects it fixed, the state
tree, the one module of cost formulas. Single process (Horovod size 1)."""
import numpy as np
import pytest
import tensorflow as tf

import reference as ref

import horovod.tensorflow as hvd  # noqa: E402

hvd.init()
import hgsgc  # noqa: E402


def _plain(tree):
    """True if ``tree`` is plain nested dicts / lists of numpy arrays, ints and strings."""
    if isinstance(tree, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in tree.items())
    if isinstance(tree, list):
        return all(_plain(v) for v in tree)
    return isinstance(tree, (np.ndarray, int, str)) and not isinstance(tree, bool)


def _dgc_reference(w0, gs, k, lr, m):
    """Numpy DGC (Lin et al. 2018): momentum correction, error feedback, factor masking."""
    w, u, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for g in gs:
        u = m * u + g
        a = v + u
        idx = ref.topk_indices(a, k)
        sent = np.zeros_like(w0)
        sent[idx] = a[idx]
        v = a - sent
        u[idx] = 0.0
        w = w - lr * sent
    return w


# ---- defect 1: DGC through the tape ran top-k with clipping but no momentum correction ------------

def test_tape_dgc_does_momentum_correction_like_the_optimizer():
    rng = np.random.default_rng(5)
    n, k, lr, m = 30, 3, 0.05, 0.9
    w0 = rng.standard_normal(n).astype(np.float32)
    targets = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    comp = hgsgc.Compression.dgc(k / n, selector="exact")
    w = tf.Variable(w0)
    opt = tf.keras.optimizers.legacy.SGD(lr)  # momentum 0: the tape keeps the velocity
    gs = []
    for t in targets:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * tf.constant(t))  # gradient = t
        tape = hgsgc.DistributedGradientTape(tape, compression=comp, momentum=m)
        g = tape.gradient(loss, [w])
        opt.apply_gradients(zip(g, [w]))
        gs.append(t)
    np.testing.assert_allclose(w.numpy(), _dgc_reference(w0, gs, k, lr, m), rtol=1e-5, atol=1e-6)
    assert set(tape.hgsgc_state()) >= {"residuals", "velocity", "rng_step"}


def test_tape_dgc_without_momentum_is_refused():
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="momentum=0.9"):
        hgsgc.DistributedGradientTape(tape, compression=hgsgc.Compression.dgc(0.1))


# ---- defect 2: hgsgc_state omitted DGC's velocity and the random-number step ----------------------

def _resume_matches(comp, opt_factory, steps=3, numel=2000):
    """Train ``steps`` steps, save weights + state, take one more step; a fresh optimizer that
    loads them must take the identical step."""
    rng = np.random.default_rng(11)
    gs = [rng.standard_normal(numel).astype(np.float32) for _ in range(steps + 1)]
    opt = hgsgc.DistributedOptimizer(opt_factory(), compression=comp)
    v = tf.Variable(rng.standard_normal(numel).astype(np.float32))
    for g in gs[:steps]:
        opt.apply_gradients([(tf.constant(g), v)])
    state, w_saved = opt.hgsgc_state(), v.numpy().copy()
    assert _plain(state), state
    opt.apply_gradients([(tf.constant(gs[steps]), v)])
    fresh = hgsgc.DistributedOptimizer(opt_factory(), compression=comp)
    v2 = tf.Variable(w_saved)
    fresh.load_hgsgc_state(state)
    fresh.apply_gradients([(tf.constant(gs[steps]), v2)])
    return state, v.numpy(), v2.numpy()


def test_state_restores_dgc_velocity():
    state, cont, resumed = _resume_matches(
        hgsgc.Compression.dgc(0.01), lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9))
    assert "velocity" in state and np.any(state["velocity"][next(iter(state["velocity"]))] != 0)
    np.testing.assert_array_equal(resumed, cont)


def test_state_restores_random_number_step():
    state, cont, resumed = _resume_matches(hgsgc.Compression.terngrad(),
                                           lambda: tf.keras.optimizers.legacy.SGD(0.1))
    assert state["rng_step"] == 3 and state["stats"]["exchanges"] == 3
    np.testing.assert_array_equal(resumed, cont)


def test_random_number_step_is_not_the_byte_counter():
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                     compression=hgsgc.Compression.terngrad())
    v = tf.Variable(np.ones(8, np.float32))
    opt.apply_gradients([(tf.constant(np.arange(8, dtype=np.float32)), v)])
    opt.hgsgc_stats.reset()  # resetting the measurements leaves the algorithm's state alone
    assert opt.hgsgc_state()["rng_step"] == 1 and opt.hgsgc_stats.snapshot()["exchanges"] == 0


def test_delay_state_loaded_before_the_first_step_is_applied():
    comp = hgsgc.Compression.sgc(0.5, delay=2)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), compression=comp)
    v = tf.Variable(np.ones(6, np.float32))
    opt.apply_gradients([(tf.constant(np.ones(6, np.float32)), v)])
    state = opt.hgsgc_state()
    fresh = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), compression=comp)
    fresh.load_hgsgc_state(state)
    v2 = tf.Variable(v.numpy())
    fresh.apply_gradients([(tf.constant(np.ones(6, np.float32)), v2)])
    opt.apply_gradients([(tf.constant(np.ones(6, np.float32)), v)])  # the sync step of both
    np.testing.assert_array_equal(v2.numpy(), v.numpy())
    assert fresh.hgsgc_state()["local_step"] == opt.hgsgc_state()["local_step"] == 2


# ---- defect 3: compression.warmup_steps accepted with layout: hourglass, then ignored ---------------

def test_warmup_steps_with_hourglass_is_a_config_error():
    from hgsgc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="compression.warmup_steps"):
        load_config(None, ["layout=hourglass", "compression.method=sgc", "compression.warmup_steps=100"])
    cfg = load_config(None, ["compression.method=dgc", "compression.warmup_steps=100"])
    assert cfg.compression.warmup_steps == 100


# ---- defect 4: the FC-side conversion dropped hierarchy for topk but passed it for sgc --------------

@pytest.mark.parametrize("fc_method", ["topk", "sgc"])
def test_fc_side_keeps_hierarchy_for_every_sparse_method(fc_method):
    from hgsgc.config import load_config
    from hgsgc.hourglass.train import fc_compression_from_config

    cfg = load_config(None, ["layout=hourglass", f"hourglass.fc_method={fc_method}",
                             "compression.hierarchy=tree", "compression.method=sgc"])
    fc = fc_compression_from_config(cfg)
    assert fc.hierarchy == "tree" and fc.method == fc_method and fc.delay == 1
    assert not fc.momentum_correction and fc.local_clip_norm is None


# ---- the one module of cost formulas ------------------------------------------------------------

def test_cost_formulas():
    from hgsgc import costs

    assert costs.ring_allreduce_bytes(4, 1000) == 1500 and costs.ring_allreduce_bytes(3, 10) == 13
    assert costs.ring_allreduce_bytes_f(3, 10) == pytest.approx(40 / 3)
    assert costs.ring_allreduce_bytes(1, 1000) == 0 and costs.ring_allreduce_rounds(5) == 8
    assert costs.allgather_bytes(5, 7) == 28 and costs.allgather_rounds(5) == 3
    assert costs.dense_bytes(2, 10) == 40
    for n in range(1, 20):
        assert costs.tree_busiest_bytes(n, 10) == max(costs.tree_cost(n, r, 10)["bytes_sent"]
                                                      for r in range(n))
        assert costs.exchange_bytes(n, 10.0, "tree") == costs.tree_busiest_bytes(n, 10.0)
    with pytest.raises(ValueError, match="algorithm"):
        costs.exchange_bytes(4, 1.0, "mesh")


def test_every_setting_reports_payload_and_algorithm():
    shapes = [(30, 4), (4,), (5, 5, 3)]
    for comp, alg in ((hgsgc.Compression.none, "ring"), (hgsgc.Compression.topk(0.1), "allgather"),
                      (hgsgc.Compression.sgc(0.1, hierarchy="node"), "node"),
                      (hgsgc.Compression.terngrad(), "allgather"),
                      (hgsgc.Compression.powersgd(2), "ring"),
                      (hgsgc.Compression.efsignsgd(), "allgather")):
        assert comp.algorithm == alg
        assert comp.payload_bytes(shapes) == hgsgc.compression.codec.exchange_payload_bytes(comp, shapes)
