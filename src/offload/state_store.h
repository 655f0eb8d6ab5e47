// StateStore: a model's training state (parameters, gradients, Adam moments) held in the
// ChunkSpace instead of flat buffers, addressed by tensor and acquired group by group.
//
// The model describes its tensors (in first-use order) and which group each belongs to (a
// group is what one compute phase touches at once: the embedding, one decoder layer, the LM
// head). Every tensor gets one chunk-space tensor per state kind; a group's tensors of a kind
// are packed into chunks of their own, so a group's chunks can live in a different tier than
// its neighbours'. The home tier of each (group, kind) comes from the caller (the planner's
// placement); other copies are cached where compute asks for them and evicted by Belady along
// the step program's schedule given to set_schedule() (offload/step_program.h).
//
// Parts: a tensor may also name a part of its group (StateTensor::part, e.g. the index of one
// expert of an MoE layer; kDensePart for the rest). A part of at least half a chunk is
// packed into chunks of its own; smaller ones (experts of a model whose largest tensor sets a
// far larger chunk size) share chunks with their neighbours instead of each
// padding a whole chunk, and come along when one of them is fetched. Either way a part can be
// acquired without the others: acquire_group() takes every part,
// acquire_part() one part along the schedule (the dense part, before compute), acquire_parts()
// several parts on demand, outside the schedule (the experts a router picked: which ones is only
// known once the router has run).
//
// Update slices: AdamW in host memory holds every kind of what it updates at once, and a whole
// group of a large model (an embedding of a large vocabulary: tens of chunks of each kind) would
// set the host memory a run needs. So each group's tensors are also split, in order, into runs
// whose state of each kind lies in one chunk (update_slices); acquire_slice() pins one run's
// chunks of a kind, and the optimizer (and loading or restoring a kind) goes slice by slice:
// five chunks at a time, one per kind, whatever the group's size.
//
// Slices: a group that holds only its tensors' slices of a kind (a data-parallel rank's ranges,
// StateStoreOptions::sliced) packs them on from where the group before it ended, when the chunk
// it would continue in lives where the group's are homed, instead of opening a chunk of its own. A rank of W holds 1/W of each group: padding every group's slices
// to whole chunks would keep a rank's share from shrinking with W (a layer's slices at W = 64 are
// a sixteenth of a chunk sized for the largest tensor). A chunk holding two groups' slices is
// never overwritten whole (kWrite reads it first), and acquiring one group pins it. A part's slices
// are packed largest first, the smaller ones filling the tails that the larger leave (fill_order):
// a rank's slices are small beside a chunk, and packing them in order left up to a slice's worth
// of each chunk empty. The order of a part's tensors in its chunks matters to nothing else. Two groups
// that share a chunk may be acquired in different tiers one after the other (each group's AdamW
// where its moments live), never at once: the step's only concurrent acquisitions (an optimizer or
// a communication thread beside compute) are of kinds ZeRO-1 holds whole.
//
// Small groups: a group with frozen tensors whose optimizer state (master, moments) is under half
// a chunk packs it on from where the group before it ended too, as slices do (LoRA's adapters:
// the chunk is sized for the frozen weights' compute copies, and a chunk per layer and kind would
// be almost all padding). packs_small_group() says which.
//
// Ownership: the Device and IoEngine must outlive the store. Pointers from pointer() are valid
// until the matching release. Thread safety: safe for concurrent use from several threads for
// different groups (the ChunkSpace serializes), e.g. AdamW threads on host groups while compute
// works on device groups, except two groups whose slices share a chunk in different tiers at once
// (see "Slices": that fails with InvalidArgument); acquire_parts() from one thread at a time.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "memory/chunk_space.h"
#include "core/io_engine.h"
#include "offload/state_layout.h"

namespace strata {


// StateTensor::part of the tensors that belong to no part of their own.
inline constexpr int kDensePart = -1;
// GroupAccess::part for an acquisition of every part of the group.
inline constexpr int kAllParts = -2;

struct StateTensor {
  std::string name;  // e.g. "model.layers.3.mlp.up_proj.weight"
  uint64_t elements = 0;
  int group = 0;
  int part = kDensePart;  // >= 0: a part of the group with chunks of its own (e.g. an expert)
  int64_t matrix_rows = 0;  // > 0: a linear layer's weight of this many rows (StateShape)
  // The elements this store holds of the kinds StateStoreOptions::sliced names (a data-parallel
  // rank's range, placement.h); none: the whole tensor. An empty range holds nothing.
  std::optional<ElementRange> slice;
  // This store holds nothing of the tensor, in any kind: other ranks hold all of it (an expert
  // that another rank of an expert group computes, model/expert_parallel.h).
  bool elsewhere = false;
  // Not trained: the store holds its compute copy alone (StateShape::frozen).
  bool frozen = false;
  StateShape shape() const { return {elements, matrix_rows, frozen}; }
  // The shape of what the store holds of a kind that is sliced (`sliced`) or whole.
  StateShape shape(bool sliced) const {
    if (elsewhere) return {0, 0};
    return sliced && slice ? StateShape{slice->count, matrix_rows, frozen} : shape();
  }
  // The range held: the slice of a sliced kind, else every element; none when elsewhere.
  ElementRange held(bool sliced) const {
    if (elsewhere) return {0, 0};
    return sliced && slice ? *slice : ElementRange{0, elements};
  }
};

// How an acquisition relates to the schedule's cursor (the entry the store takes as now).
enum class ScheduleCursor : uint8_t {
  // The next entry matching it becomes the current one, and the entries after it are prefetched.
  kFollow,
  // An acquisition beside the cursor, on another thread than the one that moves it (the
  // gradient sums at handover, train/paged_state.h): its entry was prefetched with its neighbours and
  // eviction counts it as a use, but wherever that thread has got to, it moves nothing.
  kBeside,
};

// One acquisition in the step's schedule: a group's chunks of a kind (all its parts, or one),
// or (activation >= 0) the chunks of one activation buffer (group, kind and part unused).
struct GroupAccess {
  int group = 0;
  StateKind kind = StateKind::kParam;
  int activation = -1;
  int part = kAllParts;
  // Where the acquisition will happen, so that prefetch moves the chunks there (e.g. host for
  // AdamW on host memory). Not part of an access's identity: acquires match entries without it.
  Tier prefetch_to = Tier::kDevice;
  // false: a use that may or may not happen (an expert, fetched after routing if it got
  // tokens): never prefetched, but eviction counts it as the chunks' next use, so that what is
  // probably needed soon is not evicted first. Not part of an access's identity either.
  bool prefetch = true;
  // kBeside: an entry of an acquisition beside the cursor, which kFollow acquisitions never
  // match. Not part of an access's identity.
  ScheduleCursor cursor = ScheduleCursor::kFollow;
  // >= 0: one update slice of the group (StateStore::acquire_slice; part unused). kWholeGroup:
  // none. kEachSlice: a step program's mark for an update to be made slice by slice, which
  // expand_update_slices (step_program.h) turns into one batch per slice.
  int slice = -1;
  static GroupAccess of_activation(int i) { return {0, StateKind::kParam, i}; }
  static GroupAccess of_part(int group, StateKind kind, int part) { return {group, kind, -1, part}; }
  static GroupAccess of_slice(int group, StateKind kind, int slice) {
    GroupAccess a{group, kind};
    a.slice = slice;
    return a;
  }
  bool operator==(const GroupAccess& o) const {
    return group == o.group && kind == o.kind && activation == o.activation && part == o.part && slice == o.slice;
  }
};

// GroupAccess::slice values that name no slice.
inline constexpr int kWholeGroup = -1;
inline constexpr int kEachSlice = -2;

// The home tier of the chunks of a kind that a part of a group opens (StateStoreOptions::home).
using HomeOf = std::function<Tier(int group, StateKind kind, int part)>;

struct StateStoreOptions {
  ChunkSpaceOptions space;  // budgets and nvme directory; chunk_bytes 0 = choose the size
  size_t lookahead = 2;     // schedule entries prefetched ahead of the one being acquired
  // Which kinds of state exist and their element types (offload/state_layout.h).
  StateLayout layout;
  // The home tier of the chunks of a kind that a part of a group opens (kDensePart: the group's
  // first chunks and those of every part without chunks of its own; placement.h). Empty: the
  // ChunkSpace's default (the lowest tier with room).
  HomeOf home;
  // Which groups hold only each tensor's StateTensor::slice of a kind (a data-parallel rank's
  // range of the optimizer state: ZeRO-1). Empty: none; every kind is held whole.
  std::function<bool(int group, StateKind kind)> sliced;
};

class StateStore {
 public:
  static Result<std::unique_ptr<StateStore>> create(Device& device, IoEngine* io,
                                                    std::vector<StateTensor> tensors,
                                                    const StateStoreOptions& options);
  // The chunk size create() chooses when options.space.chunk_bytes is 0: at least the largest
  // tensor, wasting the least padding when each part is packed on its own.
  // Over every kind of `layout`, each tensor in its bytes of that kind (the widest must fit).
  static uint64_t auto_chunk_bytes(const std::vector<StateTensor>& tensors, const StateLayout& layout = {});
  // Chunks of `kind` each group takes in chunks of `chunk_bytes`, packed as create() packs them
  // under `layout`: what the planner needs to count padding exactly. REQUIRES: every tensor
  // fits a chunk.
  // With `sliced` each tensor's StateTensor::slice is packed instead of the whole tensor, and a
  // group's slices continue in the chunk of the group before it when `home` homes the two
  // groups alike (no `home`: always), as create() packs them (see "Slices" below).
  static std::vector<uint64_t> group_chunks(const std::vector<StateTensor>& tensors, uint64_t chunk_bytes,
                                            const StateLayout& layout = {}, StateKind kind = StateKind::kGrad,
                                            bool sliced = false, const HomeOf& home = {});
  // The same per part: for each group, its parts in order (the dense part first), each with the
  // chunks packing it opens and whether it opens its first one itself (else it begins in the
  // chunk of the part before it, and shares that chunk's home).
  struct PartChunks {
    int part = kDensePart;
    uint64_t chunks = 0;
    bool own = true;
  };
  static std::vector<std::vector<PartChunks>> part_chunks(const std::vector<StateTensor>& tensors,
                                                          uint64_t chunk_bytes, const StateLayout& layout,
                                                          StateKind kind, bool sliced = false,
                                                          const HomeOf& home = {});
  // Packs a part's tensors of `bytes` (each in its bytes of one kind) through `pack` (given the
  // index), in the order create() does: without `fills` in order; with it (slices), largest
  // first, each time the largest left that does not open a chunk (`opens(bytes)` false, as
  // packed so far), else the largest left. Stops at the first error `pack` returns.
  static Status fill_order(const std::vector<uint64_t>& bytes, bool fills, const std::function<bool(uint64_t)>& opens,
                           const std::function<Status(size_t)>& pack);
  // part_chunks() of one kind, with the tensors' bytes worked out once, to be counted under many
  // homes (the planner's placements while it spills) without rebuilding them.
  class Packing {
   public:
    Packing(const std::vector<StateTensor>& tensors, uint64_t chunk_bytes, const StateLayout& layout, StateKind kind,
            bool sliced);
    std::vector<std::vector<PartChunks>> count(const HomeOf& home = {}) const;
    // Whether some group with trained state packs on as a small one (packs_small_group; a group
    // with none, an untrained MTP module's in full fine-tuning, packs on too but holds nothing).
    bool packs_small() const { return packs_small_trained_; }

   private:
    struct PartBytes {
      int id = kDensePart;
      bool opens_own = true;        // a part after the first that opens a chunk of its own
      std::vector<uint64_t> bytes;  // each tensor's, in order
    };
    std::vector<std::vector<PartBytes>> groups_;
    std::vector<bool> small_;  // per group: packs_small_group
    bool packs_small_trained_ = false;
    uint64_t chunk_bytes_ = 0;
    StateKind kind_ = StateKind::kParam;
    bool sliced_ = false;
  };
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  int num_groups() const { return num_groups_; }
  size_t num_tensors() const { return tensors_.size(); }
  const StateTensor& tensor(size_t i) const { return tensors_[i]; }
  uint64_t chunk_bytes() const { return space_->chunk_bytes(); }

  // The order in which a training step acquires groups; repeats every step. Belady eviction
  // and prefetch follow it.
  void set_schedule(const std::vector<GroupAccess>& accesses);
  // The schedule entry the next kFollow acquisition searches from.
  size_t schedule_cursor() {
    std::lock_guard<std::mutex> lock(schedule_mu_);
    return schedule_pos_;
  }

  // Pins every chunk holding `kind` tensors of `group` in `where` (moving and prefetching as
  // needed). Afterwards pointer(i, kind) is valid for the group's tensors.
  // With `consumer` (stream-ordered, as acquire_part): the stream waits for the chunks' moves
  // and for the work they wait on, instead of the host (which then never waits holding the
  // chunk space). REQUIRES: no part of the group is acquired for `kind`.
  Status acquire_group(int group, StateKind kind, Tier where, AccessMode mode,
                       ScheduleCursor cursor = ScheduleCursor::kFollow, Stream* consumer = nullptr);
  void release_group(int group, StateKind kind, Stream* consumer = nullptr);
  // The same for one part of the group (following its schedule entry GroupAccess::of_part, when
  // the schedule has one). REQUIRES: the group has the part (kDensePart always exists).
  // With `consumer` (stream-ordered): the consumer stream waits for the chunks' moves instead of
  // the host, and later moves of them wait for the work queued on it before release.
  // follow = false: an acquisition ahead of its entry (a gather prefetched for the next batch):
  // the cursor stays where it is, and later acquisitions pass the entry by.
  Status acquire_part(int group, int part, StateKind kind, Tier where, AccessMode mode, Stream* consumer = nullptr,
                      bool follow = true);
  // The schedule passes the part's entry as an acquisition following it would (the cursor moves
  // past it and the entries after it are prefetched), acquiring nothing: where an acquisition
  // ahead of its entry (follow = false) stands for it.
  Status pass_part(int group, int part, StateKind kind, Tier where);
  void release_part(int group, int part, StateKind kind, Stream* consumer = nullptr);
  // Several parts at once, on demand: not in the schedule (nothing is prefetched for them or
  // ahead of them) and the moves of all their chunks are started before any is waited for.
  // On error nothing stays acquired. REQUIRES: as acquire_part for each part.
  Status acquire_parts(int group, std::span<const int> parts, StateKind kind, Tier where, AccessMode mode,
                       Stream* consumer = nullptr);
  void release_parts(int group, std::span<const int> parts, StateKind kind, Stream* consumer = nullptr);
  // Update slices (see above): how many a group has (at least 1), and the tensors of one.
  int update_slices(int group) const { return static_cast<int>(slices_.at(static_cast<size_t>(group)).size()); }
  const std::vector<size_t>& slice_tensors(int group, int slice) const {
    return slices_.at(static_cast<size_t>(group)).at(static_cast<size_t>(slice)).tensors;
  }
  // Pins the chunk holding the `kind` state of one update slice of a group (none when the slice
  // holds none of that kind), as acquire_group does the group's: pointer() is then valid for
  // the slice's tensors that hold some. Its chunk may hold other slices' tensors, so kWrite reads
  // it first. REQUIRES: the slice is not acquired for `kind`.
  Status acquire_slice(int group, int slice, StateKind kind, Tier where, AccessMode mode,
                       ScheduleCursor cursor = ScheduleCursor::kFollow, Stream* consumer = nullptr);
  void release_slice(int group, int slice, StateKind kind, Stream* consumer = nullptr);
  // After the last read of a released group's `kind` (slice kWholeGroup) or of one of its update
  // slices, before a later acquisition overwrites it (ProgramEvent::discard): its chunks read as
  // zeros from now on and none of their copies is written back (ChunkSpace::discard). Chunks
  // that also hold another group's state, or a later slice's, are left as they are.
  void discard(int group, int slice, StateKind kind);
  // Zeroes a released group's `kind` (the gradients before a step) without moving a byte: where
  // none of its chunks holds another group's state, discards them all (they read as zeros) and
  // says true. False, changing nothing, where one does: the caller acquires the group and
  // writes the zeros.
  bool zero_by_discard(int group, StateKind kind);
  // After a pass over a released slice in `where` (loading, restoring or reading the state
  // there): each of its chunks of `kind` homed elsewhere goes home (written back where this was
  // its only valid copy) and gives its slot in `where` back, unless the group's next slice holds
  // it too. So a pass over the whole state through host memory reuses a few host slots, slice
  // after slice, instead of leaving a copy of everything there.
  Status send_slice_home(int group, int slice, StateKind kind, Tier where);
  // REQUIRES: tensor i's group or part is acquired for `kind`. raw_pointer() for any kind (its
  // bytes are layout().tensor_bytes(kind, tensor(i).shape(sliced(group, kind)))); pointer() for
  // the fp32 kinds. Of a sliced kind they point at the slice's first element.
  void* raw_pointer(size_t i, StateKind kind) const;
  float* pointer(size_t i, StateKind kind) const;
  const StateLayout& layout() const { return layout_; }
  // Whether group g holds only its tensors' slices of `kind` (StateStoreOptions::sliced).
  bool sliced(int group, StateKind kind) const {
    return sliced_[static_cast<size_t>(group) * kNumStateKinds + static_cast<size_t>(kind)];
  }
  // The elements of tensor i's `kind` state this store holds (StateTensor::held).
  ElementRange held(size_t i, StateKind kind) const {
    if (tensors_[i].frozen && kind != StateKind::kParam) return {0, 0};  // the compute copy alone
    return tensors_[i].held(sliced(tensors_[i].group, kind));
  }
  // Copies floats [first, first + count) of tensor i's `kind` state (an fp32 kind; of a sliced
  // kind, counted from the slice's first element) into `dst` from wherever its latest copy is, without moving or pinning anything
  // (ChunkSpace::read_tensor). The caller guarantees nobody writes them meanwhile.
  Status read_tensor(size_t i, StateKind kind, uint64_t first, uint64_t count, float* dst);
  // The same for bytes [first, first + count) of any kind's stored form.
  Status read_tensor_bytes(size_t i, StateKind kind, uint64_t first, uint64_t count, void* dst);
  // Tensors of a group, in order.
  const std::vector<size_t>& group_tensors(int group) const { return group_tensors_[group]; }
  // Chunks holding the `kind` tensors of one part of a group.
  size_t part_chunk_count(int group, int part, StateKind kind) const {
    return parts_[group][part_index(group, part)].chunks[static_cast<int>(kind)].size();
  }

  // Activation buffers (activations saved at layer boundaries, DESIGN §3.3): `count` buffers of
  // `bytes` bytes each (of whatever type the model's activations are), in chunks of kind kAct
  // homed in host memory (NVMe when the host tier is full) and always accessed there. Buffers no
  // larger than a chunk are packed whole, as many to a chunk as fit (a large model's chunk holds
  // a dozen: one each would take a chunk per layer); a larger buffer takes chunks of its own, in
  // pieces of a chunk. A buffer sharing its chunk is written in place, its neighbours kept.
  // host_chunks >= 0: the first host_chunks chunks are homed in host memory and the rest on NVMe
  // (the plan's placement, Placement::activation_host_chunks); -1: as many as the host holds.
  // Call before set_schedule(); at most once.
  Status add_activations(int count, uint64_t bytes, int64_t host_chunks = -1);
  // Chunks of `chunk_bytes` that add_activations(count, bytes) takes.
  static uint64_t activation_chunks(int count, uint64_t bytes, uint64_t chunk_bytes);
  int num_activations() const { return static_cast<int>(act_chunks_.size()); }
  // Chunks holding the training state (every kind, each chunk once, wherever homed): the
  // activation buffers' chunks are not among them.
  uint64_t state_chunks() const { return state_chunks_; }
  // Copies the first `bytes` bytes of `data` into buffer i / of buffer i into `data`,
  // through host memory. InvalidArgument when i or bytes is out of range; IOError and the
  // like from moving the chunks. A null `data` moves the chunks as a copy would and copies
  // nothing (what the planner's replay, offload/replay.h, does).
  Status write_activation(int i, const void* data, uint64_t bytes);
  Status read_activation(int i, void* data, uint64_t bytes);

  // Home tier of a group's first chunk of `kind` (its dense part's), and of the first chunk of
  // `kind` that a part holds (which it shares with the part before it when it opens none).
  Tier home(int group, StateKind kind) const;
  Tier part_home(int group, int part, StateKind kind) const;
  // The parts of a group with tensors of their own (StateTensor::part >= 0), ascending.
  std::vector<int> parts(int group) const;
  Status synchronize() { return space_->synchronize(); }
  // The ChunkSpace's statistics, with the time acquire_parts() waited for its moves added to
  // the stall time of the tier it acquired in.
  ChunkSpaceStats stats() const;
  ChunkSpace& space() { return *space_; }

 private:
  StateStore() = default;
  // One update slice of a group: its tensors (consecutive in the group's order) and, per kind,
  // the chunk holding them (none when they hold nothing of that kind).
  struct Slice {
    std::vector<size_t> tensors;
    std::array<std::vector<ChunkId>, kNumStateKinds> chunks;
    std::array<bool, kNumStateKinds> pinned{};
  };
  // The update slices of every group, once the tensors are packed.
  void make_slices();
  // One part of a group: its tensors (in order) and, per kind, the chunks holding them.
  struct Part {
    int id = kDensePart;
    std::vector<size_t> tensors;
    std::array<std::vector<ChunkId>, kNumStateKinds> chunks;  // may be shared with neighbouring parts
    std::array<bool, kNumStateKinds> pinned{};
  };
  // Bytes a part's tensors take in a chunk of `kind`, alignment included, counted as fp32
  // elements (a part pages alike in every kind); frozen tensors count only in the compute copy.
  // `sliced`: of a sliced kind, what each tensor's slice holds.
  static uint64_t part_bytes_of(const std::vector<StateTensor>& tensors, const Part& part, const StateLayout& layout,
                                StateKind kind, bool sliced);
  // Whether part pi of a group starts a chunk of its own (else it fills the chunk before it).
  // A part of a sliced kind whose slices are all empty (an expert another rank owns whole) opens
  // none.
  static bool opens_own_chunk(const std::vector<StateTensor>& tensors, const std::vector<Part>& parts, size_t pi,
                              const StateLayout& layout, StateKind kind, bool sliced, uint64_t chunk_bytes);
  // The parts of each group: the dense part first, then the others by id; each lists its
  // tensors (indices into `tensors`) in order.
  static std::vector<std::vector<Part>> make_parts(const std::vector<StateTensor>& tensors, int num_groups);
  // Whether a group's state of `kind` is small enough to pack on from the chunk before it though
  // it is whole: the optimizer's own kinds (master, moments) of a group with frozen tensors, whose
  // trained tensors hold under 1/kOwnChunkFraction of a chunk of them (LoRA's adapters, in chunks
  // sized for the frozen weights' compute copies). Only the optimizer acquires these kinds, one
  // group at a time in the tier they live in, so two groups sharing a chunk never meet in two
  // tiers. Full fine-tuning never packs so.
  static bool packs_small_group(const std::vector<StateTensor>& tensors, const std::vector<Part>& parts,
                                const StateLayout& layout, StateKind kind, bool sliced, uint64_t chunk_bytes);
  // Whether group g's state of `kind` may continue in the chunk before it: the kind is sliced (or
  // the group small, packs_small_group), g is not the first group, and `home` (when given) homes
  // g's dense part where `last` (the tier of the part that opened the chunk before) is.
  static bool continues_group(int g, StateKind kind, bool sliced, const HomeOf& home, std::optional<Tier> last);
  // Index in parts_[group]. REQUIRES: the group has the part.
  size_t part_index(int group, int part) const;
  // Pins the chunks of parts_[group][parts...] (in that order) in `where`. With `entry`, each
  // acquisition advances the schedule and the next entries are prefetched; with `consumer`, the
  // moves all start before the caller waits for them (on that stream) at the end.
  // wait_on_host: the host waits for the consumer stream afterwards (the demand stream's use).
  Status pin(int group, const std::vector<size_t>& parts, StateKind kind, Tier where, AccessMode mode,
             std::optional<size_t> entry, Stream* consumer, bool wait_on_host);
  void unpin(int group, const std::vector<size_t>& parts, StateKind kind, Stream* consumer);
  std::vector<size_t> part_indices(int group, std::span<const int> parts) const;

  // Waits for the moves of acquire_parts(); declared first so that it outlives the ChunkSpace.
  std::unique_ptr<Stream> demand_stream_;
  std::array<std::atomic<uint64_t>, kNumTiers> demand_stall_ns_{};  // per tier, waiting on it
  std::unique_ptr<ChunkSpace> space_;
  std::vector<StateTensor> tensors_;
  int num_groups_ = 0;
  std::vector<std::vector<size_t>> group_tensors_;
  std::vector<std::array<TensorId, kNumStateKinds>> ids_;  // per tensor
  std::vector<std::array<void*, kNumStateKinds>> ptrs_;    // per tensor, while acquired
  StateLayout layout_;
  std::vector<std::vector<Part>> parts_;  // per group: kDensePart first, then the others ascending
  std::vector<std::vector<Slice>> slices_;  // per group, at least one
  std::vector<bool> shared_;  // per chunk: it holds more than one part
  std::vector<bool> shared_by_groups_;  // per chunk: it holds slices of more than one group
  uint64_t state_chunks_ = 0;
  std::vector<Tier> homes_;  // per group * kind
  // Schedule: the chunk order handed to the ChunkSpace, and for each group access where it starts.
  std::vector<GroupAccess> schedule_;
  std::vector<size_t> schedule_chunk_start_;
  std::mutex schedule_mu_;  // guards schedule_pos_
  size_t schedule_pos_ = 0;
  // Activation buffers: the chunks of each (one piece of up to chunk_bytes each), their bytes,
  // where each starts in its first chunk, and how many share a chunk (1: each has its own).
  std::vector<std::vector<ChunkId>> act_chunks_;
  std::vector<uint64_t> act_offsets_;
  uint64_t act_per_chunk_ = 1;
  uint64_t act_bytes_ = 0;

  // The next schedule entry matching `access` from the current position (advancing past it).
  std::optional<size_t> next_entry(const GroupAccess& access);
  Status copy_activation(int i, char* data, uint64_t bytes, bool to_store);
  size_t lookahead_ = 2;
  std::vector<bool> sliced_;  // [group * kNumStateKinds + kind]
};

}  // namespace strata
