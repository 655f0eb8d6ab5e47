// Which tile each block of the causal attention kernels (kernels/cuda/attention.cu) owns. The
// blocks of one launch are scheduled roughly in block-index order, so the block with the most
// work should come first: the last wave then holds short blocks, not a long straggler.
// Under the causal mask a query tile visits the key tiles at or before it (the last query tile
// does the most work), and a key tile is visited by the query tiles at or after it (the first
// key tile does the most work). Compiles under nvcc (C++17) and on the host, for tests.
#pragma once

#include <cstdint>

#include "kernels/adamw_element.h"  // STRATA_HOST_DEVICE

namespace strata::kernels {

// Query tile (index) of block `block` among `tiles` tiles: the last tile first.
STRATA_HOST_DEVICE int64_t attention_query_tile(int64_t block, int64_t tiles) {
  return tiles - 1 - block;
}
// Key tile (index) of block `block` among `tiles` tiles: the first tile first.
STRATA_HOST_DEVICE int64_t attention_key_tile(int64_t block, int64_t tiles) { return block; }

// Tiles of the other kind that the block for query tile `q` / key tile `k` visits.
STRATA_HOST_DEVICE int64_t attention_query_tile_work(int64_t q, int64_t tiles) { return q + 1; }
STRATA_HOST_DEVICE int64_t attention_key_tile_work(int64_t k, int64_t tiles) { return tiles - k; }

}  // namespace strata::kernels
