// Hourglass boundary quantizers (q8 / q4: per-feature linear, stochastic rounding) in one pass,
// for hgsgc/hourglass/boundary.py. Plain C functions (called with ctypes from the numpy codec,
// which runs inside the training step's tf.numpy_function: no tensor conversion, no eager op
// dispatch from inside a running graph), compiled into the same hgsgc/_ops*.so as the ops.
//
// Format (see boundary.py): payload = lo16[f] | hi16[f] (float16 bits, little-endian) | codes,
// codes = one per sent entry in row-major order, 8 bits (q8) or 4 bits two per byte, low nibble
// first (q4, the last high nibble 0 when the count is odd). lo_j = min over feature j's sent
// entries rounded DOWN to float16, hi_j = max rounded UP (0, 0 for a feature without sent
// entries), Delta_j = (hi_j - lo_j) / L in float32 (L = 2^bits - 1),
// code = clip(floor((x - lo_j) / Delta_j + u), 0, L) (0 where Delta_j = 0) with u the caller's
// uniform float32 draws (numpy's generator: the random stream stays numpy's), decoded
// lo_j + code * Delta_j in float32 (multiply, then add: built with -ffp-contract=off).
//
// Bit identity with the numpy implementation (tests/test_hourglass_codec_exact.py) holds for
// every input except one the numpy reduction itself leaves to its SIMD code: a feature whose
// minimum or maximum is a zero while both +0.0 and -0.0 are among its sent entries (which zero
// numpy's min/max returns is not specified). hgsgc_bq_encode reports that case (return 1) and
// the caller encodes that message with numpy. Non-finite scales (NaN / inf / beyond float16)
// return 2: the caller raises the numpy path's error.
#pragma GCC optimize("O3")  // the per-entry loops vectorize at O3 (setup.py builds with -O2)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

inline float bits_float(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// float32 -> float16 bits, round to nearest even (what numpy's astype(np.float16) does);
// overflow to inf, NaN stays NaN.
uint16_t float_to_half(float v) {
  const uint32_t x = float_bits(v);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u | ((ax >> 13) & 0x3ffu) : 0x7c00u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520: rounds to inf
  if (ax < 0x38800000u) {                           // below 2^-14: subnormal half or zero
    if (ax <= 0x33000000u) return sign;             // <= 2^-25: ties to even 0
    const int e = static_cast<int>(ax >> 23);
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const int shift = 126 - e;                      // 14..23
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (ax - 0x38000000u) >> 13;
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_float(sign);
  return bits_float(sign) + (sign ? -1.0f : 1.0f) * static_cast<float>(m) * 5.9604644775390625e-08f;
}

inline bool half_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu); }
inline bool half_is_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

// numpy.nextafter(h, -inf) / (h, +inf) on float16 bits
uint16_t half_down(uint16_t h) {
  if (half_is_nan(h) || h == 0xfc00u) return h;
  if ((h & 0x7fffu) == 0) return 0x8001u;
  return (h & 0x8000u) ? h + 1 : h - 1;
}

uint16_t half_up(uint16_t h) {
  if (half_is_nan(h) || h == 0x7c00u) return h;
  if ((h & 0x7fffu) == 0) return 0x0001u;
  return (h & 0x8000u) ? h - 1 : h + 1;
}

}  // namespace

extern "C" {

// Encode x [rows, f] (row-major float32): sent entries = mask[i*f+j] != 0 (mask may be null:
// all), n of them, u [n] uniforms in [0, 1). out: 4 f + ceil(n bits / 8) bytes.
// Returns 0 (done), 1 (a signed-zero tie: use numpy), 2 (non-finite scale), 3 (bad arguments).
int hgsgc_bq_encode(const float* x, const uint8_t* mask, int64_t rows, int64_t f, const float* u,
                    int64_t n, int bits, uint8_t* out, int64_t out_len) {
  if ((bits != 8 && bits != 4) || rows < 0 || f < 0 || n < 0) return 3;
  if (out_len != 4 * f + (n * bits + 7) / 8) return 3;
  // Branch-free loops: the sent pattern of post-ReLU activations is close to random, and a
  // branch per entry on it would be mispredicted about half the time.
  std::vector<float> lo(f, INFINITY), hi(f, -INFINITY);
  std::vector<uint8_t> zeros(f, 0), nans(f, 0);  // zeros: bit 0 saw +0, bit 1 saw -0
  int64_t count = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * f;
    const uint8_t* mr = mask ? mask + i * f : nullptr;
    for (int64_t j = 0; j < f; ++j) {
      const uint8_t sel = mr ? (mr[j] != 0) : 1;
      const float v = xr[j];
      count += sel;
      nans[j] |= sel & static_cast<uint8_t>(v != v);
      zeros[j] |= static_cast<uint8_t>((sel & static_cast<uint8_t>(v == 0.0f)) << std::signbit(v));
      const float vl = sel ? v : INFINITY, vh = sel ? v : -INFINITY;
      lo[j] = vl < lo[j] ? vl : lo[j];
      hi[j] = vh > hi[j] ? vh : hi[j];
    }
  }
  if (count != n) return 3;
  const int L = (1 << bits) - 1;
  std::vector<float> lo32(f), delta(f);
  for (int64_t j = 0; j < f; ++j) {
    if (nans[j]) return 2;  // numpy's min / max would be NaN: a non-finite scale
    float a = lo[j], b = hi[j];
    if (a > b) a = b = 0.0f;  // no sent entry
    if (zeros[j] == 3 && (a == 0.0f || b == 0.0f)) return 1;
    uint16_t l16 = float_to_half(a), h16 = float_to_half(b);
    if (half_to_float(l16) > a) l16 = half_down(l16);
    if (half_to_float(h16) < b) h16 = half_up(h16);
    if (!half_is_finite(l16) || !half_is_finite(h16)) return 2;
    std::memcpy(out + 2 * j, &l16, 2);
    std::memcpy(out + 2 * f + 2 * j, &h16, 2);
    lo32[j] = half_to_float(l16);
    delta[j] = (half_to_float(h16) - lo32[j]) / static_cast<float>(L);
  }
  if (n == 0) return 0;
  std::vector<uint8_t> codes(n + 1);  // + 1: the slot written (not kept) after the last sent one
  int64_t k = 0;
  const float fl = static_cast<float>(L);
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * f;
    const uint8_t* mr = mask ? mask + i * f : nullptr;
    for (int64_t j = 0; j < f; ++j) {
      const uint8_t sel = mr ? (mr[j] != 0) : 1;
      const float d = delta[j];
      const float xv = sel ? xr[j] : lo32[j];  // unsent entries: t = 0, harmless
      const float t = d > 0.0f ? (xv - lo32[j]) / (d > 0.0f ? d : 1.0f) : 0.0f;
      // t >= 0 (x >= lo_j, the minimum rounded down) and u >= 0, so floor is truncation;
      // the clip to 0..L is numpy's np.clip(floor(t + u), 0, L)
      float c = t + u[k < n ? k : n - 1];
      c = c > fl ? fl : c;
      codes[k] = static_cast<uint8_t>(static_cast<int>(c));
      k += sel;
    }
  }
  uint8_t* body = out + 4 * f;
  if (bits == 8) {
    std::memcpy(body, codes.data(), n);
  } else {
    for (int64_t p = 0; p < n / 2; ++p)
      body[p] = static_cast<uint8_t>(codes[2 * p] | (codes[2 * p + 1] << 4));
    if (n & 1) body[n / 2] = codes[n - 1];
  }
  return 0;
}

// Decode a payload of n codes into out [rows, f] (0 where mask[i*f+j] == 0; mask may be null).
// Returns 0, or 3 when the payload is shorter than 4 f + ceil(n bits / 8) or n is not the
// mask's count.
int hgsgc_bq_decode(const uint8_t* payload, int64_t payload_len, const uint8_t* mask,
                    int64_t rows, int64_t f, int64_t n, int bits, float* out) {
  if ((bits != 8 && bits != 4) || rows < 0 || f < 0 || n < 0) return 3;
  if (payload_len < 4 * f + (n * bits + 7) / 8) return 3;
  const int L = (1 << bits) - 1;
  std::vector<float> lo32(f), delta(f);
  for (int64_t j = 0; j < f; ++j) {
    uint16_t l16, h16;
    std::memcpy(&l16, payload + 2 * j, 2);
    std::memcpy(&h16, payload + 2 * f + 2 * j, 2);
    lo32[j] = half_to_float(l16);
    delta[j] = (half_to_float(h16) - lo32[j]) / static_cast<float>(L);
  }
  const uint8_t* body = payload + 4 * f;
  std::vector<uint8_t> codes(n + 1, 0);  // + 1: read (not used) after the last sent entry
  if (bits == 8) {
    std::memcpy(codes.data(), body, n);
  } else {
    for (int64_t p = 0; p < n; ++p) codes[p] = (p & 1) ? body[p >> 1] >> 4 : body[p >> 1] & 15;
  }
  int64_t k = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* mr = mask ? mask + i * f : nullptr;
    float* o = out + i * f;
    for (int64_t j = 0; j < f; ++j) {
      const uint8_t sel = mr ? (mr[j] != 0) : 1;
      const float v = lo32[j] + static_cast<float>(codes[k < n ? k : n]) * delta[j];
      o[j] = sel ? v : 0.0f;
      k += sel;
    }
  }
  return k == n ? 0 : 3;
}

}  // extern "C"
