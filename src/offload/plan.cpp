#include "offload/plan.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "core/units.h"
#include "offload/replay.h"
#include "offload/step_program.h"

namespace strata {

KindBytes& KindBytes::operator+=(const KindBytes& o) {
  param += o.param;
  grad += o.grad;
  master += o.master;
  adam_m += o.adam_m;
  adam_v += o.adam_v;
  act += o.act;
  return *this;
}

namespace {

// bytes padded to whole chunks; unpadded when chunk is 0.
uint64_t padded_to_chunks(uint64_t bytes, uint64_t chunk) {
  return chunk == 0 ? bytes : round_up(bytes, chunk);
}

// Per-group sizes, rounded up to whole chunks because chunks are what the tiers hold.
struct GroupBytes {
  uint64_t param, grad, master, adam_m, adam_v;
  uint64_t optimizer() const { return master + adam_m + adam_v; }
};

// Bytes of `elements` at a (fractional) size per element, rounded up.
uint64_t bytes_of(uint64_t elements, double per_element) {
  return static_cast<uint64_t>(std::ceil(static_cast<double>(elements) * per_element));
}

// The trained elements of a layer group or of the edge (PlanInput::layer_trained_share).
uint64_t trained_elements(const PlanInput& in, bool edge) {
  return edge ? bytes_of(in.edge_elements, in.edge_trained_share) : bytes_of(in.layer_elements, in.layer_trained_share);
}

GroupBytes group_bytes(const PlanInput& in, uint64_t elements, double param_bytes, uint64_t packed_chunks,
                       uint64_t packed_param_chunks, uint64_t packed_moment_chunks, double trained_share) {
  const uint64_t c = in.chunk_size;
  GroupBytes g;
  // (A group with no trained tensor packs no chunk of the fp32 kinds.)
  const uint64_t trained = bytes_of(elements, trained_share);
  if (packed_param_chunks > 0 && c > 0 && in.grad_bytes == 4) {
    g.grad = packed_chunks * c;
    g.adam_m = g.adam_v = (packed_moment_chunks > 0 ? packed_moment_chunks : packed_chunks) * c;
    g.master = in.separate_master ? packed_chunks * c : 0;
    g.param = packed_param_chunks * c;
  } else {
    g.param = padded_to_chunks(bytes_of(elements, param_bytes), c);
    g.grad = padded_to_chunks(trained * in.grad_bytes, c);
    g.master = in.separate_master ? padded_to_chunks(trained * 4, c) : 0;
    g.adam_m = padded_to_chunks(bytes_of(trained, in.moment_bytes), c);
    g.adam_v = g.adam_m;
  }
  if (in.optimizer_packs_small) {
    // A group's even share of the chunks the groups fill together (SlicedKinds counts them exactly).
    g.master = in.separate_master ? trained * 4 : 0;
    g.adam_m = g.adam_v = bytes_of(trained, in.moment_bytes);
  }
  return g;
}

// Seconds for people, at three significant digits in a unit that fits: "1.25 s", "52.1 ms",
// "830 us" (fixed decimals printed a small model's whole step as 0.000 s).
std::string format_seconds(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3g} ms", s * 1e3);
  if (s > 0) return fmt::format("{:.3g} us", s * 1e6);
  return "0 s";
}

// Of the edge group's `all` chunks (or bytes, without a chunk size) of kind k (StateKind order),
// the embedding's: the store's count when the input gives it, else half; the head has the rest.
// `sliced`: the kind is held as a rank's slices (ZeRO-1 and up for the optimizer's kinds).
uint64_t embedding_share(const PlanInput& in, int k, uint64_t all, bool sliced) {
  const uint64_t moment = in.embed_moment_chunks, fp32 = in.embed_chunks, copy = in.embed_param_chunks;
  const uint64_t first = k == 0 ? copy : k >= 3 && moment > 0 ? moment : fp32;
  if (sliced) {  // counted in bytes (`all` too)
    const uint64_t moment_bytes = in.embed_sliced_moment_bytes, fp32_bytes = in.embed_sliced_bytes;
    const uint64_t bytes = k == 0 ? in.embed_sliced_param_bytes : k >= 3 && moment_bytes > 0 ? moment_bytes : fp32_bytes;
    return all == 0 ? 0 : bytes > 0 ? std::min(bytes, all) : (all + 1) / 2;
  }
  return all == 0 ? 0 : first > 0 ? std::min(first, all) : (all + 1) / 2;
}

// Where each planner group's kinds live: resident on the device or not, its optimizer state on
// the device, else on the host or spilled to NVMe; a streamed compute copy or gradient on the
// host, or spilled to NVMe too when the host cannot hold it.
struct GroupHomes {
  std::vector<bool> param_res, grad_res, opt_dev, opt_nvme, param_nvme, grad_nvme;
  // Of a group whose optimizer state stays on the host, its last experts (of those
  // spillable_experts lists) whose optimizer state is on nvme.
  std::vector<size_t> opt_nvme_experts;
};

// One expert of a layer and its optimizer state's bytes (whole chunks, as the store packs them).
struct ExpertBytes {
  int part = 0;
  uint64_t master = 0, adam_m = 0, adam_v = 0;
};

// Per planner group (layer l at l; the edge, at L, has none), the experts whose optimizer state
// can move to nvme one at a time (PlanInput::expert_chunks): as every rank holds them whole, or
// as the largest share packs its slices, so that every rank homes them alike.
std::vector<std::vector<ExpertBytes>> spillable_experts(const PlanInput& in, int64_t L, bool sharded) {
  std::vector<std::vector<ExpertBytes>> out(static_cast<size_t>(L) + 1);
  const auto& chunks = sharded ? in.expert_sliced_chunks : in.expert_chunks;
  const uint64_t c = in.chunk_size;
  for (size_t l = 0; l < chunks.size() && l < static_cast<size_t>(L) && c > 0; ++l)
    for (const PlanInput::ExpertChunks& e : chunks[l])
      out[l].push_back({e.part, e.master * c, e.adam_m * c, e.adam_v * c});
  return out;
}

// How many times plan_at_level places the groups again with less device room.
constexpr int kPlacementAttempts = 6;

// KindBytes' member for a kind of state.
uint64_t& bytes_of_kind(KindBytes& b, StateKind k) {
  switch (k) {
    case StateKind::kParam: return b.param;
    case StateKind::kGrad: return b.grad;
    case StateKind::kMaster: return b.master;
    case StateKind::kAdamM: return b.adam_m;
    case StateKind::kAdamV: return b.adam_v;
    default: break;
  }
  CHECK_MSG(false, "activations are not a kind of group state");
  return b.act;
}

// The planner group of a state-store group: the embedding and the head are the edge (L), store
// group l + 1 is layer l.
int64_t planner_group(int g, int64_t L) { return g == 0 || g == L + 1 ? L : static_cast<int64_t>(g) - 1; }

// Where the decisions made per planner group home part `part` of store group g's `kind`: the
// group's row, or nvme for an expert whose optimizer state the host spilled there.
Tier planned_home(int64_t L, const GroupHomes& h, const std::vector<std::vector<ExpertBytes>>& spill, int g,
                  StateKind kind, int part) {
  const int64_t pg = planner_group(g, L);
  const bool opt = kind == StateKind::kMaster || kind == StateKind::kAdamM || kind == StateKind::kAdamV;
  if (opt && part != kDensePart && !h.opt_dev[pg] && !h.opt_nvme[pg]) {
    const std::vector<ExpertBytes>& spilled = spill[static_cast<size_t>(pg)];
    for (size_t i = spilled.size() - std::min(spilled.size(), h.opt_nvme_experts[pg]); i < spilled.size(); ++i)
      if (spilled[i].part == part) return Tier::kNvme;
  }
  switch (kind) {
    case StateKind::kParam: return h.param_res[pg] ? Tier::kDevice : h.param_nvme[pg] ? Tier::kNvme : Tier::kHost;
    case StateKind::kGrad: return h.grad_res[pg] ? Tier::kDevice : h.grad_nvme[pg] ? Tier::kNvme : Tier::kHost;
    default: return h.opt_dev[pg] ? Tier::kDevice : h.opt_nvme[pg] ? Tier::kNvme : Tier::kHost;
  }
}

// The kinds a rank holds its slices of at ZeRO `zero` over `world` ranks (Placement::shard_over).
bool sliced_at(StateKind kind, int64_t world, int zero) {
  if (world <= 1) return false;
  if (kind == StateKind::kParam) return zero >= 3;
  if (kind == StateKind::kGrad) return zero >= 2;
  return zero >= 1;
}

// The largest share's slices of each kind sliced at the level, as the store packs them
// (state_store.h, "Slices"), and the optimizer's whole kinds whose small groups pack on alike
// (PlanInput::optimizer_packs_small); none without the store's tensors and chunk size.
struct SlicedKinds {
  std::vector<std::pair<StateKind, StateStore::Packing>> packings;
  SlicedKinds(const PlanInput& in, int64_t world, int zero) {
    if (in.chunk_size == 0 || in.state_tensors.empty()) return;
    // The largest share's slices, so that every rank chooses the same homes.
    const std::vector<StateTensor>& tensors = in.sliced_share_tensors.empty() ? in.state_tensors : in.sliced_share_tensors;
    for (StateKind k : in.state_layout.kinds()) {
      if (sliced_at(k, world, zero)) {
        packings.emplace_back(k, StateStore::Packing(tensors, in.chunk_size, in.state_layout, k, true));
      } else if (in.optimizer_packs_small) {
        // Whole, but small groups pack on alike (the optimizer's kinds with LoRA).
        StateStore::Packing whole(in.state_tensors, in.chunk_size, in.state_layout, k, false);
        if (whole.packs_small()) packings.emplace_back(k, std::move(whole));
      }
    }
  }
  // The bytes per tier of each kind homed by `home`: the groups' slices share chunks, so a run
  // of groups homed alike takes the chunks their slices fill together, not a layer's even share
  // each. With `host_adamw` (whether a store group's AdamW runs on the host), the host also
  // counts the device's chunks of the compute copy and gradients of such groups, as the planner
  // does for whole groups (AdamW acquires them there).
  std::array<uint64_t, kNumTiers> tier_bytes(size_t i, uint64_t chunk_bytes, const HomeOf& home,
                                             const std::function<bool(int)>& host_adamw = {}) const {
    const StateKind kind = packings[i].first;
    std::array<uint64_t, kNumTiers> out{};
    const auto packed = packings[i].second.count(home);
    const bool copy_or_grad = kind == StateKind::kParam || kind == StateKind::kGrad;
    for (size_t g = 0; g < packed.size(); ++g)
      for (const StateStore::PartChunks& part : packed[g]) {
        const Tier t = home(static_cast<int>(g), kind, part.part);
        out[static_cast<size_t>(t)] += part.chunks * chunk_bytes;
        if (t == Tier::kDevice && copy_or_grad && host_adamw && host_adamw(static_cast<int>(g)))
          out[static_cast<size_t>(Tier::kHost)] += part.chunks * chunk_bytes;
      }
    return out;
  }
};

// The placement (placement.h) of the decisions made per planner group (layer l at l, the edge at
// L), in the state store's groups: the embedding 0, layer l at l + 1, the head L + 1, the edge's
// bytes split between the embedding and the head as the store packs them.
Placement make_placement(const PlanInput& in, int64_t L, const GroupBytes& layer, const GroupBytes& edge,
                         const GroupHomes& h, const std::vector<std::vector<ExpertBytes>>& spill, int zero) {
  const uint64_t c = in.chunk_size;
  Placement placement(static_cast<int>(L) + 2);
  const int world = static_cast<int>(std::max<int64_t>(1, in.world_size));
  placement.shard_over(world, zero);
  auto place = [&](int group, const GroupBytes& b, const auto& part) {
    auto home = [&](StateKind k) { return planned_home(L, h, spill, group, k, kDensePart); };
    placement.place(group, StateKind::kParam, home(StateKind::kParam), part(0, b.param));
    placement.place(group, StateKind::kGrad, home(StateKind::kGrad), part(1, b.grad));
    placement.place(group, StateKind::kMaster, home(StateKind::kMaster), part(2, b.master));
    placement.place(group, StateKind::kAdamM, home(StateKind::kAdamM), part(3, b.adam_m));
    placement.place(group, StateKind::kAdamV, home(StateKind::kAdamV), part(4, b.adam_v));
  };
  auto embedding = [&](int k, uint64_t bytes) {
    const bool sliced = placement.sliced(0, static_cast<StateKind>(k));
    return c > 0 && !sliced ? embedding_share(in, k, bytes / c, sliced) * c : embedding_share(in, k, bytes, sliced);
  };
  place(0, edge, embedding);
  for (int64_t l = 0; l < L; ++l) place(static_cast<int>(l) + 1, layer, [](int, uint64_t bytes) { return bytes; });
  place(static_cast<int>(L) + 1, edge, [&](int k, uint64_t bytes) { return bytes - embedding(k, bytes); });
  // A row for each part of the store's groups (the experts of MoE layers), homed with its group
  // but for the experts whose optimizer state the host spilled to nvme, sized as the store packs
  // it (this rank's slices of a sliced kind).
  if (c == 0 || in.state_tensors.empty()) return placement;
  const HomeOf home = [&](int g, StateKind k, int part) { return planned_home(L, h, spill, g, k, part); };
  for (StateKind kind : in.state_layout.kinds()) {
    const auto packed = StateStore::part_chunks(in.state_tensors, c, in.state_layout, kind, placement.sliced(0, kind), home);
    for (size_t g = 0; g < packed.size() && g < static_cast<size_t>(placement.num_groups()); ++g)
      for (const StateStore::PartChunks& part : packed[g])
        if (part.part != kDensePart)
          placement.place_part(static_cast<int>(g), part.part, kind, home(static_cast<int>(g), kind, part.part),
                               part.chunks * c);
  }
  return placement;
}

// The replay's input: the engine's store (its tensors, homed as the plan's placement says) on
// tiers of the engine's sizes: the device's budget less the activations, the host's capped at
// what the store (every kind, wherever homed, the offloaded saved activations) and one nvme
// staging slot can occupy (train/paged_state.cpp, host_tier_size); and the step program, the
// model's micro-batch and the optimizer's passes with AdamW where each group's moments are.
ReplayInput replay_input(const PlanInput& in, const Plan& p, bool offload) {
  const uint64_t c = in.chunk_size;
  ReplayInput r;
  r.tensors = in.state_tensors;
  r.store.layout = in.state_layout;
  r.store.lookahead = in.lookahead;
  r.store.space.chunk_bytes = c;
  r.store.home = [&p](int g, StateKind k, int part) { return p.placement.home(g, k, part); };
  r.store.sliced = [&p](int g, StateKind k) { return p.placement.sliced(g, k); };
  std::array<bool, kNumStateKinds> sliced{};
  for (StateKind k : in.state_layout.kinds()) sliced[static_cast<size_t>(k)] = p.placement.sliced(0, k);
  r.activations = offload ? in.offloaded_activations : 0;
  r.activation_bytes = in.saved_activation_bytes_per_layer;
  r.activation_host_chunks = p.placement.activation_host_chunks();
  r.store.space.device_bytes = p.device_chunk_bytes;
  const uint64_t staging = in.nvme_budget > 0 ? 1 : 0;
  const uint64_t most =
      store_chunk_count(r.tensors, r.store.layout, c, r.activations, r.activation_bytes, sliced, r.store.home);
  r.store.space.host_bytes = std::min(in.host_budget, (most + staging) * c);
  r.store.space.nvme_bytes = in.nvme_budget;
  OptimizerProgram optimizer;
  optimizer.num_groups = p.placement.num_groups();
  optimizer.kinds = in.state_layout.kinds();
  optimizer.where = [&p](int g) { return update_tier(p.placement.home(g, StateKind::kAdamM)); };
  // Ranks holding every gradient sum them in place; at ZeRO-2 each backward's sums go onto the
  // ranks' slices as it ends.
  optimizer.reduces_gradients = in.world_size > 1 && !p.placement.sliced(0, StateKind::kGrad);
  optimizer.overlapped = in.overlap_optimizer;
  optimizer.slices_host_updates = true;  // as the engine updates (replay_step splits them)
  // (Expert groups sum after backward at ZeRO-0 and 1: PagedState has no handover for them.)
  optimizer.reduces_at_handover = in.overlap_comm && !in.overlap_optimizer && in.expert_ranks <= 1;
  r.program = make_step_program(offload ? in.micro_batch_program_offloaded : in.micro_batch_program, optimizer)
                  .events(std::max<int64_t>(1, in.grad_accum));
  r.expert_fetch_fraction = in.expert_fetch_fraction;
  r.expert_fetch_by_group = in.expert_fetch_by_group;
  // The ranks gather and sum every expert of a sliced kind (train/paged_state.cpp, begin_experts).
  for (StateKind k : {StateKind::kParam, StateKind::kGrad})
    r.every_expert[static_cast<size_t>(k)] = in.world_size > 1 && p.placement.sliced(0, k);
  return r;
}

// One rank's part of a group under ZeRO `zero` over `world` ranks: 1/world of each sharded
// kind, rounded up (a rank's shard of the flat state, not whole chunks); the optimizer's kinds
// as the store packs the rank's slices when `sliced` (and for compact moments `sliced_moment`)
// bytes are known.
GroupBytes shard_of(const PlanInput& in, GroupBytes b, int64_t world, int zero, uint64_t sliced,
                    uint64_t sliced_moment, uint64_t sliced_param) {
  const uint64_t w = static_cast<uint64_t>(world);
  auto part = [&](uint64_t bytes) { return (bytes + w - 1) / w; };
  const bool packed = world > 1 && sliced > 0 && in.chunk_size > 0;  // the store's slices of fp32 kinds known
  if (zero >= 1 && packed) {
    b.master = in.separate_master ? sliced : 0;
    b.adam_m = b.adam_v = sliced_moment > 0 ? sliced_moment : sliced;
  } else if (zero >= 1) {
    b.master = part(b.master), b.adam_m = part(b.adam_m), b.adam_v = part(b.adam_v);
  }
  if (zero >= 2) b.grad = packed ? sliced : part(b.grad);
  if (zero >= 3) b.param = packed && sliced_param > 0 ? sliced_param : part(b.param);
  return b;
}

// The sizes plan_at_level works with at one ZeRO level: each group whole and as this rank
// holds it, and the activations' layer-boundary copies (saved activations) of a micro-batch.
struct LevelSizes {
  int zero = 0;
  int64_t L = 0;        // layers; planner group L is the edge (embedding and head)
  int64_t W = 1;        // ranks
  int64_t groups = 0;   // L + 1
  bool sharded = false;  // some kind is split over the ranks
  GroupBytes full_layer{}, full_edge{};
  // What this rank holds of each group; the working set stays whole-layer sized: ZeRO-3
  // gathers a layer's parameters before using them and ZeRO-2 produces a layer's gradients in
  // full before reducing them onto their shards.
  GroupBytes layer{}, edge{};
  uint64_t saved_all = 0;  // every layer's saved activations, kept on the device
  const GroupBytes& of(int64_t g) const { return g == L ? edge : layer; }
  // The parameters each rank's AdamW updates in a group of `elements`.
  uint64_t updated(uint64_t elements) const {
    return zero >= 1 ? (elements + static_cast<uint64_t>(W) - 1) / static_cast<uint64_t>(W) : elements;
  }
};

LevelSizes level_sizes(const PlanInput& in, int zero) {
  LevelSizes s;
  s.zero = zero;
  s.L = in.num_layers;
  s.W = std::max<int64_t>(1, in.world_size);
  s.groups = s.L + 1;
  s.sharded = s.W > 1 && zero >= 1;
  s.full_layer = group_bytes(in, in.layer_elements, in.param_bytes, in.layer_chunks, in.layer_param_chunks,
                             in.layer_moment_chunks, in.layer_trained_share);
  s.full_edge = group_bytes(in, in.edge_elements, in.edge_param_bytes, in.edge_chunks, in.edge_param_chunks,
                            in.edge_moment_chunks, in.edge_trained_share);
  s.layer = shard_of(in, s.full_layer, s.W, zero, in.layer_sliced_bytes, in.layer_sliced_moment_bytes,
                     in.layer_sliced_param_bytes);
  s.edge = shard_of(in, s.full_edge, s.W, zero, in.edge_sliced_bytes, in.edge_sliced_moment_bytes,
                    in.edge_sliced_param_bytes);
  const int64_t checkpointed = in.checkpoint_layers >= 0 ? in.checkpoint_layers : s.L;
  s.saved_all = static_cast<uint64_t>(checkpointed + 1) * in.saved_activation_bytes_per_layer;
  return s;
}

// The device working set while everything streams: two layers' (or a layer's and the edge's)
// parameters and gradients, the activations, and the saved activations (two layers' when
// offloaded, else every layer's).
struct WorkingSet {
  uint64_t param = 0, grad = 0, act = 0, saved_offloaded = 0;
};

// Step 1: the working set on the device, and whether the saved activations are offloaded. False
// with the problem and suggestions in `p` when the device cannot hold it; else `free_bytes` is
// what the device has left for resident state.
bool plan_working_set(const PlanInput& in, const LevelSizes& s, Plan& p, WorkingSet* ws, uint64_t* free_bytes) {
  ws->param = std::max(s.full_edge.param + s.full_layer.param, 2 * s.full_layer.param);
  ws->grad = std::max(s.full_edge.grad + s.full_layer.grad, 2 * s.full_layer.grad);
  ws->act = in.layer_workspace_bytes + in.head_workspace_bytes + in.kept_activation_bytes;
  if (s.W > 1 && s.zero >= 2) {
    // Backward writes a group's full gradients into a workspace beside the chunks (a tied
    // embedding's and a layer's at once), which are summed onto their ranks' slices; the chunks
    // then pass two groups' slices.
    ws->act += in.gradient_working_bytes > 0 ? in.gradient_working_bytes : ws->grad;
    ws->grad = std::max(s.edge.grad + s.layer.grad, 2 * s.layer.grad);
  }
  if (s.W > 1 && s.zero >= 3) {
    // The same for the compute copy: each batch's groups gathered whole into a workspace.
    ws->act += in.param_working_bytes > 0 ? in.param_working_bytes : ws->param;
    ws->param = std::max(s.edge.param + s.layer.param, 2 * s.layer.param);
  }
  ws->saved_offloaded = 2 * in.saved_activation_bytes_per_layer;
  bool offload = in.offload_activations == "true";
  uint64_t minimum = ws->param + ws->grad + ws->act + (offload ? ws->saved_offloaded : s.saved_all);
  if (in.offload_activations == "auto") minimum = ws->param + ws->grad + ws->act + ws->saved_offloaded;
  p.min_device_budget = minimum;
  if (minimum > in.device_budget) {
    p.problem = fmt::format(
        "the device budget {} cannot hold one layer's working set of {} (parameters {}, gradients {}, "
        "activations {}, saved activations {})",
        format_bytes(in.device_budget), format_bytes(minimum), format_bytes(ws->param), format_bytes(ws->grad),
        format_bytes(ws->act), format_bytes(minimum - ws->param - ws->grad - ws->act));
    p.suggestions.push_back(fmt::format("raise memory.device to at least {}", format_bytes(minimum)));
    p.suggestions.push_back("or lower train.micro_batch / train.seq_len (activations grow with tokens per micro-batch)");
    return false;
  }
  *free_bytes = in.device_budget - minimum;
  p.device.act = ws->act;
  if (in.offload_activations == "auto") {
    const uint64_t extra = s.saved_all - ws->saved_offloaded;
    offload = extra > *free_bytes;
    if (!offload) *free_bytes -= extra;
  }
  p.offload_activations = offload;
  p.device.act += offload ? ws->saved_offloaded : s.saved_all;
  p.device_chunk_bytes = in.device_budget - p.device.act;
  return true;
}


// Step 2: resident parameters, then gradients, then optimizer states, group by group (edge
// first: it is touched at both ends of every pass), in the device's `free_bytes`.
GroupHomes place_on_device(const LevelSizes& s, const WorkingSet& ws, uint64_t free_bytes, Plan& p) {
  const int64_t groups = s.groups, L = s.L;
  const std::vector<bool> none(static_cast<size_t>(groups), false);
  GroupHomes h{none, none, none, none, none, none, std::vector<size_t>(static_cast<size_t>(groups), 0)};
  auto order = [&](int64_t i) { return i == 0 ? L : i - 1; };
  uint64_t ws_param_left = ws.param, ws_grad_left = ws.grad;
  for (int64_t i = 0; i < groups; ++i) {
    const int64_t g = order(i);
    if (s.of(g).param > free_bytes) continue;
    free_bytes -= s.of(g).param;
    h.param_res[g] = true;
    p.resident_param_groups++;
  }
  // Every group's parameters resident frees the working set's, unless they are shards.
  if (p.resident_param_groups == groups) free_bytes += ws_param_left, ws_param_left = 0;
  for (int64_t i = 0; i < groups; ++i) {
    const int64_t g = order(i);
    if (s.of(g).grad > free_bytes) continue;
    free_bytes -= s.of(g).grad;
    h.grad_res[g] = true;
    p.resident_grad_groups++;
  }
  // (At ZeRO-2 the working set passes slices; backward's full gradients have a workspace of their own.)
  if (p.resident_grad_groups == groups) free_bytes += ws_grad_left, ws_grad_left = 0;
  for (int64_t i = 0; i < groups; ++i) {
    const int64_t g = order(i);
    if (!h.param_res[g] || !h.grad_res[g] || s.of(g).optimizer() > free_bytes) continue;
    free_bytes -= s.of(g).optimizer();
    h.opt_dev[g] = true;
    p.device_optimizer_groups++;
  }
  p.device_working_set = ws_param_left + ws_grad_left + ws.act + (p.offload_activations ? ws.saved_offloaded : 0);
  p.device.param = ws_param_left;
  p.device.grad = ws_grad_left;
  for (int64_t g = 0; g < groups; ++g) {
    if (h.param_res[g]) p.device.param += s.of(g).param;
    if (h.grad_res[g]) p.device.grad += s.of(g).grad;
    if (h.opt_dev[g])
      p.device.master += s.of(g).master, p.device.adam_m += s.of(g).adam_m, p.device.adam_v += s.of(g).adam_v;
  }
  return h;
}

// The host staging of state homed on NVMe or passed through the host: two chunks of each of the
// `optimizer_kinds` kinds homed there (AdamW in host memory goes update slice by slice, a chunk
// of each kind at a time: the slice's, and the next one's read ahead), and two of each of the
// `paged_kinds` (compute copies and gradients reach the device through host slots, and AdamW
// takes resident ones through them). Without a fixed chunk size, chunks come out about one
// layer's optimizer tensors large. The planner's replay of the step then decides whether the
// host really has the slots.
uint64_t nvme_staging_bytes(const PlanInput& in, uint64_t optimizer_kinds, uint64_t paged_kinds) {
  const uint64_t chunk =
      in.chunk_size ? in.chunk_size : std::min<uint64_t>(64ull << 20, round_up<uint64_t>(in.layer_elements * 4, 4096));
  return 2 * (optimizer_kinds + paged_kinds) * chunk;
}

// Step 3: host and NVMe. Every group whose optimizer runs on the CPU keeps a parameter copy, a
// gradient landing buffer and its optimizer state on the host, unless the state spills to NVMe
// (whole groups at a time, from the last, until the host fits; an MoE layer's optimizer state
// expert by expert, then the rest of the layer). `order` says in which order the optimizer
// state, the compute copies and the gradients that stream to the device from the host spill:
// the planner tries each and keeps the fastest predicted step, since an optimizer step through
// NVMe reads and writes every optimizer byte once, a streamed copy is read at every use and a
// streamed gradient written at every micro-batch. Last, what the device keeps resident is passed
// through the host by update slices instead of held there. The host then holds little more than
// the slots the chunks pass through (staging): AdamW on the host holds an update slice's kinds at
// once, and a chunk homed on NVMe reaches the device through a host slot. False with the problem
// and suggestions in `p` when the host or NVMe budget cannot hold its part, or the host cannot
// hold what the weights pass through while they load.
bool place_on_host_and_nvme(const PlanInput& in, const LevelSizes& s,
                            const std::vector<std::vector<ExpertBytes>>& spill, const SlicedKinds& sliced,
                            SpillOrder order, GroupHomes& h, Plan& p) {
  // Offloaded saved activations take whole chunks of the store, packed (StateStore::add_activations).
  const uint64_t act_chunks =
      p.offload_activations && in.chunk_size > 0 && in.offloaded_activations > 0
          ? StateStore::activation_chunks(in.offloaded_activations, in.saved_activation_bytes_per_layer, in.chunk_size)
          : 0;
  if (p.offload_activations)
    p.host.act = in.chunk_size > 0 && in.offloaded_activations > 0
                     ? StateStore::activation_chunks(in.offloaded_activations, in.saved_activation_bytes_per_layer,
                                                     in.chunk_size) *
                           in.chunk_size
                     : s.saved_all;
  std::vector<int64_t> host_groups;
  for (int64_t g = 0; g < s.groups; ++g) {
    if (h.opt_dev[g]) continue;
    host_groups.push_back(g);
    const GroupBytes& b = s.of(g);
    p.host.param += b.param, p.host.grad += b.grad;
    p.host.master += b.master, p.host.adam_m += b.adam_m, p.host.adam_v += b.adam_v;
  }
  // What the device keeps resident but the host does not hold (the spill pass's last step): per
  // group, of its compute copy and of its gradients.
  std::vector<std::array<bool, 2>> resident_passed(static_cast<size_t>(s.groups), {false, false});
  bool passes_param = false, passes_grad = false;
  // Kinds with a group on nvme, or passed through the host, each needing host slots.
  auto staging = [&] {
    bool param = passes_param, grad = passes_grad;
    for (int64_t g = 0; g < s.groups; ++g) param = param || h.param_nvme[g], grad = grad || h.grad_nvme[g];
    const bool opt = p.nvme_optimizer_groups > 0 || p.nvme_optimizer_experts > 0;
    const uint64_t optimizer = opt ? (in.separate_master ? 3 : 2) : 0,
                   paged = (param ? 1 : 0) + (grad ? 1 : 0) + (p.nvme_activation_chunks > 0 ? 1 : 0);
    return optimizer + paged > 0 ? nvme_staging_bytes(in, optimizer, paged) : 0;
  };
  // The sliced kinds' bytes as the store packs them under the homes so far: what the host holds
  // of them differs from the layers' even shares p.host counts.
  const HomeOf home = [&](int g, StateKind k, int part) { return planned_home(s.L, h, spill, g, k, part); };
  const std::function<bool(int)> host_adamw = [&](int g) { return !h.opt_dev[planner_group(g, s.L)]; };
  auto sliced_exactly = [&](Tier t) {
    uint64_t exact = 0, even = 0;
    for (size_t i = 0; i < sliced.packings.size(); ++i)
      exact += sliced.tier_bytes(i, in.chunk_size, home, host_adamw)[static_cast<size_t>(t)],
          even += bytes_of_kind(t == Tier::kHost ? p.host : p.nvme, sliced.packings[i].first);
    return std::pair{exact, even};
  };
  // The even shares differ from the packing by the chunks the runs of groups homed alike fill in
  // part, a few per sliced kind: only within that margin of the budget is the packing counted
  // (O(tensors) a count, which a spill step by step would repeat many times over).
  const uint64_t margin = 4 * sliced.packings.size() * in.chunk_size;
  auto over = [&] {
    const uint64_t total = p.host.total() + staging();
    if (sliced.packings.empty() || total > in.host_budget + margin) return total > in.host_budget;
    if (total + margin < in.host_budget) return false;
    const auto [exact, even] = sliced_exactly(Tier::kHost);
    return total - even + exact > in.host_budget;
  };
  auto spill_optimizer = [&](uint64_t master, uint64_t adam_m, uint64_t adam_v) {
    p.host.master -= master, p.host.adam_m -= adam_m, p.host.adam_v -= adam_v;
    p.nvme.master += master, p.nvme.adam_m += adam_m, p.nvme.adam_v += adam_v;
  };
  auto spill_optimizer_state = [&] {
    for (auto it = host_groups.rbegin(); it != host_groups.rend(); ++it) {
      if (h.opt_nvme[*it]) continue;
      if (!over()) break;
      const GroupBytes& b = s.of(*it);
      // An MoE layer's experts go one at a time, from the last, before the rest of the layer: the
      // host then keeps all but the last expert's worth of what it has room for, not all but a
      // layer's.
      uint64_t master = b.master, adam_m = b.adam_m, adam_v = b.adam_v;
      // Expert by expert only where the experts fit in the planner's (average) layer: a model
      // with dense layers among its MoE ones has an MoE layer larger than the average, which
      // spills whole so that nvme counts every byte it holds.
      const std::vector<ExpertBytes>& listed = spill[static_cast<size_t>(*it)];
      uint64_t em_all = 0, eam_all = 0, eav_all = 0;
      for (const ExpertBytes& e : listed) em_all += e.master, eam_all += e.adam_m, eav_all += e.adam_v;
      static const std::vector<ExpertBytes> kNone;
      const std::vector<ExpertBytes>& experts =
          em_all <= master && eam_all <= adam_m && eav_all <= adam_v ? listed : kNone;
      size_t& spilled = h.opt_nvme_experts[static_cast<size_t>(*it)];
      for (size_t i = 0; i < spilled; ++i) {  // spilled by the pass before
        const ExpertBytes& e = experts[experts.size() - 1 - i];
        master -= e.master, adam_m -= e.adam_m, adam_v -= e.adam_v;
      }
      while (spilled < experts.size() && over()) {
        const ExpertBytes& e = experts[experts.size() - 1 - spilled];
        spill_optimizer(e.master, e.adam_m, e.adam_v);
        master -= e.master, adam_m -= e.adam_m, adam_v -= e.adam_v;
        ++spilled;
        p.nvme_optimizer_experts++;
      }
      if (!over()) break;
      spill_optimizer(master, adam_m, adam_v);
      p.nvme_optimizer_experts -= static_cast<int64_t>(spilled);
      spilled = 0;
      h.opt_nvme[*it] = true;
      p.nvme_optimizer_groups++;
    }
  };
  // The compute copies and gradients that stream from the host, whole groups from the last.
  auto spill_copies = [&] {
    for (auto it = host_groups.rbegin(); it != host_groups.rend(); ++it) {
      if (h.param_res[*it] || h.param_nvme[*it]) continue;
      if (!over()) break;
      p.host.param -= s.of(*it).param, p.nvme.param += s.of(*it).param;
      h.param_nvme[*it] = true;
      p.nvme_param_groups++;
    }
  };
  auto spill_gradients = [&] {
    for (auto it = host_groups.rbegin(); it != host_groups.rend(); ++it) {
      if (h.grad_res[*it] || h.grad_nvme[*it]) continue;
      if (!over()) break;
      p.host.grad -= s.of(*it).grad, p.nvme.grad += s.of(*it).grad;
      h.grad_nvme[*it] = true;
      p.nvme_grad_groups++;
    }
  };
  // Last, what the device keeps resident: its home is the device, and AdamW in host memory
  // takes its compute copy and gradients through host slots an update slice at a time, so the
  // host need not hold them whole (two slots of each kind stay for the slices: staging).
  auto pass_resident = [&] {
    for (auto it = host_groups.rbegin(); it != host_groups.rend(); ++it) {
      for (const bool param : {true, false}) {
        if (!(param ? h.param_res : h.grad_res)[*it] || resident_passed[static_cast<size_t>(*it)][param]) continue;
        if (!over()) break;
        (param ? p.host.param : p.host.grad) -= param ? s.of(*it).param : s.of(*it).grad;
        resident_passed[static_cast<size_t>(*it)][param] = true;
        (param ? passes_param : passes_grad) = true;
      }
    }
  };
  // When all that still leaves the host over its budget, the saved activations: chunk by chunk,
  // the last layers' first (the store homes the chunks it opens last on NVMe), each then written
  // and read once a micro-batch through a host slot.
  auto spill_activations = [&] {
    while (static_cast<uint64_t>(p.nvme_activation_chunks) < act_chunks && over()) {
      p.host.act -= in.chunk_size, p.nvme.act += in.chunk_size;
      ++p.nvme_activation_chunks;
    }
  };
  auto spill_pass = [&] {
    if (in.nvme_budget == 0) return;
    switch (order) {
      case SpillOrder::kOptimizerFirst: spill_optimizer_state(), spill_copies(), spill_gradients(); break;
      case SpillOrder::kCopiesFirst: spill_copies(), spill_optimizer_state(), spill_gradients(); break;
      case SpillOrder::kStreamsFirst: spill_copies(), spill_gradients(), spill_optimizer_state(); break;
    }
    pass_resident();
    spill_activations();
  };
  spill_pass();
  // The sliced kinds as the store packs them.
  for (size_t i = 0; i < sliced.packings.size(); ++i) {
    const std::array<uint64_t, kNumTiers> exact = sliced.tier_bytes(i, in.chunk_size, home, host_adamw);
    bytes_of_kind(p.host, sliced.packings[i].first) = exact[static_cast<size_t>(Tier::kHost)];
    bytes_of_kind(p.nvme, sliced.packings[i].first) = exact[static_cast<size_t>(Tier::kNvme)];
  }
  p.host.act += staging();
  if (p.host.total() > in.host_budget) {
    p.problem = fmt::format("the host budget {} cannot hold the {} this plan keeps there", format_bytes(in.host_budget),
                            format_bytes(p.host.total()));
    if (in.nvme_budget == 0) {
      const uint64_t opt = p.host.master + p.host.adam_m + p.host.adam_v;
      p.suggestions.push_back(fmt::format("raise memory.host to at least {}", format_bytes(p.host.total())));
      p.suggestions.push_back(fmt::format("or add an nvme tier (memory.nvme.path, memory.nvme.size >= {}) for the optimizer states",
                                          format_bytes(opt)));
    } else {
      p.suggestions.push_back(fmt::format("raise memory.host to at least {}", format_bytes(p.host.total())));
    }
    return false;
  }
  if (p.nvme.total() > in.nvme_budget) {
    p.problem = fmt::format("the nvme budget {} cannot hold the {} of state that spills there",
                            format_bytes(in.nvme_budget), format_bytes(p.nvme.total()));
    p.suggestions.push_back(fmt::format("raise memory.nvme.size to at least {}", format_bytes(p.nvme.total())));
    return false;
  }
  // Loading the weights passes them through host memory, whatever their home, a chunk of each
  // kind written at a time (StateStore's update slices).
  const uint64_t load_bytes = in.largest_group_load_chunks * in.chunk_size;
  if (in.host_budget > 0 && load_bytes > in.host_budget) {
    p.problem = fmt::format(
        "the host budget {} cannot hold the {} the weights pass through while they load (a chunk of each kind they "
        "are written in at a time, whatever their home)",
        format_bytes(in.host_budget), format_bytes(load_bytes));
    p.suggestions.push_back(fmt::format("raise memory.host to at least {}", format_bytes(load_bytes)));
    return false;
  }
  return true;
}

// What moves between the tiers in one step, by phase: a micro-batch's forward and backward, the
// gradient passes (zeroing and the norm) and the optimizer once per step.
struct DiskMoves {
  uint64_t read = 0, write = 0;
};

struct PhaseTraffic {
  uint64_t fwd_h2d = 0, fwd_d2h = 0, bwd_h2d = 0, bwd_d2h = 0, opt_h2d = 0, opt_d2h = 0;
  uint64_t pass_h2d = 0, pass_d2h = 0;
  uint64_t first_layer_h2d = 0;  // what the first layer of a phase needs before it can start
  uint64_t grad_total = 0;       // every gradient's bytes this rank holds
  // Disk reads and writes: per micro-batch in forward and in backward (state homed on nvme that
  // streams to the device), in the gradient passes, and in the optimizer.
  DiskMoves fwd_disk, bwd_disk, pass_disk, opt_disk;
};

// Step 4: traffic per optimizer step, with the step's totals in `p`: each streamed group moved
// at every use, or, with chunks, the replay of the chunk space.
PhaseTraffic plan_traffic(const PlanInput& in, const LevelSizes& s, const GroupHomes& h, Plan& p,
                          bool* device_short = nullptr) {
  const int64_t L = s.L, groups = s.groups, W = s.W;
  const int zero = s.zero;
  const bool offload = p.offload_activations;
  const uint64_t accum = static_cast<uint64_t>(std::max<int64_t>(1, in.grad_accum));
  // The experts a micro-batch leaves without tokens, which a streamed layer does not move. A
  // rank's gradient shard is a slice of the flat layer that cuts across experts: with sharded
  // gradients every streamed byte is planned to move.
  const double idle = W > 1 && zero >= 2 ? 0.0 : std::clamp(1.0 - in.expert_fetch_fraction, 0.0, 1.0);
  const uint64_t idle_experts = static_cast<uint64_t>(idle * static_cast<double>(in.expert_elements));
  uint64_t fwd_h2d = 0, fwd_d2h = 0, bwd_h2d = 0, bwd_d2h = 0, opt_h2d = 0, opt_d2h = 0;
  uint64_t first_layer_h2d = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const GroupBytes& b = s.of(g);
    const uint64_t idle_param = g == L ? 0 : std::min(b.param, bytes_of(idle_experts, in.param_bytes));
    const uint64_t idle_grad = g == L ? 0 : std::min(b.grad, idle_experts * in.grad_bytes);
    if (!h.param_res[g]) {  // forward, and backward's recompute
      fwd_h2d += b.param - idle_param;
      bwd_h2d += b.param - idle_param;
      if (g != L) first_layer_h2d = b.param - idle_param;
    } else if (!h.opt_dev[g]) {
      opt_h2d += b.param;  // the updated copy after CPU AdamW
    }
    if (!h.grad_res[g]) {  // accumulated on the device: read in and written back per micro-batch
      bwd_h2d += b.grad - idle_grad;
      bwd_d2h += b.grad - idle_grad;
    } else if (!h.opt_dev[g]) {
      opt_d2h += b.grad;  // once, for CPU AdamW
    }
    if (!h.opt_dev[g]) p.cpu_adam_elements += s.updated(trained_elements(in, g == L));
  }
  if (offload) {
    const uint64_t checkpointed = static_cast<uint64_t>(in.checkpoint_layers >= 0 ? in.checkpoint_layers : L);
    fwd_d2h += checkpointed * in.saved_activation_bytes_per_layer;
    bwd_h2d += checkpointed * in.saved_activation_bytes_per_layer;
  }
  // Zeroing writes each streamed gradient on the device and sends it back; the norm (unless it
  // is taken inside the overlapped optimizer) reads each one there once more.
  uint64_t grad_total = 0, streamed_grad = 0;
  for (int64_t g = 0; g < groups; ++g) {
    grad_total += s.of(g).grad;
    if (!h.grad_res[g]) streamed_grad += s.of(g).grad;
  }
  uint64_t pass_d2h = streamed_grad, pass_h2d = in.overlap_optimizer ? 0 : streamed_grad;
  p.h2d_bytes = accum * (fwd_h2d + bwd_h2d) + opt_h2d + pass_h2d;
  p.d2h_bytes = accum * (fwd_d2h + bwd_d2h) + opt_d2h + pass_d2h;
  // The disk: optimizer state read and written once; a compute copy on nvme read for forward and
  // for backward and written once updated; a gradient on nvme read and written per micro-batch.
  const uint64_t opt_nvme = p.nvme.master + p.nvme.adam_m + p.nvme.adam_v;
  DiskMoves fwd_disk{p.nvme.param, 0}, bwd_disk{p.nvme.param + p.nvme.grad, p.nvme.grad}, pass_disk;
  DiskMoves opt_disk{opt_nvme + p.nvme.param, opt_nvme + p.nvme.param};
  p.disk_read_bytes = opt_nvme + accum * (2 * p.nvme.param + p.nvme.grad);
  p.disk_write_bytes = opt_nvme + p.nvme.param + accum * p.nvme.grad;
  // With chunks, what the chunk space moves: it keeps copies in the slots its homes and working
  // set leave free and gives up, when full, the copy needed farthest along the schedule, so the
  // counts above (every streamed group moved at every use) are replaced by a replay of the step
  // on the store itself (offload/replay.h). The saved activations' copies to and from the device
  // stay as above (the model copies them in and out of their chunks, which the store holds in
  // host memory or, homed on nvme, reads and writes through host slots: the replay counts those).
  // The shards are the store's slices of each tensor, which the replay packs as the engine does.
  if (in.chunk_size > 0 && !in.micro_batch_program.empty() && !in.state_tensors.empty()) {
    Result<ReplayResult> replay = replay_step(replay_input(in, p, offload));
    if (!replay.ok()) {
      // The engine would fail the same way in its first step: the placement does not fit.
      p.fits = false;
      // The chunk space's own words, less its advice to its callers (which chunks to release).
      std::string why = replay.status().message();
      why = why.substr(0, why.find("; release chunks first"));
      p.problem = "one step of this placement cannot run (replayed on the chunk store): " + why;
      for (Tier t : {Tier::kDevice, Tier::kHost})
        if (replay.status().message().find(std::string("'") + tier_name(t) + "'") != std::string::npos) {
          p.suggestions.push_back(std::string("raise ") + tier_budget_key(t));
          if (t == Tier::kDevice && device_short != nullptr) *device_short = true;
        }
    } else {
      const ReplayResult& r = *replay;
      const uint64_t ckpt = offload ? static_cast<uint64_t>(in.checkpoint_layers >= 0 ? in.checkpoint_layers : L) *
                                          in.saved_activation_bytes_per_layer
                                    : 0;
      const ReplayMoves total = r.total();
      const ReplayMoves &fwd = r.of(StepPhase::kForward), &bwd = r.of(StepPhase::kBackward);
      const ReplayMoves &zero_pass = r.of(StepPhase::kZero), &norm = r.of(StepPhase::kNorm),
                        &opt = r.of(StepPhase::kOptimizer);
      fwd_h2d = fwd.h2d / accum, fwd_d2h = fwd.d2h / accum + ckpt;
      bwd_h2d = bwd.h2d / accum + ckpt, bwd_d2h = bwd.d2h / accum;
      pass_h2d = zero_pass.h2d + norm.h2d, pass_d2h = zero_pass.d2h + norm.d2h;
      opt_h2d = opt.h2d, opt_d2h = opt.d2h;
      p.h2d_bytes = total.h2d + accum * ckpt;
      p.d2h_bytes = total.d2h + accum * ckpt;
      p.disk_read_bytes = total.disk_read;
      p.disk_write_bytes = total.disk_write;
      fwd_disk = {fwd.disk_read / accum, fwd.disk_write / accum};
      bwd_disk = {bwd.disk_read / accum, bwd.disk_write / accum};
      pass_disk = {zero_pass.disk_read + norm.disk_read, zero_pass.disk_write + norm.disk_write};
      opt_disk = {opt.disk_read, opt.disk_write};
      p.chunk_peak_bytes = r.peak_bytes;
    }
  }
  return PhaseTraffic{fwd_h2d,  fwd_d2h,  bwd_h2d,         bwd_d2h,    opt_h2d,  opt_d2h,   pass_h2d,
                      pass_d2h, first_layer_h2d, grad_total, fwd_disk, bwd_disk, pass_disk, opt_disk};
}

// Step 5: time, phase by phase, as the engine schedules the step. Within a phase the copy
// streams prefetch along the schedule while compute runs, so a transfer hides behind the
// compute of the layers before it; the first layer's parameters cannot (nothing runs before
// them), and on the CPU backend copies take the cores compute uses (rates.copy_overlap near 0).
void plan_time(const PlanInput& in, const LevelSizes& s, const GroupHomes& h, const PhaseTraffic& tr, Plan& p) {
  const MachineRates& r = in.rates;
  const double ov = std::clamp(r.copy_overlap, 0.0, 1.0);
  const double Ld = static_cast<double>(s.L);
  const uint64_t accum = static_cast<uint64_t>(std::max<int64_t>(1, in.grad_accum));
  // Chunks move one by one, each with a cost of its own beside its bytes (a task on a copy
  // stream, its events); without a fixed chunk size, a layer's worth is one move.
  const double move_bytes = static_cast<double>(in.chunk_size ? in.chunk_size : std::max<uint64_t>(s.layer.param, 1));
  auto moves = [&](uint64_t bytes) { return std::ceil(static_cast<double>(bytes) / move_bytes) * r.copy_latency_s; };
  auto copy_seconds = [&](uint64_t h2d, uint64_t d2h) {
    const double hs = static_cast<double>(h2d) / r.h2d_bytes_per_s + moves(h2d);
    const double ds = static_cast<double>(d2h) / r.d2h_bytes_per_s + moves(d2h);
    return std::max({hs, ds, static_cast<double>(h2d + d2h) / r.both_bytes_per_s + moves(h2d + d2h) / 2});
  };
  // The disk's reads and writes of a phase are in flight together: as many bytes each way as
  // the other direction has go at the rate of both at once, the rest at its own direction's
  // rate. Without a measured rate of both, the two take turns.
  auto disk_seconds = [&](const DiskMoves& d) {
    const double rd = static_cast<double>(d.read), wr = static_cast<double>(d.write);
    if (!(r.disk_both_bytes_per_s > 0)) return rd / r.disk_read_bytes_per_s + wr / r.disk_write_bytes_per_s;
    const double both = std::min(rd, wr);
    return 2 * both / r.disk_both_bytes_per_s + (rd - both) / r.disk_read_bytes_per_s +
           (wr - both) / r.disk_write_bytes_per_s;
  };
  // The disk runs beside compute on every backend (the I/O engine's requests take no core), so
  // only what outlasts compute adds to a phase.
  auto phase = [&](double flops, uint64_t h2d, uint64_t d2h, uint64_t first_h2d, const DiskMoves& disk) {
    PhaseTime t;
    t.compute_s = flops / r.compute_flops;
    t.h2d_s = static_cast<double>(h2d) / r.h2d_bytes_per_s + moves(h2d);
    t.d2h_s = static_cast<double>(d2h) / r.d2h_bytes_per_s + moves(d2h);
    t.copy_s = copy_seconds(h2d, d2h);
    t.disk_s = disk_seconds(disk);
    const double fill = std::min(t.copy_s, static_cast<double>(first_h2d) / r.h2d_bytes_per_s);
    t.exposed_s = std::max(t.copy_s - ov * std::min(t.copy_s - fill, t.compute_s), t.disk_s - t.compute_s);
    return t;
  };
  StepPhases& ph = p.phases;
  ph.micro_batches = static_cast<int64_t>(accum);
  const double recompute_layers = in.recompute ? std::max(0.0, Ld - 1) : 0.0;
  double forward_flops = Ld * in.layer_forward_flops + (1 + in.backward_factor) * in.head_forward_flops;
  double backward_flops = (in.backward_factor * Ld + recompute_layers) * in.layer_forward_flops;
  if (forward_flops + backward_flops == 0) {  // only the step's total given: a third forward
    forward_flops = in.flops_per_step / static_cast<double>(accum) / 3;
    backward_flops = 2 * forward_flops;
  }
  ph.forward = phase(forward_flops, tr.fwd_h2d, tr.fwd_d2h, tr.first_layer_h2d, tr.fwd_disk);
  ph.backward = phase(backward_flops, tr.bwd_h2d, tr.bwd_d2h,
                      tr.first_layer_h2d + (p.offload_activations ? in.saved_activation_bytes_per_layer : 0), tr.bwd_disk);
  // Zeroing writes every gradient and the norm reads it, with their copies; with the optimizer
  // overlapped the norm is taken group by group inside it.
  const double passes = in.overlap_optimizer ? 1.0 : 2.0;
  ph.grad_passes_s = passes * static_cast<double>(tr.grad_total) / r.device_memory_bytes_per_s +
                     (1 - ov) * (static_cast<double>(tr.pass_h2d) / r.h2d_bytes_per_s + moves(tr.pass_h2d) +
                                 static_cast<double>(tr.pass_d2h) / r.d2h_bytes_per_s + moves(tr.pass_d2h)) +
                     ov * copy_seconds(tr.pass_h2d, tr.pass_d2h) + disk_seconds(tr.pass_disk);
  // AdamW on the device for the device groups; on the CPU for the others, whose nvme reads and
  // writes and copies to and from the device the CPU cannot overlap with its own AdamW on the
  // CPU backend (ov 0), and can with a GPU's copy engines (ov 1).
  uint64_t device_adam_elements = 0;
  for (int64_t g = 0; g < s.groups; ++g)
    if (h.opt_dev[g]) device_adam_elements += s.updated(trained_elements(in, g == s.L));
  p.cpu_adam_s = static_cast<double>(p.cpu_adam_elements) / r.cpu_adam_params_per_s;
  // The step's disk time: its phases', each its reads and writes together.
  p.disk_s = static_cast<double>(accum) * (disk_seconds(tr.fwd_disk) + disk_seconds(tr.bwd_disk)) +
             disk_seconds(tr.pass_disk) + disk_seconds(tr.opt_disk);
  const double opt_copies = copy_seconds(tr.opt_h2d, tr.opt_d2h);
  const double device_adam_s = static_cast<double>(device_adam_elements) / r.device_adam_params_per_s;
  ph.optimizer_s = device_adam_s + disk_seconds(tr.opt_disk) + std::max(p.cpu_adam_s, opt_copies) + (1 - ov) * std::min(p.cpu_adam_s, opt_copies);
  // Overlapped with backward, each group's update runs beside the backward of the layers below
  // it, all but the last group's (the embedding) — on cores of their own only where copies and
  // compute do not share them.
  if (in.overlap_optimizer && s.groups > 0)
    ph.optimizer_hidden_s = ov * std::min(ph.optimizer_s * Ld / static_cast<double>(s.groups), ph.backward.total_s());

  const double mb = static_cast<double>(accum);
  p.compute_s = mb * (ph.forward.compute_s + ph.backward.compute_s);
  p.h2d_s = static_cast<double>(p.h2d_bytes) / r.h2d_bytes_per_s;
  p.d2h_s = static_cast<double>(p.d2h_bytes) / r.d2h_bytes_per_s;
  p.exposed_transfer_s = mb * (ph.forward.exposed_s + ph.backward.exposed_s);
  p.optimizer_tail_s = ph.optimizer_s - ph.optimizer_hidden_s;
  p.step_s = ph.step_s();
}

// Step 6: collectives between the ranks, bytes each rank sends per step, as ring algorithms do:
// an all-reduce of B bytes sends 2(W-1)/W x B (a reduce-scatter, then an all-gather), a
// reduce-scatter or an all-gather (W-1)/W x B. G is every gradient's bytes, P the compute
// copy's, without chunk padding.
//   ZeRO-0: the accumulated gradients all-reduced once per step, 2(W-1)/W x G.
//   ZeRO-1: the accumulated gradients reduced once per step onto the rank that owns them,
//     (W-1)/W x G (strata train reduces each rank's range of every tensor onto it: every other
//     rank sends it the range once), then the compute copy each rank updated gathered, (W-1)/W x P.
//   ZeRO-2: each micro-batch's gradients reduce-scattered onto their shards (a rank keeps
//     only its shard, so the accumulation happens there), grad_accum x (W-1)/W x G, plus the
//     all-gather of the updated compute copy.
//   ZeRO-3: the parameters all-gathered for the forward and again for the backward of every
//     micro-batch, 2 x grad_accum x (W-1)/W x P, plus ZeRO-2's gradient reduce-scatter; the
//     updated shards need no gather. Overlapped, the last layer keeps its weights from its
//     forward to its backward when only an untied head's batch comes between.
// Time: those bytes over the bus bandwidth of the slowest link the ring crosses, the node's
// when the world fits in one node and the network's otherwise (no hierarchical estimate).
// What adds to the step is what strata train waits for. The sums at handover (ZeRO-0 and 1 with
// parallel.overlap_comm, the optimizer not overlapped) run on a thread of their own as the last
// micro-batch's backward hands each group over: all but the last group's (the embedding's,
// handed over as backward ends) hide behind the rest of that backward, as far as its compute
// time reaches. ZeRO-2 and 3 with parallel.overlap_comm queue their gathers and sums on a
// communication stream: a group's gather runs while the group before it computes, its sums
// while the group after it runs backward. All but the embedding's first gather of each
// micro-batch and its sums in the last hide, as far as the micro-batches' compute reaches
// (backward's for ZeRO-2's sums, forward's and backward's for ZeRO-3). The updated copy's
// gathers after the optimizer (ZeRO-1 and 2) go on that stream too, each while the next groups
// update: all but the last group's hide behind the optimizer (on cuda, only the groups updated
// in device memory). Without overlap every collective adds in full.
// The embedding's share of the parameters: of the edge, the store's chunks when known, else half.
double embedding_share(const PlanInput& in, int64_t L) {
  const double embed = in.edge_chunks > 0 && in.embed_chunks > 0
                           ? static_cast<double>(in.embed_chunks) / static_cast<double>(in.edge_chunks)
                           : 0.5;
  const double all = static_cast<double>(L) * static_cast<double>(in.layer_elements) +
                     static_cast<double>(in.edge_elements);
  return all > 0 ? embed * static_cast<double>(in.edge_elements) / all : 0;
}

void plan_comm(const PlanInput& in, const LevelSizes& s, Plan& p) {
  const int64_t W = s.W, L = s.L;
  const int zero = s.zero;
  if (W <= 1) return;
  const uint64_t accum = static_cast<uint64_t>(std::max<int64_t>(1, in.grad_accum));
  const uint64_t w = static_cast<uint64_t>(W);
  const MachineRates& r = in.rates;
  // Expert parallelism in groups of E: a rank's experts' state is summed and gathered over the
  // W / E ranks holding the same experts (the experts' share of every rank's bytes is 1/E of
  // all experts'), the rest over all W.
  const uint64_t experts_p = static_cast<uint64_t>(std::max<int64_t>(in.expert_ranks, 1));
  const uint64_t expert_elements = experts_p > 1 ? static_cast<uint64_t>(L) * in.expert_elements : 0;
  const uint64_t trained = static_cast<uint64_t>(L) * trained_elements(in, false) + trained_elements(in, true);
  // With LoRA the adapters on the experts, held with their experts, are the experts' trained
  // elements; otherwise the experts themselves.
  const uint64_t expert_adapters =
      experts_p > 1 && !in.experts_trained ? static_cast<uint64_t>(L) * in.expert_adapter_elements : 0;
  const uint64_t trained_experts = in.experts_trained ? expert_elements : expert_adapters;
  const uint64_t G = (trained - std::min(trained, trained_experts)) * in.grad_bytes;
  const uint64_t G_experts = trained_experts / experts_p * in.grad_bytes;
  // The weights gathered at ZeRO-3: the experts' (and their adapters') over their holders, the
  // rest over every rank.
  const uint64_t P = bytes_of(static_cast<uint64_t>(L) * in.layer_elements - expert_elements - expert_adapters,
                              in.param_bytes) +
                     bytes_of(in.edge_elements, in.edge_param_bytes);
  const uint64_t P_experts = bytes_of((expert_elements + expert_adapters) / experts_p, in.param_bytes);
  auto ring_over = [](uint64_t bytes, uint64_t n) { return n <= 1 ? 0 : bytes / n * (n - 1) + bytes % n * (n - 1) / n; };
  auto ring = [&](uint64_t bytes) { return ring_over(bytes, w); };  // (W-1)/W x bytes
  const uint64_t holders = w / experts_p;
  CommBytes& c = p.comm;
  if (zero == 0) c.grad_all_reduce = 2 * (ring(G) + ring_over(G_experts, holders));
  else if (zero == 1) c.grad_reduce_scatter = ring(G) + ring_over(G_experts, holders);
  else c.grad_reduce_scatter = accum * (ring(G) + ring_over(G_experts, holders));
  // The updated copies gathered after the optimizer: the trained tensors' (LoRA's adapters alone,
  // never quantised: bf16, or fp32 without a separate master).
  const bool all_trained = in.layer_trained_share >= 1 && in.edge_trained_share >= 1;
  const uint64_t P_updated = all_trained ? P : (trained - std::min(trained, trained_experts)) * (in.separate_master ? 2 : 4);
  const uint64_t P_updated_experts =
      in.experts_trained ? P_experts : trained_experts / experts_p * (in.separate_master ? 2 : 4);
  if (zero == 1 || zero == 2) c.update_all_gather = ring(P_updated) + ring_over(P_updated_experts, holders);
  if (zero == 3) {
    c.param_all_gather = 2 * accum * (ring(P) + ring_over(P_experts, holders));
    if (!in.state_tensors.empty() && !in.micro_batch_program.empty()) {
      // What strata train gathers: each group's whole copy at every batch of the micro-batch
      // that computes with it (forward, recompute, backward; a tied embedding at the head too).
      // With expert groups, the experts this rank holds over their holders, the rest not here.
      std::vector<uint64_t> copy(static_cast<size_t>(L) + 2, 0);
      std::vector<uint64_t> expert_copy(static_cast<size_t>(L) + 2, 0);
      for (const StateTensor& t : in.state_tensors) {
        if (t.elsewhere) continue;
        const uint64_t bytes = in.state_layout.tensor_bytes(StateKind::kParam, t.shape());
        (experts_p > 1 && t.part != kDensePart ? expert_copy : copy).at(static_cast<size_t>(t.group)) += bytes;
      }
      // Overlapped, a group whose weights are still in place from its batch before needs no
      // gather (step_program.h, kept_gathers): the last layer around the head.
      const std::vector<int> order = gather_order(in.micro_batch_program);
      const std::vector<bool> kept =
          in.overlap_comm ? kept_gathers(order, p.gather_ahead) : std::vector<bool>(order.size(), false);
      // A kept layer keeps its experts' weights too (gathered with it, over their holders with
      // expert groups).
      uint64_t gathered = 0;
      for (size_t k = 0; k < order.size(); ++k) {
        const size_t g = static_cast<size_t>(order[k]);
        if (!kept[k]) gathered += ring(copy.at(g)) + ring_over(expert_copy.at(g), holders);
      }
      c.param_all_gather = accum * gathered;
    }
  }
  if (in.expert_ranks > 1) {
    const uint64_t e = static_cast<uint64_t>(in.expert_ranks);
    c.expert_all_to_all = accum * (in.expert_exchange_bytes / e * (e - 1) + in.expert_exchange_bytes % e * (e - 1) / e);
  }
  if (in.context_ranks > 1) c.ring_exchange = accum * in.ring_exchange_bytes;
  const int64_t per_node = std::clamp<int64_t>(in.ranks_per_node, 1, W);
  p.comm_bytes_per_s = W <= per_node ? r.intra_node_bytes_per_s : r.inter_node_bytes_per_s;
  p.comm_s = static_cast<double>(c.total()) / p.comm_bytes_per_s;
  if (in.overlap_comm && !in.overlap_optimizer && zero <= 1 && in.expert_ranks <= 1) {
    const double sums_s = static_cast<double>(c.grad_all_reduce + c.grad_reduce_scatter) / p.comm_bytes_per_s;
    const double last = embedding_share(in, L);
    p.comm_hidden_s = std::min(sums_s * (1 - last), p.phases.backward.compute_s);
  } else if (in.overlap_comm && !in.overlap_optimizer && zero >= 2) {
    // ZeRO-2's sums hide behind backward only; ZeRO-3's gathers behind forward too. An MoE
    // layer's experts' go with the layer's, on the communication stream.
    const double queued_s = static_cast<double>(c.grad_reduce_scatter + c.param_all_gather) / p.comm_bytes_per_s;
    const double compute_s = static_cast<double>(accum) * ((zero >= 3 ? p.phases.forward.compute_s : 0.0) +
                                                           p.phases.backward.compute_s);
    // Exposed: the embedding's sums of the step's last micro-batch (the others' run during the
    // next micro-batch's forward), and its gather as each micro-batch's forward begins (nothing
    // is gathered ahead across micro-batches), about half its gathers (forward and backward).
    const double embed = embedding_share(in, L);
    const double exposed_s = (static_cast<double>(c.grad_reduce_scatter) / static_cast<double>(accum) * embed +
                              static_cast<double>(c.param_all_gather) * embed / 2) /
                             p.comm_bytes_per_s;
    // Where the token exchanges settle the streams, an MoE layer's share of the queued work is
    // counted as exposed.
    const double moe = L > 0 && in.exchanges_settle_comm
                           ? static_cast<double>(std::clamp<int64_t>(in.moe_layers, 0, L)) / static_cast<double>(L)
                           : 0.0;
    p.comm_hidden_s = std::clamp((queued_s - exposed_s) * (1.0 - moe), 0.0, compute_s);
  }
  if (in.overlap_comm && !in.overlap_optimizer && (zero == 2 || (zero == 1 && in.expert_ranks <= 1))) {
    // The updated weights' gathers run on the communication stream while the next groups update
    // (paged_state.h, queues_copy_gathers): all but the last group's hide behind the optimizer.
    const int groups = p.placement.num_groups();
    int queued = 0;
    for (int g = 0; g < groups; ++g)
      if (!in.copy_gathers_need_device || update_tier(p.placement.home(g, StateKind::kAdamM)) == Tier::kDevice) ++queued;
    const double gather_s = static_cast<double>(c.update_all_gather) / p.comm_bytes_per_s;
    const double share = groups > 0 ? static_cast<double>(std::max(queued - 1, 0)) / static_cast<double>(groups) : 0.0;
    p.comm_hidden_s += std::min(gather_s * share, p.phases.optimizer_s);
  }
  p.comm_exposed_s = p.comm_s - p.comm_hidden_s;
  p.step_s += p.comm_exposed_s;
}

// What bounds the step: the largest of its parts.
const char* bottleneck_of(const Plan& p) {
  const double opt_cpu = p.optimizer_tail_s - std::min(p.optimizer_tail_s, p.disk_s);
  const std::pair<double, const char*> terms[] = {
      {p.compute_s, "compute"},
      {p.exposed_transfer_s, p.h2d_bytes >= p.d2h_bytes ? "PCIe host-to-device" : "PCIe device-to-host"},
      {opt_cpu, "CPU AdamW"},
      {std::min(p.optimizer_tail_s, p.disk_s), "disk"},
      {p.comm_exposed_s, "communication"}};
  double largest = -1;
  const char* bottleneck = "";
  for (const auto& term : terms)
    if (term.first > largest) largest = term.first, bottleneck = term.second;
  return bottleneck;
}

// The device's bytes of a rank's sliced kinds as the store packs them under `p.placement`
// (SlicedKinds::tier_bytes): the device's groups are chosen from the layers' even shares.
// Corrects the device's total in `p` by the difference, and returns how far it then exceeds the
// budget.
uint64_t count_sliced_on_device(const PlanInput& in, const SlicedKinds& sliced, Plan& p) {
  const Placement& placement = p.placement;
  const HomeOf home = [&placement](int g, StateKind k, int part) { return placement.home(g, k, part); };
  for (size_t i = 0; i < sliced.packings.size(); ++i) {
    const StateKind kind = sliced.packings[i].first;
    const uint64_t exact = sliced.tier_bytes(i, in.chunk_size, home)[static_cast<size_t>(Tier::kDevice)];
    uint64_t even = 0;  // what the plan counted: the device's rows (nothing of them spills)
    for (int g = 0; g < placement.num_groups(); ++g)
      if (placement.home(g, kind) == Tier::kDevice) even += placement.row(g, kind).bytes;
    uint64_t& b = bytes_of_kind(p.device, kind);
    b = b + exact >= even ? b + exact - even : 0;
  }
  if (sliced.packings.empty()) return 0;
  return p.device.total() > in.device_budget ? p.device.total() - in.device_budget : 0;
}

// The plan at one ZeRO level: the device's working set, then what is resident there, the host
// and NVMe, the placement, the traffic, the time and the collectives.
Plan plan_at_level(const PlanInput& in, int zero, SpillOrder order) {
  Plan p;
  p.zero = zero;
  p.spill_order = static_cast<int>(order);
  const LevelSizes s = level_sizes(in, zero);
  WorkingSet ws;
  uint64_t free_bytes = 0;
  if (!plan_working_set(in, s, p, &ws, &free_bytes)) return p;
  const Plan start = p;
  const std::vector<std::vector<ExpertBytes>> spill = spillable_experts(in, s.L, s.sharded);
  const SlicedKinds sliced(in, s.W, zero);
  GroupHomes homes;
  // The device's groups are chosen from each layer's even share of the sliced kinds; where the
  // store's packing of them (count_sliced_on_device) then exceeds the budget, they are chosen
  // again with that much less room. (The host's spill counts the packing as it goes.) And where
  // the replayed step finds the device's slots all taken (sliced groups acquired together pin
  // whole chunks, however few of their bytes are theirs), again with two chunks less.
  uint64_t device_reserve = 0, last_over = UINT64_MAX;
  PhaseTraffic traffic;
  for (int attempt = 0;; ++attempt) {
    p = start;
    homes = place_on_device(s, ws, free_bytes - std::min(free_bytes, device_reserve), p);
    if (!place_on_host_and_nvme(in, s, spill, sliced, order, homes, p)) return p;
    p.placement = make_placement(in, s.L, s.layer, s.edge, homes, spill, zero);
    if (p.nvme_activation_chunks > 0) {
      const uint64_t all = StateStore::activation_chunks(in.offloaded_activations, in.saved_activation_bytes_per_layer,
                                                         in.chunk_size);
      p.placement.set_activation_host_chunks(static_cast<int64_t>(all) - p.nvme_activation_chunks);
    }
    const uint64_t over = count_sliced_on_device(in, sliced, p);
    if (over > 0) {
      if (attempt == kPlacementAttempts) {
        p.problem = fmt::format("the device budget {} cannot hold the {} this plan keeps there",
                                format_bytes(in.device_budget), format_bytes(p.device.total()));
        p.suggestions.push_back(fmt::format("raise memory.device to at least {}", format_bytes(p.device.total())));
        return p;
      }
      // Room that moved no group off the device: take a layer's worth more; the last try none.
      device_reserve += over < last_over ? over : over + s.layer.param + s.layer.grad + s.layer.optimizer();
      if (attempt + 1 == kPlacementAttempts) device_reserve = free_bytes;
      last_over = over;
      continue;
    }
    p.fits = true;
    // The device's room left beside what the plan keeps there takes more groups gathered ahead
    // (their workspace counted with the activations), before the traffic is replayed on the
    // device tier that then remains.
    if (s.W > 1 && zero >= 3 && in.overlap_comm && in.param_ahead_bytes > 0) {
      const uint64_t left = in.device_budget > p.device.total() ? in.device_budget - p.device.total() : 0;
      const uint64_t more = std::min<uint64_t>(kMaxGatherAhead - 1, left / in.param_ahead_bytes);
      p.gather_ahead = 1 + static_cast<int>(more);
      p.device.act += more * in.param_ahead_bytes;
      p.device_chunk_bytes -= more * in.param_ahead_bytes;
    }
    bool device_short = false;
    traffic = plan_traffic(in, s, homes, p, &device_short);
    if (p.fits) break;
    if (!device_short || sliced.packings.empty() || attempt == kPlacementAttempts || device_reserve >= free_bytes)
      return p;
    // The last try keeps no group on the device: it fits whenever the working set does.
    device_reserve = attempt + 1 == kPlacementAttempts ? free_bytes : device_reserve + 2 * in.chunk_size;
  }
  plan_time(in, s, homes, traffic, p);
  plan_comm(in, s, p);
  p.bottleneck = bottleneck_of(p);
  return p;
}

// The placement at one ZeRO level in `order`, or without one the fastest predicted step of the
// orders where anything spills to NVMe.
Plan plan_at_level(const PlanInput& in, int zero, std::optional<SpillOrder> order) {
  if (order) return plan_at_level(in, zero, *order);
  Plan best = plan_at_level(in, zero, SpillOrder::kOptimizerFirst);
  if (in.nvme_budget == 0 || !best.fits || best.nvme.total() == 0) return best;
  for (SpillOrder other : {SpillOrder::kCopiesFirst, SpillOrder::kStreamsFirst}) {
    Plan p = plan_at_level(in, zero, other);
    if (p.fits && p.step_s < best.step_s) best = std::move(p);
  }
  return best;
}

Plan plan_levels(const PlanInput& in, std::optional<SpillOrder> order) {
  CHECK(in.zero >= kZeroAuto && in.zero < kZeroLevels);
  if (in.world_size <= 1) return plan_at_level(in, 0, order);  // one rank: nothing to shard
  if (in.zero != kZeroAuto) return plan_at_level(in, in.zero, order);
  // The fastest level that fits: with every kind able to stream from nvme a lower level may fit
  // only by paging what a higher one shards away, and at a fraction of its speed.
  Plan best;
  // Expert groups shard the experts' optimizer state over their holders: ZeRO-1 and up.
  for (int z = in.expert_ranks > 1 ? 1 : 0; z < kZeroLevels; ++z) {
    Plan p = plan_at_level(in, z, order);
    if (p.fits && (!best.fits || p.step_s < best.step_s)) best = std::move(p);
    if (!best.fits && z + 1 == kZeroLevels) best = std::move(p);  // none fits: ZeRO-3's problem
  }
  return best;
}

}  // namespace

Plan make_plan(const PlanInput& in) { return plan_levels(in, std::nullopt); }

bool plan_fits(const PlanInput& in) {
  // As plan_levels and plan_at_level decide: the optimizer-first order fits wherever the
  // placement make_plan returns does, and a level fits if any does.
  CHECK(in.zero >= kZeroAuto && in.zero < kZeroLevels);
  if (in.world_size <= 1) return plan_at_level(in, 0, SpillOrder::kOptimizerFirst).fits;
  if (in.zero != kZeroAuto) return plan_at_level(in, in.zero, SpillOrder::kOptimizerFirst).fits;
  for (int z = in.expert_ranks > 1 ? 1 : 0; z < kZeroLevels; ++z)
    if (plan_at_level(in, z, SpillOrder::kOptimizerFirst).fits) return true;
  return false;
}

Plan make_plan(const PlanInput& in, SpillOrder order) { return plan_levels(in, order); }

double micro_batch_flops(const PlanInput& in) {
  const double L = static_cast<double>(in.num_layers);
  const double recompute_layers = in.recompute ? std::max(0.0, L - 1) : 0.0;
  return ((1 + in.backward_factor) * L + recompute_layers) * in.layer_forward_flops +
         (1 + in.backward_factor) * in.head_forward_flops + in.tile_recompute_flops;
}

std::string format_plan(const PlanInput& in, const Plan& p) {
  std::ostringstream os;
  auto row = [&](const char* tier, const KindBytes& k, uint64_t budget) {
    os << fmt::format("  {:<7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} | {:>11} of {}\n", tier,
                      format_bytes(k.param), format_bytes(k.grad), format_bytes(k.master), format_bytes(k.adam_m),
                      format_bytes(k.adam_v), format_bytes(k.act), format_bytes(k.total()),
                      budget ? format_bytes(budget) : std::string("-"));
  };
  if (!p.fits) {
    os << "does not fit: " << p.problem << "\n";
    for (const auto& s : p.suggestions) os << "  - " << s << "\n";
    return os.str();
  }
  os << fmt::format("  {:<7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} | {:>11}\n", "tier", "param", "grad", "master",
                    "adam_m", "adam_v", "act", "total");
  row("device", p.device, in.device_budget);
  row("host", p.host, in.host_budget);
  row("nvme", p.nvme, in.nvme_budget);
  const int64_t groups = in.num_layers + 1;
  os << fmt::format("  resident on the device: parameters {}/{} groups, gradients {}/{}, optimizer {}/{}; "
                    "activations {}\n",
                    p.resident_param_groups, groups, p.resident_grad_groups, groups, p.device_optimizer_groups, groups,
                    !p.offload_activations        ? "kept on the device"
                    : p.nvme_activation_chunks > 0 ? "offloaded to host, the last layers' to nvme"
                                                   : "offloaded to host");
  if (p.nvme_optimizer_groups > 0 || p.nvme_optimizer_experts > 0)
    os << fmt::format("  optimizer state of {}/{} groups{} streams from nvme\n", p.nvme_optimizer_groups, groups,
                      p.nvme_optimizer_experts > 0
                          ? fmt::format(" and of {} experts of another layer", p.nvme_optimizer_experts)
                          : std::string());
  if (p.nvme_param_groups > 0 || p.nvme_grad_groups > 0)
    os << fmt::format("  compute copies of {}/{} groups and gradients of {}/{} stream from nvme\n", p.nvme_param_groups,
                      groups, p.nvme_grad_groups, groups);
  if (p.nvme.total() > 0) {
    static constexpr const char* kOrders[] = {"the optimizer state, then compute copies, then gradients",
                                              "compute copies, then the optimizer state, then gradients",
                                              "compute copies, then gradients, then the optimizer state"};
    os << fmt::format("  spilled to nvme in the order with the fastest predicted step: {}\n",
                      kOrders[std::clamp(p.spill_order, 0, 2)]);
  }
  if (const bool given = !in.expert_fetch_by_group.empty(); in.expert_elements > 0)
    os << fmt::format("  experts: a micro-batch reaches {}{:.0f}% of each MoE layer's experts{}; only those are "
                      "fetched\n",
                      given ? "" : "an expected ", 100 * std::clamp(in.expert_fetch_fraction, 0.0, 1.0),
                      given ? " on average (plan.experts_reached)" : " with balanced routing");
  os << fmt::format("  per step: host->device {}, device->host {}, disk read {}, write {}, CPU AdamW {:.3g}M params\n",
                    format_bytes(p.h2d_bytes), format_bytes(p.d2h_bytes), format_bytes(p.disk_read_bytes),
                    format_bytes(p.disk_write_bytes), p.cpu_adam_elements / 1e6);
  os << fmt::format("  predicted step {}: compute {}, copies not hidden {}, optimizer after backward {}; bound by {}\n",
                    format_seconds(p.step_s), format_seconds(p.compute_s), format_seconds(p.exposed_transfer_s),
                    format_seconds(p.optimizer_tail_s), p.bottleneck);
  const StepPhases& ph = p.phases;
  auto phase_row = [&](const char* name, const PhaseTime& t) {
    os << fmt::format("    {:<30} {:>10} = compute {} + stall {} (copies {}: h2d {}, d2h {})\n", name,
                      format_seconds(t.total_s()), format_seconds(t.compute_s), format_seconds(t.exposed_s),
                      format_seconds(t.copy_s), format_seconds(t.h2d_s), format_seconds(t.d2h_s));
  };
  os << fmt::format("  per phase ({} micro-batch{}):\n", ph.micro_batches, ph.micro_batches == 1 ? "" : "es");
  phase_row("forward, per micro-batch", ph.forward);
  phase_row(in.recompute ? "recompute+backward, per m-b" : "backward, per micro-batch", ph.backward);
  os << fmt::format("    {:<30} {:>10}\n", "gradient zeroing and norm", format_seconds(ph.grad_passes_s));
  os << fmt::format("    {:<30} {:>10} (CPU AdamW {}, disk {}){}\n", "optimizer", format_seconds(ph.optimizer_s),
                    format_seconds(p.cpu_adam_s), format_seconds(p.disk_s),
                    ph.optimizer_hidden_s > 0 ? fmt::format(", {} of it during backward", format_seconds(ph.optimizer_hidden_s))
                                              : std::string());
  if (in.world_size > 1) {
    const CommBytes& c = p.comm;
    os << fmt::format("  collectives per rank per step (ZeRO-{}, {} GB/s bus): gradient all-reduce {}, reduce-scatter "
                      "{}, parameter all-gather {}, updated-copy all-gather {}{}; {}, {:.0f}% hidden behind compute, {} "
                      "adds to the step\n",
                      p.zero, p.comm_bytes_per_s / 1e9, format_bytes(c.grad_all_reduce),
                      format_bytes(c.grad_reduce_scatter), format_bytes(c.param_all_gather),
                      format_bytes(c.update_all_gather),
                      (in.expert_ranks > 1 ? fmt::format(", expert all-to-all {} (groups of {})",
                                                         format_bytes(c.expert_all_to_all), in.expert_ranks)
                                           : std::string()) +
                          (in.context_ranks > 1 ? fmt::format(", ring attention {} (context groups of {})",
                                                              format_bytes(c.ring_exchange), in.context_ranks)
                                                : std::string()),
                      format_seconds(p.comm_s),
                      p.comm_s > 0 ? 100 * p.comm_hidden_s / p.comm_s : 0.0, format_seconds(p.comm_exposed_s));
    if (p.zero >= 3 && in.overlap_comm)
      os << fmt::format("  weights gathered {} group{} ahead of compute (the device's room beside the plan)\n",
                        p.gather_ahead, p.gather_ahead == 1 ? "" : "s");
  }
  if (in.tokens_per_step > 0 && p.step_s > 0) {
    if (in.world_size > 1)
      os << fmt::format("  predicted throughput {:.0f} tokens/s per rank, {:.0f} tokens/s for the {} ranks\n",
                        in.tokens_per_step / p.step_s,
                        static_cast<double>(in.world_size) * static_cast<double>(in.tokens_per_step) / p.step_s,
                        in.world_size);
    else
      os << fmt::format("  predicted throughput {:.0f} tokens/s\n", in.tokens_per_step / p.step_s);
  }
  return os.str();
}

std::string format_zero_levels(const PlanInput& in, int chosen) {
  const int64_t W = std::max<int64_t>(1, in.world_size);
  const int64_t per_node = std::clamp<int64_t>(in.ranks_per_node, 1, W);
  const bool one_node = W <= per_node;
  std::ostringstream os;
  os << fmt::format("data parallel: {} ranks, {} per node ({} node{}), ZeRO-{}{}; collectives at {:.0f} GB/s bus "
                    "bandwidth ({})\n",
                    W, per_node, (W + per_node - 1) / per_node, (W + per_node - 1) / per_node == 1 ? "" : "s", chosen,
                    in.zero == kZeroAuto ? " (auto: the fastest level that fits)" : " (as given)",
                    (one_node ? in.rates.intra_node_bytes_per_s : in.rates.inter_node_bytes_per_s) / 1e9,
                    one_node ? "within a node, hardware.intra_node_gbps" : "between nodes, hardware.inter_node_gbps");
  os << fmt::format("  {:<6} {:>11} {:>11} {:>11} {:>5} {:>11} {:>10} {:>10} {:>12}\n", "ZeRO", "device/rank",
                    "host/rank", "nvme/rank", "fits", "comm/rank", "comm", "step", "tokens/s");
  for (int z = 0; z < kZeroLevels; ++z) {
    PlanInput level = in;
    level.zero = z;
    const Plan p = make_plan(level);
    auto tier = [&](const KindBytes& k) { return p.fits ? format_bytes(k.total()) : std::string("-"); };
    os << fmt::format("  {:<6} {:>11} {:>11} {:>11} {:>5} {:>11} {:>10} {:>10} {:>12}\n",
                      fmt::format("{}{}", z, z == chosen ? "*" : ""), tier(p.device), tier(p.host), tier(p.nvme),
                      p.fits ? "yes" : "no",
                      p.fits ? format_bytes(p.comm.total()) : "-", p.fits ? format_seconds(p.comm_s) : "-",
                      p.fits ? format_seconds(p.step_s) : "-",
                      p.fits && p.step_s > 0 && in.tokens_per_step > 0
                          ? fmt::format("{:.0f}", static_cast<double>(W * in.tokens_per_step) / p.step_s)
                          : "-");
    if (!p.fits) os << "         " << p.problem << "\n";
  }
  os << "  (bytes and collectives per rank per optimizer step, ring algorithms; each rank holds its range of "
        "every tensor of the sharded kinds; strata train runs every level)\n";
  return os.str();
}

}  // namespace strata
