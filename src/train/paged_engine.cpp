#include "train/paged_engine.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "core/units.h"
#include "memory/chunk.h"
#include "train/planning.h"

#if STRATA_HAVE_CUDA
#include "model/cuda/decoder_cuda.h"
#endif

namespace strata {

Result<std::unique_ptr<PagedEngine>> PagedEngine::create(const model::ModelConfig& mc, const TrainConfig& t,
                                                         const OptimizerConfig& oc, bool cuda) {
  std::unique_ptr<PagedEngine> e(new PagedEngine());
  e->mc_ = mc;
  TrainConfig budgets = t;
  // The state lives in the chunk space only: the model keeps no flat copy. On CUDA the model,
  // its kernels' scratch, its activations and the chunks share the device's arena.
  if (cuda) {
    // The bf16 recipe unless fp8 is asked for by name (train.precision=auto is bf16 on CUDA).
    budgets.precision = planned_precision(t, /*cuda=*/true);
#if STRATA_HAVE_CUDA
    const DType compute = StateLayout::of(budgets.precision, t.moments).compute_dtype();
    RETURN_IF_ERROR(model::cuda_supports(mc, compute));
    ASSIGN_OR_RETURN(e->device_, open_device("cuda", t.cuda_device, t.memory_device));
    ASSIGN_OR_RETURN(e->state_kernels_, make_cuda_state_kernels(*e->device_));
    ASSIGN_OR_RETURN(e->net_, model::make_cuda_decoder(*e->device_, mc, compute));
    const uint64_t budget = e->device_->memory_budget();
    const uint64_t taken = e->device_->memory_in_use();  // the kernels' scratch and workspaces
    if (budget <= taken + (64ull << 20))
      return Status::OutOfMemory(fmt::format("memory.device {} leaves no room for the model's state after the "
                                             "kernels' {} of scratch; raise memory.device",
                                             format_bytes(budget), format_bytes(taken)));
    budgets.memory_device = budget - taken;
#else
    return Status::Unimplemented("this strata was built without the CUDA backend (configure with -DSTRATA_CUDA=ON)");
#endif
  } else {
    // memory.device caps the cpu device's arena (0: unlimited), which serves the chunks and
    // the model's activations alike.
    ASSIGN_OR_RETURN(e->device_, open_device("cpu", 0, t.memory_device));
  }
  const StateLayout layout = StateLayout::of(budgets.precision, t.moments);
  if (!cuda) e->net_ = model::make_cpu_decoder(layout.compute_dtype(), mc, /*flat_buffers=*/false, e->device_.get());

  // Where the state lives: the planner places each kind on the tiers, and the chunk space
  // holds it there. The model's activation workspace is budgeted apart from the chunks.
  if (budgets.memory_host == 0) budgets.memory_host = default_host_budget();
  const uint64_t all_state = static_cast<uint64_t>(e->net_->layout().total_size()) * layout.bytes_per_parameter();
  if (budgets.memory_device == 0) budgets.memory_device = 2 * all_state + (256ull << 20);  // unlimited: room for all
  // Planned in the chunks the store will use, so that their padding is counted.
  if (budgets.chunk_size == 0) budgets.chunk_size = PagedState::auto_chunk_bytes(e->net_->layout(), layout);
  for (const model::TensorSpec& spec : e->net_->layout().tensors()) {
    const uint64_t bytes = static_cast<uint64_t>(spec.block_numel(0)) * sizeof(float);  // its largest block
    if (bytes > budgets.chunk_size)
      return Status::InvalidArgument(fmt::format(
          "memory.chunk_size {} cannot hold tensor '{}'{} ({}); raise memory.chunk_size to at least {}, or leave it auto",
          format_bytes(budgets.chunk_size), spec.name,
          spec.num_blocks() > 1 ? fmt::format(" in blocks of {} rows", spec.block_rows) : "", format_bytes(bytes),
          format_bytes((bytes + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment)));
  }
  PlanInput in = make_plan_input(mc, budgets, cuda);
  e->plan_ = make_plan(in);
  // The planner estimates activations from shapes; the table's exact size is known here. When
  // it is larger (MoE expert buffers, the backend's own), plan again with the difference taken
  // off the device, so that the groups the plan keeps there fit beside the real table.
  const int64_t tokens = t.micro_batch * t.seq_len;
  // memory.keep_activations=true is planned: the kept layers' bytes are in the plan's device.
  const bool planned_keep = in.kept_activation_bytes > 0;
  if (e->plan_.fits) {
    const uint64_t exact =
        static_cast<uint64_t>(e->net_->activation_bytes_for(tokens, e->plan_.offload_activations, planned_keep));
    if (exact > e->plan_.device.act && in.device_budget > exact - e->plan_.device.act) {
      in.device_budget -= exact - e->plan_.device.act;
      e->plan_ = make_plan(in);
    }
  }
  e->plan_input_ = in;
  const Plan& plan = e->plan_;
  if (!plan.fits) {
    std::string fix;
    for (const auto& sgn : plan.suggestions) fix += (fix.empty() ? "" : "; ") + sgn;
    return Status::OutOfMemory("the state does not fit: " + plan.problem + "; " + fix +
                               " (strata plan shows the whole placement)");
  }
  if (!t.nvme_path.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(t.nvme_path, ec);
    if (ec) return Status::IOError("cannot create memory.nvme.path '" + t.nvme_path + "': " + ec.message());
    ASSIGN_OR_RETURN(e->io_, make_io_engine(IoEngineOptions{}));
  }
  e->nvme_path_ = t.nvme_path;
  // Kept layer activations cost their bytes beside the planned activations; auto keeps them on
  // cuda when the device has that room left after the plan.
  const uint64_t keep_extra =
      planned_keep ? 0
                   : static_cast<uint64_t>(e->net_->activation_bytes_for(tokens, plan.offload_activations, true) -
                                           e->net_->activation_bytes_for(tokens, plan.offload_activations, false));
  const uint64_t planned_device = plan.device.total() + (budgets.memory_device - in.device_budget);
  const uint64_t device_room = budgets.memory_device > planned_device ? budgets.memory_device - planned_device : 0;
  e->keep_activations_ = t.keep_activations == "true" || (t.keep_activations == "auto" && cuda && keep_extra <= device_room);
  if (t.keep_activations == "true" && keep_extra > device_room)
    return Status::OutOfMemory(fmt::format("memory.keep_activations=true needs {} more device memory than the plan "
                                           "leaves ({}); set it to auto or false, or raise memory.device",
                                           format_bytes(keep_extra), format_bytes(device_room)));
  e->net_->set_keep_layer_activations(e->keep_activations_);
  PagedStateOptions& po = e->options_;
  // The chunks get what the activation table (its exact size, and a little for the arena's
  // alignment) leaves of the device's arena.
  const uint64_t activations =
      static_cast<uint64_t>(e->net_->activation_bytes_for(tokens, plan.offload_activations, e->keep_activations_)) +
      (64ull << 10);
  e->activation_bytes_ = activations;
  po.device_bytes = budgets.memory_device > activations ? budgets.memory_device - activations : 0;
  e->device_split_ = fmt::format("{} of device memory: {} chunks, {} activations{}",
                                 e->device_->memory_budget() == Device::kUnlimited
                                     ? std::string("unlimited")
                                     : format_bytes(e->device_->memory_budget()),
                                 format_bytes(po.device_bytes), format_bytes(activations),
                                 cuda ? ", " + format_bytes(e->device_->memory_in_use()) + " kernel scratch" : "");
  po.host_bytes = budgets.memory_host;
  po.nvme_bytes = t.nvme_path.empty() ? 0 : t.nvme_size;
  po.nvme_dir = t.nvme_path;
  po.chunk_bytes = budgets.chunk_size;
  po.grad_accum = t.grad_accum;
  po.offload_activations = plan.offload_activations;
  po.activation_tokens = t.micro_batch * t.seq_len;
  po.optimizer = oc;
  po.overlap_optimizer = t.overlap_backward;
  po.precision = budgets.precision;
  po.moments = t.moments;
  po.stochastic_rounding = t.stochastic_rounding;
  po.device_kernels = e->state_kernels_.get();
  if (t.dp_world > 1) {
    // Each group gets an owner among the ranks, which writes it into checkpoints and, with the
    // optimizer state sharded (ZeRO-1 over parameter groups), alone holds and updates its master
    // weights and Adam moments.
    e->plan_.placement.assign_owners(PagedState::group_elements(e->net_->layout()), t.dp_world,
                                     /*shard_optimizer=*/t.plan_zero != 0);
    po.rank = t.dp_rank;
  }
  po.placement = plan.placement;
  e->budgets_ = budgets;
  e->cuda_ = cuda;
  ASSIGN_OR_RETURN(e->state_, PagedState::create(*e->device_, e->io_.get(), e->net_->layout(), po));
  // Paging is stream-ordered: set_access hands the state the model's compute stream.
  e->net_->set_access(e->state_.get());
  return e;
}

PagedEngine::~PagedEngine() = default;

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
  net_->zero_grads();  // router statistics; the gradients themselves live in the chunk space
  return state_->zero_grads();
}

Result<double> PagedEngine::micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                        float grad_scale, bool last, float lr) {
  if (last) state_->begin_last_micro_batch(lr);
  return net_->compute(inputs, targets, B, T, grad_scale, /*backward=*/true);
}

Status PagedEngine::set_comm(parallel::Comm* comm) {
  if (comm != nullptr && comm->world_size() > 1 && options_.overlap_optimizer)
    return Status::InvalidArgument(fmt::format(
        "optim.overlap_backward updates each layer before its gradients are summed over the {} ranks; set "
        "optim.overlap_backward=false to train with several processes",
        comm->world_size()));
  state_->set_comm(comm);
  comm_ = comm;
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
  return out;
}

HostRamPlan PagedEngine::host_ram(const HostRamData& data) const {
  return plan_host_ram(mc_, budgets_, plan_, cuda_, data);
}

// The MoE routers' loss-free balancing bias, one tensor per MoE layer, when that balancing is on.
std::vector<ExtraState> PagedEngine::extra_state() const {
  std::vector<ExtraState> out;
  if (!mc_.is_moe() || !(mc_.router_bias_update_rate > 0)) return out;
  const std::vector<float>& bias = net_->expert_selection_bias();
  const int64_t E = mc_.num_experts;
  for (int64_t l = 0; l < mc_.num_hidden_layers; ++l) {
    if (!mc_.is_moe_layer(l)) continue;
    out.push_back({fmt::format("model.layers.{}.mlp.gate.selection_bias", l),
                   std::vector<float>(bias.begin() + l * E, bias.begin() + (l + 1) * E)});
  }
  return out;
}

void PagedEngine::set_extra_state(const std::vector<ExtraState>& extra) {
  if (extra.empty()) return;
  std::vector<float>& bias = net_->mutable_expert_selection_bias();
  const int64_t E = mc_.num_experts;
  size_t i = 0;
  for (int64_t l = 0; l < mc_.num_hidden_layers; ++l) {
    if (!mc_.is_moe_layer(l)) continue;
    std::copy(extra[i].values.begin(), extra[i].values.end(), bias.begin() + l * E);
    ++i;
  }
}

// "moe: aux loss 2.0113 | expert load max/mean 1.42 (layer 3)": the auxiliary loss of the last
// micro-batch and the most loaded expert of the step relative to an even split.
std::string PagedEngine::step_note() const {
  if (!mc_.is_moe()) return {};
  const int64_t E = mc_.num_experts;
  const std::vector<int64_t>& counts = net_->expert_token_counts();
  double worst = 0;
  int64_t worst_layer = -1;
  for (int64_t l = 0; l < mc_.num_hidden_layers; ++l) {
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
  return fmt::format("moe: aux loss {:.4f} | expert load max/mean {:.2f} (layer {})", net_->last_aux_loss(), worst,
                     worst_layer);
}

}  // namespace strata
