// CudaNf4Ops: the nf4 base's op set on CUDA (see backend.h).
#include <utility>

#include "core/check.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/nf4.h"
#include "kernels/cuda/ops.h"
#include "kernels/nf4.h"

namespace strata::kernels {

Result<CudaNf4Ops> CudaNf4Ops::create(Device& device) {
  ASSIGN_OR_RETURN(CudaOps base, CudaOps::create(device));
  return CudaNf4Ops(std::move(base));
}

uint64_t CudaNf4Ops::extra_activation_bytes(const MicroBatchShape& shape) {
  return CudaOps::extra_activation_bytes(shape) + nf4_dequantized_weight_bytes(shape);
}

Result<void*> CudaNf4Ops::activation_block(uint64_t bytes, const MicroBatchShape& shape) {
  ASSIGN_OR_RETURN(void* block, CudaOps::activation_block(bytes, shape));
  weight_.reset();  // CudaOps::activation_block drained the stream
  Result<DeviceAllocation> a = device_->allocate(nf4_dequantized_weight_bytes(shape));
  if (!a.ok()) return a.status().with_context("the nf4 base's dequantised weight");
  weight_ = std::move(a).value();
  return block;
}

const CudaOps::W* CudaNf4Ops::dequantized(const W* weight, int64_t OC, int64_t IC) {
  const int64_t n = OC * IC;
  auto* out = static_cast<W*>(grow(weight_, static_cast<uint64_t>(n) * sizeof(W), "the nf4 base's dequantised weight"));
  cuda::nf4_dequantize_bf16(out, reinterpret_cast<const uint8_t*>(weight), n, stream_);
  return out;
}

void CudaNf4Ops::linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC,
                                int64_t OC) {
  CudaOps::linear_forward(out, x, dequantized(weight, OC, IC), bias, N, IC, OC);
}

void CudaNf4Ops::linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N,
                                         int64_t IC, int64_t OC) {
  CudaOps::linear_forward_residual(out, x, dequantized(weight, OC, IC), residual, N, IC, OC);
}

void CudaNf4Ops::linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x,
                                 const W* weight, int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(dweight == nullptr, "a weight gradient of an NF4 weight: the nf4 base is frozen");
  CudaOps::linear_backward(dx, nullptr, dbias, dout, x, dequantized(weight, OC, IC), N, IC, OC);
}

void CudaNf4Ops::accumulate_data_grad(Act* dx, float* dweight, const Act* dout, const Act* /*x*/, const W* weight,
                                      int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(dweight == nullptr, "a weight gradient of an NF4 weight: the nf4 base is frozen");
  if (N == 0) return;
  // dx (N,IC) += dout (N,OC) @ weight (OC,IC), the sum rounded once into bf16.
  cuda::gemm(*ctx_, false, false, N, IC, OC, 1.0f, dout, OC, dequantized(weight, OC, IC), IC, 1.0f, dx, IC,
             /*c_is_fp32=*/false, nullptr, stream_);
}

}  // namespace strata::kernels
