// Builds the planner's input (offload/plan.h) from a model config and the training settings:
// how many bytes each kind of state and each micro-batch's activations take on the backend
// that will run them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "model/config.h"
#include "offload/plan.h"
#include "train/train_config.h"

namespace strata {

// `device` selects the backend's layout: on cuda the GPU's (bf16 compute copy, fp32 master and
// Adam states, bf16 activations); on the cpu the config's recipe (fp32 by default: no separate
// master).
PlanInput make_plan_input(const model::ModelConfig& model, const TrainConfig& train, DeviceKind device);

// Whether the ranks' collectives overlap compute at ZeRO level `zero` (parallel.overlap_comm
// where it applies): the gradient sums at handover (ZeRO 0 and 1), or ZeRO-2 and 3's gathers
// and sums on the communication stream. Not with the optimizer overlapped with backward, nor at
// ZeRO 0 and 1 with expert groups, whose experts' sums go through a Comm of their own after
// backward. The world is the launcher's, or strata plan's parallel.world_size.
inline bool overlaps_collectives(const TrainConfig& t, int zero) {
  return t.parallel_overlap_comm && std::max<int64_t>(t.dp_world, t.plan_world_size) > 1 && !t.overlap_backward &&
         (t.parallel_expert <= 1 || zero >= 2);
}

// Whether parallel.expert_parallel can split `model` over `world` ranks at ZeRO level `zero`
// (-1: auto): an MoE model whose experts it divides, a world it divides, the optimizer state
// sharded. InvalidArgument naming the key and what to change.
Status check_expert_parallel(const model::ModelConfig& model, int64_t expert_parallel, int64_t world, int zero);
// Whether parallel.context_parallel can split the sequences of `t` over `world` ranks on `backend`
// (model/context_parallel.h): a divisor of the world, train.seq_len a multiple of twice it, no
// document masks, no expert groups, the CPU backend. InvalidArgument naming the key and what to
// change.
Status check_context_parallel(const TrainConfig& t, int64_t world, DeviceKind backend);
// Multi-head latent attention (DeepSeek) where it does not run yet: on CUDA (the cuDNN graphs for
// value heads narrower than the keys are built but not verified on a GPU) and with context
// parallelism. InvalidArgument
// naming the key to change.
Status check_latent_attention(const model::ModelConfig& m, const TrainConfig& t, DeviceKind backend);
// plan.experts_reached (TrainConfig::experts_reached) against the model: one share, or one per
// MoE layer, of an MoE model.
Status check_experts_reached(const model::ModelConfig& model, const std::vector<double>& shares);

// The compute rate a plan for `device` predicts with: on the cpu backend with a rate table
// (hardware.cpu_tflops_by_width), the rate at the model's hidden size, interpolated in log
// width and log rate between the measured widths on either side and the nearest one's beyond
// them (a CPU's GEMMs speed up with their matrices, so one rate does not fit every model);
// otherwise hardware.gpu_tflops.
double planned_compute_flops(const model::ModelConfig& model, const TrainConfig& train, DeviceKind device);

// Model FLOPs per token, 6N + 12*L*H*T (DESIGN §2), without recomputation.
double model_flops_per_token(const model::ModelConfig& model, int64_t seq_len);

// memory.mlp_tile_tokens as planned: a number given is kept; auto is untiled (0) where the plan
// fits so, else the largest of mlp_tile_candidates with which it fits; 0 when none does (the
// untiled plan then says what does not fit). make_plan_input plans auto so. Under auto the tile
// depends on the budgets (a GPU's free memory when memory.device is unset), and a tiled run's
// MLP weight gradients differ from an untiled one's in the last bits (reordered sums).
int64_t planned_mlp_tile(const model::ModelConfig& model, const TrainConfig& train, DeviceKind device);
// The tiles auto tries for micro-batches of `tokens`, largest first: half the tokens rounded
// down to a multiple of 128, halving down to 128 (none below 256 tokens).
std::vector<int64_t> mlp_tile_candidates(int64_t tokens);

// The largest micro-batch (sequences) for which the plan fits, 0 when not even one does.
int64_t largest_micro_batch(const model::ModelConfig& model, TrainConfig train, DeviceKind device);
// The longest sequence (train.seq_len) for which the plan fits at train.micro_batch, up to the
// key's limit of 2^24 tokens (and 2^28 tokens per micro-batch) and the model's sliding window;
// 0 when not even one token does.
// Activations grow with it (and their tiers with them); the rest of the state does not.
int64_t longest_sequence(const model::ModelConfig& model, TrainConfig train, DeviceKind device);
// The smallest memory.host (a multiple of the chunk size, or of 1 MiB without one) with which the
// plan fits under the other budgets of `train` (nvme included), 0 when no host budget up to
// 16 TiB makes it fit. With an nvme tier every kind can stream from disk, so this is a handful of
// chunks of staging: a chunk or two of each kind in flight (update slices, state_store.h).
uint64_t smallest_host_budget(const model::ModelConfig& model, TrainConfig train, DeviceKind device);
// The most decoder layers a model of this shape (width, vocabulary, experts) can have and still
// fit the budgets of `train` in its recipe and moment format, up to the model limits' 1024;
// 0 when not even one layer fits. Planned without chunk padding (chunk sizes follow the model).
int64_t largest_layer_count(const model::ModelConfig& model, TrainConfig train, DeviceKind device);
// The recipe a plan is made for: the config's, except that cuda trains in bf16 unless fp8 was
// asked for by name.
Precision planned_precision(const TrainConfig& train, DeviceKind device);

// Whether this build has the CUDA backend and a CUDA device is visible to it.
bool cuda_device_visible();
// run.device as `strata train` resolves it before it tries anything: cuda when asked for, or
// auto where a CUDA device is visible; otherwise the cpu. (Train then falls back from auto to the
// cpu when the model cannot run on the GPU; a plan names the layout it planned.)
DeviceKind planned_device(const TrainConfig& train);
// memory.device=0 on cuda as strata train resolves it: the free memory of GPU train.cuda_device
// less the driver's margin (before the kernels' scratch). Unimplemented without the CUDA
// backend; the device's own error when it is not visible.
Result<uint64_t> free_gpu_budget(const TrainConfig& train);

// Host memory the planner assumes when memory.host is 0: 80% of what is available now.
uint64_t default_host_budget();

}  // namespace strata
