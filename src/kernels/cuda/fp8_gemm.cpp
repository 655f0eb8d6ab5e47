// The FP8 block-scaled GEMM on cuBLASLt (kernels/cuda/fp8.h), with its plans cached per shape
// in the Context.
//
// cuBLASLt facts this relies on (enum and attribute names checked against cublasLt.h of CUDA 13):
//   - FP8 operands need the "TN" format on Hopper: the first operand transposed, the second
//     not, both column-major with K contiguous (cublasLtMatmul documentation); compute
//     CUBLAS_COMPUTE_32F, scale type fp32 (NVIDIA's LtBlk128x128Fp8Matmul sample does the same).
//   - CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (one fp32
//     scale per 128 elements of the innermost dimension, K here) or ..._BLK128x128_32F (one per
//     128 x 128 block), the scales at CUBLASLT_MATMUL_DESC_{A,B}_SCALE_POINTER (cuBLAS 12.9+,
//     Hopper). The heuristic rejects a block-scaling mode whose scale pointer is unset, so the
//     pointers are set before it is asked. The pairs VEC128 x VEC128, VEC128 x BLK and
//     BLK x VEC128 are the ones PyTorch's scaled_mm uses. Scale layouts: fp8_scales.cu.
//   - CUBLASLT_MATMUL_DESC_FAST_ACCUM stays at its default (off); PyTorch refuses fast
//     accumulation with these modes. The per-128-K scales imply that each K block's partial sum
//     is scaled in fp32 as ref::fp8_gemm_nt does; the order of additions inside a block is
//     cuBLASLt's own (hence a bound, not bitwise equality, in the tests).
//   - Data pointers and leading dimensions 16-byte aligned (so K, and N for C, multiples of 16).
//
// Row-major to column-major: row-major C (M, N) = A (M, K) @ B (N, K)^T is column-major
// C^T (N, M) = B' @ A' where B' is B read column-major as (K, N) and transposed (op T, ld K)
// and A' is A read column-major as (K, M) untransposed (op N, ld K): exactly TN, with
// m = N, n = M, k = K. So cuBLASLt's "A" is our B (the weight) and its "B" is our A.
#include <cublasLt.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "core/round_up.h"
#include "kernels/cuda/cublas_check.h"
#include "kernels/cuda/fp8.h"

namespace strata::kernels::cuda {
namespace {

// Scratch offsets (256-byte aligned) of the repacked scales.
struct ScaleScratch {
  size_t a_offset = 0;  // (L, M) K-major tile scales of A
  size_t b_offset = 0;  // B's scales in cuBLASLt's layout, unless passed as they are
  size_t bytes = 0;
  bool b_as_is = false;  // 128 x 128 blocks with L % 4 == 0: the stored layout is cuBLASLt's
};

ScaleScratch scale_scratch(int64_t M, int64_t N, int64_t K, bool b_blocks) {
  const int64_t L = fp8_blocks(K);
  ScaleScratch s;
  s.a_offset = 0;
  s.b_offset = static_cast<size_t>(round_up(L * M * 4, 256));
  s.b_as_is = b_blocks && L % 4 == 0;
  const int64_t b_floats = s.b_as_is ? 0 : (b_blocks ? fp8_blocks(N) * round_up(L, 4) : L * N);
  s.bytes = s.b_offset + static_cast<size_t>(b_floats * 4);
  return s;
}

std::string shape_text(int64_t M, int64_t N, int64_t K, bool c_bf16, bool b_blocks) {
  return "C (" + std::to_string(M) + " x " + std::to_string(N) + ", " + (c_bf16 ? "bf16" : "fp32") + ") = A (" +
         std::to_string(M) + " x " + std::to_string(K) + ", 1x128 tiles) @ B (" + std::to_string(N) + " x " +
         std::to_string(K) + ", " + (b_blocks ? "128x128 blocks" : "1x128 tiles") + ")^T";
}

GemmDescription describe_fp8(int64_t M, int64_t N, int64_t K, bool c_bf16, bool b_blocks) {
  GemmDescription d;
  d.M = M;
  d.N = N;
  d.K = K;
  d.trans_b = true;
  d.a_type = "e4m3 (1x128 tiles)";
  d.b_type = b_blocks ? "e4m3 (128x128 blocks)" : "e4m3 (1x128 tiles)";
  d.c_type = c_bf16 ? "bf16" : "fp32";
  d.accumulate = "beta given per call";
  return d;
}

}  // namespace

size_t fp8_gemm_scratch_bytes(int64_t M, int64_t N, int64_t K, bool b_blocks) {
  return scale_scratch(M, N, K, b_blocks).bytes;
}

namespace {

void set_scale_pointers(cublasLtMatmulDesc_t op, const float* first_scales, const float* second_scales) {
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &first_scales, sizeof(first_scales)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &second_scales, sizeof(second_scales)));
}

std::unique_ptr<LtPlan> make_plan(Context& ctx, const Fp8GemmKey& key, const float* first_scales,
                                  const float* second_scales) {
  const auto [M, N, K, c_bf16, b_blocks, align_a, align_b, align_c] = key;
  auto plan = std::make_unique<LtPlan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = CUBLAS_OP_T, op_second = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // cuBLASLt's A is our B (weight or 1 x 128 tiles), its B is our A (1 x 128 tiles).
  const int32_t mode_first =
      b_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t mode_second = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_first, sizeof(mode_first)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_second, sizeof(mode_second)));
  set_scale_pointers(plan->op, first_scales, second_scales);

  const auto k = static_cast<uint64_t>(K), n = static_cast<uint64_t>(N), m = static_cast<uint64_t>(M);
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->first, CUDA_R_8F_E4M3, k, n, K));                 // B: (K, N), ld K
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->second, CUDA_R_8F_E4M3, k, m, K));                // A: (K, M), ld K
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, c_bf16 ? CUDA_R_16BF : CUDA_R_32F, n, m, N));  // C^T

  // The scale modes are part of the descriptors; the heuristic sees them with the pointers set.
  // Our B is cuBLASLt's first operand and our A its second.
  choose_algorithm(ctx, *plan, LtAlignments{align_b, align_a, align_c, align_c},
                   describe_fp8(M, N, K, c_bf16, b_blocks),
                   "; block scaling needs cuBLAS 12.9+ on a Hopper GPU, sm_90");
  return plan;
}

}  // namespace

void fp8_gemm_nt(Context& ctx, void* C, bool c_bf16, const uint8_t* A, const float* a_scales, const uint8_t* B,
                 const float* b_scales, bool b_blocks, int64_t M, int64_t N, int64_t K, float beta,
                 cudaStream_t stream) {
  CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  CHECK_MSG(K > 0, "fp8_gemm_nt: K == 0 for " + shape_text(M, N, K, c_bf16, b_blocks));
  CHECK_MSG(M % 16 == 0 && N % 16 == 0 && K % 16 == 0,
            "fp8_gemm_nt: cuBLASLt's FP8 kernels need M, N and K multiples of 16; got " +
                shape_text(M, N, K, c_bf16, b_blocks));
  const ScaleScratch layout = scale_scratch(M, N, K, b_blocks);
  // A, B, C, and b_scales where cuBLASLt reads them as they are. The other scales are copied.
  const bool aligned = alignment_of(A) >= 16 && alignment_of(B) >= 16 && alignment_of(C) >= 16 &&
                       (!layout.b_as_is || alignment_of(b_scales) >= 16);
  CHECK_MSG(aligned, "fp8_gemm_nt: A, B, C and 128x128 block scales must be 16-byte aligned; " +
                         shape_text(M, N, K, c_bf16, b_blocks));
  const int64_t L = fp8_blocks(K);

  // Scales into cuBLASLt's layouts (fp8_scales.cu), at the start of the scratch, which no operand
  // may occupy (other ops leave results there).
  auto* scratch = static_cast<char*>(ctx.scratch(layout.bytes, "fp8_gemm_nt (scales)"));
  for (const void* p : {static_cast<const void*>(A), static_cast<const void*>(B), static_cast<const void*>(C),
                        static_cast<const void*>(a_scales), static_cast<const void*>(b_scales)}) {
    const char* q = static_cast<const char*>(p);
    CHECK_MSG(!(q >= scratch && q < scratch + ctx.scratch_bytes()),
              "fp8_gemm_nt: an operand lies in the Context's scratch, where the scales are repacked; " +
                  shape_text(M, N, K, c_bf16, b_blocks));
  }
  auto* a_packed = reinterpret_cast<float*>(scratch + layout.a_offset);
  fp8_tile_scales_k_major(a_packed, a_scales, M, L, stream);
  const float* b_packed = b_scales;
  if (!layout.b_as_is) {
    auto* out = reinterpret_cast<float*>(scratch + layout.b_offset);
    if (b_blocks) {
      fp8_block_scales_padded(out, b_scales, fp8_blocks(N), L, stream);
    } else {
      fp8_tile_scales_k_major(out, b_scales, N, L, stream);
    }
    b_packed = out;
  }

  const Fp8GemmKey key{M, N, K, c_bf16, b_blocks, alignment_of(A), alignment_of(B), alignment_of(C)};
  const LtPlan& plan = ctx.fp8_gemm_plans().get(key, [&] { return make_plan(ctx, key, b_packed, a_packed); });
  set_scale_pointers(plan.op, b_packed, a_packed);

  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt(), plan.op, &alpha, B, plan.first, A, plan.second, &beta, C, plan.c, C, plan.c,
                              &plan.algo, ctx.gemm_workspace(), ctx.gemm_workspace_bytes(), stream));
}

}  // namespace strata::kernels::cuda
