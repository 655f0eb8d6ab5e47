#include "offload/state_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <span>
#include <string>

#include "core/trace.h"
#include "core/round_up.h"

namespace strata {

namespace {

// A part smaller than 1/kOwnChunkFraction of a chunk shares chunks with its neighbours (so a
// part padded to chunks of its own wastes less than its size).
constexpr uint64_t kOwnChunkFraction = 2;

// The chunk size that wastes the least padding when each group's tensors are packed into
// chunks of their own, summed over the layout's kinds (a bf16 compute copy packs half as many
// bytes per group as the fp32 kinds); ties go to the smaller size (finer-grained paging).
// bytes[k][g]: the bytes of each tensor of part g in kind k; every chunk holds the largest.
uint64_t choose_group_chunk_bytes(const std::vector<std::vector<std::vector<uint64_t>>>& bytes) {
  uint64_t largest_tensor = 0, largest_group = 0;
  for (const auto& kind : bytes) {
    for (const auto& g : kind) {
      uint64_t sum = 0;
      for (uint64_t n : g) largest_tensor = std::max(largest_tensor, n), sum += round_up(n, kTensorAlignment);
      largest_group = std::max(largest_group, sum);
    }
  }
  const uint64_t lo = round_up(std::max<uint64_t>(largest_tensor, 1), kChunkAlignment);
  const uint64_t hi = std::max(lo, round_up(largest_group, kChunkAlignment));
  // At most ~256 candidates between the largest tensor and the largest group.
  const uint64_t step = std::max(kChunkAlignment, round_up((hi - lo) / 256 + 1, kChunkAlignment));
  uint64_t best = lo, best_padding = UINT64_MAX;
  for (uint64_t c = lo; c <= hi; c += step) {
    uint64_t padding = 0;
    for (const auto& kind : bytes)
      for (const auto& g : kind) padding += pack_tensors(std::span<const uint64_t>(g), c).padding_bytes;
    if (padding < best_padding) best = c, best_padding = padding;
  }
  return best;
}

}  // namespace

uint64_t StateStore::auto_chunk_bytes(const std::vector<StateTensor>& tensors, const StateLayout& layout) {
  // Each part is packed on its own, so the chunk size is chosen over parts.
  std::map<std::pair<int, int>, std::vector<size_t>> parts;  // (group, part) -> tensors
  for (size_t i = 0; i < tensors.size(); ++i) parts[{tensors[i].group, tensors[i].part}].push_back(i);
  std::vector<std::vector<std::vector<uint64_t>>> bytes;
  for (StateKind kind : layout.kinds()) {
    std::vector<std::vector<uint64_t>>& per_part = bytes.emplace_back();
    for (const auto& [key, members] : parts) {
      std::vector<uint64_t>& b = per_part.emplace_back();
      for (size_t i : members) b.push_back(layout.tensor_bytes(kind, tensors[i].shape()));
    }
  }
  return choose_group_chunk_bytes(bytes);
}

uint64_t StateStore::part_bytes_of(const std::vector<StateTensor>& tensors, const Part& part, const StateLayout& layout,
                                   StateKind kind, bool sliced) {
  uint64_t bytes = 0;
  for (size_t i : part.tensors) {
    // Counted as fp32 elements whatever the kind's format, so that a part pages alike in every
    // kind; but a frozen tensor has nothing beside its compute copy (an expert's LoRA factors
    // are a small part of its gradients and moments, next to its frozen weights).
    if (layout.tensor_bytes(kind, tensors[i].shape(sliced)) == 0) continue;
    bytes += round_up(tensors[i].held(sliced).count * sizeof(float), kTensorAlignment);
  }
  return bytes;
}

bool StateStore::opens_own_chunk(const std::vector<StateTensor>& tensors, const std::vector<Part>& parts, size_t pi,
                                 const StateLayout& layout, StateKind kind, bool sliced, uint64_t chunk_bytes) {
  if (pi == 0) return true;
  const uint64_t bytes = part_bytes_of(tensors, parts[pi], layout, kind, sliced);
  return bytes > 0 && bytes * kOwnChunkFraction >= chunk_bytes;
}

std::vector<std::vector<StateStore::Part>> StateStore::make_parts(const std::vector<StateTensor>& tensors,
                                                                 int num_groups) {
  std::vector<std::vector<Part>> out(static_cast<size_t>(num_groups), std::vector<Part>(1));  // each has its dense part
  for (size_t i = 0; i < tensors.size(); ++i) {
    const StateTensor& t = tensors[i];
    std::vector<Part>& parts = out[static_cast<size_t>(t.group)];
    auto it = std::lower_bound(parts.begin(), parts.end(), t.part, [](const Part& p, int id) { return p.id < id; });
    if (it == parts.end() || it->id != t.part) {
      it = parts.insert(it, Part{});
      it->id = t.part;
    }
    it->tensors.push_back(i);
  }
  return out;
}

Status StateStore::fill_order(const std::vector<uint64_t>& bytes, bool fills, const std::function<bool(uint64_t)>& opens,
                              const std::function<Status(size_t)>& pack) {
  // Largest first (ties in order), each time the largest left that fits the open chunk's tail,
  // else the largest left, which opens a chunk: the small ones stay for the tails.
  std::vector<size_t> left(bytes.size());
  for (size_t j = 0; j < left.size(); ++j) left[j] = j;
  if (fills) std::stable_sort(left.begin(), left.end(), [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  while (!left.empty()) {
    size_t at = 0;
    if (fills)
      for (size_t n = 0; n < left.size(); ++n)
        if (!opens(bytes[left[n]])) {
          at = n;
          break;
        }
    const size_t pick = left[at];
    left.erase(left.begin() + static_cast<std::ptrdiff_t>(at));
    RETURN_IF_ERROR(pack(pick));
  }
  return Status::OK();
}

bool StateStore::packs_small_group(const std::vector<StateTensor>& tensors, const std::vector<Part>& parts,
                                   const StateLayout& layout, StateKind kind, bool sliced, uint64_t chunk_bytes) {
  if (kind != StateKind::kMaster && kind != StateKind::kAdamM && kind != StateKind::kAdamV) return false;
  bool frozen = false;
  uint64_t bytes = 0;
  for (const Part& p : parts) {
    for (size_t i : p.tensors) frozen = frozen || tensors[i].frozen;
    bytes += part_bytes_of(tensors, p, layout, kind, sliced);
  }
  return frozen && bytes * kOwnChunkFraction < chunk_bytes;
}

bool StateStore::continues_group(int g, StateKind kind, bool sliced, const HomeOf& home, std::optional<Tier> last) {
  if (!sliced || g == 0) return false;
  return !home || last == home(g, kind, kDensePart);
}

StateStore::Packing::Packing(const std::vector<StateTensor>& tensors, uint64_t chunk_bytes, const StateLayout& layout,
                             StateKind kind, bool sliced)
    : chunk_bytes_(chunk_bytes), kind_(kind), sliced_(sliced) {
  CHECK_MSG(chunk_bytes > 0 && chunk_bytes % kChunkAlignment == 0, "chunk size " + std::to_string(chunk_bytes));
  int num_groups = 0;
  for (const StateTensor& t : tensors) num_groups = std::max(num_groups, t.group + 1);
  const std::vector<std::vector<Part>> parts = make_parts(tensors, num_groups);
  groups_.resize(parts.size());
  small_.resize(parts.size());
  for (size_t g = 0; g < parts.size(); ++g) {
    small_[g] = packs_small_group(tensors, parts[g], layout, kind, sliced, chunk_bytes);
    for (const Part& p : parts[g])
      packs_small_trained_ = packs_small_trained_ || (small_[g] && part_bytes_of(tensors, p, layout, kind, sliced) > 0);
    for (size_t pi = 0; pi < parts[g].size(); ++pi) {
      PartBytes& p = groups_[g].emplace_back();
      p.id = parts[g][pi].id;
      p.opens_own = pi > 0 && opens_own_chunk(tensors, parts[g], pi, layout, kind, sliced, chunk_bytes);
      for (size_t i : parts[g][pi].tensors) {
        const uint64_t bytes = layout.tensor_bytes(kind, tensors[i].shape(sliced));
        CHECK_MSG(bytes <= chunk_bytes, "tensor '" + tensors[i].name + "' does not fit a chunk");
        p.bytes.push_back(bytes);
      }
    }
  }
}

std::vector<std::vector<StateStore::PartChunks>> StateStore::Packing::count(const HomeOf& home) const {
  // The packing create() does for one kind (ChunkLayout::add's rule: each tensor after the last
  // at the next kTensorAlignment boundary, or at the start of a new chunk when it does not fit),
  // counted without building a layout.
  std::vector<std::vector<PartChunks>> out(groups_.size());
  uint64_t chunks = 0, used = 0;  // chunks so far; bytes used of the last
  std::optional<Tier> last;       // the asked home of the part that opened the last chunk
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int group = static_cast<int>(g);
    for (size_t pi = 0; pi < groups_[g].size(); ++pi) {
      const PartBytes& part = groups_[g][pi];
      const uint64_t before = chunks;
      const bool own = pi == 0 ? !continues_group(group, kind_, sliced_ || small_[g], home, last) : part.opens_own;
      if (own) ++chunks, used = 0;
      const auto opens = [&](uint64_t bytes) {
        return chunks == 0 || round_up(used, kTensorAlignment) + bytes > chunk_bytes_;
      };
      const Status packed = fill_order(part.bytes, sliced_, opens, [&](size_t j) {
        const uint64_t bytes = part.bytes[j];
        if (opens(bytes)) ++chunks, used = bytes;
        else used = round_up(used, kTensorAlignment) + bytes;
        return Status::OK();
      });
      CHECK(packed.ok());
      if (chunks > before && home) last = home(group, kind_, part.id);
      out[g].push_back({part.id, chunks - before, own});
    }
  }
  return out;
}

std::vector<std::vector<StateStore::PartChunks>> StateStore::part_chunks(const std::vector<StateTensor>& tensors,
                                                                        uint64_t chunk_bytes, const StateLayout& state,
                                                                        StateKind kind, bool sliced, const HomeOf& home) {
  return Packing(tensors, chunk_bytes, state, kind, sliced).count(home);
}

std::vector<uint64_t> StateStore::group_chunks(const std::vector<StateTensor>& tensors, uint64_t chunk_bytes,
                                               const StateLayout& state, StateKind kind, bool sliced,
                                               const HomeOf& home) {
  std::vector<uint64_t> out;
  for (const std::vector<PartChunks>& group : part_chunks(tensors, chunk_bytes, state, kind, sliced, home)) {
    uint64_t n = 0;
    for (const PartChunks& p : group) n += p.chunks;
    out.push_back(n);
  }
  return out;
}

Result<std::unique_ptr<StateStore>> StateStore::create(Device& device, IoEngine* io, std::vector<StateTensor> tensors,
                                                       const StateStoreOptions& options) {
  std::unique_ptr<StateStore> s(new StateStore());
  for (const auto& t : tensors) {
    if (t.group < 0 || t.elements == 0)
      return Status::InvalidArgument("state tensor '" + t.name + "' has no elements or a negative group");
    if (t.part < kDensePart)
      return Status::InvalidArgument("state tensor '" + t.name + "' names part " + std::to_string(t.part) +
                                     " (parts are >= 0, or kDensePart)");
    s->num_groups_ = std::max(s->num_groups_, t.group + 1);
  }
  s->tensors_ = std::move(tensors);
  s->lookahead_ = options.lookahead;
  s->group_tensors_.resize(s->num_groups_);
  for (size_t i = 0; i < s->tensors_.size(); ++i) s->group_tensors_[s->tensors_[i].group].push_back(i);
  s->parts_ = make_parts(s->tensors_, s->num_groups_);
  ChunkSpaceOptions so = options.space;
  if (so.chunk_bytes == 0) so.chunk_bytes = auto_chunk_bytes(s->tensors_, options.layout);
  s->demand_stream_ = device.create_stream();
  ASSIGN_OR_RETURN(s->space_, ChunkSpace::create(device, io, so));

  s->ids_.resize(s->tensors_.size());
  s->layout_ = options.layout;
  s->ptrs_.assign(s->tensors_.size(), std::array<void*, kNumStateKinds>{});
  s->homes_.resize(static_cast<size_t>(s->num_groups_) * kNumStateKinds, Tier::kHost);
  s->sliced_.assign(static_cast<size_t>(s->num_groups_) * kNumStateKinds, false);
  for (const StateKind kind : s->layout_.kinds()) {
    const int k = static_cast<int>(kind);
    std::optional<ChunkId> last_chunk;  // the kind's last chunk so far
    std::optional<Tier> last_asked;     // the home asked by the part that opened it
    for (int g = 0; g < s->num_groups_; ++g) {
      const bool sliced = options.sliced && options.sliced(g, kind);
      s->sliced_[static_cast<size_t>(g) * kNumStateKinds + static_cast<size_t>(k)] = sliced;
      std::optional<Tier> home;
      // A home tier that is already full falls back to the tiers below it (for the rest of the
      // group's parts asked to live there too). A failed attempt leaves the layout as it was,
      // so it can be retried.
      std::optional<Tier> asked, fell_to;
      auto home_of = [&](int part) -> std::optional<Tier> {
        if (!options.home) return std::nullopt;
        const Tier want = options.home(g, kind, part);
        if (asked != want) asked = want, fell_to = want;
        return fell_to;
      };
      auto with_fallback = [&](auto add) {
        auto added = add();
        while (!added.ok() && added.status().code() == StatusCode::kOutOfMemory && home && *home != Tier::kNvme) {
          home = static_cast<Tier>(static_cast<int>(*home) + 1);
          if (s->space_->has_tier(*home)) added = add();
        }
        fell_to = home;
        return added;
      };
      const bool small = packs_small_group(s->tensors_, s->parts_[g], s->layout_, kind, sliced, so.chunk_bytes);
      for (size_t pi = 0; pi < s->parts_[g].size(); ++pi) {
        Part& part = s->parts_[g][pi];
        home = home_of(part.id);
        std::vector<ChunkId>& chunks = part.chunks[k];
        // The group's first part opens a chunk (but a group's slices continue where the group
        // before them ended, when homed alike: "Slices" in the header); a part of at least
        // 1/kOwnChunkFraction of a chunk opens one too, so it pages alone. Smaller parts (experts
        // far smaller than the largest tensor) share chunks with the part before them, rather
        // than each padding a chunk of its own: fetching one then brings its neighbours along.
        // Asked homes are compared, as Packing::count does: a tier that was full for the chunk
        // before is full for this group's too, which would fall back alike.
        const bool own = pi == 0 ? !continues_group(g, kind, sliced || small, options.home, last_asked)
                                 : opens_own_chunk(s->tensors_, s->parts_[g], pi, s->layout_, kind, sliced,
                                                   so.chunk_bytes);
        const size_t chunks_before = s->space_->num_chunks();
        if (own) {
          ASSIGN_OR_RETURN(ChunkId first, with_fallback([&] { return s->space_->add_chunk(kind, home); }));
          chunks.push_back(first);
        }
        std::vector<uint64_t> bytes;
        for (size_t i : part.tensors) bytes.push_back(s->layout_.tensor_bytes(kind, s->tensors_[i].shape(sliced)));
        RETURN_IF_ERROR(fill_order(
            bytes, sliced, [&](uint64_t b) { return s->space_->opens_chunk(kind, b); },
            [&](size_t j) -> Status {
              const size_t i = part.tensors[j];
              // A tensor that opens a chunk of its own (past the end of the current one) falls back too.
              ASSIGN_OR_RETURN(TensorId id, with_fallback([&] {
                                 return s->space_->add_tensor(
                                     std::string(state_kind_name(kind)) + "/" + s->tensors_[i].name, kind, bytes[j], home);
                               }));
              s->ids_[i][k] = id;
              const ChunkId c = s->space_->tensor(id).chunk;
              if (std::find(chunks.begin(), chunks.end(), c) == chunks.end()) chunks.push_back(c);
              return Status::OK();
            }));
        if (!chunks.empty()) last_chunk = chunks.back();
        if (options.home && s->space_->num_chunks() > chunks_before) last_asked = options.home(g, kind, part.id);
      }
      const std::vector<ChunkId>& dense = s->parts_[g].front().chunks[k];
      CHECK_MSG(!dense.empty() || last_chunk, "a group without a chunk of its own or before it");
      s->homes_[g * kNumStateKinds + k] = s->space_->home(dense.empty() ? *last_chunk : dense.front());
    }
  }
  // Chunks holding more than one part, or parts of more than one group (counted per kind: a
  // chunk holds one kind).
  std::vector<int> parts_in(s->space_->num_chunks(), 0), first_group(s->space_->num_chunks(), -1);
  s->shared_by_groups_.assign(parts_in.size(), false);
  for (int g = 0; g < s->num_groups_; ++g)
    for (const Part& p : s->parts_[g])
      for (const auto& chunks : p.chunks)
        for (ChunkId c : chunks) {
          ++parts_in[c];
          if (first_group[c] < 0) first_group[c] = g;
          if (first_group[c] != g) s->shared_by_groups_[c] = true;
        }
  s->make_slices();
  s->state_chunks_ = parts_in.size();  // activation buffers are added later
  s->shared_.resize(parts_in.size());
  for (size_t c = 0; c < parts_in.size(); ++c) s->shared_[c] = parts_in[c] > 1;
  return s;
}

void StateStore::make_slices() {
  slices_.assign(static_cast<size_t>(num_groups_), {});
  const std::vector<StateKind> kinds = layout_.kinds();
  for (int g = 0; g < num_groups_; ++g) {
    std::vector<Slice>& slices = slices_[static_cast<size_t>(g)];
    for (size_t i : group_tensors_[g]) {
      // Its chunk of each kind it holds some of; it joins the slice when each is the slice's.
      std::array<std::optional<ChunkId>, kNumStateKinds> at;
      bool joins = !slices.empty();
      for (StateKind kind : kinds) {
        const int k = static_cast<int>(kind);
        if (layout_.tensor_bytes(kind, tensors_[i].shape(sliced(g, kind))) == 0) continue;
        at[k] = space_->tensor(ids_[i][k]).chunk;
        if (joins && !slices.back().chunks[k].empty() && slices.back().chunks[k].front() != *at[k]) joins = false;
      }
      if (!joins) slices.emplace_back();
      slices.back().tensors.push_back(i);
      for (StateKind kind : kinds) {
        const int k = static_cast<int>(kind);
        if (at[k] && slices.back().chunks[k].empty()) slices.back().chunks[k].push_back(*at[k]);
      }
    }
    if (slices.empty()) slices.emplace_back();
  }
}

Status StateStore::acquire_slice(int group, int slice, StateKind kind, Tier where, AccessMode mode,
                                 ScheduleCursor cursor, Stream* consumer) {
  CHECK(group >= 0 && group < num_groups_);
  CHECK_MSG(layout_.has(kind), std::string("this layout holds no ") + state_kind_name(kind) + " state");
  const int k = static_cast<int>(kind);
  Slice& sl = slices_[static_cast<size_t>(group)].at(static_cast<size_t>(slice));
  CHECK_MSG(!sl.pinned[k], "update slice " + std::to_string(slice) + " of group " + std::to_string(group) +
                               " acquired twice");
  const std::optional<size_t> entry =
      cursor == ScheduleCursor::kFollow ? next_entry(GroupAccess::of_slice(group, kind, slice)) : std::nullopt;
  std::vector<void*> bases;
  for (ChunkId c : sl.chunks[k]) {
    if (entry) space_->advance(schedule_chunk_start_[*entry] + bases.size());
    // The chunk may hold other slices' tensors: it is never overwritten whole.
    const AccessMode chunk_mode = mode == AccessMode::kWrite ? AccessMode::kReadWrite : mode;
    Result<void*> base = space_->acquire_chunk(c, where, chunk_mode, consumer);
    Status st = base.status();
    if (st.ok() && entry && lookahead_ > 0) st = space_->prefetch(lookahead_ * sl.chunks[k].size(), where);
    if (!st.ok()) {
      if (base.ok()) space_->release_chunk(c, consumer);
      return st;
    }
    bases.push_back(*base);
  }
  for (size_t i : sl.tensors) {
    if (layout_.tensor_bytes(kind, tensors_[i].shape(sliced(group, kind))) == 0) continue;
    ptrs_[i][k] = static_cast<char*>(bases.front()) + space_->tensor(ids_[i][k]).offset;
  }
  sl.pinned[k] = true;
  return Status::OK();
}

Status StateStore::send_slice_home(int group, int slice, StateKind kind, Tier where) {
  const int k = static_cast<int>(kind);
  const std::vector<Slice>& slices = slices_[static_cast<size_t>(group)];
  const Slice& sl = slices.at(static_cast<size_t>(slice));
  CHECK_MSG(!sl.pinned[k], "update slice " + std::to_string(slice) + " of group " + std::to_string(group) +
                               " sent home while acquired");
  const std::vector<ChunkId>* next =
      static_cast<size_t>(slice) + 1 < slices.size() ? &slices[static_cast<size_t>(slice) + 1].chunks[k] : nullptr;
  for (ChunkId c : sl.chunks[k]) {
    if (next != nullptr && std::find(next->begin(), next->end(), c) != next->end()) continue;
    RETURN_IF_ERROR(space_->send_home(c, where));
  }
  return Status::OK();
}

void StateStore::release_slice(int group, int slice, StateKind kind, Stream* consumer) {
  const int k = static_cast<int>(kind);
  Slice& sl = slices_[static_cast<size_t>(group)].at(static_cast<size_t>(slice));
  CHECK_MSG(sl.pinned[k], "release of update slice " + std::to_string(slice) + " of group " + std::to_string(group) +
                              ", which is not acquired");
  for (ChunkId c : sl.chunks[k]) space_->release_chunk(c, consumer);
  for (size_t i : sl.tensors) ptrs_[i][k] = nullptr;
  sl.pinned[k] = false;
}

void StateStore::discard(int group, int slice, StateKind kind) {
  const int k = static_cast<int>(kind);
  std::vector<ChunkId> chunks;
  // The chunks later slices hold: a chunk packs the group's parts, not its tensors, in order,
  // so slices far apart may share one.
  std::vector<ChunkId> later;
  if (slice >= 0) {
    const std::vector<Slice>& slices = slices_[static_cast<size_t>(group)];
    const Slice& sl = slices.at(static_cast<size_t>(slice));
    CHECK_MSG(!sl.pinned[k], "update slice " + std::to_string(slice) + " of group " + std::to_string(group) +
                                 " discarded while acquired");
    chunks = sl.chunks[k];
    for (size_t s = static_cast<size_t>(slice) + 1; s < slices.size(); ++s)
      later.insert(later.end(), slices[s].chunks[k].begin(), slices[s].chunks[k].end());
  } else {
    for (const Part& p : parts_[group]) {
      CHECK_MSG(!p.pinned[k], "group " + std::to_string(group) + " discarded while acquired");
      chunks.insert(chunks.end(), p.chunks[k].begin(), p.chunks[k].end());
    }
  }
  for (ChunkId c : chunks) {
    if (shared_by_groups_[c]) continue;
    if (std::find(later.begin(), later.end(), c) != later.end()) continue;
    space_->discard(c);
  }
}

bool StateStore::zero_by_discard(int group, StateKind kind) {
  const int k = static_cast<int>(kind);
  for (const Part& p : parts_[group])
    for (ChunkId c : p.chunks[k])
      if (shared_by_groups_[c]) return false;
  discard(group, kWholeGroup, kind);
  return true;
}

Tier StateStore::home(int group, StateKind kind) const { return homes_[group * kNumStateKinds + static_cast<int>(kind)]; }

std::vector<int> StateStore::parts(int group) const {
  std::vector<int> out;
  for (const Part& p : parts_.at(static_cast<size_t>(group)))
    if (p.id != kDensePart) out.push_back(p.id);
  return out;
}

Tier StateStore::part_home(int group, int part, StateKind kind) const {
  const std::vector<ChunkId>& chunks = parts_.at(static_cast<size_t>(group))[part_index(group, part)].chunks[static_cast<int>(kind)];
  return chunks.empty() ? home(group, kind) : space_->home(chunks.front());  // a part another rank owns holds none
}

size_t StateStore::part_index(int group, int part) const {
  CHECK(group >= 0 && group < num_groups_);
  const std::vector<Part>& parts = parts_[group];
  auto it = std::lower_bound(parts.begin(), parts.end(), part, [](const Part& p, int id) { return p.id < id; });
  CHECK_MSG(it != parts.end() && it->id == part,
            "group " + std::to_string(group) + " has no part " + std::to_string(part));
  return static_cast<size_t>(it - parts.begin());
}

std::vector<size_t> StateStore::part_indices(int group, std::span<const int> parts) const {
  std::vector<size_t> out;
  for (size_t j = 0; j < parts.size(); ++j) {
    CHECK_MSG(j == 0 || parts[j - 1] < parts[j], "parts must be ascending, without repeats");
    out.push_back(part_index(group, parts[j]));
  }
  return out;
}

void StateStore::set_schedule(const std::vector<GroupAccess>& accesses) {
  schedule_ = accesses;
  schedule_chunk_start_.clear();
  std::vector<ChunkId> order;
  std::vector<Tier> tiers;
  for (const GroupAccess& a : accesses) {
    CHECK_MSG(a.slice >= kWholeGroup, "a schedule with an update not expanded into its slices (expand_update_slices)");
    schedule_chunk_start_.push_back(order.size());
    if (a.activation >= 0) {
      CHECK_MSG(a.activation < num_activations(), "schedule names an activation buffer that does not exist");
      for (ChunkId c : act_chunks_[a.activation]) order.push_back(c);
    } else if (a.slice >= 0) {
      for (ChunkId c : slices_.at(static_cast<size_t>(a.group)).at(static_cast<size_t>(a.slice)).chunks[static_cast<int>(a.kind)])
        order.push_back(c);
    } else if (a.part != kAllParts) {
      for (ChunkId c : parts_[a.group][part_index(a.group, a.part)].chunks[static_cast<int>(a.kind)]) order.push_back(c);
    } else {
      for (const Part& p : parts_[a.group])
        for (ChunkId c : p.chunks[static_cast<int>(a.kind)]) order.push_back(c);
    }
    // Activation entries keep the device default, which prefetch skips for kAct chunks: they
    // are written before they are read, so reading them ahead would be wasted I/O. Entries
    // not to prefetch name nvme, which prefetch never moves chunks to.
    tiers.resize(order.size(), a.prefetch ? a.prefetch_to : Tier::kNvme);
  }
  schedule_pos_ = 0;
  space_->set_schedule(std::move(order), std::move(tiers));
}

Status StateStore::pin(int group, const std::vector<size_t>& parts, StateKind kind, Tier where, AccessMode mode,
                       std::optional<size_t> entry, Stream* consumer, bool wait_on_host) {
  const int k = static_cast<int>(kind);
  std::vector<Part>& ps = parts_[group];
  for (size_t p : parts) CHECK_MSG(!ps[p].pinned[k], "part " + std::to_string(ps[p].id) + " of group " +
                                                         std::to_string(group) + " acquired twice");
  std::vector<ChunkId> chunks;
  std::vector<void*> bases;
  Status st = Status::OK();
  // Overwriting a whole chunk is only allowed to the caller of every part it holds (of one group).
  const bool every_part = parts.size() == ps.size();
  for (size_t p : parts) {
    for (ChunkId c : ps[p].chunks[k]) {
      if (entry) space_->advance(schedule_chunk_start_[*entry] + chunks.size());
      const bool others = shared_by_groups_[c] || (shared_[c] && !every_part);
      const AccessMode chunk_mode = mode == AccessMode::kWrite && others ? AccessMode::kReadWrite : mode;
      Result<void*> base = space_->acquire_chunk(c, where, chunk_mode, consumer);
      if (!base.ok()) {
        st = base.status();
        break;
      }
      chunks.push_back(c);
      bases.push_back(*base);
    }
    if (!st.ok()) break;
  }
  if (consumer != nullptr && wait_on_host) {
    // Every move started above has landed afterwards; the wait is compute stalled on data.
    const auto start = std::chrono::steady_clock::now();
    trace::Span stall("stall", "wait for experts");
    consumer->synchronize();
    stall.end();
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
    demand_stall_ns_[static_cast<int>(where)] += static_cast<uint64_t>(waited.count());
  }
  if (st.ok() && entry && lookahead_ > 0) st = space_->prefetch(lookahead_ * chunks.size(), where);
  if (!st.ok()) {
    for (ChunkId c : chunks) space_->release_chunk(c, consumer);
    return st;
  }
  for (size_t p : parts) {
    for (size_t i : ps[p].tensors) {
      const TensorPlacement tp = space_->tensor(ids_[i][k]);
      const size_t j = std::find(chunks.begin(), chunks.end(), tp.chunk) - chunks.begin();
      ptrs_[i][k] = static_cast<char*>(bases[j]) + tp.offset;
    }
    ps[p].pinned[k] = true;
  }
  return Status::OK();
}

void StateStore::unpin(int group, const std::vector<size_t>& parts, StateKind kind, Stream* consumer) {
  const int k = static_cast<int>(kind);
  for (size_t p : parts) {
    Part& part = parts_[group][p];
    CHECK_MSG(part.pinned[k], "release of part " + std::to_string(part.id) + " of group " + std::to_string(group) +
                                  ", which is not acquired");
    for (ChunkId c : part.chunks[k]) space_->release_chunk(c, consumer);
    for (size_t i : part.tensors) ptrs_[i][k] = nullptr;
    part.pinned[k] = false;
  }
}

Status StateStore::acquire_group(int group, StateKind kind, Tier where, AccessMode mode, ScheduleCursor cursor,
                                 Stream* consumer) {
  CHECK(group >= 0 && group < num_groups_);
  CHECK_MSG(layout_.has(kind), std::string("this layout holds no ") + state_kind_name(kind) + " state");
  std::vector<size_t> all(parts_[group].size());
  for (size_t p = 0; p < all.size(); ++p) all[p] = p;
  // Where this access sits in the step's schedule (the next matching entry).
  const std::optional<size_t> entry =
      cursor == ScheduleCursor::kFollow ? next_entry(GroupAccess{group, kind}) : std::nullopt;
  return pin(group, all, kind, where, mode, entry, consumer, false);
}

void StateStore::release_group(int group, StateKind kind, Stream* consumer) {
  std::vector<size_t> all(parts_[group].size());
  for (size_t p = 0; p < all.size(); ++p) all[p] = p;
  unpin(group, all, kind, consumer);
}

Status StateStore::acquire_part(int group, int part, StateKind kind, Tier where, AccessMode mode, Stream* consumer,
                                bool follow) {
  const std::vector<size_t> parts{part_index(group, part)};
  const std::optional<size_t> entry =
      follow ? next_entry(GroupAccess::of_part(group, kind, part)) : std::optional<size_t>();
  return pin(group, parts, kind, where, mode, entry, consumer, /*wait_on_host=*/false);
}

Status StateStore::pass_part(int group, int part, StateKind kind, Tier where) {
  const std::optional<size_t> entry = next_entry(GroupAccess::of_part(group, kind, part));
  if (!entry) return Status::OK();
  const size_t chunks = parts_[group][part_index(group, part)].chunks[static_cast<int>(kind)].size();
  if (chunks == 0) return Status::OK();
  space_->advance(schedule_chunk_start_[*entry] + chunks - 1);  // as acquire_part leaves it
  return lookahead_ > 0 ? space_->prefetch(lookahead_ * chunks, where) : Status::OK();
}

void StateStore::release_part(int group, int part, StateKind kind, Stream* consumer) {
  unpin(group, {part_index(group, part)}, kind, consumer);
}

Status StateStore::acquire_parts(int group, std::span<const int> parts, StateKind kind, Tier where, AccessMode mode,
                                 Stream* consumer) {
  // Without a consumer the moves are ordered on the demand stream, which the host then waits for.
  Stream* stream = consumer != nullptr ? consumer : demand_stream_.get();
  return pin(group, part_indices(group, parts), kind, where, mode, std::nullopt, stream,
             /*wait_on_host=*/consumer == nullptr);
}

void StateStore::release_parts(int group, std::span<const int> parts, StateKind kind, Stream* consumer) {
  unpin(group, part_indices(group, parts), kind, consumer != nullptr ? consumer : demand_stream_.get());
}

std::optional<size_t> StateStore::next_entry(const GroupAccess& access) {
  std::optional<size_t> entry;
  std::lock_guard<std::mutex> lock(schedule_mu_);
  for (size_t n = 0; n < schedule_.size(); ++n) {
    const size_t i = (schedule_pos_ + n) % schedule_.size();
    if (schedule_[i] == access && schedule_[i].cursor == ScheduleCursor::kFollow) {
      entry = i;
      break;
    }
  }
  if (entry) schedule_pos_ = (*entry + 1) % schedule_.size();
  return entry;
}

namespace {

// Buffers of `bytes` one chunk holds whole (0: a buffer is larger than a chunk).
uint64_t buffers_per_chunk(uint64_t bytes, uint64_t chunk_bytes) {
  // Buffer k starts at k strides (tensors start at kTensorAlignment multiples) and must end
  // inside the chunk.
  return bytes > chunk_bytes ? 0 : (chunk_bytes - bytes) / round_up(bytes, kTensorAlignment) + 1;
}

}  // namespace

uint64_t StateStore::activation_chunks(int count, uint64_t bytes, uint64_t chunk_bytes) {
  if (count <= 0 || bytes == 0) return 0;
  const uint64_t n = static_cast<uint64_t>(count), per_chunk = buffers_per_chunk(bytes, chunk_bytes);
  return per_chunk > 0 ? (n + per_chunk - 1) / per_chunk : n * ((bytes + chunk_bytes - 1) / chunk_bytes);
}

Status StateStore::add_activations(int count, uint64_t bytes, int64_t host_chunks) {
  if (!act_chunks_.empty()) return Status::InvalidArgument("activation buffers are already registered");
  if (count <= 0) return Status::OK();
  if (bytes == 0) return Status::InvalidArgument("activation buffers need at least one byte");
  if (!space_->has_tier(Tier::kHost)) return Status::InvalidArgument("activation offload needs a host memory tier");
  const uint64_t piece_bytes = space_->chunk_bytes();
  const uint64_t per_chunk = buffers_per_chunk(bytes, piece_bytes);
  if (host_chunks >= 0 && static_cast<uint64_t>(host_chunks) < activation_chunks(count, bytes, piece_bytes) &&
      !space_->has_tier(Tier::kNvme))
    return Status::InvalidArgument("the placement homes saved activations on nvme, but there is no nvme tier");
  // A chunk homed in host memory or, when that is full or the placement says so, on NVMe.
  int64_t opened_chunks = 0;
  auto add_chunk = [&]() -> Result<ChunkId> {
    if (host_chunks >= 0 && opened_chunks++ >= host_chunks) return space_->add_chunk(ChunkKind::kAct, Tier::kNvme);
    Result<ChunkId> added = space_->add_chunk(ChunkKind::kAct, Tier::kHost);
    if (!added.ok() && added.status().code() == StatusCode::kOutOfMemory && space_->has_tier(Tier::kNvme))
      added = space_->add_chunk(ChunkKind::kAct, Tier::kNvme);
    return added;
  };
  std::vector<std::vector<ChunkId>> chunks(static_cast<size_t>(count));
  std::vector<uint64_t> offsets(static_cast<size_t>(count), 0);
  for (int i = 0; i < count; ++i) {
    if (per_chunk > 0) {
      // Whole buffers packed: a new chunk for every per_chunk-th.
      std::optional<ChunkId> opened;
      if (static_cast<uint64_t>(i) % per_chunk == 0) {
        ASSIGN_OR_RETURN(opened, add_chunk());
      }
      ASSIGN_OR_RETURN(TensorId id, space_->add_tensor("act/" + std::to_string(i), ChunkKind::kAct, bytes));
      CHECK(!opened || space_->tensor(id).chunk == *opened);
      CHECK(static_cast<uint64_t>(i) % per_chunk != 0 || space_->tensor(id).offset == 0);
      chunks[static_cast<size_t>(i)].push_back(space_->tensor(id).chunk);
      offsets[static_cast<size_t>(i)] = space_->tensor(id).offset;
      continue;
    }
    for (uint64_t done = 0, p = 0; done < bytes; done += piece_bytes, ++p) {
      const uint64_t n = std::min(piece_bytes, bytes - done);
      ASSIGN_OR_RETURN(ChunkId c, add_chunk());
      ASSIGN_OR_RETURN(TensorId id, space_->add_tensor("act/" + std::to_string(i) + "/" + std::to_string(p),
                                                       ChunkKind::kAct, n));
      CHECK(space_->tensor(id).chunk == c && space_->tensor(id).offset == 0);
      chunks[static_cast<size_t>(i)].push_back(c);
    }
  }
  act_chunks_ = std::move(chunks);
  act_offsets_ = std::move(offsets);
  act_bytes_ = bytes;
  act_per_chunk_ = std::max<uint64_t>(per_chunk, 1);
  return Status::OK();
}

Status StateStore::copy_activation(int i, char* data, uint64_t bytes, bool to_store) {
  if (i < 0 || i >= num_activations())
    return Status::InvalidArgument("no activation buffer " + std::to_string(i));
  if (bytes > act_bytes_)
    return Status::InvalidArgument("activation buffer " + std::to_string(i) + " holds " + std::to_string(act_bytes_) +
                                   " bytes, not " + std::to_string(bytes));
  const std::optional<size_t> entry = next_entry(GroupAccess::of_activation(i));
  const uint64_t piece_bytes = space_->chunk_bytes();
  const std::vector<ChunkId>& chunks = act_chunks_[static_cast<size_t>(i)];
  for (size_t j = 0; j < chunks.size() && j * piece_bytes < bytes; ++j) {
    const uint64_t n = std::min(piece_bytes, bytes - j * piece_bytes);
    if (entry) space_->advance(schedule_chunk_start_[*entry] + j);
    // A piece written is written whole (the tail past `bytes` is never read back), unless other
    // buffers share its chunk: those are kept.
    const AccessMode write = act_per_chunk_ > 1 ? AccessMode::kReadWrite : AccessMode::kWrite;
    ASSIGN_OR_RETURN(void* p, space_->acquire_chunk(chunks[j], Tier::kHost, to_store ? write : AccessMode::kRead));
    char* chunk = static_cast<char*>(p) + act_offsets_[static_cast<size_t>(i)];
    if (data == nullptr) {
      // The chunks' moves only (the planner's replay): nothing to copy.
    } else if (to_store) {
      std::memcpy(chunk, data + j * piece_bytes, n);
    } else {
      std::memcpy(data + j * piece_bytes, chunk, n);
    }
    space_->release_chunk(chunks[j]);
  }
  return Status::OK();
}

Status StateStore::write_activation(int i, const void* data, uint64_t bytes) {
  return copy_activation(i, static_cast<char*>(const_cast<void*>(data)), bytes, /*to_store=*/true);
}

Status StateStore::read_activation(int i, void* data, uint64_t bytes) {
  return copy_activation(i, static_cast<char*>(data), bytes, /*to_store=*/false);
}

ChunkSpaceStats StateStore::stats() const {
  ChunkSpaceStats s = space_->stats();
  for (int t = 0; t < kNumTiers; ++t) s.tiers[t].stall_ns += demand_stall_ns_[t].load();
  return s;
}

void* StateStore::raw_pointer(size_t i, StateKind kind) const {
  void* p = ptrs_[i][static_cast<int>(kind)];
  CHECK_MSG(p != nullptr, "tensor " + tensors_[i].name + " is not acquired for " + state_kind_name(kind));
  return p;
}

float* StateStore::pointer(size_t i, StateKind kind) const {
  CHECK_MSG(layout_.is_f32(kind), std::string("the ") + state_kind_name(kind) + " state is not fp32 in this layout");
  return static_cast<float*>(raw_pointer(i, kind));
}

Status StateStore::read_tensor(size_t i, StateKind kind, uint64_t first, uint64_t count, float* dst) {
  CHECK(i < ids_.size());
  CHECK_MSG(layout_.is_f32(kind),
            std::string("read_tensor of ") + state_kind_name(kind) + ", which is not fp32 in this layout");
  return space_->read_tensor(ids_[i][static_cast<int>(kind)], first * sizeof(float), count * sizeof(float), dst);
}

Status StateStore::read_tensor_bytes(size_t i, StateKind kind, uint64_t first, uint64_t count, void* dst) {
  CHECK(i < ids_.size());
  return space_->read_tensor(ids_[i][static_cast<int>(kind)], first, count, dst);
}

}  // namespace strata
