#include "train/resident_engine.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "core/check.h"
#include "core/units.h"

namespace strata {
namespace {

constexpr size_t kHostAlign = 4096;  // lets the checkpoint writer write the buffers in place (O_DIRECT)

int host_index(StateKind kind) {
  switch (kind) {
    case StateKind::kParam: return 0;
    case StateKind::kAdamM: return 1;
    case StateKind::kAdamV: return 2;
    default: break;
  }
  CHECK_MSG(false, "a resident model's host copy holds parameters and Adam moments, not gradients");
  return -1;
}

}  // namespace

ResidentEngine::ResidentEngine(std::unique_ptr<ResidentModel> model) : model_(std::move(model)) {}

ResidentEngine::~ResidentEngine() {
  for (HostBuffer& b : host_) {
    if (b.from_model) model_->free_host(b.data);
    else std::free(b.data);
  }
}

std::string ResidentEngine::memory_summary() const {
  const uint64_t host_bytes = static_cast<uint64_t>(layout().total_size()) * sizeof(float) * 3;
  return fmt::format("everything resident on {}: {} (parameters, gradients, Adam moments, activations); "
                     "checkpoints and exports go through a host copy of {}",
                     model_->device_name(), format_bytes(model_->resident_bytes()), format_bytes(host_bytes));
}

Status ResidentEngine::zero_grads() {
  model_->zero_grads();
  return Status::OK();
}

Result<double> ResidentEngine::micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                           float grad_scale, bool /*last*/, float /*lr*/) {
  return model_->forward_backward(inputs, targets, B, T, grad_scale);
}

Result<double> ResidentEngine::step(float lr) {
  current_.fill(false);
  return model_->adamw_step(lr);
}

EngineStats ResidentEngine::stats() const {
  EngineStats s;
  s.tier_bytes[static_cast<int>(Tier::kDevice)] = model_->resident_bytes();
  for (const HostBuffer& buffer : host_)
    if (buffer.data != nullptr) s.tier_bytes[static_cast<int>(Tier::kHost)] += static_cast<uint64_t>(layout().total_size()) * sizeof(float);
  return s;
}

float* ResidentEngine::host(StateKind kind) {
  HostBuffer& buffer = host_[host_index(kind)];
  if (buffer.data == nullptr) {
    const size_t bytes = (static_cast<size_t>(layout().total_size()) * sizeof(float) + kHostAlign - 1) / kHostAlign *
                         kHostAlign;
    void* p = model_->allocate_host(bytes);
    buffer.from_model = p != nullptr;
    if (p == nullptr) p = std::aligned_alloc(kHostAlign, bytes);
    CHECK_MSG(p != nullptr, "out of host memory for the host copy of the training state (" + format_bytes(bytes) + ")");
    CHECK_MSG(reinterpret_cast<uintptr_t>(p) % kHostAlign == 0, "allocate_host returned memory that is not 4 KiB aligned");
    buffer.data = static_cast<float*>(p);
  }
  return buffer.data;
}

void ResidentEngine::before_overwriting_host() {
  if (!before_modify_) return;
  const int groups = static_cast<int>(layout().num_layers()) + 2;  // model::param_group_of numbering
  for (int g = 0; g < groups; ++g) before_modify_(g);
}

void ResidentEngine::refresh_host(bool params, bool moments) {
  const bool stale_params = params && !current_[0];
  const bool stale_moments = moments && !(current_[1] && current_[2]);
  if (!stale_params && !stale_moments) return;
  before_overwriting_host();
  if (stale_params) model_->store_params(host(StateKind::kParam));
  if (stale_moments) model_->store_moments(host(StateKind::kAdamM), host(StateKind::kAdamV));
  current_[0] = current_[0] || stale_params;
  current_[1] = current_[2] = current_[1] || stale_moments;
}

Status ResidentEngine::capture() {
  refresh_host(/*params=*/true, /*moments=*/true);
  return Status::OK();
}

const void* ResidentEngine::flat_data(StateKind kind) const {
  const int i = host_index(kind);
  return current_[static_cast<size_t>(i)] ? host_[i].data : nullptr;
}

Status ResidentEngine::read_flat(StateKind kind, uint64_t offset, uint64_t length, void* dst) {
  const uint64_t total = static_cast<uint64_t>(layout().total_size()) * sizeof(float);
  CHECK_MSG(offset <= total && length <= total - offset, "read_flat past the end of the state");
  refresh_host(kind == StateKind::kParam, kind != StateKind::kParam);
  std::memcpy(dst, reinterpret_cast<const char*>(host(kind)) + offset, length);
  return Status::OK();
}

Status ResidentEngine::fill_kind(StateKind kind, const TensorFill& fill) {
  const bool moments = kind != StateKind::kParam;
  // The moments go to the model as a pair: the one not being filled keeps its current values.
  if (moments) refresh_host(/*params=*/false, /*moments=*/true);
  else before_overwriting_host();
  const int i = host_index(kind);
  current_[static_cast<size_t>(i)] = false;
  float* buffer = host(kind);
  for (const model::TensorSpec& t : layout().tensors()) RETURN_IF_ERROR(fill(t, buffer + t.offset));
  if (moments) model_->load_moments(host(StateKind::kAdamM), host(StateKind::kAdamV));
  else model_->load_params(buffer);
  current_[static_cast<size_t>(i)] = true;  // the model now holds what the buffer does
  return Status::OK();
}

}  // namespace strata
