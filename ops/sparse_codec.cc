// Fused sparse-compression kernels for hgsgc (CPU): top-k selection by a sampled threshold, the
// 2-bit / fp32 wire encoding, compensate + select + encode + residual update in one pass over the
// gradient, and decode + dequantize + accumulate of all n gathered payloads into one dense sum.
//
// Ops (attributes in brackets; shapes as in hgsgc/ops.py):
//   HgsgcTopkSelect(x: float [numel], seed: int64 scalar) [k, sample_size, margin]
//       -> indices: int32 [k] ascending, values: float [k] = x[indices]
//   HgsgcSparseEncode(indices: int32 [k], values: float [k]) [numel, bits, index_coding]
//       -> payload: uint8 [payload_length(numel, k, bits, index_coding)], sent: float [k]
//   HgsgcCompress(grad: float [numel], residual: float [numel] or [0], seed: int64 scalar)
//       [k, bits, sample_size, margin, index_coding]
//       -> payload: uint8 [payload_length], new_residual: float [numel] (or [0] without residual)
//   HgsgcCompressResidual(grad: float [any shape], residual: resource (float32 variable of
//       numel entries), seed) [k, bits, sample_size, margin, index_coding] -> payload; the
//       residual variable is updated in place (one read of grad and residual, one write of it)
//   HgsgcCompressMomentum(grad: float [any shape], residual: resource, velocity: resource, seed)
//       [k, bits, sample_size, margin, index_coding, momentum, masking] -> payload (session 11):
//       HgsgcCompressResidual of u = momentum * velocity + grad (DGC momentum correction, Lin et
//       al. 2018), the velocity set to u in the same pass and, with masking, cleared (+0) at the
//       sent entries whose sent value is not 0 (the bits of HgsgcMomentumAccumulate +
//       HgsgcCompressResidual + a one-row decode of the own payload + HgsgcMomentumMask)
//   HgsgcDecodeAccumulate(gathered: uint8 [n, P]) [numel, k, bits, offset, index_coding, divisor]
//       -> sum: float [numel] = sum over ranks r = 0..n-1, in rank order, of the dense tensor
//          decoded from gathered[r, offset : offset + payload_length], times float32(1 / divisor)
//          when divisor > 1 (the average, session 11: the bits of `sum / n` in a tf.function,
//          which grappler turns into a multiplication by the float32 reciprocal)
//   index_coding ('fixed' default | 'elias_fano'): how the payload's indices are coded (layouts and
//   lengths in hgsgc/compression/wire.py; EfEncode / EfDecode below); payload_length follows it.
//   Checked (InvalidArgument): 0 <= k <= numel < 2^31 (int32 indices), bits 2 or 32, margin >= 1
//   (any larger margin is allowed: beyond numel it changes nothing), sample_size >= 1, seed a
//   scalar, vectors 1-D; sparse_encode's indices strictly ascending in [0, numel); decode: rows at
//   least offset + payload_length bytes, every payload's indices strictly ascending and < numel,
//   an Elias-Fano high part with k set bits among its H bits. A payload is never read past its
//   payload_length bytes, whatever it holds.
//
// Bit-identity contract with the pure-TensorFlow reference (hgsgc/ops.py *_reference, i.e.
// hgsgc.compression.sparsify / codec and the communicator's rank-order add_n):
// * Selection is exact top-k by magnitude with ties to the lower index (what tf.math.top_k does),
//   returned in ascending index order. Magnitudes are compared as the integer bit patterns of |x|
//   with subnormals mapped to 0, which is how TF's CPU kernels compare them (they run with
//   flush-to-zero / denormals-are-zero on). NaN ranks above +inf (TF: unspecified).
//   Algorithm (Deep Gradient Compression, Lin et al. 2018, Sec. 3): the threshold t is the
//   ceil(margin * k * s / numel)-th largest of s sampled magnitudes (s = max(sample_size,
//   32 numel / k), in runs of 16 entries beyond sample_size); ONE pass over x collects the
//   candidates |x| >= t (in index order, per chunk); the exact top-k among the candidates is an
//   nth_element on the packed key (magnitude << 32 | ~index), and a walk over the candidates in
//   index order keeps those >= the k-th key. Since every true top-k entry is >= the k-th largest
//   magnitude, the result is exact whenever >= k candidates pass. When fewer pass (or far too many,
//   which would cost memory), an exact radix select over the whole tensor finds the k-th key
//   instead (two histogram passes + a count and a write pass; no extra O(numel) memory).
// * Encoding reproduces codec.encode / quantize.quantize_2bit float operation by float operation
//   (a = min|v|, b = max|v|, lo = a + (b - a) * 0.25, hi = a + (b - a) * 0.75, mid = (a + b) * 0.5)
//   under the same flush-to-zero mode (tsl::port::ScopedFlushDenormal), without FMA contraction.
// * The accumulate is the strict rank-order sum ((0 + v_0) + v_1) + ... + v_{n-1} per position
//   (ranks that did not send the position add nothing), i.e. tf.scatter_nd of all ranks' decoded
//   entries concatenated in rank order (its CPU kernel adds updates in order, from +0; so -0
//   arrives as +0 and a subnormal as 0 under flush-to-zero). NOT tf.add_n of per-rank dense
//   tensors: TF's AddN adds groups of 8 and grappler rewrites add trees in graphs, so its
//   rounding for n > 9 depends on eager vs graph mode; the reference path uses scatter_nd.
//   The kernel starts from +0 and adds every rank's values in rank order: identical, because the
//   running sum is never -0 (x + y is -0 only if both are -0), so the +0 that the reference adds
//   at the positions a rank did not send changes nothing.
//
// Threads: every pass runs on TensorFlow's intra-op pool (ctx->device()->
// tensorflow_cpu_worker_threads(), tensorflow::Shard) over contiguous chunks of the tensor; the
// decode splits the OUTPUT range into chunks and finds each chunk's slice of every (ascending)
// payload by binary search on the packed indices, so ranks are summed in order without atomics and
// without a per-rank dense intermediate, and each payload byte is read once.
//
// Devices: each kernel is OpKernel<Device> calling a Functor<Device>; only the CPU functors exist.
// A GPU implementation is added without changing callers (they use the op by name):
//   1. in ops/sparse_codec.cu.cc define `template <> struct TopkSelectFunctor<GPUDevice> {...}` (and
//      the other functors) with the same signature;
//   2. register it here with
//        REGISTER_KERNEL_BUILDER(Name("HgsgcTopkSelect").Device(DEVICE_GPU).HostMemory("seed"),
//                                TopkSelectOp<GPUDevice>);
//      (attributes, shapes and the op definition stay the same; TF places the op on the GPU when
//      its inputs live there);
//   3. compile the .cu.cc with nvcc in setup.py when CUDA TensorFlow is installed.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "bitpack.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"
#include "tensorflow/core/util/work_sharder.h"

#pragma GCC optimize("fp-contract=off")

namespace hgsgc {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
namespace errors = ::tensorflow::errors;
using CPUDevice = Eigen::ThreadPoolDevice;
using namespace ::hgsgc::bitpack;  // NOLINT

constexpr int kScaleBytes = 8;          // [lo, hi] float32 of the 2-bit scheme
constexpr int64_t kChunk = 1 << 19;     // min entries per work chunk of the dense passes: below
                                        // ~2 MB a pass is not worth waking another thread
constexpr int64_t kMaxChunks = 256;

// ---------------------------------------------------------------------------------------------
// Formulas shared with hgsgc/compression/codec.py.

inline int IndexWidth(int64_t numel) {  // max(1, ceil(log2 numel))
  int w = 0;
  for (uint64_t v = static_cast<uint64_t>(numel > 0 ? numel - 1 : 0); v; v >>= 1) ++w;
  return std::max(1, w);
}

// Elias-Fano index coding (compression.index_coding = elias_fano; layout in
// hgsgc/compression/wire.py): l = floor(log2(numel / k)) low bits per index packed like the fixed
// code, then a byte-aligned bit vector of H = k + ((numel - 1) >> l) bits with bit (x_i >> l) + i
// set for every i (the high parts in unary). Elias 1974, Fano 1971, Vigna WSDM 2013.
inline int EfLowBits(int64_t numel, int64_t k) {  // bit_length(numel / k) - 1, for 1 <= k <= numel
  int b = 0;
  for (uint64_t v = static_cast<uint64_t>(numel / k); v; v >>= 1) ++b;
  return b - 1;
}
inline int64_t EfHighBits(int64_t numel, int64_t k) { return k + ((numel - 1) >> EfLowBits(numel, k)); }

inline int64_t IndexBytes(int64_t numel, int64_t k, bool ef) {
  if (k == 0) return 0;
  if (!ef) return PackedLength(k, IndexWidth(numel));
  return (k * EfLowBits(numel, k) + 7) / 8 + (EfHighBits(numel, k) + 7) / 8;
}

inline int64_t PayloadLength(int64_t numel, int64_t k, int bits, bool ef = false) {
  if (k == 0) return 0;
  const int64_t idx = IndexBytes(numel, k, ef);
  return bits == 2 ? kScaleBytes + idx + (k + 3) / 4 : idx + 4 * k;
}

// index_coding attribute: "fixed" -> false, "elias_fano" -> true.
Status ParseIndexCoding(const char* op, const std::string& s, bool* ef) {
  if (s == "fixed") {
    *ef = false;
  } else if (s == "elias_fano") {
    *ef = true;
  } else {
    return errors::InvalidArgument(op, ": index_coding must be 'fixed' or 'elias_fano', got '", s, "'");
  }
  return ::tensorflow::OkStatus();
}

template <typename Ctx>
Status ReadIndexCoding(Ctx* ctx, const char* op, bool* ef) {
  std::string s;
  TF_RETURN_IF_ERROR(ctx->GetAttr("index_coding", &s));
  return ParseIndexCoding(op, s, ef);
}

// Writes the Elias-Fano index section of ascending idx[0..k) (IndexBytes(numel, k, true) bytes).
void EfEncode(const int32_t* idx, int64_t k, int64_t numel, uint8_t* dst) {
  const int l = EfLowBits(numel, k);
  const int64_t low_bytes = (k * l + 7) / 8;
  if (l > 0) {
    const PackFn pack = kPackFns[l - 1];
    const uint32_t mask = (uint32_t{1} << l) - 1;
    uint32_t buf[kBlock];
    for (int64_t j0 = 0; j0 < k; j0 += kBlock) {
      const int64_t nb = std::min<int64_t>(kBlock, k - j0);
      for (int64_t t = 0; t < nb; ++t) buf[t] = static_cast<uint32_t>(idx[j0 + t]) & mask;
      pack(buf, 0, nb, dst + j0 / kBlock * (4 * l));  // block j0 / 32 starts at byte 4 l (j0 / 32)
    }
  }
  uint8_t* hi = dst + low_bytes;
  std::memset(hi, 0, (EfHighBits(numel, k) + 7) / 8);
  for (int64_t i = 0; i < k; ++i) {
    const uint64_t p = (static_cast<uint64_t>(static_cast<uint32_t>(idx[i])) >> l) + static_cast<uint64_t>(i);
    hi[p >> 3] |= static_cast<uint8_t>(1u << (p & 7));
  }
}

// Decodes an Elias-Fano index section (IndexBytes(numel, k, true) bytes at src) into out[0..k);
// returns false when the first H = EfHighBits(numel, k) bits of its high part hold fewer than k
// set bits (a malformed payload; encode never writes one). Like the reference
// (wire.decode_indices), only those H bits are read: a set padding bit of the last byte is not
// taken for an index. That also bounds every value by (k - 1 + ((numel - 1) >> l)) << l |
// (2^l - 1) <= 2 numel - 2 < 2^32, so none wraps around into [0, numel) (with padding bits read,
// e.g. numel = 2^30, k = 1, l = 30, padding bit 4 gave (4 << 30) mod 2^32 = 0: a wrong index
// that passed every check). Values >= numel or non-ascending ones are the caller's checks.
bool EfDecode(const uint8_t* src, int64_t k, int64_t numel, uint32_t* out) {
  const int l = EfLowBits(numel, k);
  const int64_t low_bytes = (k * l + 7) / 8;
  if (l > 0) kUnpackFns[l - 1](src, 0, k, out);
  else std::fill(out, out + k, 0u);
  const uint8_t* hi = src + low_bytes;
  const int64_t high_bits = EfHighBits(numel, k);
  const int64_t hbytes = (high_bits + 7) / 8;
  int64_t i = 0;
  for (int64_t b = 0; b < hbytes && i < k; ++b) {
    uint32_t byte = hi[b];
    if (b == hbytes - 1 && (high_bits & 7) != 0) byte &= (1u << (high_bits & 7)) - 1;  // padding
    while (byte != 0 && i < k) {
      const int64_t p = 8 * b + __builtin_ctz(byte);
      byte &= byte - 1;
      out[i] |= static_cast<uint32_t>(static_cast<uint64_t>(p - i) << l);
      ++i;
    }
  }
  return i == k;
}

Status CheckBits(const char* op, int bits) {
  if (bits != 2 && bits != 32) return errors::InvalidArgument(op, ": bits must be 2 or 32, got ", bits);
  return ::tensorflow::OkStatus();
}

// Magnitude key: bit pattern of |x| with subnormals as 0 (TF compares with DAZ on).
inline uint32_t MagKey(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b &= 0x7FFFFFFFu;
  return b < 0x00800000u ? 0u : b;
}
inline float KeyToFloat(uint32_t key) {
  float f;
  std::memcpy(&f, &key, 4);
  return f;
}
inline uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
// Candidate key: larger magnitude first, then lower index first (tf.math.top_k's tie rule).
inline uint64_t PairKey(uint32_t key, int64_t i) {
  return (static_cast<uint64_t>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

// ---------------------------------------------------------------------------------------------
// Threading.

struct Pool {
  int num_threads = 1;
  ::tensorflow::thread::ThreadPool* workers = nullptr;
  explicit Pool(OpKernelContext* ctx) {
    const auto* t = ctx->device()->tensorflow_cpu_worker_threads();
    if (t != nullptr && t->workers != nullptr) {
      num_threads = t->num_threads;
      workers = t->workers;
    }
  }
  // Number of chunks for a pass over n entries (>= 1).
  int64_t Chunks(int64_t n) const {
    const int64_t by_size = (n + kChunk - 1) / kChunk;
    return std::max<int64_t>(1, std::min<int64_t>({by_size, 4 * num_threads, kMaxChunks}));
  }
  // Runs fn(c) for c in [0, num) on the pool, with TF's flush-to-zero mode in every thread.
  template <typename Fn>
  void For(int64_t num, int64_t cost_per_unit, Fn&& fn) const {
    auto work = [&fn](int64_t b, int64_t e) {
      ::tensorflow::port::ScopedFlushDenormal flush;
      for (int64_t c = b; c < e; ++c) fn(c);
    };
    if (workers == nullptr || num <= 1) {
      work(0, num);
      return;
    }
    ::tensorflow::Shard(num_threads, workers, num, cost_per_unit, work);
  }
};

inline int64_t ChunkBegin(int64_t c, int64_t chunks, int64_t n) { return n * c / chunks; }

// ---------------------------------------------------------------------------------------------
// Selection.

// The values being selected from: either x itself, or a = g + r written to `out` on the fly
// (the fused compensate pass of HgsgcCompress).
// With a velocity (DGC momentum correction fused in, HgsgcCompressMomentum): u = m v + g (the
// product rounded, then the sum: HgsgcMomentumAccumulate's two roundings), u written to vout
// (which may be v itself), and a = u + r (r required then).
struct Source {
  const float* g = nullptr;
  const float* r = nullptr;  // nullptr: a = g
  float* out = nullptr;      // where a = g + r is stored (required when r != nullptr)
  const float* v = nullptr;  // velocity (nullptr: no momentum); then r != nullptr
  float* vout = nullptr;     // where u = m v + g is stored (required when v != nullptr)
  float m = 0.0f;
  float U(int64_t i) const {  // callers hold ScopedFlushDenormal
    if (!v) return g[i];
    const float t = m * v[i];  // rounded (and flushed) before the sum, as tf.multiply
    return t + g[i];
  }
  float At(int64_t i) const { return r ? U(i) + r[i] : g[i]; }
  const float* Values() const { return r ? out : g; }  // valid after the first pass
  // The fused compensate of entry i: writes u (with a velocity) and a; returns a.
  float Compensate(int64_t i) const {
    if (v) {
      const float u = U(i);
      vout[i] = u;
      const float a = u + r[i];
      out[i] = a;
      return a;
    }
    const float a = g[i] + r[i];
    out[i] = a;
    return a;
  }
};

// Exact radix select over all entries: the k-th largest PairKey (as key + index rule) among
// `vals[0..n)`, and writes the ascending top-k indices to idx_out. 4 passes, no O(n) memory.
void ExactSelect(const Pool& pool, const float* vals, int64_t n, int64_t k, int32_t* idx_out) {
  const int64_t chunks = pool.Chunks(n);
  constexpr int kHiBuckets = 1 << 15;  // keys < 2^31: bits 16..30
  constexpr int kLoBuckets = 1 << 16;
  std::vector<uint32_t> hist(static_cast<size_t>(chunks) * kHiBuckets, 0);
  pool.For(chunks, kChunk * 4, [&](int64_t c) {
    uint32_t* h = hist.data() + c * kHiBuckets;
    for (int64_t i = ChunkBegin(c, chunks, n), e = ChunkBegin(c + 1, chunks, n); i < e; ++i) ++h[MagKey(vals[i]) >> 16];
  });
  int64_t above = 0;  // entries with a larger high part
  uint32_t hi = 0;
  for (int b = kHiBuckets - 1; b >= 0; --b) {
    int64_t cnt = 0;
    for (int64_t c = 0; c < chunks; ++c) cnt += hist[c * kHiBuckets + b];
    if (above + cnt >= k) {
      hi = static_cast<uint32_t>(b);
      break;
    }
    above += cnt;
  }
  std::vector<uint32_t> hist2(static_cast<size_t>(chunks) * kLoBuckets, 0);
  pool.For(chunks, kChunk * 4, [&](int64_t c) {
    uint32_t* h = hist2.data() + c * kLoBuckets;
    for (int64_t i = ChunkBegin(c, chunks, n), e = ChunkBegin(c + 1, chunks, n); i < e; ++i) {
      const uint32_t key = MagKey(vals[i]);
      if ((key >> 16) == hi) ++h[key & 0xFFFFu];
    }
  });
  uint32_t thr = 0;
  for (int b = kLoBuckets - 1; b >= 0; --b) {
    int64_t cnt = 0;
    for (int64_t c = 0; c < chunks; ++c) cnt += hist2[c * kLoBuckets + b];
    if (above + cnt >= k) {
      thr = (hi << 16) | static_cast<uint32_t>(b);
      break;
    }
    above += cnt;
  }
  const int64_t need_eq = k - above;  // entries equal to thr that are taken (lowest indices)
  std::vector<int64_t> gt(chunks, 0), eq(chunks, 0);
  pool.For(chunks, kChunk * 2, [&](int64_t c) {
    int64_t g = 0, q = 0;
    for (int64_t i = ChunkBegin(c, chunks, n), e = ChunkBegin(c + 1, chunks, n); i < e; ++i) {
      const uint32_t key = MagKey(vals[i]);
      g += key > thr;
      q += key == thr;
    }
    gt[c] = g;
    eq[c] = q;
  });
  std::vector<int64_t> out_off(chunks), eq_before(chunks);
  int64_t o = 0, qb = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    eq_before[c] = qb;
    out_off[c] = o;
    const int64_t take_eq = std::max<int64_t>(0, std::min(eq[c], need_eq - qb));
    o += gt[c] + take_eq;
    qb += eq[c];
  }
  pool.For(chunks, kChunk * 2, [&](int64_t c) {
    int32_t* dst = idx_out + out_off[c];
    int64_t q = eq_before[c];
    for (int64_t i = ChunkBegin(c, chunks, n), e = ChunkBegin(c + 1, chunks, n); i < e; ++i) {
      const uint32_t key = MagKey(vals[i]);
      if (key > thr || (key == thr && q++ < need_eq)) *dst++ = static_cast<int32_t>(i);
    }
  });
}

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Selects the exact top-k of src (see file comment) into idx_out [k] (ascending). If src.r is
// set, also writes a = g + r to src.out for every entry (the fused compensate pass).
// Returns the path taken: 0 sampled threshold, 1 exact fallback, 2 trivial (k == 0 or k == n).
int SelectTopK(const Pool& pool, const Source& src, int64_t n, int64_t k, int64_t sample_size,
               float margin, uint64_t seed, int32_t* idx_out) {
  const int64_t chunks = pool.Chunks(n);
  auto compensate_all = [&]() {
    if (!src.r) return;
    pool.For(chunks, kChunk * 3, [&](int64_t c) {
      for (int64_t i = ChunkBegin(c, chunks, n), e = ChunkBegin(c + 1, chunks, n); i < e; ++i)
        src.Compensate(i);
    });
  };
  if (k == 0 || k == n) {
    compensate_all();
    for (int64_t i = 0; i < k; ++i) idx_out[i] = static_cast<int32_t>(i);
    return 2;
  }
  // The margin as used below: a margin >= n / k already makes every sample the threshold and
  // every entry a candidate, so capping it at n changes nothing, and keeps the float -> int64
  // conversions below in range (a margin of 1e20 made them undefined: the candidate reserve
  // came out negative and the process died with a segmentation fault).
  const double mg = std::min<double>(margin, static_cast<double>(n));
  // 1. Threshold estimate from a sample (all entries when numel <= sample_size).
  uint32_t thr = 0;
  int64_t cap;  // candidate budget; more means the estimate was useless: exact path instead
  if (n > sample_size) {
    ::tensorflow::port::ScopedFlushDenormal flush;
    // At least ~32 expected samples above the k-th largest magnitude (else the estimate is
    // noisy and too few candidates pass, e.g. 1024 samples at density 0.001 put ~1 sample
    // above it and the exact fallback would run in about a quarter of the calls). Beyond
    // `sample_size`, samples are taken in runs of 16 consecutive entries (one cache line each).
    constexpr int64_t kRun = 16;
    const int64_t s = std::min<int64_t>(std::max<int64_t>(sample_size, (32 * n + k - 1) / k), n / 4 + 1);
    const bool runs = s > sample_size && n > 4 * kRun;
    std::vector<uint32_t> keys(s);
    for (int64_t j = 0; j < s;) {
      const uint64_t h = SplitMix64(seed * 0x100000001B3ull + static_cast<uint64_t>(j));
      if (runs) {
        const int64_t start = static_cast<int64_t>(h % static_cast<uint64_t>(n - kRun));
        for (int64_t t = 0; t < kRun && j < s; ++t, ++j) keys[j] = MagKey(src.At(start + t));
      } else {
        keys[j++] = MagKey(src.At(static_cast<int64_t>(h % static_cast<uint64_t>(n))));
      }
    }
    const double want = std::ceil(mg * k * s / n);  // <= k s < 2^62
    const int64_t kth = std::min<int64_t>(s, std::max<int64_t>(1, static_cast<int64_t>(want)));
    std::nth_element(keys.begin(), keys.begin() + (kth - 1), keys.end(), std::greater<uint32_t>());
    thr = keys[kth - 1];
    // (a cap >= n never triggers: at most n entries pass; 2 n keeps the cast in range)
    cap = std::max<int64_t>(4 * k + 4096, static_cast<int64_t>(std::min(3.0 * mg * k, 2.0 * n)));
  } else {
    cap = n;
  }
  // 2. One pass: (compensate and) collect candidates >= thr per chunk, in index order.
  std::vector<std::vector<uint64_t>> cand(chunks);
  std::atomic<int64_t> total{0};
  std::atomic<bool> overflow{false};
  pool.For(chunks, kChunk * 3, [&](int64_t c) {
    const int64_t b = ChunkBegin(c, chunks, n), e = ChunkBegin(c + 1, chunks, n);
    std::vector<uint64_t>& mine = cand[c];
    const int64_t budget = std::min<int64_t>(e - b, cap);
    mine.reserve(static_cast<size_t>(std::min<double>(
        static_cast<double>(budget), 256.0 + 2.0 * mg * static_cast<double>(k) * (e - b) / n)));
    bool over = false;
    auto visit = [&](int64_t i, float a) {
      const uint32_t key = MagKey(a);
      if (key >= thr && !over) {
        mine.push_back(PairKey(key, i));
        if ((mine.size() & 1023) == 0 && (total.fetch_add(1024) + 1024 > cap || overflow.load())) {
          over = true;
          overflow.store(true);
        }
      }
    };
    if (src.v) {
      const float m = src.m;
      const float *g = src.g, *r = src.r, *v = src.v;
      float *out = src.out, *vout = src.vout;
      for (int64_t i = b; i < e; ++i) {
        const float t = m * v[i];  // u = m v + g: two roundings, as HgsgcMomentumAccumulate
        const float u = t + g[i];
        vout[i] = u;
        const float a = u + r[i];
        out[i] = a;
        visit(i, a);
      }
    } else if (src.r) {
      for (int64_t i = b; i < e; ++i) {
        const float a = src.g[i] + src.r[i];
        src.out[i] = a;
        visit(i, a);
      }
    } else {
      for (int64_t i = b; i < e; ++i) visit(i, src.g[i]);
    }
    if (over) {
      std::vector<uint64_t>().swap(mine);
    } else {
      total.fetch_add(static_cast<int64_t>(mine.size() & 1023));
    }
  });
  int64_t m = 0;
  for (const auto& v : cand) m += static_cast<int64_t>(v.size());
  if (overflow.load() || total.load() > cap || m < k) {
    cand.clear();
    ExactSelect(pool, src.Values(), n, k, idx_out);
    return 1;
  }
  // 3. Exact top-k among the candidates: the k-th largest pair key, then a walk in index order.
  std::vector<uint64_t> all;
  all.reserve(m);
  for (const auto& v : cand) all.insert(all.end(), v.begin(), v.end());
  std::vector<uint64_t> tmp(all);
  std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<uint64_t>());
  const uint64_t kth_key = tmp[k - 1];
  std::vector<uint64_t>().swap(tmp);
  int64_t o = 0;
  for (uint64_t p : all)
    if (p >= kth_key) idx_out[o++] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(p));
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Encoding: payload (layout of codec.py) and the values a receiver decodes (`sent`).
// vals_at(j) gives the j-th selected value (float).

template <typename ValsAt>
void Encode(const Pool& pool, const int32_t* idx, int64_t k, int64_t numel, int bits, bool ef,
            ValsAt vals_at, uint8_t* payload, float* sent) {
  if (k == 0) return;
  ::tensorflow::port::ScopedFlushDenormal flush;
  const int w = IndexWidth(numel);
  const int64_t idx_bytes = IndexBytes(numel, k, ef);
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  const int64_t shards = std::max<int64_t>(1, std::min<int64_t>(blocks / 2048, 4 * pool.num_threads));
  auto block_range = [&](int64_t s, int64_t* first, int64_t* count) {
    const int64_t b0 = blocks * s / shards, b1 = blocks * (s + 1) / shards;
    *first = b0 * kBlock;
    *count = std::min(b1 * kBlock, k) - *first;
  };
  uint8_t* idx_dst = payload + (bits == 2 ? kScaleBytes : 0);
  // Elias-Fano: the whole index section in one sequential O(k) pass here; the shards below then
  // skip the (fixed-width) index packing.
  if (ef) EfEncode(idx, k, numel, idx_dst);
  const PackFn pack_idx = ef ? nullptr : kPackFns[w - 1];
  if (bits == 32) {
    uint8_t* val_dst = payload + idx_bytes;
    pool.For(shards, 64 * kBlock * 8, [&](int64_t s) {
      int64_t first, count;
      block_range(s, &first, &count);
      if (count <= 0) return;
      if (pack_idx) pack_idx(reinterpret_cast<const uint32_t*>(idx), first, count, idx_dst);
      for (int64_t j = first; j < first + count; ++j) {
        const float v = vals_at(j);
        sent[j] = v;
        std::memcpy(val_dst + 4 * j, &v, 4);
      }
    });
    return;
  }
  // bits == 2: scales from min / max of the (flushed) magnitudes, as quantize_2bit.
  std::vector<float> lo_p(shards, std::numeric_limits<float>::infinity()), hi_p(shards, 0.0f);
  pool.For(shards, 64 * kBlock * 4, [&](int64_t s) {
    int64_t first, count;
    block_range(s, &first, &count);
    float a = std::numeric_limits<float>::infinity(), b = 0.0f;
    for (int64_t j = first; j < first + count; ++j) {
      const float mag = KeyToFloat(MagKey(vals_at(j)));
      a = std::min(a, mag);
      b = std::max(b, mag);
    }
    lo_p[s] = a;
    hi_p[s] = b;
  });
  float a = std::numeric_limits<float>::infinity(), b = 0.0f;
  for (int64_t s = 0; s < shards; ++s) {
    a = std::min(a, lo_p[s]);
    b = std::max(b, hi_p[s]);
  }
  volatile float d = b - a;  // volatile: keep the exact float op order of the reference
  const float lo = a + d * 0.25f;
  const float hi = a + d * 0.75f;
  const float mid = (a + b) * 0.5f;
  std::memcpy(payload, &lo, 4);
  std::memcpy(payload + 4, &hi, 4);
  uint8_t* code_dst = idx_dst + idx_bytes;
  const PackFn pack_codes = kPackFns[1];
  pool.For(shards, 64 * kBlock * 8, [&](int64_t s) {
    int64_t first, count;
    block_range(s, &first, &count);
    if (count <= 0) return;
    if (pack_idx) pack_idx(reinterpret_cast<const uint32_t*>(idx), first, count, idx_dst);
    uint32_t codes[kBlock];
    for (int64_t j0 = first; j0 < first + count; j0 += kBlock) {
      const int64_t nb = std::min<int64_t>(kBlock, first + count - j0);
      for (int64_t t = 0; t < nb; ++t) {
        const float v = vals_at(j0 + t);
        const uint32_t key = MagKey(v);
        const uint32_t upper = KeyToFloat(key) >= mid ? 1u : 0u;
        const uint32_t neg = ((FloatBits(v) >> 31) != 0 && key != 0) ? 1u : 0u;  // v < 0 (DAZ)
        codes[t] = 2 * neg + upper;
        const float mag = upper ? hi : lo;
        sent[j0 + t] = neg ? -mag : mag;
      }
      pack_codes(codes, 0, nb, code_dst + j0 / kBlock * 8);  // 2-bit blocks: 8 bytes each
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Functors (one per op and device; only CPU is implemented).

template <typename Device>
struct TopkSelectFunctor;
template <typename Device>
struct CompressFunctor;
template <typename Device>
struct SparseEncodeFunctor;
template <typename Device>
struct DecodeAccumulateFunctor;

struct SelectAttrs {
  int64_t k = 0;
  int64_t sample_size = 1024;
  float margin = 1.5f;
};

Status ReadSelectAttrs(OpKernelConstruction* ctx, SelectAttrs* a) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("k", &a->k));
  TF_RETURN_IF_ERROR(ctx->GetAttr("sample_size", &a->sample_size));
  TF_RETURN_IF_ERROR(ctx->GetAttr("margin", &a->margin));
  if (a->k < 0) return errors::InvalidArgument("k must be >= 0, got ", a->k);
  if (a->sample_size < 1) return errors::InvalidArgument("sample_size must be >= 1, got ", a->sample_size);
  if (!(a->margin >= 1.0f)) return errors::InvalidArgument("margin must be >= 1, got ", a->margin);
  return ::tensorflow::OkStatus();
}

Status CheckFloatVector(const char* op, const char* what, const Tensor& t) {
  if (!TensorShapeUtils::IsVector(t.shape()))
    return errors::InvalidArgument(op, ": ", what, " must be a 1-D float32 tensor, got shape ",
                                   t.shape().DebugString(), " (flatten it with tf.reshape(x, [-1]))");
  if (t.dim_size(0) >= (int64_t{1} << 31))
    return errors::InvalidArgument(op, ": ", what, " has ", t.dim_size(0),
                                   " entries; at most 2^31 - 1 are supported (int32 indices)");
  return ::tensorflow::OkStatus();
}

uint64_t SeedOf(const Tensor& seed) { return static_cast<uint64_t>(seed.scalar<int64_t>()()); }

template <>
struct TopkSelectFunctor<CPUDevice> {
  void operator()(OpKernelContext* ctx, const SelectAttrs& at, const Tensor& x, uint64_t seed,
                  Tensor* indices, Tensor* values) {
    const Pool pool(ctx);
    const int64_t n = x.dim_size(0);
    Source src;
    src.g = x.flat<float>().data();
    int32_t* idx = indices->flat<int32_t>().data();
    SelectTopK(pool, src, n, at.k, at.sample_size, at.margin, seed, idx);
    float* v = values->flat<float>().data();
    for (int64_t j = 0; j < at.k; ++j) v[j] = src.g[idx[j]];
  }
};

template <typename Device>
class TopkSelectOp : public OpKernel {
 public:
  explicit TopkSelectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadSelectAttrs(ctx, &attrs_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckFloatVector("HgsgcTopkSelect", "x", x));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(ctx->input(1).shape()),
                errors::InvalidArgument("HgsgcTopkSelect: seed must be an int64 scalar"));
    OP_REQUIRES(ctx, attrs_.k <= x.dim_size(0),
                errors::InvalidArgument("HgsgcTopkSelect: k = ", attrs_.k, " exceeds numel = ",
                                        x.dim_size(0)));
    Tensor *indices = nullptr, *values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({attrs_.k}), &indices));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({attrs_.k}), &values));
    TopkSelectFunctor<Device>()(ctx, attrs_, x, SeedOf(ctx->input(1)), indices, values);
  }

 private:
  SelectAttrs attrs_;
};

template <>
struct CompressFunctor<CPUDevice> {
  // residual / new_residual: float [n] or nullptr (no error feedback); they may alias (in place).
  // velocity / new_velocity (HgsgcCompressMomentum; nullptr otherwise, and then residual is set):
  // u = m v + g is written to new_velocity (may alias velocity) and compressed in place of grad;
  // with masking, new_velocity is then cleared (+0) at the selected entries whose sent value is
  // not 0 (DGC's momentum factor masking, the bits of HgsgcMomentumMask).
  void operator()(OpKernelContext* ctx, const SelectAttrs& at, int bits, bool ef, const Tensor& grad,
                  const float* residual, float* new_residual, uint64_t seed, Tensor* payload,
                  const float* velocity = nullptr, float* new_velocity = nullptr,
                  float momentum = 0.0f, bool masking = false) {
    const Pool pool(ctx);
    const int64_t n = grad.NumElements(), k = at.k;
    Source src;
    src.g = grad.flat<float>().data();
    if (residual != nullptr) {
      src.r = residual;
      src.out = new_residual;
    }
    if (velocity != nullptr) {
      src.v = velocity;
      src.vout = new_velocity;
      src.m = momentum;
    }
    std::vector<int32_t> idx(k);
    SelectTopK(pool, src, n, k, at.sample_size, at.margin, seed, idx.data());
    const float* a = src.Values();
    std::vector<float> sent(k);
    Encode(pool, idx.data(), k, n, bits, ef, [&](int64_t j) { return a[idx[j]]; },
           payload->flat<uint8_t>().data(), sent.data());
    if (residual != nullptr) {  // residual = a - scatter(sent): only the selected entries change
      ::tensorflow::port::ScopedFlushDenormal flush;
      float* out = src.out;
      for (int64_t j = 0; j < k; ++j) out[idx[j]] = out[idx[j]] - sent[j];
      if (velocity != nullptr && masking) {  // DAZ: a subnormal sent value compares equal to 0
        float* vout = src.vout;
        for (int64_t j = 0; j < k; ++j)
          if (!(sent[j] == 0.0f)) vout[idx[j]] = 0.0f;
      }
    }
  }
};

template <typename Device>
class CompressOp : public OpKernel {
 public:
  explicit CompressOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadSelectAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, CheckBits("HgsgcCompress", bits_));
    OP_REQUIRES_OK(ctx, ReadIndexCoding(ctx, "HgsgcCompress", &ef_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckFloatVector("HgsgcCompress", "grad", grad));
    OP_REQUIRES_OK(ctx, CheckFloatVector("HgsgcCompress", "residual", residual));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(ctx->input(2).shape()),
                errors::InvalidArgument("HgsgcCompress: seed must be an int64 scalar"));
    const int64_t n = grad.dim_size(0);
    const bool has_res = residual.dim_size(0) != 0 || n == 0;
    OP_REQUIRES(ctx, !has_res || residual.dim_size(0) == n,
                errors::InvalidArgument("HgsgcCompress: residual has ", residual.dim_size(0),
                                        " entries but grad has ", n,
                                        " (pass an empty residual to compress without error feedback)"));
    OP_REQUIRES(ctx, attrs_.k <= n,
                errors::InvalidArgument("HgsgcCompress: k = ", attrs_.k, " exceeds numel = ", n));
    Tensor *payload = nullptr, *new_res = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({PayloadLength(n, attrs_.k, bits_, ef_)}),
                                             &payload));
    if (has_res) {
      // a = grad + residual may overwrite grad's buffer when nothing else holds it.
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 1, TensorShape({n}), &new_res));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({0}), &new_res));
    }
    CompressFunctor<Device>()(ctx, attrs_, bits_, ef_, grad,
                              has_res ? residual.flat<float>().data() : nullptr,
                              has_res ? new_res->flat<float>().data() : nullptr,
                              SeedOf(ctx->input(2)), payload);
  }

 private:
  SelectAttrs attrs_;
  int bits_ = 2;
  bool ef_ = false;
};

// The runtime side of VariableCompressShape: the input checks HgsgcCompressResidual and
// HgsgcCompressMomentum share (session 12; the same messages as each op had on its own). `seed`
// (input `seed_input`) must be an int64 scalar; the gradient (input 0, any shape) must have fewer
// than 2^31 entries and at least k. Sets *n to the gradient's entry count.
Status CheckVariableCompressInputs(OpKernelContext* ctx, const char* op, const SelectAttrs& at,
                                   int seed_input, int64_t* n) {
  if (!TensorShapeUtils::IsScalar(ctx->input(seed_input).shape()))
    return errors::InvalidArgument(op, ": seed must be an int64 scalar");
  *n = ctx->input(0).NumElements();
  if (*n >= (int64_t{1} << 31))
    return errors::InvalidArgument(op, ": grad has ", *n, " entries; at most 2^31 - 1 are supported");
  if (at.k > *n) return errors::InvalidArgument(op, ": k = ", at.k, " exceeds numel = ", *n);
  return ::tensorflow::OkStatus();
}

// `t` (the tensor of the variable called `what`, locked by the caller) must be an initialized
// float32 tensor of n entries.
Status CheckCompressVariable(const char* op, const char* what, const Tensor* t, int64_t n) {
  if (t->IsInitialized() && t->dtype() == ::tensorflow::DT_FLOAT && t->NumElements() == n)
    return ::tensorflow::OkStatus();
  return errors::InvalidArgument(op, ": the ", what, " variable must be an initialized float32 "
                                 "variable of ", n, " entries, got ",
                                 t->IsInitialized() ? t->shape().DebugString() : "uninitialized");
}

// Where a compress op writes the new value of a locked variable: in place when nobody else holds
// its buffer, else (copy-on-write, like TF's training ops) into *fresh, allocated here; the
// caller then sets the variable's tensor to *fresh (returned *copy).
Status VariableOutput(OpKernelContext* ctx, ::tensorflow::Var* var, Tensor* fresh, bool* copy) {
  Tensor* t = var->tensor();
  *copy = var->copy_on_read_mode.load() || !t->RefCountIsOne();
  if (*copy) return ctx->allocate_temp(::tensorflow::DT_FLOAT, t->shape(), fresh);
  return ::tensorflow::OkStatus();
}

// Same computation, the residual being a resource variable updated in place (under its mutex):
// one pass reads grad and residual and writes the residual; no dense tensor is allocated unless
// the variable's buffer is shared (then it is replaced, copy-on-write like TF's training ops).
template <typename Device>
class CompressResidualOp : public OpKernel {
 public:
  explicit CompressResidualOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadSelectAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, CheckBits("HgsgcCompressResidual", bits_));
    OP_REQUIRES_OK(ctx, ReadIndexCoding(ctx, "HgsgcCompressResidual", &ef_));
  }
  void Compute(OpKernelContext* ctx) override {
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, CheckVariableCompressInputs(ctx, "HgsgcCompressResidual", attrs_, 2, &n));
    ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 1), &var));
    ::tensorflow::mutex_lock lock(*var->mu());
    Tensor* res = var->tensor();
    OP_REQUIRES_OK(ctx, CheckCompressVariable("HgsgcCompressResidual", "residual", res, n));
    Tensor* payload = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({PayloadLength(n, attrs_.k, bits_, ef_)}),
                                             &payload));
    Tensor fresh;
    bool copy = false;
    OP_REQUIRES_OK(ctx, VariableOutput(ctx, var.get(), &fresh, &copy));
    CompressFunctor<Device>()(ctx, attrs_, bits_, ef_, ctx->input(0), res->flat<float>().data(),
                              (copy ? &fresh : res)->flat<float>().data(), SeedOf(ctx->input(2)), payload);
    if (copy) *res = fresh;
  }

 private:
  SelectAttrs attrs_;
  int bits_ = 2;
  bool ef_ = false;
};

// HgsgcCompressResidual with DGC momentum correction folded in (session 11): the velocity, a
// second resource variable, is read and written in the same pass (u = m v + g, v := u, a = u + r),
// and with `masking` cleared at the sent entries afterwards. One op per tensor where the composed
// path ran HgsgcMomentumAccumulate + HgsgcCompressResidual + a dense decode of the own payload +
// HgsgcMomentumMask: no dense temporary, two dense read-write streams (v, r) and one read (g).
// Both variables are locked (in address order); each is written copy-on-write when its buffer is
// shared, in place otherwise.
template <typename Device>
class CompressMomentumOp : public OpKernel {
 public:
  explicit CompressMomentumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadSelectAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, CheckBits("HgsgcCompressMomentum", bits_));
    OP_REQUIRES_OK(ctx, ReadIndexCoding(ctx, "HgsgcCompressMomentum", &ef_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &momentum_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("masking", &masking_));
  }
  void Compute(OpKernelContext* ctx) override {
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, CheckVariableCompressInputs(ctx, "HgsgcCompressMomentum", attrs_, 3, &n));
    ::tensorflow::core::RefCountPtr<::tensorflow::Var> rvar, vvar;
    OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 1), &rvar));
    OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 2), &vvar));
    OP_REQUIRES(ctx, rvar.get() != vvar.get(),
                errors::InvalidArgument("HgsgcCompressMomentum: the residual and the velocity must "
                                        "be two different variables"));
    // lock both in address order (no other op locks this pair in the other order)
    ::tensorflow::mutex* m1 = rvar->mu();
    ::tensorflow::mutex* m2 = vvar->mu();
    if (m2 < m1) std::swap(m1, m2);
    ::tensorflow::mutex_lock lock1(*m1);
    ::tensorflow::mutex_lock lock2(*m2);
    Tensor* res = rvar->tensor();
    Tensor* vel = vvar->tensor();
    OP_REQUIRES_OK(ctx, CheckCompressVariable("HgsgcCompressMomentum", "residual", res, n));
    OP_REQUIRES_OK(ctx, CheckCompressVariable("HgsgcCompressMomentum", "velocity", vel, n));
    Tensor* payload = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({PayloadLength(n, attrs_.k, bits_, ef_)}),
                                             &payload));
    Tensor rfresh, vfresh;
    bool rcopy = false, vcopy = false;
    OP_REQUIRES_OK(ctx, VariableOutput(ctx, rvar.get(), &rfresh, &rcopy));
    OP_REQUIRES_OK(ctx, VariableOutput(ctx, vvar.get(), &vfresh, &vcopy));
    CompressFunctor<Device>()(ctx, attrs_, bits_, ef_, ctx->input(0), res->flat<float>().data(),
                              (rcopy ? &rfresh : res)->flat<float>().data(), SeedOf(ctx->input(3)),
                              payload, vel->flat<float>().data(),
                              (vcopy ? &vfresh : vel)->flat<float>().data(), momentum_, masking_);
    if (rcopy) *res = rfresh;
    if (vcopy) *vel = vfresh;
  }

 private:
  SelectAttrs attrs_;
  int bits_ = 2;
  bool ef_ = false;
  float momentum_ = 0.0f;
  bool masking_ = true;
};

template <>
struct SparseEncodeFunctor<CPUDevice> {
  void operator()(OpKernelContext* ctx, int64_t numel, int bits, bool ef, const Tensor& indices,
                  const Tensor& values, Tensor* payload, Tensor* sent) {
    const Pool pool(ctx);
    const float* v = values.flat<float>().data();
    Encode(pool, indices.flat<int32_t>().data(), indices.dim_size(0), numel, bits, ef,
           [v](int64_t j) { return v[j]; }, payload->flat<uint8_t>().data(),
           sent->flat<float>().data());
  }
};

template <typename Device>
class SparseEncodeOp : public OpKernel {
 public:
  explicit SparseEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("numel", &numel_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, CheckBits("HgsgcSparseEncode", bits_));
    OP_REQUIRES_OK(ctx, ReadIndexCoding(ctx, "HgsgcSparseEncode", &ef_));
    // Index widths (fixed: ceil(log2 numel), Elias-Fano: floor(log2(numel / k))) must stay <= 31:
    // a larger numel indexed past the 32 packers and shifted a uint32 by >= 32 bits.
    OP_REQUIRES(ctx, numel_ < (int64_t{1} << 31),
                errors::InvalidArgument("HgsgcSparseEncode: numel = ", numel_, "; at most 2^31 - 1 "
                                        "entries are supported (int32 indices)"));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    const Tensor& values = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()) &&
                         TensorShapeUtils::IsVector(values.shape()) &&
                         indices.dim_size(0) == values.dim_size(0),
                errors::InvalidArgument("HgsgcSparseEncode: indices and values must be 1-D of the "
                                        "same length, got ", indices.shape().DebugString(), " and ",
                                        values.shape().DebugString()));
    const int64_t k = indices.dim_size(0);
    OP_REQUIRES(ctx, k <= numel_,
                errors::InvalidArgument("HgsgcSparseEncode: k = ", k, " exceeds numel = ", numel_));
    const int32_t* idx = indices.flat<int32_t>().data();
    for (int64_t j = 0; j < k; ++j) {
      OP_REQUIRES(ctx, idx[j] >= 0 && idx[j] < numel_ && (j == 0 || idx[j] > idx[j - 1]),
                  errors::InvalidArgument("HgsgcSparseEncode: indices must be strictly ascending in "
                                          "[0, numel = ", numel_, "); position ", j, " holds ", idx[j]));
    }
    Tensor *payload = nullptr, *sent = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({PayloadLength(numel_, k, bits_, ef_)}), &payload));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &sent));
    SparseEncodeFunctor<Device>()(ctx, numel_, bits_, ef_, indices, values, payload, sent);
  }

 private:
  int64_t numel_ = 0;
  int bits_ = 2;
  bool ef_ = false;
};

// ---------------------------------------------------------------------------------------------
// Decode + dequantize + accumulate.

struct PayloadView {
  const uint8_t* idx = nullptr;    // packed indices (width w)
  const uint8_t* vals = nullptr;   // packed 2-bit codes or raw float32 values
  float lo = 0, hi = 0;            // 2-bit scales
  int64_t idx_bytes = 0;
  int64_t val_bytes = 0;
};

template <>
struct DecodeAccumulateFunctor<CPUDevice> {
  // divisor d > 1: every entry of the sum multiplied by float32(1 / d) after the last rank's add
  // (the average: what `sum / float(d)` computed inside every tf.function before, where grappler's
  // constant folding turns a division by a constant into a multiplication by its float32
  // reciprocal; one rounding, under flush-to-zero); 1: the sum as it is.
  void operator()(OpKernelContext* ctx, int64_t numel, int64_t k, int bits, bool ef, int64_t offset,
                  const Tensor& gathered, Tensor* sum, int64_t divisor = 1) {
    const Pool pool(ctx);
    const int64_t n = gathered.dim_size(0), P = gathered.dim_size(1);
    float* out = sum->flat<float>().data();
    const int64_t chunks = pool.Chunks(numel);
    if (k == 0 || n == 0) {
      pool.For(chunks, kChunk, [&](int64_t c) {
        const int64_t b = ChunkBegin(c, chunks, numel), e = ChunkBegin(c + 1, chunks, numel);
        std::memset(out + b, 0, sizeof(float) * (e - b));  // 0 / d = +0
      });
      return;
    }
    volatile float one = 1.0f;  // the reciprocal rounded to float32 once, as grappler folds it
    const float recip = one / static_cast<float>(divisor);
    const int w = IndexWidth(numel);
    const uint8_t* base = gathered.flat<uint8_t>().data();
    std::vector<PayloadView> pv(n);
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* p = base + r * P + offset;
      PayloadView& v = pv[r];
      v.idx_bytes = IndexBytes(numel, k, ef);
      if (bits == 2) {
        std::memcpy(&v.lo, p, 4);
        std::memcpy(&v.hi, p + 4, 4);
        v.idx = p + kScaleBytes;
        v.val_bytes = (k + 3) / 4;
      } else {
        v.idx = p;
        v.val_bytes = 4 * k;
      }
      v.vals = v.idx + v.idx_bytes;
    }
    // Elias-Fano: each payload's indices are decoded first (n k uint32, the sparse size; one
    // sequential pass per payload, in the same parallel loop over payloads as the chunk search),
    // then the accumulate below reads them instead of unpacking fixed-width indices.
    std::vector<uint32_t> dec(ef ? n * k : 0);
    std::vector<char> ok(n, 1);
    // seg[r * (chunks + 1) + c]: first entry of payload r whose index is >= the chunk's start.
    std::vector<int64_t> seg(n * (chunks + 1));
    pool.For(n, 64 * chunks + (ef ? 16 * k : 0), [&](int64_t r) {
      int64_t* s = seg.data() + r * (chunks + 1);
      s[0] = 0;
      s[chunks] = k;
      if (ef && !(ok[r] = EfDecode(pv[r].idx, k, numel, dec.data() + r * k))) return;
      for (int64_t c = 1; c < chunks; ++c) {
        const uint32_t start = static_cast<uint32_t>(ChunkBegin(c, chunks, numel));
        int64_t lo = 0, hi = k;  // lower_bound on the packed (ascending) indices
        while (lo < hi) {
          const int64_t mid = (lo + hi) / 2;
          const uint32_t x = ef ? dec[r * k + mid] : ExtractValue(pv[r].idx, pv[r].idx_bytes, mid, w);
          if (x < start) lo = mid + 1; else hi = mid;
        }
        s[c] = lo;
      }
    });
    for (int64_t r = 0; r < n; ++r) {
      if (!ok[r]) {
        ctx->CtxFailure(errors::InvalidArgument(
            "HgsgcDecodeAccumulate: payload of rank ", r, ": the Elias-Fano high part holds fewer "
            "than k = ", k, " set bits in its H = ", EfHighBits(numel, k), " bits (not an "
            "index_coding=elias_fano payload of this tensor? every rank must use the same "
            "compression.index_coding)"));
        return;
      }
    }
    const UnpackFn unpack_idx = kUnpackFns[w - 1];  // fixed coding only
    const UnpackFn unpack_codes = kUnpackFns[1];
    std::mutex err_mu;
    std::string err;
    pool.For(chunks, kChunk + 8 * n * k / chunks, [&](int64_t c) {
      const int64_t cb = ChunkBegin(c, chunks, numel), ce = ChunkBegin(c + 1, chunks, numel);
      std::memset(out + cb, 0, sizeof(float) * (ce - cb));
      uint32_t ib[kBlock], cbuf[kBlock];
      bool failed = false;
      for (int64_t r = 0; r < n && !failed; ++r) {
        const int64_t s = seg[r * (chunks + 1) + c], e = seg[r * (chunks + 1) + c + 1];
        if (e < s) {
          std::lock_guard<std::mutex> l(err_mu);
          err = "payload of rank " + std::to_string(r) + ": indices are not ascending";
          failed = true;
          break;
        }
        const PayloadView& v = pv[r];
        int64_t prev = cb - 1;
        for (int64_t b0 = s / kBlock * kBlock; b0 < e && !failed; b0 += kBlock) {
          const int64_t nb = std::min<int64_t>(kBlock, k - b0);
          if (ef) std::memcpy(ib, dec.data() + r * k + b0, sizeof(uint32_t) * nb);
          // (block b0 / 32 of a width-w stream starts at byte 4 w (b0 / 32); no pointer is formed
          // before ib / cbuf, which [expr.add] leaves undefined)
          else unpack_idx(v.idx + b0 / kBlock * (4 * w), 0, nb, ib);
          if (bits == 2) unpack_codes(v.vals + b0 / kBlock * 8, 0, nb, cbuf);
          const int64_t j1 = std::min<int64_t>(e, b0 + nb);
          for (int64_t j = std::max(s, b0); j < j1; ++j) {
            const int64_t i = ib[j - b0];
            if (i <= prev || i >= ce) {
              std::lock_guard<std::mutex> l(err_mu);
              err = "payload of rank " + std::to_string(r) + ": entry " + std::to_string(j) +
                    " has index " + std::to_string(i) +
                    (i >= numel ? " >= numel = " + std::to_string(numel)
                                : std::string(" (indices must be strictly ascending)"));
              failed = true;
              break;
            }
            prev = i;
            float val;
            if (bits == 2) {
              const uint32_t code = cbuf[j - b0];
              const float mag = (code & 1u) ? v.hi : v.lo;
              val = code >= 2 ? -mag : mag;
            } else {
              std::memcpy(&val, v.vals + 4 * j, 4);
            }
            out[i] += val;
          }
        }
      }
      if (divisor != 1 && !failed) {
        for (int64_t i = cb; i < ce; ++i) out[i] = out[i] * recip;
      }
    });
    if (!err.empty()) ctx->CtxFailure(errors::InvalidArgument("HgsgcDecodeAccumulate: ", err));
  }
};

template <typename Device>
class DecodeAccumulateOp : public OpKernel {
 public:
  explicit DecodeAccumulateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("numel", &numel_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("offset", &offset_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("divisor", &divisor_));
    OP_REQUIRES(ctx, divisor_ >= 1 && divisor_ <= (int64_t{1} << 24),
                errors::InvalidArgument("HgsgcDecodeAccumulate: divisor must be in [1, 2^24] (exact "
                                        "as a float32), got ", divisor_));
    OP_REQUIRES_OK(ctx, CheckBits("HgsgcDecodeAccumulate", bits_));
    OP_REQUIRES_OK(ctx, ReadIndexCoding(ctx, "HgsgcDecodeAccumulate", &ef_));
    OP_REQUIRES(ctx, numel_ >= 0 && numel_ < (int64_t{1} << 31) && k_ >= 0 && k_ <= numel_ && offset_ >= 0,
                errors::InvalidArgument("HgsgcDecodeAccumulate: need 0 <= k <= numel < 2^31 and "
                                        "offset >= 0, got numel = ", numel_, ", k = ", k_,
                                        ", offset = ", offset_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& gathered = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(gathered.shape()),
                errors::InvalidArgument("HgsgcDecodeAccumulate: gathered must be uint8 [n, P] (one "
                                        "row per rank), got shape ", gathered.shape().DebugString()));
    // len < 2^38 and the row length >= 0: the difference cannot overflow (offset + len could).
    const int64_t len = PayloadLength(numel_, k_, bits_, ef_);
    OP_REQUIRES(ctx, gathered.dim_size(1) - len >= offset_,
                errors::InvalidArgument("HgsgcDecodeAccumulate: rows of ", gathered.dim_size(1),
                                        " bytes cannot hold a payload of ", len,
                                        " bytes at offset ", offset_));
    Tensor* sum = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({numel_}), &sum));
    DecodeAccumulateFunctor<Device>()(ctx, numel_, k_, bits_, ef_, offset_, gathered, sum, divisor_);
  }

 private:
  int64_t numel_ = 0, k_ = 0, offset_ = 0, divisor_ = 1;
  int bits_ = 2;
  bool ef_ = false;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Op definitions.

Status VectorOfAttr(InferenceContext* c, int out, const char* attr) {
  int64_t v = 0;
  TF_RETURN_IF_ERROR(c->GetAttr(attr, &v));
  c->set_output(out, c->Vector(v));
  return ::tensorflow::OkStatus();
}

REGISTER_OP("HgsgcTopkSelect")
    .Input("x: float")
    .Input("seed: int64")
    .Output("indices: int32")
    .Output("values: float")
    .Attr("k: int >= 0")
    .Attr("sample_size: int = 1024")
    .Attr("margin: float = 1.5")
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(VectorOfAttr(c, 0, "k"));
      return VectorOfAttr(c, 1, "k");
    })
    .Doc("Exact top-k by magnitude (ties to the lower index) via a sampled threshold; ascending indices.");

REGISTER_OP("HgsgcSparseEncode")
    .Input("indices: int32")
    .Input("values: float")
    .Output("payload: uint8")
    .Output("sent: float")
    .Attr("numel: int >= 0")
    .Attr("bits: int")
    .Attr("index_coding: {'fixed', 'elias_fano'} = 'fixed'")
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle idx;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &idx));
      int64_t numel = 0;
      int bits = 0;
      bool ef = false;
      TF_RETURN_IF_ERROR(c->GetAttr("numel", &numel));
      TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
      TF_RETURN_IF_ERROR(ReadIndexCoding(c, "HgsgcSparseEncode", &ef));
      auto k = c->Dim(idx, 0);
      c->set_output(0, c->Vector(c->ValueKnown(k) && (bits == 2 || bits == 32) && c->Value(k) <= numel
                                     ? c->MakeDim(PayloadLength(numel, c->Value(k), bits, ef))
                                     : c->UnknownDim()));
      c->set_output(1, c->Vector(k));
      return ::tensorflow::OkStatus();
    })
    .Doc("Wire payload of codec.encode (2-bit or float32 values) and the values a receiver decodes.");

REGISTER_OP("HgsgcCompress")
    .Input("grad: float")
    .Input("residual: float")
    .Input("seed: int64")
    .Output("payload: uint8")
    .Output("new_residual: float")
    .Attr("k: int >= 0")
    .Attr("bits: int")
    .Attr("sample_size: int = 1024")
    .Attr("margin: float = 1.5")
    .Attr("index_coding: {'fixed', 'elias_fano'} = 'fixed'")
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle g, r;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &g));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &r));
      int64_t k = 0;
      int bits = 0;
      bool ef = false;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
      TF_RETURN_IF_ERROR(ReadIndexCoding(c, "HgsgcCompress", &ef));
      auto n = c->Dim(g, 0);
      c->set_output(0, c->Vector(c->ValueKnown(n) && (bits == 2 || bits == 32) && k <= c->Value(n)
                                     ? c->MakeDim(PayloadLength(c->Value(n), k, bits, ef))
                                     : c->UnknownDim()));
      c->set_output(1, r);
      return ::tensorflow::OkStatus();
    })
    .Doc("Fused compensate (grad + residual) + top-k + encode + residual update (empty residual: no error feedback).");

// Shape of the payload of an op that compresses input 0 (a float32 gradient of any shape) into a
// resource variable: a vector of PayloadLength(numel, k, bits, coding) bytes when numel is static.
static Status VariableCompressShape(InferenceContext* c, const char* op) {
  int64_t k = 0;
  int bits = 0;
  bool ef = false;
  TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
  TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
  TF_RETURN_IF_ERROR(ReadIndexCoding(c, op, &ef));
  int64_t n = -1;
  if (c->FullyDefined(c->input(0))) {
    n = 1;
    for (int i = 0; i < c->Rank(c->input(0)); ++i) n *= c->Value(c->Dim(c->input(0), i));
  }
  c->set_output(0, c->Vector(n >= 0 && (bits == 2 || bits == 32) && k <= n ? c->MakeDim(PayloadLength(n, k, bits, ef))
                                                                 : c->UnknownDim()));
  return ::tensorflow::OkStatus();
}

REGISTER_OP("HgsgcCompressResidual")
    .Input("grad: float")
    .Input("residual: resource")
    .Input("seed: int64")
    .Output("payload: uint8")
    .Attr("k: int >= 0")
    .Attr("bits: int")
    .Attr("sample_size: int = 1024")
    .Attr("margin: float = 1.5")
    .Attr("index_coding: {'fixed', 'elias_fano'} = 'fixed'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return VariableCompressShape(c, "HgsgcCompressResidual"); })
    .Doc("HgsgcCompress with the residual a float32 resource variable (any shape) updated in place.");

REGISTER_OP("HgsgcCompressMomentum")
    .Input("grad: float")
    .Input("residual: resource")
    .Input("velocity: resource")
    .Input("seed: int64")
    .Output("payload: uint8")
    .Attr("k: int >= 0")
    .Attr("bits: int")
    .Attr("sample_size: int = 1024")
    .Attr("margin: float = 1.5")
    .Attr("index_coding: {'fixed', 'elias_fano'} = 'fixed'")
    .Attr("momentum: float")
    .Attr("masking: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return VariableCompressShape(c, "HgsgcCompressMomentum"); })
    .Doc("HgsgcCompressResidual of u = momentum * velocity + grad, the velocity (a float32 resource "
         "variable) set to u and, with masking, cleared where the sent value is not 0.");

REGISTER_OP("HgsgcDecodeAccumulate")
    .Input("gathered: uint8")
    .Output("sum: float")
    .Attr("numel: int >= 0")
    .Attr("k: int >= 0")
    .Attr("bits: int")
    .Attr("offset: int = 0")
    .Attr("index_coding: {'fixed', 'elias_fano'} = 'fixed'")
    .Attr("divisor: int = 1")
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &unused));
      return VectorOfAttr(c, 0, "numel");
    })
    .Doc("Rank-order sum of the dense tensors decoded from every row's payload at `offset`, "
         "times float32(1 / divisor) (1: the sum).");

REGISTER_KERNEL_BUILDER(Name("HgsgcTopkSelect").Device(DEVICE_CPU), TopkSelectOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HgsgcSparseEncode").Device(DEVICE_CPU), SparseEncodeOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HgsgcCompress").Device(DEVICE_CPU), CompressOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HgsgcCompressResidual").Device(DEVICE_CPU).HostMemory("seed"),
                        CompressResidualOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HgsgcCompressMomentum").Device(DEVICE_CPU).HostMemory("seed"),
                        CompressMomentumOp<CPUDevice>);
REGISTER_KERNEL_BUILDER(Name("HgsgcDecodeAccumulate").Device(DEVICE_CPU),
                        DecodeAccumulateOp<CPUDevice>);

}  // namespace hgsgc
