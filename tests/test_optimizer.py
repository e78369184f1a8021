"""Single-process tests of DistributedOptimizer / DistributedGradientTape (Horovod size 1)."""
import numpy as np
import pytest
import tensorflow as tf

import reference as ref

import horovod.tensorflow as hvd  # noqa: E402

hvd.init()
import hgsgc  # noqa: E402


def _run(opt, grads_seq, w0):
    v = tf.Variable(w0)
    for g in grads_seq:
        opt.apply_gradients([(tf.constant(g), v)])
    return v.numpy()


def test_none_equals_plain_sgd():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(50).astype(np.float32)
    gs = [rng.standard_normal(50).astype(np.float32) for _ in range(4)]
    plain = _run(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), gs, w0)
    ours = _run(hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)), gs, w0)
    np.testing.assert_allclose(ours, plain, rtol=1e-6)


def test_topk_error_feedback_matches_numpy():
    """Top-k (fp32) + error feedback + plain SGD on one rank against a numpy reference."""
    rng = np.random.default_rng(1)
    n, k, lr = 40, 4, 0.1
    w0 = rng.standard_normal(n).astype(np.float32)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(lr),
                                      compression=hgsgc.Compression.topk(k / n))
    got = _run(opt, gs, w0)
    w, r = w0.copy(), np.zeros(n, np.float32)
    for g in gs:
        a = g + r
        idx = ref.topk_indices(a, k)
        sent = np.zeros(n, np.float32)
        sent[idx] = a[idx]
        r = a - sent
        w = w - lr * sent
    np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt.hgsgc_state()["residuals"][opt.hgsgc_exchanger.memory.names()[0]], r,
                               rtol=1e-6, atol=1e-7)


def _dgc_reference(w0, gs, k, lr, m, masking):
    """Numpy DGC step (Lin et al. 2018, Alg. 1): velocity ``u = m u + g``, top-k of ``v + u`` sent,
    residual ``v`` keeps the rest; with ``masking`` the sent entries of ``u`` are cleared.
    Returns the weights, the sum of the sent updates, the sum of the velocities, the residual."""
    n = w0.size
    w, u, v = w0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    applied, us = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for g in gs:
        u = m * u + g
        us += u
        a = v + u
        idx = ref.topk_indices(a, k)
        sent = np.zeros(n, np.float32)
        sent[idx] = a[idx]
        v = a - sent
        if masking:
            u[idx] = 0.0                                 # momentum factor masking
        applied += sent
        w = w - lr * sent
    return w, applied, us, v


@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_matches_dgc_reference(masking):
    """DGC (Lin et al. 2018, Alg. 1 with momentum correction) on one rank, with factor masking and
    without it (``momentum_masking=False``: the velocity is kept whole, so every accumulated
    ``u_t`` is applied once, less the residual left)."""
    rng = np.random.default_rng(2 if masking else 4)
    n, k, lr, m = 30, 3, 0.05, 0.9
    w0 = rng.standard_normal(n).astype(np.float32)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
    opt = hgsgc.DistributedOptimizer(
        tf.keras.optimizers.legacy.SGD(lr, momentum=m),
        compression=hgsgc.Compression.sgc(k / n, bits=32, momentum_correction=True, momentum_masking=masking))
    assert opt.get_config()["momentum"] == 0.0          # momentum moved before sparsification
    got = _run(opt, gs, w0)
    w, applied, us, v = _dgc_reference(w0, gs, k, lr, m, masking=masking)
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    if not masking:
        np.testing.assert_allclose(applied, us - v, rtol=1e-5, atol=1e-5)  # sum of u_t applied, less the residual


def test_momentum_correction_without_masking_at_density_one_is_momentum_sgd():
    """At density 1 nothing stays in the residual: without masking the step is momentum SGD
    (with masking it would be SGD without momentum)."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(40).astype(np.float32)
    gs = [rng.standard_normal(40).astype(np.float32) for _ in range(5)]
    plain = _run(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), gs, w0)
    ours = _run(hgsgc.DistributedOptimizer(
        tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
        compression=hgsgc.Compression.sgc(1.0, bits=32, momentum_correction=True, momentum_masking=False)), gs, w0)
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)
    masked = _run(hgsgc.DistributedOptimizer(
        tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
        compression=hgsgc.Compression.sgc(1.0, bits=32, momentum_correction=True)), gs, w0)
    np.testing.assert_allclose(masked, _run(tf.keras.optimizers.legacy.SGD(0.1), gs, w0), rtol=1e-5, atol=1e-6)


def test_momentum_masking_off_needs_momentum_correction():
    with pytest.raises(ValueError, match="momentum_masking=False applies to momentum correction only"):
        hgsgc.Compression.sgc(0.1, momentum_masking=False)
    with pytest.raises(ValueError, match="momentum_masking must be True or False"):
        hgsgc.Compression.sgc(0.1, momentum_correction=True, momentum_masking="no")


def test_pending_sync_uses_the_density_set_after_it_was_first_traced():
    """Delay > 1 with a warm-up of sparsity: ``hgsgc_synchronize`` (the sync before evaluating)
    must send the payload of the density in force, not the one of its first trace (a bug: every
    end-of-epoch sync of a speech run kept the warm-up's density 0.25, 8.7x the bytes)."""
    rng = np.random.default_rng(6)
    shapes = [(50, 40), (40,)]
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                      compression=hgsgc.Compression.sgc(0.25, delay=4))
    vs = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    stats = opt.hgsgc_exchanger.stats.vars
    for density in (0.25, 0.01, 0.05):
        opt.hgsgc_set_density(density)
        before = int(stats["payload_bytes"].numpy())
        for _ in range(2):                               # 2 local steps, no sync (delay 4)
            opt.apply_gradients([(tf.constant(rng.standard_normal(s).astype(np.float32)), v)
                                 for s, v in zip(shapes, vs)])
        assert opt.hgsgc_synchronize(vs) is True
        want = hgsgc.Compression.sgc(density, delay=4).payload_bytes(shapes)
        assert int(stats["payload_bytes"].numpy()) - before == want, density


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="legacy"):
        hgsgc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), backward_passes_per_step=2)
    with pytest.raises(ValueError, match="op must be"):
        hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), op=hvd.Sum)
    with pytest.raises(ValueError, match="momentum"):
        hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.Adam(0.1),
                                   compression=hgsgc.Compression.sgc(0.1, momentum_correction=True))
    with pytest.raises(ValueError, match="delay"):
        hgsgc.Compression.sgc(0.1, delay=2, momentum_correction=True)
    with pytest.raises(TypeError, match="compression"):
        hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), compression="fast")
    with pytest.raises(ValueError, match="delay"):
        with tf.GradientTape() as tape:
            pass
        hgsgc.DistributedGradientTape(tape, compression=hgsgc.Compression.sgc(0.1, delay=2))


def test_horovod_compression_objects_accepted():
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), compression=hvd.Compression.fp16)
    assert opt.hgsgc_exchanger.compression == hgsgc.Compression.fp16


def test_delay_state_round_trip():
    rng = np.random.default_rng(3)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                      compression=hgsgc.Compression.sgc(0.2, delay=3))
    v = tf.Variable(rng.standard_normal(20).astype(np.float32))
    for _ in range(4):
        opt.apply_gradients([(tf.constant(rng.standard_normal(20).astype(np.float32)), v)])
    st = opt.hgsgc_state()
    assert st["local_step"] == 4 and len(st["anchors"]) == 1 and len(st["residuals"]) == 1
    assert opt.hgsgc_synchronize([v]) is True           # the pending sync (4 % 3 != 0) runs
    np.testing.assert_array_equal(opt.hgsgc_state()["anchors"][0], v.numpy())
    assert opt.hgsgc_synchronize([v]) is False          # nothing pending any more


def test_tape_inside_tf_function_keeps_compression_state():
    """Horovod's TF2 pattern: a new DistributedGradientTape per step inside a tf.function."""
    for comp in (hgsgc.Compression.powersgd(rank=1), hgsgc.Compression.terngrad(),
                 hgsgc.Compression.none):
        w = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0)

        seen = []

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w)
            tape = hgsgc.DistributedGradientTape(tape, compression=comp)
            g = tape.gradient(loss, [w])[0]
            seen.append(tape.exchanger)
            return g

        g1 = step()
        g2 = step()
        ex1 = seen[0]
        assert all(e is ex1 for e in seen) and ex1.stats.snapshot()["exchanges"] == 2
        method = comp.to_dict()["method"]
        if method == "powersgd":  # rank-1 approximation + error feedback of 2 w
            assert ex1.factor_state() and ex1.memory.names() == [w.name]
            m = 2 * w.numpy()
            np.testing.assert_allclose(ex1.memory.residual(w.name, [4, 3]).numpy()
                                       + g1.numpy() + g2.numpy(), 2 * m, rtol=1e-5, atol=1e-5)
        elif method == "none":
            np.testing.assert_allclose(g2.numpy(), 2 * w.numpy(), rtol=1e-6)


def test_local_clip_mixed_dtypes_matches_formula():
    from hgsgc.optimizer import local_clip

    comp = hgsgc.Compression.dgc(0.1, local_clip_norm=1.0)
    gs = [tf.constant([3.0, 4.0], tf.float16), tf.constant([[12.0]]), None, tf.constant([5], tf.int32)]
    out = local_clip(gs, comp, 4)  # clip norm 1 / sqrt(4) = 0.5 on ||(3, 4, 12)|| = 13
    assert out[2] is None and out[3] is gs[3] and out[0].dtype == tf.float16
    np.testing.assert_allclose(out[0].numpy(), np.array([3, 4]) * 0.5 / 13, rtol=1e-3)
    np.testing.assert_allclose(out[1].numpy(), [[12 * 0.5 / 13]], rtol=1e-6)
    small = local_clip([tf.constant([0.1, 0.1])], comp, 4)  # norm below the clip: unchanged
    np.testing.assert_array_equal(small[0].numpy(), np.float32([0.1, 0.1]))


def test_powersgd_factors_in_state_round_trip():
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                     compression=hgsgc.Compression.powersgd(rank=1))
    v = tf.Variable(np.ones((5, 4), np.float32))
    opt.apply_gradients([(tf.constant(np.arange(20, dtype=np.float32).reshape(5, 4)), v)])
    state = opt.hgsgc_state()
    assert set(state["powersgd_q"]) == {v.name} and state["powersgd_q"][v.name].shape == (4, 1)
    fresh = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                       compression=hgsgc.Compression.powersgd(rank=1))
    fresh.load_hgsgc_state(state)
    np.testing.assert_array_equal(fresh.hgsgc_exchanger.factor_state()[v.name], state["powersgd_q"][v.name])


def test_tape_keeps_separate_state_per_model_with_equal_layer_names():
    comp = hgsgc.Compression.topk(0.25)

    def model(units):
        return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(units, name="fc1")])

    a, b, c = model(8), model(8), model(2)
    x = tf.ones((3, 4))
    exchangers = []
    for m in (a, b, c, a):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x) ** 2)
        tape = hgsgc.DistributedGradientTape(tape, compression=comp)
        tape.gradient(loss, m.trainable_variables)
        exchangers.append(tape.exchanger)
    assert exchangers[0] is exchangers[3]          # the same model: the same state
    assert len({id(e) for e in exchangers[:3]}) == 3  # other models: their own, whatever the names
    assert exchangers[0].stats.snapshot()["exchanges"] == 2


def test_residual_name_collision_is_a_clear_error():
    from hgsgc.compression.memory import ResidualMemory

    mem = ResidualMemory()
    mem.residual("fc1/kernel:0", [4, 8])
    with pytest.raises(ValueError, match="share a name"):
        mem.residual("fc1/kernel:0", [4, 2])
