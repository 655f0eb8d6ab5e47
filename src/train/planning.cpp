#include "train/planning.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <string>
#include <cmath>

#include <fmt/format.h>

#include "core/host_memory.h"
#include "kernels/cpu/backend.h"
#include "kernels/fp8_operands.h"
#include "kernels/nf4.h"
#include "kernels/lm_head_chunks.h"
#include "model/activations.h"
#include "model/recording_access.h"
#include "train/paged_state.h"

#if STRATA_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace strata {

double model_flops_per_token(const model::ModelConfig& m, int64_t seq_len) {
  return 6.0 * static_cast<double>(m.num_parameters()) +
         12.0 * static_cast<double>(m.num_hidden_layers * m.hidden_size * seq_len);
}

uint64_t default_host_budget() {
  // 80% of what can be allocated now (MemAvailable, or the cgroup's limit), leaving the rest to
  // the page cache, the data loader and whatever else runs beside; physical RAM when unknown.
  const HostMemory machine = available_host_memory();
  if (machine.known) return machine.available / 10 * 8;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 10 * 8;
}

namespace {

using ExpertChunks = std::vector<std::vector<PlanInput::ExpertChunks>>;

// Per layer, each expert's chunks of the optimizer's kinds as the store packs `tensors` (with
// `sliced`, their slices); a layer with an expert that shares a chunk with another part is left
// empty.
ExpertChunks expert_chunks(const std::vector<StateTensor>& tensors, uint64_t chunk, const StateLayout& state,
                           uint64_t layers, bool sliced) {
  ExpertChunks out(layers);
  std::vector<StateKind> kinds;
  std::vector<std::vector<std::vector<StateStore::PartChunks>>> packed;
  for (StateKind k : state.kinds()) {
    if (k != StateKind::kMaster && k != StateKind::kAdamM && k != StateKind::kAdamV) continue;
    kinds.push_back(k);
    packed.push_back(StateStore::part_chunks(tensors, chunk, state, k, sliced));
  }
  for (size_t l = 0; l < layers && !packed.empty(); ++l) {
    const size_t g = l + 1;  // the store's group of layer l
    if (g >= packed[0].size()) break;
    std::vector<PlanInput::ExpertChunks> experts;
    bool alone = true;
    for (size_t pi = 0; pi < packed[0][g].size(); ++pi) {
      if (packed[0][g][pi].part == kDensePart) continue;
      PlanInput::ExpertChunks e{packed[0][g][pi].part};
      for (size_t ki = 0; ki < kinds.size(); ++ki) {
        const StateStore::PartChunks& c = packed[ki][g][pi];
        alone = alone && c.own && c.chunks > 0;
        (kinds[ki] == StateKind::kMaster ? e.master : kinds[ki] == StateKind::kAdamM ? e.adam_m : e.adam_v) = c.chunks;
      }
      experts.push_back(e);
    }
    if (alone) out[l] = std::move(experts);
  }
  return out;
}

// Expert by expert, the larger of two ranks' shares; a layer either leaves empty ends empty.
void keep_largest(ExpertChunks& into, const ExpertChunks& share) {
  for (size_t l = 0; l < into.size(); ++l) {
    if (into[l].size() != share[l].size()) {
      into[l].clear();
      continue;
    }
    for (size_t e = 0; e < into[l].size(); ++e) {
      into[l][e].master = std::max(into[l][e].master, share[l][e].master);
      into[l][e].adam_m = std::max(into[l][e].adam_m, share[l][e].adam_m);
      into[l][e].adam_v = std::max(into[l][e].adam_v, share[l][e].adam_v);
    }
  }
}

// What the planner needs of every data-parallel rank's share of the sliced kinds: the largest
// share's tensors, each expert's largest chunks and the largest of the chunks each group opens
// (see make_plan_input). It depends on the model, the layout and the chunk size only, while the
// searches for the longest sequence or the largest batch ask for it at every probe, and a world
// of hundreds of ranks takes seconds: the last few answers are kept.
struct SlicedShares {
  std::vector<StateTensor> largest;
  ExpertChunks experts;
  std::array<uint64_t, 3> grad{}, moment{}, param{};  // per layer, the edge, the embedding
};

SlicedShares compute_sliced_shares(const model::ModelConfig& m, const model::ParamLayout& layout,
                                   const StateLayout& state, uint64_t chunk, int W, int P) {
  SlicedShares out;
  const uint64_t L = static_cast<uint64_t>(m.num_blocks());
  uint64_t largest_share = 0;
  for (int r = 0; r < W; ++r) {
    const std::vector<StateTensor> share = PagedState::store_tensors(layout, state, r, W, P);
    uint64_t held = 0;
    for (const StateTensor& t : share)
      for (StateKind k : state.kinds()) held += state.tensor_bytes(k, t.shape(/*sliced=*/true));
    if (held > largest_share) largest_share = held, out.largest = share;
    const ExpertChunks experts = expert_chunks(share, chunk, state, L, /*sliced=*/true);
    if (r == 0) out.experts = experts;
    else keep_largest(out.experts, experts);
    // The groups' slices share chunks (state_store.h, "Slices"): a layer's bytes are the
    // average of the chunks the layers open, the edge's the chunks its two groups open.
    const uint64_t c = chunk;
    auto most = [](uint64_t& into, uint64_t v) { into = std::max(into, v); };
    auto count = [&](StateKind kind, uint64_t& layer, uint64_t& edge, uint64_t& embed) {
      const auto packed = StateStore::part_chunks(share, c, state, kind, /*sliced=*/true);
      std::vector<uint64_t> opened;
      for (const auto& group : packed) {
        uint64_t n = 0;
        for (const StateStore::PartChunks& p : group) n += p.chunks;
        opened.push_back(n);
      }
      uint64_t layers = 0;
      for (size_t g = 1; g + 1 < opened.size(); ++g) layers += opened[g];
      most(layer, (layers * c + L - 1) / std::max<uint64_t>(L, 1));
      most(edge, (opened.front() + opened.back()) * c);
      most(embed, opened.front() * c);
    };
    count(StateKind::kGrad, out.grad[0], out.grad[1], out.grad[2]);
    count(StateKind::kAdamM, out.moment[0], out.moment[1], out.moment[2]);
    count(StateKind::kParam, out.param[0], out.param[1], out.param[2]);
  }
  return out;
}

SlicedShares sliced_shares(const model::ModelConfig& m, const model::ParamLayout& layout, const StateLayout& state,
                           uint64_t chunk, int W, int P) {
  static std::mutex mu;
  static std::map<std::string, SlicedShares> known;
  const std::string key = fmt::format("{}|{}|{}|{}|{}|{}", m.to_json().dump(), static_cast<int>(state.precision),
                                      static_cast<int>(state.moments), chunk, W, P);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = known.find(key); it != known.end()) return it->second;
  }
  SlicedShares shares = compute_sliced_shares(m, layout, state, chunk, W, P);
  std::lock_guard<std::mutex> lock(mu);
  if (known.size() >= 8) known.clear();
  known.emplace(key, shares);
  return shares;
}

}  // namespace

double planned_compute_flops(const model::ModelConfig& m, const TrainConfig& t, DeviceKind device) {
  const auto& table = t.cpu_flops_by_width;
  if (device != DeviceKind::kCpu || table.empty()) return t.gpu_flops;
  const int64_t w = m.hidden_size;
  if (w <= table.front().first) return table.front().second;
  if (w >= table.back().first) return table.back().second;
  size_t hi = 1;
  while (table[hi].first < w) ++hi;
  const auto& [w0, r0] = table[hi - 1];
  const auto& [w1, r1] = table[hi];
  const double f = std::log(static_cast<double>(w) / static_cast<double>(w0)) /
                   std::log(static_cast<double>(w1) / static_cast<double>(w0));
  return std::exp(std::log(r0) + f * std::log(r1 / r0));
}

std::vector<int64_t> mlp_tile_candidates(int64_t tokens) {
  std::vector<int64_t> tiles;
  for (int64_t tile = tokens / 2 / 128 * 128; tile >= 128; tile = tile / 2 / 128 * 128) tiles.push_back(tile);
  return tiles;
}

int64_t planned_mlp_tile(const model::ModelConfig& m, const TrainConfig& train, DeviceKind device) {
  if (train.mlp_tile_tokens != TrainConfig::kMlpTileAuto) return train.mlp_tile_tokens;
  TrainConfig t = train;
  auto fits = [&](int64_t tile) {
    t.mlp_tile_tokens = tile;
    return plan_fits(make_plan_input(m, t, device));
  };
  if (fits(0)) return 0;
  const std::vector<int64_t> tiles = mlp_tile_candidates(t.rank_tokens());
  // Where not even the smallest tile fits, no tile does (a tile's buffers shrink with it): two
  // plans decide it, as the searches for the longest sequence and largest batch mostly ask.
  if (tiles.empty() || !fits(tiles.back())) return 0;
  for (int64_t tile : tiles)
    if (tile == tiles.back() || fits(tile)) return tile;
  return 0;
}

PlanInput make_plan_input(const model::ModelConfig& m, const TrainConfig& train, DeviceKind device) {
  // An auto MLP tile is planned as the planner chooses it.
  TrainConfig t = train;
  t.mlp_tile_tokens = planned_mlp_tile(m, train, device);
  PlanInput in;
  const bool cuda = device == DeviceKind::kCuda;
  const uint64_t C = static_cast<uint64_t>(m.hidden_size);
  // The planner's layers are the layout's blocks: an MTP module's block is planned as one more
  // layer (its group pages like a layer's); the layer checkpoints are the model's layers'.
  const uint64_t V = static_cast<uint64_t>(m.vocab_size), L = static_cast<uint64_t>(m.num_blocks());
  const uint64_t layers = static_cast<uint64_t>(m.num_hidden_layers);
  const model::ParamLayout layout(m);
  // The model's parameters and, with LoRA, its adapters (in the layers' groups).
  const uint64_t total = static_cast<uint64_t>(layout.num_parameters());
  in.num_layers = m.num_blocks();
  in.checkpoint_layers = m.num_hidden_layers;
  in.edge_elements = V * C * (m.tie_word_embeddings ? 1 : 2) + C;
  in.layer_elements = (total - in.edge_elements) / std::max<uint64_t>(L, 1);
  if (m.is_moe()) {
    // The share of a layer's E experts a micro-batch reaches: plan.experts_reached when given
    // (what a run measured), else its expectation with uniform routing when N tokens each pick K
    // of them, 1 - (1 - K/E)^N. Training micro-batches of a balanced router reach every expert; an
    // untrained router, whose tokens crowd onto a few experts, reaches fewer.
    const uint64_t E = static_cast<uint64_t>(m.num_experts), Fe = static_cast<uint64_t>(m.moe_intermediate_size);
    const double tokens = static_cast<double>(t.rank_tokens());
    int64_t moe_blocks = 0;
    for (int64_t l = 0; l < m.num_blocks(); ++l) moe_blocks += m.is_moe_layer(l) ? 1 : 0;
    in.expert_elements = static_cast<uint64_t>(moe_blocks) * E * 3 * Fe * C / std::max<uint64_t>(L, 1);
    in.moe_layers = moe_blocks;
    in.expert_fetch_fraction = 1.0 - std::pow(1.0 - static_cast<double>(m.num_experts_per_tok) / E, tokens);
    const std::vector<double>& given = t.experts_reached;
    if (given.size() == 1 || (!given.empty() && given.size() == static_cast<size_t>(m.num_moe_layers()))) {
      // Per group (layer l is group l + 1), and their mean over the MoE layers.
      // (An MTP module's block is planned as the model's last MoE layer reaches.)
      in.expert_fetch_by_group.assign(static_cast<size_t>(m.num_blocks()) + 2, 0.0);
      double sum = 0;
      for (int64_t l = 0, i = 0; l < m.num_hidden_layers; ++l) {
        if (!m.is_moe_layer(l)) continue;
        const double share = given[given.size() == 1 ? 0 : static_cast<size_t>(i++)];
        in.expert_fetch_by_group[static_cast<size_t>(l) + 1] = share;
        sum += share;
      }
      for (int64_t l = m.num_hidden_layers; l < m.num_blocks(); ++l) {
        if (m.is_moe_layer(l)) in.expert_fetch_by_group[static_cast<size_t>(l) + 1] = given.back();
      }
      in.expert_fetch_fraction = sum / static_cast<double>(std::max<int64_t>(m.num_moe_layers(), 1));
    }
  }
  // The state layout of the recipe (the CUDA backend trains in bf16). Gradients are fp32 in
  // every recipe: they accumulate over micro-batches.
  const StateLayout state = StateLayout::of(planned_precision(t, device), t.moments);
  in.grad_bytes = static_cast<uint32_t>(state.element_bytes(StateKind::kGrad));
  in.separate_master = state.separate_master();
  {
    // The compute copy and the moments as the store sizes them, tensor by tensor (fp8 matrices
    // and int8 moments carry their scales), per element of the layers and of the edge.
    uint64_t layer_param = 0, edge_param = 0, moments = 0;
    for (const model::TensorSpec& s : layout.tensors()) {
      const int g = model::param_group_of(layout, s);
      const bool edge = g == 0 || g == layout.num_layers() + 1;
      for (int64_t b = 0; b < s.num_blocks(); ++b) {
        const StateShape shape{static_cast<uint64_t>(s.block_numel(b)),
                               model::param_is_linear_weight(layout, s) ? s.shape[0] : 0};
        (edge ? edge_param : layer_param) += state.tensor_bytes(StateKind::kParam, shape);
        moments += state.tensor_bytes(StateKind::kAdamM, shape);
      }
    }
    const uint64_t layer_total = in.layer_elements * std::max<uint64_t>(L, 1);
    in.param_bytes = layer_total > 0 ? static_cast<double>(layer_param) / static_cast<double>(layer_total) : 2.0;
    in.edge_param_bytes = in.edge_elements > 0 ? static_cast<double>(edge_param) / static_cast<double>(in.edge_elements) : 2.0;
    in.moment_bytes = total > 0 ? static_cast<double>(moments) / static_cast<double>(total) : 4.0;
  }
  {
    // LoRA: the adapters alone are trained (the frozen tensors hold their compute copy only), and
    // backward computes no weight gradient of the frozen weights.
    uint64_t layer_trained = 0, edge_trained = 0, layer_all = 0, edge_all = 0, expert_adapters = 0;
    for (const model::TensorSpec& s : layout.tensors()) {
      const int g = model::param_group_of(layout, s);
      const bool edge = g == 0 || g == layout.num_layers() + 1;
      (edge ? edge_all : layer_all) += static_cast<uint64_t>(s.numel);
      if (!s.frozen) (edge ? edge_trained : layer_trained) += static_cast<uint64_t>(s.numel);
      if (!s.frozen && s.adapts >= 0 && model::param_expert_of(layout, s) >= 0)
        expert_adapters += static_cast<uint64_t>(s.numel);
    }
    in.expert_adapter_elements = expert_adapters / std::max<uint64_t>(L, 1);
    in.layer_trained_share = layer_all > 0 ? static_cast<double>(layer_trained) / static_cast<double>(layer_all) : 1.0;
    in.edge_trained_share = edge_all > 0 ? static_cast<double>(edge_trained) / static_cast<double>(edge_all) : 1.0;
    if (m.lora.enabled()) in.backward_factor = 1.0, in.experts_trained = false;
  }

  // Activations, in the shapes of model/activations.h, for N tokens per micro-batch.
  const uint64_t act = dtype_size(state.activation_dtype());
  const uint64_t N = static_cast<uint64_t>(t.rank_tokens());
  in.saved_activation_bytes_per_layer = N * C * act;
  // One layer's recompute and backward scratch, the final norm's buffers and the backend's
  // own (MoE expert buffers): the decoder's activation table less its layer checkpoints, as the
  // table sizes itself (the CPU backend's in its recipe; a GPU's activations are bf16 like the
  // CPU bf16 recipe's). Kept layers hold every layer's intermediates but the last's besides.
  // Expert parallelism: the experts' buffers for every rank's rows of the group.
  auto table_bytes = [&](bool keep) {
    const int64_t tokens = static_cast<int64_t>(N);
    return state.activation_dtype() == DType::kF32
               ? model::ActivationTable<kernels::CpuF32Ops>::bytes_for(m, tokens, false, keep, t.parallel_expert,
                                                                     t.mlp_tile_tokens, t.ring_ranks())
               : model::ActivationTable<kernels::CpuBf16Ops>::bytes_for(m, tokens, false, keep, t.parallel_expert,
                                                                      t.mlp_tile_tokens, t.ring_ranks());
  };
  const uint64_t table = static_cast<uint64_t>(table_bytes(false));
  const uint64_t layer_checkpoints = (layers + 1) * in.saved_activation_bytes_per_layer;
  in.layer_workspace_bytes = table > layer_checkpoints ? table - layer_checkpoints : 0;
  // The CUDA fp8 recipe's quantised GEMM operands, allocated with the table (kernels/fp8_operands.h).
  if (cuda && state.compute_dtype() == DType::kF8E4M3)
    in.layer_workspace_bytes +=
        kernels::fp8_operand_bytes(model::micro_batch_shape(m, static_cast<int64_t>(N), t.parallel_expert));
  // The CUDA nf4 base's dequantised weight, allocated with the table (kernels/nf4.h).
  if (cuda && state.compute_dtype() == DType::kNF4)
    in.layer_workspace_bytes +=
        kernels::nf4_dequantized_weight_bytes(model::micro_batch_shape(m, static_cast<int64_t>(N), t.parallel_expert));
  if (t.keep_activations == "true") in.kept_activation_bytes = static_cast<uint64_t>(table_bytes(true)) - table;
  // The LM head's logits chunks: on a GPU the buffer the CUDA backend reserves beside the
  // activation table (kernels/lm_head_chunks.h), on the CPU a host vector of 256 x V floats.
  const uint64_t loss_chunk = std::min<uint64_t>(N, kernels::CpuCommonOps::kLossChunkTokens);
  in.head_workspace_bytes =
      cuda ? kernels::lm_head_device_scratch_bytes(std::max<int64_t>(static_cast<int64_t>(N), 1),
                                                   static_cast<int64_t>(C), static_cast<int64_t>(V))
           : loss_chunk * V * 4;

  in.grad_accum = t.grad_accum;
  in.tokens_per_step = t.rank_tokens() * t.grad_accum;
  // FLOPs as DESIGN §2 counts them (2 per weight and token forward, 4*C*T per token and layer
  // for attention), for the weights a token really multiplies: the experts it is routed to, not
  // all of them, and the LM head but not the embedding lookup.
  double active_layer = static_cast<double>(in.layer_elements);
  if (m.is_moe()) {
    const double routed = static_cast<double>(m.num_experts_per_tok) / static_cast<double>(m.num_experts);
    active_layer -= (1.0 - routed) * static_cast<double>(in.expert_elements);
  }
  const double tokens_mb = static_cast<double>(N);
  // Attention per token: 2 * T * (Hq * D) for the scores, 2 * T * (Hq * Dv) for the weighted
  // values (4 * C * T when Hq * D = C; latent attention's heads are D = 192 and Dv = 128 wide).
  in.layer_forward_flops =
      tokens_mb * (2.0 * active_layer + 2.0 * static_cast<double>((m.q_dim() + m.att_dim()) * t.seq_len));
  // An MTP module runs the LM head once more.
  in.head_forward_flops = tokens_mb * 2.0 * static_cast<double>(V * C) *
                          static_cast<double>(1 + (m.trains_mtp() ? m.num_nextn_predict_layers : 0));
  // Kept activations skip the recompute; auto keeps them only on cuda when they fit, which the
  // engine decides after planning, so auto is planned as recompute (the slower case).
  in.recompute = t.keep_activations != "true";
  // MLP tiles (memory.mlp_tile_tokens) change the compute (model/decoder_impl.h, moe_layer.h):
  // - a dense layer's backward recomputes its tiles' gate and up, and the recompute pass before it
  //   skips the MLP (the last layer, kept and not recomputed, has no such pass to skip);
  // - a shared expert's backward recomputes gate and up too, beside the whole shared expert that
  //   forward and the recompute pass still run (its output is read by backward);
  // - the routed experts (tiled without expert parallelism, not in the fp8 recipe) run again
  //   whole in every layer's backward, tile by tile.
  if (const int64_t tile = t.mlp_tile_tokens; tile > 0) {
    const int64_t tokens = t.rank_tokens(), rows = tokens * m.num_experts_per_tok;
    const double Cd = static_cast<double>(C), Nd = static_cast<double>(tokens);
    const bool tokens_tiled = tile < tokens;
    const bool experts_tiled = m.is_moe() && t.parallel_expert <= 1 && tile < rows &&
                               planned_precision(t, device) != Precision::kFp8;
    double extra = 0;
    for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
      if (m.is_moe_layer(l)) {
        if (tokens_tiled) extra += 4.0 * Nd * Cd * static_cast<double>(m.shared_expert_intermediate_size);
        if (experts_tiled)
          extra += 6.0 * static_cast<double>(rows) * Cd * static_cast<double>(m.moe_intermediate_size);
      } else if (tokens_tiled) {
        const double F = static_cast<double>(m.intermediate_size);
        extra += 4.0 * Nd * Cd * F;
        if (in.recompute && l + 1 < m.num_hidden_layers) extra -= 6.0 * Nd * Cd * F;
      }
    }
    in.tile_recompute_flops = extra;
  }
  in.overlap_optimizer = t.overlap_backward;
  in.overlap_comm = t.parallel_overlap_comm;  // (with expert groups, at ZeRO-2 and 3 only: plan_comm)
  in.copy_gathers_need_device = cuda;
  // (Counted at ZeRO-2 and 3 only.)
  in.gradient_working_bytes = PagedState::gradient_working_bytes(layout, overlaps_collectives(t, 2));
  const bool gathers_overlapped = overlaps_collectives(t, 3);
  in.param_working_bytes = PagedState::param_working_bytes(layout, state, gathers_overlapped ? 1 : 0);
  // Each more group gathered ahead takes room for the largest group.
  if (gathers_overlapped)
    in.param_ahead_bytes = PagedState::param_working_bytes(layout, state, 2) - in.param_working_bytes;
  in.flops_per_step = static_cast<double>(t.grad_accum) * micro_batch_flops(in);

  in.device_budget = t.memory_device;
  // Unset, a rank gets its share of the node's default, as strata train's ranks do.
  const int64_t world = std::max<int64_t>(t.plan_world_size, 1);
  const uint64_t node_ranks = static_cast<uint64_t>(std::clamp<int64_t>(t.plan_ranks_per_node, 1, world));
  in.host_budget = t.memory_host ? t.memory_host : default_host_budget() / node_ranks;
  in.nvme_budget = t.nvme_path.empty() ? 0 : t.nvme_size;
  in.chunk_size = t.chunk_size;  // 0 (auto): sizes are planned without chunk padding
  bool every_tensor_fits = true;
  for (const model::TensorSpec& s : layout.tensors())
    every_tensor_fits = every_tensor_fits && PagedState::largest_block_bytes(layout, s, state) <= t.chunk_size;
  if (t.chunk_size > 0 && every_tensor_fits) {
    // The chunks as the paged state packs them: the layers (on average, as the
    // planner's layer groups are all alike), and the embedding plus the head. (A chunk size
    // that cannot hold a tensor is refused by the state itself, naming the tensor.)
    // With expert groups, a rank's own: the experts it does not hold take no chunk of any kind.
    const int experts_p = check_expert_parallel(m, t.parallel_expert, world, t.plan_zero).ok()
                              ? static_cast<int>(std::max<int64_t>(t.parallel_expert, 1)) : 1;
    auto whole_chunks = [&](StateKind kind) {
      if (experts_p <= 1) return PagedState::group_chunks(layout, t.chunk_size, state, kind);
      const int own_rank = static_cast<int>(std::clamp<int64_t>(t.dp_rank, 0, world - 1));
      return StateStore::group_chunks(
          PagedState::store_tensors(layout, state, own_rank, static_cast<int>(world), experts_p), t.chunk_size, state,
          kind, /*sliced=*/false);
    };
    const std::vector<uint64_t> chunks = whole_chunks(StateKind::kGrad);
    const std::vector<uint64_t> param_chunks = whole_chunks(StateKind::kParam);
    const std::vector<uint64_t> moment_chunks = whole_chunks(StateKind::kAdamM);
    uint64_t layer_total = 0, layer_param_total = 0, layer_moment_total = 0;
    for (size_t g = 1; g + 1 < chunks.size(); ++g)
      layer_total += chunks[g], layer_param_total += param_chunks[g], layer_moment_total += moment_chunks[g];
    in.layer_chunks = (layer_total + L - 1) / std::max<uint64_t>(L, 1);
    in.edge_chunks = chunks.front() + chunks.back();
    in.layer_param_chunks = (layer_param_total + L - 1) / std::max<uint64_t>(L, 1);
    in.edge_param_chunks = param_chunks.front() + param_chunks.back();
    in.layer_moment_chunks = (layer_moment_total + L - 1) / std::max<uint64_t>(L, 1);
    in.edge_moment_chunks = moment_chunks.front() + moment_chunks.back();
    in.embed_chunks = chunks.front();
    in.embed_param_chunks = param_chunks.front();
    in.embed_moment_chunks = moment_chunks.front();
    // Loading the weights passes them through host memory update slice by slice (StateStore's
    // update slices): a chunk of the master at a time, and one of the compute copy beside it
    // where that is separate.
    in.largest_group_load_chunks = state.separate_master() ? 2 : 1;
    // What the traffic replay follows (it needs whole chunks): the store the engine builds and
    // the model's accesses, with the saved activations kept and offloaded (the plan decides).
    // A data-parallel rank's master weights and moments under ZeRO-1 and up: its slices of
    // every tensor, packed as the store packs them. The placement is planned from the largest
    // share of any rank, so that every rank's plan homes each group alike (their collectives
    // on a group's compute copy then move the same kind of memory); the traffic is replayed on
    // this rank's own store. (The largest share holds the largest slice of nearly every tensor,
    // tensor_shard; where another rank's run of groups homed alike would still take a chunk more,
    // its store homes the last of them a tier lower, StateStore::create.)
    const int W = static_cast<int>(world), rank = static_cast<int>(std::clamp<int64_t>(t.dp_rank, 0, world - 1));
    // Expert parallelism: a rank holds its experts only (and shares them out with their holders).
    const int P = check_expert_parallel(m, t.parallel_expert, W, t.plan_zero).ok()
                      ? static_cast<int>(std::max<int64_t>(t.parallel_expert, 1)) : 1;
    const std::vector<StateTensor> tensors = PagedState::store_tensors(layout, state, rank, W, P);
    in.expert_chunks = expert_chunks(tensors, t.chunk_size, state, L, /*sliced=*/false);
    in.optimizer_packs_small =
        state.has(StateKind::kAdamM) &&
        StateStore::Packing(tensors, t.chunk_size, state, StateKind::kAdamM, /*sliced=*/false).packs_small();
    if (W > 1) {
      const SlicedShares shares = sliced_shares(m, layout, state, t.chunk_size, W, P);
      in.sliced_share_tensors = shares.largest;
      in.expert_sliced_chunks = shares.experts;
      in.layer_sliced_bytes = shares.grad[0], in.edge_sliced_bytes = shares.grad[1], in.embed_sliced_bytes = shares.grad[2];
      in.layer_sliced_moment_bytes = shares.moment[0], in.edge_sliced_moment_bytes = shares.moment[1];
      in.embed_sliced_moment_bytes = shares.moment[2];
      in.layer_sliced_param_bytes = shares.param[0], in.edge_sliced_param_bytes = shares.param[1];
      in.embed_sliced_param_bytes = shares.param[2];
    }
    in.micro_batch_program = model::record_micro_batch(m, /*offload_activations=*/false);
    in.micro_batch_program_offloaded = model::record_micro_batch(m, /*offload_activations=*/true);
    in.state_tensors = tensors;
    in.state_layout = state;
    in.offloaded_activations = model::saved_activation_count(static_cast<int>(layers));
  }
  in.offload_activations = t.offload_activations;
  in.rates.compute_flops = planned_compute_flops(m, t, device);
  in.rates.h2d_bytes_per_s = t.h2d_bytes_per_s;
  in.rates.d2h_bytes_per_s = t.d2h_bytes_per_s;
  in.rates.disk_read_bytes_per_s = t.disk_read_bytes_per_s;
  in.rates.disk_write_bytes_per_s = t.disk_write_bytes_per_s;
  in.rates.disk_both_bytes_per_s = t.disk_both_bytes_per_s;
  in.rates.cpu_adam_params_per_s = t.cpu_adam_params_per_s;
  in.rates.both_bytes_per_s = t.both_bytes_per_s;
  in.rates.copy_overlap = t.copy_overlap;
  in.rates.copy_latency_s = t.copy_latency_s;
  in.rates.device_adam_params_per_s = t.device_adam_params_per_s;
  in.rates.device_memory_bytes_per_s = t.device_memory_bytes_per_s;
  in.rates.intra_node_bytes_per_s = t.intra_node_bytes_per_s;
  in.rates.inter_node_bytes_per_s = t.inter_node_bytes_per_s;
  in.world_size = t.plan_world_size;
  in.rank = std::clamp<int64_t>(t.dp_rank, 0, world - 1);
  in.ranks_per_node = t.plan_ranks_per_node;
  in.zero = t.plan_zero;
  if (t.parallel_expert > 1 && check_expert_parallel(m, t.parallel_expert, world, t.plan_zero).ok()) {
    // Each MoE layer sends its N x K rows out and back in forward, again in a recompute (every
    // layer but the last), and its gradients out and back in backward.
    int64_t passes = 0;
    for (int64_t l = 0; l < m.num_hidden_layers; ++l)
      if (m.is_moe_layer(l)) passes += 4 + (in.recompute && l + 1 < m.num_hidden_layers ? 2 : 0);
    in.expert_ranks = t.parallel_expert;
    in.exchanges_settle_comm = cuda;
    in.expert_exchange_bytes = static_cast<uint64_t>(passes) * N * static_cast<uint64_t>(m.num_experts_per_tok) * C * act;
  }
  if (t.parallel_context > 1) {
    // model/ring_attention.h: per layer, the keys and values (N tokens of the rank's share) go on
    // N - 1 times in forward, in a recompute (every layer but the last) and in backward, and
    // their fp32 gradient sums N times in backward.
    const uint64_t R = static_cast<uint64_t>(t.parallel_context);
    const uint64_t kv = N * static_cast<uint64_t>(m.kv_dim());
    const uint64_t passes = 2 * L + (in.recompute && L > 0 ? L - 1 : 0);
    in.context_ranks = t.parallel_context;
    in.ring_exchange_bytes = passes * 2 * (R - 1) * kv * act + L * 2 * R * kv * sizeof(float);
  }
  return in;
}

Status check_experts_reached(const model::ModelConfig& m, const std::vector<double>& shares) {
  if (shares.empty()) return Status::OK();
  if (!m.is_moe())
    return Status::InvalidArgument("plan.experts_reached gives the share of an MoE layer's experts a micro-batch "
                                   "reaches, and this model has no experts: leave it empty");
  if (shares.size() != 1 && shares.size() != static_cast<size_t>(m.num_moe_layers()))
    return Status::InvalidArgument(fmt::format(
        "plan.experts_reached has {} shares; give one for every MoE layer, or one per MoE layer ({} here)",
        shares.size(), m.num_moe_layers()));
  return Status::OK();
}

Status check_context_parallel(const TrainConfig& t, int64_t world, DeviceKind backend) {
  const int64_t N = t.parallel_context;
  if (N <= 1) return Status::OK();
  if (world % N != 0)
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={} must divide the number of ranks, {} (the ranks launched; for strata plan, "
        "parallel.world_size): use a multiple of it, or lower it",
        N, world));
  if (t.seq_len % (2 * N) != 0)
    return Status::InvalidArgument(fmt::format(
        "train.seq_len={} must be a multiple of {} (2 x parallel.context_parallel={}): each rank of a context group "
        "takes two equal chunks of every sequence",
        t.seq_len, 2 * N, N));
  if (t.data_packing == "document")
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={} with data.packing=document: ring attention takes no document masks yet; use "
        "data.packing=concat, or parallel.context_parallel=1",
        N));
  if (t.parallel_expert > 1)
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={} with parallel.expert_parallel={}: the two do not combine yet; set one of them "
        "to 1",
        N, t.parallel_expert));
  if (backend != DeviceKind::kCpu)
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={}: ring attention trains on the CPU backend only (its CUDA blocks are "
        "built but not yet verified on a GPU); run it with run.device=cpu, or set parallel.context_parallel=1",
        N));
  return Status::OK();
}

Status check_latent_attention(const model::ModelConfig& m, const TrainConfig& t, DeviceKind backend) {
  if (!m.is_mla()) return Status::OK();
  if (backend != DeviceKind::kCpu)
    return Status::InvalidArgument(fmt::format(
        "{}'s latent attention (value heads of {} beside {}-wide query and key heads) trains on the CPU backend "
        "only for now: its cuDNN graphs are built but not yet verified on a GPU; run it with run.device=cpu",
        m.architecture, m.v_head_dim, m.head_dim));
  if (t.parallel_context > 1)
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={} with {}'s latent attention: ring attention does not run it yet; set "
        "parallel.context_parallel=1",
        t.parallel_context, m.architecture));
  return Status::OK();
}

Status check_expert_parallel(const model::ModelConfig& m, int64_t P, int64_t world, int zero) {
  if (P <= 1) return Status::OK();
  if (!m.is_moe())
    return Status::InvalidArgument(fmt::format(
        "parallel.expert_parallel={} splits a model's experts over ranks, and this model has none: set it to 1", P));
  if (m.num_experts % P != 0)
    return Status::InvalidArgument(fmt::format(
        "parallel.expert_parallel={} must divide the model's {} experts per layer: choose a divisor of {}", P,
        m.num_experts, m.num_experts));
  if (world % P != 0)
    return Status::InvalidArgument(fmt::format("parallel.expert_parallel={} must divide the number of ranks, {}", P,
                                               world));
  if (zero == 0)
    return Status::InvalidArgument(fmt::format(
        "parallel.expert_parallel={} shares each expert's optimizer state out over the ranks that hold it: "
        "parallel.zero=0 keeps it whole on every rank; use parallel.zero=1, 2 or 3",
        P));
  return Status::OK();
}

bool cuda_device_visible() {
#if STRATA_HAVE_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

Result<uint64_t> free_gpu_budget(const TrainConfig& train) {
#if STRATA_HAVE_CUDA
  return cuda_free_budget(train.cuda_device);
#else
  (void)train;
  return Status::Unimplemented("this strata was built without the CUDA backend");
#endif
}

DeviceKind planned_device(const TrainConfig& train) {
  return train.device == "cuda" || (train.device == "auto" && cuda_device_visible()) ? DeviceKind::kCuda
                                                                                      : DeviceKind::kCpu;
}

Precision planned_precision(const TrainConfig& t, DeviceKind device) {
  if (device != DeviceKind::kCuda) return t.precision;
  // (The fp8 recipe, or the bf16 recipe over an nf4 base, when named; the GPU's bf16 otherwise.)
  if (!t.precision_auto && (t.precision == Precision::kFp8 || t.precision == Precision::kNf4)) return t.precision;
  return Precision::kBf16;
}

int64_t largest_layer_count(const model::ModelConfig& m, TrainConfig t, DeviceKind device) {
  t.chunk_size = 0;
  auto fits = [&](int64_t layers) {
    model::ModelConfig shaped = m;
    shaped.num_hidden_layers = layers;
    std::erase_if(shaped.mlp_only_layers, [&](int64_t l) { return l >= layers; });
    return plan_fits(make_plan_input(shaped, t, device));
  };
  constexpr int64_t kMostLayers = 1024;
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= kMostLayers && fits(hi)) lo = hi, hi *= 2;
  hi = std::min(hi, kMostLayers + 1);
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

uint64_t smallest_host_budget(const model::ModelConfig& m, TrainConfig t, DeviceKind device) {
  const uint64_t unit = t.chunk_size > 0 ? t.chunk_size : (1ull << 20);
  auto fits = [&](uint64_t units) {
    t.memory_host = units * unit;
    return plan_fits(make_plan_input(m, t, device));
  };
  const uint64_t most = (16ull << 40) / unit;
  if (!fits(most)) return 0;
  // Fitting only gets easier with more host memory: the smallest that fits lies in (lo, hi].
  uint64_t lo = 0, hi = 1;
  while (hi < most && !fits(hi)) lo = hi, hi = std::min(most, hi * 2);
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi * unit;
}

int64_t longest_sequence(const model::ModelConfig& m, TrainConfig t, DeviceKind device) {
  // With context parallelism over N ranks a sequence is 2N chunks: lengths in units of 2N.
  const int64_t unit = t.parallel_context > 1 ? 2 * t.parallel_context : 1;
  auto fits = [&](int64_t units) {
    t.seq_len = units * unit;
    return plan_fits(make_plan_input(m, t, device));
  };
  int64_t limit = std::min<int64_t>(int64_t{1} << 24, (int64_t{1} << 28) / std::max<int64_t>(t.micro_batch, 1));
  // A sliding window shorter than the sequence is refused (full causal attention only).
  if (m.sliding_window > 0) limit = std::min(limit, m.sliding_window);
  limit /= unit;
  if (limit < 1 || !fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= limit && fits(hi)) lo = hi, hi *= 2;
  if (hi > limit) {
    if (fits(limit)) return limit * unit;
    hi = limit;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * unit;
}

int64_t largest_micro_batch(const model::ModelConfig& m, TrainConfig t, DeviceKind device) {
  auto fits = [&](int64_t b) {
    t.micro_batch = b;
    return plan_fits(make_plan_input(m, t, device));
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= (1 << 20) && fits(hi)) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace strata
