// Context (cuBLASLt handle, GEMM workspace, scratch, plan caches), the algorithm search both
// cuBLASLt GEMMs share, and the row-major bf16 GEMM with its plans cached per shape.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "core/check.h"
#include "core/log.h"
#include "core/cuda/cuda_check.h"
#include "kernels/cuda/cublas_check.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

Context::Context(void* scratch, size_t scratch_bytes, void* gemm_workspace, size_t gemm_workspace_bytes)
    : gemm_workspace_(gemm_workspace),
      gemm_workspace_bytes_(gemm_workspace_bytes),
      scratch_(scratch),
      scratch_bytes_(scratch_bytes) {
  CUDA_CHECK(cudaGetDevice(&device_));
  CUBLAS_CHECK(cublasLtCreate(&lt_));
}

Context::~Context() {
  CUDA_CHECK(cudaSetDevice(device_));
  // Work queued by ops may still use the handles and the caller's buffers: wait for the device.
  CUDA_CHECK(cudaDeviceSynchronize());
  // Descriptors need no handle, but go before it all the same.
  gemm_plans_.clear();
  fp8_gemm_plans_.clear();
  cudnn_attention_.reset();
  if (blas_ != nullptr) CUBLAS_CHECK(cublasDestroy(blas_));
  CUBLAS_CHECK(cublasLtDestroy(lt_));
}

void* Context::scratch(size_t bytes, const char* what) const {
  CHECK_MSG(bytes <= scratch_bytes_, std::string(what) + " needs " + std::to_string(bytes) +
                                         " bytes of scratch but the CUDA kernel context has " +
                                         std::to_string(scratch_bytes_) +
                                         "; create the Context with more scratch (or use "
                                         "smaller chunks)");
  return scratch_;
}

void Context::use_scratch(void* scratch, size_t scratch_bytes) {
  scratch_ = scratch;
  scratch_bytes_ = scratch_bytes;
}

cublasHandle_t Context::blas(cudaStream_t stream) {
  if (blas_ == nullptr) {
    CUBLAS_CHECK(cublasCreate(&blas_));
    // Plain fp32 arithmetic for fp32 GEMMs (no TF32), host pointers for alpha and beta.
    CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST));
  }
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the workspace comes after.
  // Sharing it with cuBLASLt is safe: both run in the order of the one stream.
  CUBLAS_CHECK(cublasSetStream(blas_, stream));
  CUBLAS_CHECK(cublasSetWorkspace(blas_, gemm_workspace_, gemm_workspace_bytes_));
  return blas_;
}

LtPlan::~LtPlan() {
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (second) cublasLtMatrixLayoutDestroy(second);
  if (first) cublasLtMatrixLayoutDestroy(first);
  if (op) cublasLtMatmulDescDestroy(op);
}

namespace {

struct Search {
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;  // the call's, else the algorithm's own
  int found = 0;
};

Search search_algorithm(Context& ctx, LtPlan& plan, const LtAlignments& align) {
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t workspace = ctx.gemm_workspace_bytes();
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align.first,
                                                    sizeof(align.first)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align.second,
                                                    sizeof(align.second)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align.c,
                                                    sizeof(align.c)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align.d,
                                                    sizeof(align.d)));
  cublasLtMatmulHeuristicResult_t heuristic{};
  Search s;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(ctx.lt(), plan.op, plan.first, plan.second, plan.c,
                                                               plan.c, pref, 1, &heuristic, &s.found);
  cublasLtMatmulPreferenceDestroy(pref);
  // An algorithm whose own state is not SUCCESS would fail in cublasLtMatmul: treat it as none.
  s.status = status != CUBLAS_STATUS_SUCCESS ? status : heuristic.state;
  if (s.status != CUBLAS_STATUS_SUCCESS) s.found = 0;
  if (s.found > 0) plan.algo = heuristic.algo;
  return s;
}

}  // namespace

bool find_algorithm(Context& ctx, LtPlan& plan, const LtAlignments& align) {
  return search_algorithm(ctx, plan, align).found > 0;
}

void choose_algorithm(Context& ctx, LtPlan& plan, const LtAlignments& align, const GemmDescription& what,
                      const std::string& hint) {
  const Search s = search_algorithm(ctx, plan, align);
  CHECK_MSG(s.found > 0, gemm_heuristic_failure_message(what, cublasLtGetStatusName(s.status),
                                                        cublasLtGetStatusString(s.status), s.found) +
                             hint);
}

namespace {

GemmDescription describe_bf16(const GemmKey& key) {
  GemmDescription d;
  d.M = key.M;
  d.N = key.N;
  d.K = key.K;
  d.trans_a = key.trans_a;
  d.trans_b = key.trans_b;
  d.a_type = d.b_type = "bf16";
  d.c_type = key.c_is_fp32 ? "fp32" : "bf16";
  d.epilogue = key.bias ? "bias (bf16)" : "none";
  d.accumulate = key.beta_zero ? "beta = 0" : key.separate_c ? "beta != 0, C read from a separate input" : "beta != 0";
  return d;
}

// cuBLASLt is column-major. A row-major (R, S) matrix with row stride ld is the column-major
// (S, R) matrix with leading dimension ld, i.e. its transpose. So row-major
//   C (M,N) = op(A) (M,K) @ op(B) (K,N)
// is column-major
//   C^T (N,M) = op(B)^T (N,K) @ op(A)^T (K,M),
// a column-major GEMM with m = N, n = M, k = K, first operand B (stored column-major as
// B^T: transposed in the call iff trans_b) and second operand A (likewise iff trans_a).
// The bias of a row-major C is per column of C = per row of C^T: cuBLASLt's BIAS epilogue.
std::unique_ptr<LtPlan> make_plan(Context& ctx, const GemmKey& key, const bf16* bias, bool epilogue_bias) {
  auto plan = std::make_unique<LtPlan>();
  const cublasOperation_t op_first = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  if (epilogue_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    const cudaDataType_t bias_type = CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                sizeof(bias_type)));
    // The first call's pointer, for the heuristic; every call sets its own again.
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  // Stored (column-major) shapes: rows x cols with leading dimension ld.
  // B row-major is (K,N) when !trans_b, (N,K) when trans_b; column-major that is (N,K) or (K,N).
  const auto M = static_cast<uint64_t>(key.M), N = static_cast<uint64_t>(key.N), K = static_cast<uint64_t>(key.K);
  const uint64_t first_rows = key.trans_b ? K : N, first_cols = key.trans_b ? N : K;
  const uint64_t second_rows = key.trans_a ? M : K, second_cols = key.trans_a ? K : M;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->first, CUDA_R_16BF, first_rows, first_cols, key.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->second, CUDA_R_16BF, second_rows, second_cols, key.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, key.c_is_fp32 ? CUDA_R_32F : CUDA_R_16BF, N, M, key.ldc));
  // Our B is cuBLASLt's first operand ("A"), our A its second ("B").
  const LtAlignments align{key.align_b, key.align_a, key.align_c, key.align_d};
  if (epilogue_bias) {
    if (find_algorithm(ctx, *plan, align)) return plan;
    // cuBLASLt supports the BIAS epilogue for some output types and shapes only (on sm_90 it
    // offered none for an fp32 output with a bf16 bias): a plain GEMM, then a bias kernel.
    LOG_INFO("cuBLASLt has no bias epilogue for the GEMM {}; adding the bias with a kernel after it",
             describe(describe_bf16(key)));
    plan = make_plan(ctx, key, nullptr, false);
    plan->bias_after = true;
    return plan;
  }
  choose_algorithm(ctx, *plan, align, describe_bf16(key));
  return plan;
}

}  // namespace

void gemm_separate_c(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, const void* c_in, void* C,
                     int64_t ldc, bool c_is_fp32, const bf16* bias, cudaStream_t stream) {
  CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  CHECK_MSG(bias == nullptr || beta == 0.0f, "gemm: a bias epilogue requires beta == 0");
  CHECK(ldc >= N);
  if (K == 0) {
    // Nothing to multiply: C = beta * c_in (+ bias). Only beta == 1 onto C itself without bias
    // is a no-op; the ops of this backend never ask for anything else with K == 0.
    CHECK_MSG(beta == 1.0f && bias == nullptr && c_in == C, "gemm with K == 0 is only supported as a no-op");
    return;
  }
  CHECK(ldb >= (trans_b ? K : N));
  CHECK(lda >= (trans_a ? M : K));
  // With beta == 0 cuBLASLt does not read C: point it at the output, as an in-place GEMM.
  const void* c_read = beta == 0.0f ? C : c_in;
  GemmKey key;
  key.trans_a = trans_a;
  key.trans_b = trans_b;
  key.M = M;
  key.N = N;
  key.K = K;
  key.lda = lda;
  key.ldb = ldb;
  key.ldc = ldc;
  key.c_is_fp32 = c_is_fp32;
  key.bias = bias != nullptr;
  key.beta_zero = beta == 0.0f;
  key.separate_c = c_read != C;
  key.align_a = alignment_of(A);
  key.align_b = alignment_of(B);
  key.align_c = alignment_of(c_read);
  key.align_d = alignment_of(C);
  key.align_bias = bias != nullptr ? alignment_of(bias) : 0;
  LtPlan& plan = ctx.gemm_plans().get(key, [&] { return make_plan(ctx, key, bias, key.bias); });
  if (bias != nullptr && !plan.bias_after) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt(), plan.op, &alpha, B, plan.first, A, plan.second, &beta, c_read, plan.c, C,
                              plan.c, &plan.algo, ctx.gemm_workspace(), ctx.gemm_workspace_bytes(), stream));
  if (bias != nullptr && plan.bias_after) add_bias_rows(C, ldc, c_is_fp32, bias, M, N, stream);
}

void gemm(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
          int64_t lda, const bf16* B, int64_t ldb, float beta, void* C, int64_t ldc, bool c_is_fp32,
          const bf16* bias, cudaStream_t stream) {
  gemm_separate_c(ctx, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, C, ldc, c_is_fp32, bias, stream);
}

}  // namespace strata::kernels::cuda
