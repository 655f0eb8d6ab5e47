// Reductions for gradient clipping and loss sums on CUDA, deterministic: pass 1 writes one
// double per block (a fixed number of blocks, a fixed grid-stride assignment), pass 2 sums
// those partials in one block. The result depends on n only, never on timing.
//
// The multi-tensor sum of squares does the same over a table of gradient buffers in one launch
// (16-byte loads where a buffer is aligned), and clip_factor turns the sum into the clipping
// factor on the device, so that a step needs no host round trip between the norm and AdamW.
#include <algorithm>
#include <limits>

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

// ---- multi-tensor sum of squares ----

constexpr int64_t kNormChunk = 16384;  // elements per work item; a multiple of 4
static_assert(kNormChunk % 4 == 0, "chunks start 16-byte aligned in an aligned buffer");

struct NormTable {
  const float* x[kMaxNormTensorsPerLaunch];
  int64_t n[kMaxNormTensorsPerLaunch];
  int64_t first_chunk[kMaxNormTensorsPerLaunch + 1];  // tensor t owns chunks [first_chunk[t], [t+1])
  int count;
};

// Sum of squares of x[begin, end), this thread's share, added to acc in a fixed order.
__device__ __forceinline__ void chunk_sum_squares(double& acc, const float* x, int64_t begin, int64_t end) {
  int64_t scalar_begin = begin;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {  // begin is a multiple of 4: x + begin is aligned
    const int64_t quads = (end - begin) / 4;
    for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
      const float4 v = *reinterpret_cast<const float4*>(x + begin + 4 * q);
      const double a = v.x, b = v.y, c = v.z, d = v.w;
      acc += a * a;
      acc += b * b;
      acc += c * c;
      acc += d * d;
    }
    scalar_begin = begin + 4 * quads;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
}

// grid (at most kMaxBlocks), block kThreads. Block b sums chunks b, b + gridDim, ... (numbered
// across the table in order) and writes partials[b].
__global__ void multi_tensor_partials_kernel(double* partials, NormTable table) {
  __shared__ double shared[kWarpSize];
  double acc = 0.0;
  const int64_t chunks = table.first_chunk[table.count];
  int t = 0;
  for (int64_t k = blockIdx.x; k < chunks; k += gridDim.x) {
    while (table.first_chunk[t + 1] <= k) ++t;  // k only grows, so t does
    const int64_t begin = (k - table.first_chunk[t]) * kNormChunk;
    const int64_t end = min(table.n[t], begin + kNormChunk);
    chunk_sum_squares(acc, table.x[t], begin, end);
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// kernels::clip_coefficient (cpu/grad_norm.cpp) with every double operation rounded once, as
// the host's are; NaN for a non-finite norm (the step is skipped).
__global__ void clip_factor_kernel(float* factor, double* norm_out, const double* sum_squares, double max_norm) {
  const double norm = __dsqrt_rn(*sum_squares);
  if (norm_out != nullptr) *norm_out = norm;
  float f;
  if (!isfinite(norm)) {
    f = __int_as_float(0x7fc00000);  // quiet NaN
  } else if (max_norm <= 0) {
    f = 1.0f;
  } else {
    const double coef = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
    f = isnan(coef) ? __int_as_float(0x7fc00000) : __double2float_rn(coef < 1.0 ? coef : 1.0);
  }
  *factor = f;
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

void multi_tensor_sum_squares(Context& ctx, double* out, const NormTensor* tensors, int count, bool accumulate,
                              cudaStream_t stream) {
  CHECK(count >= 0);
  auto* partials = static_cast<double*>(ctx.scratch(kMaxBlocks * sizeof(double), "multi_tensor_sum_squares"));
  int t = 0;  // next tensor to place in a launch
  bool first_launch = true;
  do {
    NormTable table{};
    int64_t chunks = 0;
    for (; t < count && table.count < kMaxNormTensorsPerLaunch; ++t) {
      const NormTensor& x = tensors[t];
      CHECK(x.n >= 0);
      if (x.n == 0) continue;
      CHECK_MSG(x.x != nullptr, "multi_tensor_sum_squares: tensor " + std::to_string(t) + " has no buffer");
      const int i = table.count++;
      table.x[i] = x.x;
      table.n[i] = x.n;
      table.first_chunk[i] = chunks;
      chunks += ceil_div(x.n, kNormChunk);
    }
    table.first_chunk[table.count] = chunks;
    // An empty table still writes its zero when the caller does not accumulate.
    const int blocks = static_cast<int>(std::clamp<int64_t>(chunks, 1, kMaxBlocks));
    multi_tensor_partials_kernel<<<blocks, kThreads, 0, stream>>>(partials, table);
    CUDA_CHECK_LAUNCH();
    // The scratch is reused by the next launch: stream order keeps this sum ahead of it.
    final_sum_kernel<<<1, kMaxBlocks, 0, stream>>>(out, partials, blocks, accumulate || !first_launch);
    CUDA_CHECK_LAUNCH();
    first_launch = false;
  } while (t < count);
}

void clip_factor(float* factor, double* norm, const double* sum_squares, double max_norm, cudaStream_t stream) {
  CHECK(factor != nullptr && sum_squares != nullptr);
  clip_factor_kernel<<<1, 1, 0, stream>>>(factor, norm, sum_squares, max_norm);
  CUDA_CHECK_LAUNCH();
}

void scale_inplace(float* x, int64_t n, float s, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  scale_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(x, n, s);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
