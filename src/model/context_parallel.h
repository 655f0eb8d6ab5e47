// Context parallelism (parallel.context_parallel = N): the tokens of each sequence are split over
// the N ranks of a context group, and attention runs as a ring over them (DESIGN §3.5).
//
// Layout, load-balanced for causal attention: a sequence of T tokens is cut into 2N chunks of
// C = T / (2N) tokens, and rank r takes chunks r and 2N - 1 - r. An early chunk has few keys
// before it and a late one many, so every rank's queries see the same number of keys (the causal
// work of a contiguous split would grow with the rank).
//
// A rank holds its B sequences' tokens as 2B rows of C tokens: first chunk r of every sequence,
// then chunk 2N - 1 - r of every sequence (`local row` 0 .. B - 1, then B .. 2B - 1). Each half is
// then one contiguous (B, C, ...) tensor, so an attention block of one half against another needs
// no copy. Everything but attention (embeddings, norms, the MLP, the LM head) works per token and
// sees the 2B rows as any other batch; RoPE rotates each token by its position in the sequence.
//
// Ring attention: step s = 0 .. N-1, rank r holds the keys and values of rank (r - s) mod N (its
// own first) and passes them to rank r + 1 while the blocks run. The queries of chunk i against
// the keys of chunk j are a full block when j < i, the causal block when j = i, and nothing when
// j > i (all masked). Each rank computes 2 blocks per step after the first (3 at step 0), the same
// on every rank. The blocks' outputs merge by their log-sum-exps (kernels/attention.h). Backward
// runs the ring again: each block adds its share to dq and to the dk, dv that travel with the
// keys, which reach their own rank after the last step.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>

#include "core/check.h"
#include "kernels/attention.h"

namespace strata::model {

// The chunk of the sequence that half `half` (0 or 1) of rank `rank`'s tokens is.
inline int64_t context_chunk(int64_t ranks, int64_t rank, int half) {
  CHECK(ranks > 0 && rank >= 0 && rank < ranks && (half == 0 || half == 1));
  return half == 0 ? rank : 2 * ranks - 1 - rank;
}

// The block of queries of chunk q_chunk against keys of chunk kv_chunk; none when every key is
// after every query.
inline std::optional<kernels::AttentionBlock> context_block(int64_t q_chunk, int64_t kv_chunk) {
  if (kv_chunk < q_chunk) return kernels::AttentionBlock::kFull;
  if (kv_chunk == q_chunk) return kernels::AttentionBlock::kCausal;
  return std::nullopt;
}

// The rank whose keys and values rank `rank` holds at ring step `step`.
inline int64_t context_ring_source(int64_t ranks, int64_t rank, int64_t step) {
  return ((rank - step) % ranks + ranks) % ranks;
}

// Copies rank `rank`'s tokens of B sequences of T tokens between the sequences (B, T, width) and
// its local rows (2B, T/(2N), width) in the layout above, each token `width` elements of
// `bytes_per` bytes: into `local` when to_local, else back to their places in `sequences` (the
// other ranks' places left as they were). REQUIRES: 2N divides T.
inline void context_copy(char* local, char* sequences, int64_t B, int64_t T, int64_t width, size_t bytes_per,
                         int64_t ranks, int64_t rank, bool to_local) {
  CHECK(T % (2 * ranks) == 0);
  const int64_t C = T / (2 * ranks);
  const size_t chunk_bytes = static_cast<size_t>(C * width) * bytes_per;
  for (int half = 0; half < 2; ++half)
    for (int64_t b = 0; b < B; ++b) {
      char* mine = local + static_cast<size_t>(half * B + b) * chunk_bytes;
      char* theirs =
          sequences + static_cast<size_t>(b * T + context_chunk(ranks, rank, half) * C) * width * bytes_per;
      if (to_local)
        std::memcpy(mine, theirs, chunk_bytes);
      else
        std::memcpy(theirs, mine, chunk_bytes);
    }
}

// Rank `rank`'s local rows from the sequences.
inline void context_split(void* local, const void* sequences, int64_t B, int64_t T, int64_t width, size_t bytes_per,
                          int64_t ranks, int64_t rank) {
  context_copy(static_cast<char*>(local), const_cast<char*>(static_cast<const char*>(sequences)), B, T, width,
               bytes_per, ranks, rank, /*to_local=*/true);
}

// Rank `rank`'s local rows back to their places in the sequences.
inline void context_merge(void* sequences, const void* local, int64_t B, int64_t T, int64_t width, size_t bytes_per,
                          int64_t ranks, int64_t rank) {
  context_copy(const_cast<char*>(static_cast<const char*>(local)), static_cast<char*>(sequences), B, T, width,
               bytes_per, ranks, rank, /*to_local=*/false);
}

// Each local token's position in its sequence: (2B, C), the positions RoPE rotates by.
inline void context_positions(int32_t* positions, int64_t B, int64_t T, int64_t ranks, int64_t rank) {
  CHECK(T % (2 * ranks) == 0);
  const int64_t C = T / (2 * ranks);
  for (int half = 0; half < 2; ++half)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < C; ++t)
        positions[(half * B + b) * C + t] = static_cast<int32_t>(context_chunk(ranks, rank, half) * C + t);
}

}  // namespace strata::model
