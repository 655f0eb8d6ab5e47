#include "train/paged_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>

#include <fmt/format.h>

#include "core/cpu_device.h"
#include "core/host_memory.h"
#include "core/trace.h"
#include "core/units.h"
#include "kernels/adamw.h"
#include "kernels/adamw_simd.h"
#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "kernels/grad_norm.h"
#include "kernels/moments.h"
#include "kernels/nf4.h"
#include "model/expert_parallel.h"
#include "model/recording_access.h"

namespace strata {
namespace {

// The store tensor of row block b of t (the whole tensor when it is not in blocks).
StateTensor state_tensor(const model::ParamLayout& layout, const model::TensorSpec& t, int64_t b) {
  StateTensor s{t.num_blocks() > 1 ? t.name + "#" + std::to_string(b) : t.name, static_cast<uint64_t>(t.block_numel(b)),
                model::param_group_of(layout, t), model::param_expert_of(layout, t),
                model::param_is_linear_weight(layout, t) ? t.shape[0] : 0};
  s.frozen = t.frozen;  // its compute copy alone
  return s;
}


// The second moment (v) is non-negative: int8 moments encode it with an unsigned table.
bool is_second_moment(StateKind kind) { return kind == StateKind::kAdamV; }

std::vector<StateTensor> state_tensors(const model::ParamLayout& layout) {
  std::vector<StateTensor> tensors;
  for (const auto& t : layout.tensors())
    for (int64_t b = 0; b < t.num_blocks(); ++b) tensors.push_back(state_tensor(layout, t, b));
  return tensors;
}

// Who shares tensor t's state out among them, and where rank `rank` of `world` stands there:
// every rank for a dense tensor; with expert groups of P > 1, an expert's W / P holders (the
// ranks whose place in their group computes it), rank r being r / P of them.
struct Holders {
  bool holds = true;
  int rank = 0;
  int world = 1;
};
Holders holders_of(const model::ParamLayout& layout, const model::TensorSpec& t, int rank, int world,
                   int expert_ranks) {
  const int expert = model::param_expert_of(layout, t);
  if (expert < 0 || expert_ranks <= 1) return {true, rank, world};
  const bool holds = model::expert_range(layout.config().num_experts, expert_ranks, rank % expert_ranks).holds(expert);
  return {holds, rank / expert_ranks, world / expert_ranks};
}

// The elements of tensor t (the index-th of the layout's) that rank `rank` of `world` owns
// (none of an expert it does not hold).
ElementRange tensor_range(const model::ParamLayout& layout, const StateLayout& state, const model::TensorSpec& t,
                          size_t index, int rank, int world, int expert_ranks) {
  const Holders h = holders_of(layout, t, rank, world, expert_ranks);
  if (!h.holds) return {0, 0};
  const int64_t rows = model::param_is_linear_weight(layout, t) ? t.shape[0] : 0;
  return tensor_shard(state, {static_cast<uint64_t>(t.numel), rows}, index, h.rank, h.world);
}

// Of them, those in row block b, counted from the block's first element.
ElementRange block_range(const model::ParamLayout& layout, const StateLayout& state, const model::TensorSpec& t,
                         size_t index, int64_t b, int rank, int world, int expert_ranks) {
  const ElementRange whole = tensor_range(layout, state, t, index, rank, world, expert_ranks);
  const uint64_t begin = static_cast<uint64_t>(t.block_offset(b) - t.offset);
  const uint64_t end = begin + static_cast<uint64_t>(t.block_numel(b));
  const uint64_t first = std::clamp(whole.first, begin, end), last = std::clamp(whole.end(), begin, end);
  return {first - begin, last - first};
}

}  // namespace

std::vector<StateTensor> PagedState::store_tensors(const model::ParamLayout& layout) { return state_tensors(layout); }

std::vector<StateTensor> PagedState::store_tensors(const model::ParamLayout& layout, const StateLayout& state,
                                                   int rank, int world, int expert_ranks) {
  std::vector<StateTensor> tensors = state_tensors(layout);
  if (world <= 1) return tensors;
  size_t i = 0;
  for (size_t index = 0; index < layout.tensors().size(); ++index) {
    const model::TensorSpec& t = layout.tensors()[index];
    const bool held = holders_of(layout, t, rank, world, expert_ranks).holds;
    for (int64_t b = 0; b < t.num_blocks(); ++b) {
      tensors[i].elsewhere = !held;
      tensors[i++].slice = block_range(layout, state, t, index, b, rank, world, expert_ranks);
    }
  }
  return tensors;
}

uint64_t PagedState::largest_block_bytes(const model::ParamLayout& layout, const model::TensorSpec& t,
                                         const StateLayout& state) {
  const StateShape shape = state_tensor(layout, t, 0).shape();
  uint64_t most = 0;
  for (StateKind k : state.kinds()) most = std::max(most, state.tensor_bytes(k, shape));
  return most;
}

uint64_t PagedState::auto_chunk_bytes(const model::ParamLayout& layout, const StateLayout& state) {
  return StateStore::auto_chunk_bytes(state_tensors(layout), state);
}

std::vector<uint64_t> PagedState::group_chunks(const model::ParamLayout& layout, uint64_t chunk_bytes,
                                               const StateLayout& state, StateKind kind) {
  return StateStore::group_chunks(state_tensors(layout), chunk_bytes, state, kind);
}

std::vector<uint64_t> PagedState::group_elements(const model::ParamLayout& layout) {
  std::vector<uint64_t> elements(static_cast<size_t>(layout.num_layers()) + 2, 0);
  for (const model::TensorSpec& t : layout.tensors())
    elements[static_cast<size_t>(model::param_group_of(layout, t))] += static_cast<uint64_t>(t.numel);
  return elements;
}

uint64_t PagedState::state_bytes(const model::ParamLayout& layout, const StateLayout& state, StateKind kind) {
  uint64_t sum = 0;
  for (const StateTensor& t : state_tensors(layout)) sum += state.tensor_bytes(kind, t.shape());
  return sum;
}

HostTierSize PagedState::host_tier_size(const model::ParamLayout& layout, const PagedStateOptions& options) {
  HostTierSize size;
  size.reserved_bytes = options.host_bytes;
  if (options.host_bytes == 0) return size;
  const StateLayout state = state_layout(options);
  const uint64_t chunk = options.chunk_bytes ? options.chunk_bytes : PagedState::auto_chunk_bytes(layout, state);
  size.chunk_bytes = chunk;
  for (const model::TensorSpec& t : layout.tensors())
    if (largest_block_bytes(layout, t, state) > chunk) return size;  // refused later
  // A data-parallel rank's sliced kinds hold its ranges only (placement.h).
  const int world = options.placement ? options.placement->world() : 1;
  const std::vector<StateTensor> tensors = store_tensors(layout, state, options.rank, world, options.expert_ranks);
  HomeOf home;
  if (options.placement)
    home = [p = &*options.placement](int g, StateKind k, int part) { return p->home(g, k, part); };
  for (const StateKind kind : state.kinds()) {
    const bool sliced = options.placement && options.placement->sliced(0, kind);
    for (uint64_t n : StateStore::group_chunks(tensors, chunk, state, kind, sliced, home)) size.state_chunks += n;
    const std::vector<std::vector<StateStore::PartChunks>> parts =
        StateStore::part_chunks(tensors, chunk, state, kind, sliced, home);
    const bool moment = kind == StateKind::kAdamM || kind == StateKind::kAdamV;
    for (size_t g = 0; g < parts.size(); ++g) {
      uint64_t in_group = 0;
      for (const StateStore::PartChunks& p : parts[g]) in_group += p.chunks;
      if (kind == StateKind::kMaster && state.separate_master() && !sliced)
        size.pass_chunks = std::max(size.pass_chunks, in_group + 2);
      for (const StateStore::PartChunks& p : parts[g]) {
        const int group = static_cast<int>(g);
        const Tier at = home ? home(group, kind, p.part) : Tier::kHost;
        if (at == Tier::kHost) size.host_home_chunks += p.chunks;
        if (at == Tier::kDevice && !moment && home(group, StateKind::kAdamM, p.part) != Tier::kDevice)
          size.host_update_chunks += p.chunks;
      }
    }
    for (const StateTensor& t : tensors) size.state_bytes += state.tensor_bytes(kind, t.shape(sliced));
  }
  if (options.offload_activations && options.activation_tokens > 0) {
    uint64_t C = 0;  // hidden size: the final norm's weight has C elements
    for (const model::TensorSpec& t : layout.tensors())
      if (t.offset == layout.final_norm()) C = static_cast<uint64_t>(t.numel);
    const uint64_t bytes = static_cast<uint64_t>(options.activation_tokens) * C * dtype_size(state.activation_dtype());
    const uint64_t count =
        static_cast<uint64_t>(model::saved_activation_count(static_cast<int>(layout.config().num_hidden_layers)));
    size.activation_chunks = StateStore::activation_chunks(static_cast<int>(count), bytes, chunk);
    size.state_bytes += count * bytes;
  }
  // With an nvme tier the chunk space keeps one host slot free for staging moves to and from disk.
  if (options.nvme_bytes > 0) size.staging_chunks = 1;
  size.reserved_bytes =
      std::min(options.host_bytes, (size.state_chunks + size.activation_chunks + size.staging_chunks) * chunk);
  return size;
}

namespace {

// The host tier reserves what the state can occupy there and no more (host_tier_size). A larger
// budget would only pin idle memory (the whole of it, once the nvme tier registers it with
// io_uring). What is reserved must be available on this machine, or the run is refused here,
// before the reservation, rather than by the OOM killer later; the trainer then checks the
// run's whole host memory (host_ram.h) before it loads any weights.
Status fit_host_tier(const model::ParamLayout& layout, const PagedStateOptions& options, ChunkSpaceOptions* space) {
  if (space->host_bytes == 0) return Status::OK();
  // options.nvme_bytes, not space's: the chunk space's nvme budget is set after this.
  PagedStateOptions budgeted = options;
  budgeted.host_bytes = space->host_bytes;
  space->host_bytes = PagedState::host_tier_size(layout, budgeted).reserved_bytes;
  const HostMemory machine = available_host_memory();
  if (machine.known && space->host_bytes > machine.available)
    return Status::OutOfMemory(fmt::format(
        "memory.host: the plan keeps {} in host memory, but this machine has {} available ({}); lower memory.host "
        "(with memory.nvme.* the rest pages to disk) or free memory",
        format_bytes(space->host_bytes), format_bytes(machine.available), machine.source));
  return Status::OK();
}

// The device tier likewise holds at most every chunk of the state (and of the offloaded
// activations): a larger budget (memory.device=4TiB) only sized slot tables, an event per slot,
// for memory no chunk can use, 5 GB of them before the first step. On the cpu backend the
// device's memory is this machine's: what is left must be available, or the run is refused here.
Status fit_device_tier(Device& device, const model::ParamLayout& layout, const PagedStateOptions& options,
                       ChunkSpaceOptions* space) {
  if (space->device_bytes == 0) return Status::OK();
  PagedStateOptions budgeted = options;
  budgeted.host_bytes = space->device_bytes;  // the same count of chunks, for the device tier
  budgeted.nvme_bytes = 0;                    // no staging slot: that is the host tier's
  space->device_bytes = PagedState::host_tier_size(layout, budgeted).reserved_bytes;
  if (device.kind() != DeviceKind::kCpu) return Status::OK();
  const HostMemory machine = available_host_memory();
  if (machine.known && space->device_bytes > machine.available)
    return Status::OutOfMemory(fmt::format(
        "memory.device: the plan keeps {} of state in the cpu device's memory, which is this machine's, but it has "
        "{} available ({}); lower memory.device (the rest pages through memory.host and memory.nvme.*) or free "
        "memory",
        format_bytes(space->device_bytes), format_bytes(machine.available), machine.source));
  return Status::OK();
}

// The store's homes and slices as `placement` gives them: each (group, kind), and each part
// with rows of its own, homed where it says, and a sliced row held as this rank's range of each
// tensor (tensor_shard).
Status follow_placement(const Placement& placement, int num_layers, const PagedStateOptions& options,
                        StateStoreOptions* so) {
  if (placement.num_groups() != num_layers + 2)
    return Status::InvalidArgument(fmt::format("the placement has {} parameter groups; the model has {}",
                                               placement.num_groups(), num_layers + 2));
  for (int g = 0; g < placement.num_groups(); ++g) {
    for (StateKind k : so->layout.kinds()) {
      if (placement.home(g, k) == Tier::kNvme && options.nvme_bytes == 0)
        return Status::InvalidArgument(fmt::format(
            "the placement homes the {} of parameter group {} on nvme, but there is no nvme tier (memory.nvme.*)",
            state_kind_name(k), g));
      for (int part : placement.parts(g))
        if (placement.home(g, k, part) == Tier::kNvme && options.nvme_bytes == 0)
          return Status::InvalidArgument(
              fmt::format("the placement homes the {} of part {} of parameter group {} on nvme, but there is no nvme "
                          "tier (memory.nvme.*)",
                          state_kind_name(k), part, g));
    }
  }
  so->home = [&placement](int g, StateKind k, int part) { return placement.home(g, k, part); };
  so->sliced = [&placement](int g, StateKind k) { return placement.sliced(g, k); };
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<PagedState>> PagedState::create(Device& device, IoEngine* io, const model::ParamLayout& layout,
                                                       const PagedStateOptions& options) {
  std::unique_ptr<PagedState> ps(new PagedState());
  ps->layout_ = layout;
  ps->options_ = options;
  ps->device_ = &device;
  ps->cpu_kernels_ = make_cpu_state_kernels();
  if (options.device_kernels == nullptr) {
    // Memory kind: the CPU's state kernels can work on the CPU backend's device memory only.
    if (device.kind() != DeviceKind::kCpu)
      return Status::InvalidArgument("a PagedState on " + device.name() + " needs that device's state kernels");
    ps->kernels_ = ps->cpu_kernels_.get();
  } else {
    ps->kernels_ = options.device_kernels;
  }
  // Memory kind, not ordering: a GPU's memory is not the host's, so its checkpoints travel
  // through a staging stream; the CPU backend's device memory is host memory.
  if (device.kind() != DeviceKind::kCpu) ps->staging_stream_ = device.create_stream();
  std::vector<StateTensor> tensors;
  size_t spec_index = 0;
  for (const auto& t : ps->layout_.tensors()) {
    for (int64_t b = 0; b < t.num_blocks(); ++b) {
      ps->by_offset_[t.block_offset(b)] = tensors.size();
      ps->sorted_.emplace_back(t.block_offset(b), tensors.size());
      tensors.push_back(state_tensor(ps->layout_, t, b));
      ps->pieces_.push_back({&t, b, t.block_offset(b), t.block_numel(b), tensors.back().matrix_rows, spec_index});
    }
    ++spec_index;
  }
  if (options.expert_ranks > 1) {
    const int world = options.placement ? options.placement->world() : 1;
    if (!layout.config().is_moe() || world % options.expert_ranks != 0 ||
        layout.config().num_experts % options.expert_ranks != 0)
      return Status::InvalidArgument(fmt::format(
          "expert groups of {} ranks need an MoE model whose experts they divide, among ranks they divide ({})",
          options.expert_ranks, world));
    if (!options.placement || !options.placement->sharded())
      return Status::InvalidArgument("expert parallelism shares each expert's optimizer state out over the ranks "
                                     "holding it: parallel.zero must be 1 or more");
    if (options.overlap_reduction && !options.placement->sliced(0, StateKind::kGrad))
      return Status::InvalidArgument(
          "expert parallelism at ZeRO-1 sums the gradients after backward (no overlap_reduction): the gradient sums "
          "at handover do not know the experts' holders");
  }
  if (options.placement && options.placement->world() > 1) {
    // store_tensors' slices, and what this rank holds of no kind.
    for (size_t i = 0; i < tensors.size(); ++i) {
      tensors[i].slice = ps->range_of(i, options.rank);
      const Piece& p = ps->pieces_[i];
      tensors[i].elsewhere = !holders_of(layout, *p.spec, options.rank, options.placement->world(),
                                         options.expert_ranks).holds;
    }
  }
  std::sort(ps->sorted_.begin(), ps->sorted_.end());
  const int L = static_cast<int>(ps->layout_.num_layers());
  StateStoreOptions so;
  so.space.chunk_bytes = options.chunk_bytes;
  so.space.device_bytes = options.device_bytes;
  so.space.host_bytes = options.host_bytes;
  RETURN_IF_ERROR(fit_host_tier(ps->layout_, options, &so.space));
  RETURN_IF_ERROR(fit_device_tier(device, ps->layout_, options, &so.space));
  so.space.nvme_bytes = options.nvme_bytes;
  so.space.nvme_dir = options.nvme_dir;
  so.lookahead = options.lookahead;
  so.layout = state_layout(options);
  if (options.placement) RETURN_IF_ERROR(follow_placement(*options.placement, L, options, &so));
  if (options.overlap_optimizer && options.optimizer.grad_clip > 0)
    return Status::InvalidArgument("optim.overlap_backward needs optim.grad_clip=0: with clipping, no group can be "
                                   "updated before the whole backward has produced the global gradient norm");
  ASSIGN_OR_RETURN(ps->store_, StateStore::create(device, io, std::move(tensors), so));
  int offloaded = 0;
  if (options.offload_activations) {
    if (options.activation_tokens <= 0)
      return Status::InvalidArgument("activation offload needs activation_tokens (B * T of a micro-batch)");
    offloaded = model::saved_activation_count(static_cast<int>(ps->layout_.config().num_hidden_layers));
    // Hidden size C: the final norm's weight has C elements.
    const int64_t C = ps->pieces_[ps->tensor_at(ps->layout_.final_norm())].numel;
    const uint64_t bytes = static_cast<uint64_t>(options.activation_tokens) * static_cast<uint64_t>(C) *
                           dtype_size(so.layout.activation_dtype());
    RETURN_IF_ERROR(ps->store_->add_activations(
        offloaded, bytes, options.placement ? options.placement->activation_host_chunks() : -1));
  }
  // The optimizer's loops walk the program's passes: the order the store prefetches along is the
  // order they acquire in, by construction.
  const StepProgram program = ps->step_program();
  for (const ProgramEvent& e : program.zero) ps->zero_pass_.push_back(e);
  // The updates are in the last micro-batch when overlapped, else after the norm pass; so are
  // the reductions at handover.
  ps->reductions_.resize(static_cast<size_t>(ps->store_->num_groups()));
  for (const std::vector<ProgramEvent>* part : {&program.last_micro_batch, &program.optimizer}) {
    for (const ProgramEvent& e : *part) {
      if (e.phase == StepPhase::kNorm && part == &program.last_micro_batch) {
        ps->reductions_.at(static_cast<size_t>(e.access.group)) = e;
      } else if (e.phase == StepPhase::kNorm) {
        ps->norm_pass_.push_back(e);
      } else if (e.phase == StepPhase::kOptimizer) {
        // (A group updated by slices has the same kinds for each: its first slice's.)
        if (ps->updates_.empty() || ps->updates_.back().group != e.access.group)
          ps->updates_.push_back({e.access.group, {}, e.access.cursor, e.access.slice >= 0});
        if (e.access.slice <= 0) {
          ps->updates_.back().kinds.push_back(e.access.kind);
          ps->updates_.back().discards.push_back(e.discard);
        }
      }
    }
  }
  ps->handover_ = gradient_batches(program.micro_batch, ps->store_->num_groups());
  ps->update_index_.assign(static_cast<size_t>(ps->store_->num_groups()), SIZE_MAX);
  for (size_t u = 0; u < ps->updates_.size(); ++u) ps->update_index_[static_cast<size_t>(ps->updates_[u].group)] = u;
  ps->store_->set_schedule(program.schedule(options.grad_accum));
  if (ps->slices_gradients()) {
    if (options.overlap_optimizer)
      return Status::InvalidArgument("optim.overlap_backward with the gradients sliced over the ranks (parallel.zero=2)");
    std::vector<StateTensor> all;
    for (size_t i = 0; i < ps->store_->num_tensors(); ++i) all.push_back(ps->store_->tensor(i));
    ASSIGN_OR_RETURN(GroupWorkspace w,
                     GroupWorkspace::create(device,
                                            workspace_layout(all, so.layout, StateKind::kGrad,
                                                             ps->plans_overlapped_collectives() ? 1 : 0),
                                            program.micro_batch, "backward's full gradients (parallel.zero=2)"));
    ps->workspace_ = std::move(w);
    ps->gradient_batches_seen_.assign(static_cast<size_t>(ps->store_->num_groups()), 0);
    if (ps->slices_params()) {
      ASSIGN_OR_RETURN(GroupWorkspace p,
                       GroupWorkspace::create(device,
                                              workspace_layout(all, so.layout, StateKind::kParam,
                                                               ps->plans_overlapped_collectives()
                                                                   ? std::max(options.gather_ahead, 1)
                                                                   : 0),
                                              program.micro_batch, "the weights gathered for compute (parallel.zero=3)"));
      ps->gathered_ = std::move(p);
    }
  }
  // The communication stream: ZeRO-2 and 3's overlapped collectives, and ZeRO-1's (and 2's)
  // gathers of the updated weights (queues_copy_gathers).
  if (ps->plans_overlapped_collectives() || (ps->plans_reductions_at_handover() && ps->sharded())) {
    ps->comm_stream_ = device.create_stream();
    ps->comm_stream_->set_trace_name("communication");
  }
  if (ps->plans_overlapped_collectives()) {
    ps->gathered_event_ = device.create_event();
    ps->comm_done_event_ = device.create_event();
    ps->gather_order_ = gather_order(program.micro_batch);
    ps->compute_done_event_ = device.create_event();
    for (int g = 0; g < ps->store_->num_groups(); ++g) ps->slice_summed_.push_back(device.create_event());
    ps->summing_experts_.resize(static_cast<size_t>(ps->store_->num_groups()));
  }
  CHECK_MSG(!(options.overlap_optimizer && options.overlap_reduction),
            "overlap_optimizer updates groups before their gradients are summed over the ranks");
  if (ps->plans_reductions_at_handover()) {
    ps->handover_stream_ = device.create_stream();
    ps->handover_stream_->set_trace_name("communication");
  }
  if (options.overlap_optimizer) {
    ps->update_stream_ = device.create_stream();
    ps->update_stream_->set_trace_name("optimizer (overlapped)");
  }
  if (options.overlap_optimizer || ps->plans_reductions_at_handover())
    ps->worker_ = std::thread([p = ps.get()] { p->worker_loop(); });
  return ps;
}

Tier PagedState::adam_tier(int group) const { return update_tier(store_->home(group, StateKind::kAdamM)); }

ElementRange PagedState::saved_range(const model::TensorSpec& t, size_t index) const {
  if (t.frozen) return {0, 0};  // a frozen tensor comes from the run's source again
  if (!options_.placement || options_.placement->world() <= 1) return {0, static_cast<uint64_t>(t.numel)};
  return tensor_range(layout_, state_layout(options_), t, index, options_.rank, options_.placement->world(),
                      options_.expert_ranks);
}

ElementRange PagedState::range_of(size_t i, int rank) const {
  const Piece& p = pieces_[i];
  if (!options_.placement || options_.placement->world() <= 1) return {0, static_cast<uint64_t>(p.numel)};
  return block_range(layout_, state_layout(options_), *p.spec, p.spec_index, p.block, rank,
                     options_.placement->world(), options_.expert_ranks);
}

std::vector<size_t> PagedState::rank_blocks(size_t i, uint64_t element_bytes, uint64_t whole_bytes) const {
  const int world = options_.placement ? options_.placement->world() : 1;
  // The ranks of comm_of(i), in its rank order: every rank, or an expert's holders, the ranks
  // at this rank's place in their expert groups.
  const Piece& p = pieces_[i];
  const Holders me = holders_of(layout_, *p.spec, options_.rank, world, options_.expert_ranks);
  const int P = me.world == world ? 1 : options_.expert_ranks;
  std::vector<size_t> blocks(static_cast<size_t>(me.world));
  uint64_t next = 0;
  for (int k = 0; k < me.world; ++k) {
    const ElementRange range = range_of(i, P == 1 ? k : options_.rank % P + k * P);
    if (range.count == 0) continue;
    // The ranks' ranges follow each other in rank order from the tensor's start.
    CHECK_MSG(range.first == next, "a tensor's ranges are not consecutive in rank order");
    next = range.first + range.count;
    blocks[static_cast<size_t>(k)] =
        whole_bytes > 0 ? whole_bytes : element_bytes > 0 ? range.count * element_bytes : range.count;
  }
  return blocks;
}

parallel::Comm& PagedState::comm_of(size_t i) const {
  const bool expert = expert_tensor(i);
  parallel::Comm* comm = expert ? expert_comm_ : comm_;
  CHECK_MSG(comm != nullptr, expert ? "expert parallelism without the Comm of the ranks holding this rank's experts"
                                    : "data parallelism without the ranks' Comm (set_comm)");
  return *comm;
}

std::vector<int> PagedState::held_parts(int group) const {
  std::vector<int> held;
  for (int part : store_->parts(group)) {
    bool elsewhere_part = true;
    for (size_t i : store_->group_tensors(group))
      if (store_->tensor(i).part == part && !elsewhere(i)) elsewhere_part = false;
    if (!elsewhere_part) held.push_back(part);
  }
  return held;
}

StepProgram PagedState::step_program() const {
  OptimizerProgram optimizer;
  optimizer.num_groups = store_->num_groups();
  optimizer.kinds = store_->layout().kinds();
  // Data-parallel ranks (a placement over several) sum the gradients in place before the norm.
  optimizer.reduces_gradients = options_.placement && options_.placement->world() > 1 && !slices_gradients();
  optimizer.where = [this](int g) { return adam_tier(g); };
  optimizer.overlapped = options_.overlap_optimizer;
  optimizer.reduces_at_handover = plans_reductions_at_handover();
  optimizer.slices_host_updates = true;
  StepProgram program = make_step_program(model::record_micro_batch(layout_.config(), options_.offload_activations), optimizer);
  program.optimizer = expand_update_slices(program.optimizer, [this](int g) { return store_->update_slices(g); });
  return program;
}

size_t PagedState::tensor_at(int64_t offset) const {
  auto it = by_offset_.find(offset);
  CHECK_MSG(it != by_offset_.end(), "no parameter tensor starts at offset " + std::to_string(offset));
  return it->second;
}

Status PagedState::fill_kind(StateKind saved, const TensorFill& fill, TensorSet which) {
  drain_compute();
  drop_prefetch();  // weights gathered ahead would miss this change
  const StateKind kind = stored_kind(saved);
  const bool f32 = store_->layout().is_f32(kind);
  // A tensor in row blocks, of a compact kind, or held as a slice is filled into fp32 values
  // first (once: its blocks may lie in several update slices), then stored block by block.
  std::vector<float> whole;
  const model::TensorSpec* whole_of = nullptr;
  for (int g = 0; g < store_->num_groups(); ++g) {
    if (before_modify_ && kind != StateKind::kGrad) before_modify_(g);
    const bool sliced = store_->sliced(g, kind);
    // A sliced master holds this rank's ranges only, so the compute copy, which every rank holds
    // whole, is written here from the whole values rather than from the master afterwards; so is
    // a frozen tensor's, which has no master.
    bool frozen_in_group = false;
    for (size_t i : store_->group_tensors(g)) frozen_in_group = frozen_in_group || pieces_[i].spec->frozen;
    const bool copy_too = kind == StateKind::kMaster && (sliced || frozen_in_group);
    // Update slice by slice: host memory holds a chunk of each kind at a time, whatever the
    // group's size.
    for (int sl = 0; sl < store_->update_slices(g); ++sl) {
      RETURN_IF_ERROR(store_->acquire_slice(g, sl, kind, Tier::kHost, AccessMode::kReadWrite));
      Status st = copy_too ? store_->acquire_slice(g, sl, StateKind::kParam, Tier::kHost, AccessMode::kReadWrite)
                           : Status::OK();
      if (!st.ok()) {
        store_->release_slice(g, sl, kind);
        return st;
      }
      for (size_t i : store_->slice_tensors(g, sl)) {
        const Piece& p = pieces_[i];
        if (elsewhere(i) || !in_set(which, *p.spec)) continue;  // nothing of it here, or not asked for
        // A frozen tensor holds no gradient or moments, and its values go to the compute copy.
        if (p.spec->frozen && kind != StateKind::kParam && kind != StateKind::kMaster) continue;
        if (p.spec->num_blocks() == 1 && f32 && !sliced && !(p.spec->frozen && kind == StateKind::kMaster)) {
          st = fill(*p.spec, store_->pointer(i, kind));
        } else {
          if (whole_of != p.spec) {
            whole.resize(static_cast<size_t>(p.spec->numel));
            st = fill(*p.spec, whole.data());
            whole_of = p.spec;
          }
          if (st.ok()) {
            const float* values = whole.data() + (p.spec->block_offset(p.block) - p.spec->offset);
            const ElementRange held = store_->held(i, kind);
            put_values(i, kind, values + held.first, held.count);
            if (copy_too) {
              // The whole copy, or (ZeRO-3) this rank's range of it.
              const ElementRange copy_held = store_->held(i, StateKind::kParam);
              write_copy(*cpu_state_kernels(), i, values + copy_held.first, copy_held);
            }
          }
        }
        if (!st.ok()) break;
      }
      if (copy_too) store_->release_slice(g, sl, StateKind::kParam);
      store_->release_slice(g, sl, kind);
      RETURN_IF_ERROR(st);
      // Host memory passes the state through: a few slots, not a copy of everything (a master
      // whose compute copy is refreshed from it below goes home after that).
      if (copy_too) RETURN_IF_ERROR(store_->send_slice_home(g, sl, StateKind::kParam, Tier::kHost));
      if (kind != StateKind::kMaster || sliced) RETURN_IF_ERROR(store_->send_slice_home(g, sl, kind, Tier::kHost));
    }
    if (kind == StateKind::kMaster && !sliced) RETURN_IF_ERROR(refresh_compute_copy(g));
  }
  return store_->synchronize();
}

Status PagedState::fill_quantized_copies(const CopyFill& fill) {
  const StateLayout& layout = store_->layout();
  if (!layout.separate_master() || layout.precision != Precision::kFp8) return Status::OK();  // E4M3 copies only
  drain_compute();
  drop_prefetch();  // weights gathered ahead would miss this change
  for (int g = 0; g < store_->num_groups(); ++g) {
    for (int sl = 0; sl < store_->update_slices(g); ++sl) {
      std::vector<size_t> quantized;
      for (size_t i : store_->slice_tensors(g, sl)) {
        const Piece& t = pieces_[i];
        if (t.spec->num_blocks() != 1 || elsewhere(i)) continue;
        if (!layout.quantized({static_cast<uint64_t>(t.numel), t.matrix_rows})) continue;
        if (store_->held(i, StateKind::kParam).count != static_cast<uint64_t>(t.numel)) continue;
        quantized.push_back(i);
      }
      if (quantized.empty()) continue;
      if (before_modify_) before_modify_(g);
      RETURN_IF_ERROR(store_->acquire_slice(g, sl, StateKind::kParam, Tier::kHost, AccessMode::kReadWrite));
      Status st;
      for (size_t i : quantized) {
        Result<bool> wrote = fill(*pieces_[i].spec, static_cast<uint8_t*>(store_->raw_pointer(i, StateKind::kParam)));
        if (!wrote.ok()) {
          st = wrote.status();
          break;
        }
      }
      store_->release_slice(g, sl, StateKind::kParam);
      RETURN_IF_ERROR(st);
      RETURN_IF_ERROR(store_->send_slice_home(g, sl, StateKind::kParam, Tier::kHost));
    }
  }
  return store_->synchronize();
}

Status PagedState::refresh_compute_copy(int g) {
  for (int sl = 0; sl < store_->update_slices(g); ++sl) {
    RETURN_IF_ERROR(store_->acquire_slice(g, sl, StateKind::kMaster, Tier::kHost, AccessMode::kRead));
    Status st = store_->acquire_slice(g, sl, StateKind::kParam, Tier::kHost, AccessMode::kWrite);
    if (st.ok()) {
      for (size_t i : store_->slice_tensors(g, sl)) {
        const ElementRange held = store_->held(i, StateKind::kMaster);
        if (held.count > 0) write_copy(*cpu_state_kernels(), i, store_->pointer(i, StateKind::kMaster), held);
      }
      store_->release_slice(g, sl, StateKind::kParam);
    }
    store_->release_slice(g, sl, StateKind::kMaster);
    RETURN_IF_ERROR(st);
    RETURN_IF_ERROR(store_->send_slice_home(g, sl, StateKind::kParam, Tier::kHost));
    RETURN_IF_ERROR(store_->send_slice_home(g, sl, StateKind::kMaster, Tier::kHost));
  }
  return Status::OK();
}

Status PagedState::copy_kind(StateKind saved, float* flat, bool to_store) {
  drain_compute();
  drop_prefetch();  // weights gathered ahead would miss this change
  const StateKind kind = stored_kind(saved);
  if (to_store) {
    return fill_kind(saved, [flat](const model::TensorSpec& t, float* chunk) {
      std::memcpy(chunk, flat + t.offset, static_cast<size_t>(t.numel) * sizeof(float));
      return Status::OK();
    });
  }
  for (int g = 0; g < store_->num_groups(); ++g) {
    CHECK_MSG(!store_->sliced(g, kind), "copy_kind out of a kind this rank holds only its ranges of");
    for (int sl = 0; sl < store_->update_slices(g); ++sl) {
      RETURN_IF_ERROR(store_->acquire_slice(g, sl, kind, Tier::kHost, AccessMode::kRead));
      for (size_t i : store_->slice_tensors(g, sl)) {
        if (elsewhere(i)) continue;
        if (pieces_[i].spec->frozen && kind != StateKind::kParam) {
          // No gradient or moments; its values are its compute copy's.
          if (kind == StateKind::kMaster)
            RETURN_IF_ERROR(read_copy_values(i, 0, static_cast<uint64_t>(pieces_[i].numel), flat + pieces_[i].offset));
          continue;
        }
        get_values(i, kind, flat + pieces_[i].offset, static_cast<uint64_t>(pieces_[i].numel));
      }
      store_->release_slice(g, sl, kind);
      RETURN_IF_ERROR(store_->send_slice_home(g, sl, kind, Tier::kHost));
    }
  }
  return store_->synchronize();
}

// A save reads beside training; the chunk space orders the reads after the compute stream's
// releases (slot fences), and the compute stream writes only gradients, which saves never read.
Status PagedState::read_flat(StateKind saved, uint64_t offset, uint64_t length, void* dst) {
  const StateKind kind = stored_kind(saved);
  CHECK_MSG(offset % sizeof(float) == 0 && length % sizeof(float) == 0, "read_flat of a range that splits a float");
  int64_t first = static_cast<int64_t>(offset / sizeof(float));
  const int64_t end = first + static_cast<int64_t>(length / sizeof(float));
  float* out = static_cast<float*>(dst);
  // The last tensor starting at or before `first`.
  auto it = std::upper_bound(sorted_.begin(), sorted_.end(), std::make_pair(first, SIZE_MAX));
  CHECK_MSG(it != sorted_.begin(), "read_flat before the first tensor");
  --it;
  while (first < end) {
    CHECK_MSG(it != sorted_.end(), "read_flat past the last tensor");
    const Piece& t = pieces_[it->second];
    CHECK_MSG(first >= t.offset && first < t.offset + t.numel,
              "read_flat of flat offset " + std::to_string(first) + ", which is in no tensor");
    const int64_t count = std::min(end, t.offset + t.numel) - first;
    const uint64_t at = static_cast<uint64_t>(first - t.offset);
    if (t.spec->frozen && kind == StateKind::kMaster) {
      // A frozen tensor's values are its compute copy's (it has no master).
      RETURN_IF_ERROR(read_copy_values(it->second, at, static_cast<uint64_t>(count), out));
      out += count;
      first += count;
      ++it;
      continue;
    }
    // Of a sliced kind the range must lie in this rank's slice; offsets count from its start.
    const ElementRange held = store_->held(it->second, kind);
    CHECK_MSG(at >= held.first && at + static_cast<uint64_t>(count) <= held.end(),
              "read_flat of " + std::string(state_kind_name(kind)) + " state outside this rank's range");
    if (store_->layout().is_f32(kind)) {
      RETURN_IF_ERROR(store_->read_tensor(it->second, kind, at - held.first, static_cast<uint64_t>(count), out));
    } else {
      RETURN_IF_ERROR(read_moments(it->second, kind, at - held.first, static_cast<uint64_t>(count), out));
    }
    out += count;
    first += count;
    ++it;
  }
  return Status::OK();
}

Status PagedState::load_params(const float* flat) { return copy_kind(StateKind::kParam, const_cast<float*>(flat), true); }
Status PagedState::store_params(float* flat) { return copy_kind(StateKind::kParam, flat, false); }
Status PagedState::store_grads(float* flat) { return copy_kind(StateKind::kGrad, flat, false); }
Status PagedState::store_moments(float* m_flat, float* v_flat) {
  RETURN_IF_ERROR(copy_kind(StateKind::kAdamM, m_flat, false));
  return copy_kind(StateKind::kAdamV, v_flat, false);
}

Status PagedState::load_moments(const float* m_flat, const float* v_flat) {
  RETURN_IF_ERROR(copy_kind(StateKind::kAdamM, const_cast<float*>(m_flat), true));
  return copy_kind(StateKind::kAdamV, const_cast<float*>(v_flat), true);
}

Status PagedState::zero_grads() {
  drain_compute();
  drop_prefetch();  // none is kept across the optimizer
  // A step skipped after its last micro-batch (a non-finite loss) never reached clip_and_step():
  // its last overlapped update's kinds are released first, as the step would have (and a
  // micro-batch that failed half-way leaves no group open).
  const Status settled = settle_update();
  open_groups_ = 0;
  updates_due_.clear();
  RETURN_IF_ERROR(std::exchange(deferred_, Status::OK()));  // a sum end() could not make
  RETURN_IF_ERROR(settled);
  if (workspace_) std::fill(gradient_batches_seen_.begin(), gradient_batches_seen_.end(), 0);
  // Its gradient sums finish before the gradients are zeroed.
  if (reduces_at_handover()) RETURN_IF_ERROR(finish_handovers().status());
  store_->space().trace_usage();  // a trace's memory counters start from every tier's use
  trace::Span span("optimizer", "zero gradients");
  for (const ProgramEvent& e : zero_pass_) {
    const int g = e.access.group;
    if (store_->zero_by_discard(g, e.access.kind)) continue;  // its chunks now read as zeros
    RETURN_IF_ERROR(store_->acquire_group(g, e.access.kind, e.access.prefetch_to, e.mode));
    for (size_t i : store_->group_tensors(g)) {
      const uint64_t held = store_->held(i, StateKind::kGrad).count;
      if (held > 0) kernels_->zero(store_->pointer(i, StateKind::kGrad), static_cast<int64_t>(held));
    }
    kernels_->synchronize();
    store_->release_group(g, e.access.kind);
  }
  return Status::OK();
}

kernels::AdamWParams PagedState::adamw_params(float lr) const {
  kernels::AdamWParams p;
  p.lr = lr;
  p.beta1 = options_.optimizer.beta1;
  p.beta2 = options_.optimizer.beta2;
  p.eps = options_.optimizer.eps;
  p.step = step_count_;
  return p;
}

Status PagedState::update_group(int g, float coefficient, kernels::AdamWParams p, double* sum_squares) {
  // AdamW runs where the group's moments live: the device tier, or host memory (NVMe-homed
  // moments are read into host slots and written back when evicted); there, as the program
  // says, slice by slice.
  const Tier where = adam_tier(g);
  const GroupUpdate& update = updates_[update_index_.at(static_cast<size_t>(g))];
  trace::Span span("optimizer", "adamw group", g);
  span.arg("tier", static_cast<double>(where));
  if (before_modify_) before_modify_(g);
  if (sharded() && !slices_params() && queues_copy_gathers(where)) ++queued_copy_gathers_;
  if (!update.by_slices)
    return update_tensors(g, kWholeGroup, store_->group_tensors(g), where, coefficient, p, sum_squares);
  CHECK_MSG(sum_squares == nullptr, "the overlapped optimizer updates its groups whole");
  for (int s = 0; s < store_->update_slices(g); ++s)
    RETURN_IF_ERROR(update_tensors(g, s, store_->slice_tensors(g, s), where, coefficient, p, nullptr));
  return Status::OK();
}

Status PagedState::update_tensors(int g, int slice, std::span<const size_t> tensors, Tier where, float coefficient,
                                  kernels::AdamWParams p, double* sum_squares) {
  // The kinds, in the order, the program's update of the group acquires.
  const GroupUpdate& update = updates_[update_index_.at(static_cast<size_t>(g))];
  RETURN_IF_ERROR(acquire_update_kinds(g, slice, where));
  if (!apply_update(g, tensors, where, coefficient, p, sum_squares)) {
    for (StateKind k : update.kinds) release_update(g, slice, k);
    return Status::OK();
  }
  return finish_update(g, slice, tensors, where);
}

Status PagedState::acquire_update_kinds(int g, int slice, Tier where, Stream* consumer) {
  const GroupUpdate& update = updates_[update_index_.at(static_cast<size_t>(g))];
  const std::vector<StateKind>& kinds = update.kinds;
  for (size_t k = 0; k < kinds.size(); ++k) {
    Status st = acquire_update(g, slice, kinds[k], where, AccessMode::kReadWrite, update.cursor, consumer);
    if (!st.ok()) {
      for (size_t r = 0; r < k; ++r) release_update(g, slice, kinds[r]);
      return st;
    }
  }
  return Status::OK();
}

bool PagedState::apply_update(int g, std::span<const size_t> tensors, Tier where, float coefficient,
                              kernels::AdamWParams p, double* sum_squares) {
  static const kernels::SimdLevel simd = kernels::detect_simd_level();
  const StateLayout& layout = store_->layout();
  if (sum_squares != nullptr) {
    // The overlap's check: this group's gradients, before anything of it changes.
    double ss = 0;
    if (where == Tier::kDevice) {
      kernels_->begin_norm();
      kernels_->add_sum_squares(grad_buffers(g));
      ss = kernels_->end_norm();
    } else {
      for (size_t i : tensors)
        if (!pieces_[i].spec->frozen) ss += kernels::cpu::sum_squares(store_->pointer(i, StateKind::kGrad), pieces_[i].numel);
    }
    *sum_squares = ss;
    if (!std::isfinite(ss)) return false;
  }
  const bool compact = layout.moments != kernels::MomentFormat::kF32;
  StateKernels& here = where == Tier::kDevice ? *kernels_ : *cpu_state_kernels();
  // On the device tier AdamW applies the clip factor prepare_clip() left there; in host memory
  // the gradients are scaled by `coefficient` first. Both are the same fp32 product.
  const bool clipped = coefficient != 1.0f;
  const bool device_clips = clipped && where == Tier::kDevice;
  on_compute_thread([&] {
  for (size_t i : tensors) {
    const Piece& t = pieces_[i];
    if (t.spec->frozen) continue;  // kept as loaded (model/params.h)
    // This rank's range of the tensor (all of it without sharded optimizer state); the moments,
    // and a sliced master, hold that range alone, the gradients and compute copy every element.
    const ElementRange range = updated_range(i);
    if (range.count == 0) continue;
    const int64_t n = static_cast<int64_t>(range.count);
    // The gradients of the range: all of the tensor's held, or (ZeRO-2) this rank's slice.
    float* grad = store_->pointer(i, StateKind::kGrad) + (range.first - store_->held(i, StateKind::kGrad).first);
    p.weight_decay = t.spec->weight_decay ? options_.optimizer.weight_decay : 0.0f;
    const StateKind mk = layout.master_kind();
    float* master = store_->pointer(i, mk) + (range.first - store_->held(i, mk).first);
    void* m = store_->raw_pointer(i, StateKind::kAdamM);
    void* v = store_->raw_pointer(i, StateKind::kAdamV);
    const size_t copy_size = dtype_size(layout.activation_dtype());
    void* copy_at = static_cast<char*>(store_->raw_pointer(i, StateKind::kParam)) +
                    (range.first - store_->held(i, StateKind::kParam).first) * copy_size;
    const int64_t tag = static_cast<int64_t>(i);  // first_nonfinite() names the tensor
    // The host's fp32 update reads the gradients scaled (one pass); the compact one scales first.
    if (clipped && where != Tier::kDevice && compact) kernels::cpu::scale_inplace(grad, n, coefficient);
    if (compact) {
      // The random bits of stochastic rounding follow (step, tensor, the range's first element),
      // never tiers or threads: the kernel counts elements from the range's start, so each rank's
      // range draws bits of its own (0 for the whole tensor).
      const kernels::MomentRounding rounding{options_.stochastic_rounding,
                                             (static_cast<uint64_t>(p.step) * 0x9E3779B97F4A7C15ull ^ i) +
                                                 range.first * 0xD1B54A32D192ED03ull};
      here.adamw_compact(master, grad, m, v, layout.moments, n, p, rounding, device_clips, tag);
      if (layout.separate_master()) write_copy(here, i, master, range);
    } else if (where == Tier::kDevice && layout.precision != Precision::kFp8) {
      // The bf16 copy is written by the same kernel.
      void* copy = layout.separate_master() ? copy_at : nullptr;
      kernels_->adamw(master, grad, static_cast<float*>(m), static_cast<float*>(v), copy, n, p, device_clips, tag);
    } else if (where == Tier::kDevice) {
      kernels_->adamw(master, grad, static_cast<float*>(m), static_cast<float*>(v), nullptr, n, p, device_clips, tag);
      write_copy(here, i, master, range);
    } else {
      // A bf16 compute copy is written by the same pass; an fp8 one is quantised after it (its
      // block scales need the whole block's new values).
      const bool copy = layout.separate_master();
      const bool bf16 = copy && !layout.quantized({static_cast<uint64_t>(t.numel), t.matrix_rows});
      auto* out = bf16 ? static_cast<uint16_t*>(copy_at) : nullptr;
      if (!kernels::adamw_step_f32_clipped(master, grad, coefficient, static_cast<float*>(m), static_cast<float*>(v),
                                           out, n, p, simd) &&
          (host_nonfinite_ < 0 || tag < host_nonfinite_))
        host_nonfinite_ = tag;
      if (copy && !bf16) write_copy(here, i, master, range);
    }
  }
  });
  if (where == Tier::kDevice) kernels_->synchronize();
  return true;
}

Status PagedState::finish_update(int g, int slice, std::span<const size_t> tensors, Tier where) {
  // ZeRO-3's ranks keep their ranges of the copy: nothing to send (begin() gathers it for compute).
  if (sharded() && !slices_params() && queues_copy_gathers(where)) {
    // The copy's chunks move only after the gather (released with its stream).
    queue_copy_gather(g, tensors);
    end_update(g, slice, comm_stream_.get());
    return Status::OK();
  }
  Status sent = sharded() && !slices_params() ? gather_copy(g, tensors, where) : Status::OK();
  end_update(g, slice);
  return sent;
}

void PagedState::end_update(int group, int slice, Stream* param_consumer) {
  const GroupUpdate& update = updates_[update_index_.at(static_cast<size_t>(group))];
  for (size_t k = 0; k < update.kinds.size(); ++k) {
    const StateKind kind = update.kinds[k];
    release_update(group, slice, kind, kind == StateKind::kParam ? param_consumer : nullptr);
    if (update.discards[k]) store_->discard(group, slice, kind);
  }
}

Status PagedState::sum_gradients(int g, parallel::Comm& comm, Stream* stream) {
  const bool to_ranges = sharded();
  trace::Span span("communication", to_ranges ? "gradient reduce to ranges" : "gradient all-reduce", g);
  const std::vector<GradBuffer> buffers = grad_buffers(g);
  const std::vector<size_t>& tensors = store_->group_tensors(g);
  Status st = Status::OK();
  for (size_t j = 0; j < buffers.size() && st.ok(); ++j) {
    float* p = const_cast<float*>(buffers[j].p);
    if (pieces_[tensors[j]].spec->frozen) continue;  // no gradient (every rank skips it alike)
    if (!to_ranges) {
      st = comm.all_reduce_sum(p, static_cast<size_t>(buffers[j].n), stream);
      continue;
    }
    // Each range summed onto its rank, the whole tensor in one collective: over every rank, or
    // an expert's over the ranks that hold it (none of it here when another group's rank does).
    if (elsewhere(tensors[j])) continue;
    parallel::Comm& over = expert_tensor(tensors[j]) ? comm_of(tensors[j]) : comm;
    st = over.reduce_scatter_v_sum(p, rank_blocks(tensors[j], 0), stream);
  }
  if (stream != nullptr) stream->synchronize();
  return st.ok() ? st : st.with_context("the gradients of parameter group " + std::to_string(g));
}

Result<std::vector<bool>> PagedState::finish_handovers() {
  std::unique_lock<std::mutex> lock(worker_mu_);
  if (!overlap_active_) return std::vector<bool>(static_cast<size_t>(store_->num_groups()), false);
  {
    trace::Span wait("optimizer", "wait for gradient sums");
    worker_cv_.wait(lock, [&] { return queue_.empty() && !worker_busy_; });
  }
  overlap_active_ = false;
  RETURN_IF_ERROR(std::exchange(worker_status_, Status::OK()));
  return updated_;
}

Status PagedState::reduce_handed_over(int g) {
  CHECK_MSG(handover_comm_ != nullptr, "gradient sums at handover without their Comm (set_comm)");
  const ProgramEvent& e = reductions_.at(static_cast<size_t>(g));
  CHECK_MSG(e.access.kind == StateKind::kGrad && e.mode == AccessMode::kReadWrite &&
                e.access.cursor == ScheduleCursor::kBeside,
            "the step program has no reduction at handover for parameter group " + std::to_string(g));
  // The handover stream waits for the gradients (for backward's last writes to them, and their
  // moves): this thread never waits holding the chunk space while compute goes on. Gloo waits
  // for the stream (the CPU backend's) and sums host memory; NCCL queues on it.
  Stream* stream = handover_stream_.get();
  RETURN_IF_ERROR(store_->acquire_group(g, StateKind::kGrad, e.access.prefetch_to, e.mode, e.access.cursor, stream));
  Status st = sum_gradients(g, *handover_comm_, stream);
  ++handover_sums_;
  store_->release_group(g, StateKind::kGrad, stream);
  return st;
}

ElementRange PagedState::updated_range(size_t i) const {
  if (pieces_[i].spec->frozen) return {0, 0};
  return sharded() ? range_of(i, options_.rank) : ElementRange{0, static_cast<uint64_t>(pieces_[i].numel)};
}

Status PagedState::gather_copy(int g, std::span<const size_t> tensors, Tier where) {
  CHECK_MSG(comm_ != nullptr, "sharded optimizer state without the ranks' Comm (set_comm)");
  // Device memory goes on the compute stream (NCCL queues there; Gloo, which moves the CPU
  // backend's host memory, waits for the stream and runs to completion); host memory without one.
  Stream* stream = where == Tier::kDevice ? compute_stream_ : nullptr;
  if (stream != nullptr) settle_before_collective();
  trace::Span span("communication", "updated weight gather", g);
  for (size_t i : tensors) {
    if (elsewhere(i) || pieces_[i].spec->frozen) continue;  // a frozen tensor was not updated (on any rank)
    // Each rank's range, from that rank, in one collective.
    const auto [copy, blocks] = copy_blocks(i);
    Status st = comm_of(i).all_gather_v(copy, blocks, stream);
    if (!st.ok()) return st.with_context("the updated weights of parameter group " + std::to_string(g));
  }
  if (stream != nullptr) stream->synchronize();
  return Status::OK();
}

std::pair<char*, std::vector<size_t>> PagedState::copy_blocks(size_t i) const {
  const StateLayout& layout = store_->layout();
  const Piece& t = pieces_[i];
  const bool whole = layout.quantized({static_cast<uint64_t>(t.numel), t.matrix_rows});
  const uint64_t whole_bytes = whole ? layout.tensor_bytes(StateKind::kParam, store_->tensor(i).shape()) : 0;
  return {static_cast<char*>(store_->raw_pointer(i, StateKind::kParam)),
          rank_blocks(i, dtype_size(layout.activation_dtype()), whole_bytes)};
}

void PagedState::queue_copy_gather(int g, std::span<const size_t> tensors) {
  // The copy was written before (the host's AdamW, or the device's, synchronized): the stream
  // starts at once.
  copy_gathers_queued_ = true;
  for (size_t i : tensors) {
    if (elsewhere(i) || pieces_[i].spec->frozen) continue;  // a frozen tensor was not updated (on any rank)
    std::pair<char*, std::vector<size_t>> piece = copy_blocks(i);  // (no structured binding: it is captured)
    queue_collective("gathering the updated weights", g, expert_tensor(i),
                     [copy = piece.first, blocks = std::move(piece.second)](parallel::Comm& c, Stream* st) {
                       return c.all_gather_v(copy, blocks, st);
                     });
  }
}

Status PagedState::finish_copy_gathers() {
  if (!std::exchange(copy_gathers_queued_, false)) return Status::OK();
  {
    trace::Span wait("wait", "communication stream");
    comm_stream_->synchronize();
  }
  return collective_error();
}

Result<double> PagedState::clip_and_step(float lr) {
  drain_compute();
  drop_prefetch();  // none is kept across the optimizer
  // The overlapped optimizer's last group: waited for and its kinds released, whatever follows.
  const Status settled = settle_update();
  RETURN_IF_ERROR(std::exchange(deferred_, Status::OK()));  // a sum end() could not make
  if (options_.overlap_optimizer) {
    // The groups whose gradients became final during backward are being (or have been)
    // updated by the worker; wait for it, then update any group it has not seen.
    std::unique_lock<std::mutex> lock(worker_mu_);
    CHECK_MSG(overlap_active_, "begin_last_micro_batch() was not called before the step's last micro-batch");
    {
      trace::Span wait("optimizer", "wait for overlapped updates");
      worker_cv_.wait(lock, [&] { return queue_.empty() && !worker_busy_; });
    }
    overlap_active_ = false;
    Status failed = worker_status_;
    worker_status_ = Status::OK();
    const std::vector<bool> done = updated_;
    const kernels::AdamWParams p = overlap_params_;
    double sum = overlap_sum_squares_;
    int bad_group = overlap_bad_group_;
    lock.unlock();
    RETURN_IF_ERROR(failed);
    RETURN_IF_ERROR(settled);
    for (size_t u = 0; u < updates_.size() && bad_group < 0; ++u) {
      const int g = updates_[u].group;
      if (done[static_cast<size_t>(g)]) continue;
      double ss = 0;
      RETURN_IF_ERROR(update_group(g, 1.0f, p, &ss));
      sum += ss;
      if (!std::isfinite(ss)) bad_group = g;
    }
    if (bad_group >= 0) {
      return Status::InvalidArgument(
          "the gradients of parameter group " + std::to_string(bad_group) +
          " are not finite (NaN or Inf), and with optim.overlap_backward other groups were already updated during "
          "backward, so the step cannot be skipped; the run stops without saving this state (the last committed "
          "checkpoint is intact: resume from it with optim.overlap_backward=false to skip such steps, or lower "
          "optim.lr)");
    }
    RETURN_IF_ERROR(check_updated_parameters());
    return std::sqrt(sum);
  }
  if (reduces_at_handover()) {
    // The groups backward handed over are being (or have been) summed over the ranks by the
    // handover thread; wait for it, then sum any group it has not seen, in group order (the
    // program's), through its Comm: every rank issues the same sums in the same order.
    CHECK_MSG(overlap_active_, "begin_last_micro_batch() was not called before the step's last micro-batch");
    ASSIGN_OR_RETURN(const std::vector<bool> done, finish_handovers());
    for (int g = 0; g < store_->num_groups(); ++g)
      if (!done[static_cast<size_t>(g)]) RETURN_IF_ERROR(reduce_handed_over(g));
  }
  // The global norm, summed tensor by tensor in layout order (as AdamW::grad_norm does).
  trace::Span norm_span("optimizer", "gradient norm");
  // Consecutive groups whose gradients live in device memory are summed together (one
  // multi-tensor launch on CUDA, one wait for the run); any other group is brought in alone,
  // with nothing else held. Either way the tensors are added in layout order.
  kernels_->begin_norm();
  std::vector<int> held;
  std::vector<GradBuffer> pending;
  auto sum_and_release = [&] {
    if (!pending.empty()) on_compute_thread([&] { kernels_->add_sum_squares(pending); });
    kernels_->synchronize();  // before the release lets the chunks move
    for (int h : held) store_->release_group(h, StateKind::kGrad);
    held.clear();
    pending.clear();
  };
  // Data parallel: each group's gradients are summed over the ranks where they are acquired,
  // before their squares are. Every rank holds the sums when the optimizer state is whole
  // (all-reduce); with sharded state each rank's ranges are summed onto it (a reduce per range,
  // half the bytes of an all-reduce), it alone adds their squares, and the ranks then add their
  // partial sums.
  const bool reduce = comm_ != nullptr && comm_->world_size() > 1;
  const bool to_ranges = reduce && sharded();
  for (const ProgramEvent& e : norm_pass_) {
    const int g = e.access.group;
    const bool on_device = store_->home(g, StateKind::kGrad) == Tier::kDevice;
    if (!on_device) sum_and_release();
    CHECK_MSG(!reduce || reduces_at_handover() || workspace_ || e.mode == AccessMode::kReadWrite,
              "the program's norm pass does not write the gradients the ranks sum in place");
    Status st = store_->acquire_group(g, e.access.kind, e.access.prefetch_to, e.mode);
    if (!st.ok()) {
      sum_and_release();
      return st;
    }
    held.push_back(g);
    const std::vector<GradBuffer> buffers = grad_buffers(g);
    const std::vector<size_t>& tensors = store_->group_tensors(g);
    if (reduce && !reduces_at_handover() && !workspace_) {
      st = sum_gradients(g, *comm_, compute_stream_);  // on the compute stream, as gather_copy's weights
      if (!st.ok()) {
        sum_and_release();
        return st;
      }
    }
    for (size_t j = 0; j < buffers.size(); ++j) {
      const ElementRange range = updated_range(tensors[j]);
      const uint64_t from = range.first - store_->held(tensors[j], StateKind::kGrad).first;
      if (range.count > 0) pending.push_back({buffers[j].p + from, static_cast<int64_t>(range.count)});
    }
    if (!on_device) sum_and_release();
  }
  sum_and_release();
  double sum_squares = kernels_->end_norm();
  if (to_ranges) {
    // The partial sums added in rank order: every rank gets the same bits.
    ASSIGN_OR_RETURN(sum_squares, parallel::sum_over_ranks(*comm_, sum_squares));
    kernels_->set_norm(sum_squares);
  }
  const double norm = std::sqrt(sum_squares);
  norm_span.end();
  // A NaN or Inf anywhere is known before any group changes: the step is skipped whole (the
  // AdamW step count, used for bias correction, does not advance either).
  if (!std::isfinite(norm)) return norm;
  const float coefficient = kernels::clip_coefficient(norm, options_.optimizer.grad_clip);
  // The device tier's copy of the coefficient, made from the device's own sum (bitwise equal).
  if (coefficient != 1.0f) kernels_->prepare_clip(options_.optimizer.grad_clip);
  ++step_count_;
  const kernels::AdamWParams p = adamw_params(lr);
  Status updated = Status::OK();
  for (size_t u = 0; u < updates_.size() && updated.ok(); ++u) updated = update_group(updates_[u].group, coefficient, p);
  const Status gathered = finish_copy_gathers();
  RETURN_IF_ERROR(updated);
  RETURN_IF_ERROR(gathered);
  RETURN_IF_ERROR(check_updated_parameters());
  return norm;
}

Status PagedState::check_updated_parameters() {
  int64_t first = std::exchange(host_nonfinite_, -1);
  for (StateKernels* k : {kernels_, cpu_state_kernels()}) {
    const int64_t t = k->first_nonfinite();
    if (t >= 0 && (first < 0 || t < first)) first = t;
  }
  if (sharded() && comm_ != nullptr && comm_->world_size() > 1) {
    // Each range is updated on its rank alone: every rank learns the first tensor of any, so
    // that all of them stop at this step with the same error.
    std::vector<int64_t> firsts(static_cast<size_t>(comm_->world_size()), 0);
    firsts[static_cast<size_t>(comm_->rank())] = first + 1;  // 0: none
    RETURN_IF_ERROR(parallel::sum_over_ranks(*comm_, std::span<int64_t>(firsts)));
    for (int64_t f : firsts)
      if (f > 0 && (first < 0 || f - 1 < first)) first = f - 1;
  }
  if (first < 0) return Status::OK();
  const std::string cause =
      options_.optimizer.eps == 0.0f
          ? "optim.eps=0 divides 0 by 0 where a gradient and its moments are 0: set optim.eps > 0 (1e-8 is usual)"
          : fmt::format("the update overflowed with optim.eps={:g}: lower optim.lr", options_.optimizer.eps);
  return Status::InvalidArgument(fmt::format(
      "AdamW produced non-finite parameters (NaN or Inf) in '{}' (the first such tensor) from finite gradients; {}. "
      "The run stops without saving this state; checkpoints committed before it are intact",
      pieces_[static_cast<size_t>(first)].spec->name, cause));
}

void PagedState::begin_last_micro_batch(float lr) {
  if (!options_.overlap_optimizer && !reduces_at_handover()) return;
  std::lock_guard<std::mutex> lock(worker_mu_);
  if (options_.overlap_optimizer) ++step_count_;
  overlap_params_ = adamw_params(lr);
  updated_.assign(static_cast<size_t>(store_->num_groups()), false);
  grad_releases_.assign(static_cast<size_t>(store_->num_groups()), 0);
  overlap_sum_squares_ = 0;
  overlap_bad_group_ = -1;
  overlap_active_ = true;
}

void PagedState::hand_over_update(int g) {
  const Status settled = settle_update();
  {
    std::lock_guard<std::mutex> lock(worker_mu_);
    if (!settled.ok() && worker_status_.ok()) worker_status_ = settled;
    // After a group with non-finite gradients, or an error, the step is lost: later groups are
    // left alone.
    if (overlap_bad_group_ >= 0 || !worker_status_.ok()) {
      updated_[static_cast<size_t>(g)] = true;
      return;
    }
  }
  // Whole groups (the program does not slice overlapped updates), where the moments live; the
  // update stream, not this thread, waits for the moves.
  const Status acquired = acquire_update_kinds(g, kWholeGroup, adam_tier(g), update_stream_.get());
  {
    std::lock_guard<std::mutex> lock(worker_mu_);
    if (!acquired.ok()) {
      if (worker_status_.ok()) worker_status_ = acquired;
      updated_[static_cast<size_t>(g)] = true;
      return;
    }
    pending_update_ = g;
    pending_applied_ = false;
    queue_.push_back(g);
  }
  worker_cv_.notify_all();
}

// A group whose gradients were not finite is released as it was (nothing discarded), and the
// groups after it are not acquired: the step is lost and the run stops (clip_and_step), so its
// traffic need not be the plan's.
Status PagedState::settle_update() {
  if (pending_update_ < 0) return Status::OK();
  bool applied = false;
  {
    std::unique_lock<std::mutex> lock(worker_mu_);
    if (!queue_.empty() || worker_busy_) {
      trace::Span wait("optimizer", "wait for the overlapped update", pending_update_);
      worker_cv_.wait(lock, [&] { return queue_.empty() && !worker_busy_; });
    }
    applied = pending_applied_;
  }
  const int g = std::exchange(pending_update_, -1);
  if (applied) return finish_update(g, kWholeGroup, store_->group_tensors(g), adam_tier(g));
  for (StateKind k : updates_[update_index_.at(static_cast<size_t>(g))].kinds) release_update(g, kWholeGroup, k);
  return Status::OK();
}

void PagedState::worker_loop() {
  trace::name_thread(options_.overlap_optimizer ? "optimizer (overlapped)" : "communication (gradients)");
  std::unique_lock<std::mutex> lock(worker_mu_);
  for (;;) {
    worker_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    // Stopping: what is queued is left (sums would be collectives the other ranks may not make).
    if (stop_) return;
    const int g = queue_.front();
    queue_.pop_front();
    // After a group with non-finite gradients the step is lost; later groups are left alone.
    if (overlap_bad_group_ >= 0 || !worker_status_.ok()) {
      updated_[static_cast<size_t>(g)] = true;
      worker_cv_.notify_all();
      continue;
    }
    worker_busy_ = true;
    const kernels::AdamWParams p = overlap_params_;
    lock.unlock();
    double ss = 0;
    bool applied = false;
    Status st = Status::OK();
    if (options_.overlap_optimizer) {
      // The compute thread acquired the group's kinds (hand_over_update); they are here once the
      // update stream has waited for their moves. It releases them (settle_update).
      update_stream_->synchronize();
      const Tier where = adam_tier(g);
      trace::Span span("optimizer", "adamw group", g);
      span.arg("tier", static_cast<double>(where));
      if (before_modify_) before_modify_(g);
      applied = apply_update(g, store_->group_tensors(g), where, 1.0f, p, &ss);
    } else {
      st = reduce_handed_over(g);
    }
    lock.lock();
    worker_busy_ = false;
    if (st.ok() && !options_.overlap_optimizer) {
      updated_[static_cast<size_t>(g)] = true;  // summed over the ranks
    } else if (st.ok()) {
      updated_[static_cast<size_t>(g)] = true;
      pending_applied_ = applied;
      overlap_sum_squares_ += ss;
      if (std::isfinite(ss)) ++overlapped_updates_;
      else overlap_bad_group_ = g;
    } else if (worker_status_.ok()) {
      worker_status_ = st;
    }
    worker_cv_.notify_all();
  }
}

PagedState::~PagedState() {
  drain_compute();  // queued ops may still use chunks whose slots go back to the arena
  if (worker_.joinable()) {
    (void)settle_update();  // a step that stopped between handovers: the worker finishes it first
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      stop_ = true;
    }
    worker_cv_.notify_all();
    worker_.join();
  }
}

void PagedState::on_compute_thread(const std::function<void()>& work) {
  const bool cpu = compute_stream_ != nullptr && device_->kind() == DeviceKind::kCpu;
  if (!cpu || (worker_.joinable() && std::this_thread::get_id() == worker_.get_id())) {
    work();
    return;
  }
  CpuStream& stream = as_cpu_stream(*compute_stream_);
  stream.enqueue([&work] { work(); });
  stream.synchronize();
}

Stream* PagedState::model_stream() const {
  CHECK_MSG(compute_stream_ != nullptr,
            "PagedState pages for a model whose ops are queued on its device's compute stream; this model runs its "
            "ops in the caller (made without a Device)");
  return compute_stream_;
}

Status PagedState::begin(int group, bool params, bool grads) {
  RETURN_IF_ERROR(deferred_);  // a sum end() could not make
  Stream* s = model_stream();
  if (params && gathered_ && overlaps_collectives()) {
    RETURN_IF_ERROR(begin_gathered(group));
  } else if (params) {
    RETURN_IF_ERROR(acquire_part(group, StateKind::kParam, AccessMode::kRead, s));
    if (gathered_) {
      gather_params(group, /*experts=*/false, *s);
      if (!deferred_.ok()) {  // no compute with weights gathered in part
        gathered_->close(group);
        store_->release_part(group, kDensePart, StateKind::kParam, s);
        return deferred_;
      }
    }
  }
  if (grads) {
    // (A group whose sums are still queued is acquired again: a tied embedding at the head.)
    if (std::find(summing_.begin(), summing_.end(), group) != summing_.end()) release_summed_slices();
    Status st = acquire_part(group, StateKind::kGrad, AccessMode::kReadWrite, s);
    if (!st.ok()) {
      if (params && gathered_) gathered_->close(group, overlaps_collectives() ? s : nullptr);
      if (params && !(gathered_ && overlaps_collectives()))
        store_->release_part(group, kDensePart, StateKind::kParam, s);
      return st;
    }
    if (workspace_) open_gradients(group, *s);
  }
  ++open_groups_;
  return Status::OK();
}

Status PagedState::begin_experts(int group, std::span<const int> experts, bool params, bool grads) {
  RETURN_IF_ERROR(deferred_);
  Stream* s = model_stream();
  // Ranks holding slices of a kind take part in its collectives for every expert of the layer,
  // whichever their own tokens reach: ZeRO-3 gathers every expert's weights, ZeRO-2 sums every
  // expert's gradients (zero where no token of a rank went), on every rank alike.
  const std::vector<int> every = held_parts(group);
  const std::span<const int> weights = gathered_ ? std::span<const int>(every) : experts;
  if (!sums_experts_with_layer()) {
    release_summed_slices();  // the experts' collectives wait for the compute stream anyway
  } else if (std::find(summing_.begin(), summing_.end(), group) != summing_.end()) {
    release_summed_slices();  // its slices, still pinned for the sums of the micro-batch before
  }
  // Expert groups on NCCL: the model's token exchanges between here and end_experts() run on the
  // compute stream, after the communication stream's work and before its next (see
  // settle_before_collective). Gloo's run apart on the host.
  if (options_.expert_ranks > 1 && device_->kind() != DeviceKind::kCpu) settle_before_collective();
  const std::span<const int> gradients = workspace_ ? std::span<const int>(every) : experts;
  // A rank that fails here skips the experts' collectives the others make: it makes no more
  // collectives at all (deferred_ stops them), so that the others fail at theirs rather than
  // pair theirs with its next ones.
  auto failed = [&](Status st) {
    if ((gathered_ || workspace_) && deferred_.ok()) deferred_ = st;
    return st;
  };
  // Overlapped ZeRO-3 gathered the experts with their layer, on the communication stream.
  const bool weights_here = params && !gathers_experts_with_layer();
  if (weights_here) {
    if (Status st = store_->acquire_parts(group, weights, StateKind::kParam, Tier::kDevice, AccessMode::kRead, s);
        !st.ok())
      return failed(st);
    if (gathered_) {
      gather_params(group, /*experts=*/true, *s);
      if (!deferred_.ok()) {
        store_->release_parts(group, weights, StateKind::kParam, s);
        return deferred_;
      }
    }
  }
  if (grads) {
    Status st = store_->acquire_parts(group, gradients, StateKind::kGrad, Tier::kDevice, AccessMode::kReadWrite, s);
    if (st.code() == StatusCode::kOutOfMemory && !summing_.empty()) {  // as acquire_part does
      release_summed_slices();
      st = store_->acquire_parts(group, gradients, StateKind::kGrad, Tier::kDevice, AccessMode::kReadWrite, s);
    }
    if (!st.ok()) {
      if (weights_here) store_->release_parts(group, weights, StateKind::kParam, s);
      return failed(st);
    }
    if (workspace_) fill_gradients(group, /*experts=*/true, *s);
  }
  return Status::OK();
}

void PagedState::end_experts(int group, std::span<const int> experts, bool params, bool grads) {
  const std::vector<int> every = held_parts(group);
  const bool queued = grads && sums_experts_with_layer();
  if (grads && workspace_) {
    // An MoE layer's gradients are taken in one batch of the micro-batch (its backward), so the
    // experts' sums are made here, while their slices are acquired: in line, or queued on the
    // communication stream ahead of the layer's own (end()), their slices pinned until they are
    // done and released with the layer's (release_summed_slices).
    CHECK_MSG(handover_[static_cast<size_t>(group)] == 1,
              "an MoE layer whose gradients are taken in more than one batch of a micro-batch");
    if (queued) {
      queue_gradient_sums(group, /*experts=*/true);
      summing_experts_[static_cast<size_t>(group)] = every;
    } else {
      sum_gradients_to_ranges(group, /*experts=*/true, *model_stream());
    }
  }
  if (params && !gathers_experts_with_layer())
    store_->release_parts(group, gathered_ ? std::span<const int>(every) : experts, StateKind::kParam,
                          compute_stream_);
  if (grads && !queued)
    store_->release_parts(group, workspace_ ? std::span<const int>(every) : experts, StateKind::kGrad,
                          compute_stream_);
  if (options_.expert_ranks > 1) after_collective();  // (begin_experts)
}

void PagedState::end(int group, bool params, bool grads) {
  --open_groups_;
  const bool overlapped = overlaps_collectives();
  // Overlapped, the sums onto the slice are queued on the communication stream, after the
  // group's backward: the slice's chunk moves only after them.
  const bool summed = grads && workspace_ && close_gradients(group, *model_stream());
  // Without overlap the compute stream's later work reuses the place in order; with it, a gather
  // on the communication stream waits for this group's compute first.
  if (params && gathered_ && overlapped && keeps_gathered(group)) ahead_.push_back(Ahead{group, nullptr});
  else if (params && gathered_) gathered_->close(group, overlapped ? compute_stream_ : nullptr);
  // (An overlapped gather released the chunk once it had copied from it.)
  if (params && !(gathered_ && overlapped))
    store_->release_part(group, kDensePart, StateKind::kParam, compute_stream_);
  if (grads && summed && overlapped) {
    // The slice's chunk stays pinned until the sums queued on the communication stream have
    // written it, and is then released with the compute stream. Released with the communication
    // stream instead, it would make the next acquisitions of the chunk (other groups' slices
    // share it) wait for those sums on the compute stream: a chunk's fence orders its users one
    // after another. At most one group's slices stay pinned so, and an acquisition that finds the
    // device tier full releases them first (acquire_part).
    release_summed_slices();
    summing_.push_back(group);
  } else if (grads) {
    store_->release_part(group, kDensePart, StateKind::kGrad, compute_stream_);
  }
  // In the last micro-batch a group's gradients are final when the last batch of the program
  // that acquires them ends (the embedding's, whose gradients a tied head adds to first, at its
  // backward).
  if ((options_.overlap_optimizer || reduces_at_handover()) && overlap_active_ && grads &&
      ++grad_releases_[static_cast<size_t>(group)] == handover_[static_cast<size_t>(group)]) {
    if (!options_.overlap_optimizer) {
      {
        std::lock_guard<std::mutex> lock(worker_mu_);
        queue_.push_back(group);
      }
      worker_cv_.notify_all();
    } else {
      updates_due_.push_back(group);
    }
  }
  // The overlapped optimizer takes a group once the model holds nothing more of the batch that
  // handed it over (a tied head's batch also holds the embedding): where the step program's
  // batch closes, so the update's acquisitions meet the tiers as the replay's do.
  if (open_groups_ == 0 && !updates_due_.empty()) {
    for (int g : updates_due_) hand_over_update(g);
    updates_due_.clear();
  }
}

StateKernels* PagedState::cpu_state_kernels() { return cpu_kernels_.get(); }

std::vector<GradBuffer> PagedState::grad_buffers(int g) {
  std::vector<GradBuffer> buffers;
  for (size_t i : store_->group_tensors(g)) {
    // A frozen tensor has none (an empty buffer keeps the tensors' order).
    const uint64_t held = store_->held(i, StateKind::kGrad).count;
    buffers.push_back({held > 0 ? store_->pointer(i, StateKind::kGrad) : nullptr, static_cast<int64_t>(held)});
  }
  return buffers;
}

void PagedState::write_copy(StateKernels& kernels, size_t i, const float* master, ElementRange range) {
  if (range.count == 0) return;
  const Piece& t = pieces_[i];
  void* copy = store_->raw_pointer(i, StateKind::kParam);
  if (store_->layout().quantized({static_cast<uint64_t>(t.numel), t.matrix_rows})) {
    CHECK_MSG(range.count == static_cast<uint64_t>(t.numel), "a quantised matrix's compute copy is written whole");
    if (store_->layout().precision == Precision::kNf4) {
      // A frozen base's NF4 copy, written once from the loaded values in host memory.
      CHECK_MSG(t.spec->frozen, "an NF4 compute copy of trained tensor " + t.spec->name);
      kernels::nf4_quantize(master, t.numel, static_cast<uint8_t*>(copy));
      return;
    }
    kernels.quantize_copy(copy, master, t.matrix_rows, t.numel / t.matrix_rows);
  } else {
    // The copy holds the tensor whole, or (ZeRO-3) this rank's range of it.
    const uint64_t size = dtype_size(store_->layout().activation_dtype());
    const uint64_t from = range.first - store_->held(i, StateKind::kParam).first;
    kernels.round_copy(static_cast<char*>(copy) + from * size, master, static_cast<int64_t>(range.count));
  }
}

Status PagedState::read_copy_values(size_t i, uint64_t first, uint64_t count, float* out) {
  const Piece& t = pieces_[i];
  const StateLayout& layout = store_->layout();
  if (layout.is_f32(StateKind::kParam)) return store_->read_tensor(i, StateKind::kParam, first, count, out);
  if (layout.quantized({static_cast<uint64_t>(t.numel), t.matrix_rows}) && layout.precision == Precision::kNf4) {
    std::vector<uint8_t> copy(kernels::nf4_layout(t.numel).bytes);
    RETURN_IF_ERROR(store_->read_tensor_bytes(i, StateKind::kParam, 0, copy.size(), copy.data()));
    std::vector<float> values(static_cast<size_t>(t.numel));
    kernels::nf4_dequantize(copy.data(), t.numel, values.data());
    std::copy_n(values.data() + first, count, out);
    return Status::OK();
  }
  if (layout.quantized({static_cast<uint64_t>(t.numel), t.matrix_rows})) {
    // E4M3 blocks: the whole matrix decoded, then the range.
    const int64_t cols = t.numel / t.matrix_rows;
    std::vector<uint8_t> copy(kernels::fp8_matrix_bytes(t.matrix_rows, cols));
    RETURN_IF_ERROR(store_->read_tensor_bytes(i, StateKind::kParam, 0, copy.size(), copy.data()));
    std::vector<float> values(static_cast<size_t>(t.numel));
    kernels::cpu::dequantize_weight_e4m3(values.data(), copy.data(), t.matrix_rows, cols);
    std::copy_n(values.data() + first, count, out);
    return Status::OK();
  }
  std::vector<uint16_t> bits(count);
  RETURN_IF_ERROR(store_->read_tensor_bytes(i, StateKind::kParam, first * 2, count * 2, bits.data()));
  for (uint64_t k = 0; k < count; ++k) out[k] = kernels::bf16_to_f32(bits[k]);
  return Status::OK();
}

void PagedState::put_values(size_t i, StateKind kind, const float* values, uint64_t count) {
  if (count == 0) return;  // (a tensor holding none of the kind is not addressable)
  const int64_t n = static_cast<int64_t>(count);
  const StateLayout& layout = store_->layout();
  if (layout.is_f32(kind)) {
    std::memcpy(store_->pointer(i, kind), values, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  CHECK_MSG(kind == StateKind::kAdamM || kind == StateKind::kAdamV,
            std::string("put_values of ") + state_kind_name(kind) + ", which is not fp32");
  kernels::cpu::encode_moments(store_->raw_pointer(i, kind), values, layout.moments, is_second_moment(kind), n);
}

void PagedState::get_values(size_t i, StateKind kind, float* values, uint64_t count) {
  if (count == 0) return;  // (a tensor holding none of the kind is not addressable)
  const int64_t n = static_cast<int64_t>(count);
  const StateLayout& layout = store_->layout();
  if (layout.is_f32(kind)) {
    std::memcpy(values, store_->pointer(i, kind), static_cast<size_t>(n) * sizeof(float));
    return;
  }
  CHECK_MSG(kind == StateKind::kAdamM || kind == StateKind::kAdamV,
            std::string("get_values of ") + state_kind_name(kind) + ", which is not fp32");
  kernels::cpu::decode_moments(values, store_->raw_pointer(i, kind), layout.moments, is_second_moment(kind), n, 0, n);
}

// Reads only the stored bytes that hold the range: for int8 moments the codes of the blocks it
// touches and their scales, laid out as a tensor of those blocks alone, then decoded.
Status PagedState::read_moments(size_t i, StateKind kind, uint64_t first, uint64_t count, float* dst) {
  const kernels::MomentFormat format = store_->layout().moments;
  const bool is_v = is_second_moment(kind);
  if (format == kernels::MomentFormat::kBf16) {
    std::vector<uint16_t> bits(count);
    RETURN_IF_ERROR(store_->read_tensor_bytes(i, kind, first * 2, count * 2, bits.data()));
    kernels::cpu::decode_moments(dst, bits.data(), format, is_v, static_cast<int64_t>(count), 0,
                                 static_cast<int64_t>(count));
    return Status::OK();
  }
  CHECK_MSG(format == kernels::MomentFormat::kInt8, "read_moments of fp32 moments");
  const uint64_t n = store_->held(i, kind).count, B = kernels::kMomentBlock;
  const uint64_t b0 = first / B, b1 = (first + count - 1) / B;
  const uint64_t sub_first = b0 * B, sub_n = std::min(n, (b1 + 1) * B) - sub_first;
  const uint64_t sub_bytes = kernels::moment_bytes(format, static_cast<int64_t>(sub_n));
  const uint64_t sub_scales = sub_bytes - (b1 - b0 + 1) * sizeof(float);  // where the scales start
  const uint64_t scales = kernels::moment_bytes(format, static_cast<int64_t>(n)) - ((n + B - 1) / B) * sizeof(float);
  std::vector<uint8_t> sub(sub_bytes, 0);
  RETURN_IF_ERROR(store_->read_tensor_bytes(i, kind, sub_first, sub_n, sub.data()));
  RETURN_IF_ERROR(store_->read_tensor_bytes(i, kind, scales + b0 * sizeof(float), (b1 - b0 + 1) * sizeof(float),
                                            sub.data() + sub_scales));
  kernels::cpu::decode_moments(dst, sub.data(), format, is_v, static_cast<int64_t>(sub_n),
                               static_cast<int64_t>(first - sub_first), static_cast<int64_t>(count));
  return Status::OK();
}

const void* PagedState::param(int64_t offset) {
  const size_t i = tensor_at(offset);
  return gathered_ ? gathered_->at(i) : store_->raw_pointer(i, StateKind::kParam);
}
float* PagedState::grad(int64_t offset) {
  const size_t i = tensor_at(offset);
  CHECK_MSG(!pieces_[i].spec->frozen, "the gradient of frozen tensor " + pieces_[i].spec->name);
  return workspace_ ? static_cast<float*>(workspace_->at(i)) : store_->pointer(i, StateKind::kGrad);
}

WorkspaceLayout PagedState::workspace_layout(const std::vector<StateTensor>& tensors, const StateLayout& state,
                                             StateKind kind, int in_flight) {
  WorkspaceLayout w;
  w.kind = kind;
  // Groups' gathers in flight beside the one computing, or a group's sums beside the next's
  // backward.
  w.in_flight = in_flight;
  w.span = kind == StateKind::kGrad ? WorkspaceSpan::kMicroBatch : WorkspaceSpan::kBatch;
  for (const StateTensor& t : tensors) {
    // Nothing of an expert held elsewhere is computed here.
    const uint64_t bytes = kind == StateKind::kGrad ? t.elements * sizeof(float) : state.tensor_bytes(kind, t.shape());
    // A frozen tensor's gradient is never computed.
    w.tensor_bytes.push_back(t.elsewhere || (t.frozen && kind == StateKind::kGrad) ? 0 : bytes);
    w.groups.push_back(t.group);
  }
  return w;
}

uint64_t PagedState::gradient_working_bytes(const model::ParamLayout& layout, bool overlapped) {
  return GroupWorkspace::bytes_for(
      workspace_layout(store_tensors(layout), StateLayout{}, StateKind::kGrad, overlapped ? 1 : 0),
      model::record_micro_batch(layout.config(), false));
}

uint64_t PagedState::param_working_bytes(const model::ParamLayout& layout, const StateLayout& state, int ahead) {
  return GroupWorkspace::bytes_for(workspace_layout(store_tensors(layout), state, StateKind::kParam, ahead),
                                   model::record_micro_batch(layout.config(), false));
}

void PagedState::settle_before_collective() {
  if (device_->kind() == DeviceKind::kCpu) {
    drain_compute();  // (the communication stream's too)
    return;
  }
  if (!overlaps_collectives()) return;
  comm_done_event_->record(*comm_stream_);
  model_stream()->wait(*comm_done_event_);
}

void PagedState::after_collective() {
  if (device_->kind() == DeviceKind::kCpu || !overlaps_collectives()) return;
  compute_done_event_->record(*model_stream());
  comm_stream_->wait(*compute_done_event_);
}

PagedState::GatherPiece PagedState::gather_piece(size_t i) const {
  const StateLayout& layout = store_->layout();
  const uint64_t size = dtype_size(layout.activation_dtype());
  GatherPiece p;
  p.place = static_cast<char*>(gathered_->at(i));
  // A quantised matrix's copy (with its block scales) is owned whole, as it is stored.
  const bool whole = layout.quantized(store_->tensor(i).shape());
  const uint64_t whole_bytes = whole ? layout.tensor_bytes(StateKind::kParam, store_->tensor(i).shape()) : 0;
  const ElementRange own = store_->held(i, StateKind::kParam);
  if (own.count > 0) {
    p.own_at = p.place + (whole ? 0 : own.first * size);
    p.own = store_->raw_pointer(i, StateKind::kParam);
    p.own_bytes = whole ? whole_bytes : own.count * size;
  }
  p.blocks = rank_blocks(i, size, whole_bytes);
  return p;
}

void PagedState::gather_params(int g, bool experts, Stream& stream) {
  CHECK_MSG(comm_ != nullptr, "weights sliced over the ranks without the ranks' Comm (set_comm)");
  settle_before_collective();
  trace::Span span("communication", experts ? "expert weight gather" : "weight gather", g);
  if (!experts) gathered_->open(g);
  for (size_t i : store_->group_tensors(g)) {
    if ((store_->tensor(i).part != kDensePart) != experts || elsewhere(i)) continue;
    const GatherPiece p = gather_piece(i);
    if (p.own_bytes > 0) device_->copy(p.own_at, p.own, p.own_bytes, stream, "gathered weights");
    // Every rank's range from its rank, in one collective. After an error no more collectives.
    if (!deferred_.ok()) continue;
    Status st = comm_of(i).all_gather_v(p.place, p.blocks, &stream);
    if (!st.ok()) deferred_ = st.with_context("gathering the weights of parameter group " + std::to_string(g));
  }
  after_collective();
}

void PagedState::open_gradients(int g, Stream& stream) {
  // Opened at the group's first gradient batch of the micro-batch, kept to its last.
  if (workspace_->is_open(g)) return;
  if (overlaps_collectives()) {
    // The place may still be in an earlier group's sums, and the slice filled below in this
    // group's sums of the micro-batch before.
    workspace_->open(g, &stream);
    stream.wait(*slice_summed_[static_cast<size_t>(g)]);
  } else {
    workspace_->open(g);
  }
  fill_gradients(g, /*experts=*/false, stream);
}

void PagedState::fill_gradients(int g, bool experts, Stream& stream) {
  for (size_t i : store_->group_tensors(g)) {
    if ((store_->tensor(i).part != kDensePart) != experts || elsewhere(i) || pieces_[i].spec->frozen) continue;
    float* w = static_cast<float*>(workspace_->at(i));
    const ElementRange own = store_->held(i, StateKind::kGrad);
    // Zeros, and this rank's sums so far in its range: the ranks' sum of what backward adds
    // there is then the new sum of the range.
    device_->fill(w, 0, static_cast<uint64_t>(pieces_[i].numel) * sizeof(float), stream);
    if (own.count > 0)
      device_->copy(w + own.first, store_->pointer(i, StateKind::kGrad), own.count * sizeof(float), stream,
                    "gradient slice");
  }
}

bool PagedState::close_gradients(int g, Stream& stream) {
  // Summed once a micro-batch, at the group's last gradient batch (a tied embedding's own
  // backward, after the head's).
  int& seen = gradient_batches_seen_[static_cast<size_t>(g)];
  if (++seen < handover_[static_cast<size_t>(g)]) return false;
  seen = 0;
  if (overlaps_collectives()) {
    queue_gradient_sums(g, /*experts=*/false);
    workspace_->close(g, comm_stream_.get());
  } else {
    sum_gradients_to_ranges(g, /*experts=*/false, stream);
    workspace_->close(g);
  }
  return true;
}

void PagedState::queue_collective(const char* what, int group, bool expert,
                                  std::function<Status(parallel::Comm&, Stream*)> op, std::function<void(Stream*)> then) {
  parallel::Comm* comm = expert ? expert_handover_comm_ : handover_comm_;
  CHECK_MSG(comm != nullptr, expert ? "an expert's collective on the communication stream without the holders' Comm"
                                    : "a collective on the communication stream without its Comm (set_comm)");
  auto failed = [this, what, group](const Status& st) {
    collectives_stopped_ = true;
    std::lock_guard<std::mutex> lock(collective_mu_);
    if (collective_error_.ok()) collective_error_ = st.with_context(fmt::format("{} of parameter group {}", what, group));
  };
  if (device_->kind() != DeviceKind::kCpu) {
    // NCCL queues the collective on the stream and returns.
    if (collectives_stopped_) return;
    trace::Span span("communication", what, group);
    if (Status st = op(*comm, comm_stream_.get()); !st.ok()) failed(st);
    else if (then) then(comm_stream_.get());
    return;
  }
  // Gloo moves host memory (the CPU backend's device memory) from the stream's own thread.
  as_cpu_stream(*comm_stream_).enqueue([this, comm, what, group, failed, op = std::move(op), then = std::move(then)] {
    if (collectives_stopped_) return;
    {
      trace::Span span("communication", what, group);
      if (Status st = op(*comm, nullptr); !st.ok()) return failed(st);
    }
    if (then) then(nullptr);
  });
}

void PagedState::release_summed_slices(bool done_only) {
  std::erase_if(summing_, [&](int g) {
    Event& summed = *slice_summed_[static_cast<size_t>(g)];
    if (!summed.query()) {
      if (done_only) return false;
      trace::Span wait("wait", "communication stream");
      summed.synchronize();
    }
    store_->release_part(g, kDensePart, StateKind::kGrad, compute_stream_);
    std::vector<int>& experts = summing_experts_[static_cast<size_t>(g)];
    if (!experts.empty()) store_->release_parts(g, experts, StateKind::kGrad, compute_stream_);
    experts.clear();
    return true;
  });
}

Status PagedState::acquire_part(int g, StateKind kind, AccessMode mode, Stream* consumer, bool follow) {
  Status st = store_->acquire_part(g, kDensePart, kind, Tier::kDevice, mode, consumer, follow);
  if (st.code() != StatusCode::kOutOfMemory || summing_.empty()) return st;
  release_summed_slices();
  return store_->acquire_part(g, kDensePart, kind, Tier::kDevice, mode, consumer, /*follow=*/false);
}

Status PagedState::begin_gathered(int g) {
  RETURN_IF_ERROR(collective_error());
  if (!ahead_.empty() && ahead_.front().group == g) {
    // Gathered ahead (or kept from its batch before, on the compute stream's order since): its
    // acquisition came ahead of its entry, so the schedule moves past it now.
    Ahead a = std::move(ahead_.front());
    ahead_.pop_front();
    if (a.done) {
      model_stream()->wait(*a.done);
      spare_ahead_events_.push_back(std::move(a.done));
    }
    RETURN_IF_ERROR(store_->pass_part(g, kDensePart, StateKind::kParam, Tier::kDevice));
  } else {
    drop_prefetch();
    RETURN_IF_ERROR(queue_gather(g, /*follow=*/true, *gathered_event_));
    model_stream()->wait(*gathered_event_);
  }
  // Where g is in the order: the next entry, else the first one after it (wrapping).
  for (size_t n = 0; n < gather_order_.size(); ++n) {
    const size_t i = (gather_next_ + n) % gather_order_.size();
    if (gather_order_[i] != g) continue;
    gather_next_ = i + 1;
    break;
  }
  // The groups after those already ahead, up to gather_ahead of them and not past the
  // micro-batch's last gather, while the workspace has room; not one still open (g itself,
  // which end() may keep).
  const size_t most = static_cast<size_t>(std::max(options_.gather_ahead, 1));
  for (size_t at = gather_next_ + ahead_.size(); ahead_.size() < most && at < gather_order_.size(); ++at) {
    const int next = gather_order_[at];
    if (gathered_->is_open(next) || !gathered_->can_open(next)) break;
    std::unique_ptr<Event> done;
    if (spare_ahead_events_.empty()) {
      done = device_->create_event();
    } else {
      done = std::move(spare_ahead_events_.back());
      spare_ahead_events_.pop_back();
    }
    // A gather that cannot be queued now (no room to acquire the slices) is made when its
    // batch begins: g's batch goes on.
    if (!queue_gather(next, /*follow=*/false, *done).ok()) {
      spare_ahead_events_.push_back(std::move(done));
      break;
    }
    ahead_.push_back(Ahead{next, std::move(done)});
  }
  return Status::OK();
}

bool PagedState::keeps_gathered(int g) const {
  // gather_next_ is the entry after g's own (begin_gathered); those ahead follow it.
  const size_t again = gather_next_ + ahead_.size();
  return again < gather_order_.size() && gather_order_[again] == g &&
         ahead_.size() <= static_cast<size_t>(std::max(options_.gather_ahead, 1));
}

void PagedState::drop_prefetch() {
  for (Ahead& a : ahead_) {
    // A gather's only user is its stream; a kept group's last was the compute stream.
    gathered_->close(a.group, a.done ? comm_stream_.get() : compute_stream_);
    if (a.done) spare_ahead_events_.push_back(std::move(a.done));
  }
  ahead_.clear();
}

Status PagedState::queue_gather(int g, bool follow, Event& done) {
  Stream& cs = *comm_stream_;
  // The chunk is read on the communication stream: its moves are waited for there, and it moves
  // again only after the copy of this rank's ranges.
  RETURN_IF_ERROR(acquire_part(g, StateKind::kParam, AccessMode::kRead, &cs, follow));
  // An MoE layer's experts come along (every one the layer has, as begin_experts would gather).
  const std::vector<int> experts = gathers_experts_with_layer() ? held_parts(g) : std::vector<int>{};
  if (!experts.empty()) {
    Status st = store_->acquire_parts(g, experts, StateKind::kParam, Tier::kDevice, AccessMode::kRead, &cs);
    if (st.code() == StatusCode::kOutOfMemory && !summing_.empty()) {  // as acquire_part does
      release_summed_slices();
      st = store_->acquire_parts(g, experts, StateKind::kParam, Tier::kDevice, AccessMode::kRead, &cs);
    }
    if (!st.ok()) {
      store_->release_part(g, kDensePart, StateKind::kParam, &cs);
      return st;
    }
  }
  gathered_->open(g, &cs);
  for (size_t i : store_->group_tensors(g)) {
    if ((store_->tensor(i).part != kDensePart && experts.empty()) || elsewhere(i)) continue;
    GatherPiece p = gather_piece(i);
    if (p.own_bytes > 0) device_->copy(p.own_at, p.own, p.own_bytes, cs, "gathered weights");
    queue_collective("gathering the weights", g, expert_tensor(i),
                     [w = p.place, blocks = std::move(p.blocks)](parallel::Comm& c, Stream* st) {
                       return c.all_gather_v(w, blocks, st);
                     });
  }
  store_->release_part(g, kDensePart, StateKind::kParam, &cs);
  if (!experts.empty()) store_->release_parts(g, experts, StateKind::kParam, &cs);
  done.record(cs);
  return Status::OK();
}

void PagedState::queue_gradient_sums(int g, bool experts) {
  Stream& cs = *comm_stream_;
  compute_done_event_->record(*model_stream());  // the group's backward
  cs.wait(*compute_done_event_);
  for (size_t i : store_->group_tensors(g)) {
    if ((store_->tensor(i).part != kDensePart) != experts || elsewhere(i) || pieces_[i].spec->frozen) continue;
    float* w = static_cast<float*>(workspace_->at(i));
    const ElementRange own = store_->held(i, StateKind::kGrad);
    float* slice = own.count > 0 ? store_->pointer(i, StateKind::kGrad) : nullptr;
    // The slice takes the sum of its range, and nothing after a failed collective: no partial
    // sums reach the state.
    queue_collective(
        "summing the gradients", g, expert_tensor(i),
        [w, counts = rank_blocks(i, 0)](parallel::Comm& c, Stream* st) { return c.reduce_scatter_v_sum(w, counts, st); },
        [this, w, slice, own](Stream* st) {
          if (slice == nullptr) return;
          if (st != nullptr) {
            device_->copy(slice, w + own.first, own.count * sizeof(float), *st, "gradient slice");
          } else {
            trace::Span span("copy", "gradient slice");
            std::memcpy(slice, w + own.first, own.count * sizeof(float));
          }
        });
  }
  if (!experts) slice_summed_[static_cast<size_t>(g)]->record(cs);  // the experts' are queued before
}

void PagedState::sum_gradients_to_ranges(int g, bool experts, Stream& stream) {
  CHECK_MSG(comm_ != nullptr, "gradients sliced over the ranks without the ranks' Comm (set_comm)");
  settle_before_collective();
  trace::Span span("communication", experts ? "expert gradient sums to ranges" : "gradient sums to ranges", g);
  for (size_t i : store_->group_tensors(g)) {
    if ((store_->tensor(i).part != kDensePart) != experts || elsewhere(i) || pieces_[i].spec->frozen) continue;
    float* w = static_cast<float*>(workspace_->at(i));
    // Each range summed onto its rank, in rank order (one process's sum of the same addends),
    // the whole tensor in one collective. After an error no more collectives: this rank's run
    // stops, and the others' time out.
    if (deferred_.ok()) {
      Status st = comm_of(i).reduce_scatter_v_sum(w, rank_blocks(i, 0), &stream);
      if (!st.ok()) deferred_ = st.with_context("the gradients of parameter group " + std::to_string(g));
    }
    const ElementRange own = store_->held(i, StateKind::kGrad);
    if (own.count > 0 && deferred_.ok())
      device_->copy(store_->pointer(i, StateKind::kGrad), w + own.first, own.count * sizeof(float), stream,
                    "gradient slice");
  }
  after_collective();
}

// On a device whose memory the host cannot read, checkpoints travel through a host buffer (a
// difference of memory kind: the CPU backend's device memory is host memory).
Status PagedState::offload_saved_activation(int index, const void* data, uint64_t bytes) {
  if (staging_stream_ == nullptr) return store_->write_activation(index, data, bytes);
  staging_.resize(bytes);
  device_->copy(staging_.data(), data, bytes, *staging_stream_);
  staging_stream_->synchronize();
  return store_->write_activation(index, staging_.data(), bytes);
}

Status PagedState::fetch_saved_activation(int index, void* data, uint64_t bytes) {
  drain_compute();  // the slot may still be read by queued ops
  if (staging_stream_ == nullptr) return store_->read_activation(index, data, bytes);
  staging_.resize(bytes);
  RETURN_IF_ERROR(store_->read_activation(index, staging_.data(), bytes));
  device_->copy(data, staging_.data(), bytes, *staging_stream_);
  staging_stream_->synchronize();
  return Status::OK();
}

std::string PagedState::placement_summary() const {
  std::string out;
  for (StateKind k : store_->layout().kinds()) {
    int counts[kNumTiers] = {0, 0, 0}, apart[kNumTiers] = {0, 0, 0};
    for (int g = 0; g < store_->num_groups(); ++g) {
      counts[static_cast<int>(store_->home(g, k))]++;
      // Experts homed elsewhere than their layer (placement part rows).
      for (int part : store_->parts(g))
        if (const Tier t = store_->part_home(g, part, k); t != store_->home(g, k)) apart[static_cast<int>(t)]++;
    }
    bool sliced = false;
    for (int g = 0; g < store_->num_groups(); ++g) sliced = sliced || store_->sliced(g, k);
    std::string experts;
    if (apart[0] + apart[1] + apart[2] > 0)
      experts = fmt::format(" (experts apart from their layer: {} device, {} host, {} nvme)", apart[0], apart[1], apart[2]);
    out += fmt::format("{}{}: {} device, {} host, {} nvme{}{}", out.empty() ? "" : "; ", state_kind_name(k), counts[0],
                       counts[1], counts[2], experts, sliced ? " (this rank's ranges)" : "");
  }
  return out;
}

}  // namespace strata
