"""Wire format: one sparse tensor as one contiguous uint8 payload of exactly known length.

For a tensor of ``numel`` entries with ``k`` selected entries, indices are bit-packed with
``w = index_width(numel) = max(1, ceil(log2 numel))`` bits each (a fixed-width alternative to
delta coding that keeps the length known in advance). Layout, little-endian:

* ``bits == 2``:  ``[lo, hi] float32 (8 B) | indices ceil(k w / 8) B | codes ceil(k / 4) B``
* ``bits == 32``: ``indices ceil(k w / 8) B | values float32 4 k B``
* ``k == 0``: empty payload.

So ``payload_length = ceil(k w / 8) + (8 + ceil(k / 4) if bits == 2 else 4 k)``; for comparison
the DESIGN.md figure with int32 indices is ``4k + k/4 + scales``: fixed-width packing saves
``(32 - w) k / 8`` bytes. Indices travel sorted ascending.

Index coding (``compression.index_coding``): ``"fixed"`` (above) or ``"elias_fano"`` (the default
of every setting: :data:`DEFAULT_INDEX_CODING`; the functions of this module and of
:mod:`hgsgc.compression.kernels` take the coding as an argument whose default stays ``"fixed"``,
the layout above), the Elias-Fano code of the ascending index sequence (P. Elias, "Efficient storage and retrieval
by content and address of static files", J. ACM 1974; R. Fano, "On the number of bits required
to implement an associative memory", MIT Project MAC memo 61, 1971; S. Vigna, "Quasi-succinct
indices", WSDM 2013). Its length depends on ``(numel, k)`` only, so payloads keep a length known
in advance. With ``l = ef_low_bits(numel, k) = floor(log2(numel / k))`` (integer arithmetic:
``bit_length(numel // k) - 1``, >= 0 since ``k <= numel``) and ``H = k + ((numel - 1) >> l)``:

* low part: ``x_i & (2^l - 1)`` for every index, packed with width ``l`` exactly like the fixed
  code (``ceil(k l / 8)`` bytes; absent when ``l == 0``);
* high part: a bit vector of ``H`` bits (``ceil(H / 8)`` bytes, starting on a byte boundary
  after the low part) with bit ``(x_i >> l) + i`` set for ``i = 0..k-1`` and every other bit 0
  (the high parts in unary: ``i``-th set bit at position ``p_i`` gives ``x_i >> l = p_i - i``).
  ``H`` is the fewest bits that hold the largest possible position ``((numel - 1) >> l) + k - 1``.
  Bit ``j`` is bit ``j % 8`` of byte ``j // 8`` (the stream layout of :mod:`hgsgc.ops`).

So the index section takes ``ceil(k l / 8) + ceil((k + ((numel - 1) >> l)) / 8)`` bytes (about
``k (l + 2) / 8``) instead of ``ceil(k w / 8)``; the rest of the layout is unchanged (the index
section sits where the fixed-width indices do). E.g. ``numel = 1,600,000``, ``k = 8,000``:
``l = 7``, 7,000 + 2,563 = 9,563 B instead of 21,000 B.
"""
from __future__ import annotations

import math

import tensorflow as tf

from hgsgc import ops
from hgsgc.compression import DEFAULT_INDEX_CODING, quantize  # noqa: F401 (re-exported)

SUPPORTED_BITS = (2, 32)
#: Accepted values of ``compression.index_coding`` (module docstring).
INDEX_CODINGS = ("fixed", "elias_fano")


def index_width(numel: int) -> int:
    """Bits per index: ``max(1, ceil(log2(numel)))`` (indices are ``0..numel-1``)."""
    return max(1, (int(numel) - 1).bit_length())


def check_index_coding(index_coding: str) -> str:
    """``index_coding`` if it is one of :data:`INDEX_CODINGS`, else ValueError naming the fix."""
    if index_coding not in INDEX_CODINGS:
        raise ValueError(f"compression.index_coding must be one of {INDEX_CODINGS} (default "
                         f"{DEFAULT_INDEX_CODING!r}), got {index_coding!r}")
    return index_coding


def ef_low_bits(numel: int, k: int) -> int:
    """Elias-Fano low bits per index: ``l = max(0, floor(log2(numel / k)))`` for ``1 <= k <= numel``,
    computed exactly as ``bit_length(numel // k) - 1`` (``floor(log2 x) = floor(log2 floor(x))``
    for ``x >= 1``). Raises ValueError for ``k`` outside ``[1, numel]``."""
    numel, k = int(numel), int(k)
    if not 1 <= k <= numel:
        raise ValueError(f"k={k} outside [1, numel={numel}]")
    return (numel // k).bit_length() - 1


def ef_high_bits(numel: int, k: int) -> int:
    """Bits of the Elias-Fano high part (unary bit vector): ``H = k + ((numel - 1) >> l)`` with
    ``l = ef_low_bits(numel, k)``. Raises ValueError for ``k`` outside ``[1, numel]``."""
    return int(k) + ((int(numel) - 1) >> ef_low_bits(numel, k))


def index_bytes(numel: int, k: int, index_coding: str = "fixed") -> int:
    """Bytes of the index section of a payload with ``k`` of ``numel`` entries (int, exact).

    * ``"fixed"``: ``ceil(k w / 8)``, ``w = index_width(numel) = max(1, ceil(log2 numel))``;
    * ``"elias_fano"``: ``ceil(k l / 8) + ceil((k + ((numel - 1) >> l)) / 8)`` with
      ``l = floor(log2(numel / k))`` (module docstring; Elias 1974, Fano 1971, Vigna 2013).

    0 when ``k == 0``. Raises ValueError: unknown coding or ``k`` outside ``[0, numel]``.
    """
    check_index_coding(index_coding)
    numel, k = int(numel), int(k)
    if not 0 <= k <= numel:
        raise ValueError(f"k={k} outside [0, numel={numel}]")
    if k == 0:
        return 0
    if index_coding == "fixed":
        return math.ceil(k * index_width(numel) / 8)
    low = ef_low_bits(numel, k)
    return (k * low + 7) // 8 + (ef_high_bits(numel, k) + 7) // 8


def payload_length(numel: int, k: int, bits: int, index_coding: str = "fixed") -> int:
    """Exact payload size in bytes of ``k`` entries of a ``numel``-entry tensor (see module doc).

    ``payload_length = I + (8 + ceil(k / 4) if bits == 2 else 4 k)`` for ``k >= 1`` (0 for
    ``k == 0``), where ``I = index_bytes(numel, k, index_coding)``: ``ceil(k w / 8)`` for
    ``"fixed"`` (``w = ceil(log2 numel)``), ``ceil(k l / 8) + ceil((k + ((numel - 1) >> l)) / 8)``
    for ``"elias_fano"`` (``l = floor(log2(numel / k))``; Elias 1974, Fano 1971, Vigna 2013).
    Both depend on ``(numel, k, bits, index_coding)`` only, so the length is known in advance.

    Raises:
        ValueError: ``bits`` not in (2, 32), ``k`` outside ``[0, numel]`` or an unknown
        ``index_coding``.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    check_index_coding(index_coding)
    if not 0 <= k <= numel:
        raise ValueError(f"k={k} outside [0, numel={numel}]")
    if k == 0:
        return 0
    idx_bytes = index_bytes(numel, k, index_coding)
    if bits == 2:
        return quantize.SCALE_BYTES + idx_bytes + math.ceil(k / 4)
    return idx_bytes + 4 * k


def _f32_to_bytes(x):
    return tf.reshape(tf.bitcast(tf.cast(x, tf.float32), tf.uint8), [-1])


def _bytes_to_f32(b):
    return tf.bitcast(tf.reshape(b, [-1, 4]), tf.float32)


def _check_numel(numel):
    """ValueError unless ``numel < 2^31`` (indices travel as int32, as in the C++ kernels)."""
    if int(numel) >= 2**31:
        raise ValueError(f"numel = {int(numel)}: at most 2^31 - 1 entries are supported (int32 "
                         "indices); split the tensor")


def encode_indices(indices: tf.Tensor, numel: int, index_coding: str = "fixed") -> tf.Tensor:
    """The index section of a payload (pure TensorFlow, with :func:`hgsgc.ops.pack_bits`).

    Args:
        indices: int32 ``[k]`` (static ``k``), strictly ascending, in ``[0, numel)``.
        numel: entries of the dense tensor; index_coding: ``"fixed"`` or ``"elias_fano"``.

    Returns:
        uint8 ``[index_bytes(numel, k, index_coding)]`` (layouts in the module docstring).

    Raises:
        tf.errors.InvalidArgumentError (when run): ``"elias_fano"`` indices that are not strictly
            ascending in ``[0, numel)`` (names them; the code could not give them back), or a
            ``"fixed"`` index ``>= 2^index_width(numel)`` (``pack_bits``; the fixed code keeps
            any order).
        ValueError: ``numel >= 2^31`` or an unknown ``index_coding``.
    """
    check_index_coding(index_coding)
    _check_numel(numel)
    indices = tf.convert_to_tensor(indices, tf.int32)
    k = int(indices.shape[0])
    if k == 0:
        return tf.zeros([0], tf.uint8)
    if index_coding == "fixed":
        return ops.pack_bits(indices, index_width(numel))
    low = ef_low_bits(numel, k)
    high = ef_high_bits(numel, k)
    # Elias-Fano codes a strictly ascending sequence in [0, numel) only: other indices would
    # decode to other indices silently (e.g. [9, 0] of 10 came back as [5, 4]); the fixed code
    # and the C++ kernel (InvalidArgument) do not lose them, so fail here too, naming them.
    ok = tf.logical_and(tf.reduce_all(indices[1:] > indices[:-1]),
                        tf.logical_and(indices[0] >= 0, indices[-1] < numel))
    check = tf.debugging.Assert(ok, [tf.strings.format(
        "wire.encode_indices (elias_fano): indices must be strictly ascending in [0, numel = "
        f"{numel}), got {{}}", indices, summarize=16)])
    with tf.control_dependencies([check]):
        indices = tf.identity(indices)
    parts = []
    if low > 0:
        parts.append(ops.pack_bits(tf.bitwise.bitwise_and(indices, (1 << low) - 1), low))
    pos = tf.bitwise.right_shift(indices, low) + tf.range(k, dtype=tf.int32)  # ascending, < high
    unary = tf.scatter_nd(pos[:, None], tf.ones([k], tf.int32), [high])
    parts.append(ops.pack_bits(unary, 1))
    out = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
    return tf.ensure_shape(out, [index_bytes(numel, k, index_coding)])


def decode_indices(section: tf.Tensor, numel: int, k: int, index_coding: str = "fixed",
                   what: str = "") -> tf.Tensor:
    """Inverse of :func:`encode_indices`: uint8 ``[index_bytes(numel, k, index_coding)]`` ->
    int32 ``[k]``.

    ``what`` (e.g. ``"payload of rank 2: "``) is put in front of the messages below.

    Raises:
        tf.errors.InvalidArgumentError (when run): a section of another length (``unpack_bits``
            names both); an Elias-Fano section whose first ``H`` high bits hold fewer than
            ``k`` set bits (encode never produces one; the padding bits after ``H`` are not read);
            decoded indices that are not strictly ascending in ``[0, numel)`` (a corrupt section:
            a duplicate would be added twice, one ``>= numel`` has no entry), as
            ``HgsgcDecodeAccumulate`` refuses them: ``wire.decode_indices: WHAT entry J has index
            I (indices must be strictly ascending)`` or ``... has index I >= numel = N``, naming
            the first such entry.
        ValueError: ``numel >= 2^31`` or an unknown ``index_coding``.
    """
    check_index_coding(index_coding)
    _check_numel(numel)
    k = int(k)
    if k == 0:
        return tf.zeros([0], tf.int32)
    if index_coding == "fixed":
        return _check_decoded(ops.unpack_bits(section, index_width(numel), k), numel, what)
    low = ef_low_bits(numel, k)
    high = ef_high_bits(numel, k)
    low_bytes = (k * low + 7) // 8
    unary = ops.unpack_bits(section[low_bytes:], 1, high)
    pos = tf.cast(tf.where(tf.not_equal(unary, 0))[:, 0], tf.int32)
    check = tf.debugging.Assert(tf.size(pos) >= k, [tf.strings.format(
        "wire.decode_indices: the Elias-Fano high part holds {} set bits, fewer than k = "
        f"{k} set bits in its H = {high} bits (not an index_coding=elias_fano payload of this "
        "tensor? every rank must use the same compression.index_coding)", tf.size(pos))])
    with tf.control_dependencies([check]):
        pos = tf.reshape(pos[:k], [k])
    idx = tf.bitwise.left_shift(pos - tf.range(k, dtype=tf.int32), low)
    if low > 0:
        idx = tf.bitwise.bitwise_or(idx, ops.unpack_bits(section[:low_bytes], low, k))
    return _check_decoded(idx, numel, what)


def _check_decoded(idx, numel, what):
    """``idx`` (int32 ``[k]``, k >= 1) after an assertion that it is strictly ascending in
    ``[0, numel)``, naming the first entry that is not (the message of HgsgcDecodeAccumulate)."""
    bad = tf.logical_or(idx >= numel, tf.concat([[False], idx[1:] <= idx[:-1]], 0))
    j = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int32)  # the first bad entry
    why = tf.where(idx[j] >= numel, f" >= numel = {numel}", " (indices must be strictly ascending)")
    check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [tf.strings.join([
        f"wire.decode_indices: {what}entry ", tf.strings.as_string(j), " has index ",
        tf.strings.as_string(idx[j]), why])])
    with tf.control_dependencies([check]):
        return tf.identity(idx)


def encode(indices: tf.Tensor, values: tf.Tensor, numel: int, bits: int, index_coding: str = "fixed"):
    """Encode selected entries.

    Args:
        indices: int32 ``[k]``, ascending, in ``[0, numel)``.
        values: float32 ``[k]``.
        numel: entries of the dense tensor; bits: 2 or 32; index_coding: ``"fixed"`` or
            ``"elias_fano"`` (module docstring).

    Returns:
        ``(payload uint8 [payload_length(numel, k, bits, index_coding)], sent float32 [k])``
        where ``sent`` is what a receiver decodes (the quantized values for bits=2), used for
        the residual.
    """
    k = int(indices.shape[0])
    n_bytes = payload_length(numel, k, bits, index_coding)
    if k == 0:
        return tf.zeros([0], tf.uint8), tf.zeros([0], tf.float32)
    values = tf.cast(values, tf.float32)
    idx_packed = encode_indices(indices, numel, index_coding)
    if bits == 2:
        codes, scales = quantize.quantize_2bit(values)
        sent = quantize.dequantize_2bit(codes, scales)
        payload = tf.concat([_f32_to_bytes(scales), idx_packed, quantize.pack_codes(codes)], 0)
    else:
        sent = values
        payload = tf.concat([idx_packed, _f32_to_bytes(values)], 0)
    payload = tf.ensure_shape(payload, [n_bytes])
    return payload, sent


def decode(payload: tf.Tensor, numel: int, k: int, bits: int, index_coding: str = "fixed",
           what: str = ""):
    """Inverse of :func:`encode`: uint8 ``[payload_length(numel, k, bits, index_coding)]`` ->
    ``(indices int32 [k], values float32 [k])`` (for ``bits=2`` the dequantized values).

    Args:
        payload: uint8 ``[payload_length(numel, k, bits, index_coding)]`` (exactly: a longer
            ``bits=32`` payload would give more values). numel, k, bits, index_coding: as
            :func:`encode` (the sender's). what: names the payload in errors (e.g.
            ``"payload of rank 2: "``).

    Raises:
        tf.errors.InvalidArgumentError (when run): a short payload, a malformed Elias-Fano
            index section, or indices that are not strictly ascending in ``[0, numel)``
            (duplicates included; :func:`decode_indices`).
        ValueError: ``numel >= 2^31`` or an unknown ``index_coding``.
    """
    check_index_coding(index_coding)
    if k == 0:
        return tf.zeros([0], tf.int32), tf.zeros([0], tf.float32)
    idx_bytes = index_bytes(numel, k, index_coding)
    if bits == 2:
        scales = _bytes_to_f32(payload[: quantize.SCALE_BYTES])
        off = quantize.SCALE_BYTES
        indices = decode_indices(payload[off: off + idx_bytes], numel, k, index_coding, what)
        codes = quantize.unpack_codes(payload[off + idx_bytes:], k)
        values = quantize.dequantize_2bit(codes, scales)
    else:
        indices = decode_indices(payload[:idx_bytes], numel, k, index_coding, what)
        values = _bytes_to_f32(payload[idx_bytes:])
    return indices, values
