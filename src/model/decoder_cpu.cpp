// The decoder on the CPU backends: the fp32 reference and the GPU's bf16 recipe emulated.
#include "model/decoder_impl.h"

namespace strata::model {

int64_t count_valid_targets(const int32_t* targets, int64_t n) {
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) valid += targets[i] >= 0 ? 1 : 0;
  return valid;
}

template class Decoder<kernels::CpuF32Ops>;
template class Decoder<kernels::CpuBf16Ops>;

std::unique_ptr<Model> make_cpu_decoder(DType compute, const ModelConfig& config, bool flat_buffers,
                                        Device* device) {
  if (compute == DType::kBF16) return std::make_unique<LlamaModelBf16>(config, flat_buffers, kernels::CpuBf16Ops(device));
  return std::make_unique<LlamaModel>(config, flat_buffers, kernels::CpuF32Ops(device));
}

}  // namespace strata::model
