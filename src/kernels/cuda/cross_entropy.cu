// LM head fused with cross-entropy on CUDA, chunk_tokens tokens at a time: only
// chunk_tokens x V logits (fp32) and their gradient (bf16) exist, in the Context's scratch.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"
#include "kernels/lm_head_chunks.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 512;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Running (max, sum of exp(x - max)) pairs, merged without NaNs when both are empty.
struct MaxSum {
  float m;
  float s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// grid (rows of the chunk), block kThreads. For row r: loss = logsumexp(logits) -
// logits[target]; dlogits (when non-null) = (softmax - onehot) * grad_scale; a masked row
// (target < 0) gets loss 0 and dlogits 0.
__global__ void softmax_loss_kernel(float* losses, bf16* dlogits, const float* logits,
                                    const int32_t* targets, int64_t V, float grad_scale) {
  __shared__ MaxSum shared[kWarpSize];
  const int64_t r = blockIdx.x;
  const int32_t target = targets[r];
  if (target >= V) __trap();  // REQUIRES target < V
  const float* row = logits + r * V;
  bf16* drow = dlogits == nullptr ? nullptr : dlogits + r * V;
  if (target < 0) {
    if (threadIdx.x == 0) losses[r] = 0.0f;
    if (drow != nullptr) {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) drow[v] = to_bf16(0.0f);
    }
    return;  // the whole block returns: no barrier is skipped by part of it
  }
  // One pass: each thread keeps an online (max, sum).
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float l = row[v];
    if (l > acc.m) {
      acc.s = acc.s * expf(acc.m - l) + 1.0f;
      acc.m = l;
    } else {
      acc.s += expf(l - acc.m);
    }
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, offset),
                 __shfl_xor_sync(0xffffffffu, acc.s, offset)};
    acc = merge(acc, other);
  }
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) shared[warp] = acc;
  __syncthreads();
  MaxSum total{-INFINITY, 0.0f};
  for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) total = merge(total, shared[w]);
  const float lse = total.m + logf(total.s);
  if (threadIdx.x == 0) losses[r] = lse - row[target];
  if (drow != nullptr) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const float p = expf(row[v] - lse);
      drow[v] = to_bf16((p - (v == target ? 1.0f : 0.0f)) * grad_scale);
    }
  }
}

}  // namespace

size_t lm_head_scratch_bytes(int64_t C, int64_t V, int64_t chunk_tokens) {
  return static_cast<size_t>(lm_head_chunk_bytes(C, V, chunk_tokens, /*blocked=*/false));
}

void lm_head_cross_entropy(Context& ctx, float* losses, bf16* dx, float* dweight, const bf16* x,
                           const bf16* weight, const int32_t* targets, int64_t N, int64_t C,
                           int64_t V, float grad_scale, int64_t chunk_tokens,
                           cudaStream_t stream) {
  CHECK(N >= 0 && C > 0 && V > 0);
  CHECK_MSG(chunk_tokens > 0, "chunk_tokens must be positive, got " + std::to_string(chunk_tokens));
  if (N == 0) return;
  const int64_t chunk = chunk_tokens < N ? chunk_tokens : N;
  char* base = static_cast<char*>(
      ctx.scratch(lm_head_scratch_bytes(C, V, chunk), "lm_head_cross_entropy (logits chunk)"));
  auto* logits = reinterpret_cast<float*>(base);  // (chunk, V)
  auto* dlogits = reinterpret_cast<bf16*>(
      base + align256(static_cast<size_t>(chunk) * V * sizeof(float)));  // (chunk, V)
  const bool need_grad = dx != nullptr || dweight != nullptr;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = chunk < N - n0 ? chunk : N - n0;
    const bf16* xc = x + n0 * C;
    // logits (rows,V) = x (rows,C) @ weight (V,C)^T, fp32
    gemm(ctx, false, true, rows, V, C, 1.0f, xc, C, weight, C, 0.0f, logits, V,
         /*c_is_fp32=*/true, nullptr, stream);
    softmax_loss_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        losses + n0, need_grad ? dlogits : nullptr, logits, targets + n0, V, grad_scale);
    CUDA_CHECK_LAUNCH();
    if (dx != nullptr) {
      // dx (rows,C) = dlogits (rows,V) @ weight (V,C)
      gemm(ctx, false, false, rows, C, V, 1.0f, dlogits, V, weight, C, 0.0f, dx + n0 * C, C,
           false, nullptr, stream);
    }
    if (dweight != nullptr) {
      // dweight (V,C) += dlogits^T (V,rows) @ x (rows,C), fp32
      gemm(ctx, true, false, V, C, rows, 1.0f, dlogits, V, xc, C, 1.0f, dweight, C, true,
           nullptr, stream);
    }
  }
}

size_t lm_head_blocked_scratch_bytes(int64_t C, int64_t V, int64_t chunk_tokens) {
  // align256(lm_head_scratch_bytes) + the fp32 dx sum (chunk, C), as carved below.
  return static_cast<size_t>(lm_head_chunk_bytes(C, V, chunk_tokens, /*blocked=*/true));
}

void lm_head_cross_entropy_blocked(Context& ctx, float* losses, bf16* dx, float* const* dweight_blocks,
                                   const bf16* x, const bf16* const* weight_blocks, int64_t block_rows,
                                   const int32_t* targets, int64_t N, int64_t C, int64_t V,
                                   float grad_scale, int64_t chunk_tokens, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0 && V > 0 && block_rows > 0);
  if (block_rows >= V) {  // one block: the contiguous op
    lm_head_cross_entropy(ctx, losses, dx, dweight_blocks != nullptr ? dweight_blocks[0] : nullptr, x,
                          weight_blocks[0], targets, N, C, V, grad_scale, chunk_tokens, stream);
    return;
  }
  CHECK_MSG(chunk_tokens > 0, "chunk_tokens must be positive, got " + std::to_string(chunk_tokens));
  if (N == 0) return;
  const int64_t chunk = chunk_tokens < N ? chunk_tokens : N;
  char* base = static_cast<char*>(
      ctx.scratch(lm_head_blocked_scratch_bytes(C, V, chunk), "lm_head_cross_entropy (logits chunk)"));
  auto* logits = reinterpret_cast<float*>(base);  // (chunk, V)
  auto* dlogits = reinterpret_cast<bf16*>(base + align256(static_cast<size_t>(chunk) * V * sizeof(float)));
  // dx of a chunk sums over the blocks in fp32 and is rounded once, as with one block.
  auto* dx_acc = reinterpret_cast<float*>(base + align256(lm_head_scratch_bytes(C, V, chunk)));  // (chunk, C)
  const bool need_grad = dx != nullptr || dweight_blocks != nullptr;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = chunk < N - n0 ? chunk : N - n0;
    const bf16* xc = x + n0 * C;
    // logits[:, block] (rows, block) = x (rows,C) @ block (block,C)^T, fp32, ldc V
    for (int64_t r0 = 0, b = 0; r0 < V; r0 += block_rows, ++b) {
      const int64_t vb = block_rows < V - r0 ? block_rows : V - r0;
      gemm(ctx, false, true, rows, vb, C, 1.0f, xc, C, weight_blocks[b], C, 0.0f, logits + r0, V,
           /*c_is_fp32=*/true, nullptr, stream);
    }
    softmax_loss_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        losses + n0, need_grad ? dlogits : nullptr, logits, targets + n0, V, grad_scale);
    CUDA_CHECK_LAUNCH();
    for (int64_t r0 = 0, b = 0; r0 < V; r0 += block_rows, ++b) {
      const int64_t vb = block_rows < V - r0 ? block_rows : V - r0;
      if (dx != nullptr) {
        // dx (rows,C) (+)= dlogits[:, block] (rows,vb) @ block (vb,C), fp32
        gemm(ctx, false, false, rows, C, vb, 1.0f, dlogits + r0, V, weight_blocks[b], C, b == 0 ? 0.0f : 1.0f,
             dx_acc, C, true, nullptr, stream);
      }
      if (dweight_blocks != nullptr) {
        // block's dweight (vb,C) += dlogits[:, block]^T (vb,rows) @ x (rows,C), fp32
        gemm(ctx, true, false, vb, C, rows, 1.0f, dlogits + r0, V, xc, C, 1.0f, dweight_blocks[b], C, true,
             nullptr, stream);
      }
    }
    if (dx != nullptr) f32_to_bf16(dx + n0 * C, dx_acc, rows * C, stream);
  }
}

}  // namespace strata::kernels::cuda
