"""hgsgc's custom TensorFlow kernels and their pure-TensorFlow references.

Two groups of ops, each with a C++ kernel (``hgsgc/_ops*.so``, built from ``ops/*.cc``) and a
pure-TensorFlow reference that gives the same result bit for bit:

* bit packing (this docstring, below): :func:`pack_bits` / :func:`unpack_bits`;
* fused sparse compression (``ops/sparse_codec.cc``): loaded here (:func:`load`, backend
  setting :func:`set_compression_backend`), wrapped with their pure-TF references in
  :mod:`hgsgc.compression.kernels` (which needs the wire codec; this module stays at the bottom
  of the import graph and imports nothing of hgsgc).

Bit packing of unsigned integers of arbitrary width (1..32 bits) for the wire codec.
Two implementations with the same bit layout, bit for bit:

* ``"custom"``: the C++ kernels ``HgsgcPackBits`` / ``HgsgcUnpackBits`` from ``ops/pack_bits.cc``,
  compiled into ``hgsgc/_ops*.so`` by ``setup.py`` and loaded with :func:`load`.
* ``"reference"``: :func:`pack_bits_reference` / :func:`unpack_bits_reference`, plain TensorFlow
  ops (``tf.bitwise`` etc.), slower but available everywhere.

:func:`pack_bits` / :func:`unpack_bits` pick one per call: the ``backend=`` argument if given,
else the module setting (:func:`set_backend`; initially ``$HGSGC_OPS_BACKEND`` or ``"auto"``);
``"auto"`` means the custom kernel when the library loads, else the reference. Inside a
``tf.function`` the choice is made when the function is traced.

Bit stream layout (little-endian): value ``i`` occupies stream bits ``[i*width, (i+1)*width)``,
least significant bit first; stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``; the unused high
bits of the last byte are 0 (and are ignored when unpacking). Values are taken as uint32 bit
patterns, so ``n`` values take :func:`packed_length` ``(n, width) = ceil(n * width / 8)`` bytes.
For example ``pack_bits([1, 2, 3], 2)`` is ``[0b00111001] = [57]`` (one byte).

This module imports only TensorFlow and NumPy (never horovod or mpi4py).
"""
from __future__ import annotations

import glob
import importlib.machinery
import os
import threading
import warnings

import numpy as np
import tensorflow as tf

__all__ = [
    "BACKENDS",
    "MAX_WIDTH",
    "available",
    "library_path",
    "get_backend",
    "load",
    "pack_bits",
    "pack_bits_reference",
    "packed_length",
    "set_backend",
    "unpack_bits",
    "unpack_bits_reference",
    "set_compression_backend",
    "use_compression_kernels",
]

MIN_WIDTH = 1
MAX_WIDTH = 32
#: Accepted values of :func:`set_backend` and of the ``backend=`` arguments.
BACKENDS = ("auto", "custom", "reference")

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.Lock()
_LIB = None  # the loaded op library, once loaded
_LOAD_ERROR = None  # the RuntimeError message of a failed load, cached like a success
_backend = "auto"


# ------------------------------------------------------------------------------------------------
# Library loading and backend selection.


def _library_path():
    """Path of the compiled ``_ops*.so`` next to this file, or ``None``."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # this interpreter's ABI first
        path = os.path.join(_HERE, "_ops" + suffix)
        if os.path.isfile(path):
            return path
    found = sorted(glob.glob(os.path.join(_HERE, "_ops*.so")))
    return found[0] if found else None


def library_path():
    """Path of the compiled ``hgsgc/_ops*.so`` (this interpreter's ABI first), or ``None``. Besides
    the ops it exports plain C functions (the Hourglass boundary quantizers,
    ``ops/boundary_codec.cc``) that :mod:`hgsgc.hourglass.boundary` calls through ``ctypes``."""
    return _library_path()


def load():
    """Load the custom op library ``hgsgc/_ops*.so`` (``tf.load_op_library``), once per process.

    Returns:
        The loaded module: ``hgsgc_pack_bits`` / ``hgsgc_unpack_bits`` (``ops/pack_bits.cc``) and
        the fused compression ops ``hgsgc_topk_select``, ``hgsgc_sparse_encode``,
        ``hgsgc_compress``, ``hgsgc_compress_residual``, ``hgsgc_decode_accumulate``
        (``ops/sparse_codec.cc``; called through :mod:`hgsgc.compression.kernels`, which checks
        their arguments and documents shapes and errors).

    Raises:
        RuntimeError: the library is missing or does not load (e.g. built against another
            TensorFlow). The outcome, success or failure, is cached for the process.
    """
    global _LIB, _LOAD_ERROR
    with _LOCK:
        if _LIB is not None:
            return _LIB
        if _LOAD_ERROR is None:
            path = _library_path()
            hint = (
                "build it with `make install` or `pip install --no-build-isolation -e .` in the "
                "repository root (or `python setup.py build_ext --inplace` for a source checkout)"
            )
            if path is None:
                _LOAD_ERROR = (
                    f"hgsgc custom ops library (_ops*.so) not found in {_HERE}: {hint}; "
                    "or use hgsgc.ops.set_backend('reference')"
                )
            else:
                try:
                    _LIB = tf.load_op_library(path)
                    return _LIB
                except (tf.errors.OpError, OSError) as exc:  # e.g. NotFoundError: undefined symbol
                    _LOAD_ERROR = (
                        f"could not load hgsgc custom ops from {path} ({exc}); it may be built "
                        f"against another TensorFlow than {tf.__version__}: rebuild it: {hint}"
                    )
        raise RuntimeError(_LOAD_ERROR)


def available():
    """``True`` if the custom op library loads (see :func:`load`), else ``False``."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def _check_backend(name):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name):
    """Choose the implementation of :func:`pack_bits` / :func:`unpack_bits` for this process.

    Args:
        name: ``"custom"`` (the C++ kernels; calls raise ``RuntimeError`` if the library is
            missing), ``"reference"`` (pure TensorFlow) or ``"auto"`` (custom if available).

    Raises:
        ValueError: unknown name.
    """
    global _backend
    _backend = _check_backend(name)


def get_backend():
    """The module-level backend setting: ``"auto"``, ``"custom"`` or ``"reference"``."""
    return _backend


_WARNED = False


def _resolve(backend):
    global _WARNED
    name = _check_backend(_backend if backend is None else backend)
    if name == "auto":
        if available():
            return "custom"
        if not _WARNED:  # once per process: the reference path is correct, only slower
            _WARNED = True
            warnings.warn(f"{_LOAD_ERROR}; hgsgc uses the pure-TensorFlow reference ops instead "
                          "(same results, slower)", RuntimeWarning, stacklevel=3)
        return "reference"
    return name


_backend = _check_backend(os.environ.get("HGSGC_OPS_BACKEND", "auto"))
#: Backend of the fused compression kernels (topk_select ... decode_accumulate) when a call passes
#: ``backend=None``: ``$HGSGC_COMPRESSION_KERNELS`` (auto | custom | reference), default "auto".
#: Separate from the bit-packing setting, so the reference compression path can be timed with the
#: packing kernels it uses today (scripts/bench_kernels.py).
_compression_backend = _check_backend(os.environ.get("HGSGC_COMPRESSION_KERNELS", "auto"))


def set_compression_backend(name):
    """Choose the implementation of the fused compression ops for this process (see
    :func:`set_backend`; ``"reference"`` makes hgsgc use the pure-TF path).

    Raises:
        ValueError: unknown name.
    """
    global _compression_backend
    _compression_backend = _check_backend(name)


def _resolve_compression(backend):
    return _resolve(_compression_backend if backend is None else backend)


def use_compression_kernels():
    """Whether the fused compression ops run their C++ kernels under the module setting
    (``"auto"`` and the library loads, or ``"custom"``); else the pure-TF reference path
    (warned once by ``"auto"`` when the library is missing)."""
    return _resolve_compression(None) == "custom"


# ------------------------------------------------------------------------------------------------
# Argument handling.


def _check_width(width):
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise TypeError(f"width must be a Python int in [{MIN_WIDTH}, {MAX_WIDTH}], got {width!r}")
    width = int(width)
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(f"width must be in [{MIN_WIDTH}, {MAX_WIDTH}], got {width}")
    return width


def packed_length(count, width):
    """Bytes taken by ``count`` values of ``width`` bits: ``ceil(count * width / 8)``.

    Args:
        count: number of values, a Python int >= 0.
        width: bits per value, 1..32.

    Returns:
        int.

    Raises:
        ValueError: ``count < 0`` or ``width`` outside 1..32. TypeError: non-integer arguments.
    """
    width = _check_width(width)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"count must be a Python int >= 0, got {count!r}")
    count = int(count)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return (count * width + 7) // 8


def _integer_array(obj, what):
    """NumPy integer array from a non-tensor (lists, arrays, scalars); empty lists are allowed."""
    arr = np.asarray(obj)
    if arr.size == 0 and arr.dtype.kind in "fbO":
        arr = arr.astype(np.int64)  # [] -> float64 by default
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr


def _as_values(values):
    """int32 ``[n]`` tensor from int32/uint32 values (uint32 is bit-cast, not converted).

    Tensors must be int32 or uint32. Other array-likes must be integers that fit in 32 bits
    (``[-2**31, 2**32)``); they are never silently wrapped or cast from floats.
    """
    if tf.is_tensor(values):
        x = tf.convert_to_tensor(values)
    else:
        arr = _integer_array(values, "values")
        if arr.dtype not in (np.int32, np.uint32):
            lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
            if lo < -(2**31) or hi >= 2**32 or (lo < 0 and hi >= 2**31):
                raise ValueError(f"values must fit in 32 bits (int32 or uint32), got range [{lo}, {hi}]")
            arr = arr.astype(np.int32 if hi < 2**31 else np.uint32)
        x = tf.constant(arr)
    if x.dtype == tf.uint32:
        x = tf.bitcast(x, tf.int32)
    if x.dtype != tf.int32:
        raise TypeError(
            f"values must be int32 (or uint32), got {x.dtype.name}; cast explicitly, "
            "e.g. tf.cast(values, tf.int32)"
        )
    if x.shape.rank is not None and x.shape.rank != 1:
        raise ValueError(f"values must be 1-D, got shape {x.shape}")
    return x


def _as_packed(packed):
    """uint8 ``[m]`` tensor; non-tensors may be ``bytes`` or integers in ``[0, 256)``."""
    if tf.is_tensor(packed):
        x = tf.convert_to_tensor(packed)
    else:
        if isinstance(packed, (bytes, bytearray, memoryview)):
            arr = np.frombuffer(packed, dtype=np.uint8)
        else:
            arr = _integer_array(packed, "packed")
            if arr.dtype != np.uint8:
                if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 255):
                    raise ValueError("packed must hold bytes in [0, 256)")
                arr = arr.astype(np.uint8)
        x = tf.constant(arr)
    if x.dtype != tf.uint8:
        raise TypeError(f"packed must be uint8, got {x.dtype.name}")
    if x.shape.rank is not None and x.shape.rank != 1:
        raise ValueError(f"packed must be 1-D, got shape {x.shape}")
    return x


def _as_count(count):
    if isinstance(count, (int, np.integer)) and not isinstance(count, bool):
        if not 0 <= int(count) < 2**31:
            raise ValueError(f"count must be in [0, 2**31), got {int(count)}")
        return tf.constant(int(count), tf.int32)
    x = tf.convert_to_tensor(count)
    if not x.dtype.is_integer:
        raise TypeError(f"count must be an integer scalar, got {x.dtype.name}")
    if x.shape.rank is not None and x.shape.rank != 0:
        raise ValueError(f"count must be a scalar, got shape {x.shape}")
    return tf.cast(x, tf.int32)


# ------------------------------------------------------------------------------------------------
# Public ops.


def pack_bits(values, width, backend=None, name=None):
    """Pack ``n`` unsigned integers of ``width`` bits each into ``ceil(n * width / 8)`` bytes.

    Args:
        values: int32 ``[n]`` (or uint32, bit-cast), values in ``[0, 2**width)`` read as uint32
            bit patterns (for ``width == 32`` every int32, negative ones included, is valid).
            Anything ``tf.convert_to_tensor`` accepts; ``n`` may be 0.
        width: bits per value, a Python int in 1..32.
        backend: ``"custom"``, ``"reference"``, ``"auto"`` or ``None`` (the module setting,
            see :func:`set_backend`).
        name: optional name scope.

    Returns:
        uint8 ``[packed_length(n, width)]`` in the layout of the module docstring (static length
        when ``n`` is static).

    Raises:
        tf.errors.InvalidArgumentError: a value ``>= 2**width`` (names the value, its position and
            the width; raised when the op runs).
        ValueError / TypeError: bad ``width``, ``backend``, dtype or rank.
        RuntimeError: ``backend="custom"`` and the library is unavailable.
    """
    width = _check_width(width)
    if _resolve(backend) == "reference":
        return pack_bits_reference(values, width, name=name)
    lib = load()
    with tf.name_scope(name or "pack_bits"):
        return lib.hgsgc_pack_bits(_as_values(values), width=width)


def unpack_bits(packed, width, count, backend=None, name=None):
    """Inverse of :func:`pack_bits`: read ``count`` values of ``width`` bits from ``packed``.

    Args:
        packed: uint8 ``[packed_length(count, width)]`` (or ``bytes``); the padding bits of the
            last byte are ignored.
        width: bits per value, a Python int in 1..32.
        count: number of values, a Python int or an integer scalar tensor, >= 0.
        backend: ``"custom"``, ``"reference"``, ``"auto"`` or ``None`` (module setting).
        name: optional name scope.

    Returns:
        int32 ``[count]`` (static length when ``count`` is a Python int); values in
        ``[0, 2**width)``, except that width-32 values are uint32 bit patterns (may be negative).

    Raises:
        tf.errors.InvalidArgumentError: ``len(packed) != ceil(count * width / 8)`` or a negative
            tensor ``count``.
        ValueError / TypeError: bad ``width``, ``backend``, Python ``count``, dtype or rank.
        RuntimeError: ``backend="custom"`` and the library is unavailable.
    """
    width = _check_width(width)
    if _resolve(backend) == "reference":
        return unpack_bits_reference(packed, width, count, name=name)
    lib = load()
    with tf.name_scope(name or "unpack_bits"):
        return lib.hgsgc_unpack_bits(_as_packed(packed), _as_count(count), width=width)


# ------------------------------------------------------------------------------------------------
# Pure-TensorFlow reference (bit matrices; memory O(n * width)).

_BYTE_SHIFTS = np.arange(8, dtype=np.uint8)


def pack_bits_reference(values, width, name=None):
    """Pure-TensorFlow :func:`pack_bits` (same layout, same result bit for bit, same errors).

    Builds the ``[n, width]`` bit matrix with ``tf.bitwise`` shifts, flattens it to the bit
    stream, pads it to whole bytes and sums each byte's bits times ``1, 2, ..., 128``. Usable
    inside ``tf.function``; memory is ``O(n * width)``.

    Args:
        values: int32 (or uint32) ``[n]``, values in ``[0, 2**width)``.
        width: bits per value, a Python int in 1..32.
        name: optional name scope.

    Returns:
        uint8 ``[ceil(n * width / 8)]``.

    Raises:
        tf.errors.InvalidArgumentError: a value ``>= 2**width`` (message names value, position
            and width).
        ValueError / TypeError: bad ``width``, dtype or rank.
    """
    width = _check_width(width)
    with tf.name_scope(name or "pack_bits_reference"):
        values = _as_values(values)
        bits32 = tf.bitcast(values, tf.uint32)
        n = tf.shape(values, out_type=tf.int64)[0]
        deps = []
        if width < 32:
            bad = tf.not_equal(tf.bitwise.right_shift(bits32, tf.constant(width, tf.uint32)), 0)
            pos = tf.reduce_min(tf.where(bad, tf.range(n), n))  # n if none is bad
            val = tf.gather(tf.concat([values, [0]], 0), tf.minimum(pos, n))
            as_int = tf.where(val < 0, tf.strings.format(" (int32 {})", val), "")
            msg = tf.strings.join(
                [
                    tf.strings.format(
                        "HgsgcPackBits (reference): value {}", tf.bitcast(val, tf.uint32)
                    ),
                    as_int,
                    tf.strings.format(
                        " at position {} does not fit in width "
                        f"{width} bits (values must be in [0, {2 ** width}))",
                        pos,
                    ),
                ]
            )
            deps.append(tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [msg]))
        with tf.control_dependencies(deps):
            shifts = tf.constant(np.arange(width, dtype=np.uint32))
            bits = tf.bitwise.bitwise_and(
                tf.bitwise.right_shift(tf.expand_dims(bits32, 1), shifts), tf.constant(1, tf.uint32)
            )  # [n, width], bit k of value i
            stream = tf.cast(tf.reshape(bits, [-1]), tf.uint8)  # [n * width]
            static_n = values.shape[0]
            if static_n is not None:
                num_bytes = (static_n * width + 7) // 8
                pad = num_bytes * 8 - static_n * width
            else:
                num_bytes = (n * width + 7) // 8
                pad = num_bytes * 8 - n * width
            stream = tf.pad(stream, tf.reshape(tf.cast(tf.stack([0, pad]), tf.int64), [1, 2]))
            grid = tf.reshape(stream, [-1, 8])  # [num_bytes, 8], bit b of byte j
            packed = tf.reduce_sum(
                tf.bitwise.left_shift(grid, tf.constant(_BYTE_SHIFTS)), axis=1
            )  # distinct powers of two: the uint8 sum never overflows
            if static_n is not None:
                packed = tf.ensure_shape(packed, [num_bytes])
            return packed


def unpack_bits_reference(packed, width, count, name=None):
    """Pure-TensorFlow :func:`unpack_bits` (same layout, same result bit for bit, same errors).

    Expands ``packed`` into its ``[m * 8]`` bit stream with ``tf.bitwise`` shifts, keeps the first
    ``count * width`` bits as a ``[count, width]`` matrix and sums each row's bits times
    ``2**k`` in uint32. Usable inside ``tf.function``; memory is ``O(m * 8)``.

    Args:
        packed: uint8 ``[ceil(count * width / 8)]`` (or ``bytes``).
        width: bits per value, a Python int in 1..32.
        count: Python int or integer scalar tensor >= 0.
        name: optional name scope.

    Returns:
        int32 ``[count]``.

    Raises:
        tf.errors.InvalidArgumentError: wrong packed length or negative tensor ``count``.
        ValueError / TypeError: bad ``width``, Python ``count``, dtype or rank.
    """
    width = _check_width(width)
    with tf.name_scope(name or "unpack_bits_reference"):
        packed = _as_packed(packed)
        static_count = int(count) if isinstance(count, (int, np.integer)) else None
        count = tf.cast(_as_count(count), tf.int64)
        m = tf.shape(packed, out_type=tf.int64)[0]
        expected = (count * width + 7) // 8
        deps = [
            tf.debugging.Assert(
                count >= 0,
                [tf.strings.format("HgsgcUnpackBits (reference): count must be >= 0, got {}", count)],
            ),
            tf.debugging.Assert(
                tf.equal(m, expected),
                [
                    tf.strings.format(
                        "HgsgcUnpackBits (reference): packed has {} bytes but {} values of width "
                        f"{width} need ceil({{}} * {width} / 8) = {{}} bytes",
                        (m, count, count, expected),
                    )
                ],
            ),
        ]
        with tf.control_dependencies(deps):
            bits = tf.bitwise.bitwise_and(
                tf.bitwise.right_shift(tf.expand_dims(packed, 1), tf.constant(_BYTE_SHIFTS)),
                tf.constant(1, tf.uint8),
            )  # [m, 8], bit b of byte j
            stream = tf.reshape(bits, [-1])[: count * width]
            rows = tf.reshape(
                tf.cast(stream, tf.uint32), [-1 if static_count is None else static_count, width]
            )
            shifts = tf.constant(np.arange(width, dtype=np.uint32))
            words = tf.reduce_sum(tf.bitwise.left_shift(rows, shifts), axis=1)  # [count] uint32
            return tf.bitcast(words, tf.int32)
