#include "train/paged_engine.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "core/log.h"
#include "core/units.h"
#include "memory/chunk.h"
#include "train/planning.h"

#if STRATA_HAVE_CUDA
#include "model/cuda/decoder_cuda.h"
#endif

namespace strata {
namespace {

// Device memory kept beside the activation table for the arena's alignment of its blocks.
constexpr uint64_t kArenaSlack = 64ull << 10;

}  // namespace

Result<std::unique_ptr<PagedEngine>> PagedEngine::create(const model::ModelConfig& mc, const TrainConfig& t,
                                                         const OptimizerConfig& oc, DeviceKind backend) {
  std::unique_ptr<PagedEngine> e(new PagedEngine());
  e->mc_ = mc;
  e->budgets_ = t;
  e->dropout_seed_ = t.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(t.dp_rank) * 0xC2B2AE3D27D4EB4Full;
  // The plan is this rank's among the ranks launched (parallel.world_size is what strata plan
  // plans for), at the level the engine trains: parallel.zero, ZeRO-1 for auto.
  e->budgets_.plan_world_size = std::max(1, t.dp_world);
  e->budgets_.plan_zero = t.dp_world <= 1 || t.plan_zero == 0 ? 0 : t.plan_zero < 0 ? 1 : t.plan_zero;
  e->backend_ = backend;
  // Expert parallelism: what it cannot split is refused before anything is planned.
  RETURN_IF_ERROR(check_expert_parallel(mc, t.parallel_expert, std::max(1, t.dp_world), e->budgets_.plan_zero));
  RETURN_IF_ERROR(check_experts_reached(mc, t.experts_reached));
  RETURN_IF_ERROR(check_context_parallel(t, std::max(1, t.dp_world), backend));
  RETURN_IF_ERROR(check_latent_attention(mc, t, backend));
  RETURN_IF_ERROR(e->open_backend(t));
  RETURN_IF_ERROR(e->resolve_budgets());
  // Before anything sizes the activation table: the MLP's tile (the planner's choice under auto,
  // for the budgets resolved) sets its buffers.
  e->budgets_.mlp_tile_tokens = planned_mlp_tile(mc, e->budgets_, backend);
  e->net_->set_mlp_tile_tokens(e->budgets_.mlp_tile_tokens);
  Status placed = e->plan_placement(t);
  if (t.mlp_tile_tokens == TrainConfig::kMlpTileAuto && placed.code() == StatusCode::kOutOfMemory) {
    // The planner chose the tile from its estimate of the activation table; the exact table
    // (plan_placement) may be larger: smaller tiles then, while one fits.
    for (const int64_t tile : mlp_tile_candidates(t.rank_tokens())) {
      if (e->budgets_.mlp_tile_tokens != 0 && tile >= e->budgets_.mlp_tile_tokens) continue;
      e->budgets_.mlp_tile_tokens = tile;
      e->net_->set_mlp_tile_tokens(tile);
      if (Status st = e->plan_placement(t); st.ok() || st.code() != StatusCode::kOutOfMemory) {
        placed = st;
        break;
      }
    }
  }
  RETURN_IF_ERROR(placed);
  if (t.mlp_tile_tokens == TrainConfig::kMlpTileAuto && e->budgets_.mlp_tile_tokens > 0)
    LOG_INFO("the MLP runs in tiles of {} tokens (and rows of the routed experts): untiled, the step's "
             "activations do not fit "
             "(memory.mlp_tile_tokens=auto)", e->budgets_.mlp_tile_tokens);
  RETURN_IF_ERROR(e->open_nvme(t));
  RETURN_IF_ERROR(e->size_activations(t));
  e->process_bytes_ = process_baseline_bytes(backend);
  RETURN_IF_ERROR(e->create_state(t, oc));
  return e;
}

// The device, the state kernels and the model on the backend. The state lives in the chunk
// space only: the model holds none. On CUDA the model, its kernels' scratch, its
// activations and the chunks share the device's arena, so budgets_.memory_device becomes what
// the kernels' scratch leaves of it: from here on it is the one device budget of the state and
// the activations.
Status PagedEngine::open_backend(const TrainConfig& t) {
  if (backend_ == DeviceKind::kCpu) {
    // memory.device caps the cpu device's arena (0: unlimited), which serves the chunks and
    // the model's activations alike.
    ASSIGN_OR_RETURN(device_, open_device("cpu", 0, t.memory_device));
    const DType compute = StateLayout::of(budgets_.precision, t.moments).compute_dtype();
    net_ = model::make_cpu_decoder(compute, mc_, device_.get());
    return Status::OK();
  }
  // The bf16 recipe unless fp8 is asked for by name (train.precision=auto is bf16 on CUDA).
  budgets_.precision = planned_precision(t, DeviceKind::kCuda);
#if STRATA_HAVE_CUDA
  const DType compute = StateLayout::of(budgets_.precision, t.moments).compute_dtype();
  RETURN_IF_ERROR(model::cuda_supports(mc_, compute));
  ASSIGN_OR_RETURN(device_, open_device("cuda", t.cuda_device, t.memory_device));
  ASSIGN_OR_RETURN(state_kernels_, make_cuda_state_kernels(*device_));
  ASSIGN_OR_RETURN(net_, model::make_cuda_decoder(*device_, mc_, compute));
  const uint64_t budget = device_->memory_budget();
  const uint64_t taken = device_->memory_in_use();  // the kernels' scratch and workspaces
  // Whether the rest holds the activations and enough chunks is the planner's to say, in its
  // own words; here only a budget the scratch alone fills.
  if (budget <= taken)
    return Status::OutOfMemory(fmt::format("memory.device {} leaves no room for the model's state after the "
                                           "kernels' {} of scratch; raise memory.device",
                                           format_bytes(budget), format_bytes(taken)));
  budgets_.memory_device = budget - taken;
  return Status::OK();
#else
  return Status::Unimplemented("this strata was built without the CUDA backend (configure with -DSTRATA_CUDA=ON)");
#endif
}

// The budgets left 0 (host: 80% of what is available; device: room for all the state) and the
// chunk size, which every tensor's largest block must fit. The planner plans in the chunks the
// store will use, so that their padding is counted.
Status PagedEngine::resolve_budgets() {
  const StateLayout layout = StateLayout::of(budgets_.precision, budgets_.moments);
  const model::ParamLayout& params = net_->layout();
  if (budgets_.memory_host == 0) budgets_.memory_host = default_host_budget();
  const uint64_t all_state = static_cast<uint64_t>(params.total_size()) * layout.bytes_per_parameter();
  if (budgets_.memory_device == 0) budgets_.memory_device = 2 * all_state + (256ull << 20);  // unlimited: room for all
  if (budgets_.chunk_size == 0) budgets_.chunk_size = PagedState::auto_chunk_bytes(params, layout);
  for (const model::TensorSpec& spec : params.tensors()) {
    const uint64_t bytes = PagedState::largest_block_bytes(params, spec, layout);  // its largest block's
    if (bytes > budgets_.chunk_size)
      return Status::InvalidArgument(fmt::format(
          "memory.chunk_size {} cannot hold tensor '{}'{} ({}); raise memory.chunk_size to at least {}, or leave it auto",
          format_bytes(budgets_.chunk_size), spec.name,
          spec.num_blocks() > 1 ? fmt::format(" in blocks of {} rows", spec.block_rows) : "", format_bytes(bytes),
          format_bytes((bytes + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment)));
  }
  return Status::OK();
}

// Where the state lives: the planner places each kind on the tiers, and the chunk space holds
// it there. The planner estimates activations from shapes; the table's exact size is known
// here. When it is larger (MoE expert buffers, the backend's own), plan again with the
// difference taken off the device, so that the groups the plan keeps there fit beside the real
// table. OutOfMemory with the planner's suggestions when the state does not fit.
Status PagedEngine::plan_placement(const TrainConfig& t) {
  PlanInput in = make_plan_input(mc_, budgets_, backend_);
  plan_ = make_plan(in);
  const int64_t tokens = t.rank_tokens();
  // memory.keep_activations=true is planned: the kept layers' bytes are in the plan's device.
  const bool planned_keep = in.kept_activation_bytes > 0;
  if (plan_.fits) {
    // The plan counts ZeRO-2's gradient workspace with the activations: so does the comparison.
    const uint64_t exact =
        static_cast<uint64_t>(net_->activation_bytes_for(tokens, plan_.offload_activations, planned_keep, t.parallel_expert,
                                                         t.ring_ranks())) +
        kArenaSlack + workspace_bytes();
    if (exact > plan_.device.act && in.device_budget > exact - plan_.device.act) {
      const uint64_t more = exact - plan_.device.act;
      in.device_budget -= more;
      plan_ = make_plan(in);
      // The plan on the whole budget again, its activations the table the engine reserves: the
      // chunks keep the device tier the planner gave them (Plan::device_chunk_bytes).
      in.device_budget += more;
      plan_.device.act += more;
    }
  }
  plan_input_ = in;
  if (!plan_.fits) {
    std::string fix;
    for (const auto& sgn : plan_.suggestions) fix += (fix.empty() ? "" : "; ") + sgn;
    // When a shorter sequence would fit, say how long: activations are what grows with it.
    // (With memory.mlp_tile_tokens as the user gave it: auto chooses a tile per length.)
    TrainConfig shorter = budgets_;
    shorter.mlp_tile_tokens = t.mlp_tile_tokens;
    if (const int64_t longest = longest_sequence(mc_, shorter, backend_); longest > 0 && longest < t.seq_len)
      fix += fmt::format("; or lower train.seq_len to at most {} (the longest that fits these budgets at "
                         "train.micro_batch={})",
                         longest, t.micro_batch);
    return Status::OutOfMemory("the state does not fit: " + plan_.problem + "; " + fix +
                               " (strata plan shows the whole placement)");
  }
  return Status::OK();
}

// memory.nvme.path, created, and the I/O engine that pages through it.
Status PagedEngine::open_nvme(const TrainConfig& t) {
  if (!t.nvme_path.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(t.nvme_path, ec);
    if (ec) return Status::IOError("cannot create memory.nvme.path '" + t.nvme_path + "': " + ec.message());
    ASSIGN_OR_RETURN(io_, make_io_engine(IoEngineOptions{}));
  }
  nvme_path_ = t.nvme_path;
  return Status::OK();
}

// The model's activation table and what it leaves of the device budget to the chunks. Kept
// layer activations cost their bytes beside the planned activations; memory.keep_activations=auto
// keeps them on cuda when the device has that room left after the plan.
Status PagedEngine::size_activations(const TrainConfig& t) {
  const int64_t tokens = t.rank_tokens();
  const bool offload = plan_.offload_activations;
  auto table_bytes = [&](bool keep) {
    return static_cast<uint64_t>(net_->activation_bytes_for(tokens, offload, keep, t.parallel_expert, t.ring_ranks()));
  };
  const uint64_t device = budgets_.memory_device;
  const bool planned_keep = plan_input_.kept_activation_bytes > 0;
  const uint64_t keep_extra = planned_keep ? 0 : table_bytes(true) - table_bytes(false);
  // The plan's device bytes, the activation table's exact size among them (plan_placement).
  const uint64_t planned_device = plan_.device.total();
  const uint64_t device_room = device > planned_device ? device - planned_device : 0;
  keep_activations_ = t.keep_activations == "true" ||
                      (t.keep_activations == "auto" && backend_ == DeviceKind::kCuda && keep_extra <= device_room);
  if (t.keep_activations == "true" && keep_extra > device_room)
    return Status::OutOfMemory(fmt::format("memory.keep_activations=true needs {} more device memory than the plan "
                                           "leaves ({}); set it to auto or false, or raise memory.device",
                                           format_bytes(keep_extra), format_bytes(device_room)));
  net_->set_keep_layer_activations(keep_activations_);
  // The chunks get the device tier the plan replayed its traffic on, which plan_placement made
  // fit beside the activation table (its exact size, and a little for the arena's alignment);
  // less when kept layers take more.
  activation_bytes_ = table_bytes(keep_activations_) + kArenaSlack;
  activation_bytes_ += workspace_bytes();
  options_.device_bytes = std::min(device > activation_bytes_ ? device - activation_bytes_ : 0, plan_.device_chunk_bytes);
  const uint64_t arena = device_->memory_budget();
  device_split_ = fmt::format(
      "{} of device memory: {} chunks, {} activations{}",
      arena == Device::kUnlimited ? std::string("unlimited") : format_bytes(arena), format_bytes(options_.device_bytes),
      format_bytes(activation_bytes_),
      backend_ == DeviceKind::kCuda ? ", " + format_bytes(device_->memory_in_use()) + " kernel scratch" : "");
  return Status::OK();
}

// The paged state on the tiers of the budgets, homed and shared out by the plan's placement: with
// several ranks each owns a range of every tensor, which it writes into checkpoints and, with the
// optimizer state sharded (ZeRO-1 over element ranges), alone holds and updates the master
// weights and Adam moments of.
Status PagedEngine::create_state(const TrainConfig& t, const OptimizerConfig& oc) {
  PagedStateOptions& po = options_;
  po.host_bytes = budgets_.memory_host;
  po.nvme_bytes = t.nvme_path.empty() ? 0 : t.nvme_size;
  po.nvme_dir = t.nvme_path;
  po.chunk_bytes = budgets_.chunk_size;
  po.grad_accum = t.grad_accum;
  po.offload_activations = plan_.offload_activations;
  po.activation_tokens = t.rank_tokens();
  po.optimizer = oc;
  po.overlap_optimizer = t.overlap_backward;
  po.overlap_reduction = overlaps_collectives(t, budgets_.plan_zero);
  po.expert_ranks = static_cast<int>(t.parallel_expert);
  po.gather_ahead = plan_.gather_ahead;
  po.precision = budgets_.precision;
  po.moments = t.moments;
  po.stochastic_rounding = t.stochastic_rounding;
  po.device_kernels = state_kernels_.get();
  po.rank = t.dp_rank;  // the plan's placement shares the tensors out over the ranks
  po.placement = plan_.placement;
  ASSIGN_OR_RETURN(state_, PagedState::create(*device_, io_.get(), net_->layout(), po));
  // Paging is stream-ordered: set_access hands the state the model's compute stream.
  net_->set_access(state_.get());
  return Status::OK();
}

PagedEngine::~PagedEngine() = default;

uint64_t PagedEngine::workspace_bytes() const {
  uint64_t bytes = 0;
  const bool overlapped = overlaps_collectives(budgets_, budgets_.plan_zero);
  if (budgets_.plan_zero >= 2) bytes += PagedState::gradient_working_bytes(net_->layout(), overlapped);
  if (budgets_.plan_zero >= 3)
    bytes += PagedState::param_working_bytes(net_->layout(), StateLayout::of(budgets_.precision, budgets_.moments),
                                             overlapped ? std::max(plan_.gather_ahead, 1) : 0);
  return bytes;
}

std::string PagedEngine::recipe() const {
  std::string out = precision_name(options_.precision);
  if (options_.moments != kernels::MomentFormat::kF32)
    out += fmt::format(", {} moments{}", kernels::moment_format_name(options_.moments),
                       options_.stochastic_rounding ? " (stochastic)" : "");
  return out;
}

std::string PagedEngine::memory_summary() const {
  return fmt::format("precision {}; activations {}; {}; chunks of {}; host {}, nvme {}; homes: {}",
                     recipe(), keep_activations_ ? "kept per layer" : "recomputed",
                     device_split_, format_bytes(state_->store().chunk_bytes()), format_bytes(options_.host_bytes),
                     options_.nvme_bytes ? format_bytes(options_.nvme_bytes) + " in " + nvme_path_ : std::string("none"),
                     state_->placement_summary());
}

Status PagedEngine::zero_grads() {
  net_->reset_expert_token_counts();  // the gradients themselves live in the chunk space
  reached_by_layer_.assign(static_cast<size_t>(mc_.num_moe_layers()), 0);
  reach_batches_ = 0;
  mtp_nll_ = 0;
  mtp_targets_ = 0;
  micro_in_step_ = 0;
  return state_->zero_grads();
}

Result<double> PagedEngine::micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                        float grad_scale, bool last, float lr, const int32_t* positions) {
  // (Before begin_last_micro_batch, which counts the step early when AdamW overlaps backward.)
  if (mc_.lora.dropout > 0) {
    uint64_t z = dropout_seed_ ^ (static_cast<uint64_t>(state_->step_count()) << 20 ^ static_cast<uint64_t>(micro_in_step_));
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    net_->set_dropout_seed(z ^ (z >> 29));
  }
  ++micro_in_step_;
  if (last) state_->begin_last_micro_batch(lr);
  if (mc_.is_moe()) counts_before_ = net_->expert_token_counts();
  Result<double> loss = net_->compute(inputs, targets, B, T, grad_scale, /*backward=*/true, positions);
  train_aux_loss_ = net_->last_aux_loss();  // an evaluation's forward does not replace it
  if (loss.ok()) {
    mtp_nll_ += net_->last_mtp_loss().first;
    mtp_targets_ += net_->last_mtp_loss().second;
  }
  if (mc_.is_moe() && loss.ok()) {
    const std::vector<int64_t>& counts = net_->expert_token_counts();
    const int64_t E = mc_.num_experts;
    reached_by_layer_.resize(static_cast<size_t>(mc_.num_moe_layers()), 0);
    for (int64_t l = 0, m = 0; l < mc_.num_hidden_layers; ++l) {
      if (!mc_.is_moe_layer(l)) continue;
      for (int64_t e = 0; e < E; ++e) {
        const size_t i = static_cast<size_t>(l * E + e);
        reached_by_layer_[static_cast<size_t>(m)] += counts[i] > counts_before_[i] ? 1 : 0;
      }
      ++m;
    }
    ++reach_batches_;
  }
  return loss;
}

std::vector<double> PagedEngine::experts_reached_by_layer() const {
  std::vector<double> share;
  if (reach_batches_ == 0) return share;
  const double runs = static_cast<double>(reach_batches_ * mc_.num_experts);
  for (int64_t n : reached_by_layer_) share.push_back(static_cast<double>(n) / runs);
  return share;
}

double PagedEngine::experts_reached() const {
  const std::vector<double> share = experts_reached_by_layer();
  if (share.empty()) return -1.0;
  double sum = 0;
  for (double s : share) sum += s;
  return sum / static_cast<double>(share.size());
}

Result<double> PagedEngine::eval_micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                             const int32_t* positions) {
  return net_->compute(inputs, targets, B, T, /*grad_scale=*/0.0f, /*backward=*/false, positions);
}

void PagedEngine::run_gathers_ahead(int ahead) {
  CHECK(ahead >= 1 && ahead <= gather_ahead());
  state_->run_gathers_ahead(ahead);
}

// Whether a layer is recomputed decides whether its exchanges (expert groups' tokens, the context
// ring's keys) run again in backward: every rank must decide alike. memory.keep_activations=auto
// decides by each rank's own room (its experts differ), so the ranks keep only when all can.
Status PagedEngine::agree_keep_activations(parallel::Comm& comm) {
  if (comm.world_size() <= 1) return Status::OK();
  ASSIGN_OR_RETURN(const double keeping, parallel::sum_over_ranks(comm, keep_activations_ ? 1.0 : 0.0));
  if (keep_activations_ && keeping < comm.world_size()) {
    keep_activations_ = false;
    net_->set_keep_layer_activations(false);
  }
  return Status::OK();
}

Status PagedEngine::set_context_comm(parallel::Comm* context) {
  const int64_t N = context != nullptr ? context->world_size() : 1;
  if (N != std::max<int64_t>(budgets_.parallel_context, 1))
    return Status::InvalidArgument(fmt::format("the engine was planned for context groups of {} ranks "
                                               "(parallel.context_parallel), and this rank's group has {}",
                                               budgets_.parallel_context, N));
  if (context != nullptr) RETURN_IF_ERROR(agree_keep_activations(*context));
  net_->set_context_comm(N > 1 ? context : nullptr);
  return Status::OK();
}

Status PagedEngine::set_comm(parallel::Comm* comm, parallel::Comm* handover, parallel::Comm* experts,
                             parallel::Comm* expert_holders, parallel::Comm* expert_handover) {
  const int P = experts != nullptr ? experts->world_size() : 1;
  if (P != std::max(options_.expert_ranks, 1))
    return Status::InvalidArgument(fmt::format("the training state was made for expert groups of {} ranks, and "
                                               "this rank's group has {}", options_.expert_ranks, P));
  // The ranks the state's ranges were shared out over must be the ranks that sum and gather them.
  const int world = std::max(plan_.placement.world(), 1), comm_world = comm != nullptr ? comm->world_size() : 1;
  if (world != comm_world)
    return Status::InvalidArgument(fmt::format("the training state is shared out over {} ranks but the "
                                               "communicator has {}", world, comm_world));
  if (comm != nullptr && comm->world_size() > 1 && options_.overlap_optimizer)
    return Status::InvalidArgument(fmt::format(
        "optim.overlap_backward updates each layer before its gradients are summed over the {} ranks; set "
        "optim.overlap_backward=false to train with several processes",
        comm->world_size()));
  if (comm != nullptr && comm->world_size() > 1 && options_.overlap_reduction && handover == nullptr)
    return Status::InvalidArgument("parallel.overlap_comm sums the gradients through a communicator of its own; "
                                   "none was given");
  if (P > 1 && comm != nullptr) RETURN_IF_ERROR(agree_keep_activations(*comm));
  state_->set_comm(comm, handover, P > 1 ? expert_holders : nullptr, P > 1 ? expert_handover : nullptr);
  net_->set_expert_comm(P > 1 ? experts : nullptr);
  comm_ = comm;
  if (state_->overlaps_collectives())
    LOG_INFO("parallel: ZeRO-{}'s {}gradient sums run on a communication stream beside compute (parallel.overlap_comm)",
             budgets_.plan_zero, budgets_.plan_zero >= 3 ? "weight gathers and " : "");
  return Status::OK();
}

Result<double> PagedEngine::step(float lr) {
  ASSIGN_OR_RETURN(double norm, state_->clip_and_step(lr));
  if (!std::isfinite(norm)) return norm;  // a skipped step changes nothing
  if (comm_ != nullptr && comm_->world_size() > 1 && mc_.is_moe()) {
    // The loss-free balancing bias moves by the load of the whole global batch.
    RETURN_IF_ERROR(parallel::sum_over_ranks(*comm_, std::span<int64_t>(net_->mutable_expert_token_counts())));
  }
  net_->update_expert_bias();  // loss-free MoE balancing; a no-op unless configured
  return norm;
}

EngineStats PagedEngine::stats() const {
  const ChunkSpaceStats s = state_->stats();
  EngineStats out;
  for (int i = 0; i < kNumTiers; ++i) out.tier_bytes[i] = s.tiers[i].in_use_bytes;
  out.stall_ns = s.stall_ns();
  out.moved_bytes = s.moved_bytes();
  out.state_bytes = state_->store().state_chunks() * state_->store().chunk_bytes();
  return out;
}

HostRamPlan PagedEngine::host_ram(const HostRamData& data) const {
  return plan_host_ram(mc_, budgets_, plan_, backend_, data, process_bytes_);
}

// The MoE routers' loss-free balancing bias, one tensor per MoE layer, when that balancing is on.
std::string selection_bias_state_name(int64_t layer) {
  return fmt::format("model.layers.{}.mlp.gate.selection_bias", layer);
}

std::vector<ExtraState> PagedEngine::extra_state() const {
  std::vector<ExtraState> out;
  if (!mc_.has_selection_bias()) return out;
  const std::vector<float>& bias = net_->expert_selection_bias();
  const int64_t E = mc_.num_experts;
  for (int64_t l = 0; l < mc_.num_blocks(); ++l) {
    if (!mc_.is_moe_layer(l)) continue;
    out.push_back({selection_bias_state_name(l),
                   std::vector<float>(bias.begin() + l * E, bias.begin() + (l + 1) * E)});
  }
  return out;
}

const std::vector<float>& PagedEngine::selection_bias() const { return net_->expert_selection_bias(); }

void PagedEngine::set_selection_bias(const std::vector<float>& bias) {
  CHECK(bias.size() == net_->expert_selection_bias().size());
  net_->mutable_expert_selection_bias() = bias;
}

void PagedEngine::set_extra_state(const std::vector<ExtraState>& extra) {
  if (extra.empty()) return;
  std::vector<float>& bias = net_->mutable_expert_selection_bias();
  const int64_t E = mc_.num_experts;
  size_t i = 0;
  for (int64_t l = 0; l < mc_.num_blocks(); ++l) {
    if (!mc_.is_moe_layer(l)) continue;
    std::copy(extra[i].values.begin(), extra[i].values.end(), bias.begin() + l * E);
    ++i;
  }
}

// "moe: aux loss 2.0113 | expert load max/mean 1.42 (layer 3) | experts reached 87.5%": the
// auxiliary loss of the last micro-batch, the most loaded expert of the step relative to an even
// split, and experts_reached().
std::string PagedEngine::step_note() const {
  // The MTP module's mean NLL over its targets of this rank's micro-batches.
  const std::string mtp = mc_.trains_mtp() && mtp_targets_ > 0
                              ? fmt::format("mtp: loss {:.4f} (weight {})", mtp_nll_ / static_cast<double>(mtp_targets_),
                                            mc_.mtp_loss_weight)
                              : std::string();
  if (!mc_.is_moe()) return mtp;
  const int64_t E = mc_.num_experts;
  const std::vector<int64_t>& counts = net_->expert_token_counts();
  double worst = 0;
  int64_t worst_layer = -1;
  for (int64_t l = 0; l < mc_.num_blocks(); ++l) {
    if (!mc_.is_moe_layer(l)) continue;
    int64_t total = 0, most = 0;
    for (int64_t e = 0; e < E; ++e) {
      total += counts[static_cast<size_t>(l * E + e)];
      most = std::max(most, counts[static_cast<size_t>(l * E + e)]);
    }
    const double ratio = total > 0 ? static_cast<double>(most) * static_cast<double>(E) / static_cast<double>(total) : 0.0;
    if (ratio > worst) {
      worst = ratio;
      worst_layer = l;
    }
  }
  // DeepSeek's routers train without an auxiliary loss (the selection bias balances them).
  const std::string aux = mc_.output_router_logits || mc_.router_aux_loss_coef > 0
                              ? fmt::format("aux loss {:.4f} | ", train_aux_loss_)
                              : std::string();
  return fmt::format("moe: {}expert load max/mean {:.2f} (layer {}) | experts reached {:.1f}%{}", aux, worst,
                     worst_layer, 100 * std::max(experts_reached(), 0.0), mtp.empty() ? "" : " | " + mtp);
}

}  // namespace strata
