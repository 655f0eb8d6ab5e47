// The decoder on the CUDA backend: the one layer graph (decoder_impl.h) over kernels::CudaOps.
#include "model/cuda/decoder_cuda.h"

#include <fmt/format.h>

#include "kernels/cuda/backend.h"
#include "model/decoder_impl.h"

namespace strata::model {

template class Decoder<kernels::CudaOps>;

Status cuda_supports(const ModelConfig& config) {
  RETURN_IF_ERROR(config.validate("model"));
  if (config.head_dim != 64 && config.head_dim != 128)
    return Status::Unimplemented(fmt::format("the CUDA attention kernel runs head_dim 64 and 128, not {}; train this "
                                             "model on the cpu (run.device=cpu)",
                                             config.head_dim));
  return Status::OK();
}

Result<std::unique_ptr<Model>> make_cuda_decoder(Device& device, const ModelConfig& config) {
  RETURN_IF_ERROR(cuda_supports(config));
  if (device.kind() != DeviceKind::kCuda)
    return Status::InvalidArgument("the CUDA decoder needs a CUDA device, not " + device.name());
  Result<kernels::CudaOps> ops = kernels::CudaOps::create(device);
  if (!ops.ok()) return ops.status().with_context("the CUDA kernels' scratch and workspace");
  return std::unique_ptr<Model>(new Decoder<kernels::CudaOps>(config, /*flat_buffers=*/false, std::move(ops).value()));
}

uint64_t cuda_decoder_overhead_bytes() { return kernels::CudaOps::kScratchBytes + kernels::CudaOps::kGemmWorkspaceBytes; }

}  // namespace strata::model
