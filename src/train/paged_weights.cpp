#include "train/paged_weights.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "core/check.h"
#include "core/units.h"
#include "kernels/nf4.h"
#include "model/recording_access.h"
#include "offload/step_program.h"
#include "train/paged_state.h"
#include "train/state_kernels.h"

namespace strata {
namespace {

uint64_t sum_largest(std::vector<uint64_t> chunks, size_t count) {
  std::sort(chunks.begin(), chunks.end(), std::greater<>());
  uint64_t sum = 0;
  for (size_t i = 0; i < std::min(count, chunks.size()); ++i) sum += chunks[i];
  return sum;
}

Status too_small(const char* key, uint64_t budget, uint64_t chunks, uint64_t chunk_bytes, const std::string& what) {
  return Status::OutOfMemory(std::string(key) + " = " + format_bytes(budget) + " is too small for the weights: " +
                                   what + " takes " + std::to_string(chunks) + " chunks of " +
                                   format_bytes(chunk_bytes) + " (" + format_bytes(chunks * chunk_bytes) +
                                   "); raise " + key);
}

}  // namespace

Result<WeightsPlacement> place_weights(const model::ParamLayout& layout, const PagedWeightsOptions& options) {
  const StateLayout state = StateLayout::weights(options.precision);
  const std::vector<StateTensor> tensors = PagedState::store_tensors(layout);
  WeightsPlacement p;
  p.chunk_bytes = options.chunk_bytes > 0 ? options.chunk_bytes : StateStore::auto_chunk_bytes(tensors, state);
  p.chunks = StateStore::group_chunks(tensors, p.chunk_bytes, state, StateKind::kParam);
  const size_t groups = p.chunks.size();
  p.homes.assign(groups, Tier::kDevice);
  uint64_t total = 0, largest = 0;
  for (uint64_t c : p.chunks) total += c, largest = std::max(largest, c);
  const uint64_t device_slots = options.device_bytes / p.chunk_bytes;
  // A tied head reads the embedding's group beside its own.
  const bool tied = layout.lm_head() == layout.embed_tokens();
  const uint64_t at_once = std::max(largest, tied ? p.chunks.front() + p.chunks.back() : 0);
  if (device_slots < at_once) {
    return too_small("memory.device", options.device_bytes, at_once, p.chunk_bytes,
                     "holding the largest group the model uses at once");
  }
  // Loading passes the weights through a host slot or two; an nvme tier stages through one more.
  const bool nvme = options.nvme_bytes > 0;
  const uint64_t host_pass = 2 + (nvme ? 1 + largest : 0);
  uint64_t device_homes = total;
  if (device_slots < total) {
    const uint64_t in_flight = sum_largest(p.chunks, options.lookahead + 1);
    device_homes = device_slots - (device_slots >= in_flight + largest ? in_flight : at_once);
  }
  // Groups in order, each homed on the device where it still fits (a large embedding that does
  // not leaves the room to the layers after it), then in host memory, then on nvme.
  std::vector<bool> placed(groups, false);
  uint64_t used = 0, rest = 0;
  for (size_t g = 0; g < groups; ++g) {
    placed[g] = used + p.chunks[g] <= device_homes;
    if (placed[g]) used += p.chunks[g];
    else rest += p.chunks[g];
  }
  // (All on the device: the tier is what they take, whatever the budget.)
  p.device_slots = std::min(device_slots, total);
  // Host memory: without an nvme tier every group left (its default: room for all of them);
  // with one, what memory.host leaves after staging (its default: staging alone).
  const uint64_t host_wanted = rest + host_pass;
  const uint64_t host_slots = options.host_bytes > 0 ? options.host_bytes / p.chunk_bytes
                              : nvme                 ? host_pass
                                                     : host_wanted;
  if (host_slots < host_pass || (!nvme && host_slots < host_wanted)) {
    const char* what = rest == 0 ? "loading the weights through host memory"
                       : nvme    ? "staging the weights to and from nvme"
                                 : "holding the groups the device has no room for";
    return too_small("memory.host", options.host_bytes, nvme || rest == 0 ? host_pass : host_wanted, p.chunk_bytes,
                     what);
  }
  p.host_slots = std::min(host_slots, host_wanted);
  uint64_t host_used = 0, nvme_used = 0;
  for (size_t g = 0; g < groups; ++g) {
    if (placed[g]) continue;
    if (host_used + p.chunks[g] + host_pass <= p.host_slots) {
      p.homes[g] = Tier::kHost;
      host_used += p.chunks[g];
    } else {
      p.homes[g] = Tier::kNvme;
      nvme_used += p.chunks[g];
    }
  }
  if (nvme_used > 0) {
    const uint64_t nvme_slots = options.nvme_bytes / p.chunk_bytes;
    if (nvme_slots < nvme_used)
      return too_small("memory.nvme.size", options.nvme_bytes, nvme_used, p.chunk_bytes,
                       "holding the groups homed on nvme");
    p.nvme_slots = nvme_used;
  }
  return p;
}

Result<std::unique_ptr<PagedWeights>> PagedWeights::create(Device& device, IoEngine* io,
                                                           const model::ParamLayout& layout,
                                                           const PagedWeightsOptions& options) {
  ASSIGN_OR_RETURN(WeightsPlacement placement, place_weights(layout, options));
  if (placement.nvme_slots > 0 && (io == nullptr || options.nvme_dir.empty()))
    return Status::InvalidArgument("the weights spill to nvme, which needs an nvme directory (memory.nvme.path)");
  StateStoreOptions so;
  so.layout = StateLayout::weights(options.precision);
  so.lookahead = options.lookahead;
  so.space.chunk_bytes = placement.chunk_bytes;
  so.space.device_bytes = placement.device_slots * placement.chunk_bytes;
  so.space.host_bytes = placement.host_slots * placement.chunk_bytes;
  so.space.nvme_bytes = placement.nvme_slots * placement.chunk_bytes;
  so.space.nvme_dir = options.nvme_dir;
  const std::vector<Tier> homes = placement.homes;
  so.home = [homes](int group, StateKind, int) { return homes.at(static_cast<size_t>(group)); };

  std::unique_ptr<PagedWeights> w(new PagedWeights());
  w->placement_ = std::move(placement);
  std::vector<StateTensor> tensors = PagedState::store_tensors(layout);
  for (const model::TensorSpec& t : layout.tensors()) {
    for (int64_t b = 0; b < t.num_blocks(); ++b) {
      w->by_offset_[t.block_offset(b)] = w->specs_.size();
      w->specs_.push_back(&t);
      w->offsets_.push_back(t.block_offset(b));
    }
  }
  ASSIGN_OR_RETURN(w->store_, StateStore::create(device, io, std::move(tensors), so));
  // Every decode() acquires as the forward does; the store prefetches and evicts along it.
  std::vector<GroupAccess> schedule;
  for (const ProgramEvent& e : model::record_micro_batch(layout.config(), false, /*backward=*/false))
    schedule.push_back(e.access);
  w->store_->set_schedule(schedule);
  return w;
}

Status PagedWeights::load(const float* flat) {
  const std::unique_ptr<StateKernels> kernels = make_cpu_state_kernels();
  const StateLayout& layout = store_->layout();
  for (int g = 0; g < store_->num_groups(); ++g) {
    for (int sl = 0; sl < store_->update_slices(g); ++sl) {
      RETURN_IF_ERROR(store_->acquire_slice(g, sl, StateKind::kParam, Tier::kHost, AccessMode::kWrite));
      for (size_t i : store_->slice_tensors(g, sl)) {
        const StateTensor& t = store_->tensor(i);
        const float* values = flat + offsets_[i];
        void* copy = store_->raw_pointer(i, StateKind::kParam);
        const int64_t n = static_cast<int64_t>(t.elements);
        if (layout.quantized(t.shape()) && layout.precision == Precision::kNf4) {
          kernels::nf4_quantize(values, n, static_cast<uint8_t*>(copy));
        } else if (layout.quantized(t.shape())) {
          kernels->quantize_copy(copy, values, t.matrix_rows, n / t.matrix_rows);
        } else if (layout.is_f32(StateKind::kParam)) {
          std::memcpy(copy, values, static_cast<size_t>(n) * sizeof(float));
        } else {
          kernels->round_copy(copy, values, n);
        }
      }
      store_->release_slice(g, sl, StateKind::kParam);
      RETURN_IF_ERROR(store_->send_slice_home(g, sl, StateKind::kParam, Tier::kHost));
    }
  }
  return store_->synchronize();
}

size_t PagedWeights::tensor_at(int64_t offset) const {
  auto it = by_offset_.find(offset);
  CHECK_MSG(it != by_offset_.end(), "no parameter tensor starts at offset " + std::to_string(offset));
  return it->second;
}

Status PagedWeights::begin(int group, bool params, bool grads) {
  CHECK_MSG(!grads, "frozen weights have no gradients");
  if (!params) return Status::OK();
  return store_->acquire_part(group, kDensePart, StateKind::kParam, Tier::kDevice, AccessMode::kRead);
}

void PagedWeights::end(int group, bool params, bool grads) {
  CHECK_MSG(!grads, "frozen weights have no gradients");
  if (params) store_->release_part(group, kDensePart, StateKind::kParam);
}

Status PagedWeights::begin_experts(int group, std::span<const int> experts, bool params, bool grads) {
  CHECK_MSG(!grads, "frozen weights have no gradients");
  if (!params || experts.empty()) return Status::OK();
  return store_->acquire_parts(group, experts, StateKind::kParam, Tier::kDevice, AccessMode::kRead);
}

void PagedWeights::end_experts(int group, std::span<const int> experts, bool params, bool grads) {
  CHECK_MSG(!grads, "frozen weights have no gradients");
  if (params && !experts.empty()) store_->release_parts(group, experts, StateKind::kParam);
}

const void* PagedWeights::param(int64_t offset) { return store_->raw_pointer(tensor_at(offset), StateKind::kParam); }

float* PagedWeights::grad(int64_t offset) {
  CHECK_MSG(false, "frozen weights have no gradients (offset " + std::to_string(offset) + ")");
  return nullptr;
}

}  // namespace strata
