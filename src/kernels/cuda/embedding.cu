// Token embedding on CUDA: a gather forward and a deterministic scatter-add backward. When C is
// a multiple of 8 and the pointers are 16-byte aligned, a thread moves 8 columns per access
// (vector_access.cuh); otherwise one column. The backward adds each element's values in the
// same order on both paths, so the path never changes a result.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vector_access.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kColumnsPerBlock = 128;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Bits needed to hold every token id in [0, V).
int key_bits(int64_t V) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < V) ++bits;
  return bits;
}

// ---- kernels ----------------------------------------------------------------------------------

__device__ __forceinline__ void check_token(int32_t token, int64_t V) {
  if (token < 0 || token >= V) __trap();  // REQUIRES 0 <= token < V
}

// out (N,C) = table[tokens] for the tokens in rows [r0, r0 + rows) of the vocabulary, which
// `table` holds (the whole table: r0 = 0, rows = V; or one row block of it). A thread copies
// kWidth columns; kWidth == 8 REQUIRES C % 8 == 0 and out, table 16-byte aligned.
template <int kWidth>
__global__ void embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* table,
                                         int64_t N, int64_t C, int64_t V, int64_t r0, int64_t rows) {
  const int64_t total = N * C / kWidth;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < total;
       p += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = p * kWidth;
    const int64_t n = i / C, c = i % C;
    const int32_t token = tokens[n];
    check_token(token, V);
    if (token < r0 || token >= r0 + rows) continue;
    const bf16* src = table + (int64_t{token} - r0) * C + c;
    if constexpr (kWidth == kBf16PerPack) {
      *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(src);  // a copy: exact
    } else {
      static_assert(kWidth == 1, "embedding_forward_kernel: one column or a pack of 8 per thread");
      out[i] = *src;
    }
  }
}

// keys (N) = tokens as unsigned, positions (N) = 0..N-1: the input of the stable sort.
__global__ void sort_input_kernel(uint32_t* keys, int32_t* positions, const int32_t* tokens,
                                  int64_t N, int64_t V) {
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < N;
       n += int64_t{gridDim.x} * blockDim.x) {
    check_token(tokens[n], V);
    keys[n] = static_cast<uint32_t>(tokens[n]);
    positions[n] = static_cast<int32_t>(n);
  }
}

// grid (N, ceil(C / (kWidth * kColumnsPerBlock))). Block x = one sorted index i; only the
// first index of each run of equal tokens does work: it adds the run's dout rows, in position
// order (the sort is stable), and adds the sum to the token's row once. No two threads write
// one element. A thread owns kWidth columns; kWidth == 8 REQUIRES C % 8 == 0 and dout, dtable
// 16-byte aligned. dtable holds rows [r0, r0 + rows) of the vocabulary; other tokens are left
// to other launches.
template <int kWidth>
__global__ void embedding_backward_kernel(float* dtable, const bf16* dout, const uint32_t* keys,
                                          const int32_t* positions, int64_t N, int64_t C, int64_t r0,
                                          int64_t rows) {
  const int64_t i = blockIdx.x;
  const int64_t c = (int64_t{blockIdx.y} * kColumnsPerBlock + threadIdx.x) * kWidth;
  if (c >= C) return;
  const uint32_t token = keys[i];
  if (int64_t{token} < r0 || int64_t{token} >= r0 + rows) return;
  if (i > 0 && keys[i - 1] == token) return;
  float acc[kWidth] = {};
  for (int64_t j = i; j < N && keys[j] == token; ++j) {
    const bf16* src = dout + int64_t{positions[j]} * C + c;
    if constexpr (kWidth == kBf16PerPack) {
      float v[kBf16PerPack];
      load_bf16x8(src, v);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) acc[k] += v[k];
    } else {
      acc[0] += to_float(*src);
    }
  }
  float* dst = dtable + (int64_t{token} - r0) * C + c;
  if constexpr (kWidth == kBf16PerPack) {
    float lo[kF32PerPack], hi[kF32PerPack];
    load_f32x4(dst, lo);
    load_f32x4(dst + kF32PerPack, hi);
#pragma unroll
    for (int k = 0; k < kF32PerPack; ++k) {
      lo[k] += acc[k];
      hi[k] += acc[k + kF32PerPack];
    }
    store_f32x4(dst, lo);
    store_f32x4(dst + kF32PerPack, hi);
  } else {
    static_assert(kWidth == 1, "embedding_backward_kernel: one column or a pack of 8 per thread");
    *dst += acc[0];
  }
}

struct SortScratch {
  uint32_t* keys_in;
  uint32_t* keys_out;
  int32_t* positions_in;
  int32_t* positions_out;
  void* cub_temp;
  size_t cub_temp_bytes;
  size_t total_bytes;
};

// Carves the scratch for N tokens starting at `base` (null: sizes only).
SortScratch sort_scratch(void* base, int64_t N, int64_t V) {
  SortScratch s{};
  size_t cub_bytes = 0;
  // A size query: no work is launched and no memory is touched.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(N),
                                             0, key_bits(V)));
  const size_t keys = align256(static_cast<size_t>(N) * sizeof(uint32_t));
  const size_t positions = align256(static_cast<size_t>(N) * sizeof(int32_t));
  auto* p = static_cast<char*>(base);
  s.keys_in = reinterpret_cast<uint32_t*>(p);
  s.keys_out = reinterpret_cast<uint32_t*>(p + keys);
  s.positions_in = reinterpret_cast<int32_t*>(p + 2 * keys);
  s.positions_out = reinterpret_cast<int32_t*>(p + 2 * keys + positions);
  s.cub_temp = p + 2 * keys + 2 * positions;
  s.cub_temp_bytes = cub_bytes;
  s.total_bytes = 2 * keys + 2 * positions + align256(cub_bytes);
  return s;
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t N, int64_t C,
                       int64_t V, cudaStream_t stream) {
  const bf16* const blocks[] = {table};
  embedding_forward_blocked(out, tokens, blocks, V, N, C, V, stream);
}

void embedding_forward_blocked(bf16* out, const int32_t* tokens, const bf16* const* table_blocks,
                               int64_t block_rows, int64_t N, int64_t C, int64_t V, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0 && V > 0 && block_rows > 0);
  if (N == 0) return;
  const int64_t blocks = ceil_div(V, block_rows);
  bool vector = C % kBf16PerPack == 0 && aligned16(out);
  for (int64_t b = 0; b < blocks; ++b) vector = vector && aligned16(table_blocks[b]);
  for (int64_t r0 = 0, b = 0; r0 < V; r0 += block_rows, ++b) {
    const int64_t rows = block_rows < V - r0 ? block_rows : V - r0;
    if (vector) {
      embedding_forward_kernel<kBf16PerPack><<<elementwise_blocks(N * C / kBf16PerPack, kThreads), kThreads, 0,
                                               stream>>>(out, tokens, table_blocks[b], N, C, V, r0, rows);
    } else {
      embedding_forward_kernel<1><<<elementwise_blocks(N * C, kThreads), kThreads, 0, stream>>>(
          out, tokens, table_blocks[b], N, C, V, r0, rows);
    }
    CUDA_CHECK_LAUNCH();
  }
}

size_t embedding_backward_scratch_bytes(int64_t N, int64_t V) {
  return sort_scratch(nullptr, N, V).total_bytes;
}

void embedding_backward(Context& ctx, float* dtable, const bf16* dout, const int32_t* tokens,
                        int64_t N, int64_t C, int64_t V, cudaStream_t stream) {
  float* const blocks[] = {dtable};
  embedding_backward_blocked(ctx, blocks, V, dout, tokens, N, C, V, stream);
}

void embedding_backward_blocked(Context& ctx, float* const* dtable_blocks, int64_t block_rows,
                                const bf16* dout, const int32_t* tokens, int64_t N, int64_t C,
                                int64_t V, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0 && V > 0 && block_rows > 0);
  CHECK_MSG(N < (int64_t{1} << 31) && V <= (int64_t{1} << 31),
            "embedding_backward: N and V must fit in int32");
  if (N == 0) return;
  const size_t bytes = embedding_backward_scratch_bytes(N, V);
  SortScratch s = sort_scratch(ctx.scratch(bytes, "embedding_backward"), N, V);
  sort_input_kernel<<<elementwise_blocks(N, kThreads), kThreads, 0, stream>>>(
      s.keys_in, s.positions_in, tokens, N, V);
  CUDA_CHECK_LAUNCH();
  size_t cub_bytes = s.cub_temp_bytes;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.cub_temp, cub_bytes, s.keys_in, s.keys_out,
                                             s.positions_in, s.positions_out, static_cast<int>(N),
                                             0, key_bits(V), stream));
  const int64_t blocks = ceil_div(V, block_rows);
  bool vector = C % kBf16PerPack == 0 && aligned16(dout);
  for (int64_t b = 0; b < blocks; ++b) vector = vector && aligned16(dtable_blocks[b]);
  const int64_t width = vector ? kBf16PerPack : 1;
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(ceil_div(C, width * kColumnsPerBlock)));
  // One launch per row block; each adds the tokens of its rows.
  for (int64_t r0 = 0, b = 0; r0 < V; r0 += block_rows, ++b) {
    const int64_t rows = block_rows < V - r0 ? block_rows : V - r0;
    if (vector) {
      embedding_backward_kernel<kBf16PerPack><<<grid, kColumnsPerBlock, 0, stream>>>(
          dtable_blocks[b], dout, s.keys_out, s.positions_out, N, C, r0, rows);
    } else {
      embedding_backward_kernel<1><<<grid, kColumnsPerBlock, 0, stream>>>(
          dtable_blocks[b], dout, s.keys_out, s.positions_out, N, C, r0, rows);
    }
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace strata::kernels::cuda
