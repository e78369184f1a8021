"""compression.index_coding: fixed-width vs Elias-Fano coded payload indices (elias_fano is the
default of every sparse setting since session 10; fixed stays selectable).

Checks against a numpy Elias-Fano coder written here (independent of hgsgc's): the index section
bytes of the pure-TF reference (``wire.encode``) and of the C++ kernels (``sparse_encode``, the
fused ``compress`` / ``compress_into``, ``decode_accumulate``) are the numpy bytes, the lengths are
the formula, decoding gives the indices back; SGC trains to bit-identical weights with either
coding (single process here; 2 and 3 ranks, allgather and tree, in tests/mpi/check_index_coding.py).
"""
import math

import numpy as np
import pytest
import tensorflow as tf

import reference as ref
from hgsgc import ops
from hgsgc.compression import Compression, SparseCompression, kernels, wire
from hgsgc.config import ConfigError, compression_from_config, load_config

EF = "elias_fano"


# ------------------------------------------------------------------ numpy reference
def np_low_bits(numel, k):
    """Largest l with k 2^l <= numel, i.e. floor(log2(numel / k)) (by doubling, no logs)."""
    low = 0
    while k << (low + 1) <= numel:
        low += 1
    return low


def np_pack(values, width):
    """values (ints) of ``width`` bits each, LSB first, into bytes (little bit order)."""
    if width == 0 or len(values) == 0:
        return np.zeros(0, np.uint8)
    bits = ((np.asarray(values, np.uint64)[:, None] >> np.arange(width, dtype=np.uint64)) & 1).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little")


def np_ef_encode(idx, numel):
    """Elias-Fano index section: low l bits packed, then the unary high bit vector (H bits)."""
    k = len(idx)
    low = np_low_bits(numel, k)
    high_bits = k + ((numel - 1) >> low)
    unary = np.zeros(high_bits, np.uint8)
    unary[(np.asarray(idx, np.int64) >> low) + np.arange(k)] = 1
    return np.concatenate([np_pack(np.asarray(idx, np.int64) & ((1 << low) - 1), low),
                           np.packbits(unary, bitorder="little")])


def np_ef_decode(section, numel, k):
    low = np_low_bits(numel, k)
    nlow = (k * low + 7) // 8
    unary = np.unpackbits(section[nlow:], bitorder="little")
    pos = np.flatnonzero(unary)[:k]
    lows = np.zeros(k, np.int64)
    if low:
        lb = np.unpackbits(section[:nlow], bitorder="little")[:k * low].reshape(k, low)
        lows = (lb.astype(np.int64) << np.arange(low)).sum(1)
    return ((pos - np.arange(k)) << low) | lows


def np_fixed_encode(idx, numel):
    return np_pack(idx, max(1, (numel - 1).bit_length()))


def index_section(payload, k, bits, nbytes):
    off = 8 if bits == 2 else 0
    return np.asarray(payload)[off:off + nbytes]


def cases():
    rng = np.random.default_rng(5)
    out = [(1, np.array([0])), (2, np.array([1])), (2, np.array([0, 1])), (5, np.arange(5)),
           (1000, np.array([0])), (1000, np.array([999])), (1000, np.array([0, 999])),
           (1000, np.arange(1000)), (1000, np.arange(400, 900)),  # k = numel; a run, l = 0
           (1001, np.arange(0, 1001, 2)), (4096, np.arange(4096 - 64, 4096)),  # run at the end
           (1 << 20, np.array([0, 1, 2, 3, (1 << 20) - 1])), (3, np.array([0, 2]))]
    for numel, k in [(7, 3), (100, 37), (1000, 17), (12345, 600), (65537, 65), (300_001, 1500),
                     (1_605_632, 8029)]:
        out.append((numel, np.sort(rng.choice(numel, k, replace=False))))
    return [(n, i.astype(np.int32)) for n, i in out]


CASES = cases()


# ------------------------------------------------------------------ the formula and the coders
def test_low_bits_and_lengths_follow_the_formula():
    for numel, idx in CASES:
        k = len(idx)
        low = np_low_bits(numel, k)
        assert wire.ef_low_bits(numel, k) == low == max(0, math.floor(math.log2(numel / k) + 1e-12))
        want = math.ceil(k * low / 8) + math.ceil((k + ((numel - 1) >> low)) / 8)
        assert wire.index_bytes(numel, k, EF) == want == len(np_ef_encode(idx, numel))
        assert wire.payload_length(numel, k, 2, EF) == 8 + want + math.ceil(k / 4)
        assert wire.payload_length(numel, k, 32, EF) == want + 4 * k
        assert wire.payload_length(numel, k, 2) == ref.payload_length(numel, k, 2, "fixed")  # fixed unchanged
        assert wire.payload_length(numel, k, 2, EF) == ref.payload_length(numel, k, 2, EF)
    # alexnet_small's fc1 kernel (3136 x 512 = 1,605,632 entries) at density 0.005: k = 8029,
    # l = 7: ceil(8029 * 7 / 8) = 7026 low bytes + ceil((8029 + 12543) / 8) = 2572 high bytes
    assert ref.k_for(1_605_632, 0.005) == 8029 and wire.ef_low_bits(1_605_632, 8029) == 7
    assert wire.index_bytes(1_605_632, 8029, EF) == 7026 + 2572
    assert wire.index_bytes(1_605_632, 8029, "fixed") == 21077  # 21 bits each
    assert wire.payload_length(1_605_632, 8029, 2, EF) == 8 + 9598 + 2008 == 11614
    assert wire.payload_length(5, 0, 2, EF) == 0 and wire.index_bytes(5, 0, EF) == 0
    with pytest.raises(ValueError, match="index_coding must be one of"):
        wire.payload_length(10, 2, 2, "delta")
    # never more than 1 byte longer than fixed width, and shorter from k = 8 on (docs/compression.md)
    for numel in range(1, 257):
        for k in range(1, numel + 1):
            d = wire.index_bytes(numel, k, EF) - wire.index_bytes(numel, k)
            assert d <= 1 and (k < 8 or d < 0), (numel, k, d)


@pytest.mark.parametrize("bits", [2, 32])
def test_reference_and_kernel_encode_equal_numpy_and_decode_back(bits):
    rng = np.random.default_rng(bits)
    for numel, idx in CASES:
        k = len(idx)
        vals = rng.standard_normal(k).astype(np.float32)
        want = np_ef_encode(idx, numel)
        np.testing.assert_array_equal(np_ef_decode(want, numel, k), idx)
        p_fixed, s_fixed = wire.encode(tf.constant(idx), tf.constant(vals), numel, bits)
        np.testing.assert_array_equal(index_section(p_fixed, k, bits, wire.index_bytes(numel, k)),
                                      np_fixed_encode(idx, numel))
        payloads = []
        for backend in ("reference", "custom"):
            p, s = kernels.sparse_encode(idx, vals, numel, bits, backend=backend, index_coding=EF)
            assert p.shape == (wire.payload_length(numel, k, bits, EF),)
            np.testing.assert_array_equal(index_section(p, k, bits, len(want)), want)
            np.testing.assert_array_equal(s.numpy(), s_fixed.numpy())  # the values are untouched
            payloads.append(p.numpy())
        np.testing.assert_array_equal(payloads[0], payloads[1])
        # the rest of the payload is the fixed payload's, the index section swapped
        P = p_fixed.numpy()
        off, fi = (8 if bits == 2 else 0), wire.index_bytes(numel, k)
        np.testing.assert_array_equal(np.concatenate([P[:off], want, P[off + fi:]]), payloads[0])
        i2, v2 = wire.decode(tf.constant(payloads[0]), numel, k, bits, EF)
        np.testing.assert_array_equal(i2.numpy(), idx)
        np.testing.assert_array_equal(v2.numpy(), s_fixed.numpy())


@pytest.mark.parametrize("bits", [2, 32])
def test_decode_accumulate_kernel_equals_reference_and_the_fixed_coding(bits):
    """3 ranks' payloads with different index sets at an offset: the EF sum equals the reference's
    and the fixed coding's bit for bit, and numpy's rank-order sum."""
    rng = np.random.default_rng(10 + bits)
    for numel, idx in CASES:
        k = len(idx)
        sets = [idx] + [np.sort(rng.choice(numel, k, replace=False)).astype(np.int32) for _ in range(2)]
        vals = [rng.standard_normal(k).astype(np.float32) for _ in sets]
        rows = {}
        for coding in ("fixed", EF):
            ps = [kernels.sparse_encode(i, v, numel, bits, backend="custom", index_coding=coding)
                  for i, v in zip(sets, vals)]
            rows[coding] = np.stack([np.concatenate([[7, 7, 7], p.numpy(), [9]]) for p, _ in ps])
            sent = [s.numpy() for _, s in ps]
        want = np.zeros(numel, np.float32)
        for i, s in zip(sets, sent):
            want[i] += s
        got = {}
        for coding in ("fixed", EF):
            for backend in ("custom", "reference"):
                got[coding, backend] = kernels.decode_accumulate(
                    tf.constant(rows[coding], tf.uint8), numel, k, bits, offset=3, backend=backend,
                    index_coding=coding).numpy()
                np.testing.assert_array_equal(got[coding, backend], want)


def test_decode_accumulate_refuses_a_malformed_elias_fano_payload():
    numel, k = 1000, 10
    p, _ = kernels.sparse_encode(np.arange(k, dtype=np.int32), np.ones(k, np.float32), numel, 32,
                                 backend="custom", index_coding=EF)
    bad = p.numpy().copy()
    low_bytes = (k * wire.ef_low_bits(numel, k) + 7) // 8
    bad[low_bytes:wire.index_bytes(numel, k, EF)] = 0  # no high bits at all
    with pytest.raises(tf.errors.InvalidArgumentError, match="fewer than k = 10 set bits"):
        kernels.decode_accumulate(tf.constant(bad[None, :]), numel, k, 32, backend="custom",
                                  index_coding=EF)
    with pytest.raises(ValueError, match="index_coding must be one of"):
        kernels.decode_accumulate(tf.constant(bad[None, :]), numel, k, 32, index_coding="delta")


@pytest.mark.parametrize("bits", [2, 32])
def test_fused_compress_kernels_equal_the_reference_and_select_the_same_entries(bits):
    rng = np.random.default_rng(3)
    for numel, k in [(1, 1), (37, 37), (37, 20), (5000, 1), (5000, 25), (200_003, 1000)]:
        g = rng.standard_normal(numel).astype(np.float32)
        r = rng.standard_normal(numel).astype(np.float32) * 0.1
        fixed, _ = kernels.compress(tf.constant(g), tf.constant(r), k, bits, seed=5, backend="custom")
        p_c, res_c = kernels.compress(tf.constant(g), tf.constant(r), k, bits, seed=5, backend="custom",
                                      index_coding=EF)
        p_r, res_r = kernels.compress(tf.constant(g), tf.constant(r), k, bits, seed=5,
                                      backend="reference", index_coding=EF)
        np.testing.assert_array_equal(p_c.numpy(), p_r.numpy())
        np.testing.assert_array_equal(res_c.numpy(), res_r.numpy())
        assert p_c.shape == (wire.payload_length(numel, k, bits, EF),)
        i_f, v_f = wire.decode(fixed, numel, k, bits)
        i_e, v_e = wire.decode(p_c, numel, k, bits, EF)
        np.testing.assert_array_equal(i_f.numpy(), i_e.numpy())
        np.testing.assert_array_equal(v_f.numpy(), v_e.numpy())
        var = tf.Variable(r)
        p_v = kernels.compress_into(tf.constant(g), var, k, bits, seed=5, backend="custom", index_coding=EF)
        np.testing.assert_array_equal(p_v.numpy(), p_r.numpy())
        np.testing.assert_array_equal(var.numpy(), res_r.numpy())


# ------------------------------------------------------------------ settings, config, byte counts
def test_setting_config_and_payload_bytes():
    shapes = [(40, 30), (17,), (3, 3, 2, 5), (90, 7), (1_758_400,)]
    s = Compression.sgc(0.005, index_coding=EF)
    fixed = Compression.sgc(0.005, index_coding="fixed")
    assert s.index_coding == EF and fixed.index_coding == "fixed"
    assert Compression.topk(0.01, index_coding=EF).codec().index_coding == EF
    assert Compression.dgc(0.01, index_coding=EF).index_coding == EF
    assert Compression.topk(0.01, index_coding="fixed").codec().index_coding == "fixed"
    want = sum(wire.payload_length(math.prod(sh), ref.k_for(math.prod(sh), 0.005), 2, EF) for sh in shapes)
    assert s.payload_bytes(shapes) == want
    assert s.payload_bytes(shapes) < fixed.payload_bytes(shapes)
    assert fixed.payload_bytes(shapes) == sum(
        ref.payload_length(math.prod(sh), ref.k_for(math.prod(sh), 0.005), 2, "fixed") for sh in shapes)
    from hgsgc import perfmodel  # hgsgc plan / the performance model charge the same bytes

    assert perfmodel.traffic(s, shapes).collectives == (("allgather", want),)
    assert sum(perfmodel.allgather_buckets(Compression.sgc(0.005, buckets=2, index_coding=EF), shapes)) == want
    with pytest.raises(ValueError, match="compression.index_coding must be one of"):
        SparseCompression(0.01, index_coding="delta")
    cfg = load_config("configs/fashion_mnist_sgc.yaml", ["compression.index_coding=elias_fano"])
    assert compression_from_config(cfg.compression).index_coding == EF
    cfg = load_config("configs/fashion_mnist_sgc.yaml", ["compression.index_coding=fixed"])
    assert compression_from_config(cfg.compression).index_coding == "fixed"
    with pytest.raises(ConfigError, match="compression.index_coding.*elias_fano.*fixed"):
        load_config("configs/fashion_mnist_sgc.yaml", ["compression.index_coding=delta"])
    with pytest.raises(ConfigError, match="compression.index_coding.*needs method topk, sgc or dgc"):
        load_config("configs/fashion_mnist_sgc.yaml", ["compression.method=none", "compression.delay=1",
                                                       "compression.density=null",
                                                       "compression.index_coding=elias_fano"])


def _train(index_coding, steps=4):
    import horovod.tensorflow as hvd

    import hgsgc
    from hgsgc.models import build_model
    from hgsgc.train import byte_figures

    hvd.init()
    model = build_model("tiny", seed=3)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                      compression=Compression.sgc(0.05, index_coding=index_coding))
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
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    grad_bytes = 4 * sum(math.prod(s) for s in shapes)
    figs = byte_figures(opt.hgsgc_stats.snapshot(), steps, 1, grad_bytes)
    return [v.numpy() for v in model.trainable_variables], figs, shapes, grad_bytes


def test_sgc_trains_bit_identically_with_elias_fano_and_counts_its_bytes():
    w_f, f_f, shapes, grad_bytes = _train("fixed")
    w_e, f_e, _, _ = _train(EF)
    for a, b in zip(w_f, w_e):
        np.testing.assert_array_equal(a, b)
    for figs, coding in ((f_f, "fixed"), (f_e, EF)):
        P = sum(wire.payload_length(math.prod(s), ref.k_for(math.prod(s), 0.05), 2, coding) for s in shapes)
        assert figs["payload_bytes_per_step_per_rank"] == P
        assert figs["compression_ratio"] == grad_bytes / P
    assert f_e["payload_bytes_per_step_per_rank"] < f_f["payload_bytes_per_step_per_rank"]


# ------------------------------------------------------------------ under mpirun: 2 and 3 ranks
@pytest.fixture(scope="module", params=[2, 3])
def result(request):
    """``conftest.mpi_result`` with waiting ranks yielding their core (Open MPI busy-polls
    otherwise; on the 2 shared cores that multiplies the wall time, tests/test_state9.py)."""
    import json

    from conftest import mpirun

    p = mpirun(request.param, ["tests/mpi/check_index_coding.py"], timeout=240,
               env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["size"] == request.param and len(out["ranks"]) == request.param
    return out


@pytest.mark.mpi
def test_elias_fano_training_is_bit_identical_on_every_rank(result):
    """SGC delay 1 (allgather, 2-bit) and SGC over hierarchy=tree: the weights after 3 steps
    with elias_fano equal those with fixed coding, on every rank, and are equal across ranks;
    bytes sent are (n - 1) P per exchange with P by the Elias-Fano formula."""
    n = result["size"]
    for r in result["ranks"]:
        for h in ("allgather", "tree"):
            got = r[h]
            assert got["fixed_vs_ef"] == 0.0 and got["spread_fixed"] == 0.0 and got["spread_ef"] == 0.0, (h, got)
            st_f, st_e = got["stats_fixed"], got["stats_ef"]
            assert st_e["payload_bytes"] == 3 * got["P_ef"] and st_f["payload_bytes"] == 3 * got["P_fixed"]
            assert got["P_ef"] < got["P_fixed"]
            if h == "allgather":
                assert st_e["bytes_sent"] == 3 * (n - 1) * got["P_ef"]
                assert st_f["bytes_sent"] == 3 * (n - 1) * got["P_fixed"]
            else:  # the tree sends whole payloads: bytes scale with P
                assert st_e["bytes_sent"] * got["P_fixed"] == st_f["bytes_sent"] * got["P_ef"]
        node = r["node"]  # Exchanger, hierarchy=node on uneven emulated hosts, 3 exchanges
        assert node["fixed_vs_ef"] == 0.0, node
        assert node["payload_fixed"] == node["P_fixed"] and node["payload_ef"] == node["P_ef"] < node["P_fixed"]


@pytest.mark.parametrize("hierarchy", ["allgather", "tree"])
def test_the_planner_measures_the_decode_of_the_coding_it_plans(monkeypatch, hierarchy):
    """perfmodel.measure_compression_s (hgsgc plan's per-payload decode cost) decodes payloads
    in the setting's index coding, on the exchange's own path (since session 14): the
    allgather's decode-and-add kernel, the tree's merge round (hierarchy.merge_received)."""
    from hgsgc import perfmodel

    seen = []
    if hierarchy == "allgather":
        real = kernels.decode_accumulate

        def spy(*a, **k):
            seen.append(k.get("index_coding", "fixed"))
            return real(*a, **k)
        mod, name = kernels, "decode_accumulate"
    else:
        from hgsgc import hierarchy as hier

        real = hier.merge_received

        def spy(agg, received, lay):
            seen.append(lay.coding)
            return real(agg, received, lay)
        mod, name = hier, "merge_received"

    monkeypatch.setattr(mod, name, spy)
    out = perfmodel.measure_compression_s(Compression.sgc(0.05, index_coding=EF, hierarchy=hierarchy),
                                          [(40, 30), (90, 7)], reps=1)
    # the allgather's figure is a slope between two timings of tiny tensors here: 0 when noise wins
    assert out["per_payload_s"] >= 0 and seen and set(seen) == {EF}
