"""Session 12: the input checks ``HgsgcCompressResidual`` and ``HgsgcCompressMomentum`` share.

Both ops now run one helper for the seed / size / ``k`` checks, one for each variable's check
and one for the copy-on-write decision (``ops/sparse_codec.cc``: ``CheckVariableCompressInputs``,
``CheckCompressVariable``, ``VariableOutput``). The raw ops (no Python argument checks in front)
must give the same error text for the same fault, name the op, and keep the computation: payload,
residual and velocity equal to the pure-TF reference bit for bit, in place and copy-on-write
(a read of the variable held across the call keeps the old value).

The kernel tests skip when the library is not built, unless HGSGC_REQUIRE_CUSTOM_OPS=1.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

from hgsgc import ops
from hgsgc.compression import kernels, wire

HAVE_CUSTOM = ops.available()
REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")
pytestmark = pytest.mark.skipif(not HAVE_CUSTOM and not REQUIRE_CUSTOM,
                                reason="custom ops not built (python setup.py build_ext --inplace)")

SEED = tf.constant(3, tf.int64)


def bits_of(a):
    a = a.numpy() if tf.is_tensor(a) or isinstance(a, tf.Variable) else np.asarray(a)
    return a.astype(np.float32).view(np.uint32) if a.dtype == np.float32 else a


def assert_same(a, b, what=""):
    a, b = bits_of(a), bits_of(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} entries differ, first at {bad[:5]}"


def finite(n, seed):
    """float32 [n]: normal values with +0 and positive subnormals (no -0: see test_kernels11.plus0)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, 10, n) == 1] = 0.0
    x[rng.integers(0, 10, n) == 2] = np.float32(1e-40)
    return x


def residual_op(grad, res, seed=SEED, k=1):
    return ops.load().hgsgc_compress_residual(grad, res.handle, seed, k=k, bits=2)


def momentum_op(grad, res, vel, seed=SEED, k=1):
    return ops.load().hgsgc_compress_momentum(grad, res.handle, vel.handle, seed, k=k, bits=2,
                                              momentum=0.9)


def message(fn):
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        fn()
    return e.value.message


@pytest.mark.parametrize("op", ["HgsgcCompressResidual", "HgsgcCompressMomentum"])
def test_shared_checks_same_message_per_fault(op):
    """Each fault gives the one message, naming the op, for both ops (the shared helpers)."""
    g = tf.zeros([5])
    v5, v6 = tf.Variable(tf.zeros([5])), tf.Variable(tf.zeros([6]))
    vi = tf.Variable(tf.zeros([5], tf.int32))
    if op == "HgsgcCompressResidual":
        call = lambda grad=g, res=v5, seed=SEED, k=1: residual_op(grad, res, seed, k)  # noqa: E731
    else:
        other = tf.Variable(tf.zeros([5]))
        call = lambda grad=g, res=v5, seed=SEED, k=1: momentum_op(grad, res, other, seed, k)  # noqa: E731
    assert f"{op}: seed must be an int64 scalar" in message(lambda: call(seed=tf.constant([1], tf.int64)))
    assert f"{op}: k = 6 exceeds numel = 5" in message(lambda: call(k=6))
    assert (f"{op}: the residual variable must be an initialized float32 variable of 5 entries, "
            "got [6]") in message(lambda: call(res=v6))
    assert (f"{op}: the residual variable must be an initialized float32 variable of 5 entries, "
            "got [5]") in message(lambda: call(res=vi))  # int32 variable of the right size
    # the first failing check wins: seed before k before the variable
    assert "seed must be" in message(lambda: call(res=v6, k=6, seed=tf.constant([1], tf.int64)))
    assert "exceeds numel" in message(lambda: call(res=v6, k=6))


def test_momentum_checks_the_velocity_like_the_residual():
    g = tf.zeros([5])
    r, v6 = tf.Variable(tf.zeros([5])), tf.Variable(tf.zeros([6]))
    assert ("HgsgcCompressMomentum: the velocity variable must be an initialized float32 variable "
            "of 5 entries, got [6]") in message(lambda: momentum_op(g, r, v6))
    assert "two different variables" in message(lambda: momentum_op(g, r, r))


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("coding", ["fixed", "elias_fano"])
def test_residual_op_in_place_and_copy_on_write_equal_reference(hold, coding):
    """Through the shared copy-on-write helper: in place (nothing else holds the residual) and
    copy-on-write (a read held across the call keeps the old bits); payload and residual equal
    the pure-TF reference bit for bit, for k = 0, 1, 97 and numel."""
    shape, n = [7, 11, 13], 7 * 11 * 13
    g = tf.constant(finite(n, 1).reshape(shape))
    r0 = finite(n, 2).reshape(shape)
    for k in (0, 1, 97, n):
        got, want = {}, {}
        for backend, out in (("custom", got), ("reference", want)):
            r = tf.Variable(r0)
            old = r.read_value() if hold else None
            p = kernels.compress_into(g, r, k, 2, seed=4, backend=backend, index_coding=coding)
            out["payload"], out["residual"] = p.numpy(), r.numpy()
            if hold:
                assert_same(old, r0, f"k={k} {backend}: held read")
        assert got["payload"].size == wire.payload_length(n, k, 2, coding)
        for what in ("payload", "residual"):
            assert_same(got[what], want[what], f"k={k} hold={hold} {what}")


@pytest.mark.parametrize("hold", ["none", "residual", "velocity", "both"])
def test_momentum_op_copy_on_write_per_variable_equal_reference(hold):
    """Each variable takes its own copy-on-write decision: the held ones keep their old bits,
    all end equal to the pure-TF reference (payload, residual, velocity)."""
    n = 3_001
    g = tf.constant(finite(n, 3))
    r0, v0 = finite(n, 4), finite(n, 5)
    res = {}
    for backend in ("custom", "reference"):
        r, v = tf.Variable(r0), tf.Variable(v0)
        held_r = r.read_value() if hold in ("residual", "both") else None
        held_v = v.read_value() if hold in ("velocity", "both") else None
        if backend == "custom":
            p = kernels.compress_momentum_into(g, r, v, 0.9, 31, 2, True, seed=6, backend="custom")
        else:
            p = kernels.compress_momentum_into_reference(g, r, v, 0.9, 31, 2, True, seed=6)
        res[backend] = (p.numpy(), r.numpy(), v.numpy())
        if held_r is not None:
            assert_same(held_r, r0, f"{backend}: held residual")
        if held_v is not None:
            assert_same(held_v, v0, f"{backend}: held velocity")
    for what, a, b in zip(("payload", "residual", "velocity"), res["custom"], res["reference"]):
        assert_same(a, b, f"hold={hold} {what}")
