// The cached cuBLASLt plan that gemm() (context.cpp) and fp8_gemm_nt (fp8_gemm.cpp) share: one
// shape's matmul descriptor, operand layouts and the algorithm the heuristic chose, with the
// keys the two GEMMs cache them by (kernels/gemm_plan.h's PlanCache, in the Context).
//
// Both GEMMs compute row-major C = op(A) @ op(B) as the column-major C^T = op(B)^T @ op(A)^T, so
// cuBLASLt's first operand ("A" in its attribute names) is our B and its second is our A; the
// fields below are named first/second to keep that apart from our A and B.
// Usable from C++ (.cpp, C++20) and CUDA (.cu, C++17).
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "kernels/gemm_plan.h"

namespace strata::kernels::cuda {

class Context;

// RAII over one GEMM's descriptors. Pointers that change from call to call (the bias, the FP8
// scales) are attributes of `op` set again by every call before cublasLtMatmul, which reads
// them when it enqueues the work.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr;
  cublasLtMatrixLayout_t c = nullptr;  // C and D (same type and layout)
  cublasLtMatmulAlgo_t algo{};
  // The bias is added by a kernel after the GEMM: cuBLASLt had no algorithm with the BIAS
  // epilogue for this shape and these types (e.g. fp32 output with a bf16 bias).
  bool bias_after = false;
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan();
};

// Largest power of two (up to 256) dividing the address: the alignment cuBLASLt may assume
// (without the preference it assumes 256 bytes, which slices of larger buffers are not).
inline uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// Byte alignments of the operands as cuBLASLt names them.
struct LtAlignments {
  uint32_t first = 256, second = 256, c = 256, d = 256;
};

// Sets plan.algo to the heuristic's first choice for plan's descriptors, the Context's GEMM
// workspace and these alignments. A failed search (an error status, or no algorithm) is a
// programmer or library error: it aborts with gemm_heuristic_failure_message(what, ...) and
// `hint` appended.
void choose_algorithm(Context& ctx, LtPlan& plan, const LtAlignments& align, const GemmDescription& what,
                      const std::string& hint = "");
// The same search without the abort: false when cuBLASLt offers no algorithm.
bool find_algorithm(Context& ctx, LtPlan& plan, const LtAlignments& align);

// The key of a bf16 gemm() plan: everything its descriptors and the heuristic's choice depend
// on. Pointers are not part of it except through their alignments; the bias pointer is set per
// call.
struct GemmKey {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  bool c_is_fp32 = false;
  bool bias = false;        // the BIAS epilogue
  bool beta_zero = true;    // C is not read
  bool separate_c = false;  // C read from another buffer than the one written (a residual)
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0, align_bias = 0;

  auto tie() const {
    return std::tie(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_is_fp32, bias, beta_zero, separate_c, align_a,
                    align_b, align_c, align_d, align_bias);
  }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

// The key of an fp8_gemm_nt plan: M, N, K, c_bf16, b_blocks, and the alignments of A, B, C.
using Fp8GemmKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, uint32_t, uint32_t, uint32_t>;

}  // namespace strata::kernels::cuda
