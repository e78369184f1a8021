"""The fused sparse-compression kernels (``ops/sparse_codec.cc``) and their pure-TF references.

The C++ ops are loaded by :mod:`hgsgc.ops` (``ops.load()``; backend setting
``ops.set_compression_backend`` / ``$HGSGC_COMPRESSION_KERNELS``); this module wraps them with
argument checks and gives each a reference in plain TensorFlow that returns the same result bit
for bit: :func:`topk_select` / :func:`topk_select_reference` (``sparsify.sampled_threshold_topk``),
:func:`sparse_encode` / :func:`sparse_encode_reference` (``wire.encode``), :func:`compress` /
:func:`compress_into` / :func:`compress_reference` (compensate + select + encode + residual
update in one pass), :func:`decode_accumulate` / :func:`decode_accumulate_reference`
(decode + dequantize + rank-order sum of all n gathered payloads, optionally ``/ n``),
:func:`momentum_accumulate` / :func:`momentum_mask` (DGC momentum correction, session 10) and
:func:`compress_momentum_into` / :func:`compress_momentum_into_reference` (momentum correction,
error feedback, selection, encoding and masking in one pass, session 11). ``codec.TopKCodec``
calls them.
"""
from __future__ import annotations

import inspect

import numpy as np
import tensorflow as tf

from hgsgc import ops
from hgsgc.compression import wire
from hgsgc.compression.sparsify import sampled_threshold_topk

__all__ = ["DEFAULT_SAMPLE_SIZE", "DEFAULT_MARGIN", "topk_select", "topk_select_reference",
           "sparse_encode", "sparse_encode_reference", "compress", "compress_reference",
           "compress_into", "decode_accumulate", "decode_accumulate_reference",
           "momentum_accumulate", "momentum_accumulate_reference", "momentum_mask",
           "momentum_mask_reference", "compress_momentum_into", "compress_momentum_into_reference"]

# ------------------------------------------------------------------------------------------------
# Fused sparse-compression kernels (ops/sparse_codec.cc) and their references.
#
# Contract (bit for bit, tested in tests/test_kernels.py): the custom kernels return exactly what
# the reference functions below return, which are hgsgc's compression path as the communicator
# runs it. Devices: the kernels are registered per device (REGISTER_KERNEL_BUILDER in
# ops/sparse_codec.cc); only CPU kernels exist, and a GPU kernel can be registered under the same
# op names without changing these wrappers (see the comment at the top of ops/sparse_codec.cc).

DEFAULT_SAMPLE_SIZE = 1024
DEFAULT_MARGIN = 1.5


def _float_vector(x, what):
    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32:
        raise TypeError(f"{what} must be float32, got {x.dtype.name}; cast it with tf.cast({what}, tf.float32)")
    if x.shape.rank != 1 or x.shape[0] is None:
        raise ValueError(f"{what} must be 1-D with a static length, got shape {x.shape}; "
                         f"flatten it with tf.reshape({what}, [-1])")
    return x


def _check_k(k, numel):
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= int(k) <= numel:
        raise ValueError(f"k must be a Python int in [0, numel={numel}], got {k!r}")
    return int(k)


def _check_bits(bits):
    if bits not in (2, 32):
        raise ValueError(f"bits must be 2 or 32, got {bits!r}")
    return int(bits)


def _check_select_args(sample_size, margin):
    if isinstance(sample_size, bool) or not isinstance(sample_size, (int, np.integer)) or sample_size < 1:
        raise ValueError(f"sample_size must be a Python int >= 1, got {sample_size!r}")
    if not float(margin) >= 1.0:
        raise ValueError(f"margin must be >= 1, got {margin!r}")
    return int(sample_size), float(margin)


def _coding_attr(index_coding):
    """The ops' ``index_coding`` attribute as keyword arguments: none for the default "fixed", so
    a library built before the attribute existed still runs the default path."""
    return {} if index_coding == "fixed" else {"index_coding": index_coding}


def _call(op, *args, **kwargs):
    """Call a custom op; a library built before ``index_coding`` existed gets one clear error."""
    try:
        return op(*args, **kwargs)
    except TypeError as exc:
        if "index_coding" in kwargs and "index_coding" in str(exc):
            raise RuntimeError("compression.index_coding=elias_fano needs the custom ops rebuilt "
                               "(the loaded hgsgc/_ops*.so predates it): run `python setup.py "
                               "build_ext --inplace` (or `make install`)") from exc
        raise


def _seed64(seed):
    """int64 scalar seed for the kernels (None: a fixed seed; an int32 [2] pair is combined)."""
    if seed is None:
        return tf.constant(7 * 2**32 + 11, tf.int64)
    t = tf.cast(tf.convert_to_tensor(seed), tf.int64)
    if t.shape.rank == 1:
        return t[0] * (2**32) + t[1]
    return t


def _seed_pair(seed):
    """int32 [2] seed for the reference's tf.random.stateless_uniform (None: its default)."""
    if seed is None:
        return None
    t = tf.convert_to_tensor(seed)
    if t.shape.rank == 1:
        return tf.cast(t, tf.int32)
    t = tf.cast(t, tf.int64)
    return tf.stack([tf.cast(t % (2**30), tf.int32), tf.constant(1013, tf.int32)])


def topk_select(x, k, sample_size=DEFAULT_SAMPLE_SIZE, margin=DEFAULT_MARGIN, seed=None,
                backend=None):
    """Exact top-k by magnitude of a float32 vector, found through a sampled threshold.

    Deep Gradient Compression's selection (Lin et al., ICLR 2018, Sec. 3): estimate the
    threshold on ``min(numel, sample_size)`` sampled magnitudes, keep the candidates above it in
    one pass, take the exact top-k of the candidates (exact fallback when too few pass). The
    result equals ``hgsgc.compression.sparsify.exact_topk`` (largest ``|x|``, ties to the lower
    index, subnormals compared as 0 like TF's CPU kernels); the seed changes only the speed.

    Args:
        x: float32 ``[numel]`` (static length). k: Python int in ``[0, numel]``.
        sample_size: entries sampled for the estimate; margin: over-selection factor (>= 1).
        seed: integer scalar (or int32 ``[2]``) tensor or int; None: a fixed seed.
        backend: ``"custom"``, ``"reference"``, ``"auto"`` or None (the module setting,
            :func:`set_compression_backend` / ``$HGSGC_COMPRESSION_KERNELS``).

    Returns:
        ``(indices int32 [k] ascending, values float32 [k] = x[indices])``.

    Raises:
        ValueError / TypeError: bad ``x``, ``k``, ``sample_size`` or ``margin``.
        RuntimeError: ``backend="custom"`` and the library is unavailable.
    """
    x = _float_vector(x, "x")
    k = _check_k(k, int(x.shape[0]))
    sample_size, margin = _check_select_args(sample_size, margin)
    if ops._resolve_compression(backend) == "reference":
        return topk_select_reference(x, k, sample_size, margin, seed)
    return ops.load().hgsgc_topk_select(x, _seed64(seed), k=k, sample_size=sample_size, margin=margin)


def topk_select_reference(x, k, sample_size=DEFAULT_SAMPLE_SIZE, margin=DEFAULT_MARGIN, seed=None):
    """Reference of :func:`topk_select`: ``sparsify.sampled_threshold_topk`` (same arguments)."""
    x = _float_vector(x, "x")
    return sampled_threshold_topk(x, _check_k(k, int(x.shape[0])), sample_size=sample_size,
                                  margin=margin, seed=_seed_pair(seed))


def sparse_encode(indices, values, numel, bits, backend=None, index_coding="fixed"):
    """Fused 2-bit quantization + bit packing of selected entries into the wire payload.

    Same payload as ``hgsgc.compression.codec.encode`` byte for byte (layout in
    :mod:`hgsgc.compression.wire`: ``[lo, hi] f32 | index section | codes 2 bits`` for ``bits=2``,
    ``index section | values f32`` for ``bits=32``; the index section holds ``w =
    wire.index_width(numel)`` bits per index (``"fixed"``) or the Elias-Fano code).

    Args:
        indices: int32 ``[k]`` strictly ascending in ``[0, numel)``; values: float32 ``[k]``.
        numel: entries of the dense tensor (Python int); bits: 2 or 32.
        backend: see :func:`topk_select`.
        index_coding: ``"fixed"`` (``w`` bits per index) or ``"elias_fano"`` (the index section
            in the Elias-Fano layout of :mod:`hgsgc.compression.wire`).

    Returns:
        ``(payload uint8 [wire.payload_length(numel, k, bits, index_coding)], sent float32 [k])``; ``sent`` is
        what a receiver decodes (the quantized values for ``bits=2``).

    Raises:
        tf.errors.InvalidArgumentError: indices not strictly ascending in ``[0, numel)`` (custom:
            any coding; reference: ``"elias_fano"`` only), or ``numel >= 2^31`` (custom).
        ValueError / TypeError: bad shapes, dtypes, ``bits`` or ``index_coding``; ``numel >=
            2^31`` (reference).
        RuntimeError: the custom library is missing (``backend="custom"``) or predates
            ``index_coding`` (``"elias_fano"``: rebuild it).
    """
    bits = _check_bits(bits)
    wire.check_index_coding(index_coding)
    values = _float_vector(values, "values")
    indices = tf.convert_to_tensor(indices, tf.int32)
    if indices.shape.rank != 1 or indices.shape[0] != values.shape[0]:
        raise ValueError(f"indices {indices.shape} and values {values.shape} must be 1-D of the same length")
    _check_k(int(values.shape[0]), int(numel))
    if ops._resolve_compression(backend) == "reference":
        return sparse_encode_reference(indices, values, numel, bits, index_coding)
    return _call(ops.load().hgsgc_sparse_encode, indices, values, numel=int(numel), bits=bits,
                 **_coding_attr(index_coding))


def sparse_encode_reference(indices, values, numel, bits, index_coding="fixed"):
    """Reference of :func:`sparse_encode`: ``hgsgc.compression.codec.encode``."""
    return wire.encode(tf.convert_to_tensor(indices, tf.int32),
                        tf.convert_to_tensor(values, tf.float32), int(numel), _check_bits(bits),
                        index_coding)


def compress(grad, residual, k, bits, sample_size=DEFAULT_SAMPLE_SIZE, margin=DEFAULT_MARGIN,
             seed=None, backend=None, index_coding="fixed"):
    """One rank's sparse compression of one tensor, fused into one pass over its entries.

    With error feedback (Seide et al. 2014; Lin et al. 2018): ``a = grad + residual``
    (compensate), ``(idx, v) = top-k(a)`` (:func:`topk_select`), ``payload, sent =
    encode(idx, v)`` (:func:`sparse_encode`), ``new_residual = a - scatter(idx, sent)``. The
    kernel computes ``a`` and collects the top-k candidates in the same pass and writes
    ``new_residual`` in place of ``a`` (it may reuse ``grad``'s buffer): the only dense memory is
    the new residual, one float32 copy of the tensor.

    Args:
        grad: float32 ``[numel]``; residual: float32 ``[numel]`` or None (no error feedback).
        k: Python int in ``[0, numel]``; bits: 2 or 32; sample_size, margin, seed: as
        :func:`topk_select`; backend: see :func:`topk_select`; index_coding: ``"fixed"`` or
        ``"elias_fano"`` (:mod:`hgsgc.compression.wire`).

    Returns:
        ``(payload uint8 [wire.payload_length(numel, k, bits, index_coding)], new_residual
        float32 [numel] or None when residual is None)``.

    Raises:
        ValueError / TypeError: bad shapes, dtypes, ``k``, ``bits``, ``sample_size``, ``margin``
            or ``index_coding``.
        RuntimeError: the custom library is missing (``backend="custom"``) or predates
            ``index_coding`` (``"elias_fano"``: rebuild it).
    """
    grad = _float_vector(grad, "grad")
    numel = int(grad.shape[0])
    k = _check_k(k, numel)
    bits = _check_bits(bits)
    sample_size, margin = _check_select_args(sample_size, margin)
    wire.check_index_coding(index_coding)
    if residual is not None:
        residual = _float_vector(residual, "residual")
        if int(residual.shape[0]) != numel:
            raise ValueError(f"residual has {residual.shape[0]} entries but grad has {numel}")
    if ops._resolve_compression(backend) == "reference":
        return compress_reference(grad, residual, k, bits, sample_size, margin, seed, index_coding)
    res = residual if residual is not None else tf.zeros([0], tf.float32)
    payload, new_res = _call(ops.load().hgsgc_compress, grad, res, _seed64(seed), k=k, bits=bits,
                             sample_size=sample_size, margin=margin, **_coding_attr(index_coding))
    return payload, (new_res if residual is not None else None)


def compress_into(grad, residual, k, bits, sample_size=DEFAULT_SAMPLE_SIZE, margin=DEFAULT_MARGIN,
                  seed=None, backend=None, index_coding="fixed"):
    """:func:`compress` with the residual a ``tf.Variable``, updated in place.

    The kernel (``HgsgcCompressResidual``) reads ``grad`` and the residual once and writes the new
    residual over the old one under the variable's lock: no dense tensor is allocated (unless the
    variable's buffer is shared with a live read, then it is replaced copy-on-write).

    Args:
        grad: float32 tensor of any static shape, ``numel`` entries; residual: float32
            ``tf.Variable`` with ``numel`` entries (any shape). Other arguments: :func:`compress`.

    Returns:
        payload uint8 ``[wire.payload_length(numel, k, bits, index_coding)]``; the variable holds
        ``a - scatter(idx, sent)`` afterwards (``a = grad + residual``), bit for bit as
        :func:`compress_reference`. Inside a ``tf.function`` the update is ordered before any
        later read of the variable (automatic control dependencies).

    Raises:
        ValueError / TypeError: bad shapes, dtypes, ``k``, ``bits``, ``sample_size``, ``margin``
            or ``index_coding``.
        RuntimeError: the custom library is missing (``backend="custom"``) or predates
            ``index_coding`` (``"elias_fano"``: rebuild it).
    """
    grad, numel = _check_grad_and_residual_variable(grad, residual)
    k = _check_k(k, numel)
    bits = _check_bits(bits)
    sample_size, margin = _check_select_args(sample_size, margin)
    wire.check_index_coding(index_coding)
    if ops._resolve_compression(backend) == "reference":
        payload, new_res = compress_reference(tf.reshape(grad, [-1]), tf.reshape(residual, [-1]), k,
                                              bits, sample_size, margin, seed, index_coding)
        with tf.control_dependencies([residual.assign(tf.reshape(new_res, residual.shape))]):
            return tf.identity(payload)
    return _call(ops.load().hgsgc_compress_residual, grad, residual.handle, _seed64(seed), k=k,
                 bits=bits, sample_size=sample_size, margin=margin, **_coding_attr(index_coding))


def compress_reference(grad, residual, k, bits, sample_size=DEFAULT_SAMPLE_SIZE,
                       margin=DEFAULT_MARGIN, seed=None, index_coding="fixed"):
    """Reference of :func:`compress`: the communicator's path (``ResidualMemory.compensate``,
    ``sampled_threshold_topk``, ``codec.encode``, ``a - tf.scatter_nd(idx, sent)``)."""
    grad = _float_vector(grad, "grad")
    numel = int(grad.shape[0])
    a = grad + residual if residual is not None else grad
    idx, vals = sampled_threshold_topk(a, k, sample_size=sample_size, margin=margin,
                                       seed=_seed_pair(seed))
    payload, sent = wire.encode(idx, vals, numel, bits, index_coding)
    if residual is None:
        return payload, None
    return payload, a - tf.scatter_nd(idx[:, None], sent, [numel])


def _check_gathered(gathered, numel, k, bits, offset, index_coding="fixed"):
    wire.check_index_coding(index_coding)
    gathered = tf.convert_to_tensor(gathered)
    if gathered.dtype != tf.uint8 or gathered.shape.rank != 2 or gathered.shape[0] is None:
        raise ValueError(f"gathered must be uint8 [n, P] with a static n (one row per rank), got "
                         f"{gathered.dtype.name} {gathered.shape}; reshape the allgather output to [n, P]")
    numel = int(numel)
    k = _check_k(k, numel)
    bits = _check_bits(bits)
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise ValueError(f"offset must be a Python int >= 0, got {offset!r}")
    p = wire.payload_length(numel, k, bits, index_coding)
    if gathered.shape[1] is not None and int(gathered.shape[1]) < int(offset) + p:
        raise ValueError(f"rows of {gathered.shape[1]} bytes cannot hold a payload of {p} bytes "
                         f"at offset {offset}")
    return gathered, numel, k, bits, int(offset), p


def _check_divisor(divisor):
    if isinstance(divisor, bool) or not isinstance(divisor, (int, np.integer)) \
            or not 1 <= int(divisor) <= 2**24:
        raise ValueError(f"divisor must be a Python int in [1, 2^24] (exact as a float32; the "
                         f"number of ranks for the average), got {divisor!r}")
    return int(divisor)


def _decode_lib(divisor):
    """The loaded library, when its HgsgcDecodeAccumulate takes ``divisor`` (or none is asked),
    else None (a library built before session 11: divide in TF)."""
    lib = ops.load()
    if divisor == 1:
        return lib
    key = id(lib)
    if key not in _HAS_DIVISOR:
        _HAS_DIVISOR[key] = "divisor" in inspect.signature(lib.hgsgc_decode_accumulate).parameters
    return lib if _HAS_DIVISOR[key] else None


_HAS_DIVISOR = {}  # id(loaded library) -> whether its HgsgcDecodeAccumulate has the divisor attr


def decode_accumulate(gathered, numel, k, bits, offset=0, backend=None, index_coding="fixed",
                      divisor=1):
    """Decode, dequantize and sum every rank's payload of one tensor, in rank order.

    ``sum[i] = ((0 + v_0[i]) + v_1[i]) + ... + v_{n-1}[i]`` over the ranks that sent entry ``i``
    (float32, strictly in rank order; what ``tf.scatter_nd`` of all ranks' entries gives). The
    kernel reads each payload once and adds it straight into the output: no per-rank dense
    tensor. Divide by ``n`` for the average. (Not ``tf.add_n`` of per-rank dense tensors: TF's
    AddN sums groups of 8 and grappler rewrites add trees inside graphs, so for n > 9 its
    rounding differs between eager and graph mode.)

    Args:
        gathered: uint8 ``[n, P]``, row r = rank r's allgathered buffer; this tensor's payload
            (``wire.payload_length(numel, k, bits, index_coding)`` bytes) starts at byte
            ``offset`` of every row (bytes after it are not read).
        numel, k, bits: the tensor's entries, entries sent per rank, 2 or 32 (Python ints).
        offset: byte offset of the payload in each row. backend: see :func:`topk_select`.
        index_coding: ``"fixed"`` or ``"elias_fano"`` (how the payloads' indices are coded).
        divisor: Python int in ``[1, 2^24]``; ``d > 1`` returns ``sum * float32(1 / d)`` (the
            average over ``d`` ranks, each entry scaled right after its sum: the bits of
            ``sum / float(d)`` inside a ``tf.function``, which grappler's constant folding turns
            into a multiplication by the float32 reciprocal; eager TF would divide exactly,
            up to 1 ulp apart for d not a power of 2); 1: the sum.

    Returns:
        float32 ``[numel]``.

    Raises:
        tf.errors.InvalidArgumentError: a payload whose indices reach ``numel`` or are not
            strictly ascending (a duplicate included), naming the rank, entry and index (both
            backends: ``payload of rank R: entry J has index I ...``); an Elias-Fano payload
            whose high part holds fewer than ``k`` set bits in its ``H`` bits (encode never
            produces either; e.g. ranks that disagree on ``index_coding``); rows shorter than
            ``offset`` + the payload length when ``P`` is not static (a static ``P`` is a
            ValueError); ``numel >= 2^31`` (custom).
        ValueError: bad shapes, ``k``, ``bits``, ``offset``, ``index_coding`` or ``divisor``;
            ``numel >= 2^31`` (reference).
        RuntimeError: the custom library is missing (``backend="custom"``) or predates
            ``index_coding`` (``"elias_fano"``: rebuild it).
    """
    gathered, numel, k, bits, offset, _ = _check_gathered(gathered, numel, k, bits, offset, index_coding)
    divisor = _check_divisor(divisor)
    if ops._resolve_compression(backend) == "reference":
        return decode_accumulate_reference(gathered, numel, k, bits, offset, index_coding, divisor)
    lib = _decode_lib(divisor)
    if lib is None:  # a library without the divisor attribute: the same scaling in TF
        return _call(ops.load().hgsgc_decode_accumulate, gathered, numel=numel, k=k, bits=bits,
                     offset=offset, **_coding_attr(index_coding)) * reciprocal(divisor)
    extra = {"divisor": divisor} if divisor != 1 else {}
    return _call(lib.hgsgc_decode_accumulate, gathered, numel=numel, k=k, bits=bits,
                 offset=offset, **_coding_attr(index_coding), **extra)


def decode_accumulate_reference(gathered, numel, k, bits, offset=0, index_coding="fixed", divisor=1):
    """Reference of :func:`decode_accumulate`: ``codec.decode`` of every rank's payload, then one
    ``tf.scatter_nd`` of all entries concatenated in rank order (its CPU kernel adds the updates
    one after another from +0: the strict rank-order sum, in eager and graph mode alike); with
    ``divisor`` > 1, that sum times :func:`reciprocal` ``(divisor)`` (a TF Mul)."""
    divisor = _check_divisor(divisor)
    total = _decode_accumulate_reference_sum(gathered, numel, k, bits, offset, index_coding)
    return total * reciprocal(divisor) if divisor != 1 else total


def reciprocal(n):
    """float32 ``1 / n`` rounded once (numpy): the factor of an average over ``n`` ranks. Inside a
    ``tf.function`` TF computes ``x / float(n)`` as ``x * reciprocal(n)`` (grappler's constant
    folding); multiplying explicitly gives the same bits in eager mode too."""
    return tf.constant(np.float32(1.0) / np.float32(n), tf.float32)


def _decode_accumulate_reference_sum(gathered, numel, k, bits, offset, index_coding):
    gathered, numel, k, bits, offset, p = _check_gathered(gathered, numel, k, bits, offset, index_coding)
    idxs, vals = [], []
    for r in range(int(gathered.shape[0])):
        i, v = wire.decode(gathered[r, offset:offset + p], numel, k, bits, index_coding,
                           what=f"payload of rank {r}: ")
        idxs.append(i)
        vals.append(v)
    if not idxs or k == 0:
        return tf.zeros([numel], tf.float32)
    return tf.scatter_nd(tf.concat(idxs, 0)[:, None], tf.concat(vals, 0), [numel])


# ------------------------------------------------------------------------------------------------
# DGC momentum correction on the velocity variable (ops/momentum_mask.cc), session 10.

def _momentum_ops(backend):
    """The loaded library when the momentum kernels run under ``backend``, else None (the
    reference path: the pure-TF ops below; also when the loaded library predates the ops)."""
    if ops._resolve_compression(backend) == "reference":
        return None
    lib = ops.load()
    return lib if hasattr(lib, "hgsgc_momentum_accumulate") else None


def _check_grad_and_residual_variable(grad, residual):
    """``(grad as a tensor, its numel)`` after checking a float32 gradient of static shape and a
    float32 ``tf.Variable`` residual of as many entries.

    Raises:
        ValueError: either does not match.
    """
    grad = tf.convert_to_tensor(grad)
    if grad.dtype != tf.float32 or not grad.shape.is_fully_defined():
        raise ValueError(f"grad must be float32 with a static shape, got {grad.dtype.name} {grad.shape}")
    numel = int(grad.shape.num_elements())
    if not isinstance(residual, tf.Variable) or residual.dtype != tf.float32 \
            or residual.shape.num_elements() != numel:
        raise ValueError(f"residual must be a float32 tf.Variable of {numel} entries, got {residual!r}")
    return grad, numel


def _check_velocity(velocity, numel, what):
    if not isinstance(velocity, tf.Variable) or velocity.dtype != tf.float32 \
            or velocity.shape.num_elements() != numel:
        raise ValueError(f"{what}: velocity must be a float32 tf.Variable of {numel} entries, got {velocity!r}")


def momentum_accumulate(velocity, grad, momentum, backend=None):
    """DGC momentum correction's accumulation ``u = m v + g`` in one pass (Lin et al. 2018, Sec. 3.2).

    Args:
        velocity: float32 ``tf.Variable`` of ``numel`` entries (read, not written).
        grad: float32 tensor of a static shape with ``numel`` entries.
        momentum: ``m`` (Python float; used as float32). backend: see :func:`topk_select`.

    Returns:
        float32 ``[numel]``: ``float32(m) * v`` rounded, then ``+ g`` rounded, under TF's
        flush-to-zero mode: the bits of :func:`momentum_accumulate_reference`.

    Raises:
        ValueError: bad dtypes or shapes.
    """
    grad = tf.convert_to_tensor(grad)
    if grad.dtype != tf.float32 or not grad.shape.is_fully_defined():
        raise ValueError(f"grad must be float32 with a static shape, got {grad.dtype.name} {grad.shape}")
    numel = int(grad.shape.num_elements())
    _check_velocity(velocity, numel, "momentum_accumulate")
    lib = _momentum_ops(backend)
    if lib is None:
        return momentum_accumulate_reference(velocity, grad, momentum)
    return lib.hgsgc_momentum_accumulate(velocity.handle, grad, momentum=float(momentum))


def momentum_accumulate_reference(velocity, grad, momentum):
    """Reference of :func:`momentum_accumulate`: ``m * v + g`` in TF ops (flat)."""
    return tf.reshape(float(momentum) * velocity + tf.reshape(grad, velocity.shape), [-1])


def momentum_mask(velocity, u, sent, backend=None):
    """DGC momentum factor masking in place: ``v = u`` where ``sent == 0``, ``+0`` elsewhere.

    Args:
        velocity: float32 ``tf.Variable`` of ``numel`` entries (written; copy-on-write when a
            read of it is still alive). u, sent: float32 ``[numel]`` (``sent``: the dense decoded
            own payload; a subnormal counts as 0 and NaN as sent, as ``tf.equal`` on TF's CPU).
        backend: see :func:`topk_select`.

    Returns:
        the update op (inside ``tf.function``, ordered by automatic control dependencies).

    Raises:
        ValueError: bad dtypes or shapes.
    """
    u = _float_vector(u, "u")
    sent = _float_vector(sent, "sent")
    numel = int(u.shape[0])
    if int(sent.shape[0]) != numel:
        raise ValueError(f"sent has {sent.shape[0]} entries but u has {numel}")
    _check_velocity(velocity, numel, "momentum_mask")
    lib = _momentum_ops(backend)
    if lib is None:
        return momentum_mask_reference(velocity, u, sent)
    return lib.hgsgc_momentum_mask(velocity.handle, u, sent)


def momentum_mask_reference(velocity, u, sent):
    """Reference of :func:`momentum_mask`: ``v.assign(tf.where(tf.equal(sent, 0.0), u, 0.0))``."""
    return velocity.assign(tf.reshape(tf.where(tf.equal(sent, 0.0), u, 0.0), velocity.shape))


# ------------------------------------------------------------------------------------------------
# DGC momentum correction folded into the compression (ops/sparse_codec.cc HgsgcCompressMomentum),
# session 11.

def _compress_momentum_lib(backend):
    """The loaded library when the fused momentum + compression kernel runs under ``backend``,
    else None (reference backend, or a library built before session 11)."""
    if ops._resolve_compression(backend) == "reference":
        return None
    lib = ops.load()
    return lib if hasattr(lib, "hgsgc_compress_momentum") else None


def compress_momentum_into(grad, residual, velocity, momentum, k, bits, masking=True,
                           sample_size=DEFAULT_SAMPLE_SIZE, margin=DEFAULT_MARGIN, seed=None,
                           backend=None, index_coding="fixed"):
    """DGC momentum correction, error feedback and the sparse encoding of one tensor in one pass.

    Deep Gradient Compression (Lin et al., ICLR 2018, Sec. 3.2) with error feedback: ``u = m v +
    g`` (momentum correction), ``a = u + residual``, ``payload = encode(top-k(a))``,
    ``residual = a - scatter(idx, sent)``, ``velocity = u`` and, with ``masking`` (momentum
    factor masking), ``velocity[i] = +0`` where the sent value ``sent[i]`` is not 0 (a subnormal
    counts as 0, NaN as sent: ``tf.equal`` on TF's CPU). The kernel (``HgsgcCompressMomentum``)
    reads ``g``, ``v`` and the residual once and writes both variables in place (copy-on-write
    when a read of one is still alive); the composed path it replaces ran
    :func:`momentum_accumulate`, :func:`compress_into`, a one-row :func:`decode_accumulate` of
    the own payload and :func:`momentum_mask`, and its results are the same bits
    (:func:`compress_momentum_into_reference`, ``tests/test_kernels11.py``).

    Args:
        grad: float32 tensor of any static shape, ``numel`` entries.
        residual, velocity: two different float32 ``tf.Variable`` of ``numel`` entries each.
        momentum: ``m`` (Python float, used as float32; ``MomentumCorrection`` sends ``m = 0``
            elsewhere: in graphs grappler folds the reference's ``0 * v``).
        k: Python int in ``[0, numel]``; bits: 2 or 32; masking: bool.
        sample_size, margin, seed, backend, index_coding: as :func:`compress_into`.

    Returns:
        payload uint8 ``[wire.payload_length(numel, k, bits, index_coding)]``; both variables
        are updated (inside a ``tf.function`` ordered by automatic control dependencies).

    Raises:
        ValueError / TypeError: bad shapes, dtypes, ``k``, ``bits``, ``sample_size``,
            ``margin``, ``index_coding``, or the residual and the velocity are one variable.
        RuntimeError: the custom library is missing (``backend="custom"``).
    """
    grad, numel = _check_grad_and_residual_variable(grad, residual)
    _check_velocity(velocity, numel, "compress_momentum_into")
    if velocity is residual:
        raise ValueError("compress_momentum_into: residual and velocity must be two different "
                         "variables (the residual e and DGC's velocity u)")
    k = _check_k(k, numel)
    bits = _check_bits(bits)
    sample_size, margin = _check_select_args(sample_size, margin)
    wire.check_index_coding(index_coding)
    lib = _compress_momentum_lib(backend)
    if lib is None:
        return _compress_momentum_composed(grad, residual, velocity, momentum, k, bits, masking,
                                           sample_size, margin, seed, backend, index_coding)
    return lib.hgsgc_compress_momentum(grad, residual.handle, velocity.handle, _seed64(seed), k=k,
                                       bits=bits, momentum=float(momentum), masking=bool(masking),
                                       sample_size=sample_size, margin=margin,
                                       index_coding=index_coding)


def _compress_momentum_composed(grad, residual, velocity, momentum, k, bits, masking, sample_size,
                                margin, seed, backend, index_coding):
    """The session-10 composition of :func:`compress_momentum_into` (each step under ``backend``)."""
    numel = int(grad.shape.num_elements())
    u = momentum_accumulate(velocity, tf.reshape(grad, [-1]), momentum, backend=backend)
    payload = compress_into(u, residual, k, bits, sample_size, margin, seed, backend=backend,
                            index_coding=index_coding)
    if masking:
        sent = decode_accumulate(tf.reshape(payload, [1, -1]), numel, k, bits, 0, backend=backend,
                                 index_coding=index_coding)
        upd = momentum_mask(velocity, u, sent, backend=backend)
    else:
        upd = velocity.assign(tf.reshape(u, velocity.shape))
    with tf.control_dependencies([upd] if upd is not None else []):
        return tf.identity(payload)


def compress_momentum_into_reference(grad, residual, velocity, momentum, k, bits, masking=True,
                                     sample_size=DEFAULT_SAMPLE_SIZE, margin=DEFAULT_MARGIN,
                                     seed=None, index_coding="fixed"):
    """Reference of :func:`compress_momentum_into` in TF ops: ``u = m * v + g``,
    :func:`compress_reference` of ``u`` with the residual assigned, the own payload decoded
    (``wire.decode`` + ``tf.scatter_nd``) and ``v.assign(tf.where(tf.equal(sent, 0.0), u, 0.0))``
    (or ``v.assign(u)`` without masking)."""
    return compress_momentum_into(grad, residual, velocity, momentum, k, bits, masking,
                                  sample_size, margin, seed, backend="reference",
                                  index_coding=index_coding)
