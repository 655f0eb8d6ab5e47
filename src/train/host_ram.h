// Every byte of host memory a training run holds, from the model config, the settings and the
// planner's Plan, itemised: the host tier's chunks (and their rounding to whole slots), the
// pinned staging beside them (the nvme staging slot, offloaded saved activations), the
// device's memory when the device is the CPU, the checkpoint writer's staging, the I/O
// engines, the data loader, the tokenizer, weight loading and the process's own baseline.
//
// The peak is the sum of the items: a bound, as some of them never coexist (weights are
// loaded before the first checkpoint stages anything). `strata plan` prints it and refuses a
// plan whose peak the machine does not have; `strata train` refuses such a run before it loads
// any weights, and each step line shows the process's RSS against it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/host_memory.h"
#include "core/status.h"
#include "data/data.h"
#include "model/config.h"
#include "offload/plan.h"
#include "train/train_config.h"

namespace strata {

struct HostRamItem {
  std::string name;  // "chunks", "staging", ...
  uint64_t bytes = 0;
  uint64_t pinned = 0;  // the part that is pinned (page-locked)
  // File pages mapped from disk (the data shards): they count in RSS but the kernel can drop
  // them, so they are not held against the memory available.
  bool reclaimable = false;
  std::string detail;  // what it is made of, for the report
};

struct HostRamPlan {
  std::vector<HostRamItem> items;
  // Of the "weights" item, the bytes that only loading holds, in memory the run writes only
  // after it (on the cpu backend: the device's gradients, moments and activations, which a fresh
  // run leaves untouched until its first step). The items less these make the peak.
  uint64_t load_overlap = 0;
  uint64_t peak() const;
  // The pinned part of the host tier (chunks and staging). On cuda it is page-locked when the
  // engine reserves it, so from then on resident and gone from the machine's available memory.
  uint64_t pinned_tier() const;
  uint64_t pinned() const;
  uint64_t reclaimable() const;
  // The bytes item `name` holds (0 when there is no such item).
  uint64_t bytes_of(const std::string& name) const;
};

// What the run reads that is not in the config: the data as opened (0s when it is not).
struct HostRamData {
  uint64_t mapped_bytes = 0;  // token files mapped into memory
  uint64_t windows = 0;       // training windows (the loader keeps an order of them)
  uint64_t mask_bytes = 0;    // loss masks held in memory (one byte per token)
  uint64_t index_bytes = 0;   // in-memory indexes (Megatron .idx: 16 bytes per sequence)
  // Another dataset's footprint on top (the eval data beside the training data).
  HostRamData& operator+=(const HostRamData& o) {
    mapped_bytes += o.mapped_bytes;
    windows += o.windows;
    mask_bytes += o.mask_bytes;
    index_bytes += o.index_bytes;
    return *this;
  }
};

// The footprint of an opened dataset whose loader has `windows` windows.
HostRamData host_ram_data(const TokenDataset& dataset, int64_t windows);

// The process's resident memory besides the run's own items: the 16 MiB measured for a cpu-only
// build with its first steps' threads, or the largest the process has been so far when that is
// more (the libraries of a build with the CUDA backend, about 220 MiB at start); on a cuda
// device, the CUDA runtime's estimate on top. See host_ram.cpp.
uint64_t process_baseline_bytes(DeviceKind device);

// The host memory of a run of `model` with settings `t` placed by `plan` (as PagedEngine makes
// it: t's budgets and chunk size already resolved) on `device`'s backend. process_bytes: the
// process item as measured before the state's tiers were reserved (0: process_baseline_bytes
// now, right while nothing of the run is allocated yet).
HostRamPlan plan_host_ram(const model::ModelConfig& model, const TrainConfig& t, const Plan& plan, DeviceKind device,
                          const HostRamData& data = {}, uint64_t process_bytes = 0);

// "host RAM: peak 80.0 MiB (pinned 10.0 MiB): chunks 10.0 MiB, staging ..., ..."
std::string format_host_ram(const HostRamPlan& ram);
// One line per item with what it is made of ("chunks 9.81 MiB: 51 slots of 196.00 KiB ..."),
// each starting with `indent`.
std::string format_host_ram_items(const HostRamPlan& ram, const std::string& indent);

// OK when the peak (less its reclaimable part) fits in what the machine has available (or that
// is unknown); otherwise OutOfMemory with both numbers and the items.
Status check_host_ram(const HostRamPlan& ram, const HostMemory& machine);

}  // namespace strata
