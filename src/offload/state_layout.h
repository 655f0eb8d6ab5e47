// The state layout of a precision recipe (DESIGN §3.0): the element type of each kind of
// training state. The chunk store sizes its tensors from it, the planner counts its bytes from
// it, and the model's backend reads the compute copy in its dtype.
//
//   recipe   param (compute copy)              master   grad   adam_m, adam_v
//   fp32     fp32 (is the master)              -        fp32   fp32 | bf16 | int8
//   bf16     bf16                              fp32     fp32   fp32 | bf16 | int8
//   fp8      E4M3 + block scales (matrices     fp32     fp32   fp32 | bf16 | int8
//            of linear layers), bf16 (rest)
//
// A frozen tensor (StateShape::frozen) has the compute copy alone in every recipe (in fp32 the
// copy is its fp32 values).
//
// Gradients stay fp32 in every recipe: they accumulate over micro-batches with `+=`, and bf16
// sums lose the low bits of every addend after the first few. Activations are the compute
// copy's type (bf16 in the fp8 recipe: only the GEMMs' operands are quantised, inside the ops).
// The moments' format (kernels/moments.h) is independent of the recipe; fp32 is the default.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "kernels/moments.h"
#include "memory/chunk.h"

namespace strata {

// The kinds of training state: memory/chunk.h's ChunkKind (one enum for chunks and state),
// kAct excepted. Arrays indexed by kind have kNumStateKinds entries.
using StateKind = ChunkKind;
inline constexpr int kNumStateKinds = 5;  // param, grad, master, adam_m, adam_v
inline const char* state_kind_name(StateKind kind) { return chunk_kind_name(kind); }

// kNf4: the bf16 recipe with the linear layers' weights in NF4 (kernels/nf4.h), for LoRA's frozen
// base only (lora.base=nf4): NF4 copies are written once from the loaded values and never updated.
enum class Precision : uint8_t { kFp32, kBf16, kFp8, kNf4 };
const char* precision_name(Precision precision);  // "fp32", "bf16", "fp8", "nf4"
std::optional<Precision> parse_precision(std::string_view name);

// What the layout needs to know of a tensor to size it.
struct StateShape {
  uint64_t elements = 0;
  // > 0: the tensor is a weight matrix of a linear layer with this many rows (out_features),
  // which the fp8 recipe keeps as E4M3 blocks. 0: any other tensor.
  int64_t matrix_rows = 0;
  // Not trained (model::TensorSpec::frozen: a LoRA run's base, an untrained MTP module): the
  // compute copy alone, without gradient, master or moments.
  bool frozen = false;
};

// A contiguous range of a tensor's elements (row-major, flattened): e.g. the part of a tensor's
// optimizer state one data-parallel rank holds (placement.h).
struct ElementRange {
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t end() const { return first + count; }
  bool operator==(const ElementRange&) const = default;
};

struct StateLayout {
  Precision precision = Precision::kFp32;
  kernels::MomentFormat moments = kernels::MomentFormat::kF32;
  // Frozen weights (generation, train/paged_weights.h): the compute copy alone, in the recipe's
  // dtype; no master, gradients or moments.
  bool weights_only = false;

  static StateLayout of(Precision precision, kernels::MomentFormat moments = kernels::MomentFormat::kF32) {
    return StateLayout{precision, moments};
  }
  static StateLayout weights(Precision precision) {
    return StateLayout{precision, kernels::MomentFormat::kF32, /*weights_only=*/true};
  }
  // The compute copy's type as the model's backend names it: kF32, kBF16, or kF8E4M3 for the
  // fp8 recipe (E4M3 matrices, bf16 elsewhere).
  DType compute_dtype() const {
    switch (precision) {
      case Precision::kFp32: return DType::kF32;
      case Precision::kBf16: return DType::kBF16;
      case Precision::kFp8: return DType::kF8E4M3;
      case Precision::kNf4: return DType::kNF4;
    }
    return DType::kF32;
  }
  // The activations' type (what offloaded saved activations hold).
  DType activation_dtype() const { return precision == Precision::kFp32 ? DType::kF32 : DType::kBF16; }
  // A separate fp32 master exists (otherwise the compute copy is the master, or there is none).
  bool separate_master() const { return precision != Precision::kFp32 && !weights_only; }
  // The kind that holds the fp32 master weights: kMaster, or kParam when it is the master.
  StateKind master_kind() const { return separate_master() ? StateKind::kMaster : StateKind::kParam; }
  // Whether this tensor's compute copy is fp8 blocks (the fp8 recipe's linear weights).
  // (fp8: E4M3 blocks; nf4: NF4 with double-quantised scales.)
  bool quantized(const StateShape& t) const {
    return (precision == Precision::kFp8 || precision == Precision::kNf4) && t.matrix_rows > 0;
  }
  // Bytes of `kind` for one tensor, its scales included; 0 when the layout has no such state.
  uint64_t tensor_bytes(StateKind kind, const StateShape& t) const;
  // Bytes per element of `kind` where every element takes the same (fp32 kinds, bf16 copies,
  // bf16 moments); for kinds sized per tensor (fp8 copies, int8 moments) the bytes per element
  // of a large fp8 matrix or int8 moment, scales left out: an estimate, and tensor_bytes() is
  // what sizes state. 0 when the layout has no such state.
  uint64_t element_bytes(StateKind kind) const;
  // True when every element of `kind` is an fp32 value (what pointer() and read_tensor() hand out).
  bool is_f32(StateKind kind) const;
  bool has(StateKind kind) const { return element_bytes(kind) > 0; }
  // The kinds this layout holds, in enum order.
  std::vector<StateKind> kinds() const;
  // Bytes of every kind together per parameter as element_bytes() counts them (16 for fp32, 18
  // for bf16, 17 for fp8 with fp32 moments; 12 for bf16 with int8 moments).
  uint64_t bytes_per_parameter() const;
};

}  // namespace strata
