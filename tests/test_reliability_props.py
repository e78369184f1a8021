"""Property-based tests (hypothesis) of the compression identities, single process.

Over shapes, dtypes, densities, value bits and selectors, one rank's :class:`hgsgc.Exchanger`
(a one-rank average is the rank's own decompressed payload) must keep error feedback exact:
``g + r_old == out + r_new`` (nothing is lost: what is not sent stays in the residual), send at
most ``k = ceil(density * numel)`` entries, return the input's shape and dtype, and at density 1
with fp32 values return ``g`` itself with a zero residual. Averages over 2, 3 and 4 ranks are
checked against numpy in tests/test_mpi.py and tests/test_baselines.py under mpirun.
"""
import math

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hgsgc import Compression
from hgsgc.communicator import Exchanger

hvd.init()  # a single process: the exchange is local

shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=12)
# TensorFlow flushes float32 subnormals to zero on CPU, so they are left out of the draws
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, density=st.sampled_from([0.01, 0.1, 0.3, 1.0]), bits=st.sampled_from([2, 32]),
       selector=st.sampled_from(["exact", "sampled"]), dtype=st.sampled_from([np.float32, np.float64]),
       data=st.data())
def test_error_feedback_conserves_the_gradient(shape, density, bits, selector, dtype, data):
    g1 = data.draw(hnp.arrays(dtype, shape, elements=finite))
    g2 = data.draw(hnp.arrays(dtype, shape, elements=finite))
    comp = Compression.sgc(density, bits=bits, selector=selector)
    ex = Exchanger(comp)
    numel = int(np.prod(shape))
    k = min(numel, max(1, math.ceil(density * numel)))
    r_old = np.zeros(numel, np.float32)
    for g in (g1, g2):  # two steps: the second starts from a non-zero residual
        out = ex.exchange([tf.constant(g)], ["v"])[0]
        assert out.dtype == tf.as_dtype(dtype) and tuple(out.shape) == tuple(shape)
        o = out.numpy().astype(np.float32).reshape(-1)
        r_new = ex.memory.state_dict()["v"].reshape(-1)
        a = g.astype(np.float32).reshape(-1) + r_old
        assert np.count_nonzero(o) <= k
        if bits == 32 and dtype == np.float32:
            # the selected entries travel exactly, the rest stays in the residual: exact
            np.testing.assert_array_equal(o + r_new, a)
            np.testing.assert_array_equal(r_new[o != 0], 0.0)
        else:  # 2-bit codes / a cast of the output: one rounding of each value
            np.testing.assert_allclose(o + r_new, a, rtol=1e-5, atol=1e-5 * (1 + np.abs(a).max()))
        r_old = r_new


@settings(max_examples=12, deadline=None)
@given(shape=shapes, data=st.data())
def test_density_one_fp32_is_the_identity(shape, data):
    g = data.draw(hnp.arrays(np.float32, shape, elements=finite))
    ex = Exchanger(Compression.topk(1.0, selector="exact"))
    out = ex.exchange([tf.constant(g)], ["w"])[0].numpy()
    np.testing.assert_array_equal(out, g)
    np.testing.assert_array_equal(ex.memory.state_dict()["w"], 0.0)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(2, 12), p=st.integers(2, 12), rank=st.integers(1, 4), data=st.data())
def test_powersgd_error_feedback_conserves_the_gradient(m, p, rank, data):
    g = data.draw(hnp.arrays(np.float32, (m, p), elements=st.floats(-10, 10, width=32, allow_subnormal=False)))
    ex = Exchanger(Compression.powersgd(rank=rank))
    out = ex.exchange([tf.constant(g)], ["m"])[0].numpy()
    res = ex.memory.state_dict().get("m")
    if res is None:  # not compressed: (m + p) q >= m p, averaged densely
        np.testing.assert_array_equal(out, g)
    else:
        np.testing.assert_allclose(out + res.reshape(m, p), g, rtol=1e-5, atol=1e-4)
