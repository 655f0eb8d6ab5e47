// Planning a save: headers, tensor order, aligned pieces and the region → piece index.
#include "ckpt/save_plan.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

namespace strata::ckpt {
namespace {

// One tensor (or slice of one) as placed in a file.
struct Placed {
  std::string qualified;
  const RegionTensor* tensor = nullptr;
  int region = 0;
  uint64_t nbytes = 0;
  uint64_t file_begin = 0;  // from the first data byte
  std::optional<HeaderSlice> slice;
  // The entry's shape in the file: the tensor's, or {count} for a slice.
  std::vector<int64_t> file_shape() const {
    return slice ? std::vector<int64_t>{static_cast<int64_t>(slice->count)} : tensor->shape;
  }
};

// Consecutive bytes of one region at consecutive file offsets.
struct Extent {
  uint64_t file_offset = 0;  // absolute
  uint64_t length = 0;
  int region = 0;
  uint64_t region_offset = 0;
  const char* data = nullptr;
};

Status tensor_error(const SaveRequest& r, int region, const RegionTensor& t, const std::string& what) {
  return Status::InvalidArgument("checkpoint step " + std::to_string(r.step) + ": tensor '" + t.name + "' (region " +
                                 std::to_string(region) + ") " + what);
}

// Plans file `index` from its tensors; appends pieces and spans.
void plan_file(int index, const std::string& name, std::vector<Placed>& placed, const SaveRequest& request,
               uint64_t piece_bytes, SavePlan* plan) {
  PlannedFile file;
  file.name = name;
  std::vector<HeaderEntry> entries;
  uint64_t pos = 0;
  for (Placed& p : placed) {
    p.file_begin = pos;
    entries.push_back(HeaderEntry{p.qualified, p.tensor->dtype, p.file_shape(), pos, pos + p.nbytes, p.slice});
    pos += p.nbytes;
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                 {"strata_step", std::to_string(request.step)},
                                                 {"strata_file", name}};
  file.header = build_safetensors_header(entries, metadata);
  file.data_start = file.header.size();
  file.size = file.data_start + pos;
  file.tensor_count = placed.size();
  file.tensors = entries;

  std::vector<Extent> extents;
  for (const Placed& p : placed) {
    if (p.nbytes == 0) continue;
    const Region& region = request.regions[p.region];
    const uint64_t file_offset = file.data_start + p.file_begin;
    if (!extents.empty()) {
      Extent& last = extents.back();
      if (last.region == p.region && last.region_offset + last.length == p.tensor->offset) {
        last.length += p.nbytes;
        continue;
      }
    }
    const char* data = region.data != nullptr ? static_cast<const char*>(region.data) + p.tensor->offset : nullptr;
    extents.push_back(Extent{file_offset, p.nbytes, p.region, p.tensor->offset, data});
  }

  file.first_piece = static_cast<int>(plan->pieces.size());
  // Header pieces.
  for (uint64_t off = 0; off < file.data_start; off += piece_bytes) {
    Piece piece;
    piece.file = index;
    piece.offset = off;
    piece.length = std::min(piece_bytes, file.data_start - off);
    piece.real = piece.length;
    plan->pieces.push_back(std::move(piece));
  }
  // Data pieces, cut at piece_bytes and at aligned extent starts.
  const uint64_t aligned_end = round_up(file.size, kFileAlign);
  size_t next_extent = 0;  // first extent that may start after the current piece start
  for (uint64_t start = file.data_start; start < aligned_end;) {
    uint64_t end = std::min(start + piece_bytes, aligned_end);
    while (next_extent < extents.size() && extents[next_extent].file_offset <= start) ++next_extent;
    for (size_t e = next_extent; e < extents.size() && extents[e].file_offset < end; ++e) {
      if (extents[e].file_offset % kFileAlign == 0) {
        end = extents[e].file_offset;
        break;
      }
    }
    Piece piece;
    piece.file = index;
    piece.offset = start;
    piece.length = end - start;
    piece.real = std::min(end, file.size) - start;
    plan->pieces.push_back(std::move(piece));
    start = end;
  }
  file.end_piece = static_cast<int>(plan->pieces.size());

  // Sources: header bytes, then extents intersected with each data piece.
  size_t e = 0;
  for (int i = file.first_piece; i < file.end_piece; ++i) {
    Piece& piece = plan->pieces[i];
    if (piece.offset < file.data_start) {
      piece.sources.push_back(PieceSource{nullptr, piece.length, 0, -1, 0});
      continue;
    }
    const uint64_t real_end = piece.offset + piece.real;
    while (e < extents.size() && extents[e].file_offset + extents[e].length <= piece.offset) ++e;
    for (size_t k = e; k < extents.size() && extents[k].file_offset < real_end; ++k) {
      const Extent& x = extents[k];
      const uint64_t b = std::max(x.file_offset, piece.offset);
      const uint64_t en = std::min(x.file_offset + x.length, real_end);
      const uint64_t into = b - x.file_offset;
      piece.sources.push_back(PieceSource{x.data != nullptr ? x.data + into : nullptr, en - b, b - piece.offset, x.region,
                                          x.region_offset + into});
    }
    piece.direct = piece.sources.size() == 1 && piece.sources[0].length == piece.length &&
                   piece.sources[0].data != nullptr &&
                   reinterpret_cast<uintptr_t>(piece.sources[0].data) % kFileAlign == 0;
    for (const PieceSource& s : piece.sources) {
      plan->region_spans[s.region].push_back(RegionSpan{s.region_offset, s.region_offset + s.length, i});
    }
  }
  plan->files.push_back(std::move(file));
}

}  // namespace

uint64_t piece_bytes_for_staging(uint64_t staging_bytes) {
  uint64_t piece = staging_bytes / 4 / kFileAlign * kFileAlign;
  return std::clamp<uint64_t>(piece, kFileAlign, 8 * kMiB);
}

Result<SavePlan> make_save_plan(const SaveRequest& request, uint64_t piece_bytes) {
  CHECK(piece_bytes % kFileAlign == 0 && piece_bytes > 0);
  std::vector<Placed> model, optimizer;
  std::set<std::string> names[2];
  for (int r = 0; r < static_cast<int>(request.regions.size()); ++r) {
    const Region& region = request.regions[r];
    if (region.data == nullptr && !region.read && region.size > 0) {
      return Status::InvalidArgument("checkpoint step " + std::to_string(request.step) + ": region " +
                                     std::to_string(r) + " has no memory");
    }
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const RegionTensor& t : region.tensors) {
      if (t.name.empty()) return tensor_error(request, r, t, "has no name");
      for (int64_t d : t.shape)
        if (d < 0) return tensor_error(request, r, t, "has a negative dimension");
      const std::optional<uint64_t> numel = checked_numel(t.shape);
      uint64_t nbytes = 0;
      if (!numel || __builtin_mul_overflow(*numel, dtype_size(t.dtype), &nbytes)) {
        return tensor_error(request, r, t, "has a shape whose byte count overflows");
      }
      std::optional<HeaderSlice> slice;
      if (t.slice) {
        const TensorSlice& s = *t.slice;
        if (s.count > *numel || s.first > *numel - s.count) {
          return tensor_error(request, r, t, "has a slice of " + std::to_string(s.count) + " elements from element " +
                                                 std::to_string(s.first) + ", past its " + std::to_string(*numel) +
                                                 " elements");
        }
        if (s.count == 0) continue;  // nothing of it is this writer's to save
        if (s.count < *numel) slice = HeaderSlice{s.first, s.count, t.shape};
        nbytes = s.count * dtype_size(t.dtype);
      }
      if (t.offset > region.size || nbytes > region.size - t.offset) {
        return tensor_error(request, r, t, "does not fit in its region (offset " + std::to_string(t.offset) + ", " +
                                               std::to_string(nbytes) + " bytes, region " +
                                               std::to_string(region.size) + " bytes)");
      }
      Placed p{qualified_name(region.kind, t.name), &t, r, nbytes, 0, std::move(slice)};
      const int f = region.kind == TensorKind::kParam ? 0 : 1;
      if (!names[f].insert(p.qualified).second) return tensor_error(request, r, t, "is saved twice");
      (f == 0 ? model : optimizer).push_back(std::move(p));
      if (nbytes > 0) ranges.emplace_back(t.offset, t.offset + nbytes);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) {
      if (ranges[i].first < ranges[i - 1].second) {
        return Status::InvalidArgument("checkpoint step " + std::to_string(request.step) + ": region " +
                                       std::to_string(r) + " has overlapping tensors at byte " +
                                       std::to_string(ranges[i].first));
      }
    }
  }
  auto order = [](const Placed& a, const Placed& b) {
    return a.region != b.region ? a.region < b.region : a.tensor->offset < b.tensor->offset;
  };
  std::sort(model.begin(), model.end(), order);
  std::sort(optimizer.begin(), optimizer.end(), order);

  SavePlan plan;
  plan.region_spans.resize(request.regions.size());
  const ShardedSave& shard = request.shard;
  plan_file(0, shard.sharded() ? shard_file_name(kModelFile, shard.rank, shard.world) : kModelFile, model, request,
            piece_bytes, &plan);
  plan_file(1, shard.sharded() ? shard_file_name(kOptimizerFile, shard.rank, shard.world) : kOptimizerFile,
            optimizer, request, piece_bytes, &plan);
  for (auto& spans : plan.region_spans) {
    std::sort(spans.begin(), spans.end(), [](const RegionSpan& a, const RegionSpan& b) { return a.begin < b.begin; });
  }
  return plan;
}

}  // namespace strata::ckpt
