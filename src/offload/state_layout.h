// The state layout of a precision recipe (DESIGN §3.0): the element type of each kind of
// training state. The chunk store sizes its tensors from it, the planner counts its bytes from
// it, and the model's backend reads the compute copy in its dtype.
//
//   recipe   param (compute copy)   master   grad   adam_m, adam_v
//   fp32     fp32 (is the master)   -        fp32   fp32
//   bf16     bf16                   fp32     fp32   fp32
//
// Gradients stay fp32 in both: they accumulate over micro-batches with `+=`, and bf16 sums lose
// the low bits of every addend after the first few. Room is left for FP8 compute copies (a
// dtype and its block scales) as a third recipe.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "memory/chunk.h"

namespace strata {

// The kinds of training state: memory/chunk.h's ChunkKind (one enum for chunks and state),
// kAct excepted. Arrays indexed by kind have kNumStateKinds entries.
using StateKind = ChunkKind;
inline constexpr int kNumStateKinds = 5;  // param, grad, master, adam_m, adam_v
inline const char* state_kind_name(StateKind kind) { return chunk_kind_name(kind); }

enum class Precision : uint8_t { kFp32, kBf16 };
const char* precision_name(Precision precision);  // "fp32", "bf16"
std::optional<Precision> parse_precision(std::string_view name);

struct StateLayout {
  Precision precision = Precision::kFp32;

  static StateLayout of(Precision precision) { return StateLayout{precision}; }
  // The compute copy's element type (what the model's ops read).
  DType compute_dtype() const { return precision == Precision::kFp32 ? DType::kF32 : DType::kBF16; }
  // A separate fp32 master exists (otherwise the compute copy is the master).
  bool separate_master() const { return precision != Precision::kFp32; }
  // The kind that holds the fp32 master weights: kMaster, or kParam when it is the master.
  StateKind master_kind() const { return separate_master() ? StateKind::kMaster : StateKind::kParam; }
  // Bytes per element of `kind`; 0 when the layout has no such state.
  uint64_t element_bytes(StateKind kind) const;
  bool has(StateKind kind) const { return element_bytes(kind) > 0; }
  // The kinds this layout holds, in enum order.
  std::vector<StateKind> kinds() const;
  // Bytes of every kind together per parameter (16 for fp32, 18 for bf16).
  uint64_t bytes_per_parameter() const;
};

}  // namespace strata
