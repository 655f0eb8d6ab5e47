// Chunks (DESIGN §3.2): fixed-size blocks that tensors are packed into, one chunk kind per
// role. A ChunkLayout packs tensors in the order they are added (the schedule's first-use
// order) without splitting a tensor across chunks; choose_chunk_size() picks the chunk size
// that wastes the least padding for a list of tensors, as PatrickStar/Gemini search it.
//
// Alignment: chunk sizes are multiples of kChunkAlignment (4 KiB, what O_DIRECT needs on the
// nvme tier); tensors start at multiples of kTensorAlignment (256 bytes) inside a chunk, so
// vector loads and device kernels see aligned data.
//
// ChunkLayout is a value type with no internal locking: not safe for concurrent use.
// The free functions are pure and safe for concurrent use.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "core/units.h"

namespace strata {

inline constexpr uint64_t kChunkAlignment = 4 * kKiB;
inline constexpr uint64_t kTensorAlignment = 256;
inline constexpr uint64_t kDefaultChunkBytes = 64 * kMiB;

enum class ChunkKind : uint8_t {
  kParam,  // bf16/fp8 compute copy of the weights
  kGrad,
  kMaster,  // fp32 master weights
  kAdamM,
  kAdamV,
  kAct,  // saved activations
};
inline constexpr int kNumChunkKinds = 6;
const char* chunk_kind_name(ChunkKind kind);  // "param", "grad", "master", "adam_m", ...

using ChunkId = uint32_t;
using TensorId = uint32_t;

// A half-open byte range [begin, end) inside a chunk.
struct ByteRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  bool operator==(const ByteRange&) const = default;
};

// The part of a chunk of `chunk_bytes` that data-parallel rank `rank` of `world_size` owns
// (ZeRO sharding): equal contiguous parts, each a multiple of kTensorAlignment except possibly
// the last; trailing ranks may own an empty range. The ranges of all ranks partition
// [0, chunk_bytes). REQUIRES: 0 <= rank < world_size.
ByteRange owned_range(uint64_t chunk_bytes, int rank, int world_size);

struct TensorPlacement {
  std::string name;
  ChunkKind kind = ChunkKind::kParam;
  uint64_t bytes = 0;
  ChunkId chunk = 0;
  uint64_t offset = 0;  // from the start of the chunk; a multiple of kTensorAlignment
};

struct ChunkInfo {
  ChunkKind kind = ChunkKind::kParam;
  uint64_t used_bytes = 0;        // end of the last tensor packed into it
  std::vector<TensorId> tensors;  // in packing order
};

class ChunkLayout {
 public:
  // InvalidArgument unless chunk_bytes is a positive multiple of kChunkAlignment.
  static Result<ChunkLayout> create(uint64_t chunk_bytes);

  // OK when a tensor `name` of `bytes` could be added: the name is new and the tensor fits in
  // one chunk (otherwise the message gives the chunk size that would hold it).
  Status validate(const std::string& name, uint64_t bytes) const;
  // True when adding a tensor of `bytes` of `kind` would start a new chunk.
  bool opens_chunk(ChunkKind kind, uint64_t bytes) const;
  // Packs the tensor after the last tensor of the same kind, at the next kTensorAlignment
  // boundary, or at offset 0 of a new chunk when it does not fit there. Errors as validate().
  Result<TensorId> add(const std::string& name, ChunkKind kind, uint64_t bytes);
  // Starts a new, empty chunk of `kind`; later tensors of that kind go into it.
  ChunkId open_chunk(ChunkKind kind);

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  size_t num_chunks() const { return chunks_.size(); }
  size_t num_tensors() const { return tensors_.size(); }
  // REQUIRES: id < num_chunks() / num_tensors().
  const ChunkInfo& chunk(ChunkId id) const;
  const TensorPlacement& tensor(TensorId id) const;
  std::optional<TensorId> find(const std::string& name) const;
  // Bytes of all chunks not covered by tensors (alignment gaps and unused tails).
  uint64_t padding_bytes() const;

 private:
  explicit ChunkLayout(uint64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {}

  uint64_t chunk_bytes_;
  std::vector<ChunkInfo> chunks_;
  std::vector<TensorPlacement> tensors_;
  std::unordered_map<std::string, TensorId> by_name_;
  std::array<std::optional<ChunkId>, kNumChunkKinds> open_{};  // the chunk each kind fills
  uint64_t tensor_bytes_ = 0;
};

// Packs `tensor_bytes` in order into chunks of `chunk_bytes` as ChunkLayout does (one kind).
// REQUIRES: every tensor fits in one chunk.
struct PackingResult {
  uint64_t num_chunks = 0;
  uint64_t padding_bytes = 0;  // num_chunks * chunk_bytes - sum(tensor_bytes)
};
PackingResult pack_tensors(std::span<const uint64_t> tensor_bytes, uint64_t chunk_bytes);

// Candidate chunk sizes: from the largest tensor rounded up to `step` up to `max_bytes`, in
// steps of `step`. REQUIRES: step a positive multiple of kChunkAlignment.
std::vector<uint64_t> chunk_size_candidates(std::span<const uint64_t> tensor_bytes,
                                            uint64_t max_bytes, uint64_t step = kChunkAlignment);

struct ChunkSizeChoice {
  uint64_t chunk_bytes = 0;
  uint64_t num_chunks = 0;
  uint64_t padding_bytes = 0;
};
// The candidate that wastes the least padding when `tensor_bytes` are packed in order; ties go
// to the smaller chunk. Candidates smaller than the largest tensor are skipped. InvalidArgument
// when a candidate is not a positive multiple of kChunkAlignment or none can hold the largest
// tensor (the message names the size that would).
Result<ChunkSizeChoice> choose_chunk_size(std::span<const uint64_t> tensor_bytes,
                                          std::span<const uint64_t> candidates);

}  // namespace strata
