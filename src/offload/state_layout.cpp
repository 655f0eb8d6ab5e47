#include "offload/state_layout.h"

namespace strata {

const char* precision_name(Precision precision) { return precision == Precision::kFp32 ? "fp32" : "bf16"; }

std::optional<Precision> parse_precision(std::string_view name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "bf16") return Precision::kBf16;
  return std::nullopt;
}

uint64_t StateLayout::element_bytes(StateKind kind) const {
  switch (kind) {
    case StateKind::kParam: return dtype_size(compute_dtype());
    case StateKind::kMaster: return separate_master() ? 4 : 0;
    case StateKind::kGrad:
    case StateKind::kAdamM:
    case StateKind::kAdamV: return 4;
    case StateKind::kAct: return 0;
  }
  return 0;
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
