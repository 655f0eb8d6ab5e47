#include "core/dtype.h"

namespace strata {

const char* dtype_name(DType dtype) { return dtype == DType::kF32 ? "F32" : "BF16"; }
uint64_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
std::optional<DType> parse_dtype(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

}  // namespace strata
