// Linear layer on CUDA: the GEMMs go through cuBLASLt (gemm() in context.cpp); the bias
// gradient is a column sum in row chunks, reduced in chunk order (no atomics).
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxChunks = 256;  // row chunks of the bias gradient (depends on N only)

// grid (ceil(OC / kThreads), chunks). partial (chunks, OC) row b = column sums of dout over
// rows [b * rows_per_chunk, ...).
__global__ void column_partials_kernel(float* partial, const bf16* dout, int64_t N, int64_t OC,
                                       int64_t rows_per_chunk) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= OC) return;
  const int64_t begin = blockIdx.y * rows_per_chunk;
  const int64_t end = min(N, begin + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t row = begin; row < end; ++row) acc += to_float(dout[row * OC + c]);
  partial[blockIdx.y * OC + c] = acc;
}

// dbias (OC) += sum over chunks of partial (chunks, OC), in chunk order.
__global__ void sum_partials_kernel(float* dbias, const float* partial, int64_t chunks,
                                    int64_t OC) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= OC) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < chunks; ++b) acc += partial[b * OC + c];
  dbias[c] += acc;
}

// grid (ceil(N / kThreads), up to 65535 rows, striding over the rest): C[row, c] += bias[c].
template <typename T>
__global__ void add_bias_rows_kernel(T* C, int64_t ldc, const bf16* bias, int64_t M, int64_t N) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= N) return;
  const float b = to_float(bias[c]);
  for (int64_t row = blockIdx.y; row < M; row += gridDim.y) {
    T& out = C[row * ldc + c];
    if constexpr (std::is_same_v<T, float>) {
      out += b;
    } else {
      out = __float2bfloat16(to_float(out) + b);
    }
  }
}

}  // namespace

void add_bias_rows(void* C, int64_t ldc, bool c_is_fp32, const bf16* bias, int64_t M, int64_t N,
                   cudaStream_t stream) {
  CHECK(M >= 0 && N >= 0 && ldc >= N);
  if (M == 0 || N == 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(N, kThreads)), static_cast<unsigned>(M < 65535 ? M : 65535));
  if (c_is_fp32) {
    add_bias_rows_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(C), ldc, bias, M, N);
  } else {
    add_bias_rows_kernel<<<grid, kThreads, 0, stream>>>(static_cast<bf16*>(C), ldc, bias, M, N);
  }
  CUDA_CHECK_LAUNCH();
}

void linear_forward(Context& ctx, bf16* out, const bf16* x, const bf16* weight, const bf16* bias,
                    int64_t N, int64_t IC, int64_t OC, cudaStream_t stream) {
  CHECK(N >= 0 && IC > 0 && OC > 0);
  // out (N,OC) = x (N,IC) @ weight (OC,IC)^T (+ bias as the epilogue)
  gemm(ctx, /*trans_a=*/false, /*trans_b=*/true, N, OC, IC, 1.0f, x, IC, weight, IC, 0.0f, out,
       OC, /*c_is_fp32=*/false, bias, stream);
}

void linear_forward_residual(Context& ctx, bf16* out, const bf16* x, const bf16* weight, const bf16* residual,
                             int64_t N, int64_t IC, int64_t OC, cudaStream_t stream) {
  CHECK(N >= 0 && IC > 0 && OC > 0);
  CHECK_MSG(out != residual, "linear_forward_residual: out must not alias the residual");
  // out (N,OC) = x (N,IC) @ weight (OC,IC)^T + residual: cuBLASLt's D = A B + C with C != D.
  gemm_separate_c(ctx, /*trans_a=*/false, /*trans_b=*/true, N, OC, IC, 1.0f, x, IC, weight, IC, 1.0f, residual, out,
                  OC, /*c_is_fp32=*/false, nullptr, stream);
}

void linear_backward(Context& ctx, bf16* dx, float* dweight, float* dbias, const bf16* dout,
                     const bf16* x, const bf16* weight, int64_t N, int64_t IC, int64_t OC,
                     cudaStream_t stream) {
  CHECK(N >= 0 && IC > 0 && OC > 0);
  if (N == 0) return;  // dx is empty and nothing accumulates
  if (dx != nullptr) {
    // dx (N,IC) = dout (N,OC) @ weight (OC,IC)
    gemm(ctx, false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 0.0f, dx, IC, false, nullptr,
         stream);
  }
  if (dweight != nullptr) {
    // dweight (OC,IC) += dout^T (OC,N) @ x (N,IC), accumulated in fp32
    gemm(ctx, true, false, OC, IC, N, 1.0f, dout, OC, x, IC, 1.0f, dweight, IC, true, nullptr,
         stream);
  }
  if (dbias != nullptr) bias_backward(ctx, dbias, dout, N, OC, stream);
}

void bias_backward(Context& ctx, float* dbias, const bf16* dout, int64_t N, int64_t OC, cudaStream_t stream) {
  CHECK(N >= 0 && OC > 0);
  if (N == 0) return;
  const int64_t chunks = N < kMaxChunks ? N : kMaxChunks;
  const int64_t rows_per_chunk = ceil_div(N, chunks);
  const int64_t used = ceil_div(N, rows_per_chunk);
  auto* partial =
      static_cast<float*>(ctx.scratch(static_cast<size_t>(used * OC) * sizeof(float), "linear_backward (dbias)"));
  const dim3 grid(static_cast<unsigned>(ceil_div(OC, kThreads)), static_cast<unsigned>(used));
  column_partials_kernel<<<grid, kThreads, 0, stream>>>(partial, dout, N, OC, rows_per_chunk);
  CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<static_cast<unsigned>(ceil_div(OC, kThreads)), kThreads, 0, stream>>>(dbias, partial, used,
                                                                                               OC);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
