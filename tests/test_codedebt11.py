"""Session 11 code debt (cd11).

* The pure-TF decode (``wire.decode``, ``decode_accumulate``'s reference, the tree/node merges)
  refuses indices that are not strictly ascending in ``[0, numel)`` (a duplicate from a corrupt
  payload was added twice) with the C++ op's message.
"""
import re

import numpy as np
import pytest
import tensorflow as tf

from hgsgc.compression import kernels, wire
from test_index_coding import np_ef_encode, np_fixed_encode

EF = "elias_fano"


# ------------------------------------------------------------------ pure-TF decode: duplicates
NUMEL, K = 1000, 10
IDX = [1, 80, 81, 200, 333, 500, 640, 700, 901, 999]  # 80, 81: one Elias-Fano bucket (l = 6)


def _payload(idx, bits, coding):
    """A payload of ``idx`` (any order, duplicates kept) built with the numpy coders."""
    vals = np.linspace(-1, 1, K).astype(np.float32)
    good, _ = kernels.sparse_encode(IDX, vals, NUMEL, bits, backend="custom", index_coding=coding)
    good = good.numpy()
    sec = (np_ef_encode if coding == EF else np_fixed_encode)(np.asarray(idx), NUMEL)
    off = 8 if bits == 2 else 0
    assert len(sec) == wire.index_bytes(NUMEL, K, coding)
    return np.concatenate([good[:off], sec, good[off + len(sec):]]).astype(np.uint8), good


@pytest.mark.parametrize("coding", ["fixed", EF])
@pytest.mark.parametrize("bits", [2, 32])
def test_reference_decode_refuses_a_duplicate_index_as_the_kernel_does(bits, coding):
    """A corrupt payload decoding to index 80 twice: HgsgcDecodeAccumulate refused it; the
    reference (and wire.decode, used by the tree / node merges) added entry 80 twice."""
    dup = IDX[:2] + [80] + IDX[3:]
    bad, good = _payload(dup, bits, coding)
    rows = np.stack([good, bad])
    msg = "payload of rank 1: entry 2 has index 80 (indices must be strictly ascending)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(f"HgsgcDecodeAccumulate: {msg}")):
        kernels.decode_accumulate(rows, NUMEL, K, bits, backend="custom", index_coding=coding)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(f"wire.decode_indices: {msg}")):
        kernels.decode_accumulate(rows, NUMEL, K, bits, backend="reference", index_coding=coding)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"wire.decode_indices: entry 2 has index 80 \(indices must be strictly"):
        wire.decode(tf.constant(bad), NUMEL, K, bits, coding)
    # inside a tf.function too
    fn = tf.function(lambda r: kernels.decode_accumulate(r, NUMEL, K, bits, backend="reference",
                                                         index_coding=coding))
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(msg)):
        fn(tf.constant(rows))
    # well-formed rows: both backends give the same sum, bit for bit, in eager and graph
    ok = np.stack([good, good])
    want = kernels.decode_accumulate(ok, NUMEL, K, bits, backend="custom", index_coding=coding).numpy()
    np.testing.assert_array_equal(
        kernels.decode_accumulate(ok, NUMEL, K, bits, backend="reference", index_coding=coding).numpy(), want)
    np.testing.assert_array_equal(fn(tf.constant(ok)).numpy(), want)


@pytest.mark.parametrize("bits", [2, 32])
def test_reference_decode_refuses_descending_and_out_of_range_fixed_indices(bits):
    """The fixed code keeps any order and reaches 2^w - 1 = 1023 >= numel: descending indices
    were added silently and 1001 failed inside tf.scatter_nd naming no payload."""
    desc = IDX[:4] + [199] + IDX[5:]  # 200 then 199
    bad, good = _payload(desc, bits, "fixed")
    for backend in ("custom", "reference"):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"payload of rank 0: entry 4 has index 199 \(indices must be strictly"):
            kernels.decode_accumulate(np.stack([bad]), NUMEL, K, bits, backend=backend)
    far = IDX[:9] + [1001]
    bad, _ = _payload(far, bits, "fixed")
    for backend in ("custom", "reference"):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"payload of rank 1: entry 9 has index 1001 >= numel = 1000"):
            kernels.decode_accumulate(np.stack([good, bad]), NUMEL, K, bits, backend=backend)
