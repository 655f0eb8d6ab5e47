// How many tokens the CUDA LM head (kernels/cuda/cross_entropy.cu) takes at a time, and the
// scratch that needs. Plain C++ so that the planner, the CPU build and its tests use the same
// numbers as the CUDA backend. Usable from C++17 (nvcc) and C++20.
//
// Why chunks of thousands of tokens: per chunk the weight-gradient GEMM dW (V, C) += dlogits^T
// (V, t) @ x (t, C) reads and writes all of dW in fp32. With t = 256 that traffic (8 V C bytes)
// takes longer than the GEMM's arithmetic on an H100-class GPU; from t ~ 2K the arithmetic
// dominates. The logits (fp32) and their gradient (bf16) of a chunk, 6 V bytes per token
// (770 KB for V = 128K), bound t: the backend gives the LM head up to kLmHeadMaxScratchBytes.
#pragma once

#include <cstdint>

namespace strata::kernels {

// Tokens per chunk the CUDA backend aims for (one chunk when the micro-batch is smaller).
inline constexpr int64_t kLmHeadTargetChunkTokens = 4096;
// The most scratch the CUDA backend reserves for the LM head per micro-batch.
inline constexpr uint64_t kLmHeadMaxScratchBytes = uint64_t{2} << 30;

// Scratch of one chunk of chunk_tokens tokens: fp32 logits and bf16 dlogits (chunk_tokens, V),
// each 256-byte aligned, and for a vocabulary in row blocks (`blocked`) the fp32 sum of dx over
// the blocks (chunk_tokens, C). The CUDA op's lm_head_scratch_bytes / lm_head_blocked_scratch_bytes.
uint64_t lm_head_chunk_bytes(int64_t C, int64_t V, int64_t chunk_tokens, bool blocked);

// Tokens per chunk for a micro-batch of N tokens when `scratch_bytes` hold a chunk (blocked
// layout, the larger): N itself when it fits, else N split evenly into the fewest chunks that
// fit, each a multiple of 64 tokens where that still fits; at least 1 (whether one token fits
// is the op's to check). REQUIRES N, C, V > 0.
int64_t lm_head_chunk_tokens(int64_t N, int64_t C, int64_t V, uint64_t scratch_bytes);

// The scratch the CUDA backend reserves for the LM head of a micro-batch of N tokens: chunks
// of up to kLmHeadTargetChunkTokens tokens within kLmHeadMaxScratchBytes (at least one token's
// worth). What the planner counts as the head's workspace on a GPU.
uint64_t lm_head_device_scratch_bytes(int64_t N, int64_t C, int64_t V);

}  // namespace strata::kernels
