// CudaFp8Ops: the fp8 recipe's op set on CUDA (see backend.h).
#include <utility>

#include "kernels/cuda/backend.h"
#include "kernels/cuda/fp8.h"
#include "kernels/fp8_operands.h"

namespace strata::kernels {
namespace {

const uint8_t* codes(const cuda::bf16* weight) { return reinterpret_cast<const uint8_t*>(weight); }

}  // namespace

Result<CudaFp8Ops> CudaFp8Ops::create(Device& device) {
  ASSIGN_OR_RETURN(CudaOps base, CudaOps::create(device));
  return CudaFp8Ops(std::move(base));
}

uint64_t CudaFp8Ops::extra_activation_bytes(const MicroBatchShape& shape) {
  return CudaOps::extra_activation_bytes(shape) + fp8_operand_bytes(shape);
}

Result<void*> CudaFp8Ops::activation_block(uint64_t bytes, const MicroBatchShape& shape) {
  ASSIGN_OR_RETURN(void* block, CudaOps::activation_block(bytes, shape));
  operands_.reset();  // CudaOps::activation_block drained the stream
  Result<DeviceAllocation> a = device_->allocate(fp8_operand_bytes(shape));
  if (!a.ok()) return a.status().with_context("the fp8 GEMMs' quantised operands");
  operands_ = std::move(a).value();
  return block;
}

void* CudaFp8Ops::operands(int64_t N, int64_t IC, int64_t OC) {
  return grow(operands_, fp8_linear_operand_bytes(N, IC, OC), "the fp8 GEMMs' quantised operands");
}

void CudaFp8Ops::linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC,
                                int64_t OC) {
  cuda::fp8_linear_forward(*ctx_, operands(N, IC, OC), out, x, codes(weight), bias, nullptr, N, IC, OC, stream_);
}

void CudaFp8Ops::linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N,
                                         int64_t IC, int64_t OC) {
  cuda::fp8_linear_forward(*ctx_, operands(N, IC, OC), out, x, codes(weight), nullptr, residual, N, IC, OC, stream_);
}

void CudaFp8Ops::linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x,
                                 const W* weight, int64_t N, int64_t IC, int64_t OC) {
  cuda::fp8_linear_backward(*ctx_, operands(N, IC, OC), dx, /*accumulate_dx=*/false, dweight, dbias, dout, x,
                            codes(weight), N, IC, OC, stream_);
}

void CudaFp8Ops::accumulate_data_grad(Act* dx, float* dweight, const Act* dout, const Act* x, const W* weight,
                                      int64_t N, int64_t IC, int64_t OC) {
  cuda::fp8_linear_backward(*ctx_, operands(N, IC, OC), dx, /*accumulate_dx=*/true, dweight, nullptr, dout, x,
                            codes(weight), N, IC, OC, stream_);
}

}  // namespace strata::kernels
