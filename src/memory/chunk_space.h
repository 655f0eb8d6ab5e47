// ChunkSpace: the chunk address space (DESIGN §3.2). Maps tensor -> (chunk, offset) and
// chunk -> (tier, slot), and moves chunks between the tiers as compute asks for them.
//
// Residency. Every chunk has a home: a slot in the lowest tier with room when it is created
// (nvme, then host, then device) unless the caller names one. It may also hold cached copies
// in the tiers above its home. Each copy is valid (holds the chunk's latest bytes) or stale.
// Acquiring a chunk for writing makes every other copy stale; evicting a copy that is the only
// valid one writes it one tier down first (device -> host, host -> its nvme home), while a
// copy with a valid copy elsewhere is simply dropped. A chunk never written reads as zeros
// (it is zero-filled where it is first acquired; nothing is read from disk).
//
// Moves. device <-> host run on two copy streams of the Device (one per direction) and
// host -> device also goes through a host slot for nvme-homed chunks; host <-> nvme goes through
// the IoEngine. Every slot carries a fence (an Event and/or an I/O ticket) for the last move
// that touched it: a move using the slot is ordered after it (Stream::wait, no blocking) and an
// acquire waits for it before handing out the pointer. A write-back to nvme is complete before
// its host copy is dropped, so an I/O error there reaches the caller that caused the eviction
// and the bytes stay in host memory. prefetch() starts the write-back of the copy it would evict
// and leaves the eviction to a later call (write-behind), which finds the write done or
// waits only for what is left. The nvme copy counts as valid from the write's completion, and
// only if the chunk was not written again meanwhile.
// A failed read reaches the caller of acquire() as a Status; the copy it was filling stays
// stale, never a silent zero page.
//
// Eviction: with a schedule (set_schedule + advance), the unpinned copy whose next use is the
// farthest goes first (Belady); without one, the least recently acquired. Stale copies always
// go first. prefetch() follows the schedule and starts moves ahead of need (chunks of kind
// kAct, saved activations used from host memory, are never prefetched into device memory).
//
// Ownership: the Device and IoEngine passed to create() must outlive the ChunkSpace; so must
// any consumer Stream passed to acquire/release until the work queued on it is done.
// Pointers from acquire() are valid until the matching release().
// Thread safety: safe for concurrent use (one internal mutex; a call that must wait for data
// holds it while waiting, so concurrent callers are serialized, not parallel). Never call it
// from a task running on a Stream: it may be waiting, under its lock, on that stream.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "memory/chunk.h"
#include "core/io_engine.h"
#include "memory/tier.h"

namespace strata {

enum class AccessMode : uint8_t {
  kRead,       // the caller only reads; the chunk stays clean
  kWrite,      // the caller writes; for acquire_chunk: it overwrites the whole chunk, so the
               // old bytes are not loaded (their contents are unspecified)
  kReadWrite,  // the caller reads and writes
};

struct ChunkSpaceOptions {
  uint64_t chunk_bytes = kDefaultChunkBytes;  // a multiple of 4 KiB
  // Tier budgets; 0 = no such tier. An nvme tier needs a host tier to stage through.
  uint64_t device_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t nvme_bytes = 0;
  std::string nvme_dir;                   // directory of the nvme tier's files
  uint64_t nvme_file_bytes = 1 * kGiB;    // size of each preallocated file
  uint64_t host_block_bytes = 1 * kGiB;   // size of each pinned allocation
  int rank = 0;                           // data-parallel rank and world (owned ranges)
  int world_size = 1;
};

struct TierUsage {
  uint64_t capacity_bytes = 0;  // whole slots within the budget
  uint64_t in_use_bytes = 0;    // slots holding a chunk (home or cached copy)
  uint64_t peak_bytes = 0;
  uint64_t acquires = 0;        // acquire calls targeting this tier
  uint64_t stall_ns = 0;        // time those calls spent blocked on data
};

struct ChunkSpaceStats {
  std::array<TierUsage, kNumTiers> tiers;  // indexed by Tier
  uint64_t device_to_host_bytes = 0;
  uint64_t host_to_device_bytes = 0;
  uint64_t host_to_nvme_bytes = 0;
  uint64_t nvme_to_host_bytes = 0;
  uint64_t zero_filled_bytes = 0;
  uint64_t prefetched_bytes = 0;    // moves started by prefetch()
  uint64_t prefetch_hit_bytes = 0;  // acquired chunks whose move prefetch() had started
  uint64_t demand_bytes = 0;        // moves started by acquire() itself (not prefetched)
  uint64_t act_bytes = 0;           // bytes of the chunks of kind kAct (saved activations)
  // Bytes moved between any two tiers, by the kind of the chunk moved (ChunkKind order).
  std::array<uint64_t, kNumChunkKinds> moved_by_kind{};
  // Of them, the bytes written to the nvme tier.
  std::array<uint64_t, kNumChunkKinds> written_by_kind{};
  uint64_t moved_bytes() const {
    return device_to_host_bytes + host_to_device_bytes + host_to_nvme_bytes + nvme_to_host_bytes;
  }
  uint64_t stall_ns() const {
    uint64_t s = 0;
    for (const TierUsage& t : tiers) s += t.stall_ns;
    return s;
  }
};

class ChunkSpace {
 public:
  // Reserves all tiers up front. io may be null when options.nvme_bytes is 0.
  static Result<std::unique_ptr<ChunkSpace>> create(Device& device, IoEngine* io,
                                                    const ChunkSpaceOptions& options);
  // Waits for every move in flight, then frees all slots (nvme files are removed).
  // REQUIRES: no chunk is pinned.
  ~ChunkSpace();
  ChunkSpace(const ChunkSpace&) = delete;
  ChunkSpace& operator=(const ChunkSpace&) = delete;

  // OutOfMemory when tier `where` cannot hold `pinned_at_once` chunks pinned together (what
  // one layer of a step keeps resident); the message gives the budget that would.
  Status check_feasible(uint32_t pinned_at_once, Tier where = Tier::kDevice) const;

  // --- Registration -----------------------------------------------------------------------
  // Packs a tensor (ChunkLayout::add). When it opens a new chunk, that chunk gets its home in
  // `home`, or in the lowest tier with room. OutOfMemory when no tier has room.
  Result<TensorId> add_tensor(const std::string& name, ChunkKind kind, uint64_t bytes,
                              std::optional<Tier> home = std::nullopt);
  // Whether add_tensor() of `bytes` of `kind` would open a new chunk (ChunkLayout::opens_chunk).
  bool opens_chunk(ChunkKind kind, uint64_t bytes) const;
  // A new empty chunk of `kind` (later tensors of the kind go into it), homed as above.
  Result<ChunkId> add_chunk(ChunkKind kind, std::optional<Tier> home = std::nullopt);

  uint64_t chunk_bytes() const { return layout_.chunk_bytes(); }
  size_t num_chunks() const;
  // REQUIRES: a valid id.
  TensorPlacement tensor(TensorId id) const;
  std::optional<TensorId> find_tensor(const std::string& name) const;
  ChunkKind chunk_kind(ChunkId id) const;
  Tier home(ChunkId id) const;
  // The byte range of chunk `id` this rank owns.
  ByteRange owned_range(ChunkId id) const;
  // Whether a valid copy of the chunk is in `tier` (its move may still be in flight).
  bool is_resident(ChunkId id, Tier tier) const;
  bool has_tier(Tier tier) const { return tiers_[static_cast<int>(tier)] != nullptr; }

  // --- Access -----------------------------------------------------------------------------
  // Pins the chunk in `where` (device or host) and returns its bytes there, moving them in
  // (and evicting others) as needed. With `consumer`, the consumer stream is made to wait for
  // the move instead of the caller. Errors: InvalidArgument for the nvme tier, a missing
  // tier, or a chunk pinned in another tier; OutOfMemory when every slot of a tier it needs is
  // pinned; IOError from a failed read or write-back.
  Result<void*> acquire_chunk(ChunkId id, Tier where, AccessMode mode,
                              Stream* consumer = nullptr);
  // The tensor's bytes inside its chunk (the whole chunk is pinned and loaded).
  Result<void*> acquire_tensor(TensorId id, Tier where, AccessMode mode,
                               Stream* consumer = nullptr);
  // Unpins. With `consumer`, later moves of the chunk wait for the work queued on it so far.
  // REQUIRES: one acquire not yet released. `consumer` is the stream whose work last uses the
  // bytes: the acquire's, or one they were handed to after it (a chunk the host acquired, then
  // read by a collective queued on a communication stream).
  void release_chunk(ChunkId id, Stream* consumer = nullptr);
  void release_tensor(TensorId id, Stream* consumer = nullptr);

  // Drops the chunk's copy in `from`, writing it one tier down first when it is the only
  // valid copy. No-op when it has no copy there. InvalidArgument for the home tier or when
  // the chunk is pinned there.
  Status evict(ChunkId id, Tier from);
  // As evict(), but a no-op, not an error, for the home tier or a chunk pinned there: what a
  // pass through a tier (loading, restoring, reading the state) calls on each chunk after it,
  // so that the tier's slots are reused chunk after chunk instead of keeping every copy.
  Status send_home(ChunkId id, Tier from);
  // The caller is done with the chunk's bytes until an acquisition overwrites them (AdamW's
  // gradients, which the next step zeroes): it reads as zeros from now on, every copy is stale,
  // and none is written back. A write-back in flight no longer counts for it. Its slots stay
  // until eviction takes them, first, for free. REQUIRES: the chunk is not pinned.
  void discard(ChunkId id);
  // For the chaos suite's planted-bug test only: acquire no longer waits for (or orders the
  // consumer after) the move that fills the copy it returns, the one bug the suite must catch.
  void set_test_skip_acquire_wait(bool skip) { skip_acquire_wait_ = skip; }

  // Copies bytes [offset, offset + length) of tensor `id` into `dst` from the tensor's latest
  // copy wherever it is (host, device or nvme; zeros for a chunk never written), without
  // moving the chunk, taking a slot, pinning it or touching the eviction order: a reader beside
  // compute (a checkpoint save). The caller guarantees nobody writes those bytes meanwhile.
  // Errors: InvalidArgument for a range outside the tensor; IOError from an nvme read.
  Status read_tensor(TensorId id, uint64_t offset, uint64_t length, void* dst);

  // --- Schedule ---------------------------------------------------------------------------
  // The order in which chunks will be acquired, one entry per acquire; it repeats (the next
  // step follows the last entry). Replaces LRU by Belady eviction. An empty order clears it.
  // `tiers`, when given (one per entry), is where each entry will be acquired: prefetch()
  // moves an entry's chunk there instead of into its `to` tier. An entry naming the nvme tier
  // is never prefetched: it only tells eviction when its chunk is next (probably) used.
  void set_schedule(std::vector<ChunkId> order, std::vector<Tier> tiers = {});
  // Marks entry `position` of the schedule as the current one (call before its acquire).
  void advance(size_t position);
  // Starts moving the chunks of the next `lookahead` schedule entries that can be prefetched
  // (from the current one) into `to` (or each entry's tier from set_schedule): into free
  // slots, or into slots of copies not needed before them. An nvme-homed chunk reaches host by
  // this call and device by a later one, which waits for the read if it is still running. Where
  // a host slot needs its copy written back to nvme first, it starts that write and takes no
  // other host slot in this call; a later call waits only for what is left of the write. No
  // choice depends on how far a copy or disk request has got. Errors: failed write-backs.
  Status prefetch(size_t lookahead, Tier to = Tier::kDevice);

  // Blocks until every move issued so far has completed. Returns the first I/O error seen.
  Status synchronize();
  // Records the bytes in use per tier and kind as trace counters (core/trace.h) now; the space
  // also records them whenever they change. Call at a step's start so a trace begins with them.
  void trace_usage() const;

  ChunkSpaceStats stats() const;

 private:
  // Per-tier arrays (tiers_, a chunk's slot[] and valid[]) are indexed by the tier's number.
  static constexpr int kDevice = static_cast<int>(Tier::kDevice);
  static constexpr int kHost = static_cast<int>(Tier::kHost);
  static constexpr int kNvme = static_cast<int>(Tier::kNvme);
  static constexpr int idx(Tier t) { return static_cast<int>(t); }

  // The outcome of one nvme read or write, shared by the fences of the two slots it touches.
  struct IoFence {
    IoTicket ticket = 0;
    bool waited = false;
    Status status;
    bool read = false;
    ChunkId chunk = 0;       // the chunk whose host copy the read fills or the write saves
    uint32_t host_slot = 0;  // the host slot it fills or saves
    uint64_t version = 0;    // writes: ChunkState::version of the bytes written
  };

  // The last move that touched a slot.
  struct SlotFence {
    std::unique_ptr<Event> event;  // device and host slots: stream copies
    std::shared_ptr<IoFence> io;   // host and nvme slots: I/O not yet waited on
  };

  struct ChunkState {
    Tier home = Tier::kNvme;
    std::array<int64_t, kNumTiers> slot{-1, -1, -1};  // -1: no copy in that tier
    std::array<bool, kNumTiers> valid{};              // the copy holds the latest bytes
    std::array<bool, kNumTiers> prefetched{};         // the copy was made by prefetch()
    uint32_t pins = 0;
    Tier pinned_in = Tier::kDevice;
    bool zero = true;  // never written: reads as zeros, nothing to write back
    uint64_t last_use = 0;
    uint64_t version = 0;  // counts acquires for writing: a write-back saves one version
    ChunkKind kind = ChunkKind::kParam;
  };

  ChunkSpace(Device& device, IoEngine* io, ChunkLayout layout, const ChunkSpaceOptions& options);

  // Why a move happens (for the statistics).
  enum class MoveOrigin : uint8_t { kDemand, kPrefetch, kWriteBack };

  // All REQUIRE mu_ held.
  Result<ChunkId> new_chunk_home(ChunkKind kind, std::optional<Tier> home);
  Result<void*> acquire_locked(ChunkId id, Tier where, AccessMode mode, bool whole_chunk,
                               Stream* consumer);
  // A slot in `tier` for chunk `id`, evicting a copy when none is free. With `due` (prefetch),
  // only copies not needed within `due` schedule entries may go.
  Result<uint32_t> take_slot(Tier tier, ChunkId id, std::optional<uint64_t> due);
  std::optional<ChunkId> pick_victim(Tier tier, std::optional<uint64_t> due) const;
  Status evict_locked(ChunkId id, Tier from);
  void drop_copy(ChunkId id, Tier tier);
  // Starts the moves that make the chunk's copy in `tier` valid (it holds a slot there).
  // Blocks only where a device copy must wait for an nvme read into host.
  Status fill(ChunkId id, Tier tier, MoveOrigin origin);
  void zero_fill(ChunkId id, Tier tier, MoveOrigin origin);
  Status copy_up(ChunkId id, MoveOrigin origin);    // host -> device, on up_
  Status copy_down(ChunkId id, MoveOrigin origin);  // device -> host, on down_
  Status read_up(ChunkId id, MoveOrigin origin);    // nvme -> host, asynchronous
  Status write_down(ChunkId id);                    // host -> nvme, complete on return
  Status start_write_down(ChunkId id);              // host -> nvme, asynchronous
  // Whether dropping the chunk's host copy needs a write-back first (its only valid copy,
  // homed on nvme).
  bool needs_write_down(ChunkId id) const;
  // The write-back of the chunk's current host copy, when one is in flight or done but not yet
  // waited on; else null.
  IoFence* pending_write(ChunkId id);
  // For prefetch(): whether to take a host slot now. When the eviction it needs would write a
  // copy back, starts that write-back and says no; prefetch then takes no host slot for the
  // rest of the call. A later call that finds the write started says yes, and the eviction
  // waits for what is left of it. None of this depends on how far the disk has got.
  Result<bool> host_slot_ready(std::optional<uint64_t> due);
  void count_move(ChunkId id, Tier to, uint64_t ChunkSpaceStats::*field, MoveOrigin origin);
  // Fences. wait_io/wait_slot block; order_on blocks only for I/O. They return the status of
  // an I/O the slot was waiting for (a failed read has already marked its copy stale). A
  // `reader` of the slot does not wait for a write-back from it, which only reads it too.
  SlotFence& fence(Tier tier, int64_t slot);
  Status wait_io(IoFence& f);
  Status wait_slot(Tier tier, uint32_t slot, bool reader = false);
  Status order_on(Tier tier, uint32_t slot, Stream& stream, bool reader = false);
  void record_on(Tier tier, uint32_t slot, Stream& stream);
  uint64_t next_use(ChunkId id) const;  // schedule entries until the chunk's next use
  // Locks mu_ for the calls compute makes; with tracing on, the time spent waiting for
  // another caller (an optimizer thread writing back to nvme under the lock) is a stall span.
  std::unique_lock<std::mutex> lock_space() const;
  // Tracing: a slot of `t` changed hands (bytes of `kind` rose or fell by a chunk).
  void count_usage(Tier t, ChunkKind kind, bool taken);
  void trace_usage_locked(Tier t) const;
  TierSlots& tier(Tier t) const { return *tiers_[static_cast<int>(t)]; }

  Device& device_;
  IoEngine* const io_;
  const ChunkSpaceOptions options_;
  // Chaos mode (Device::chaos_seed): a device slot a chunk leaves is filled with 0xFF bytes (NaN
  // in fp32, bf16 and E4M3), ordered after its last use, so a read that missed its wait sees NaN.
  const bool poison_released_;
  std::atomic<bool> skip_acquire_wait_{false};

  mutable std::mutex mu_;
  ChunkLayout layout_;                                         // GUARDED_BY(mu_)
  std::array<std::unique_ptr<TierSlots>, kNumTiers> tiers_;    // GUARDED_BY(mu_)
  std::array<std::vector<SlotFence>, kNumTiers> fences_;       // GUARDED_BY(mu_); per slot
  std::array<std::vector<int64_t>, kNumTiers> owner_;          // GUARDED_BY(mu_); slot -> chunk
  std::array<uint32_t, kNumTiers> homes_{};                    // GUARDED_BY(mu_); home slots
  // The slots of each tier that no home holds, in slot order: the only ones pick_victim can
  // choose from. A home keeps its slot for good, so the list is rebuilt only after homes are added.
  mutable std::array<std::vector<uint32_t>, kNumTiers> guest_slots_;  // GUARDED_BY(mu_)
  mutable std::array<bool, kNumTiers> guest_slots_known_{};           // GUARDED_BY(mu_)
  std::vector<ChunkState> chunks_;                             // GUARDED_BY(mu_)
  std::unique_ptr<Stream> up_;    // host -> device copies
  std::unique_ptr<Stream> down_;  // device -> host copies
  std::vector<ChunkId> schedule_;                    // GUARDED_BY(mu_)
  std::vector<Tier> schedule_tiers_;                 // GUARDED_BY(mu_); empty or one per entry
  std::vector<std::vector<uint64_t>> uses_;          // GUARDED_BY(mu_); chunk -> positions
  uint64_t position_ = 0;                            // GUARDED_BY(mu_)
  // next_use's last answer per chunk, with the positions it holds for: no use of the chunk lies
  // in [from, at), so from any position there the next use is `at` (past the schedule's end: in
  // the next step). pick_victim asks for the chunk of every slot of a tier at every eviction.
  struct NextUse {
    uint64_t from = 1, at = 0;  // from > at: not known
  };
  mutable std::vector<NextUse> next_use_cache_;      // GUARDED_BY(mu_)
  uint64_t tick_ = 0;                                // GUARDED_BY(mu_); LRU clock
  std::optional<ChunkId> busy_;                      // GUARDED_BY(mu_); never a victim
  uint64_t blocked_ns_ = 0;                          // GUARDED_BY(mu_); time in blocking waits
  // Bytes of slots in use per tier and chunk kind (home and cached copies).
  std::array<std::array<uint64_t, kNumChunkKinds>, kNumTiers> usage_{};  // GUARDED_BY(mu_)
  ChunkSpaceStats stats_;                            // GUARDED_BY(mu_)
  // Chunks of kind kAct, counted as they are added: stats() is read after every entry of a
  // replayed step, so it must not walk the chunks.
  uint64_t act_chunks_ = 0;                          // GUARDED_BY(mu_)
};

}  // namespace strata
