// Bit-stream packing primitives shared by hgsgc's kernels (ops/pack_bits.cc, ops/sparse_codec.cc).
//
// Layout (little-endian): value i occupies stream bits [i * width, (i + 1) * width), least
// significant bit first; stream bit j is bit (j % 8) of byte j / 8; unused high bits of the last
// byte are 0. Work is split into blocks of 32 values: a block of 32 values of width w is exactly
// w 32-bit words (4 * w bytes), so blocks start on byte boundaries and can be packed/unpacked
// independently (on TF's intra-op thread pool, or to random-access a block of a stream).
#ifndef HGSGC_OPS_BITPACK_H_
#define HGSGC_OPS_BITPACK_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "tensorflow/core/framework/op_kernel.h"

namespace hgsgc {
namespace bitpack {

using ::tensorflow::Status;
namespace errors = ::tensorflow::errors;

inline constexpr int kMinWidth = 1;
inline constexpr int kMaxWidth = 32;
inline constexpr int64_t kBlock = 32;  // values per independently (un)packed block = width words

// Bytes needed for `count` values of `width` bits: ceil(count * width / 8).
inline int64_t PackedLength(int64_t count, int width) {
  return (count * static_cast<int64_t>(width) + 7) / 8;
}

inline Status CheckWidth(const char* op, int width) {
  if (width < kMinWidth || width > kMaxWidth) {
    return errors::InvalidArgument(op, ": width must be in [", kMinWidth, ", ", kMaxWidth,
                                   "], got ", width);
  }
  return ::tensorflow::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Little-endian 32-bit load/store (memcpy compiles to a single mov on little-endian hosts).

inline void StoreLE32(uint8_t* p, uint32_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  std::memcpy(p, &v, sizeof(v));
#else
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
#endif
}

inline uint32_t LoadLE32(const uint8_t* p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#else
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
#endif
}

template <int W>
constexpr uint64_t LowMask() {
  return W == 64 ? ~uint64_t{0} : ((uint64_t{1} << W) - 1);
}

// ---------------------------------------------------------------------------------------------
// Packing.

// Packs 32 values (exactly W words) from `in` to `out`; returns the OR of the inputs.
template <int W>
inline uint32_t PackBlock(const uint32_t* __restrict in, uint8_t* __restrict out) {
  uint64_t acc = 0;
  int nbits = 0;
  uint32_t ored = 0;
#pragma GCC unroll 32
  for (int k = 0; k < kBlock; ++k) {
    const uint32_t v = in[k];
    ored |= v;
    acc |= static_cast<uint64_t>(v) << nbits;  // nbits < 32, so no bits are lost
    nbits += W;
    if (nbits >= 32) {  // resolved at compile time once the loop is unrolled
      StoreLE32(out, static_cast<uint32_t>(acc));
      out += 4;
      acc >>= 32;
      nbits -= 32;
    }
  }
  return ored;
}

// Packs the final n < 32 values (byte at a time; writes exactly ceil(n * W / 8) bytes).
template <int W>
inline uint32_t PackTail(const uint32_t* in, int64_t n, uint8_t* out) {
  uint64_t acc = 0;
  int nbits = 0;
  uint32_t ored = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t v = in[k];
    ored |= v;
    acc |= static_cast<uint64_t>(v) << nbits;  // nbits < 8 here
    nbits += W;
    while (nbits >= 8) {
      *out++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      nbits -= 8;
    }
  }
  if (nbits > 0) *out = static_cast<uint8_t>(acc & 0xFFu);  // high padding bits are 0
  return ored;
}

// Packs values [first, first + n) where `first` is a multiple of kBlock; returns OR of inputs.
template <int W>
uint32_t PackRange(const uint32_t* in, int64_t first, int64_t n, uint8_t* out) {
  in += first;
  out += first / kBlock * (4 * W);
  uint32_t ored = 0;
  const int64_t full = n / kBlock;
  for (int64_t b = 0; b < full; ++b) {
    ored |= PackBlock<W>(in, out);
    in += kBlock;
    out += 4 * W;
  }
  const int64_t rest = n - full * kBlock;
  if (rest > 0) ored |= PackTail<W>(in, rest, out);
  return ored;
}

// ---------------------------------------------------------------------------------------------
// Unpacking.

// Unpacks 32 values from exactly W words (4 * W bytes) of `in`.
template <int W>
inline void UnpackBlock(const uint8_t* __restrict in, uint32_t* __restrict out) {
  constexpr uint64_t kMask = LowMask<W>();
  uint64_t acc = 0;
  int nbits = 0;
#pragma GCC unroll 32
  for (int k = 0; k < kBlock; ++k) {
    if (nbits < W) {  // resolved at compile time once the loop is unrolled
      acc |= static_cast<uint64_t>(LoadLE32(in)) << nbits;
      in += 4;
      nbits += 32;
    }
    out[k] = static_cast<uint32_t>(acc & kMask);
    acc >>= W;
    nbits -= W;
  }
}

// Unpacks the final n < 32 values, reading exactly ceil(n * W / 8) bytes.
template <int W>
inline void UnpackTail(const uint8_t* in, int64_t n, uint32_t* out) {
  constexpr uint64_t kMask = LowMask<W>();
  uint64_t acc = 0;
  int nbits = 0;
  for (int64_t k = 0; k < n; ++k) {
    while (nbits < W) {
      acc |= static_cast<uint64_t>(*in++) << nbits;
      nbits += 8;
    }
    out[k] = static_cast<uint32_t>(acc & kMask);
    acc >>= W;
    nbits -= W;
  }
}

// Unpacks values [first, first + n) where `first` is a multiple of kBlock.
template <int W>
void UnpackRange(const uint8_t* in, int64_t first, int64_t n, uint32_t* out) {
  in += first / kBlock * (4 * W);
  out += first;
  const int64_t full = n / kBlock;
  for (int64_t b = 0; b < full; ++b) {
    UnpackBlock<W>(in, out);
    in += 4 * W;
    out += kBlock;
  }
  const int64_t rest = n - full * kBlock;
  if (rest > 0) UnpackTail<W>(in, rest, out);
}

// ---------------------------------------------------------------------------------------------
// Width dispatch tables: index w - 1 holds the instantiation for width w.

using PackFn = uint32_t (*)(const uint32_t*, int64_t, int64_t, uint8_t*);
using UnpackFn = void (*)(const uint8_t*, int64_t, int64_t, uint32_t*);

template <size_t... I>
constexpr std::array<PackFn, sizeof...(I)> MakePackTable(std::index_sequence<I...>) {
  return {{&PackRange<static_cast<int>(I) + 1>...}};
}
template <size_t... I>
constexpr std::array<UnpackFn, sizeof...(I)> MakeUnpackTable(std::index_sequence<I...>) {
  return {{&UnpackRange<static_cast<int>(I) + 1>...}};
}

inline constexpr std::array<PackFn, kMaxWidth> kPackFns =
    MakePackTable(std::make_index_sequence<kMaxWidth>{});
inline constexpr std::array<UnpackFn, kMaxWidth> kUnpackFns =
    MakeUnpackTable(std::make_index_sequence<kMaxWidth>{});


// Reads the single `width`-bit value i of a stream of `nbytes` bytes (random access; used for
// binary searches over packed ascending indices).
inline uint32_t ExtractValue(const uint8_t* in, int64_t nbytes, int64_t i, int width) {
  const int64_t bit = i * static_cast<int64_t>(width);
  int64_t byte = bit / 8;
  const int shift = static_cast<int>(bit % 8);
  uint64_t acc = 0;
  const int need = (shift + width + 7) / 8;  // <= 5 bytes
  for (int b = 0; b < need && byte + b < nbytes; ++b) acc |= static_cast<uint64_t>(in[byte + b]) << (8 * b);
  acc >>= shift;
  return static_cast<uint32_t>(acc & ((width == 32) ? 0xFFFFFFFFull : ((uint64_t{1} << width) - 1)));
}

}  // namespace bitpack
}  // namespace hgsgc

#endif  // HGSGC_OPS_BITPACK_H_
