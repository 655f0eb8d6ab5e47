// Context (cuBLASLt handle, GEMM workspace, scratch) and the row-major cuBLASLt GEMM.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "kernels/cuda/cublas_check.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

Context::Context(size_t scratch_bytes, size_t gemm_workspace_bytes)
    : gemm_workspace_bytes_(gemm_workspace_bytes), scratch_bytes_(scratch_bytes) {
  CUDA_CHECK(cudaGetDevice(&device_));
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  if (gemm_workspace_bytes_ > 0) CUDA_CHECK(cudaMalloc(&gemm_workspace_, gemm_workspace_bytes_));
  if (scratch_bytes_ > 0) CUDA_CHECK(cudaMalloc(&scratch_, scratch_bytes_));
}

Context::Context(void* scratch, size_t scratch_bytes, void* gemm_workspace, size_t gemm_workspace_bytes)
    : gemm_workspace_(gemm_workspace),
      gemm_workspace_bytes_(gemm_workspace_bytes),
      scratch_(scratch),
      scratch_bytes_(scratch_bytes),
      owns_memory_(false) {
  CUDA_CHECK(cudaGetDevice(&device_));
  CUBLAS_CHECK(cublasLtCreate(&lt_));
}

Context::~Context() {
  CUDA_CHECK(cudaSetDevice(device_));
  // Work queued by ops may still use the buffers: wait for the device before freeing.
  CUDA_CHECK(cudaDeviceSynchronize());
  fp8_gemm_plans_.reset();
  cudnn_attention_.reset();
  if (blas_ != nullptr) CUBLAS_CHECK(cublasDestroy(blas_));
  if (owns_memory_ && scratch_ != nullptr) CUDA_CHECK(cudaFree(scratch_));
  if (owns_memory_ && gemm_workspace_ != nullptr) CUDA_CHECK(cudaFree(gemm_workspace_));
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

namespace {

// Largest power of two (up to 256) dividing the address: what cuBLASLt may assume.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// RAII for the descriptors of one call.
struct MatmulDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~MatmulDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

// cuBLASLt is column-major. A row-major (R, S) matrix with row stride ld is the column-major
// (S, R) matrix with leading dimension ld, i.e. its transpose. So row-major
//   C (M,N) = op(A) (M,K) @ op(B) (K,N)
// is column-major
//   C^T (N,M) = op(B)^T (N,K) @ op(A)^T (K,M),
// a column-major GEMM with m = N, n = M, k = K, first operand B (stored column-major as
// B^T: transposed in the call iff trans_b) and second operand A (likewise iff trans_a).
// The bias of a row-major C is per column of C = per row of C^T: cuBLASLt's BIAS epilogue.
void gemm(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, void* C,
          int64_t ldc, bool c_is_fp32, const bf16* bias, cudaStream_t stream) {
  CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  CHECK_MSG(bias == nullptr || beta == 0.0f, "gemm: a bias epilogue requires beta == 0");
  CHECK(ldc >= N);
  if (K == 0) {
    // Nothing to multiply: C = beta * C (+ bias). Only beta == 1 without bias is a no-op; the
    // ops of this backend never ask for anything else with K == 0.
    CHECK_MSG(beta == 1.0f && bias == nullptr, "gemm with K == 0 is only supported as a no-op");
    return;
  }
  const cudaDataType_t c_type = c_is_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  // Column-major view: first operand = B^T-or-B with shape (m=N, k=K).
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  // Stored (column-major) shapes: rows x cols with leading dimension ld.
  // B row-major is (K,N) when !trans_b, (N,K) when trans_b; column-major that is (N,K) or (K,N).
  const uint64_t first_rows = trans_b ? K : N, first_cols = trans_b ? N : K;
  const uint64_t second_rows = trans_a ? M : K, second_cols = trans_a ? K : M;
  CHECK(ldb >= static_cast<int64_t>(first_rows));
  CHECK(lda >= static_cast<int64_t>(second_rows));

  MatmulDescs d;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                              sizeof(op_first)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                              sizeof(op_second)));
  if (bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                sizeof(epilogue)));
    const cudaDataType_t bias_type = CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                &bias_type, sizeof(bias_type)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof(bias)));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_16BF, first_rows, first_cols, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_16BF, second_rows, second_cols, lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, c_type, N, M, ldc));

  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
  const uint64_t workspace = ctx.gemm_workspace_bytes();
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
  // Without these, cuBLASLt assumes 256-byte aligned pointers; slices of larger buffers are not.
  const uint32_t align_first = alignment_of(B), align_second = alignment_of(A);
  const uint32_t align_c = alignment_of(C);
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_first, sizeof(align_first)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_second, sizeof(align_second)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.lt(), d.op, d.a, d.b, d.c, d.c, d.pref, 1,
                                              &heuristic, &found));
  CHECK_MSG(found > 0 && heuristic.state == CUBLAS_STATUS_SUCCESS, "cuBLASLt has no algorithm for a " + std::to_string(M) + "x" +
                           std::to_string(N) + "x" + std::to_string(K) + " bf16 GEMM");
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt(), d.op, &alpha, B, d.a, A, d.b, &beta, C, d.c, C, d.c,
                              &heuristic.algo, ctx.gemm_workspace(), ctx.gemm_workspace_bytes(),
                              stream));
}

}  // namespace strata::kernels::cuda
