// Element types of stored state: what a tensor's bytes are, wherever they live (chunks, device
// memory, checkpoint files). The precision recipe (offload/state_layout.h) names one for each
// kind of training state; the checkpoint format writes them under their safetensors names.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace strata {

enum class DType : uint8_t { kF32, kBF16 };
const char* dtype_name(DType dtype);  // "F32", "BF16" (safetensors spelling)
uint64_t dtype_size(DType dtype);     // bytes per element
std::optional<DType> parse_dtype(std::string_view name);

}  // namespace strata
