// ChunkSpace internals: slot allocation, eviction, and the moves between tiers with their
// fences. Every function here runs with ChunkSpace::mu_ held.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>

#include "core/trace.h"
#include "core/units.h"
#include "memory/chunk_space.h"

namespace strata {
namespace {

uint64_t elapsed_ns(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - start)
                                   .count());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Slots and eviction

Result<uint32_t> ChunkSpace::take_slot(Tier t, ChunkId id, std::optional<uint64_t> due) {
  ChunkState& c = chunks_[id];
  CHECK(c.slot[idx(t)] < 0);
  TierSlots& slots = tier(t);
  std::optional<uint32_t> s = slots.take();
  if (!s) {
    const std::optional<ChunkId> victim = pick_victim(t, due);
    if (!victim) {
      return Status::OutOfMemory(
          std::string("tier '") + tier_name(t) + "' has no slot for chunk " +
          std::to_string(id) + ": all " + std::to_string(slots.slot_count()) + " chunks of " +
          format_bytes(slots.slot_bytes()) + " in it are pinned or live there; release chunks " +
          "first or raise " + tier_budget_key(t) + " (check_feasible() gives the minimum)");
    }
    RETURN_IF_ERROR(evict_locked(*victim, t));
    s = slots.take();
    CHECK(s.has_value());
  }
  owner_[idx(t)][*s] = id;
  c.slot[idx(t)] = *s;
  count_usage(t, c.kind, /*taken=*/true);
  return *s;
}

std::optional<ChunkId> ChunkSpace::pick_victim(Tier t, std::optional<uint64_t> due) const {
  using Key = std::tuple<bool, uint64_t, bool, uint64_t>;  // larger goes first
  std::optional<ChunkId> best;
  Key best_key{};
  const int w = idx(t);
  if (!guest_slots_known_[w]) {
    guest_slots_[w].clear();
    for (uint32_t slot = 0; slot < owner_[w].size(); ++slot) {
      const int64_t owner = owner_[w][slot];
      if (owner < 0 || chunks_[static_cast<ChunkId>(owner)].home != t) guest_slots_[w].push_back(slot);
    }
    guest_slots_known_[w] = true;
  }
  for (uint32_t slot : guest_slots_[w]) {
    const int64_t owner = owner_[w][slot];
    if (owner < 0) continue;
    const ChunkId id = static_cast<ChunkId>(owner);
    const ChunkState& c = chunks_[id];
    if (c.home == t || (c.pins > 0 && c.pinned_in == t) || busy_ == id) continue;
    const bool stale = !c.valid[idx(t)];
    bool clean = stale || c.zero;
    for (int o = 0; o < kNumTiers; ++o) clean = clean || (o != idx(t) && c.valid[o]);
    Key key;
    if (schedule_.empty()) {
      key = Key{stale, UINT64_MAX - c.last_use, clean, 0};
    } else {
      const uint64_t next = next_use(id);
      if (due && !stale && next <= *due) continue;  // needed no later than the prefetched one
      key = Key{stale, next, clean, UINT64_MAX - c.last_use};
    }
    if (!best || key > best_key) {
      best = id;
      best_key = key;
    }
  }
  return best;
}

Status ChunkSpace::evict_locked(ChunkId id, Tier from) {
  ChunkState& c = chunks_[id];
  const int f = idx(from);
  if (c.slot[f] < 0) return Status::OK();
  CHECK(c.home != from && !(c.pins > 0 && c.pinned_in == from));
  bool elsewhere = false;
  for (int o = 0; o < kNumTiers; ++o) elsewhere = elsewhere || (o != f && c.valid[o]);
  if (c.valid[f] && !c.zero && !elsewhere) {
    // The only valid copy: write it one tier down first (or back up to a device home).
    if (from == Tier::kDevice) {
      if (c.slot[kHost] < 0) RETURN_IF_ERROR(take_slot(Tier::kHost, id, std::nullopt).status());
      RETURN_IF_ERROR(copy_down(id, MoveOrigin::kWriteBack));
    } else if (c.home == Tier::kDevice) {
      RETURN_IF_ERROR(copy_up(id, MoveOrigin::kWriteBack));
    } else {
      CHECK(from == Tier::kHost && c.home == Tier::kNvme);
      RETURN_IF_ERROR(write_down(id));
    }
  }
  drop_copy(id, from);
  return Status::OK();
}

void ChunkSpace::drop_copy(ChunkId id, Tier t) {
  ChunkState& c = chunks_[id];
  const int64_t slot = c.slot[idx(t)];
  CHECK(slot >= 0);
  if (poison_released_ && t == Tier::kDevice) {
    const uint32_t d = static_cast<uint32_t>(slot);
    (void)order_on(t, d, *up_);  // after every use of the copy leaving it
    device_.fill(tier(t).data(d), 0xFF, layout_.chunk_bytes(), *up_);
    record_on(t, d, *up_);
  }
  owner_[idx(t)][slot] = -1;
  tier(t).give_back(static_cast<uint32_t>(slot));
  count_usage(t, c.kind, /*taken=*/false);
  c.slot[idx(t)] = -1;
  c.valid[idx(t)] = false;
  c.prefetched[idx(t)] = false;
  // The slot's fence stays with the slot: its next user is ordered after this copy's moves.
}

// ---------------------------------------------------------------------------------------------
// Moves

Status ChunkSpace::fill(ChunkId id, Tier t, MoveOrigin origin) {
  ChunkState& c = chunks_[id];
  if (c.zero) {
    zero_fill(id, t, origin);
    return Status::OK();
  }
  if (t == Tier::kDevice) {
    if (!c.valid[kHost]) {
      CHECK_MSG(c.valid[kNvme], "chunk " + std::to_string(id) + " has no valid copy");
      if (c.slot[kHost] < 0) RETURN_IF_ERROR(take_slot(Tier::kHost, id, std::nullopt).status());
      RETURN_IF_ERROR(read_up(id, origin));
    }
    return copy_up(id, origin);
  }
  CHECK(t == Tier::kHost);
  if (c.valid[kDevice]) return copy_down(id, origin);
  CHECK_MSG(c.valid[kNvme], "chunk " + std::to_string(id) + " has no valid copy");
  return read_up(id, origin);
}

void ChunkSpace::zero_fill(ChunkId id, Tier t, MoveOrigin origin) {
  ChunkState& c = chunks_[id];
  const uint32_t slot = static_cast<uint32_t>(c.slot[idx(t)]);
  const uint64_t bytes = layout_.chunk_bytes();
  // Ordered after the slot's last use like any move into it; an acquire waits for it.
  (void)order_on(t, slot, *up_);
  device_.fill(tier(t).data(slot), 0, bytes, *up_);
  record_on(t, slot, *up_);
  c.valid[idx(t)] = true;
  c.prefetched[idx(t)] = origin == MoveOrigin::kPrefetch;
  stats_.zero_filled_bytes += bytes;
}

Status ChunkSpace::copy_up(ChunkId id, MoveOrigin origin) {
  ChunkState& c = chunks_[id];
  const uint32_t h = static_cast<uint32_t>(c.slot[kHost]);
  const uint32_t d = static_cast<uint32_t>(c.slot[kDevice]);
  // A write-back of the host copy may still run: the copy only reads the slot too.
  Status st = order_on(Tier::kHost, h, *up_, /*reader=*/true);
  if (!c.valid[kHost]) {
    return st.ok() ? Status::Internal("chunk " + std::to_string(id) + " lost its host copy")
                   : st.with_context("reading chunk " + std::to_string(id) + " from the nvme tier");
  }
  (void)order_on(Tier::kDevice, d, *up_);
  device_.copy(tier(Tier::kDevice).data(d), tier(Tier::kHost).data(h), layout_.chunk_bytes(),
               *up_);
  record_on(Tier::kHost, h, *up_);
  record_on(Tier::kDevice, d, *up_);
  c.valid[kDevice] = true;
  count_move(id, Tier::kDevice, &ChunkSpaceStats::host_to_device_bytes, origin);
  return Status::OK();
}

Status ChunkSpace::copy_down(ChunkId id, MoveOrigin origin) {
  ChunkState& c = chunks_[id];
  const uint32_t h = static_cast<uint32_t>(c.slot[kHost]);
  const uint32_t d = static_cast<uint32_t>(c.slot[kDevice]);
  (void)order_on(Tier::kDevice, d, *down_);
  (void)order_on(Tier::kHost, h, *down_);  // an old read into this slot no longer matters
  device_.copy(tier(Tier::kHost).data(h), tier(Tier::kDevice).data(d), layout_.chunk_bytes(),
               *down_);
  record_on(Tier::kDevice, d, *down_);
  record_on(Tier::kHost, h, *down_);
  c.valid[kHost] = true;
  count_move(id, Tier::kHost, &ChunkSpaceStats::device_to_host_bytes, origin);
  return Status::OK();
}

Status ChunkSpace::read_up(ChunkId id, MoveOrigin origin) {
  ChunkState& c = chunks_[id];
  const uint32_t h = static_cast<uint32_t>(c.slot[kHost]);
  const uint32_t n = static_cast<uint32_t>(c.slot[kNvme]);
  // The engine is not ordered with the copy streams: wait for what still uses the slots.
  (void)wait_slot(Tier::kHost, h);
  (void)wait_slot(Tier::kNvme, n);
  const FileSpan span = tier(Tier::kNvme).file_span(n);
  IoRequest request;
  request.op = IoOp::kRead;
  request.file = span.file;
  request.buffer = tier(Tier::kHost).data(h);
  request.length = layout_.chunk_bytes();
  request.offset = span.offset;
  request.trace_name = "nvme read";
  Result<IoTicket> ticket = io_->submit(request);
  if (!ticket.ok()) {
    return ticket.status().with_context("reading chunk " + std::to_string(id) +
                                        " from the nvme tier");
  }
  auto f = std::make_shared<IoFence>();
  f->ticket = *ticket;
  f->read = true;
  f->chunk = id;
  f->host_slot = h;
  fence(Tier::kHost, h).io = f;
  fence(Tier::kNvme, n).io = f;
  c.valid[kHost] = true;
  count_move(id, Tier::kHost, &ChunkSpaceStats::nvme_to_host_bytes, origin);
  return Status::OK();
}

Status ChunkSpace::start_write_down(ChunkId id) {
  ChunkState& c = chunks_[id];
  const uint32_t h = static_cast<uint32_t>(c.slot[kHost]);
  const uint32_t n = static_cast<uint32_t>(c.slot[kNvme]);
  // The engine is not ordered with the copy streams: the copy filling the host slot (an
  // eviction from the device) and the last I/O of the nvme slot finish first.
  (void)wait_slot(Tier::kHost, h);
  (void)wait_slot(Tier::kNvme, n);
  CHECK(c.valid[kHost]);  // the only valid copy never comes from a read
  // Those waits may have completed an earlier write-back of these very bytes.
  if (c.valid[kNvme]) return Status::OK();
  const FileSpan span = tier(Tier::kNvme).file_span(n);
  IoRequest request;
  request.op = IoOp::kWrite;
  request.file = span.file;
  request.buffer = tier(Tier::kHost).data(h);
  request.length = layout_.chunk_bytes();
  request.offset = span.offset;
  request.trace_name = "nvme write";
  Result<IoTicket> ticket = io_->submit(request);
  if (!ticket.ok()) {
    return ticket.status().with_context("writing chunk " + std::to_string(id) + " back to the nvme tier in '" +
                                        tier(Tier::kNvme).dir() + "'");
  }
  auto f = std::make_shared<IoFence>();
  f->ticket = *ticket;
  f->chunk = id;
  f->host_slot = h;
  f->version = c.version;
  // An acquire of the host copy, a later user of the host slot and a read of the nvme slot all
  // wait for the write through these fences.
  fence(Tier::kHost, h).io = f;
  fence(Tier::kNvme, n).io = f;
  count_move(id, Tier::kNvme, &ChunkSpaceStats::host_to_nvme_bytes, MoveOrigin::kWriteBack);
  return Status::OK();
}

Status ChunkSpace::write_down(ChunkId id) {
  ChunkState& c = chunks_[id];
  if (pending_write(id) == nullptr) {
    RETURN_IF_ERROR(start_write_down(id));
    if (c.valid[kNvme]) return Status::OK();
  }
  // Keep the fence: wait_slot() would drop it, and a failed write's status belongs to this caller.
  const std::shared_ptr<IoFence> f = fence(Tier::kHost, c.slot[kHost]).io;
  CHECK(f != nullptr);
  Status st = wait_io(*f);
  if (!st.ok()) {
    // The host copy stays valid and dirty: nothing is lost, and the caller sees why.
    const TierSlots& nvme = tier(Tier::kNvme);
    return st.with_context("writing chunk " + std::to_string(id) + " (" +
                           format_bytes(layout_.chunk_bytes()) + ") back to the nvme tier in '" +
                           nvme.dir() + "', which needs " + format_bytes(nvme.budget()) +
                           " there");
  }
  CHECK(c.valid[kNvme]);
  return Status::OK();
}

bool ChunkSpace::needs_write_down(ChunkId id) const {
  const ChunkState& c = chunks_[id];
  return c.home == Tier::kNvme && c.slot[kHost] >= 0 && c.valid[kHost] && !c.zero && !c.valid[kDevice] &&
         !c.valid[kNvme];
}

ChunkSpace::IoFence* ChunkSpace::pending_write(ChunkId id) {
  const ChunkState& c = chunks_[id];
  if (c.slot[kHost] < 0) return nullptr;
  IoFence* f = fence(Tier::kHost, c.slot[kHost]).io.get();
  if (f == nullptr || f->read || f->chunk != id || f->version != c.version) return nullptr;
  if (f->waited && !f->status.ok()) return nullptr;  // failed: an eviction writes it again
  return f;
}

Result<bool> ChunkSpace::host_slot_ready(std::optional<uint64_t> due) {
  if (tier(Tier::kHost).free_count() > 0) return true;
  const std::optional<ChunkId> victim = pick_victim(Tier::kHost, due);
  if (!victim) return false;
  if (!has_tier(Tier::kNvme) || !needs_write_down(*victim)) return true;
  // Started by an earlier call: the eviction waits for what is left of it. The answer never
  // depends on how far the disk has got, so the planner's replay, whose I/O completes at once,
  // makes the same moves as the engine.
  if (pending_write(*victim) != nullptr) return true;
  RETURN_IF_ERROR(start_write_down(*victim));
  return false;
}

void ChunkSpace::count_move(ChunkId id, Tier to, uint64_t ChunkSpaceStats::*field,
                            MoveOrigin origin) {
  const uint64_t bytes = layout_.chunk_bytes();
  stats_.*field += bytes;
  stats_.moved_by_kind[static_cast<size_t>(layout_.chunk(id).kind)] += bytes;
  if (field == &ChunkSpaceStats::host_to_nvme_bytes)
    stats_.written_by_kind[static_cast<size_t>(layout_.chunk(id).kind)] += bytes;
  ChunkState& c = chunks_[id];
  c.prefetched[idx(to)] = origin == MoveOrigin::kPrefetch;
  if (origin == MoveOrigin::kPrefetch) stats_.prefetched_bytes += bytes;
  if (origin == MoveOrigin::kDemand) stats_.demand_bytes += bytes;
}

// ---------------------------------------------------------------------------------------------
// Fences

ChunkSpace::SlotFence& ChunkSpace::fence(Tier t, int64_t slot) {
  CHECK(slot >= 0 && static_cast<size_t>(slot) < fences_[idx(t)].size());
  return fences_[idx(t)][static_cast<size_t>(slot)];
}

Status ChunkSpace::wait_io(IoFence& f) {
  if (f.waited) return f.status;
  if (io_->done(f.ticket)) {
    f.status = io_->wait(f.ticket);
  } else {
    const auto start = std::chrono::steady_clock::now();
    trace::Span stall("stall", f.read ? "wait for nvme read" : "nvme write-back");
    f.status = io_->wait(f.ticket);
    stall.end();
    blocked_ns_ += elapsed_ns(start);
  }
  f.waited = true;
  if (f.status.ok() && !f.read && f.chunk < chunks_.size()) {
    // The nvme copy holds the chunk's latest bytes unless it was written again since.
    ChunkState& c = chunks_[f.chunk];
    if (c.version == f.version) c.valid[kNvme] = true;
  }
  if (!f.status.ok() && f.read && f.chunk < chunks_.size()) {
    // The host copy the read was filling holds garbage: mark it stale, once, here.
    ChunkState& c = chunks_[f.chunk];
    if (c.slot[kHost] == static_cast<int64_t>(f.host_slot)) {
      c.valid[kHost] = false;
      c.prefetched[kHost] = false;
    }
  }
  return f.status;
}

Status ChunkSpace::wait_slot(Tier t, uint32_t slot, bool reader) {
  SlotFence& f = fence(t, slot);
  if (f.event && !f.event->query()) {
    const auto start = std::chrono::steady_clock::now();
    trace::Span stall("stall", "wait for copy");
    stall.arg("tier", static_cast<double>(idx(t)));
    f.event->synchronize();
    blocked_ns_ += elapsed_ns(start);
  }
  Status st = Status::OK();
  if (f.io && !(reader && !f.io->read)) {
    st = wait_io(*f.io);
    f.io.reset();
  }
  return st;
}

Status ChunkSpace::order_on(Tier t, uint32_t slot, Stream& stream, bool reader) {
  SlotFence& f = fence(t, slot);
  Status st = Status::OK();
  if (f.io && !(reader && !f.io->read)) {
    st = wait_io(*f.io);
    f.io.reset();
  }
  if (f.event) stream.wait(*f.event);
  return st;
}

void ChunkSpace::count_usage(Tier t, ChunkKind kind, bool taken) {
  uint64_t& bytes = usage_[idx(t)][static_cast<int>(kind)];
  bytes = taken ? bytes + layout_.chunk_bytes() : bytes - layout_.chunk_bytes();
  if (trace::enabled()) trace_usage_locked(t);
}

void ChunkSpace::trace_usage_locked(Tier t) const {
  static constexpr const char* kCounter[kNumTiers] = {"device bytes", "host bytes", "nvme bytes"};
  const auto& u = usage_[idx(t)];
  const auto kind = [&](ChunkKind k) {
    return trace::Arg{chunk_kind_name(k), static_cast<double>(u[static_cast<int>(k)])};
  };
  static_assert(kNumChunkKinds <= trace::kMaxArgs, "one series per chunk kind");
  trace::counter(kCounter[idx(t)], {kind(ChunkKind::kParam), kind(ChunkKind::kGrad), kind(ChunkKind::kMaster),
                                    kind(ChunkKind::kAdamM), kind(ChunkKind::kAdamV), kind(ChunkKind::kAct)});
}

void ChunkSpace::record_on(Tier t, uint32_t slot, Stream& stream) {
  SlotFence& f = fence(t, slot);
  CHECK(f.event != nullptr);
  f.event->record(stream);
}

}  // namespace strata
