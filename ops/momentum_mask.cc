// DGC momentum correction and momentum factor masking (Lin et al., ICLR 2018, Sec. 3.2) as two
// one-pass CPU kernels on the velocity variable, for hgsgc.compression.wrappers.MomentumCorrection.
//
// Ops:
//   HgsgcMomentumAccumulate(velocity: resource (float32 variable, numel entries), grad: float
//       [any shape, numel entries]) [momentum: float]
//       -> u: float [numel] = momentum * velocity + grad    (two roundings: the product, then the sum)
//   HgsgcMomentumMask(velocity: resource, u: float [numel], sent: float [numel])
//       velocity := (sent == 0 ? u : +0). When u's buffer is not referenced elsewhere (inside a
//       tf.function, after the compression has read it) it becomes the velocity's buffer and only
//       the entries with sent != 0 are written; else the velocity is written whole, in place or
//       copy-on-write when its buffer is shared.
//
// Bit-identity contract with the pure-TF path they replace (tests/test_kernels10.py):
//   u    = m * v + x                          (tf.multiply, then tf.add: Eigen's CPU kernels)
//   v   := tf.where(tf.equal(sent, 0.0), u, 0.0)
// Every float operation is the same IEEE operation in the same order, without FMA contraction
// (-ffp-contract=off in setup.py and the pragma below), under TensorFlow's flush-to-zero /
// denormals-are-zero mode (tensorflow::port::ScopedFlushDenormal, as TF's kernels run): a
// subnormal v or x reads as 0, a subnormal product or sum is written as 0, and a subnormal `sent`
// compares equal to 0 (as tf.equal does under DAZ). NaN == 0 is false (the entry is cleared).
// `u` is copied bit for bit. The momentum attribute is a float32, the value TF converts the
// Python float to.
//
// Why: the TF path runs 5 kernels per tensor (Mul, AddV2, Equal, Select, AssignVariableOp) and
// allocates 3 dense temporaries; these two run 2 kernels and allocate one (u), which the mask
// then keeps as the new velocity.
//
// Threads: contiguous chunks on TF's intra-op pool (tensorflow::Shard), as ops/sparse_codec.cc.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

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

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
namespace errors = ::tensorflow::errors;

constexpr int64_t kMinChunk = 1 << 18;  // entries per work unit below which one thread does it

// fn(begin, end) over [0, n) on TF's intra-op pool, flush-to-zero on in every thread.
template <typename Fn>
void ParallelFor(OpKernelContext* ctx, int64_t n, Fn&& fn) {
  auto work = [&fn](int64_t b, int64_t e) {
    ::tensorflow::port::ScopedFlushDenormal flush;
    fn(b, e);
  };
  const auto* t = ctx->device()->tensorflow_cpu_worker_threads();
  if (t == nullptr || t->workers == nullptr || t->num_threads <= 1 || n < 2 * kMinChunk) {
    work(0, n);
    return;
  }
  const int64_t units = std::min<int64_t>(4 * t->num_threads, n / kMinChunk);
  ::tensorflow::Shard(t->num_threads, t->workers, units, /*cost_per_unit=*/kMinChunk * 4,
                      [&](int64_t b, int64_t e) { work(n * b / units, n * e / units); });
}

Status LookupVariable(OpKernelContext* ctx, int input,
                      ::tensorflow::core::RefCountPtr<::tensorflow::Var>* var) {
  return ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, input), var);
}

Status CheckVelocity(const Tensor* v, int64_t numel, const char* op) {
  if (!v->IsInitialized() || v->dtype() != ::tensorflow::DT_FLOAT || v->NumElements() != numel) {
    return errors::InvalidArgument(op, ": the velocity variable must be an initialized float32 "
                                   "variable of ", numel, " entries, got ",
                                   v->IsInitialized() ? v->shape().DebugString() : "uninitialized");
  }
  return ::tensorflow::OkStatus();
}

class MomentumAccumulateOp : public OpKernel {
 public:
  explicit MomentumAccumulateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &momentum_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(1);
    const int64_t n = grad.NumElements();
    ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, 0, &var));
    ::tensorflow::tf_shared_lock lock(*var->mu());
    const Tensor* v = var->tensor();
    OP_REQUIRES_OK(ctx, CheckVelocity(v, n, "HgsgcMomentumAccumulate"));
    Tensor* u = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({n}), &u));
    const float m = momentum_;
    const float* vp = v->flat<float>().data();
    const float* gp = grad.flat<float>().data();
    float* up = u->flat<float>().data();
    ParallelFor(ctx, n, [=](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float t = m * vp[i];  // rounded (and flushed) before the sum, as tf.multiply
        up[i] = t + gp[i];
      }
    });
  }

 private:
  float momentum_ = 0.0f;
};

class MomentumMaskOp : public OpKernel {
 public:
  explicit MomentumMaskOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(1);
    const Tensor& sent = ctx->input(2);
    const int64_t n = u.NumElements();
    OP_REQUIRES(ctx, sent.NumElements() == n,
                errors::InvalidArgument("HgsgcMomentumMask: u has ", n, " entries but sent has ",
                                        sent.NumElements()));
    ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, 0, &var));
    ::tensorflow::mutex_lock lock(*var->mu());
    Tensor* v = var->tensor();
    OP_REQUIRES_OK(ctx, CheckVelocity(v, n, "HgsgcMomentumMask"));
    const float* up = u.flat<float>().data();
    const float* sp = sent.flat<float>().data();
    // u is usually dead after this op (inside a tf.function nothing else reads it): then its
    // buffer becomes the velocity and only the sent entries are cleared (one read of `sent`,
    // no dense write); else v is written whole, in place or copy-on-write.
    std::unique_ptr<Tensor> fwd = ctx->forward_input(
        1, OpKernelContext::Params::kNoReservation, ::tensorflow::DT_FLOAT, u.shape(),
        ::tensorflow::DEVICE_MEMORY, ::tensorflow::AllocatorAttributes());
    if (fwd != nullptr) {
      Tensor t;
      OP_REQUIRES(ctx, t.CopyFrom(*fwd, v->shape()),
                  errors::Internal("HgsgcMomentumMask: cannot view u as the velocity's shape"));
      float* out = t.flat<float>().data();
      ParallelFor(ctx, n, [=](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          if (!(sp[i] == 0.0f)) out[i] = 0.0f;  // DAZ: a subnormal s compares equal to 0
        }
      });
      *v = t;
      return;
    }
    Tensor fresh;
    float* out;
    const bool copy = var->copy_on_read_mode.load() || !v->RefCountIsOne();
    if (copy) {
      // someone holds the old value: write to a new buffer (copy-on-write, as TF's training ops)
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, v->shape(), &fresh));
      out = fresh.flat<float>().data();
    } else {
      out = v->flat<float>().data();
    }
    ParallelFor(ctx, n, [=](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float s = sp[i];
        float keep;
        std::memcpy(&keep, up + i, sizeof(float));  // u's bits, untouched
        out[i] = (s == 0.0f) ? keep : 0.0f;          // DAZ: a subnormal s compares equal to 0
      }
    });
    if (copy) *v = fresh;
  }
};

REGISTER_KERNEL_BUILDER(Name("HgsgcMomentumAccumulate").Device(::tensorflow::DEVICE_CPU),
                        MomentumAccumulateOp);
REGISTER_KERNEL_BUILDER(Name("HgsgcMomentumMask").Device(::tensorflow::DEVICE_CPU), MomentumMaskOp);

}  // namespace

REGISTER_OP("HgsgcMomentumAccumulate")
    .Input("velocity: resource")
    .Input("grad: float")
    .Output("u: float")
    .Attr("momentum: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) -> Status {
      ShapeHandle g = c->input(1);
      if (!c->RankKnown(g)) {
        c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
        return ::tensorflow::OkStatus();
      }
      ::tensorflow::shape_inference::DimensionHandle n = c->MakeDim(1);
      for (int i = 0; i < c->Rank(g); ++i) TF_RETURN_IF_ERROR(c->Multiply(n, c->Dim(g, i), &n));
      c->set_output(0, c->Vector(n));
      return ::tensorflow::OkStatus();
    })
    .Doc("DGC momentum correction: u = momentum * velocity + grad (flat), one pass.");

REGISTER_OP("HgsgcMomentumMask")
    .Input("velocity: resource")
    .Input("u: float")
    .Input("sent: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) -> Status { return ::tensorflow::OkStatus(); })
    .Doc("DGC momentum factor masking: velocity := (sent == 0 ? u : 0), in place.");

}  // namespace hgsgc
