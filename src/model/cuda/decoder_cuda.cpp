// The decoder on the CUDA backend: the one layer graph (decoder_impl.h) over kernels::CudaOps.
#include "model/cuda/decoder_cuda.h"

#include <fmt/format.h>

#include <utility>

#include "kernels/cuda/backend.h"
#include "model/decoder_impl.h"

namespace strata::model {

template class Decoder<kernels::CudaOps>;
template class Decoder<kernels::CudaFp8Ops>;
template class Decoder<kernels::CudaNf4Ops>;

Status cuda_supports(const ModelConfig& config, DType compute) {
  RETURN_IF_ERROR(config.validate("model"));
  if (config.head_dim != 64 && config.head_dim != 128)
    return Status::Unimplemented(fmt::format("the CUDA attention kernel runs head_dim 64 and 128, not {}; train this "
                                             "model on the cpu (run.device=cpu)",
                                             config.head_dim));
  if (compute != DType::kBF16 && compute != DType::kF8E4M3 && compute != DType::kNF4)
    return Status::Unimplemented(fmt::format("the CUDA backend computes in the bf16 and fp8 recipes (and bf16 over an "
                                             "nf4 base), not with {} "
                                             "weights; train.precision=fp32 runs on the cpu (run.device=cpu)",
                                             dtype_name(compute)));
  if (compute == DType::kF8E4M3) {
    // cuBLASLt's FP8 GEMMs want every width a multiple of 16 (kernels/cuda/fp8.h).
    for (auto [name, width] : {std::pair{"hidden_size", config.hidden_size}, std::pair{"q_dim", config.q_dim()},
                               std::pair{"kv_dim", config.kv_dim()}}) {
      if (width % 16 != 0)
        return Status::Unimplemented(fmt::format(
            "the fp8 recipe's CUDA GEMMs need every linear layer's width a multiple of 16; {} is {}; train this "
            "model in bf16 (train.precision=bf16) or on the cpu (run.device=cpu)",
            name, width));
    }
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
      const int64_t widths[] = {config.is_moe_layer(l) ? config.moe_intermediate_size : config.intermediate_size,
                                config.is_moe_layer(l) ? config.shared_expert_intermediate_size : 0};
      for (int64_t w : widths)
        if (w % 16 != 0)
          return Status::Unimplemented(fmt::format(
              "the fp8 recipe's CUDA GEMMs need every linear layer's width a multiple of 16; layer {} has an MLP "
              "of {}; train this model in bf16 (train.precision=bf16) or on the cpu (run.device=cpu)",
              l, w));
    }
  }
  return Status::OK();
}

namespace {

template <class Ops>
Result<std::unique_ptr<Model>> make_decoder(Device& device, const ModelConfig& config) {
  Result<Ops> ops = Ops::create(device);
  if (!ops.ok()) return ops.status().with_context("the CUDA kernels' scratch and workspace");
  return std::unique_ptr<Model>(new Decoder<Ops>(config, std::move(ops).value()));
}

}  // namespace

Result<std::unique_ptr<Model>> make_cuda_decoder(Device& device, const ModelConfig& config, DType compute) {
  RETURN_IF_ERROR(cuda_supports(config, compute));
  if (device.kind() != DeviceKind::kCuda)
    return Status::InvalidArgument("the CUDA decoder needs a CUDA device, not " + device.name());
  if (compute == DType::kF8E4M3) return make_decoder<kernels::CudaFp8Ops>(device, config);
  if (compute == DType::kNF4) return make_decoder<kernels::CudaNf4Ops>(device, config);
  return make_decoder<kernels::CudaOps>(device, config);
}

}  // namespace strata::model
