// The model's part of the step program (offload/step_program.h), taken from the decoder's own
// code: record_micro_batch() runs Decoder's forward, recompute and backward for one micro-batch
// over an op set whose ops do nothing, through a RecordingAccess that writes down each
// begin/end, begin_experts/end_experts and activation offload and fetch the decoder makes.
// Nothing is computed and the activation table is planned for one token, so a recording costs
// the model's control flow only, whatever the batch the run will train on.
//
// Experts: the dry run routes every token to every expert, so begin_experts() names all of a
// MoE layer's experts. Which of them a real micro-batch reaches is data dependent: their
// accesses are recorded as not prefetched (GroupAccess::prefetch), uses that may happen.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/param_access.h"
#include "offload/step_program.h"

namespace strata::model {

// A ParamAccess that hands out no state and records what the model acquires, in order.
// Not thread-safe.
class RecordingAccess final : public ParamAccess {
 public:
  // offload_activations: answer offloads_activations() as a state that offloads them does.
  explicit RecordingAccess(bool offload_activations) : offload_activations_(offload_activations) {}

  Status begin(int group, bool params, bool grads) override;
  void end(int group, bool params, bool grads) override;
  Status begin_experts(int group, std::span<const int> experts, bool params, bool grads) override;
  void end_experts(int group, std::span<const int> experts, bool params, bool grads) override;
  // No state: the dry run's ops read nothing.
  const void* param(int64_t offset) override { return (void)offset, nullptr; }
  float* grad(int64_t offset) override { return (void)offset, nullptr; }
  bool offloads_activations() const override { return offload_activations_; }
  Status offload_saved_activation(int index, const void* data, uint64_t bytes) override;
  Status fetch_saved_activation(int index, void* data, uint64_t bytes) override;

  // The phase the model's ops mark next (the decoder's trace_phase names: "embedding forward",
  // "forward", "head", "recompute", "backward", "embedding backward"; null ends the last).
  void mark_phase(const char* name);
  // What was recorded; the access is empty afterwards.
  std::vector<ProgramEvent> take_events() { return std::move(events_); }

 private:
  void record(GroupAccess access, AccessMode mode);
  // Everything acquired since the last close is released here (an end of the model's).
  void close_batch();

  bool offload_activations_ = false;
  StepPhase phase_ = StepPhase::kForward;
  std::vector<ProgramEvent> events_;
  bool open_ = false;  // some event since the last close_batch()
};

// One micro-batch of a model of `config`, forward, recompute and backward, as the decoder
// acquires state for it; with offload_activations, its layer checkpoints' offloads and fetches too.
// backward = false: the forward alone (evaluation), whose acquisitions are also those of one
// decode() of generation: the embedding, each layer (its experts on demand), the head.
std::vector<ProgramEvent> record_micro_batch(const ModelConfig& config, bool offload_activations,
                                             bool backward = true);

}  // namespace strata::model
