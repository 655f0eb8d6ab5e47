// RMSNorm on CUDA: one block per row forward; backward in row chunks whose dweight partials
// are summed in chunk order by a second kernel (no atomics, reproducible).
//
// Both directions move 8 bf16 per access (vector_access.cuh) when C is a multiple of 8 and
// every row pointer is 16-byte aligned, else one value per access. The path changes the order
// of the per-row sums (sum of squares, the backward's dot product) — each order is fixed by C
// and the block size, so results are reproducible run to run — but not dweight's, which is
// summed over rows in row order and over chunks in chunk order on both paths.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vector_access.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Row chunks of the backward: their number depends on N only, which fixes the order in which
// dweight's partial sums are added.
constexpr int64_t kMaxChunks = 512;
// Columns a backward thread owns: the narrow kernel (C <= 512 * 16) keeps its weights, the
// row's dout and x and its dweight sums in registers, the wide one (C <= 512 * 64) only the
// dweight sums. 512 threads leave each thread 128 registers: both fit without spilling on the
// 16-byte path; the wide kernel of the one-value path (rows that are not whole packs) keeps its
// sums in (cached) local memory. Rows up to the model limit (512 * 128 = 65536 columns) take a
// third kernel that spills on both paths: correct, slower, wider than any model strata targets.
constexpr int kNarrowColumns = 16;
constexpr int kWideColumns = 64;
constexpr int kHugeColumns = 128;
constexpr int kMaxBackwardThreads = 512;

// Loads kWidth values at column c of a bf16 row (kWidth 8: 16-byte aligned) into v.
template <int kWidth>
__device__ __forceinline__ void load_columns(const bf16* row, int64_t c, float* v) {
  if constexpr (kWidth == kBf16PerPack) {
    float pack[kBf16PerPack];
    load_bf16x8(row + c, pack);
#pragma unroll
    for (int j = 0; j < kBf16PerPack; ++j) v[j] = pack[j];
  } else {
    static_assert(kWidth == 1, "rmsnorm: one column or a pack of 8 per access");
    v[0] = to_float(row[c]);
  }
}
template <int kWidth>
__device__ __forceinline__ void store_columns(bf16* row, int64_t c, const float* v) {
  if constexpr (kWidth == kBf16PerPack) {
    float pack[kBf16PerPack];
#pragma unroll
    for (int j = 0; j < kBf16PerPack; ++j) pack[j] = v[j];
    store_bf16x8(row + c, pack);
  } else {
    row[c] = to_bf16(v[0]);
  }
}

// ---- kernels ----------------------------------------------------------------------------------

// grid (N), block kThreads. out = x * rstd * weight. Thread t takes columns t * kWidth,
// (t + blockDim) * kWidth, ...; kWidth 8 REQUIRES C % 8 == 0 and 16-byte aligned rows.
template <int kWidth>
__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* x, const bf16* weight, int64_t C,
                                       float eps) {
  __shared__ float shared[kWarpSize];
  const int64_t row = blockIdx.x;
  const bf16* xr = x + row * C;
  const int64_t step = int64_t{blockDim.x} * kWidth;
  float ss = 0.0f;
  for (int64_t c = int64_t{threadIdx.x} * kWidth; c < C; c += step) {
    float v[kWidth];
    load_columns<kWidth>(xr, c, v);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) ss += v[j] * v[j];
  }
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  bf16* o = out + row * C;
  for (int64_t c = int64_t{threadIdx.x} * kWidth; c < C; c += step) {
    float v[kWidth], w[kWidth];
    load_columns<kWidth>(xr, c, v);  // the row was just read: a cache hit
    load_columns<kWidth>(weight, c, w);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) v[j] = v[j] * r * w[j];
    store_columns<kWidth>(o, c, v);
  }
}

// grid (chunks), block >= ceil(C / (kWidth * kSlots)) threads, at most kMaxBackwardThreads.
// Block b handles rows [b * rows_per_chunk, ...): writes dx and partial (chunks, C) row b =
// sum over its rows of dout * x * rstd (nothing when partial is null: a frozen weight). Thread
// t owns kSlots groups of kWidth columns, group k at column (k * blockDim + t) * kWidth, for the
// whole chunk: their dweight sums stay in registers, and the only trips through shared memory
// are the per-row block sums. With kKeepRow the thread also keeps its weights and each row's
// dout and x in registers, so a row is read from memory once; without (wide rows, where that
// many registers would spill), the second pass over a row re-reads them (cache hits: the thread
// has just read them). kWidth 8 REQUIRES C % 8 == 0 and 16-byte aligned rows.
template <int kWidth, int kSlots, bool kKeepRow>
__global__ void __launch_bounds__(kMaxBackwardThreads)
    rmsnorm_backward_kernel(bf16* dx, float* partial, const bf16* dout, const bf16* x, const bf16* weight,
                            const float* rstd, int64_t N, int64_t C, int64_t rows_per_chunk) {
  constexpr int kColumns = kWidth * kSlots;
  constexpr int kKept = kKeepRow ? kColumns : kWidth;  // without kKeepRow: one group, reused
  __shared__ float shared[kWarpSize];
  float acc[kColumns], w[kKept], g[kKept], xv[kKept];
  auto column = [&](int k) { return (int64_t{k} * blockDim.x + threadIdx.x) * kWidth; };
  auto kept = [](int k) { return kKeepRow ? k * kWidth : 0; };
#pragma unroll
  for (int i = 0; i < kColumns; ++i) acc[i] = 0.0f;
  if constexpr (kKeepRow) {
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      if (column(k) < C) load_columns<kWidth>(weight, column(k), &w[kept(k)]);
    }
  }

  const int64_t begin = blockIdx.x * rows_per_chunk;
  const int64_t end = min(N, begin + rows_per_chunk);
  for (int64_t row = begin; row < end; ++row) {
    const bf16* xr = x + row * C;
    const bf16* gr = dout + row * C;
    const float r = rstd[row];
    // out_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / C, so
    // dx_j = r w_j g_j - r^3 x_j / C * sum_i g_i w_i x_i.
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int64_t c = column(k);
      if (c >= C) continue;
      float* gk = &g[kept(k)];
      float* xk = &xv[kept(k)];
      float* wk = &w[kept(k)];
      load_columns<kWidth>(gr, c, gk);
      load_columns<kWidth>(xr, c, xk);
      if constexpr (!kKeepRow) load_columns<kWidth>(weight, c, wk);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) s += gk[j] * wk[j] * xk[j];
    }
    s = block_sum(s, shared);
    const float kk = r * r * r * s / static_cast<float>(C);
    bf16* dxr = dx + row * C;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int64_t c = column(k);
      if (c >= C) continue;
      float* gk = &g[kept(k)];
      float* xk = &xv[kept(k)];
      float* wk = &w[kept(k)];
      if constexpr (!kKeepRow) {
        load_columns<kWidth>(gr, c, gk);
        load_columns<kWidth>(xr, c, xk);
        load_columns<kWidth>(weight, c, wk);
      }
      float d[kWidth];
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        d[j] = r * wk[j] * gk[j] - kk * xk[j];
        acc[k * kWidth + j] += gk[j] * xk[j] * r;
      }
      store_columns<kWidth>(dxr, c, d);
    }
  }
  if (partial == nullptr) return;  // a frozen weight: no dweight
  float* part = partial + blockIdx.x * C;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    if (column(k) >= C) continue;
#pragma unroll
    for (int j = 0; j < kWidth; ++j) part[column(k) + j] = acc[k * kWidth + j];
  }
}

// dweight (C) += sum over chunks of partial (chunks, C), in chunk order.
__global__ void sum_partials_kernel(float* dweight, const float* partial, int64_t chunks, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < chunks; ++b) acc += partial[b * C + c];
  dweight[c] += acc;
}

// Threads for a backward block whose threads hold `columns` columns each: whole warps.
unsigned backward_threads(int64_t C, int columns) {
  return static_cast<unsigned>(ceil_div(ceil_div(C, columns), kWarpSize) * kWarpSize);
}

template <int kWidth>
void launch_backward(bf16* dx, float* partial, const bf16* dout, const bf16* x, const bf16* weight, const float* rstd,
                     int64_t N, int64_t C, int64_t chunks, int64_t rows_per_chunk, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(chunks);
  if (C <= int64_t{kMaxBackwardThreads} * kNarrowColumns) {
    rmsnorm_backward_kernel<kWidth, kNarrowColumns / kWidth, true>
        <<<grid, backward_threads(C, kNarrowColumns), 0, stream>>>(dx, partial, dout, x, weight, rstd, N, C,
                                                                   rows_per_chunk);
  } else if (C <= int64_t{kMaxBackwardThreads} * kWideColumns) {
    rmsnorm_backward_kernel<kWidth, kWideColumns / kWidth, false>
        <<<grid, backward_threads(C, kWideColumns), 0, stream>>>(dx, partial, dout, x, weight, rstd, N, C,
                                                                 rows_per_chunk);
  } else {
    rmsnorm_backward_kernel<kWidth, kHugeColumns / kWidth, false>
        <<<grid, backward_threads(C, kHugeColumns), 0, stream>>>(dx, partial, dout, x, weight, rstd, N, C,
                                                                 rows_per_chunk);
  }
  CUDA_CHECK_LAUNCH();
}

// Rows of `a` and `b` (and `c`) are 16-byte aligned: C whole packs, aligned bases.
bool vector_rows(int64_t C, const void* a, const void* b, const void* c, const void* d) {
  return C % kBf16PerPack == 0 && aligned16(a) && aligned16(b) && aligned16(c) && aligned16(d);
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight, int64_t N, int64_t C, float eps,
                     cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  CHECK_MSG(N < (int64_t{1} << 31), "rmsnorm_forward: too many rows");
  if (N == 0) return;
  const unsigned grid = static_cast<unsigned>(N);
  if (vector_rows(C, out, x, weight, weight)) {
    rmsnorm_forward_kernel<kBf16PerPack><<<grid, kThreads, 0, stream>>>(out, rstd, x, weight, C, eps);
  } else {
    rmsnorm_forward_kernel<1><<<grid, kThreads, 0, stream>>>(out, rstd, x, weight, C, eps);
  }
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(Context& ctx, bf16* dx, float* dweight, const bf16* dout, const bf16* x, const bf16* weight,
                      const float* rstd, int64_t N, int64_t C, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  CHECK_MSG(C <= int64_t{kMaxBackwardThreads} * kHugeColumns,
            "rmsnorm_backward: rows of more than " + std::to_string(kMaxBackwardThreads * kHugeColumns) +
                " columns are not supported, got " + std::to_string(C));
  if (N == 0) return;
  const int64_t chunks = N < kMaxChunks ? N : kMaxChunks;
  const int64_t rows_per_chunk = ceil_div(N, chunks);
  const int64_t used_chunks = ceil_div(N, rows_per_chunk);
  float* partial = nullptr;  // a frozen weight (dweight null) takes no partial sums and no reduction
  if (dweight != nullptr) {
    partial =
        static_cast<float*>(ctx.scratch(static_cast<size_t>(used_chunks * C) * sizeof(float), "rmsnorm_backward"));
  }
  if (vector_rows(C, dx, dout, x, weight)) {
    launch_backward<kBf16PerPack>(dx, partial, dout, x, weight, rstd, N, C, used_chunks, rows_per_chunk, stream);
  } else {
    launch_backward<1>(dx, partial, dout, x, weight, rstd, N, C, used_chunks, rows_per_chunk, stream);
  }
  if (dweight == nullptr) return;
  sum_partials_kernel<<<static_cast<unsigned>(ceil_div(C, kThreads)), kThreads, 0, stream>>>(dweight, partial,
                                                                                             used_chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
