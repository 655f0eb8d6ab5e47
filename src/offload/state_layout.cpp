#include "offload/state_layout.h"

#include "kernels/fp8.h"
#include "kernels/nf4.h"

namespace strata {

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp8: return "fp8";
    case Precision::kNf4: return "nf4";
  }
  return "?";
}

std::optional<Precision> parse_precision(std::string_view name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "bf16") return Precision::kBf16;
  if (name == "fp8") return Precision::kFp8;
  if (name == "nf4") return Precision::kNf4;
  return std::nullopt;
}

uint64_t StateLayout::element_bytes(StateKind kind) const {
  if (weights_only && kind != StateKind::kParam) return 0;
  switch (kind) {
    case StateKind::kParam: return precision == Precision::kFp32 ? 4 : precision == Precision::kBf16 ? 2 : 1;
    case StateKind::kMaster: return separate_master() ? 4 : 0;
    case StateKind::kGrad: return 4;
    case StateKind::kAdamM:
    case StateKind::kAdamV: return moments == kernels::MomentFormat::kF32 ? 4 : moments == kernels::MomentFormat::kBf16 ? 2 : 1;
    case StateKind::kAct: return 0;
  }
  return 0;
}

bool StateLayout::is_f32(StateKind kind) const {
  if (weights_only && kind != StateKind::kParam) return false;
  switch (kind) {
    case StateKind::kParam: return precision == Precision::kFp32;
    case StateKind::kMaster: return separate_master();
    case StateKind::kGrad: return true;
    case StateKind::kAdamM:
    case StateKind::kAdamV: return moments == kernels::MomentFormat::kF32;
    case StateKind::kAct: return false;
  }
  return false;
}

uint64_t StateLayout::tensor_bytes(StateKind kind, const StateShape& t) const {
  const int64_t n = static_cast<int64_t>(t.elements);
  if ((weights_only || t.frozen) && kind != StateKind::kParam) return 0;
  switch (kind) {
    case StateKind::kParam:
      if (quantized(t) && precision == Precision::kNf4) return kernels::nf4_layout(n).bytes;
      if (quantized(t)) return kernels::fp8_matrix_bytes(t.matrix_rows, n / t.matrix_rows);
      return t.elements * dtype_size(activation_dtype());  // fp32 (the master itself), or bf16
    case StateKind::kAdamM:
    case StateKind::kAdamV: return kernels::moment_bytes(moments, n);
    default: return t.elements * element_bytes(kind);
  }
}

std::vector<StateKind> StateLayout::kinds() const {
  std::vector<StateKind> out;
  for (int k = 0; k < kNumStateKinds; ++k)
    if (has(static_cast<StateKind>(k))) out.push_back(static_cast<StateKind>(k));
  return out;
}

uint64_t StateLayout::bytes_per_parameter() const {
  uint64_t sum = 0;
  for (StateKind k : kinds()) sum += element_bytes(k);
  return sum;
}

}  // namespace strata
