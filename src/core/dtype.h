// Element types of stored state: what a tensor's bytes are, wherever they live (chunks, device
// memory, checkpoint files). The precision recipe (offload/state_layout.h) names one for each
// kind of training state; the checkpoint format writes them under their safetensors names.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace strata {

// kF8E4M3: OCP E4M3 codes (kernels/fp8.h). As a model's weight type it names the fp8 recipe's
// compute copy: linear layers' weights in E4M3 with block scales, every other tensor in bf16.
// kNF4: QLoRA's 4-bit NormalFloat (kernels/nf4.h), only as a model's weight type: the compute copy
// of the nf4 base (LoRA's frozen linear weights in NF4 with double-quantised block scales, every
// other tensor in bf16). No stored state is of it but such copies; parse_dtype does not read it.
enum class DType : uint8_t { kF32, kBF16, kF8E4M3, kNF4 };
const char* dtype_name(DType dtype);  // "F32", "BF16", "F8_E4M3" (safetensors spelling), "NF4"
uint64_t dtype_size(DType dtype);     // bytes per element (NF4: 1, its matrices' bytes are their own)
std::optional<DType> parse_dtype(std::string_view name);

}  // namespace strata
