"""Session 11: DGC momentum correction folded into the compression kernel, ``/ n`` into the decode.

``HgsgcCompressMomentum`` (``kernels.compress_momentum_into``) does in one pass per tensor what
session 10 ran as four kernels (``HgsgcMomentumAccumulate``, ``HgsgcCompressResidual``, a one-row
``HgsgcDecodeAccumulate`` of the own payload, ``HgsgcMomentumMask``); ``HgsgcDecodeAccumulate``
takes a ``divisor`` (the average's ``sum / n``). Every result is compared on raw bits (float32
viewed as uint32: -0.0 vs +0.0 and NaN payloads count) against the pure-TF reference backend
(``sparsify`` + ``wire`` + ``tf.scatter_nd`` + TF ops), against session 10's composition of
kernels (``wrappers.FOLD_MOMENTUM = False``) and against numpy (``tests/reference.py``). The
payload byte formulas are unchanged (byte counters compared, payload lengths = the formula).
Multi-rank training (2/3/4 ranks, ``tests/mpi/check_kernels11.py``): fold vs composed vs
reference, bit for bit, and the same weights on every rank.

The kernel tests skip when the library is not built, unless HGSGC_REQUIRE_CUSTOM_OPS=1.
"""
import os

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from hgsgc import ops
from hgsgc.communicator import Exchanger
from hgsgc.compression import Compression, kernels, wire, wrappers
import reference as npref
from conftest import mpi_cases

HAVE_CUSTOM = ops.available()
REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")
pytestmark = pytest.mark.skipif(not HAVE_CUSTOM and not REQUIRE_CUSTOM,
                                reason="custom ops not built (python setup.py build_ext --inplace)")

hvd.init()


def bits_of(a):
    a = a.numpy() if tf.is_tensor(a) or isinstance(a, tf.Variable) else np.asarray(a)
    return a.astype(np.float32).view(np.uint32) if a.dtype == np.float32 else a


def assert_same(a, b, what=""):
    a, b = bits_of(a), bits_of(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} entries differ, first at {bad[:5]}"


@pytest.fixture
def backend():
    """Set the compression backend (and the fold switch) for one test; restored afterwards."""
    old, old_fold = ops._compression_backend, wrappers.FOLD_MOMENTUM

    def set_(name, fold=True):
        ops.set_compression_backend(name)
        wrappers.FOLD_MOMENTUM = fold

    yield set_
    ops.set_compression_backend(old)
    wrappers.FOLD_MOMENTUM = old_fold


def tricky(n, seed, finite=False):
    """float32 [n]: normal values, +0/-0, subnormals, a product with m that is subnormal (flushed);
    unless ``finite``: huge values (m v + g overflows), NaN, inf. (NaN ranks above +inf in the
    kernels' selection and is unspecified in TF's top_k: the reference comparisons use finite
    inputs, the kernel-vs-kernel ones all of them.)"""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    pick = rng.integers(0, 10, n)
    x[pick == 1] = 0.0
    x[pick == 2] = -0.0
    x[pick == 3] = np.float32(1e-40) * rng.integers(-4, 5, (pick == 3).sum())
    x[pick == 5] = np.float32(1.2e-38)
    if not finite:
        x[pick == 4] = np.float32(3e38) * rng.choice([-1, 1], (pick == 4).sum())
        x[rng.integers(0, n, 2)] = np.nan
        x[rng.integers(0, n, 2)] = np.inf
    return x


def plus0(x):
    """x with -0.0 and negative subnormals (-0 under denormals-are-zero) made positive. For the
    variables of the reference comparisons: a selected a = u + r of -0 with fp32 values leaves
    the kernels' residual a - a = +0 but the reference's a - scatter_nd(-0) = -0 - (+0) = -0
    (scatter_nd adds onto +0): a difference of HgsgcCompress / HgsgcCompressResidual (not new
    here) that an exchange never reaches (residuals and velocities start at +0, and a sum is -0
    only when both terms are), so the pure-TF comparison keeps -0 out of r and v; the
    kernel-vs-kernel comparisons keep it."""
    x = np.array(x, np.float32)
    neg0 = np.signbit(x) & (np.abs(x) < np.float32(1.1754944e-38))
    x[neg0] = -x[neg0]
    return x


def gradients(step, shapes):
    """Per-step gradients: normal values, ties (small integers), +0/-0 runs (2-bit scales of 0:
    sent values 0 and -0, which the masking must keep), subnormals."""
    rng = np.random.default_rng(100 + step)
    out = []
    for j, shape in enumerate(shapes):
        n = int(np.prod(shape))
        kind = j % 4
        if kind == 0:
            x = rng.standard_normal(n)
        elif kind == 1:
            x = rng.integers(-2, 3, n).astype(np.float64)
        elif kind == 2:
            x = np.where(rng.random(n) < 0.5, -0.0, 0.0)
            if step % 2:
                x[rng.integers(0, n, 3)] = rng.standard_normal(3)
        else:
            x = rng.standard_normal(n) * 1e-3
            x[rng.random(n) < 0.3] = np.float32(1e-40) * rng.integers(-3, 4)
        out.append(tf.constant(x.astype(np.float32).reshape(shape)))
    return out


SHAPES = [(37, 11), (400,), (16, 3, 3, 8), (1000, 7), (5,), (64, 33)]


def run_exchanges(comp, momentum, steps, graph, shapes=SHAPES, grads=gradients):
    ex = Exchanger(comp, momentum=momentum)
    names = [f"t{j}" for j in range(len(shapes))]
    fn = tf.function(ex.exchange) if graph else ex.exchange
    outs = [[a.numpy() for a in fn(grads(s, shapes), names)] for s in range(steps)]
    ops_seen = set()
    if graph:
        g = fn.get_concrete_function(grads(0, shapes), names).graph
        ops_seen = {op.type for op in g.get_operations()}
        for f in g._functions.values():  # noqa: SLF001 (nested functions of the graph)
            ops_seen |= {n.op for n in f.definition.node_def}
    return outs, ex.state_dict(), ops_seen


def compare_runs(a, b):
    (outs_a, state_a, _), (outs_b, state_b, _) = a, b
    for s, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        for j, (x, y) in enumerate(zip(oa, ob)):
            assert_same(x, y, f"step {s} average of tensor {j}")
    assert sorted(state_a) == sorted(state_b)
    for key in state_a:
        if isinstance(state_a[key], dict):
            assert sorted(state_a[key]) == sorted(state_b[key]), key
            for name in state_a[key]:
                assert_same(state_a[key][name], state_b[key][name], f"{key}[{name}]")
        else:
            assert state_a[key] == state_b[key], key


@pytest.mark.parametrize("bits,coding,masking,buckets", [
    (2, "fixed", True, 1), (2, "elias_fano", True, 1), (32, "fixed", True, 3),
    (2, "fixed", False, 1), (32, "elias_fano", False, 2)])
@pytest.mark.parametrize("graph", [True, False])
def test_fold_exchange_equals_composed_and_reference(backend, bits, coding, masking, buckets, graph):
    """DGC momentum correction + error feedback, 4 exchanges: the averages, residuals,
    velocities and byte counters are the same bits with the fused kernel, with session 10's
    four kernels and with the pure-TF ops; the traced graph runs HgsgcCompressMomentum (and no
    HgsgcMomentumMask / HgsgcMomentumAccumulate) only on the fused path."""
    comp = Compression.sgc(0.05, bits=bits, momentum_correction=True, momentum_masking=masking,
                           index_coding=coding, buckets=buckets)
    backend("reference")
    ref = run_exchanges(comp, 0.9, 4, graph)
    backend("custom", fold=False)
    old = run_exchanges(comp, 0.9, 4, graph)
    backend("custom", fold=True)
    new = run_exchanges(comp, 0.9, 4, graph)
    compare_runs(ref, new)
    compare_runs(old, new)
    if graph:
        assert "HgsgcCompressMomentum" in new[2] and "HgsgcMomentumMask" not in new[2], new[2]
        assert "HgsgcCompressMomentum" not in old[2] and "HgsgcCompressResidual" in old[2]
        assert not any(t.startswith(("HgsgcCompress", "HgsgcMomentum", "HgsgcDecode")) for t in ref[2]), ref[2]
    if masking:  # the masking did clear entries (else the test would not pin it)
        assert any((v == 0).sum() > 0 for v in new[1]["velocity"].values())


def numpy_dgc(steps, shapes, density, bits, m, masking):
    """Independent numpy DGC on one rank: u = m v + g, a = u + e, top-k of |a| (ties to the
    lower index), 2-bit or fp32 values, e = a - sent, v = u masked where sent != 0; average =
    sent / 1. Float32 ops one at a time (no subnormals in these inputs: no flush-to-zero)."""
    mf = np.float32(m)
    v = [np.zeros(int(np.prod(s)), np.float32) for s in shapes]
    e = [np.zeros(int(np.prod(s)), np.float32) for s in shapes]
    outs = []
    for step in range(steps):
        rng = np.random.default_rng(500 + step)
        avg = []
        for j, s in enumerate(shapes):
            g = rng.standard_normal(int(np.prod(s))).astype(np.float32)
            u = (mf * v[j]).astype(np.float32) + g
            a = u + e[j]
            k = npref.k_for(a.size, density)
            idx = npref.topk_indices(a, k)
            vals = npref.quantize_2bit(a[idx])[0] if bits == 2 else a[idx]
            sent = np.zeros_like(a)
            sent[idx] = vals
            e[j] = a - sent
            v[j] = np.where(sent != 0, np.float32(0), u).astype(np.float32) if masking else u
            avg.append(sent.reshape(s) / np.float32(1))
        outs.append(avg)
    return outs, v, e


@pytest.mark.parametrize("bits,masking", [(2, True), (32, True), (2, False)])
def test_fold_exchange_equals_numpy(backend, bits, masking):
    shapes = [(300, 7), (1000,), (64, 9)]

    def grads(step, shp):
        rng = np.random.default_rng(500 + step)
        return [tf.constant(rng.standard_normal(int(np.prod(s))).astype(np.float32).reshape(s))
                for s in shp]

    comp = Compression.sgc(0.02, bits=bits, momentum_correction=True, momentum_masking=masking,
                           index_coding="elias_fano")
    backend("custom", fold=True)
    outs, state, seen = run_exchanges(comp, 0.9, 5, True, shapes, grads)
    assert "HgsgcCompressMomentum" in seen
    want, v, e = numpy_dgc(5, shapes, 0.02, bits, 0.9, masking)
    for s in range(5):
        for j in range(len(shapes)):
            assert_same(outs[s][j], want[s][j], f"step {s} average {j}")
    for j in range(len(shapes)):
        assert_same(state["velocity"][f"t{j}"].ravel(), v[j], f"velocity {j}")
        assert_same(state["residuals"][f"t{j}"].ravel(), e[j], f"residual {j}")
    # bytes: the formula of docs/compression.md, unchanged
    want_bytes = sum(npref.payload_length(int(np.prod(s)), npref.k_for(int(np.prod(s)), 0.02), bits,
                                          "elias_fano") for s in shapes)
    assert state["stats"]["payload_bytes"] == 5 * want_bytes, state["stats"]


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("coding", ["fixed", "elias_fano"])
@pytest.mark.parametrize("m,masking", [(0.9, True), (0.5, False), (1.0, True)])
@pytest.mark.parametrize("graph", [False, True])
def test_compress_momentum_into_equals_reference(bits, coding, m, masking, graph):
    """One call on subnormal / +-0 inputs, k from 0 to numel (the trivial, sampled-threshold and
    exact-fallback selections): payload, residual and velocity equal the pure-TF reference and
    session 10's kernels bit for bit; with NaN / inf / overflowing inputs too, the kernels of
    session 10 (whose selection ranks NaN first, where TF's is unspecified)."""
    n = 20_011
    run = (lambda f: tf.function(f)()) if graph else (lambda f: f())
    for k, finite in ((0, True), (1, True), (97, True), (2_000, True), (n, True), (1, False),
                      (97, False), (n, False)):
        res = {}
        for mode in ("reference", "composed", "fused") if finite else ("composed", "fused"):
            g = tf.constant(tricky(n, 1, finite))
            r = tf.Variable(plus0(tricky(n, 2, finite)) if finite else tricky(n, 2))
            v = tf.Variable(plus0(tricky(n, 3, finite)) if finite else tricky(n, 3))
            if mode == "fused":
                fn = lambda: kernels.compress_momentum_into(g, r, v, m, k, bits, masking, seed=5,  # noqa: E731
                                                            backend="custom", index_coding=coding)
            elif mode == "composed":
                fn = lambda: kernels._compress_momentum_composed(g, r, v, m, k, bits, masking, 1024,  # noqa: E731
                                                                 1.5, 5, "custom", coding)
            else:
                fn = lambda: kernels.compress_momentum_into_reference(g, r, v, m, k, bits, masking,  # noqa: E731
                                                                      seed=5, index_coding=coding)
            p = run(fn)
            res[mode] = (p.numpy(), r.numpy(), v.numpy())
        assert res["fused"][0].size == wire.payload_length(n, k, bits, coding)
        for mode in [m_ for m_ in res if m_ != "fused"]:
            for what, a, b in zip(("payload", "residual", "velocity"), res[mode], res["fused"]):
                assert_same(a, b, f"k={k} finite={finite} {what} vs {mode}")


def test_compress_momentum_into_any_shape_and_copy_on_write():
    """A 4-D gradient with 4-D variables; reads of both variables taken before the call keep the
    old values (copy-on-write) while the variables hold the reference's new ones."""
    shape = [8, 3, 3, 50]
    n = int(np.prod(shape))
    g = tf.constant(tricky(n, 4, True).reshape(shape))
    want = []
    for fused in (False, True):
        r = tf.Variable(plus0(tricky(n, 5, True)).reshape(shape))
        v = tf.Variable(plus0(tricky(n, 6, True)).reshape(shape))
        r_old, v_old = r.read_value(), v.read_value()
        if fused:
            p = kernels.compress_momentum_into(g, r, v, 0.9, 36, 2, True, seed=1, backend="custom")
        else:
            p = kernels.compress_momentum_into_reference(g, r, v, 0.9, 36, 2, True, seed=1)
        want.append((p.numpy(), r.numpy(), v.numpy()))
        assert_same(r_old, plus0(tricky(n, 5, True)).reshape(shape), "earlier read of the residual")
        assert_same(v_old, plus0(tricky(n, 6, True)).reshape(shape), "earlier read of the velocity")
    for what, a, b in zip(("payload", "residual", "velocity"), *want):
        assert_same(a, b, what)


def test_compress_momentum_into_bad_arguments():
    r, v = tf.Variable(tf.zeros([5])), tf.Variable(tf.zeros([5]))
    with pytest.raises(ValueError, match="two different variables"):
        kernels.compress_momentum_into(tf.zeros([5]), r, r, 0.9, 1, 2, backend="custom")
    with pytest.raises(ValueError, match="velocity must be a float32 tf.Variable of 6 entries"):
        kernels.compress_momentum_into(tf.zeros([6]), tf.Variable(tf.zeros([6])), v, 0.9, 1, 2,
                                       backend="custom")
    with pytest.raises(ValueError, match="residual must be a float32 tf.Variable of 5 entries"):
        kernels.compress_momentum_into(tf.zeros([5]), tf.zeros([5]), v, 0.9, 1, 2, backend="custom")
    with pytest.raises(ValueError, match="k must be a Python int"):
        kernels.compress_momentum_into(tf.zeros([5]), r, v, 0.9, 6, 2, backend="custom")
    with pytest.raises(ValueError, match="bits must be 2 or 32"):
        kernels.compress_momentum_into(tf.zeros([5]), r, v, 0.9, 1, 8, backend="custom")


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("coding", ["fixed", "elias_fano"])
@pytest.mark.parametrize("graph", [False, True])
def test_decode_accumulate_divisor_equals_reference_and_numpy(bits, coding, graph):
    """The average in the kernel (sum x float32(1/n)) == the reference (TF Mul) == numpy float32
    rank-order sum x float32(1/n), for n = 1..7; and, inside a tf.function, == session 10's
    kernel sum `/ float(n)` in TF (grappler folds that division into the same multiplication;
    eager TF divides exactly: up to 1 ulp apart for n = 3, 5, 6, 7, checked below)."""
    numel, k = 5_000, 333
    run = (lambda f: tf.function(f)()) if graph else (lambda f: f())
    for n in (1, 2, 3, 4, 5, 6, 7):
        rng = np.random.default_rng(n)
        rows, dense = [], []
        for _ in range(n):
            idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)
            vals = (rng.standard_normal(k) * rng.choice([1e-3, 1.0, 1e3], k)).astype(np.float32)
            p, _ = wire.encode(tf.constant(idx), tf.constant(vals), numel, bits, coding)
            rows.append(p.numpy())
            sent = npref.quantize_2bit(vals)[0] if bits == 2 else vals
            d = np.zeros(numel, np.float32)
            d[idx] = sent
            dense.append(d)
        gathered = tf.constant(np.stack(rows))
        got = run(lambda: kernels.decode_accumulate(gathered, numel, k, bits, backend="custom",
                                                    index_coding=coding, divisor=n))
        ref = run(lambda: kernels.decode_accumulate_reference(gathered, numel, k, bits, 0, coding,
                                                              divisor=n))
        old = run(lambda: kernels.decode_accumulate(gathered, numel, k, bits, backend="custom",
                                                    index_coding=coding) / float(n))
        total = np.zeros(numel, np.float32)
        for d in dense:
            total = total + d
        assert_same(got, ref, f"n={n} vs reference")
        assert_same(got, total * (np.float32(1) / np.float32(n)), f"n={n} vs numpy")
        if graph or n in (1, 2, 4):
            assert_same(got, old, f"n={n} vs kernel sum then TF division (graph)")
        else:  # eager: an exact division, at most 1 ulp from the multiplication
            ulps = np.abs(bits_of(old).astype(np.int64) - bits_of(got).astype(np.int64))
            assert ulps.max() <= 1 and (ulps == 1).any(), (n, ulps.max())


def test_decode_accumulate_divisor_bad():
    g = tf.zeros([1, 100], tf.uint8)
    for d in (0, -1, 2**24 + 1, 2.0, True):
        with pytest.raises(ValueError, match="divisor must be a Python int in"):
            kernels.decode_accumulate(g, 10, 1, 2, backend="custom", divisor=d)


# Each case of tests/mpi/check_kernels11.py runs on 2 ranks and on one more count (3 or 4): every case
# on every count cost ~550 s of the suite on a slow day (session 12), the 4-rank launch most
FOLD_CASES = {2: ("sgc2_dgc_momentum", "sgc2_dgc_momentum_ef_b2", "dgc_fp32_nomask", "topk_div_n"),
              3: ("sgc2_dgc_momentum", "dgc_fp32_nomask"), 4: ("sgc2_dgc_momentum_ef_b2", "topk_div_n")}
MPI_CASES = [c for np_, names in FOLD_CASES.items()
             for c in mpi_cases("tests/mpi/check_kernels11.py", *names, ranks=[np_], timeout=420)]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_training_fold_equals_composed_and_reference_mpi(np_, mpi_batch):
    """2/3/4 ranks (mpirun, timeout): DistributedOptimizer + model.fit and DistributedGradientTape
    in a tf.function with DGC momentum correction (2-bit SGC, fp32 DGC; allgather, 1 and 2
    buckets) and top-k (the / n fold): final weights and every state leaf equal across the fused
    kernel, session 10's kernels and the pure-TF path, and the weights equal on every rank (each
    case on 2 ranks and one of 3 / 4, ``FOLD_CASES``)."""
    out = mpi_batch.result(np_, "tests/mpi/check_kernels11.py", *FOLD_CASES[np_])
    expect = {"sgc2_dgc_momentum": ("fit", "tape"), "sgc2_dgc_momentum_ef_b2": ("tape",),
              "dgc_fp32_nomask": ("fit",), "topk_div_n": ("fit",)}
    assert sorted(k for k in out if k != "size") == sorted(f"{n}_{e}" for n in FOLD_CASES[np_] for e in expect[n])
    for case, r in out.items():
        if case == "size":
            continue
        assert r["weights_differ"] == {"composed": [], "reference": []}, (case, r)
        assert r["state_differ"] == {"composed": [], "reference": []}, (case, r)
        assert r["ranks_equal"] and r["moved"] and r["n_state"] > 0, (case, r)
        assert r["fused_op"] == r["expect_fused"], (case, r)
        assert r["fused_in_other_modes"] == [False, False], (case, r)
