// Reductions for gradient clipping and loss sums on CUDA, deterministic: pass 1 writes one
// double per block (a fixed number of blocks, a fixed grid-stride assignment), pass 2 sums
// those partials in one block. The result depends on n only, never on timing.
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // pass 2 runs one block of kMaxBlocks threads

template <bool kSquare>
__global__ void partial_sums_kernel(double* partials, const float* x, int64_t n) {
  __shared__ double shared[kWarpSize];
  double acc = 0.0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double v = x[i];
    acc += kSquare ? v * v : v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block of kMaxBlocks threads.
__global__ void final_sum_kernel(double* out, const double* partials, int count, bool accumulate) {
  __shared__ double shared[kWarpSize];
  double v = static_cast<int>(threadIdx.x) < count ? partials[threadIdx.x] : 0.0;
  v = block_sum(v, shared);
  if (threadIdx.x == 0) *out = accumulate ? *out + v : v;
}

template <bool kSquare>
void reduce(Context& ctx, double* out, const float* x, int64_t n, bool accumulate,
            cudaStream_t stream) {
  CHECK(n >= 0);
  const int blocks = static_cast<int>(n == 0 ? 1 : std::min<int64_t>(kMaxBlocks, ceil_div(n, kThreads)));
  auto* partials = static_cast<double*>(ctx.scratch(blocks * sizeof(double), "sum_squares/sum"));
  partial_sums_kernel<kSquare><<<blocks, kThreads, 0, stream>>>(partials, x, n);
  CUDA_CHECK_LAUNCH();
  final_sum_kernel<<<1, kMaxBlocks, 0, stream>>>(out, partials, blocks, accumulate);
  CUDA_CHECK_LAUNCH();
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] *= s;
  }
}

}  // namespace

void sum_squares(Context& ctx, double* out, const float* x, int64_t n, bool accumulate,
                 cudaStream_t stream) {
  reduce<true>(ctx, out, x, n, accumulate, stream);
}

void sum(Context& ctx, double* out, const float* x, int64_t n, bool accumulate,
         cudaStream_t stream) {
  reduce<false>(ctx, out, x, n, accumulate, stream);
}

void scale_inplace(float* x, int64_t n, float s, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  scale_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(x, n, s);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
