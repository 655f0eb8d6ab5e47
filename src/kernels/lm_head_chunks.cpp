// Chunk sizes of the CUDA LM head (lm_head_chunks.h).
#include "kernels/lm_head_chunks.h"

#include <algorithm>

#include "core/check.h"

namespace strata::kernels {
namespace {

uint64_t align256(uint64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

uint64_t lm_head_chunk_bytes(int64_t C, int64_t V, int64_t chunk_tokens, bool blocked) {
  CHECK(C > 0 && V > 0 && chunk_tokens >= 0);
  const uint64_t cells = static_cast<uint64_t>(chunk_tokens) * static_cast<uint64_t>(V);
  const uint64_t logits = align256(cells * 4) + align256(cells * 2);  // fp32 logits, bf16 dlogits
  if (!blocked) return logits;
  return align256(logits) + static_cast<uint64_t>(chunk_tokens) * static_cast<uint64_t>(C) * 4;
}

int64_t lm_head_chunk_tokens(int64_t N, int64_t C, int64_t V, uint64_t scratch_bytes) {
  CHECK(N > 0 && C > 0 && V > 0);
  if (lm_head_chunk_bytes(C, V, N, true) <= scratch_bytes) return N;
  // The most tokens that fit (fewer than N): bytes grow by 6 V + 4 C per token plus under 512
  // of alignment, so the estimate is at most one token off; step to the exact edge.
  const uint64_t per_token = 6 * static_cast<uint64_t>(V) + 4 * static_cast<uint64_t>(C);
  int64_t cap = std::min<int64_t>(N - 1, static_cast<int64_t>(scratch_bytes / per_token));
  while (cap > 0 && lm_head_chunk_bytes(C, V, cap, true) > scratch_bytes) --cap;
  while (cap + 1 < N && lm_head_chunk_bytes(C, V, cap + 1, true) <= scratch_bytes) ++cap;
  if (cap <= 1) return 1;
  // The fewest chunks of at most cap tokens, evened out so that the last is not a sliver.
  const int64_t chunks = (N + cap - 1) / cap;
  const int64_t even = (N + chunks - 1) / chunks;
  const int64_t rounded = (even + 63) / 64 * 64;
  return rounded <= cap ? rounded : even;
}

uint64_t lm_head_device_scratch_bytes(int64_t N, int64_t C, int64_t V) {
  CHECK(N > 0 && C > 0 && V > 0);
  const int64_t want = std::min(N, kLmHeadTargetChunkTokens);
  const int64_t chunk = lm_head_chunk_tokens(want, C, V, kLmHeadMaxScratchBytes);
  return lm_head_chunk_bytes(C, V, chunk, true);
}

}  // namespace strata::kernels
