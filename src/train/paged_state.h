// PagedState: the training state of a model held in the chunk address space, with the
// optimizer run where that state lives (DESIGN §3.2-3.3). It is the model's ParamAccess: the
// model begins and ends parameter groups as it computes, and PagedState acquires their chunks
// in device memory, prefetching along the step's schedule and letting Belady eviction push
// the rest to pinned host memory and NVMe.
//
// Experts (MoE layers): each expert's tensors are a part of the layer's group with chunks of
// their own (StateStore parts). begin() acquires only the dense part (attention, router, shared
// expert); after routing, begin_experts() fetches the experts that received tokens, all of
// them at once, on demand: routing is data dependent, so the experts are not in the schedule and
// are not prefetched ahead of it. Experts without tokens in a micro-batch are never fetched and
// get no gradient chunks acquired, except where the ranks hold slices of a kind: ZeRO-3 gathers
// every expert's weights and ZeRO-2 sums every expert's gradients, on every rank, so that the
// ranks' collectives match; zero_grads() and AdamW still cover every expert (an expert
// without tokens has a zero gradient, and AdamW decays its moments and weights as the flat
// AdamW does).
//
// Precision (PagedStateOptions::precision): with fp32 the parameters are the master; with bf16
// the chunks hold a bf16 compute copy (what param() hands the model) and an fp32 master in
// chunks of its own kind, and AdamW updates the master and writes the copy. Checkpoints and
// load/store_params see the fp32 master either way.
//
// One step: zero_grads(), then the model's forward/backward over each micro-batch (which calls
// begin/end), then clip_and_step(): the global gradient norm (summed tensor by tensor in layout
// order, like AdamW::clip_gradients) and AdamW per group, on the device tier for groups whose
// Adam moments live there and with the SIMD CPU AdamW in host memory for the others (NVMe-homed
// moments are read into host slots and written back by eviction). With offload_activations it
// also keeps the model's offloaded saved activations (layer checkpoints), in host memory. Both
// AdamW paths are bitwise equal to the reference, so where a group is updated never changes the
// result: N steps under any budgets give bitwise the parameters of an unpaged run.
//
// Ownership: borrows the Device and IoEngine, which must outlive it. Not thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/device.h"
#include "core/io_engine.h"
#include "core/trace.h"
#include "model/param_access.h"
#include "model/params.h"
#include "offload/placement.h"
#include "kernels/adamw.h"
#include "offload/state_store.h"
#include "offload/step_program.h"
#include "parallel/comm.h"
#include "train/optimizer.h"
#include "train/group_workspace.h"
#include "train/savable_state.h"
#include "train/state_kernels.h"

namespace strata {

struct PagedStateOptions {
  uint64_t device_bytes = 0;  // device tier (chunks only; activations are budgeted apart)
  uint64_t host_bytes = 0;
  uint64_t nvme_bytes = 0;    // 0 = no nvme tier
  std::string nvme_dir;
  uint64_t chunk_bytes = 0;   // 0 = choose the size that wastes the least padding
  size_t lookahead = 2;       // groups prefetched ahead
  int64_t grad_accum = 1;     // micro-batches per step (for the schedule)
  // Home and sharding of each group's state of each kind (the plan's placement). None: every chunk
  // in the lowest tier with room, all of it this process's.
  std::optional<Placement> placement;
  // Activation offload (DESIGN §3.3): keep the model's offloaded layer checkpoints (saved
  // activations, param_access.h) in kAct chunks homed in host memory. activation_tokens = B * T
  // of one micro-batch; micro-batches may be smaller, never larger.
  bool offload_activations = false;
  int64_t activation_tokens = 0;
  OptimizerConfig optimizer;
  // The precision recipe: which kinds of state exist and in what dtype (offload/state_layout.h).
  // bf16: the chunks hold a bf16 compute copy beside the fp32 master, and AdamW writes both.
  Precision precision = Precision::kFp32;
  // How the Adam moments are stored (kernels/moments.h): fp32, bf16 or 8-bit blocks. Compact
  // moments are decoded, updated in fp32 by AdamW's rule and encoded again; checkpoints and
  // store_moments see them decoded. Stochastic rounding draws from (step, tensor, element).
  kernels::MomentFormat moments = kernels::MomentFormat::kF32;
  bool stochastic_rounding = false;
  // The arithmetic on state in the device tier (train/state_kernels.h): the device's backend's.
  // Null: the CPU's (the CPU backend, whose device memory is host memory). Borrowed.
  StateKernels* device_kernels = nullptr;
  // Start AdamW on each group as soon as its gradients are final in the step's last micro-batch,
  // on a worker thread, while backward continues on earlier layers. Requires grad_clip = 0.
  bool overlap_optimizer = false;
  // Data parallelism: this process's rank. With sharded optimizer state (ZeRO-1 over element
  // ranges, Placement::sharded) each rank holds the master weights and Adam moments of its range
  // of every tensor only (tensor_shard), updates that range and sends its new compute copy to
  // the other ranks (set_comm); every rank holds every group's compute copy and gradients.
  int rank = 0;
  // Data parallelism (a placement over several ranks): sum each group's gradients over the ranks
  // as the step's last micro-batch hands it over (step_program.h), on a thread of their own with
  // a Comm of their own (set_comm's `handover`), hidden behind the backward of the groups before
  // it. Not with overlap_optimizer.
  bool overlap_reduction = false;
  // Expert parallelism (model/expert_parallel.h): the ranks of an expert group, P > 1 (the
  // placement's world a multiple of it). Rank r then holds no state of any kind of the experts
  // other ranks of its group compute (StateTensor::elsewhere): only of expert_range(E, P, r % P).
  // Those experts' state is shared out over the W / P ranks holding them (r / P among them), as
  // dense tensors' are over all W, and their sums and gathers run over those ranks (set_comm's
  // `experts`). REQUIRES with P > 1: a sharded placement (ZeRO >= 1), and overlap_reduction only
  // with the gradients sliced (ZeRO-2 and 3: the dense parts' collectives on the communication
  // stream; the experts' stay on the compute stream).
  int expert_ranks = 1;
  // ZeRO-3 with overlap_reduction: how many groups' gathers run ahead of compute along the step
  // program (the plan's Plan::gather_ahead, as the device budget allows); the gathered weights'
  // workspace holds that many groups in flight.
  int gather_ahead = 1;
};

// What create() reserves in host memory: a slot of chunk_bytes for every chunk the state can
// occupy there (every kind's, and the offloaded saved activations'), one more slot for
// staging moves to and from disk when there is an nvme tier, and no more than the host budget.
struct HostTierSize {
  uint64_t chunk_bytes = 0;
  uint64_t state_chunks = 0;       // every chunk of every kind of state
  uint64_t host_home_chunks = 0;   // those homed in host memory (all of them without a placement)
  // Those homed on the device that the optimizer reads or writes in host memory every step (the
  // weights, master and gradients of a group whose Adam moments are not on the device).
  uint64_t host_update_chunks = 0;
  // The most host slots a pass over the state (loading, restoring) holds at once: two
  // consecutive slices of two kinds, or a group's whole master (kept until its compute copy is
  // refreshed from it) and a slice of the copy.
  uint64_t pass_chunks = 4;
  uint64_t activation_chunks = 0;  // offloaded layer checkpoints (saved activations)
  uint64_t staging_chunks = 0;     // the free slot an nvme tier stages through
  uint64_t state_bytes = 0;        // the state's bytes in those chunks (the rest is padding)
  uint64_t reserved_bytes = 0;     // min(host budget, all those chunks): what is reserved
};

class PagedState : public model::ParamAccess, public SavableState {
 public:
  ~PagedState() override;
  static Result<std::unique_ptr<PagedState>> create(Device& device, IoEngine* io,
                                                    const model::ParamLayout& layout,
                                                    const PagedStateOptions& options);

  // The chunk size create() chooses for `layout` when options.chunk_bytes is 0.
  // The store's tensors for `layout`, as create() registers them (a linear weight in row blocks
  // is one tensor per block): what the planner's traffic replay builds its store from.
  static std::vector<StateTensor> store_tensors(const model::ParamLayout& layout);
  // The same for data-parallel rank `rank` of `world` (world > 1): each with the slice of its
  // elements the rank owns (StateTensor::slice), what a sharded optimizer's kinds hold.
  // With expert_ranks P > 1 (expert parallelism), the experts other ranks of its expert group
  // compute are elsewhere, and an expert's slices are shared out over the ranks that hold it.
  static std::vector<StateTensor> store_tensors(const model::ParamLayout& layout, const StateLayout& state, int rank,
                                                int world, int expert_ranks = 1);
  static uint64_t auto_chunk_bytes(const model::ParamLayout& layout, const StateLayout& state = {});
  // The most bytes any kind of state of tensor t's largest row block takes (its fp32 kinds, or a
  // frozen tensor's compute copy): what a chunk must hold.
  static uint64_t largest_block_bytes(const model::ParamLayout& layout, const model::TensorSpec& t,
                                      const StateLayout& state);
  static uint64_t auto_chunk_bytes(const model::ParamLayout& layout, Precision precision) {
    return auto_chunk_bytes(layout, StateLayout::of(precision));
  }
  // Chunks of `kind` each parameter group of `layout` takes in chunks of `chunk_bytes`
  // (model::param_group_of numbering) under the recipe's `state` layout, as create() packs them.
  static std::vector<uint64_t> group_chunks(const model::ParamLayout& layout, uint64_t chunk_bytes,
                                            const StateLayout& state = {}, StateKind kind = StateKind::kGrad);
  // Parameters (elements) of each parameter group of `layout`, model::param_group_of numbering.
  static std::vector<uint64_t> group_elements(const model::ParamLayout& layout);
  // Bytes of `kind` over every tensor of `layout` under `state` (alignment left out).
  static uint64_t state_bytes(const model::ParamLayout& layout, const StateLayout& state, StateKind kind);
  // Device bytes of the workspace backward writes full gradients into when the ranks hold only
  // their slices of the sums (ZeRO-2): beside the chunks, what the planner keeps free for it.
  // `overlapped` (collectives on the communication stream): with room for a group in flight.
  static uint64_t gradient_working_bytes(const model::ParamLayout& layout, bool overlapped = false);
  // The same for ZeRO-3's gathered weights under the recipe's `state` layout.
  // `ahead`: groups in flight (PagedStateOptions::gather_ahead; 0 without overlap).
  static uint64_t param_working_bytes(const model::ParamLayout& layout, const StateLayout& state, int ahead = 0);
  // The state layout `options` ask for.
  static StateLayout state_layout(const PagedStateOptions& options) {
    return StateLayout::of(options.precision, options.moments);
  }
  // The host tier create() reserves for `options` (host_bytes is the budget; 0: no host tier).
  // When a tensor does not fit a chunk (create() refuses it) the whole budget is reported.
  static HostTierSize host_tier_size(const model::ParamLayout& layout, const PagedStateOptions& options);

  // Copies parameters in from / out to a flat buffer of layout.total_size() floats.
  Status load_params(const float* flat);
  Status store_params(float* flat);
  // Whether ZeRO-2 and 3's collectives run on the communication stream now (options'
  // overlap_reduction with sliced gradients, and set_comm's `handover` of several ranks).
  bool overlaps_collectives() const {
    return plans_overlapped_collectives() && handover_comm_ != nullptr && handover_comm_->world_size() > 1;
  }
  // Copies the gradients out (tests compare them across backends).
  Status store_grads(float* flat);
  // Copies the Adam moments out / in.
  Status store_moments(float* m_flat, float* v_flat);
  Status load_moments(const float* m_flat, const float* v_flat);
  // Calls fill(tensor, data) for every tensor with its `kind` state acquired in host memory
  // for writing, group by group, so that a checkpoint is restored without a second copy of
  // the state. Stops at the first error.
  Status fill_kind(StateKind kind, const TensorFill& fill, TensorSet which = TensorSet::kAll) override;
  // The fp8 recipe: calls fill(tensor, copy) for every E4M3 block-quantised compute copy (a linear
  // weight held whole and trained; model/params.h), with the copy acquired in host memory for
  // writing in kernels/fp8.h's matrix layout (codes, then the fp32 scales of its 128 x 128
  // blocks at fp8_matrix_scale_offset). fill returns whether it wrote the copy; a copy it leaves
  // stays the master quantised. Loads an FP8 checkpoint's own codes and block scales (DeepSeek-V3's)
  // after fill_kind wrote their dequantised values to the master; the next optimizer step
  // quantises the updated master as always. Does nothing in the other recipes.
  using CopyFill = std::function<Result<bool>(const model::TensorSpec& tensor, uint8_t* copy)>;
  Status fill_quantized_copies(const CopyFill& fill);
  // Copies bytes [offset, offset + length) of the flat `kind` state (the layout of
  // load_params; only tensor bytes, whole floats) into dst from wherever the chunks are,
  // moving nothing: what a checkpoint save reads beside training.
  Status read_flat(StateKind kind, uint64_t offset, uint64_t length, void* dst) override;
  // Called with a group before the optimizer (or a load) modifies its parameters or moments,
  // from the thread doing it: a save in flight captures the bytes it has not written yet.
  void set_before_modify(std::function<void(int group)> hook) override { before_modify_ = std::move(hook); }
  void set_step_count(int64_t steps) override { step_count_ = steps; }
  ElementRange saved_range(const model::TensorSpec& t, size_t index) const override;

  Status zero_grads();
  // Clips the global gradient norm to options.optimizer.grad_clip and applies one AdamW update
  // with learning rate `lr`. Returns the pre-clip norm. When the norm is not finite (a NaN or
  // Inf gradient) nothing changes, not even step_count(): the caller skips the step.
  Result<double> clip_and_step(float lr);
  // With overlap_optimizer: call before the last micro-batch's forward/backward of a step, with
  // the step's learning rate; groups are then updated as backward finishes with them, and
  // clip_and_step() only waits for the rest. Each group's gradients are checked just before its
  // update, so the norm is known (summed in update order) but only after some groups changed:
  // a non-finite group cannot be skipped cleanly, so clip_and_step() returns an error naming it
  // (the groups after it are left alone) and the run must stop.
  void begin_last_micro_batch(float lr);
  // Group updates the overlap worker has made (they ran while backward went on).
  int64_t overlapped_updates() {
    std::lock_guard<std::mutex> lock(worker_mu_);
    return overlapped_updates_;
  }
  // Groups whose gradients were summed over the ranks at handover (options.overlap_reduction).
  int64_t handover_sums() const { return handover_sums_.load(); }
  // Groups whose updated weights were gathered on the communication stream (queues_copy_gathers).
  int64_t queued_copy_gathers() const { return queued_copy_gathers_; }
  int64_t step_count() const override { return step_count_; }

  // ParamAccess.
  Status begin(int group, bool params, bool grads) override;
  void end(int group, bool params, bool grads) override;
  Status begin_experts(int group, std::span<const int> experts, bool params, bool grads) override;
  void end_experts(int group, std::span<const int> experts, bool params, bool grads) override;
  void collectives_failed(const Status& error) override {
    if (deferred_.ok()) deferred_ = error;
  }
  const void* param(int64_t offset) override;
  DType param_dtype() const override { return store_->layout().compute_dtype(); }
  bool stream_ordered() const override { return compute_stream_ != nullptr; }
  // Stream-ordered paging, the one paging path on every backend: the model's ops are queued on
  // `stream` (its device's compute stream; the model's set_access hands it over): begin() makes
  // the stream wait for the chunks' moves instead of blocking the host, and end() leaves later
  // moves of them waiting for what is queued on it. The optimizer and loads wait for the stream
  // first; the overlap worker waits on its update stream (which waits for the update's moves),
  // the handover sums and saves on the chunks' fences. Stall time counts host
  // waits only: compute-stream waits are not timed. REQUIRES: set before begin() (which aborts
  // without one: a model made without a Device runs its ops in the caller and cannot page);
  // the stream outlives its use (the model sets null when it lets the state go).
  void set_compute_stream(Stream* stream) override { compute_stream_ = stream; }
  // Data parallelism: every gradient is summed over the ranks of `comm` (parallel/comm.h), in
  // rank order, so all ranks take the same step: onto every rank (all-reduce) when each holds the
  // whole state, each rank's ranges onto it (reduce) when the optimizer state is sharded
  // (options.placement), whose partial norms are then summed. clip_and_step() sums them, or with
  // options.overlap_reduction the handover thread does, through `handover` (another Comm of the
  // same ranks: one thread issues a Comm's operations). Null or world 1: no reduction.
  // REQUIRES: not with overlap_optimizer (groups would update before the sums); `handover` with
  // overlap_reduction; the Comms outlive the state.
  // `experts` (options.expert_ranks > 1): the W / P ranks that hold the same experts as this one,
  // whose experts' gradients it sums and whose experts' weights it gathers; `expert_handover`,
  // another Comm of those ranks, makes those collectives on the communication stream when the
  // dense ones go there (null: on the compute path).
  // Runs `ahead` groups' gathers ahead instead of options.gather_ahead (fewer: the workspace has
  // room for those). Every rank must run alike: their collectives pair up in order. Between steps.
  void run_gathers_ahead(int ahead) {
    CHECK(ahead >= 1 && ahead <= std::max(options_.gather_ahead, 1));
    drop_prefetch();
    options_.gather_ahead = ahead;
  }
  void set_comm(parallel::Comm* comm, parallel::Comm* handover = nullptr, parallel::Comm* experts = nullptr,
                parallel::Comm* expert_handover = nullptr) {
    CHECK_MSG(comm == nullptr || comm->world_size() == 1 || !options_.overlap_optimizer,
              "overlap_optimizer updates groups before their gradients are summed over the ranks");
    CHECK_MSG(!plans_reductions_at_handover() || comm == nullptr || comm->world_size() == 1 || handover != nullptr,
              "overlap_reduction sums the gradients through a Comm of its own");
    CHECK_MSG(options_.expert_ranks <= 1 || comm == nullptr ||
                  (experts != nullptr && experts->world_size() * options_.expert_ranks == comm->world_size()),
              "expert parallelism without the Comm of the ranks that hold this rank's experts");
    CHECK_MSG(expert_handover == nullptr || (experts != nullptr && expert_handover->world_size() == experts->world_size()),
              "the experts' handover Comm is not of the ranks holding this rank's experts");
    comm_ = comm;
    handover_comm_ = handover;
    expert_comm_ = experts;
    expert_handover_comm_ = expert_handover;
  }
  float* grad(int64_t offset) override;
  bool offloads_activations() const override { return options_.offload_activations; }
  Status offload_saved_activation(int index, const void* data, uint64_t bytes) override;
  Status fetch_saved_activation(int index, void* data, uint64_t bytes) override;

  // One step of this state as the code runs it (offload/step_program.h): the micro-batch as the
  // decoder of the layout's model acquires it (recorded, model/recording_access.h), with its
  // activation offloads when this state keeps them, and the optimizer's zeroing, norm and AdamW,
  // each group's kinds where update_group() acquires them. The chunk store prefetches and
  // evicts along its schedule.
  StepProgram step_program() const;

  ChunkSpaceStats stats() const { return store_->stats(); }
  StateStore& store() { return *store_; }
  // Which tier each kind of each group calls home, e.g. for logs: "param: 3 device, 2 host".
  std::string placement_summary() const;

 private:
  PagedState() = default;
  Status copy_kind(StateKind kind, float* flat, bool to_store);
  // The kind that holds what SavableState calls `kind`: the fp32 master for kParam.
  StateKind stored_kind(StateKind kind) const {
    return kind == StateKind::kParam ? store_->layout().master_kind() : kind;
  }
  // Rounds group g's fp32 master into its compute copy (a layout with a separate master).
  Status refresh_compute_copy(int g);
  // Writes elements `range` of store tensor i's compute copy from `master`, the master values of
  // that range (both acquired where `kernels` works). A quantised matrix is written whole.
  void write_copy(StateKernels& kernels, size_t i, const float* master, ElementRange range);
  // The gradient buffers of group g's tensors, in layout order (REQUIRES its gradients acquired).
  std::vector<GradBuffer> grad_buffers(int g);
  // Tensor i's `kind` state (acquired; `count` elements, what the store holds of it) from / into
  // fp32 values: a copy for fp32 kinds, the moments' encoding or decoding for compact ones.
  void put_values(size_t i, StateKind kind, const float* values, uint64_t count);
  // Elements [first, first + count) of store tensor i's compute copy as fp32 (a frozen tensor's
  // values: it has no master), read wherever the copy lives.
  Status read_copy_values(size_t i, uint64_t first, uint64_t count, float* out);
  void get_values(size_t i, StateKind kind, float* values, uint64_t count);
  // Decoded elements [first, first + count) of tensor i's compact moments, read beside training.
  Status read_moments(size_t i, StateKind kind, uint64_t first, uint64_t count, float* dst);
  size_t tensor_at(int64_t offset) const;
  // Where AdamW updates a group: the device tier when its moments live there, else host memory
  // (NVMe-homed moments are read into host slots).
  Tier adam_tier(int group) const;
  // Whether the optimizer state is sharded over the ranks (each rank's ranges on that rank).
  bool sharded() const { return options_.placement && options_.placement->sharded(); }
  // The elements of store tensor i that rank `rank` owns (placement.h's tensor_shard of its
  // layout tensor, as far as it falls in this piece, counted from the piece's first element);
  // every element without ranks.
  ElementRange range_of(size_t i, int rank) const;
  // Tensor i's blocks per rank for Comm::all_gather_v / reduce_scatter_v_sum: each rank's range
  // in elements (element_bytes 0), or in bytes of `element_bytes` each; a tensor owned whole by
  // one rank (a quantised matrix, `whole_bytes` > 0) is that rank's block of whole_bytes.
  std::vector<size_t> rank_blocks(size_t i, uint64_t element_bytes, uint64_t whole_bytes = 0) const;
  // Expert parallelism: whether this rank holds nothing of store tensor i (another expert
  // group's rank computes its expert), and the ranks that sum and gather tensor i's state: the
  // expert's holders (expert_comm_) for an expert's tensor, else all of them (comm_). Their
  // blocks (rank_blocks) are in that Comm's rank order.
  bool elsewhere(size_t i) const { return store_->tensor(i).elsewhere; }
  // Whether store tensor i is summed and gathered over its expert's holders (expert groups).
  bool expert_tensor(size_t i) const { return options_.expert_ranks > 1 && store_->tensor(i).part != kDensePart; }
  parallel::Comm& comm_of(size_t i) const;
  // The parts of `group` this rank holds (every part but the experts held elsewhere).
  std::vector<int> held_parts(int group) const;
  // The elements of store tensor i this rank updates: its range when sharded, else all.
  ElementRange updated_range(size_t i) const;
  // Sums group g's gradients (acquired) over the ranks of `comm`, on `stream` when they are in
  // device memory (see set_comm).
  Status sum_gradients(int group, parallel::Comm& comm, Stream* stream);
  // The handover thread's work on group g: its gradients acquired beside the cursor where the
  // program's reduction says, summed over the ranks through handover_comm_.
  Status reduce_handed_over(int group);
  // Waits for the handover thread's sums of this step (none since begin_last_micro_batch: all
  // false) and returns which groups it summed, or its error.
  Result<std::vector<bool>> finish_handovers();
  // Whether the program sums the gradients as backward hands each group over: several ranks
  // share the placement out, each holding every gradient, and options.overlap_reduction.
  bool plans_reductions_at_handover() const {
    return options_.overlap_reduction && options_.placement && options_.placement->world() > 1 && !slices_gradients();
  }
  // ZeRO-2: each rank holds its ranges of the gradients' sums only (the placement slices them).
  // Backward writes a group's full gradients into the workspace; end() sums each range onto its
  // rank, which adds it to its slice (open_gradients, close_gradients).
  bool slices_gradients() const {
    return options_.placement && options_.placement->world() > 1 && options_.placement->sliced(0, StateKind::kGrad);
  }
  // ZeRO-3: each rank holds its ranges of the compute copy only; begin() gathers a group's whole
  // copy from the ranks into `gathered_` for the batch, end() drops it.
  bool slices_params() const {
    return options_.placement && options_.placement->world() > 1 && options_.placement->sliced(0, StateKind::kParam);
  }
  // The workspace layout of `kind` (kGrad: fp32 gradients for a micro-batch; kParam: the
  // compute copy for a batch) over the store's tensors, with room for `in_flight` groups.
  static WorkspaceLayout workspace_layout(const std::vector<StateTensor>& tensors, const StateLayout& state,
                                          StateKind kind, int in_flight);
  // Gathers group g's compute copy (the dense part's tensors, or with `experts` those of its
  // experts, whose place the dense part's gather opened): this rank's ranges copied into place,
  // every range then sent from its rank to the others (the first error is kept in deferred_).
  // The ranks gather every expert of a layer, whichever their own tokens reach, so that their
  // collectives match.
  void gather_params(int group, bool experts, Stream& stream);
  // Store tensor i in its group's gathered place (open): the place, where this rank's part of
  // it goes and comes from (none when it holds none), and every rank's blocks for all_gather_v.
  struct GatherPiece {
    char* place = nullptr;
    char* own_at = nullptr;
    const void* own = nullptr;
    uint64_t own_bytes = 0;
    std::vector<size_t> blocks;
  };
  GatherPiece gather_piece(size_t i) const;
  // At group g's first gradient batch of a micro-batch: its place in the workspace, zeros with
  // this rank's range holding its slice (fill_gradients: of the dense part's or, at
  // begin_experts, of every expert's tensors).
  void open_gradients(int group, Stream& stream);
  void fill_gradients(int group, bool experts, Stream& stream);
  // At its last (the program's gradient_batches): sums each range onto its rank and copies
  // this rank's into its slice (the first error is kept in deferred_), then gives the place back.
  // sum_gradients_to_ranges does it for the dense part's or every expert's tensors (the
  // experts' at end_experts, every rank summing every expert).
  // Returns whether it summed (the group's last gradient batch of the micro-batch).
  bool close_gradients(int group, Stream& stream);
  void sum_gradients_to_ranges(int group, bool experts, Stream& stream);
  // ZeRO-2 and 3 with options.overlap_reduction: the dense parts' weight gathers and gradient
  // sums run on a communication stream of their own (comm_stream_), through `handover` (set_comm),
  // ordered against compute by events: begin() queues a group's gather there and the compute
  // stream waits for it only before that group's compute, so that a gather runs while the
  // groups before it compute; end() queues its sums there behind its backward, and backward goes
  // on. An MoE layer's experts' go with the layer's (gathers_experts_with_layer,
  // sums_experts_with_layer): every expert this rank holds, whichever its tokens reach.
  bool plans_overlapped_collectives() const {
    return options_.overlap_reduction && options_.placement && options_.placement->world() > 1 && slices_gradients();
  }
  // Queues `op` (a collective through handover_comm_, named `what` for group g) on the
  // communication stream, and `then` after it when it succeeds: on the CPU backend in a task of
  // the stream's thread, which runs them on host memory (Gloo; `then` gets no stream and works
  // at once); elsewhere the host queues them on the stream (NCCL; `then` gets the stream). Once
  // one has failed no more run; the first error is kept (collective_error_) for begin() and the
  // step.
  // `expert`: through expert_handover_comm_ (an expert's tensor with expert groups).
  void queue_collective(const char* what, int group, bool expert, std::function<Status(parallel::Comm&, Stream*)> op,
                        std::function<void(Stream*)> then = {});
  // The overlapped gather of group g's dense part (plans_overlapped_collectives), whose end
  // `done` marks; `follow` as StateStore::acquire_part's (false: a prefetch).
  Status queue_gather(int group, bool follow, Event& done);
  // begin()'s weights, overlapped: group g's gather (prefetched by the begin before, or queued
  // now), waited for by the compute stream; then the gather of the group the micro-batch's
  // program begins next (gather_order_), when the workspace has room for it. Every rank runs
  // the same program and so gathers in the same order. Not past the micro-batch's last gather:
  // the optimizer may change the weights before the next.
  Status begin_gathered(int group);
  // Whether end() keeps group g's gathered weights for its next batch (in ahead_) rather than
  // dropping them: when only batches whose weights are already ahead come between (the last
  // layer's forward, the head, the last layer's backward; with a tied head and two ahead, the
  // embedding too). Its place is open already, and no gather opens one for it: keeping costs no
  // room.
  bool keeps_gathered(int group) const;
  // Overlapped ZeRO-3: a layer's gather on the communication stream brings its experts' weights
  // too (every expert this rank holds, as begin_experts would gather them), so that begin_experts
  // finds them in place. With expert groups, over the holders' Comm of that stream
  // (expert_handover_comm_); without one, the experts' gathers run on the compute path.
  bool gathers_experts_with_layer() const { return gathered_ && overlaps_collectives() && experts_handed_over(); }
  // Overlapped ZeRO-2 and 3: an MoE layer's experts' gradient sums are queued on the
  // communication stream too (end_experts), ahead of the layer's own; as above with expert groups.
  bool sums_experts_with_layer() const { return workspace_ && overlaps_collectives() && experts_handed_over(); }
  bool experts_handed_over() const {
    return options_.expert_ranks <= 1 || expert_handover_comm_ != nullptr;
  }
  // Gives the places of the groups ahead back unused (a begin other than the program's next,
  // e.g. an evaluation's; the step's end).
  void drop_prefetch();
  // The overlapped sums of group g's dense part (or its experts') onto the ranks' slices,
  // behind its backward. The dense part's are the group's last: their end is slice_summed_.
  void queue_gradient_sums(int group, bool experts);
  // Releases the gradient slices of the groups whose sums were queued (summing_), once the
  // host has waited for those sums; with `done_only`, only those whose sums are already done.
  void release_summed_slices(bool done_only = false);
  // StateStore::acquire_part, and when the device tier has no slot free while gradient slices
  // stay pinned for their queued sums, again after those are released (the cursor already at
  // the entry). Which of them is released when does not change any rank's collectives.
  Status acquire_part(int group, StateKind kind, AccessMode mode, Stream* consumer, bool follow = true);
  // The first error of a queued collective (none: OK).
  Status collective_error() {
    std::lock_guard<std::mutex> lock(collective_mu_);
    return collective_error_;
  }
  // Whether it does now (the Comms are set).
  bool reduces_at_handover() const {
    return plans_reductions_at_handover() && handover_comm_ != nullptr && handover_comm_->world_size() > 1;
  }
  // Sends this rank's ranges of the new compute copy of group g's `tensors` (acquired at
  // `where`) to the other ranks and receives theirs.
  Status gather_copy(int group, std::span<const size_t> tensors, Tier where);
  // AdamW on `tensors` of group g (the group's, or one update slice's: `slice`), their kinds
  // acquired at `where` as the program's update says; update_group's work.
  Status update_tensors(int group, int slice, std::span<const size_t> tensors, Tier where, float coefficient,
                        kernels::AdamWParams p, double* sum_squares);
  // update_tensors' three parts. Acquires every kind of group g's update (whole, or one update
  // slice) at `where`, along the program's cursor; with `consumer` (whole groups), that stream
  // waits for the moves instead of the host. On error nothing stays acquired.
  Status acquire_update_kinds(int group, int slice, Tier where, Stream* consumer = nullptr);
  // AdamW on the acquired `tensors`; false (nothing changed) when sum_squares is given and the
  // gradients' sum of squares it receives is not finite.
  bool apply_update(int group, std::span<const size_t> tensors, Tier where, float coefficient, kernels::AdamWParams p,
                    double* sum_squares);
  // After apply_update: the ranks' gather of the new copy (sharded state), and the releases.
  Status finish_update(int group, int slice, std::span<const size_t> tensors, Tier where);
  // The overlapped optimizer, on the compute thread at group g's handover: settles the group
  // handed over before (settle_update), then acquires g's update at this point of the program and
  // queues it for the worker, which applies it while backward goes on. So every acquisition and
  // release of the step happens on the compute thread at a fixed point of its program, and the
  // traffic is the planner's replay's (offload/replay.h), whatever the threads' timing.
  void hand_over_update(int group);
  // Waits for the worker to apply the pending update (the group last handed over), then releases
  // its kinds: at the next handover, or in the step after the last micro-batch.
  Status settle_update();
  // Acquires / releases group g's `kind` whole (slice kWholeGroup; with `consumer`, that stream
  // waits for the moves) or one update slice of it.
  Status acquire_update(int group, int slice, StateKind kind, Tier where, AccessMode mode,
                        ScheduleCursor cursor = ScheduleCursor::kFollow, Stream* consumer = nullptr) {
    return slice >= 0 ? store_->acquire_slice(group, slice, kind, where, mode, cursor)
                      : store_->acquire_group(group, kind, where, mode, cursor, consumer);
  }
  void release_update(int group, int slice, StateKind kind, Stream* consumer = nullptr) {
    if (slice >= 0) store_->release_slice(group, slice, kind, consumer);
    else store_->release_group(group, kind, consumer);
  }
  // Releases every kind of group g's update (or of one of its update slices) as the program
  // says, discarding those it marks; the compute copy's release after `param_consumer`'s work.
  void end_update(int group, int slice, Stream* param_consumer = nullptr);
  // ZeRO-1 and 2 with options.overlap_reduction over several ranks: each group's gather of its
  // updated copy (acquired at `where`) is queued on the communication stream instead
  // (queue_copy_gather), so that the next groups update while it runs; the ranks queue them in
  // the program's update order. On a GPU for device memory (NCCL queues there); on the CPU
  // backend for any tier (Gloo runs on the stream's thread over host memory). The step waits
  // for them at its end (finish_copy_gathers): forward reads the new weights.
  bool queues_copy_gathers(Tier where) const {
    return comm_stream_ != nullptr && handover_comm_ != nullptr && handover_comm_->world_size() > 1 && sharded() &&
           !slices_params() && experts_handed_over() && (device_->kind() == DeviceKind::kCpu || where == Tier::kDevice);
  }
  void queue_copy_gather(int group, std::span<const size_t> tensors);
  Status finish_copy_gathers();
  // Tensor i's compute copy and each rank's block of it in bytes, as the updated weights are
  // gathered: a quantised matrix's copy (owned whole) as it is stored.
  std::pair<char*, std::vector<size_t>> copy_blocks(size_t i) const;

  model::ParamLayout layout_;
  kernels::AdamWParams adamw_params(float lr) const;
  // With sum_squares: first sums the squares of the group's gradients into it and, when that
  // is not finite, changes nothing (the overlap's per-group check).
  Status update_group(int group, float coefficient, kernels::AdamWParams p, double* sum_squares = nullptr);
  // After a step's updates: an error naming the first tensor whose new parameters hold a NaN or
  // Inf, as the AdamW kernels found while writing them (on every rank when the state is sharded).
  Status check_updated_parameters();
  void worker_loop();

  PagedStateOptions options_;
  Device* device_ = nullptr;
  std::unique_ptr<StateKernels> cpu_kernels_;  // host-tier arithmetic (the device's too on the CPU backend)
  // The CPU's state kernels (what host-tier state is updated with).
  StateKernels* cpu_state_kernels();
  StateKernels* kernels_ = nullptr;           // device-tier arithmetic
  Stream* compute_stream_ = nullptr;          // the model's, when paging is stream-ordered
  parallel::Comm* comm_ = nullptr;             // data-parallel ranks whose gradients are summed
  parallel::Comm* handover_comm_ = nullptr;    // the same ranks, for the handover thread's sums
  parallel::Comm* expert_comm_ = nullptr;      // the ranks holding this rank's experts (expert_ranks > 1)
  parallel::Comm* expert_handover_comm_ = nullptr;  // the same, for the communication stream's collectives
  std::unique_ptr<Stream> handover_stream_;    // its device-memory sums queue here
  // The overlapped optimizer's acquisitions: this stream waits for their moves (and backward's
  // last writes to the gradients), the worker for the stream.
  std::unique_ptr<Stream> update_stream_;
  // The overlapped collectives of ZeRO-2 and 3 (plans_overlapped_collectives): their stream, the
  // event the compute stream waits on for a gather, the per-group event after the latest sums
  // onto its gradient slice (a later micro-batch's backward reads the slice), and their errors.
  std::unique_ptr<Stream> comm_stream_;
  std::unique_ptr<Event> gathered_event_, compute_done_event_, comm_done_event_;
  std::vector<std::unique_ptr<Event>> slice_summed_;
  std::vector<int> summing_;  // groups whose slices are pinned until their queued sums are done
  std::vector<std::vector<int>> summing_experts_;  // per group, its experts' parts pinned so too
  // ZeRO-3 overlapped: the groups a micro-batch's batches gather, in order (the program's dense
  // kParam acquisitions), the entry after the latest begin's, and the groups whose weights are
  // in place ahead of their batches, for the entries from it on: each gathered ahead (with the
  // end of its gather) or kept by end() from its batch before (no event).
  struct Ahead {
    int group = -1;
    std::unique_ptr<Event> done;
  };
  std::vector<int> gather_order_;
  size_t gather_next_ = 0;
  std::deque<Ahead> ahead_;
  std::vector<std::unique_ptr<Event>> spare_ahead_events_;
  std::mutex collective_mu_;
  Status collective_error_;                   // GUARDED_BY(collective_mu_)
  std::atomic<bool> collectives_stopped_{false};
  bool copy_gathers_queued_ = false;  // this step's (queue_copy_gather)
  int64_t queued_copy_gathers_ = 0;
  // Waits for the model's queued ops (stream-ordered paging) before state is touched otherwise.
  // Runs `work` (arithmetic on state the host has acquired) and returns when it is done. On the
  // CPU backend it runs as a task on the model's compute stream's thread, so that one OpenMP
  // team serves every op on the machine's cores: a second team, the host thread's, makes libgomp
  // throttle its spin-waits once threads outnumber cores (the demo ran 12% slower on two cores).
  // A difference of which thread does CPU work, not of ordering: the host waits either way. The
  // overlap worker and other backends run it in place.
  void on_compute_thread(const std::function<void()>& work);
  // The compute stream begin() orders moves on (aborts without one).
  Stream* model_stream() const;
  // Also waits for the overlapped collectives, and keeps their first error in deferred_.
  void drain_compute() {
    if (compute_stream_ != nullptr) {
      trace::Span wait("wait", "compute stream");  // profiles attribute it to what the stream ran
      compute_stream_->synchronize();
    }
    if (comm_stream_ != nullptr) {
      trace::Span wait("wait", "communication stream");
      comm_stream_->synchronize();
      release_summed_slices();
      if (Status st = collective_error(); !st.ok() && deferred_.ok()) deferred_ = st;
    }
  }
  // Before a collective's span on the compute stream: on the CPU backend Gloo first waits for
  // the stream's queued compute, which the span would otherwise count as communication. (On
  // CUDA the collective is queued behind it, and the span times the queueing.) With the
  // communication stream in use, no collective of the compute stream's runs beside one of its
  // (NCCL kernels of two communicators at once may wait on each other): the compute stream
  // waits for what is queued there, and after_collective() makes it wait for the compute
  // stream's collective in turn.
  void settle_before_collective();
  void after_collective();
  std::unique_ptr<Stream> staging_stream_;     // saved activations between device and host memory
  std::vector<char> staging_;
  std::unique_ptr<StateStore> store_;
  std::optional<GroupWorkspace> workspace_;     // ZeRO-2's full gradients (slices_gradients)
  std::optional<GroupWorkspace> gathered_;      // ZeRO-3's gathered weights (slices_params)
  std::vector<int> gradient_batches_seen_;      // per group, in the micro-batch under way (ZeRO-2)
  Status deferred_;  // the first error of a sum end() made (it returns nothing); begin() and the step return it
  // The optimizer's passes of the step program (step_program()), which its loops walk: zeroing,
  // the norm (none when overlapped), and AdamW group by group with the kinds it acquires, in
  // order (the order the overlapped optimizer is handed the groups in).
  struct GroupUpdate {
    int group = 0;
    std::vector<StateKind> kinds;
    ScheduleCursor cursor = ScheduleCursor::kFollow;  // the program's (kFollow for every update)
    bool by_slices = false;  // slice by slice (StateStore's update slices), else the group whole
    std::vector<bool> discards;  // per kind: ProgramEvent::discard
  };
  std::vector<ProgramEvent> zero_pass_, norm_pass_;
  std::vector<ProgramEvent> reductions_;  // per group: its reduction at handover (overlap_reduction)
  std::vector<GroupUpdate> updates_;
  std::vector<size_t> update_index_;  // group -> its entry in updates_
  // Per group: batches of a micro-batch that acquire its gradients (gradient_batches), and how
  // many of them the last micro-batch has ended so far (the overlap hands it over at the last).
  std::vector<int> handover_, grad_releases_;
  std::unordered_map<int64_t, size_t> by_offset_;  // flat offset -> store tensor index
  std::vector<std::pair<int64_t, size_t>> sorted_;  // (flat offset, store tensor index), ascending
  std::function<void(int group)> before_modify_;
  // Store tensor index -> its part of a layout tensor: the whole tensor, or one row block of
  // a tensor in blocks (TensorSpec::block_rows), which the store holds as tensors of their own.
  struct Piece {
    const model::TensorSpec* spec = nullptr;
    int64_t block = 0;
    int64_t offset = 0;  // in the flat layout
    int64_t numel = 0;
    int64_t matrix_rows = 0;  // > 0: a linear layer's weight (the fp8 recipe quantises it)
    size_t spec_index = 0;    // of spec in the layout's tensors
  };
  std::vector<Piece> pieces_;
  int64_t step_count_ = 0;
  int64_t host_nonfinite_ = -1;  // the first tensor host-memory AdamW wrote NaN or Inf into (-1: none)

  // The compute thread's alone (not guarded by worker_mu_): groups the model has begun and not
  // ended, groups handed over while some were (taken when none is), and the update handed over,
  // acquired and not yet settled (hand_over_update).
  int open_groups_ = 0;
  std::vector<int> updates_due_;
  int pending_update_ = -1;

  // Overlap with backward (options.overlap_optimizer or overlap_reduction): end() queues groups
  // whose gradients are final in the last micro-batch; the worker applies their updates (which the
  // compute thread acquired: hand_over_update), or sums them over the ranks, while backward goes on.
  std::thread worker_;
  std::mutex worker_mu_;  // guards everything below
  std::condition_variable worker_cv_;
  std::deque<int> queue_;
  std::vector<bool> updated_;
  kernels::AdamWParams overlap_params_;
  bool overlap_active_ = false;
  bool worker_busy_ = false;
  bool stop_ = false;
  Status worker_status_;
  int64_t overlapped_updates_ = 0;
  std::atomic<int64_t> handover_sums_{0};
  double overlap_sum_squares_ = 0;  // the step's groups so far, in the order they were updated
  int overlap_bad_group_ = -1;      // the first group whose gradients were not finite
  bool pending_applied_ = false;  // the worker applied pending_update_ (else not finite, or it failed)
};

}  // namespace strata
