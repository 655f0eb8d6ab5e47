// PagedWeights: a model's frozen weights in the chunk address space, for generation. It is the
// model's ParamAccess as PagedState is in training, over a StateStore whose layout holds the
// compute copy alone (StateLayout::weights: no master, gradients or moments), so a model larger
// than the device still runs: the groups the device has no room for live in pinned host memory
// or on NVMe and come up as the model begins them, prefetched along the forward's schedule
// (model::record_micro_batch without backward: the embedding, each layer, the head), the device
// holding what Belady eviction keeps. Each decode() of generation repeats that schedule.
//
// The compute copy is the training state's: load() rounds (bf16) or quantises (fp8 matrices)
// fp32 values with the CPU's state kernels as PagedState writes its copy, so a paged model
// computes the bits of the same weights held whole in flat buffers.
//
// Experts (MoE layers): begin() acquires a layer's dense part; begin_experts() the experts the
// router picked, on demand, as PagedState does.
//
// Ownership: borrows the Device and IoEngine, which must outlive it. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/device.h"
#include "core/io_engine.h"
#include "model/param_access.h"
#include "model/params.h"
#include "offload/state_store.h"

namespace strata {

struct PagedWeightsOptions {
  // Tier budgets. device_bytes: at least the chunks of the groups the model holds at once (a
  // layer with all its experts; the embedding and the head together when they are tied).
  // host_bytes 0: without nvme, room for every group the device has none for; with nvme, the
  // slots staging takes alone (the rest goes to nvme). nvme_bytes 0: no nvme tier.
  uint64_t device_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t nvme_bytes = 0;
  std::string nvme_dir;
  uint64_t chunk_bytes = 0;  // 0: the size that wastes the least padding
  size_t lookahead = 2;      // groups prefetched ahead
  Precision precision = Precision::kFp32;
};

// Where each group's weights live (placement of a weights-only store).
struct WeightsPlacement {
  uint64_t chunk_bytes = 0;
  std::vector<Tier> homes;         // per group
  std::vector<uint64_t> chunks;    // per group
  uint64_t device_slots = 0;       // chunks the device tier holds (homes and copies in flight)
  uint64_t host_slots = 0;
  uint64_t nvme_slots = 0;
};

// The placement for `options`: every group on the device when all fit; otherwise the device
// keeps room for the groups in flight (the `lookahead` + 1 largest, or at least what the model
// holds at once) and homes groups, in order, where each still fits in the rest; host memory the
// others while there is room (keeping two slots to load through and, with nvme, one to stage
// through and room for the largest group's copies on their way up), and the nvme tier the rest. An error naming the budget (memory.device, memory.host,
// memory.nvme) that is too small, with what it needs.
Result<WeightsPlacement> place_weights(const model::ParamLayout& layout, const PagedWeightsOptions& options);

class PagedWeights final : public model::ParamAccess {
 public:
  static Result<std::unique_ptr<PagedWeights>> create(Device& device, IoEngine* io, const model::ParamLayout& layout,
                                                      const PagedWeightsOptions& options);
  // Writes the compute copy of the model's flat fp32 parameters (layout order), group by group
  // through host memory, each group's chunks then sent home.
  Status load(const float* flat);

  Status begin(int group, bool params, bool grads) override;
  void end(int group, bool params, bool grads) override;
  Status begin_experts(int group, std::span<const int> experts, bool params, bool grads) override;
  void end_experts(int group, std::span<const int> experts, bool params, bool grads) override;
  const void* param(int64_t offset) override;
  // Frozen weights have no gradients: a programmer's error.
  float* grad(int64_t offset) override;
  DType param_dtype() const override { return store_->layout().compute_dtype(); }

  const WeightsPlacement& placement() const { return placement_; }
  ChunkSpaceStats stats() const { return store_->stats(); }

 private:
  PagedWeights() = default;
  size_t tensor_at(int64_t offset) const;

  std::unique_ptr<StateStore> store_;
  WeightsPlacement placement_;
  std::vector<const model::TensorSpec*> specs_;  // per store tensor
  std::vector<int64_t> offsets_;                 // per store tensor: its (block's) flat offset
  std::unordered_map<int64_t, size_t> by_offset_;
};

}  // namespace strata
