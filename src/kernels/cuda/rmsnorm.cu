// RMSNorm on CUDA: one block per row forward; backward in row chunks whose dweight partials
// are summed in chunk order by a second kernel (no atomics, reproducible).
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Row chunks of the backward: their number depends on N only, which fixes the order in which
// dweight's partial sums are added.
constexpr int64_t kMaxChunks = 512;

// ---- kernels ----------------------------------------------------------------------------------

// grid (N), block kThreads. out = x * rstd * weight.
__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* x, const bf16* weight,
                                       int64_t C, float eps) {
  __shared__ float shared[kWarpSize];
  const int64_t row = blockIdx.x;
  const bf16* xr = x + row * C;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xv = to_float(xr[c]);
    ss += xv * xv;
  }
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  bf16* o = out + row * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    o[c] = to_bf16(to_float(xr[c]) * r * to_float(weight[c]));
  }
}

// grid (chunks), block kThreads. Block b handles rows [b * rows_per_chunk, ...): writes dx and
// partial (chunks, C) row b = sum over its rows of dout * x * rstd. Each thread owns the same
// columns of its block's partial row for the whole loop, so no two threads share an element.
__global__ void rmsnorm_backward_kernel(bf16* dx, float* partial, const bf16* dout, const bf16* x,
                                        const bf16* weight, const float* rstd, int64_t N, int64_t C,
                                        int64_t rows_per_chunk) {
  __shared__ float shared[kWarpSize];
  float* part = partial + blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) part[c] = 0.0f;
  const int64_t begin = blockIdx.x * rows_per_chunk;
  const int64_t end = min(N, begin + rows_per_chunk);
  for (int64_t row = begin; row < end; ++row) {
    const bf16* xr = x + row * C;
    const bf16* g = dout + row * C;
    const float r = rstd[row];
    // out_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / C, so
    // dx_j = r w_j g_j - r^3 x_j / C * sum_i g_i w_i x_i.
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      s += to_float(g[c]) * to_float(weight[c]) * to_float(xr[c]);
    }
    s = block_sum(s, shared);
    const float k = r * r * r * s / static_cast<float>(C);
    bf16* dxr = dx + row * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float gv = to_float(g[c]), xv = to_float(xr[c]);
      dxr[c] = to_bf16(r * to_float(weight[c]) * gv - k * xv);
      part[c] += gv * xv * r;
    }
  }
}

// dweight (C) += sum over chunks of partial (chunks, C), in chunk order.
__global__ void sum_partials_kernel(float* dweight, const float* partial, int64_t chunks,
                                    int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < chunks; ++b) acc += partial[b * C + c];
  dweight[c] += acc;
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight, int64_t N,
                     int64_t C, float eps, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  CHECK_MSG(N < (int64_t{1} << 31), "rmsnorm_forward: too many rows");
  if (N == 0) return;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(out, rstd, x, weight,
                                                                           C, eps);
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(Context& ctx, bf16* dx, float* dweight, const bf16* dout, const bf16* x,
                      const bf16* weight, const float* rstd, int64_t N, int64_t C,
                      cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  if (N == 0) return;
  const int64_t chunks = N < kMaxChunks ? N : kMaxChunks;
  const int64_t rows_per_chunk = ceil_div(N, chunks);
  const int64_t used_chunks = ceil_div(N, rows_per_chunk);
  auto* partial = static_cast<float*>(
      ctx.scratch(static_cast<size_t>(used_chunks * C) * sizeof(float), "rmsnorm_backward"));
  rmsnorm_backward_kernel<<<static_cast<unsigned>(used_chunks), kThreads, 0, stream>>>(
      dx, partial, dout, x, weight, rstd, N, C, rows_per_chunk);
  CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<static_cast<unsigned>(ceil_div(C, kThreads)), kThreads, 0, stream>>>(
      dweight, partial, used_chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
