#include "memory/chunk_space.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>

#include "core/log.h"
#include "core/trace.h"
#include "core/units.h"

namespace strata {
namespace {

constexpr uint64_t kNever = UINT64_MAX;       // next use of a chunk not in the schedule

bool writes(AccessMode mode) { return mode != AccessMode::kRead; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Creation

ChunkSpace::ChunkSpace(Device& device, IoEngine* io, ChunkLayout layout,
                       const ChunkSpaceOptions& options)
    : device_(device),
      io_(io),
      options_(options),
      poison_released_(device.chaos_seed() != 0),
      layout_(std::move(layout)) {}

Result<std::unique_ptr<ChunkSpace>> ChunkSpace::create(Device& device, IoEngine* io,
                                                       const ChunkSpaceOptions& options) {
  ASSIGN_OR_RETURN(ChunkLayout layout, ChunkLayout::create(options.chunk_bytes));
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return Status::InvalidArgument("rank " + std::to_string(options.rank) + " is outside world " +
                                   std::to_string(options.world_size));
  }
  if (options.nvme_bytes > 0 && io == nullptr) {
    return Status::InvalidArgument("the nvme tier needs an I/O engine");
  }
  const uint64_t chunk = options.chunk_bytes;
  if (options.nvme_bytes > 0 && options.host_bytes < chunk) {
    return Status::InvalidArgument(
        "the nvme tier moves chunks through host memory, but memory.host (" +
        format_bytes(options.host_bytes) + ") holds no chunk of " + format_bytes(chunk) +
        "; raise memory.host to at least " + format_bytes(chunk));
  }
  std::unique_ptr<ChunkSpace> s(new ChunkSpace(device, io, std::move(layout), options));
  ASSIGN_OR_RETURN(s->tiers_[kDevice],
                   TierSlots::create_device(device, options.device_bytes, chunk));
  ASSIGN_OR_RETURN(s->tiers_[kHost], TierSlots::create_host(device, io, options.host_bytes, chunk,
                                                            options.host_block_bytes));
  if (options.nvme_bytes > 0) {
    ASSIGN_OR_RETURN(s->tiers_[kNvme],
                     io->moves_bytes() ? TierSlots::create_nvme(*io, options.nvme_dir, options.nvme_bytes, chunk,
                                                                options.nvme_file_bytes)
                                       : TierSlots::create_nvme_without_files(options.nvme_bytes, chunk));
  }
  for (int t = 0; t < kNumTiers; ++t) {
    if (!s->tiers_[t]) continue;
    const uint32_t n = s->tiers_[t]->slot_count();
    s->owner_[t].assign(n, -1);
    s->fences_[t].resize(n);
    if (t != kNvme) {
      for (SlotFence& f : s->fences_[t]) f.event = device.create_event();
    }
  }
  // The copy streams; zero fills of either tier run on the first, so that every byte the space
  // writes goes through the Device (the planner's replay runs it over one that moves nothing).
  s->up_ = device.create_stream();
  s->down_ = device.create_stream();
  s->up_->set_trace_name("copy host->device");
  s->down_->set_trace_name("copy device->host");
  return s;
}

ChunkSpace::~ChunkSpace() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const ChunkState& c : chunks_) {
    if (c.pins > 0) {
      LOG_ERROR("chunk space destroyed while a chunk is pinned in tier '{}'",
                tier_name(c.pinned_in));
      break;
    }
  }
  if (up_) up_->synchronize();
  if (down_) down_->synchronize();
  for (auto& tier_fences : fences_) {
    for (SlotFence& f : tier_fences) {
      if (f.io) (void)wait_io(*f.io);
    }
  }
}

Status ChunkSpace::check_feasible(uint32_t pinned_at_once, Tier where) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t chunk = layout_.chunk_bytes();
  const uint64_t needed = uint64_t{pinned_at_once} * chunk;
  const uint32_t slots = tiers_[idx(where)] ? tier(where).slot_count() : 0;
  if (slots >= pinned_at_once) return Status::OK();
  const uint64_t budget = tiers_[idx(where)] ? tier(where).budget() : 0;
  return Status::OutOfMemory(std::string("tier '") + tier_name(where) + "' budget " +
                             format_bytes(budget) + " holds " + std::to_string(slots) +
                             " chunks of " + format_bytes(chunk) + ", but a layer needs " +
                             std::to_string(pinned_at_once) + " pinned at once; raise " +
                             tier_budget_key(where) + " to at least " + format_bytes(needed) +
                             " or lower memory.chunk_size");
}

// ---------------------------------------------------------------------------------------------
// Registration

Result<ChunkId> ChunkSpace::new_chunk_home(ChunkKind kind, std::optional<Tier> home) {
  const ChunkId id = static_cast<ChunkId>(chunks_.size());
  chunks_.emplace_back();
  chunks_.back().kind = kind;
  uses_.emplace_back();
  std::vector<Tier> order = {Tier::kNvme, Tier::kHost, Tier::kDevice};
  if (home) {
    if (!has_tier(*home)) {
      chunks_.pop_back();
      uses_.pop_back();
      return Status::InvalidArgument(std::string("cannot home a chunk in tier '") +
                                     tier_name(*home) + "': " + tier_budget_key(*home) + " is 0");
    }
    order = {*home};
  }
  Status last = Status::OK();
  for (Tier t : order) {
    if (!has_tier(t)) continue;
    // With an nvme tier, one host slot stays free of homes to stage nvme chunks through.
    const uint32_t staging = t == Tier::kHost && has_tier(Tier::kNvme) ? 1 : 0;
    if (homes_[idx(t)] + staging >= tier(t).slot_count()) continue;
    busy_ = id;
    Result<uint32_t> slot = take_slot(t, id, std::nullopt);
    busy_.reset();
    if (!slot.ok()) {
      last = slot.status();
      continue;
    }
    chunks_[id].home = t;
    ++homes_[idx(t)];
    guest_slots_known_[idx(t)] = false;
    if (kind == ChunkKind::kAct) ++act_chunks_;
    return id;
  }
  chunks_.pop_back();
  uses_.pop_back();
  if (!last.ok()) return last;
  std::string have;
  for (Tier t : order) {
    if (!has_tier(t)) continue;
    have += std::string(have.empty() ? "" : ", ") + tier_name(t) + " " +
            std::to_string(tier(t).slot_count());
  }
  return Status::OutOfMemory("no tier has room for chunk " + std::to_string(id) + " of " +
                             format_bytes(layout_.chunk_bytes()) + " (chunks per tier: " + have +
                             "); raise memory.nvme.size or memory.host");
}

Result<TensorId> ChunkSpace::add_tensor(const std::string& name, ChunkKind kind, uint64_t bytes,
                                        std::optional<Tier> home) {
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(layout_.validate(name, bytes));
  if (layout_.opens_chunk(kind, bytes)) {
    RETURN_IF_ERROR(new_chunk_home(kind, home).status());
  }
  ASSIGN_OR_RETURN(TensorId id, layout_.add(name, kind, bytes));
  CHECK(layout_.num_chunks() == chunks_.size());
  return id;
}

bool ChunkSpace::opens_chunk(ChunkKind kind, uint64_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_.opens_chunk(kind, bytes);
}

Result<ChunkId> ChunkSpace::add_chunk(ChunkKind kind, std::optional<Tier> home) {
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(new_chunk_home(kind, home).status());
  const ChunkId id = layout_.open_chunk(kind);
  CHECK(layout_.num_chunks() == chunks_.size());
  return id;
}

size_t ChunkSpace::num_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunks_.size();
}

TensorPlacement ChunkSpace::tensor(TensorId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_.tensor(id);
}

std::optional<TensorId> ChunkSpace::find_tensor(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_.find(name);
}

ChunkKind ChunkSpace::chunk_kind(ChunkId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_.chunk(id).kind;
}

Tier ChunkSpace::home(ChunkId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  CHECK(id < chunks_.size());
  return chunks_[id].home;
}

ByteRange ChunkSpace::owned_range(ChunkId id) const {
  return strata::owned_range(layout_.chunk_bytes(), options_.rank, options_.world_size);
}

bool ChunkSpace::is_resident(ChunkId id, Tier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  CHECK(id < chunks_.size());
  return chunks_[id].valid[idx(tier)];
}

ChunkSpaceStats ChunkSpace::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ChunkSpaceStats s = stats_;
  s.act_bytes = act_chunks_ * layout_.chunk_bytes();
  for (int t = 0; t < kNumTiers; ++t) {
    if (!tiers_[t]) continue;
    s.tiers[t].capacity_bytes = uint64_t{tiers_[t]->slot_count()} * tiers_[t]->slot_bytes();
    s.tiers[t].in_use_bytes = tiers_[t]->in_use_bytes();
    s.tiers[t].peak_bytes = tiers_[t]->peak_bytes();
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Access

Result<void*> ChunkSpace::acquire_chunk(ChunkId id, Tier where, AccessMode mode,
                                        Stream* consumer) {
  std::unique_lock<std::mutex> lock = lock_space();
  return acquire_locked(id, where, mode, /*whole_chunk=*/true, consumer);
}

Result<void*> ChunkSpace::acquire_tensor(TensorId id, Tier where, AccessMode mode,
                                         Stream* consumer) {
  std::unique_lock<std::mutex> lock = lock_space();
  const TensorPlacement& t = layout_.tensor(id);
  ASSIGN_OR_RETURN(void* base, acquire_locked(t.chunk, where, mode, /*whole_chunk=*/false,
                                              consumer));
  return static_cast<void*>(static_cast<char*>(base) + t.offset);
}

Result<void*> ChunkSpace::acquire_locked(ChunkId id, Tier where, AccessMode mode,
                                         bool whole_chunk, Stream* consumer) {
  CHECK(id < chunks_.size());
  if (where == Tier::kNvme || !has_tier(where)) {
    return Status::InvalidArgument(std::string("cannot acquire chunk ") + std::to_string(id) +
                                   " in tier '" + tier_name(where) + "'" +
                                   (where == Tier::kNvme ? ": nvme is not addressable"
                                                         : ": the tier is absent"));
  }
  ChunkState& c = chunks_[id];
  if (c.pins > 0 && c.pinned_in != where) {
    return Status::InvalidArgument("chunk " + std::to_string(id) + " is pinned in tier '" +
                                   tier_name(c.pinned_in) + "'; release it before acquiring it in '" +
                                   tier_name(where) + "'");
  }
  const int w = idx(where);
  const uint64_t blocked_before = blocked_ns_;
  ++stats_.tiers[w].acquires;
  c.last_use = ++tick_;
  busy_ = id;
  struct Unbusy {
    std::optional<ChunkId>& busy;
    ~Unbusy() { busy.reset(); }
  } unbusy{busy_};
  const bool prefetch_hit = c.valid[w] && c.prefetched[w];
  const bool load = !(mode == AccessMode::kWrite && whole_chunk);

  if (c.slot[w] < 0) RETURN_IF_ERROR(take_slot(where, id, std::nullopt).status());
  if (!c.valid[w] && load) RETURN_IF_ERROR(fill(id, where, MoveOrigin::kDemand));
  const uint32_t slot = static_cast<uint32_t>(c.slot[w]);
  Status st = skip_acquire_wait_ ? Status::OK()
              : consumer != nullptr ? order_on(where, slot, *consumer, mode == AccessMode::kRead)
                                    : wait_slot(where, slot, mode == AccessMode::kRead);
  stats_.tiers[w].stall_ns += blocked_ns_ - blocked_before;
  if (load && !c.valid[w]) {
    // The read that was filling this copy failed.
    return st.ok() ? Status::Internal("chunk " + std::to_string(id) + " lost its copy")
                   : st.with_context("loading chunk " + std::to_string(id) + " into tier '" +
                                     tier_name(where) + "'");
  }
  if (writes(mode)) {
    c.zero = false;
    ++c.version;
    for (int t = 0; t < kNumTiers; ++t) {
      c.valid[t] = t == w;
      if (t != w) c.prefetched[t] = false;
    }
  }
  c.valid[w] = true;
  if (prefetch_hit) stats_.prefetch_hit_bytes += layout_.chunk_bytes();
  c.prefetched[w] = false;
  ++c.pins;
  c.pinned_in = where;
  return tier(where).data(slot);
}

void ChunkSpace::release_chunk(ChunkId id, Stream* consumer) {
  std::unique_lock<std::mutex> lock = lock_space();
  CHECK(id < chunks_.size());
  ChunkState& c = chunks_[id];
  CHECK_MSG(c.pins > 0, "release of chunk " + std::to_string(id) + " that is not acquired");
  if (consumer != nullptr) {
    record_on(c.pinned_in, static_cast<uint32_t>(c.slot[idx(c.pinned_in)]), *consumer);
  }
  --c.pins;
}

void ChunkSpace::release_tensor(TensorId id, Stream* consumer) {
  ChunkId chunk;
  {
    std::unique_lock<std::mutex> lock = lock_space();
    chunk = layout_.tensor(id).chunk;
  }
  release_chunk(chunk, consumer);
}

Status ChunkSpace::evict(ChunkId id, Tier from) {
  std::unique_lock<std::mutex> lock = lock_space();
  CHECK(id < chunks_.size());
  const ChunkState& c = chunks_[id];
  if (!has_tier(from) || c.slot[idx(from)] < 0) return Status::OK();
  if (c.home == from) {
    return Status::InvalidArgument("chunk " + std::to_string(id) + " lives in tier '" +
                                   tier_name(from) + "' (its home); it cannot be evicted from it");
  }
  if (c.pins > 0 && c.pinned_in == from) {
    return Status::InvalidArgument("chunk " + std::to_string(id) + " is pinned in tier '" +
                                   tier_name(from) + "'");
  }
  busy_ = id;
  Status st = evict_locked(id, from);
  busy_.reset();
  return st;
}

Status ChunkSpace::send_home(ChunkId id, Tier from) {
  std::unique_lock<std::mutex> lock = lock_space();
  CHECK(id < chunks_.size());
  const ChunkState& c = chunks_[id];
  if (!has_tier(from) || c.slot[idx(from)] < 0 || c.home == from || (c.pins > 0 && c.pinned_in == from))
    return Status::OK();
  busy_ = id;
  Status st = evict_locked(id, from);
  busy_.reset();
  return st;
}

void ChunkSpace::discard(ChunkId id) {
  std::unique_lock<std::mutex> lock = lock_space();
  CHECK(id < chunks_.size());
  ChunkState& c = chunks_[id];
  CHECK_MSG(c.pins == 0, "discard of chunk " + std::to_string(id) + ", which is acquired");
  c.zero = true;
  ++c.version;  // a write-back still running saves bytes nobody needs
  c.valid = {};
  c.prefetched = {};
}

Status ChunkSpace::read_tensor(TensorId id, uint64_t offset, uint64_t length, void* dst) {
  std::unique_lock<std::mutex> lock(mu_);
  const TensorPlacement t = layout_.tensor(id);
  if (offset > t.bytes || length > t.bytes - offset) {
    return Status::InvalidArgument("read of bytes [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + length) + ") of tensor '" + t.name +
                                   "', which has " + std::to_string(t.bytes));
  }
  if (length == 0) return Status::OK();
  ChunkState& c = chunks_[t.chunk];
  const uint64_t at = t.offset + offset;  // within the chunk
  if (c.zero) {
    std::memset(dst, 0, length);
    return Status::OK();
  }
  // The cheapest valid copy first. Waiting on a slot's fence may find that the read filling
  // it failed, which marks the copy stale; then the next copy is tried.
  if (c.valid[kHost]) {
    const uint32_t h = static_cast<uint32_t>(c.slot[kHost]);
    (void)wait_slot(Tier::kHost, h, /*reader=*/true);
    if (c.valid[kHost]) {
      std::memcpy(dst, static_cast<const char*>(tier(Tier::kHost).data(h)) + at, length);
      return Status::OK();
    }
  }
  if (c.valid[kDevice]) {
    const uint32_t d = static_cast<uint32_t>(c.slot[kDevice]);
    (void)order_on(Tier::kDevice, d, *down_);
    device_.copy(dst, static_cast<const char*>(tier(Tier::kDevice).data(d)) + at, length, *down_, "checkpoint read");
    record_on(Tier::kDevice, d, *down_);
    down_->synchronize();
    return Status::OK();
  }
  CHECK_MSG(c.valid[kNvme], "chunk " + std::to_string(t.chunk) + " has no valid copy");
  // O_DIRECT wants 4 KiB-aligned offsets, lengths and memory: read the aligned span around
  // the range (it stays inside the slot, whose size is a multiple of 4 KiB).
  const uint32_t n = static_cast<uint32_t>(c.slot[kNvme]);
  RETURN_IF_ERROR(wait_slot(Tier::kNvme, n));
  const uint64_t begin = at / 4096 * 4096;
  const uint64_t end = (at + length + 4095) / 4096 * 4096;
  std::unique_ptr<char, void (*)(void*)> buffer(static_cast<char*>(std::aligned_alloc(4096, end - begin)),
                                                std::free);
  CHECK_MSG(buffer != nullptr, "out of host memory for a read of " + format_bytes(end - begin));
  const FileSpan span = tier(Tier::kNvme).file_span(n);
  IoRequest request;
  request.op = IoOp::kRead;
  request.file = span.file;
  request.buffer = buffer.get();
  request.length = end - begin;
  request.offset = span.offset + begin;
  request.trace_name = "checkpoint read";
  // The read runs without the lock, so that compute is not held up behind the disk. The slot
  // is the chunk's home (never given back), and nothing writes it while the caller's bytes are
  // unchanged: a write-back to nvme only follows a modification of the chunk.
  lock.unlock();
  Result<IoTicket> ticket = io_->submit(request);
  Status st = ticket.ok() ? io_->wait(*ticket) : ticket.status();
  if (!st.ok()) return st.with_context("reading tensor '" + t.name + "' from the nvme tier");
  std::memcpy(dst, buffer.get() + (at - begin), length);
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Schedule and prefetch

void ChunkSpace::set_schedule(std::vector<ChunkId> order, std::vector<Tier> tiers) {
  std::lock_guard<std::mutex> lock(mu_);
  CHECK_MSG(tiers.empty() || tiers.size() == order.size(), "set_schedule: one tier per entry, or none");
  for (auto& u : uses_) u.clear();
  for (size_t i = 0; i < order.size(); ++i) {
    CHECK_MSG(order[i] < chunks_.size(), "schedule names an unknown chunk");
    uses_[order[i]].push_back(i);
  }
  schedule_ = std::move(order);
  schedule_tiers_ = std::move(tiers);
  next_use_cache_.assign(uses_.size(), NextUse{});
  position_ = 0;
}

void ChunkSpace::advance(size_t position) {
  std::unique_lock<std::mutex> lock = lock_space();
  CHECK(schedule_.empty() || position < schedule_.size());
  position_ = position;
}

uint64_t ChunkSpace::next_use(ChunkId id) const {
  if (id >= uses_.size()) return kNever;
  const std::vector<uint64_t>& uses = uses_[id];
  if (uses.empty()) return kNever;
  if (next_use_cache_.size() <= id) next_use_cache_.resize(uses_.size());
  NextUse& known = next_use_cache_[id];
  if (known.from <= position_ && position_ <= known.at) return known.at - position_;
  auto it = std::lower_bound(uses.begin(), uses.end(), position_);
  const uint64_t at = it != uses.end() ? *it : uses.front() + schedule_.size();  // else in the next step
  known = NextUse{position_, at};
  return at - position_;
}

Status ChunkSpace::prefetch(size_t lookahead, Tier default_to) {
  std::unique_lock<std::mutex> lock = lock_space();
  if (schedule_.empty()) return Status::OK();
  std::array<bool, kNumTiers> full{};  // no slot left for prefetches into the tier
  // Chunks whose disk read this call started: an entry naming one again (a chunk two groups or
  // parts share) leaves its device copy to a later call too, rather than wait for the read.
  std::vector<ChunkId> reading;
  // `lookahead` counts entries that may be prefetched: those naming nvme only tell eviction
  // when their chunks are next used, so they neither move nor use up the window.
  size_t counted = 0;
  for (size_t k = 0; k < schedule_.size() && counted < lookahead; ++k) {
    const size_t entry = (position_ + k) % schedule_.size();
    const Tier to = schedule_tiers_.empty() ? default_to : schedule_tiers_[entry];
    if (to == Tier::kNvme) continue;
    ++counted;
    if (!has_tier(to) || full[idx(to)]) continue;
    const int w = idx(to);
    const ChunkId id = schedule_[entry];
    ChunkState& c = chunks_[id];
    if (c.valid[w] || (c.pins > 0 && c.pinned_in != to)) continue;
    // Saved activations are copied in and out through host memory; a device copy is no use.
    if (to == Tier::kDevice && layout_.chunk(id).kind == ChunkKind::kAct) continue;
    const uint64_t due = next_use(id);
    busy_ = id;
    struct Unbusy {
      std::optional<ChunkId>& busy;
      ~Unbusy() { busy.reset(); }
    } unbusy{busy_};
    // A chunk only on nvme goes to host first; its device copy is left to a later call, which
    // queues it after the read. That call waits for the read if the disk is behind: skipping
    // the entry instead would depend on how far the disk has got, which the planner's replay
    // cannot know.
    const bool on_nvme_only = !c.zero && !c.valid[kHost] && !c.valid[kDevice];
    if (to == Tier::kDevice && std::find(reading.begin(), reading.end(), id) != reading.end()) continue;
    if (to == Tier::kDevice && on_nvme_only) {
      if (!has_tier(Tier::kHost)) continue;
      if (c.slot[kHost] < 0) {
        if (full[kHost]) continue;
        ASSIGN_OR_RETURN(const bool ready, host_slot_ready(due));
        if (!ready) {
          full[kHost] = true;  // later entries would wait for the write-back just started
          continue;
        }
        RETURN_IF_ERROR(take_slot(Tier::kHost, id, due).status());
      }
      RETURN_IF_ERROR(fill(id, Tier::kHost, MoveOrigin::kPrefetch));
      reading.push_back(id);
      continue;
    }
    if (c.slot[w] < 0) {
      if (to == Tier::kHost) {
        ASSIGN_OR_RETURN(const bool ready, host_slot_ready(due));
        if (!ready) {
          full[w] = true;  // later entries would wait for the same eviction
          continue;
        }
      } else if (tier(to).free_count() == 0) {
        const std::optional<ChunkId> victim = pick_victim(to, due);
        if (!victim) {
          full[w] = true;  // later entries are due even later: none of them gets a slot either
          continue;
        }
        // Evicting the victim from the device copies it to a host slot first, which may have
        // to be written back to make room.
        const ChunkState& v = chunks_[*victim];
        bool only_copy = v.valid[w] && !v.zero;
        for (int o = 0; o < kNumTiers; ++o) only_copy = only_copy && (o == w || !v.valid[o]);
        if (only_copy && v.home != Tier::kDevice && v.slot[kHost] < 0 && has_tier(Tier::kNvme)) {
          bool ready = false;
          if (!full[kHost]) {
            ASSIGN_OR_RETURN(ready, host_slot_ready(std::nullopt));
          }
          if (!ready) {
            full[w] = true;
            full[kHost] = true;
            continue;
          }
        }
      }
      RETURN_IF_ERROR(take_slot(to, id, due).status());
    }
    RETURN_IF_ERROR(fill(id, to, MoveOrigin::kPrefetch));
  }
  return Status::OK();
}

std::unique_lock<std::mutex> ChunkSpace::lock_space() const {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) {
    trace::Span wait("stall", "chunk space busy");
    lock.lock();
  }
  return lock;
}

void ChunkSpace::trace_usage() const {
  if (!trace::enabled()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (int t = 0; t < kNumTiers; ++t)
    if (tiers_[t]) trace_usage_locked(static_cast<Tier>(t));
}

Status ChunkSpace::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  if (up_) up_->synchronize();
  if (down_) down_->synchronize();
  Status first = Status::OK();
  for (int t = 0; t < kNumTiers; ++t) {
    for (SlotFence& f : fences_[t]) {
      if (!f.io) continue;
      Status st = wait_io(*f.io);
      f.io.reset();
      if (first.ok() && !st.ok()) first = st;
    }
  }
  return first;
}

}  // namespace strata
