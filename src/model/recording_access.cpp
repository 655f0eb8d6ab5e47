#include "model/recording_access.h"

#include <cstring>
#include <memory>
#include <numeric>
#include <string>

#include "model/decoder_impl.h"

namespace strata::model {
namespace {

// The decoder's op set for a dry run (the members model/decoder.h calls, kernels/cpu/backend.h
// describes): every op does nothing, routing sends every token to every expert, and the ops'
// phase marks go to the recorder.
class DryRunOps {
 public:
  using Act = float;
  using W = float;
  static constexpr DType kWeightDType = DType::kF32;
  static constexpr const char* kName = "dry run";

  explicit DryRunOps(RecordingAccess* recorder) : recorder_(recorder) {}

  // Reserved, never touched: the pointers the table hands out are only passed along.
  Result<void*> activation_block(uint64_t bytes, const kernels::MicroBatchShape& /*shape*/) {
    block_.reset(new char[bytes]);
    return static_cast<void*>(block_.get());
  }
  static uint64_t extra_activation_bytes(const kernels::MicroBatchShape& /*shape*/) { return 0; }
  int64_t lm_head_chunk_tokens(int64_t N, int64_t /*C*/, int64_t /*V*/) const { return N; }
  void synchronize() {}
  Stream* compute_stream() { return nullptr; }
  static constexpr bool kHostMemory = true;
  using HostMark = int;
  HostMark host_mark() { return 0; }
  void wait_host_mark(HostMark /*mark*/) {}
  void trace_phase(const char* name, int64_t /*index*/ = trace::kNoIndex) { recorder_->mark_phase(name); }
  const float* stage_constants(const float* host, int64_t /*n*/) { return host; }
  const int32_t* stage_tokens(const int32_t* host, int64_t /*N*/, int32_t* /*slot*/) { return host; }
  const int64_t* stage_offsets(const int64_t* host, int64_t /*n*/, int64_t* /*slot*/) { return host; }
  // Expert e owns row e: every expert has tokens, so the decoder begins them all.
  const int64_t* expert_offsets_on_host(const int64_t* /*offsets*/, int64_t E) {
    every_expert_.resize(static_cast<size_t>(E) + 1);
    std::iota(every_expert_.begin(), every_expert_.end(), int64_t{0});
    return every_expert_.data();
  }
  template <class... A>
  double lm_head_cross_entropy(A&&...) {
    return 0.0;
  }

#define STRATA_DRY_RUN_OP(name) \
  template <class... A>         \
  void name(A&&...) {}
  STRATA_DRY_RUN_OP(embedding_forward)
  STRATA_DRY_RUN_OP(embedding_backward)
  STRATA_DRY_RUN_OP(rmsnorm_forward)
  STRATA_DRY_RUN_OP(rmsnorm_backward)
  STRATA_DRY_RUN_OP(linear_forward)
  STRATA_DRY_RUN_OP(linear_backward)
  STRATA_DRY_RUN_OP(linear_forward_residual)
  STRATA_DRY_RUN_OP(linear_forward_f32)
  STRATA_DRY_RUN_OP(linear_backward_f32)
  STRATA_DRY_RUN_OP(lora_forward)
  STRATA_DRY_RUN_OP(lora_backward)
  STRATA_DRY_RUN_OP(rope_forward)
  STRATA_DRY_RUN_OP(rope_backward)
  STRATA_DRY_RUN_OP(attention_forward)
  STRATA_DRY_RUN_OP(attention_backward)
  STRATA_DRY_RUN_OP(attention_block_forward)
  STRATA_DRY_RUN_OP(attention_block_backward)
  STRATA_DRY_RUN_OP(round_activations)
  STRATA_DRY_RUN_OP(swiglu_forward)
  STRATA_DRY_RUN_OP(swiglu_backward)
  STRATA_DRY_RUN_OP(add_inplace)
  STRATA_DRY_RUN_OP(copy_columns)
  STRATA_DRY_RUN_OP(sum_head_columns)
  STRATA_DRY_RUN_OP(moe_route_forward)
  STRATA_DRY_RUN_OP(moe_route_backward)
  STRATA_DRY_RUN_OP(moe_router_stats)
  STRATA_DRY_RUN_OP(moe_permute)
  STRATA_DRY_RUN_OP(moe_tile_offsets)
  STRATA_DRY_RUN_OP(moe_gather)
  STRATA_DRY_RUN_OP(moe_gather_backward)
  STRATA_DRY_RUN_OP(moe_combine_forward)
  STRATA_DRY_RUN_OP(moe_combine_backward)
  STRATA_DRY_RUN_OP(moe_experts_forward)
  STRATA_DRY_RUN_OP(moe_experts_backward)
  STRATA_DRY_RUN_OP(shared_expert_combine)
  STRATA_DRY_RUN_OP(shared_expert_backward)
  STRATA_DRY_RUN_OP(copy_to_host)
#undef STRATA_DRY_RUN_OP

 private:
  RecordingAccess* recorder_ = nullptr;
  std::unique_ptr<char[]> block_;
  std::vector<int64_t> every_expert_;
};

}  // namespace

void RecordingAccess::record(GroupAccess access, AccessMode mode) {
  events_.push_back({access, mode, phase_, false});
  open_ = true;
}

void RecordingAccess::close_batch() {
  if (open_) events_.back().last = true;
  open_ = false;
}

Status RecordingAccess::begin(int group, bool params, bool grads) {
  if (params) record(GroupAccess::of_part(group, StateKind::kParam, kDensePart), AccessMode::kRead);
  if (grads) record(GroupAccess::of_part(group, StateKind::kGrad, kDensePart), AccessMode::kReadWrite);
  return Status::OK();
}

void RecordingAccess::end(int /*group*/, bool /*params*/, bool /*grads*/) { close_batch(); }

Status RecordingAccess::begin_experts(int group, std::span<const int> experts, bool params, bool grads) {
  auto record_experts = [&](StateKind kind, AccessMode mode) {
    for (int e : experts) {
      GroupAccess a = GroupAccess::of_part(group, kind, e);
      a.prefetch = false;
      record(a, mode);
    }
  };
  if (params) record_experts(StateKind::kParam, AccessMode::kRead);
  if (grads) record_experts(StateKind::kGrad, AccessMode::kReadWrite);
  return Status::OK();
}

void RecordingAccess::end_experts(int /*group*/, std::span<const int> /*experts*/, bool /*params*/,
                                  bool /*grads*/) {
  close_batch();
}

Status RecordingAccess::offload_saved_activation(int index, const void* /*data*/, uint64_t /*bytes*/) {
  record(GroupAccess::of_activation(index), AccessMode::kWrite);
  close_batch();
  return Status::OK();
}

Status RecordingAccess::fetch_saved_activation(int index, void* /*data*/, uint64_t /*bytes*/) {
  record(GroupAccess::of_activation(index), AccessMode::kRead);
  close_batch();
  return Status::OK();
}

void RecordingAccess::mark_phase(const char* name) {
  if (name == nullptr) return;
  const std::string_view n = name;
  // The MTP module runs its forward and backward together after the head, as the head does.
  if (n == "embedding forward" || n == "forward" || n == "head" || n == "mtp") {
    phase_ = StepPhase::kForward;
  } else if (n == "recompute" || n == "backward" || n == "embedding backward") {
    phase_ = StepPhase::kBackward;
  } else {
    CHECK_MSG(false, "the decoder marks a phase the step program does not know: " + std::string(n));
  }
}

std::vector<ProgramEvent> record_micro_batch(const ModelConfig& config, bool offload_activations, bool backward) {
  RecordingAccess recorder(offload_activations && backward);
  Decoder<DryRunOps> model(config, DryRunOps(&recorder));
  model.set_access(&recorder);
  const int32_t token = 0;
  const Result<double> loss = model.compute(&token, &token, /*B=*/1, /*T=*/1, 1.0f, backward);
  CHECK_MSG(loss.ok(), "recording the model's accesses failed: " + loss.status().to_string());
  model.set_access(nullptr);
  return recorder.take_events();
}

}  // namespace strata::model
