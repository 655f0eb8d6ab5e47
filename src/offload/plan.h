// The memory planner: given the sizes of a model's state, one micro-batch's activations, the
// tier budgets and the machine's rates, decide how many bytes of each kind of state live on
// the device, in pinned host memory and on NVMe; how many bytes cross PCIe and the disk per
// step; whether it fits at all; and, when it does not, the smallest change that would.
//
// The planner knows nothing about models: callers describe the model as L equal decoder-layer
// groups plus one "edge" group (embeddings, final norm, LM head). Placement is decided per
// group and kind, in the order that saves the most traffic per byte of device memory:
//   device: the working set (one layer's parameters plus the prefetched next, gradients being
//           produced, one layer's recompute workspace, the LM-head workspace, saved
//           activations), then the layer-boundary saved activations (else they are offloaded
//           to host), then
//           parameters (each resident group saves 2 x grad_accum transfers per step), then
//           gradients (saves a transfer per micro-batch), then optimizer states (AdamW on the
//           GPU: saves the gradient and updated-parameter transfers entirely).
//   host:   everything not on the device that the CPU AdamW and the transfers need, filled in
//           the order param copies, gradients, master weights, Adam m, Adam v.
//   nvme:   what the host cannot hold, whole groups from the last: optimizer states first, then
//           the compute copies and the gradients that stream through host slots.
// With several data-parallel ranks the plan is one rank's: ZeRO (parallel.zero) shards kinds of
// state over the ranks, which then count 1/world of their bytes on each, the placement above
// runs on those per-rank sizes, and the collectives' bytes and time join the step.
// Pure computation; thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "offload/placement.h"
#include "offload/step_program.h"

namespace strata {

// Bytes per kind of state.
struct KindBytes {
  uint64_t param = 0;   // compute copy (bf16 on GPUs, fp32 on the CPU backend)
  uint64_t grad = 0;
  uint64_t master = 0;  // fp32 master weights (0 when the compute copy is the master)
  uint64_t adam_m = 0;
  uint64_t adam_v = 0;
  uint64_t act = 0;     // saved activations and workspaces
  uint64_t total() const { return param + grad + master + adam_m + adam_v + act; }
  KindBytes& operator+=(const KindBytes& o);
};

// The machine's rates: defaults are the H200 box of DESIGN §2; `strata bench machine` measures
// them (train/machine_bench.h) and writes them as hardware.* keys.
struct MachineRates {
  double compute_flops = 781e12;      // what the backend's ops reach on the model's shapes
  double h2d_bytes_per_s = 55e9;      // pinned host -> device
  double d2h_bytes_per_s = 55e9;      // device -> pinned host
  double both_bytes_per_s = 87e9;     // both directions at once, the two together
  double copy_latency_s = 10e-6;      // each chunk move's own cost beyond its bytes
  // Share of copy time that can run beside compute: 1 with a GPU's copy engines; on the CPU
  // backend copies are memcpys on stream threads that take the cores compute uses (near 0).
  double copy_overlap = 1.0;
  double disk_read_bytes_per_s = 1.7e9;
  double disk_write_bytes_per_s = 1.7e9;
  // Reads and writes at once, the two together; 0: unknown (they take turns).
  double disk_both_bytes_per_s = 0;
  double cpu_adam_params_per_s = 3.66e9;      // SIMD AdamW on host memory, all cores
  double device_adam_params_per_s = 150e9;    // AdamW on the device tier (HBM / 28 B)
  double device_memory_bytes_per_s = 4.2e12;  // read + write, for the passes over the gradients
  // Collectives' bus bandwidth per GPU (NCCL's "busbw": a ring all-reduce of B bytes takes
  // 2(W-1)/W x B / busbw): within a node (NVLink-class; PCIe-only boxes reach ~20e9) and
  // between nodes (a 200 Gb/s NIC per GPU).
  double intra_node_bytes_per_s = 150e9;
  double inter_node_bytes_per_s = 25e9;
};

// What ZeRO shards over the data-parallel ranks, by level: 0 nothing (every rank holds
// everything; what the engine implements today), 1 the master weights and Adam moments, 2 also
// the gradients, 3 also the compute copy. kZeroAuto plans the fastest level that fits.
constexpr int kZeroAuto = -1;
constexpr int kZeroLevels = 4;

struct PlanInput {
  // Model state, as L identical layer groups plus the edge group.
  int64_t num_layers = 0;
  // The layers with layer checkpoints (saved activations), when fewer than num_layers: a model's
  // multi-token prediction blocks are planned as layers but save none. -1: num_layers.
  int64_t checkpoint_layers = -1;
  uint64_t layer_elements = 0;  // parameters per decoder layer
  uint64_t edge_elements = 0;   // embeddings + untied LM head + final norm
  // MoE: the routed experts' parameters per layer (averaged over the L layers; part of
  // layer_elements) and the expected fraction of them that one micro-batch's tokens reach. A
  // streamed layer fetches only those experts and produces only their gradients.
  uint64_t expert_elements = 0;
  int64_t moe_layers = 0;  // layers with routed experts (the rest are dense)
  double expert_fetch_fraction = 1.0;
  // Given (plan.experts_reached): per group, the share of its experts a micro-batch reaches (0
  // for groups without experts), with expert_fetch_fraction their mean over the MoE layers. Empty:
  // expert_fetch_fraction, uniform routing's expectation, for every MoE layer.
  std::vector<double> expert_fetch_by_group;
  // Bytes per element of the compute copy in a layer group and in the edge group (they differ in
  // the fp8 recipe: E4M3 matrices with their scales in the layers, bf16 embeddings), and of each
  // Adam moment (4 fp32, 2 bf16, a little over 1 int8).
  double param_bytes = 2;
  double edge_param_bytes = 2;
  double moment_bytes = 4;
  uint32_t grad_bytes = 4;
  bool separate_master = true;  // false on the CPU backend: the fp32 compute copy is the master
  // Of a layer group's and of the edge group's elements, the share that is trained (has
  // gradients, a master and moments): 1 but with LoRA (its adapters; the edge none), whose frozen
  // tensors hold their compute copy alone.
  double layer_trained_share = 1;
  double edge_trained_share = 1;
  // A backward's FLOPs per forward FLOP: 2 (the data and the weight gradients), 1 with LoRA (the
  // frozen weights take no gradient; the adapters' own small GEMMs are not counted).
  double backward_factor = 2;
  // The optimizer's kinds of the layers pack on from chunk to chunk, as the store packs small
  // groups (StateStore::packs_small_group: LoRA's adapters): they are counted in bytes, and
  // per tier as the store packs them, not as a chunk per layer.
  bool optimizer_packs_small = false;
  // Whether the routed experts' weights are trained (not with LoRA, where adapters on the experts,
  // when targeted, are trained instead: expert_adapter_elements of the layer's trained elements,
  // per layer as expert_elements; with expert groups their sums and gathers run over the experts'
  // holders, as the experts' own would).
  bool experts_trained = true;
  uint64_t expert_adapter_elements = 0;
  // Activations of one micro-batch.
  uint64_t saved_activation_bytes_per_layer = 0;  // the activation saved at a layer boundary
  uint64_t layer_workspace_bytes = 0;       // one layer's recomputation and backward scratch
  uint64_t head_workspace_bytes = 0;        // chunked LM head + cross-entropy
  uint64_t kept_activation_bytes = 0;       // every layer's intermediates kept (no recompute)
  // Work per optimizer step.
  int64_t grad_accum = 1;
  int64_t tokens_per_step = 0;
  double flops_per_step = 0;  // including recomputation
  // Work of one micro-batch, for the per-phase time model: the forward FLOPs of one decoder
  // layer (the experts a token reaches, not all of them) and of the head (final norm, LM head,
  // cross-entropy). Backward costs twice a forward; recompute adds one forward of every layer
  // but the last (whose intermediates are still in the scratch).
  double layer_forward_flops = 0;
  double head_forward_flops = 0;
  // Per micro-batch, what MLP tiles compute more than the untiled MLP (train/planning.cpp; less
  // where a tiled dense MLP skips the recompute pass: negative then).
  double tile_recompute_flops = 0;
  bool recompute = true;           // false with memory.keep_activations
  bool overlap_optimizer = false;  // AdamW starts on each group as backward finishes with it
  // With several ranks: each group's gradient sums start as backward finishes with it
  // (OptimizerProgram::reduces_at_handover).
  bool overlap_comm = false;
  // ZeRO-2 and up over several ranks: the device buffer backward writes full gradients into
  // before they are summed onto the ranks' slices (PagedState::gradient_working_bytes); 0: two
  // layers' (or the edge's and a layer's) gradients.
  uint64_t gradient_working_bytes = 0;
  // ZeRO-3: the device buffer a batch's groups' compute copies are gathered into
  // (PagedState::param_working_bytes); 0: two layers' (or the edge's and a layer's). With
  // overlap_comm it has room for one group gathered ahead; param_ahead_bytes is the room for each
  // more (the largest group's copy).
  uint64_t param_working_bytes = 0;
  uint64_t param_ahead_bytes = 0;
  // Budgets; 0 nvme bytes means no nvme tier.
  uint64_t device_budget = 0;
  uint64_t host_budget = 0;
  uint64_t nvme_budget = 0;
  uint64_t chunk_size = 64ull << 20;
  // Chunks of one fp32 kind a layer group (the average over the layers, rounded up) and the
  // edge groups take, as the store packs them, and the same for the compute copy (param_bytes
  // per element; equal to the former when that is 4): when set, group sizes are these times
  // chunk_size, which counts the padding; 0: the bytes rounded up to whole chunks.
  uint64_t layer_chunks = 0;
  uint64_t edge_chunks = 0;
  uint64_t layer_param_chunks = 0;
  uint64_t edge_param_chunks = 0;
  // The same for each Adam moment when it is not fp32 (0: as the fp32 kinds).
  uint64_t layer_moment_chunks = 0;
  uint64_t edge_moment_chunks = 0;
  // Of the edge's chunks, those of the embedding (the rest are the head's), in fp32 and in the
  // compute copy; 0: half each. The traffic model replays the schedule on the two apart.
  uint64_t embed_chunks = 0;
  uint64_t embed_param_chunks = 0;
  uint64_t embed_moment_chunks = 0;
  // The bytes of one fp32 kind a layer group (the average over the layers) and the edge
  // groups take, and their moment variants, for the master weights and moments of data-parallel
  // rank `rank` under ZeRO-1 and up (and its gradients from ZeRO-2), packed from its slices of
  // every tensor (placement.h's tensor_shard) as the store packs them: the groups' slices share
  // chunks (state_store.h, "Slices"), so each group counts the chunks it opens, whole, and the
  // sum over the groups is the store's when every group is homed alike (the planner then counts
  // the homes it chooses exactly, from sliced_share_tensors). 0: 1/world_size of the whole.
  uint64_t layer_sliced_bytes = 0, edge_sliced_bytes = 0, embed_sliced_bytes = 0;
  uint64_t layer_sliced_moment_bytes = 0, edge_sliced_moment_bytes = 0, embed_sliced_moment_bytes = 0;
  // The same of the compute copy (ZeRO-3).
  uint64_t layer_sliced_param_bytes = 0, edge_sliced_param_bytes = 0, embed_sliced_param_bytes = 0;
  // MoE: per layer (the store's groups 1..L), each expert's chunks of the optimizer's kinds as
  // the store packs them, whole and (sliced) as the largest share of any rank packs its slices.
  // A layer is left empty when some expert of it shares a chunk with another part (its chunks
  // could not move alone). The planner spills an MoE layer's optimizer state to NVMe expert by
  // expert from these.
  struct ExpertChunks {
    int part = 0;
    uint64_t master = 0, adam_m = 0, adam_v = 0;
  };
  std::vector<std::vector<ExpertChunks>> expert_chunks, expert_sliced_chunks;
  // Chunks host memory holds at once while the weights load (initialisation, a model file, a
  // checkpoint), update slice by update slice: one of the fp32 kind being written, and with a
  // separate master one of the compute copy beside it (written from the master). The host tier
  // must have that many slots.
  uint64_t largest_group_load_chunks = 0;
  std::string offload_activations = "auto";  // auto | true | false
  // The model's accesses in one micro-batch, as its code makes them (model/recording_access.h
  // records them), with its saved activations kept on the device and offloaded; and the state
  // store the engine builds: its tensors as it registers them and the layout of their kinds.
  // With a chunk size and these, the traffic is one step of the step program replayed on that
  // store (offload/replay.h); without, every streamed group is counted as moved at every use.
  std::vector<ProgramEvent> micro_batch_program;
  std::vector<ProgramEvent> micro_batch_program_offloaded;
  // With several ranks, each with the slice rank `rank` holds of a sliced kind (StateTensor::slice).
  std::vector<StateTensor> state_tensors;
  // The same with the slices of the rank holding the most of the sliced kinds (the last holds
  // the largest part of every tensor split evenly, while tensors of fewer shard units than ranks
  // spread over the ranks; in the fp8 recipe whichever owns the most whole matrices): the
  // planner counts them to choose the homes, so that every rank homes each group alike
  // (their collectives on a group then move the same kind of memory). Empty: state_tensors.
  std::vector<StateTensor> sliced_share_tensors;
  StateLayout state_layout;
  int offloaded_activations = 0;  // saved-activation buffers in the store when offloaded
  size_t lookahead = 2;           // the store's prefetch window (StateStoreOptions::lookahead)
  // Data parallelism: ranks in all, ranks sharing a node (capped at world_size), ZeRO level.
  // The budgets above are each rank's; the work per step above is each rank's micro-batches.
  int64_t world_size = 1;
  int64_t rank = 0;  // the rank planned (the others' shares differ by a few padded chunks)
  int64_t ranks_per_node = 8;
  int zero = kZeroAuto;
  // Expert parallelism: ranks per expert group (1: none), and the bytes of the routed rows one
  // micro-batch's MoE layers exchange in all (a layer's N x K rows of C activations, sent out
  // and back in forward, in a recompute, and in backward), before the share that stays on the
  // rank.
  int64_t expert_ranks = 1;
  uint64_t expert_exchange_bytes = 0;
  // Context parallelism: ranks per context group (1: none), and the bytes one micro-batch's ring
  // attention sends from a rank in all (keys and values N - 1 times a layer in forward, in a
  // recompute and in backward; their fp32 gradient sums N times a layer in backward).
  int64_t context_ranks = 1;
  uint64_t ring_exchange_bytes = 0;
  // Expert groups on cuda: an MoE layer's token exchanges on the compute stream first wait for
  // the communication stream's work, which then waits for them (NCCL's kernels of two
  // communicators must not interleave differently on different GPUs), so the queued
  // collectives do not run beside MoE layers. On the CPU backend Gloo's exchanges run apart.
  bool exchanges_settle_comm = false;
  // On cuda the updated weights' gathers of ZeRO-1 and 2 overlap the optimizer only for groups
  // updated in device memory (NCCL moves device memory); on the CPU backend for every group.
  bool copy_gathers_need_device = false;
  MachineRates rates;
};

// Bytes one rank sends per optimizer step, by collective (ring algorithms; see make_plan).
struct CommBytes {
  uint64_t grad_all_reduce = 0;      // ZeRO-0: every gradient, once per step
  uint64_t grad_reduce_scatter = 0;  // ZeRO-1: once per step; ZeRO-2/3: each micro-batch's, onto their shards
  uint64_t param_all_gather = 0;     // ZeRO-3: the compute copy for forward and for backward
  uint64_t update_all_gather = 0;    // ZeRO-1/2: the updated compute copy after the optimizer
  // Expert parallelism: routed rows to their experts' ranks and back, with even routing (each
  // rank keeps 1/P of its rows); on the critical path, never hidden.
  uint64_t expert_all_to_all = 0;
  // Context parallelism: ring attention's exchanges, counted on the critical path (the planner
  // does not yet credit the keys' overlap with the blocks).
  uint64_t ring_exchange = 0;
  uint64_t total() const {
    return grad_all_reduce + grad_reduce_scatter + param_all_gather + update_all_gather + expert_all_to_all +
           ring_exchange;
  }
};

// Predicted seconds of one phase of a step: its compute, the copy time its transfers take,
// and of that what compute cannot hide (the stall the engine reports).
struct PhaseTime {
  double compute_s = 0;
  double h2d_s = 0, d2h_s = 0;  // each direction alone
  double copy_s = 0;            // both directions, on two copy streams, as they share the link
  double disk_s = 0;            // the nvme tier's reads and writes
  double exposed_s = 0;         // copy or disk time not hidden behind compute
  double total_s() const { return compute_s + exposed_s; }
};

// The step as the engine schedules it: grad_accum x (forward, backward), then the passes over
// every gradient (zeroing before the step, the norm after backward), then the optimizer.
struct StepPhases {
  int64_t micro_batches = 1;
  PhaseTime forward;   // one micro-batch: embedding, the layers, the head's forward and backward
  PhaseTime backward;  // one micro-batch: recompute and backward of the layers
  double grad_passes_s = 0;   // zeroing and the norm over every gradient, with their copies
  double optimizer_s = 0;     // AdamW on the device and on the CPU, the nvme reads and writes,
                              // the updated parameters' and final gradients' copies
  double optimizer_hidden_s = 0;  // of it, what ran during backward (optim.overlap_backward)
  double step_s() const {
    return static_cast<double>(micro_batches) * (forward.total_s() + backward.total_s()) + grad_passes_s +
           optimizer_s - optimizer_hidden_s;
  }
};

struct Plan {
  bool fits = false;
  std::string problem;                   // why it does not fit (empty when it does)
  std::vector<std::string> suggestions;  // smallest changes that would make it fit
  KindBytes device, host, nvme;          // steady-state bytes per tier
  uint64_t device_working_set = 0;       // the part of `device` that is transient
  uint64_t min_device_budget = 0;        // the smallest device budget this micro-batch can run in
  // What the device budget leaves the chunk space beside the activations: the engine's device
  // tier, and the one the traffic replay runs on.
  uint64_t device_chunk_bytes = 0;
  bool offload_activations = false;
  // Where each group's state lives (placement.h), in the state store's groups: the embedding,
  // the layers, the head (the edge group's decisions apply to the first and the last). Set when
  // the plan fits; what the engine homes its chunks by. The counts below summarise it in the
  // planner's groups (num_layers + 1).
  Placement placement;
  int64_t resident_param_groups = 0;
  int64_t resident_grad_groups = 0;
  int64_t device_optimizer_groups = 0;   // groups whose AdamW runs on the device
  int64_t nvme_optimizer_groups = 0;     // groups whose optimizer state streams from NVMe
  // Experts of an MoE layer not counted above whose optimizer state streams from NVMe: the
  // planner spills a layer's experts one at a time before the rest of it, so the host keeps all
  // it has room for (placement.h part rows).
  int64_t nvme_optimizer_experts = 0;
  int64_t nvme_param_groups = 0;         // groups whose compute copy streams from NVMe
  int64_t nvme_grad_groups = 0;          // groups whose gradients stream to and from NVMe
  // Chunks of the offloaded saved activations homed on NVMe (the last layers'): when the host
  // cannot hold them beside the state however much of it spills, they go through host slots
  // (Placement::activation_host_chunks).
  int64_t nvme_activation_chunks = 0;
  int prefetch_depth = 1;
  // Traffic per optimizer step: with a chunk size, what the chunk space moves in a steady step
  // (offload/replay.h replays the step program); without, every streamed group moved at every use.
  uint64_t h2d_bytes = 0, d2h_bytes = 0, disk_read_bytes = 0, disk_write_bytes = 0;
  // With the replay: the most each tier's chunks take over the step (by Tier), the placed state
  // and working set above and the copies cached in the slots they leave free: what the engine's
  // chunk space reports as its tiers' peaks. Zero without the replay.
  std::array<uint64_t, kNumTiers> chunk_peak_bytes{};
  uint64_t cpu_adam_elements = 0;
  // Predicted seconds per step and what bounds it. compute_s .. disk_s are each resource's
  // busy time over the step; step_s is the phase model's sum (phases), in which only what
  // cannot hide behind compute adds to compute.
  double compute_s = 0, h2d_s = 0, d2h_s = 0, cpu_adam_s = 0, disk_s = 0, step_s = 0;
  double exposed_transfer_s = 0;  // copy time of the step not hidden behind compute (stalls)
  double optimizer_tail_s = 0;    // the optimizer's time after backward
  StepPhases phases;
  std::string bottleneck;  // compute, PCIe host-to-device / device-to-host, CPU AdamW, disk or
                           // communication
  // Data parallelism (all zero for one process): the level planned (auto's choice), each
  // rank's collective bytes per step, the bus bandwidth they run at, their time, the part of it
  // hidden behind compute (the gradient sums made as backward hands each group over, ZeRO-0
  // and 1 with parallel.overlap_comm) and the rest, which adds to step_s.
  int zero = 0;
  CommBytes comm;
  double comm_bytes_per_s = 0;
  double comm_s = 0, comm_hidden_s = 0, comm_exposed_s = 0;
  // ZeRO-3 with overlap_comm: how many groups' gathers run ahead of compute. One, and as many
  // more (up to kMaxGatherAhead) as the device has room for beside what the plan keeps there
  // (counted in device.act, taken from device_chunk_bytes): a late gather then delays compute
  // less. The ranks run the fewest any of them plans (their collectives pair up in order).
  int gather_ahead = 1;
  // Where state spills to NVMe: the spill order this placement was made in (make_plan keeps the
  // fastest predicted step of them).
  int spill_order = 0;  // a SpillOrder
};

inline constexpr int kMaxGatherAhead = 4;

// FLOPs of one micro-batch's forward and backward (with recompute when in.recompute).
double micro_batch_flops(const PlanInput& in);

// The order in which state spills to NVMe when the host cannot hold it: the optimizer state (read
// and written once a step), the compute copies that stream to the device from the host (read at
// every use), the gradients that stream back (written at every micro-batch). kOptimizerFirst:
// optimizer, copies, gradients; kCopiesFirst: copies, optimizer, gradients; kStreamsFirst:
// copies, gradients, optimizer. The homes of what the device keeps resident spill last in each.
enum class SpillOrder : uint8_t { kOptimizerFirst, kCopiesFirst, kStreamsFirst };

// The plan for input.zero, or with kZeroAuto for the fastest level that fits (ZeRO-3's plan,
// with its problem and suggestions, when none does). With one rank every level is level 0. At
// each level, where state spills to NVMe, the fastest predicted step of the three spill orders.
Plan make_plan(const PlanInput& input);
// The same with one spill order only (what make_plan compares).
Plan make_plan(const PlanInput& input, SpillOrder order);
// Whether make_plan(input) fits, without the plans that would only choose the fastest of those
// that fit (the other spill orders; the ZeRO levels after the first that fits). The searches for
// the largest batch, longest sequence and smallest host budget ask this at every probe.
bool plan_fits(const PlanInput& input);

// With several ranks: a table of every ZeRO level's per-rank bytes on each tier, whether it
// fits, collective bytes and time per step, step time and the world's tokens per second.
std::string format_zero_levels(const PlanInput& input, int chosen);

// A human-readable report: bytes per tier per kind, traffic, predicted time, fit or not.
std::string format_plan(const PlanInput& input, const Plan& plan);

}  // namespace strata
