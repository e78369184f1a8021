// Bit packing of unsigned integers of arbitrary width (1..32 bits) for hgsgc's wire codec.
//
// Ops:
//   HgsgcPackBits(values: int32 [n], width: int) -> packed: uint8 [ceil(n * width / 8)]
//   HgsgcUnpackBits(packed: uint8 [m], count: int32 scalar, width: int) -> values: int32 [count]
//
// Bit stream layout (little-endian, shared with hgsgc/ops.py's pure-TF reference):
//   value i occupies stream bits [i * width, (i + 1) * width), least significant bit first;
//   stream bit j is bit (j % 8) of byte j / 8; the unused high bits of the last byte are 0.
// Values are taken as uint32 bit patterns. Packing a value >= 2^width (width < 32) is an
// InvalidArgument error (never a silent truncation). Unpacking ignores the padding bits of
// the last byte.
//
// Implementation: the kernels are templated on the width, so the inner loops work on a 64-bit
// accumulator with 32-bit little-endian stores/loads and compile-time shifts. Work is split into
// blocks of 32 values: a block of 32 values of width w is exactly w 32-bit words (4 * w bytes), so
// blocks start on byte boundaries and can be packed/unpacked independently on TF's intra-op
// thread pool.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"
#include "bitpack.h"

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
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
namespace errors = ::tensorflow::errors;

using namespace ::hgsgc::bitpack;  // NOLINT: the primitives of ops/bitpack.h

// Runs fn(first_value, num_values) over [0, n) in kBlock-aligned pieces on the intra-op pool.
template <typename Fn>
void ForEachBlockRange(OpKernelContext* ctx, int64_t n, int width, Fn fn) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  // Rough cost of one block in cycles: ~1 cycle per value plus per-byte traffic.
  const int64_t cost_per_block = kBlock + 4 * width;
  auto work = [n, &fn](int64_t begin_block, int64_t end_block) {
    const int64_t first = begin_block * kBlock;
    const int64_t last = std::min(end_block * kBlock, n);
    if (last > first) fn(first, last - first);
  };
  const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  if (threads == nullptr || threads->workers == nullptr) {
    work(0, num_blocks);
    return;
  }
  ::tensorflow::Shard(threads->num_threads, threads->workers, num_blocks, cost_per_block, work);
}

// ---------------------------------------------------------------------------------------------
// Kernels.

class PackBitsOp : public OpKernel {
 public:
  explicit PackBitsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("width", &width_));
    OP_REQUIRES_OK(ctx, CheckWidth("HgsgcPackBits", width_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(values.shape()),
                errors::InvalidArgument("HgsgcPackBits: values must be a 1-D int32 tensor, got shape ",
                                        values.shape().DebugString()));
    const int64_t n = values.dim_size(0);
    const int64_t m = PackedLength(n, width_);
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m}), &packed));
    if (n == 0) return;

    const uint32_t* in = reinterpret_cast<const uint32_t*>(values.flat<int32_t>().data());
    uint8_t* out = packed->flat<uint8_t>().data();
    const PackFn pack = kPackFns[width_ - 1];
    std::atomic<uint32_t> ored{0};
    ForEachBlockRange(ctx, n, width_, [&](int64_t first, int64_t count) {
      ored.fetch_or(pack(in, first, count, out), std::memory_order_relaxed);
    });

    if (width_ < 32 && (ored.load(std::memory_order_relaxed) >> width_) != 0) {
      // Slow path, only on error: report the first offending value.
      for (int64_t i = 0; i < n; ++i) {
        if ((in[i] >> width_) != 0) {
          // Values are uint32 bit patterns; negative int32 inputs are named both ways.
          const int32_t as_int = static_cast<int32_t>(in[i]);
          ctx->CtxFailure(errors::InvalidArgument(
              "HgsgcPackBits: value ", in[i],
              as_int < 0 ? " (int32 " + std::to_string(as_int) + ")" : std::string(),
              " at position ", i, " does not fit in width ", width_, " bits (values must be in [0, ",
              uint64_t{1} << width_, "))"));
          return;
        }
      }
    }
  }

 private:
  int width_ = 0;
};

class UnpackBitsOp : public OpKernel {
 public:
  explicit UnpackBitsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("width", &width_));
    OP_REQUIRES_OK(ctx, CheckWidth("HgsgcUnpackBits", width_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    const Tensor& count_t = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(packed.shape()),
                errors::InvalidArgument("HgsgcUnpackBits: packed must be a 1-D uint8 tensor, got shape ",
                                        packed.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(count_t.shape()),
                errors::InvalidArgument("HgsgcUnpackBits: count must be an int32 scalar, got shape ",
                                        count_t.shape().DebugString()));
    const int64_t count = count_t.scalar<int32_t>()();
    OP_REQUIRES(ctx, count >= 0,
                errors::InvalidArgument("HgsgcUnpackBits: count must be >= 0, got ", count));
    const int64_t m = packed.dim_size(0);
    const int64_t expected = PackedLength(count, width_);
    OP_REQUIRES(ctx, m == expected,
                errors::InvalidArgument("HgsgcUnpackBits: packed has ", m, " bytes but ", count,
                                        " values of width ", width_, " need ceil(", count, " * ",
                                        width_, " / 8) = ", expected, " bytes"));
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({count}), &values));
    if (count == 0) return;

    const uint8_t* in = packed.flat<uint8_t>().data();
    uint32_t* out = reinterpret_cast<uint32_t*>(values->flat<int32_t>().data());
    const UnpackFn unpack = kUnpackFns[width_ - 1];
    ForEachBlockRange(ctx, count, width_,
                      [&](int64_t first, int64_t n) { unpack(in, first, n, out); });
  }

 private:
  int width_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Op registrations.

REGISTER_OP("HgsgcPackBits")
    .Input("values: int32")
    .Output("packed: uint8")
    .Attr("width: int >= 1")
    .SetShapeFn([](InferenceContext* c) -> Status {
      int width = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
      TF_RETURN_IF_ERROR(CheckWidth("HgsgcPackBits", width));
      ShapeHandle values;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &values));
      const DimensionHandle n = c->Dim(values, 0);
      c->set_output(0, c->Vector(c->ValueKnown(n) ? c->MakeDim(PackedLength(c->Value(n), width))
                                                  : c->UnknownDim()));
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Packs unsigned integers of `width` bits into a little-endian bit stream.

Value i occupies stream bits [i * width, (i + 1) * width), least significant bit first; stream
bit j is bit (j % 8) of byte j / 8; unused high bits of the last byte are 0. Values are read as
uint32 bit patterns; a value >= 2^width (width < 32) is an InvalidArgument error.

values: 1-D int32, n values.
packed: 1-D uint8 of ceil(n * width / 8) bytes.
width: bits per value, 1..32.
)doc");

REGISTER_OP("HgsgcUnpackBits")
    .Input("packed: uint8")
    .Input("count: int32")
    .Output("values: int32")
    .Attr("width: int >= 1")
    .SetShapeFn([](InferenceContext* c) -> Status {
      int width = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
      TF_RETURN_IF_ERROR(CheckWidth("HgsgcUnpackBits", width));
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      DimensionHandle count;
      // Static when `count` is a graph constant; unknown otherwise.
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(1, &count));
      c->set_output(0, c->Vector(count));
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Inverse of HgsgcPackBits: reads `count` values of `width` bits from a little-endian bit stream.

packed: 1-D uint8; must hold exactly ceil(count * width / 8) bytes (else InvalidArgument).
count: int32 scalar >= 0, the number of values.
values: 1-D int32 of `count` values (uint32 bit patterns; values of width 32 may be negative).
width: bits per value, 1..32.
)doc");

REGISTER_KERNEL_BUILDER(Name("HgsgcPackBits").Device(DEVICE_CPU), PackBitsOp);
REGISTER_KERNEL_BUILDER(Name("HgsgcUnpackBits").Device(DEVICE_CPU), UnpackBitsOp);

}  // namespace hgsgc
