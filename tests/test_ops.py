"""Tests of hgsgc.ops: the custom bit-packing kernels vs the pure-TF reference vs NumPy.

The custom-kernel tests skip when ``hgsgc/_ops*.so`` is not built (set
``HGSGC_REQUIRE_CUSTOM_OPS=1`` to make that a failure instead).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from hgsgc import ops

WIDTHS = list(range(1, 33))
LENGTHS = [0, 1, 7, 8, 9, 1000]
HAVE_CUSTOM = ops.available()
REQUIRE_CUSTOM = os.environ.get("HGSGC_REQUIRE_CUSTOM_OPS", "") not in ("", "0")

needs_custom = pytest.mark.skipif(
    not HAVE_CUSTOM and not REQUIRE_CUSTOM,
    reason="custom ops not built: run `pip install --no-build-isolation -e .` "
    "or `python setup.py build_ext --inplace`",
)
BACKENDS = [pytest.param("custom", marks=needs_custom), "reference"]


# ------------------------------------------------------------------------------------------------
# NumPy reference of the layout: bit k of value i is stream bit i*width + k, little-endian bytes.


def np_pack(values, width):
    v = np.asarray(values, dtype=np.int32).view(np.uint32)
    bits = ((v[:, None] >> np.arange(width, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, width]
    return np.packbits(bits.reshape(-1), bitorder="little")


def np_unpack(packed, width, count):
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")[: count * width]
    rows = bits.reshape(count, width).astype(np.uint64)
    return (rows << np.arange(width, dtype=np.uint64)).sum(axis=1).astype(np.uint32).view(np.int32)


def random_values(width, n, seed):
    """int32 [n] uniform in [0, 2**width) (as uint32 bit patterns), with the extremes included."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 2**width, size=n, dtype=np.uint64).astype(np.uint32)
    if n >= 2:
        v[0] = 2**width - 1
        v[-1] = 0
    return v.view(np.int32)


def test_numpy_reference_matches_hand_examples():
    assert np_pack([1, 2, 3], 2).tolist() == [0b00111001]
    assert np_pack([5, 3, 7], 3).tolist() == [0b11011101, 0b1]
    assert np_unpack([0b11011101, 0b1], 3, 3).tolist() == [5, 3, 7]


# ------------------------------------------------------------------------------------------------
# Hand-computed layouts.


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_examples(backend):
    def pack(v, w):
        return ops.pack_bits(np.array(v, np.int32), w, backend=backend).numpy().tolist()

    assert pack([1, 2, 3], 2) == [0b00111001]
    assert pack([5, 3, 7], 3) == [0b11011101, 0b00000001]
    assert pack([1, 0, 1, 1, 0, 0, 0, 1, 1], 1) == [0b10001101, 0b1]
    assert pack([0xAB, 0x01, 0xFF], 8) == [0xAB, 0x01, 0xFF]
    assert pack([0x12345678, -1], 32) == [0x78, 0x56, 0x34, 0x12, 0xFF, 0xFF, 0xFF, 0xFF]
    assert pack([0x3, 0x5], 4) == [0x53]
    assert pack([0x7FF], 11) == [0xFF, 0x07]  # high padding bits of the last byte are 0
    assert pack([], 5) == []


# ------------------------------------------------------------------------------------------------
# Custom vs reference vs NumPy, bit for bit.


@needs_custom
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("width", WIDTHS)
def test_custom_reference_numpy_agree(width, n):
    x = random_values(width, n, seed=1000 * width + n)
    expected = np_pack(x, width)
    assert expected.shape == (ops.packed_length(n, width),)

    custom = ops.pack_bits(x, width, backend="custom")
    reference = ops.pack_bits_reference(x, width)
    assert custom.dtype == tf.uint8 and reference.dtype == tf.uint8
    np.testing.assert_array_equal(custom.numpy(), expected)
    np.testing.assert_array_equal(reference.numpy(), expected)

    for out in (
        ops.unpack_bits(expected, width, n, backend="custom"),
        ops.unpack_bits_reference(expected, width, n),
    ):
        assert out.dtype == tf.int32
        np.testing.assert_array_equal(out.numpy(), x)
    np.testing.assert_array_equal(np_unpack(expected, width, n), x)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("width", WIDTHS)
def test_reference_matches_numpy(width, n):
    # Runs without the custom library too.
    x = random_values(width, n, seed=7 * width + n)
    packed = ops.pack_bits_reference(x, width)
    np.testing.assert_array_equal(packed.numpy(), np_pack(x, width))
    np.testing.assert_array_equal(ops.unpack_bits_reference(packed, width, n).numpy(), x)


@needs_custom
@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 13, 20, 31, 32])
@pytest.mark.parametrize("n", [31, 32, 33, 63, 64, 65, 4095, 100_003, 1_000_037])
def test_custom_block_boundaries_and_sharding(width, n):
    # Around the kernel's 32-value blocks, and large enough to be split across threads.
    x = random_values(width, n, seed=width * 31 + n)
    expected = np_pack(x, width)
    packed = ops.pack_bits(x, width, backend="custom")
    np.testing.assert_array_equal(packed.numpy(), expected)
    np.testing.assert_array_equal(ops.unpack_bits(expected, width, n, backend="custom").numpy(), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_width_32_negative_values_round_trip(backend):
    x = np.array([-1, -(2**31), 2**31 - 1, 0, -12345], np.int32)
    packed = ops.pack_bits(x, 32, backend=backend)
    np.testing.assert_array_equal(packed.numpy(), x.view(np.uint8))
    np.testing.assert_array_equal(ops.unpack_bits(packed, 32, 5, backend=backend).numpy(), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_uint32_input_is_bitcast(backend):
    x = np.array([2**32 - 1, 7], np.uint32)
    packed = ops.pack_bits(x, 32, backend=backend)
    np.testing.assert_array_equal(packed.numpy(), x.view(np.uint8))
    assert ops.unpack_bits(packed, 32, 2, backend=backend).numpy().tolist() == [-1, 7]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_ignores_padding_bits(backend):
    packed = np.array([0b00111001 | 0b11000000], np.uint8)  # 3 values of width 2 + 2 padding bits
    assert ops.unpack_bits(packed, 2, 3, backend=backend).numpy().tolist() == [1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_accepts_bytes(backend):
    assert ops.unpack_bits(b"\x39", 2, 3, backend=backend).numpy().tolist() == [1, 2, 3]


# ------------------------------------------------------------------------------------------------
# Property test (hypothesis): unpack(pack(x)) == x, custom == reference == NumPy.


@st.composite
def widths_and_values(draw):
    width = draw(st.integers(min_value=1, max_value=32))
    values = draw(st.lists(st.integers(min_value=0, max_value=2**width - 1), max_size=200))
    return width, np.array(values, dtype=np.uint64).astype(np.uint32).view(np.int32)


@settings(max_examples=150, deadline=None)
@given(widths_and_values())
def test_property_round_trip(case):
    width, x = case
    n = x.shape[0]
    expected = np_pack(x, width)
    backends = ["custom", "reference"] if HAVE_CUSTOM else ["reference"]
    for backend in backends:
        packed = ops.pack_bits(x, width, backend=backend)
        assert packed.shape == (ops.packed_length(n, width),)
        np.testing.assert_array_equal(packed.numpy(), expected)
        np.testing.assert_array_equal(ops.unpack_bits(packed, width, n, backend=backend).numpy(), x)


# ------------------------------------------------------------------------------------------------
# Lengths.


@pytest.mark.parametrize("width", WIDTHS)
def test_packed_length_formula(width):
    for count in [0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 1000, 10**9]:
        assert ops.packed_length(count, width) == -(-count * width // 8)
        assert ops.packed_length(count, width) * 8 >= count * width
        assert ops.packed_length(count, width) * 8 < count * width + 8


def test_packed_length_examples_and_errors():
    assert ops.packed_length(4, 2) == 1
    assert ops.packed_length(5, 2) == 2
    assert ops.packed_length(3, 20) == 8
    assert ops.packed_length(0, 32) == 0
    with pytest.raises(ValueError):
        ops.packed_length(-1, 8)
    with pytest.raises(ValueError):
        ops.packed_length(10, 0)
    with pytest.raises(ValueError):
        ops.packed_length(10, 33)
    with pytest.raises(TypeError):
        ops.packed_length(1.5, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_lengths(backend):
    for width in (1, 2, 5, 20, 32):
        for n in (0, 1, 3, 4, 5, 17):
            x = np.zeros(n, np.int32)
            assert ops.pack_bits(x, width, backend=backend).shape == (ops.packed_length(n, width),)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend):
    for width in (1, 13, 32):
        packed = ops.pack_bits(np.zeros(0, np.int32), width, backend=backend)
        assert packed.dtype == tf.uint8 and packed.shape == (0,)
        out = ops.unpack_bits(np.zeros(0, np.uint8), width, 0, backend=backend)
        assert out.dtype == tf.int32 and out.shape == (0,)


# ------------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1, 2, 7, 8, 20, 31])
def test_out_of_range_value_raises(backend, width):
    x = np.zeros(100, np.uint32)
    x[37] = 2**width  # first invalid value
    x[80] = 2**width + 5
    x = x.view(np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        ops.pack_bits(x, width, backend=backend)
    msg = info.value.message
    assert f"value {2 ** width} " in msg
    assert "position 37 " in msg
    assert f"width {width} " in msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_value_raises_below_width_32(backend):
    x = np.array([0, 1, -1], np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        ops.pack_bits(x, 31, backend=backend)
    assert "value 4294967295 (int32 -1) at position 2 does not fit in width 31 " in info.value.message


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("delta", [-1, 1, 5])
def test_wrong_packed_length_raises(backend, delta):
    width, count = 20, 9  # needs 23 bytes
    packed = np.zeros(ops.packed_length(count, width) + delta, np.uint8)
    with pytest.raises(tf.errors.InvalidArgumentError, match="23 bytes"):
        ops.unpack_bits(packed, width, count, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_count_tensor_raises(backend):
    with pytest.raises(tf.errors.InvalidArgumentError):
        ops.unpack_bits(np.zeros(0, np.uint8), 4, tf.constant(-1), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise_in_python(backend):
    with pytest.raises(ValueError):
        ops.pack_bits([1], 0, backend=backend)
    with pytest.raises(ValueError):
        ops.pack_bits([1], 33, backend=backend)
    with pytest.raises(TypeError):
        ops.pack_bits([1], 2.0, backend=backend)
    with pytest.raises(TypeError):
        ops.pack_bits(np.array([1.0], np.float32), 2, backend=backend)
    with pytest.raises(ValueError):
        ops.pack_bits(np.zeros((2, 2), np.int32), 2, backend=backend)
    with pytest.raises(ValueError):
        ops.unpack_bits(np.zeros(1, np.uint8), 2, -1, backend=backend)
    with pytest.raises(ValueError):
        ops.pack_bits([1], 2, backend="fast")
    with pytest.raises(ValueError):  # not silently wrapped to 32 bits
        ops.pack_bits(np.array([2**40], np.int64), 2, backend=backend)
    with pytest.raises(TypeError):
        ops.pack_bits(tf.constant([1], tf.int64), 2, backend=backend)
    with pytest.raises(TypeError):
        ops.unpack_bits(tf.constant([1], tf.int32), 2, 1, backend=backend)
    with pytest.raises(ValueError):
        ops.unpack_bits([256], 8, 1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_lists_and_int64_arrays(backend):
    assert ops.pack_bits([1, 2, 3], 2, backend=backend).numpy().tolist() == [57]
    assert ops.pack_bits(np.array([1, 2, 3], np.int64), 2, backend=backend).numpy().tolist() == [57]
    assert ops.pack_bits([2**32 - 1], 32, backend=backend).numpy().tolist() == [255] * 4
    assert ops.pack_bits([], 3, backend=backend).numpy().tolist() == []
    assert ops.unpack_bits([57], 2, 3, backend=backend).numpy().tolist() == [1, 2, 3]
    assert ops.unpack_bits([], 2, 0, backend=backend).numpy().tolist() == []


@needs_custom
def test_raw_kernel_validates_width_attr():
    lib = ops.load()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lib.hgsgc_pack_bits(tf.constant([1], tf.int32), width=33)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lib.hgsgc_unpack_bits(tf.constant([1], tf.uint8), tf.constant(1), width=0)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lib.hgsgc_pack_bits(tf.zeros([2, 2], tf.int32), width=3)


# ------------------------------------------------------------------------------------------------
# tf.function.


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_tf_function_static_shapes(backend):
    @tf.function
    def round_trip(x):
        packed = ops.pack_bits(x, 20, backend=backend)
        return packed, ops.unpack_bits(packed, 20, 10, backend=backend)

    x = random_values(20, 10, seed=3)
    cf = round_trip.get_concrete_function(tf.TensorSpec([10], tf.int32))
    packed_spec, values_spec = cf.structured_outputs
    assert packed_spec.shape.as_list() == [25]
    assert values_spec.shape.as_list() == [10]
    packed, values = round_trip(tf.constant(x))
    np.testing.assert_array_equal(packed.numpy(), np_pack(x, 20))
    np.testing.assert_array_equal(values.numpy(), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_tf_function_dynamic_shapes_and_errors(backend):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def pack(x):
        return ops.pack_bits(x, 7, backend=backend)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.uint8), tf.TensorSpec([], tf.int32)])
    def unpack(p, count):
        return ops.unpack_bits(p, 7, count, backend=backend)

    for n in (0, 1, 9, 1000):
        x = random_values(7, n, seed=n)
        packed = pack(tf.constant(x))
        np.testing.assert_array_equal(packed.numpy(), np_pack(x, 7))
        np.testing.assert_array_equal(unpack(packed, tf.constant(n)).numpy(), x)
    with pytest.raises(tf.errors.InvalidArgumentError, match="position 1"):
        pack(tf.constant([1, 128, 0], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError):
        unpack(tf.zeros([3], tf.uint8), tf.constant(5))


# ------------------------------------------------------------------------------------------------
# Backend selection and loading.


def test_set_backend(monkeypatch):
    monkeypatch.setattr(ops, "_backend", ops.get_backend())  # restored after the test
    with pytest.raises(ValueError):
        ops.set_backend("gpu")

    def broken_load():
        raise RuntimeError("no library")

    monkeypatch.setattr(ops, "load", broken_load)
    ops.set_backend("reference")
    assert ops.get_backend() == "reference"
    assert ops.pack_bits([1, 2, 3], 2).numpy().tolist() == [57]  # never calls load()
    ops.set_backend("custom")
    with pytest.raises(RuntimeError):
        ops.pack_bits([1, 2, 3], 2)
    assert ops.pack_bits([1, 2, 3], 2, backend="reference").numpy().tolist() == [57]


@needs_custom
def test_auto_backend_uses_custom_library():
    lib = ops.load()
    assert lib is ops.load()  # cached
    assert ops.available()

    @tf.function
    def f(x):
        return ops.pack_bits(x, 3, backend="auto")

    graph = f.get_concrete_function(tf.TensorSpec([4], tf.int32)).graph
    assert "HgsgcPackBits" in {op.type for op in graph.get_operations()}


def test_missing_library_message(monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "_HERE", str(tmp_path))
    monkeypatch.setattr(ops, "_LIB", None)
    monkeypatch.setattr(ops, "_LOAD_ERROR", None)
    with pytest.raises(RuntimeError, match=r"pip install --no-build-isolation -e \."):
        ops.load()
    with pytest.raises(RuntimeError, match="make install"):
        ops.load()  # failure is cached
    assert not ops.available()
    # "auto" falls back to the reference.
    assert ops.pack_bits([5, 3, 7], 3, backend="auto").numpy().tolist() == [0b11011101, 1]


def test_module_does_not_import_horovod_or_mpi4py():
    path = os.path.join(os.path.dirname(__file__), "..", "hgsgc", "ops.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('hgsgc_ops_isolated', {os.path.abspath(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "bad = [m for m in ('horovod', 'mpi4py') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
