// The decoder on the CPU backends: the fp32 reference and the GPU's bf16 and fp8 recipes emulated.
#include "model/decoder_impl.h"

namespace strata::model {

int64_t count_valid_targets(const int32_t* targets, int64_t n) {
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) valid += targets[i] >= 0 ? 1 : 0;
  return valid;
}

template class Decoder<CpuF32Model>;
template class Decoder<CpuBf16Model>;
template class Decoder<CpuFp8Model>;
template class Decoder<CpuNf4Model>;

std::unique_ptr<Model> make_cpu_decoder(DType compute, const ModelConfig& config, Device* device) {
  if (compute == DType::kF8E4M3) return std::make_unique<LlamaModelFp8>(config, CpuFp8Model(device));
  if (compute == DType::kNF4) return std::make_unique<LlamaModelNf4>(config, CpuNf4Model(device));
  if (compute == DType::kBF16) return std::make_unique<LlamaModelBf16>(config, CpuBf16Model(device));
  return std::make_unique<LlamaModel>(config, CpuF32Model(device));
}

}  // namespace strata::model
