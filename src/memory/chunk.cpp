#include "memory/chunk.h"

#include <algorithm>

#include "core/units.h"

namespace strata {

const char* chunk_kind_name(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParam:
      return "param";
    case ChunkKind::kGrad:
      return "grad";
    case ChunkKind::kMaster:
      return "master";
    case ChunkKind::kAdamM:
      return "adam_m";
    case ChunkKind::kAdamV:
      return "adam_v";
    case ChunkKind::kAct:
      return "act";
  }
  return "?";
}

ByteRange owned_range(uint64_t chunk_bytes, int rank, int world_size) {
  CHECK(world_size > 0 && rank >= 0 && rank < world_size);
  const uint64_t w = static_cast<uint64_t>(world_size);
  const uint64_t part = round_up((chunk_bytes + w - 1) / w, kTensorAlignment);
  const uint64_t begin = std::min(chunk_bytes, part * static_cast<uint64_t>(rank));
  return ByteRange{begin, std::min(chunk_bytes, begin + part)};
}

// ---------------------------------------------------------------------------------------------
// ChunkLayout

Result<ChunkLayout> ChunkLayout::create(uint64_t chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % kChunkAlignment != 0) {
    return Status::InvalidArgument("memory.chunk_size " + format_bytes(chunk_bytes) + " (" +
                                   std::to_string(chunk_bytes) +
                                   " bytes) must be a positive multiple of 4 KiB");
  }
  return ChunkLayout(chunk_bytes);
}

Status ChunkLayout::validate(const std::string& name, uint64_t bytes) const {
  if (by_name_.count(name) != 0) {
    return Status::InvalidArgument("tensor '" + name + "' is registered twice");
  }
  if (bytes > chunk_bytes_) {
    return Status::InvalidArgument(
        "tensor '" + name + "' (" + format_bytes(bytes) + ") is larger than a chunk (" +
        format_bytes(chunk_bytes_) + "); raise memory.chunk_size to at least " +
        format_bytes(round_up(bytes, kChunkAlignment)));
  }
  return Status::OK();
}

bool ChunkLayout::opens_chunk(ChunkKind kind, uint64_t bytes) const {
  const std::optional<ChunkId>& open = open_[static_cast<int>(kind)];
  if (!open) return true;
  return round_up(chunks_[*open].used_bytes, kTensorAlignment) + bytes > chunk_bytes_;
}

ChunkId ChunkLayout::open_chunk(ChunkKind kind) {
  const ChunkId id = static_cast<ChunkId>(chunks_.size());
  chunks_.push_back(ChunkInfo{kind, 0, {}});
  open_[static_cast<int>(kind)] = id;
  return id;
}

Result<TensorId> ChunkLayout::add(const std::string& name, ChunkKind kind, uint64_t bytes) {
  RETURN_IF_ERROR(validate(name, bytes));
  if (opens_chunk(kind, bytes)) open_chunk(kind);
  const ChunkId chunk = *open_[static_cast<int>(kind)];
  ChunkInfo& info = chunks_[chunk];
  const uint64_t offset = round_up(info.used_bytes, kTensorAlignment);
  const TensorId id = static_cast<TensorId>(tensors_.size());
  tensors_.push_back(TensorPlacement{name, kind, bytes, chunk, offset});
  info.used_bytes = offset + bytes;
  info.tensors.push_back(id);
  by_name_.emplace(name, id);
  tensor_bytes_ += bytes;
  return id;
}

const ChunkInfo& ChunkLayout::chunk(ChunkId id) const {
  CHECK(id < chunks_.size());
  return chunks_[id];
}

const TensorPlacement& ChunkLayout::tensor(TensorId id) const {
  CHECK(id < tensors_.size());
  return tensors_[id];
}

std::optional<TensorId> ChunkLayout::find(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

uint64_t ChunkLayout::padding_bytes() const {
  return chunks_.size() * chunk_bytes_ - tensor_bytes_;
}

// ---------------------------------------------------------------------------------------------
// Chunk size search

PackingResult pack_tensors(std::span<const uint64_t> tensor_bytes, uint64_t chunk_bytes) {
  PackingResult r;
  uint64_t used = 0;  // of the open chunk
  uint64_t total = 0;
  for (uint64_t bytes : tensor_bytes) {
    CHECK(bytes <= chunk_bytes);
    const uint64_t offset = round_up(used, kTensorAlignment);
    if (r.num_chunks == 0 || offset + bytes > chunk_bytes) {
      ++r.num_chunks;
      used = bytes;
    } else {
      used = offset + bytes;
    }
    total += bytes;
  }
  r.padding_bytes = r.num_chunks * chunk_bytes - total;
  return r;
}

std::vector<uint64_t> chunk_size_candidates(std::span<const uint64_t> tensor_bytes,
                                            uint64_t max_bytes, uint64_t step) {
  CHECK(step > 0 && step % kChunkAlignment == 0);
  uint64_t largest = 0;
  for (uint64_t bytes : tensor_bytes) largest = std::max(largest, bytes);
  std::vector<uint64_t> out;
  for (uint64_t size = std::max(step, round_up(largest, step)); size <= max_bytes; size += step) {
    out.push_back(size);
  }
  return out;
}

Result<ChunkSizeChoice> choose_chunk_size(std::span<const uint64_t> tensor_bytes,
                                          std::span<const uint64_t> candidates) {
  uint64_t largest = 0;
  for (uint64_t bytes : tensor_bytes) largest = std::max(largest, bytes);
  std::optional<ChunkSizeChoice> best;
  for (uint64_t size : candidates) {
    if (size == 0 || size % kChunkAlignment != 0) {
      return Status::InvalidArgument("candidate chunk size " + std::to_string(size) +
                                     " bytes is not a positive multiple of 4 KiB");
    }
    if (size < largest) continue;
    const PackingResult packed = pack_tensors(tensor_bytes, size);
    const bool better = !best || packed.padding_bytes < best->padding_bytes ||
                        (packed.padding_bytes == best->padding_bytes && size < best->chunk_bytes);
    if (better) best = ChunkSizeChoice{size, packed.num_chunks, packed.padding_bytes};
  }
  if (!best) {
    return Status::InvalidArgument("no candidate chunk size holds the largest tensor (" +
                                   format_bytes(largest) + "); allow chunk sizes of at least " +
                                   format_bytes(round_up(std::max<uint64_t>(largest, 1),
                                                         kChunkAlignment)));
  }
  return *best;
}

}  // namespace strata
