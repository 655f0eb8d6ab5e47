// AdamW on CUDA over many tensors per launch (fp32 master weights, gradients and moments;
// optionally the bf16 compute copy). The per-element update is the reference's own
// (kernels/adamw_element.h): every fp32 operation is an explicitly rounded intrinsic, so the
// compiler cannot fuse a multiply and an add and the results equal the CPU reference bit for bit.
#include <cmath>

#include "kernels/adamw_element.h"
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 4096;          // elements per block
constexpr int kMaxTensorsPerLaunch = 32;  // keeps the kernel parameters under 4 KiB

// The scalars of one step, formed on the host exactly as the CPU paths do (kernels/adamw.h).
using Scalars = AdamWScalars;
inline Scalars make_scalars(const AdamWParams& p) { return adamw_scalars(p); }

struct TensorList {
  float* param[kMaxTensorsPerLaunch];
  const float* grad[kMaxTensorsPerLaunch];
  float* m[kMaxTensorsPerLaunch];
  float* v[kMaxTensorsPerLaunch];
  bf16* param_bf16[kMaxTensorsPerLaunch];
  int64_t n[kMaxTensorsPerLaunch];
  int64_t first_block[kMaxTensorsPerLaunch + 1];  // tensor t owns blocks [first_block[t], [t+1])
  int count;
};

// grid (total blocks of the list). Block b updates kChunk elements of one tensor. grad_scale:
// see ops.h (null: 1; NaN: the step is skipped and nothing is written). nonfinite: see ops.h
// (null: not checked).
__global__ void adamw_kernel(TensorList list, Scalars s, const float* grad_scale, int* nonfinite) {
  const float factor = grad_scale != nullptr ? *grad_scale : 1.0f;
  if (isnan(factor)) return;
  const int64_t block = blockIdx.x;
  int t = 0;
  while (t + 1 < list.count && list.first_block[t + 1] <= block) ++t;
  const int64_t begin = (block - list.first_block[t]) * kChunk;
  const int64_t end = min(list.n[t], begin + kChunk);
  float* param = list.param[t];
  const float* grad = list.grad[t];
  float* m = list.m[t];
  float* v = list.v[t];
  bf16* param_bf16 = list.param_bf16[t];
  uint32_t bad = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float w = param[i], mi = m[i], vi = v[i];
    // The product scale_inplace would have stored (one rounding); g * 1 is g.
    adamw_update_element(mul_rn(grad[i], factor), w, mi, vi, s);
    param[i] = w;
    m[i] = mi;
    v[i] = vi;
    if (param_bf16 != nullptr) param_bf16[i] = to_bf16(w);
    bad |= nonfinite_bits(w);
  }
  if (bad != 0 && nonfinite != nullptr) *nonfinite = 1;  // every writer stores the same value
}

}  // namespace

void adamw_step(const AdamWTensor* tensors, int count, const AdamWParams& p,
                cudaStream_t stream) {
  adamw_step(tensors, count, p, nullptr, stream);
}

void adamw_step(const AdamWTensor* tensors, int count, const AdamWParams& p, const float* grad_scale,
                cudaStream_t stream) {
  adamw_step(tensors, count, p, grad_scale, nullptr, stream);
}

void adamw_step(const AdamWTensor* tensors, int count, const AdamWParams& p, const float* grad_scale, int* nonfinite,
                cudaStream_t stream) {
  CHECK(count >= 0);
  const Scalars s = make_scalars(p);
  int t = 0;  // next tensor to place in a launch
  while (t < count) {
    TensorList list{};
    int64_t blocks = 0;
    list.count = 0;
    for (; t < count && list.count < kMaxTensorsPerLaunch; ++t) {
      const AdamWTensor& x = tensors[t];
      CHECK(x.n >= 0);
      if (x.n == 0) continue;
      CHECK_MSG(x.param != nullptr && x.grad != nullptr && x.m != nullptr && x.v != nullptr,
                "adamw_step: tensor " + std::to_string(t) + " lacks a buffer");
      const int i = list.count++;
      list.param[i] = x.param;
      list.grad[i] = x.grad;
      list.m[i] = x.m;
      list.v[i] = x.v;
      list.param_bf16[i] = x.param_bf16;
      list.n[i] = x.n;
      list.first_block[i] = blocks;
      blocks += ceil_div(x.n, kChunk);
    }
    list.first_block[list.count] = blocks;
    if (list.count == 0) continue;
    CHECK_MSG(blocks < (int64_t{1} << 31), "adamw_step: too many elements in one launch");
    adamw_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(list, s, grad_scale, nonfinite);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace strata::kernels::cuda
