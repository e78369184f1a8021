// One merge of SGC's hierarchical (tree / node) exchange in one pass: the sorted union of two
// sparse aggregates, their summed values, and the per-tensor top-k of the sum
// (hgsgc/hierarchy.py, _merge_all; issue 10, session 17).
//
// Op:
//   HgsgcSparseMergeSelect(idx_a: int64 [m_a], vals_a: float [m_a], idx_b: int64 [m_b],
//       vals_b: float [m_b], base: int64 [T], k: int32 [T]) [kept: int]
//       -> union: int64 [u]      the sorted distinct global indices of idx_a and idx_b
//          contrib_a: float [u]  vals_a at its index in the union, else +0
//          contrib_b: float [u]  the same for b
//          total: float [u]      contrib_a + contrib_b
//          pos: int32 [kept]     ascending positions in `union` of the entries kept: for each tensor
//                                t (union entries with base[t] <= index < base[t + 1]), the k[t]
//                                largest |total| (ties: the lower position), all of them when the
//                                tensor has fewer; `kept` must equal the number kept.
//   idx_a and idx_b must each be strictly ascending (as decoded payloads are); base ascending,
//   base[0] <= every index.
//
// Bit-identity contract with the pure-TF path (hierarchy._merge_all_reference; tests/test_kernels17.py):
//   union      = tf.unique(tf.sort(concat(idx_a, idx_b))).y
//   contrib_p  = tf.where(present, tf.gather(vals_p, pos_p), 0.0)        (bits copied)
//   total      = contrib_a + contrib_b                                   (one IEEE add, FTZ/DAZ)
//   key        = ((T - 1 - seg) << 32) + bitcast<int32>(|total|), sorted descending by
//                tf.math.top_k (equal keys: the lower position first), the first k[t] of each
//                tensor kept, positions sorted ascending.
// The add runs under TensorFlow's flush-to-zero / denormals-are-zero mode
// (tensorflow::port::ScopedFlushDenormal, as TF's CPU kernels run) and without FMA contraction;
// |x| is the bit pattern with the sign bit cleared (tf.abs on CPU: NaN stays NaN, -0 becomes +0),
// compared as int32 (so NaN sorts above +inf, as in the key above).
//
// Why: the TF path sorts 2K entries, deduplicates them, binary-searches and gathers once per part,
// then sorts the 2K keys again with top_k: about 4 ms per merge round for VGG-16's 45 tensors at
// 1 % density (K = 9,589) on this machine, 3 rounds per exchange on 8 ranks. Here: one linear
// merge and one selection per tensor.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"

#pragma GCC optimize("fp-contract=off")

namespace hgsgc {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
namespace errors = ::tensorflow::errors;

inline int32_t AbsBits(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b & 0x7fffffff;
}

class SparseMergeSelectOp : public OpKernel {
 public:
  explicit SparseMergeSelectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kept", &kept_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ia = ctx->input(0);
    const Tensor& va = ctx->input(1);
    const Tensor& ib = ctx->input(2);
    const Tensor& vb = ctx->input(3);
    const Tensor& base_t = ctx->input(4);
    const Tensor& k_t = ctx->input(5);
    OP_REQUIRES(ctx, ia.NumElements() == va.NumElements() && ib.NumElements() == vb.NumElements(),
                errors::InvalidArgument("HgsgcSparseMergeSelect: indices and values of a part differ in "
                                        "length: ", ia.NumElements(), " / ", va.NumElements(), " and ",
                                        ib.NumElements(), " / ", vb.NumElements()));
    const int64_t T = base_t.NumElements();
    OP_REQUIRES(ctx, T >= 1 && k_t.NumElements() == T,
                errors::InvalidArgument("HgsgcSparseMergeSelect: base and k must have one entry per "
                                        "tensor (>= 1), got ", T, " and ", k_t.NumElements()));
    const int64_t ma = ia.NumElements(), mb = ib.NumElements();
    const int64_t* a = ia.flat<int64_t>().data();
    const int64_t* b = ib.flat<int64_t>().data();
    const float* fa = va.flat<float>().data();
    const float* fb = vb.flat<float>().data();
    const int64_t* base = base_t.flat<int64_t>().data();
    const int32_t* kk = k_t.flat<int32_t>().data();
    for (int64_t i = 1; i < ma; ++i)
      OP_REQUIRES(ctx, a[i - 1] < a[i], errors::InvalidArgument(
                           "HgsgcSparseMergeSelect: idx_a is not strictly ascending at ", i));
    for (int64_t i = 1; i < mb; ++i)
      OP_REQUIRES(ctx, b[i - 1] < b[i], errors::InvalidArgument(
                           "HgsgcSparseMergeSelect: idx_b is not strictly ascending at ", i));
    for (int64_t t = 1; t < T; ++t)
      OP_REQUIRES(ctx, base[t - 1] <= base[t],
                  errors::InvalidArgument("HgsgcSparseMergeSelect: base is not ascending at ", t));
    const int64_t lowest = std::min(ma ? a[0] : base[0], mb ? b[0] : base[0]);
    OP_REQUIRES(ctx, lowest >= base[0], errors::InvalidArgument(
                     "HgsgcSparseMergeSelect: index ", lowest, " lies below base[0] = ", base[0]));

    // 1. the union, by one linear merge of the two ascending lists
    std::vector<int64_t> u;
    std::vector<float> ca, cb;
    u.reserve(ma + mb);
    ca.reserve(ma + mb);
    cb.reserve(ma + mb);
    {
      int64_t i = 0, j = 0;
      while (i < ma || j < mb) {
        if (j >= mb || (i < ma && a[i] < b[j])) {
          u.push_back(a[i]);
          ca.push_back(fa[i++]);
          cb.push_back(0.0f);
        } else if (i >= ma || b[j] < a[i]) {
          u.push_back(b[j]);
          ca.push_back(0.0f);
          cb.push_back(fb[j++]);
        } else {
          u.push_back(a[i]);
          ca.push_back(fa[i++]);
          cb.push_back(fb[j++]);
        }
      }
    }
    const int64_t n = static_cast<int64_t>(u.size());
    Tensor *ou, *oca, *ocb, *otot, *opos;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &ou));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &oca));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &ocb));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &otot));
    std::copy(u.begin(), u.end(), ou->flat<int64_t>().data());
    std::memcpy(oca->flat<float>().data(), ca.data(), n * sizeof(float));  // bits copied
    std::memcpy(ocb->flat<float>().data(), cb.data(), n * sizeof(float));
    float* tot = otot->flat<float>().data();
    {
      ::tensorflow::port::ScopedFlushDenormal flush;  // as TF's CPU add
      for (int64_t i = 0; i < n; ++i) tot[i] = ca[i] + cb[i];
    }

    // 2. per tensor (a contiguous range of the union), the k[t] largest |total|, ties: lower position
    std::vector<int32_t> keep;
    keep.reserve(kept_);
    std::vector<int32_t> cand;
    int64_t s = 0;
    for (int64_t t = 0; t < T && s < n; ++t) {
      const bool last = (t + 1 == T);
      int64_t e = s;
      while (e < n && (last || u[e] < base[t + 1])) ++e;
      const int64_t cnt = e - s;
      const int64_t want = std::max<int64_t>(0, std::min<int64_t>(kk[t], cnt));
      if (want == cnt) {
        for (int64_t i = s; i < e; ++i) keep.push_back(static_cast<int32_t>(i));
      } else if (want > 0) {
        cand.resize(cnt);
        for (int64_t i = 0; i < cnt; ++i) cand[i] = static_cast<int32_t>(s + i);
        auto before = [tot](int32_t x, int32_t y) {
          const int32_t mx = AbsBits(tot[x]), my = AbsBits(tot[y]);
          return mx > my || (mx == my && x < y);
        };
        std::nth_element(cand.begin(), cand.begin() + want, cand.end(), before);
        std::sort(cand.begin(), cand.begin() + want);
        keep.insert(keep.end(), cand.begin(), cand.begin() + want);
      }
      s = e;
    }
    OP_REQUIRES(ctx, static_cast<int64_t>(keep.size()) == kept_,
                errors::InvalidArgument("HgsgcSparseMergeSelect: the tensors keep ", keep.size(),
                                        " entries in all, not the kept=", kept_, " attribute (a union "
                                        "holding fewer than k entries of some tensor)"));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({kept_}), &opos));
    std::copy(keep.begin(), keep.end(), opos->flat<int32_t>().data());
  }

 private:
  int64_t kept_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("HgsgcSparseMergeSelect").Device(::tensorflow::DEVICE_CPU), SparseMergeSelectOp);

// HgsgcPackFields(values: int32 [F], bitpos: int32 [F], span: int32 [F], bytes: uint8 [B],
//     bytepos: int32 [B]) [length: int] -> payload: uint8 [length]
// The payload hierarchy._write builds with one tf.scatter_nd (session 17): every field adds its
// bytes into an int32 accumulator per payload byte, which is then cast to uint8 (mod 256):
//   span[i] == 0 (a 1-bit field, its position possibly computed): acc[bitpos >> 3] += values << (bitpos & 7)
//   span[i] >= 1: wide = int64(values) << (bitpos & 7); for s < span:
//                 acc[min((bitpos >> 3) + s, length - 1)] += (wide >> 8 s) & 255
//   bytes: acc[bytepos] += bytes
// Positions outside [0, length) raise InvalidArgument (as tf.scatter_nd on CPU).
class PackFieldsOp : public OpKernel {
 public:
  explicit PackFieldsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("length", &length_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& v_t = ctx->input(0);
    const Tensor& p_t = ctx->input(1);
    const Tensor& s_t = ctx->input(2);
    const Tensor& b_t = ctx->input(3);
    const Tensor& bp_t = ctx->input(4);
    const int64_t F = v_t.NumElements(), B = b_t.NumElements();
    OP_REQUIRES(ctx, p_t.NumElements() == F && s_t.NumElements() == F && bp_t.NumElements() == B,
                errors::InvalidArgument("HgsgcPackFields: values / bitpos / span (", F, ", ", p_t.NumElements(),
                                        ", ", s_t.NumElements(), ") and bytes / bytepos (", B, ", ",
                                        bp_t.NumElements(), ") must pair up"));
    const int32_t* v = v_t.flat<int32_t>().data();
    const int32_t* pos = p_t.flat<int32_t>().data();
    const int32_t* span = s_t.flat<int32_t>().data();
    const uint8_t* by = b_t.flat<uint8_t>().data();
    const int32_t* bpos = bp_t.flat<int32_t>().data();
    const int64_t P = length_;
    std::vector<int32_t> acc(P, 0);
    for (int64_t i = 0; i < F; ++i) {
      const int32_t p = pos[i];
      OP_REQUIRES(ctx, p >= 0, errors::InvalidArgument("HgsgcPackFields: bit position ", p, " of field ", i,
                                                        " is negative"));
      const int64_t at = p >> 3;
      if (span[i] <= 0) {
        OP_REQUIRES(ctx, at < P, errors::InvalidArgument("HgsgcPackFields: field ", i, " at byte ", at,
                                                          " outside the payload of ", P, " bytes"));
        acc[at] += static_cast<int32_t>(static_cast<uint32_t>(v[i]) << (p & 7));
        continue;
      }
      const int64_t wide = static_cast<int64_t>(v[i]) << (p & 7);
      for (int32_t s = 0; s < span[i]; ++s) {
        const int64_t where = std::min<int64_t>(at + s, P - 1);
        OP_REQUIRES(ctx, where >= 0, errors::InvalidArgument("HgsgcPackFields: empty payload"));
        acc[where] += static_cast<int32_t>((wide >> (8 * s)) & 255);
      }
    }
    for (int64_t i = 0; i < B; ++i) {
      OP_REQUIRES(ctx, bpos[i] >= 0 && bpos[i] < P,
                  errors::InvalidArgument("HgsgcPackFields: byte ", i, " at ", bpos[i], " outside the payload of ",
                                          P, " bytes"));
      acc[bpos[i]] += static_cast<int32_t>(by[i]);
    }
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({P}), &out));
    uint8_t* o = out->flat<uint8_t>().data();
    for (int64_t j = 0; j < P; ++j) o[j] = static_cast<uint8_t>(acc[j]);
  }

 private:
  int64_t length_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("HgsgcPackFields").Device(::tensorflow::DEVICE_CPU), PackFieldsOp);

}  // namespace

REGISTER_OP("HgsgcSparseMergeSelect")
    .Input("idx_a: int64")
    .Input("vals_a: float")
    .Input("idx_b: int64")
    .Input("vals_b: float")
    .Input("base: int64")
    .Input("k: int32")
    .Output("union: int64")
    .Output("contrib_a: float")
    .Output("contrib_b: float")
    .Output("total: float")
    .Output("pos: int32")
    .Attr("kept: int >= 0")
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle unused;
      for (int i = 0; i < 6; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
      for (int i = 0; i < 4; ++i) c->set_output(i, c->Vector(InferenceContext::kUnknownDim));
      int64_t kept;
      TF_RETURN_IF_ERROR(c->GetAttr("kept", &kept));
      c->set_output(4, c->Vector(kept));
      return ::tensorflow::OkStatus();
    })
    .Doc("Sorted union of two sparse aggregates, their sum, and the per-tensor top-k of |sum| "
         "(positions in the union, ascending): one merge of SGC's tree / node exchange.");

REGISTER_OP("HgsgcPackFields")
    .Input("values: int32")
    .Input("bitpos: int32")
    .Input("span: int32")
    .Input("bytes: uint8")
    .Input("bytepos: int32")
    .Output("payload: uint8")
    .Attr("length: int >= 0")
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle unused;
      for (int i = 0; i < 5; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
      int64_t length;
      TF_RETURN_IF_ERROR(c->GetAttr("length", &length));
      c->set_output(0, c->Vector(length));
      return ::tensorflow::OkStatus();
    })
    .Doc("The payload of bit fields and whole bytes at given positions, as hierarchy._write's "
         "tf.scatter_nd builds it (int32 sums per byte, cast to uint8).");

}  // namespace hgsgc
