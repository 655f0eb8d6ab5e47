// ParamAccess: where the model finds its parameters and accumulates its gradients while it
// computes. The model brackets every phase of compute with begin()/end() for the parameter
// group it touches (the embedding, one decoder layer, the head), so an implementation can
// page groups in and out of device memory around compute. The model owns no state and always
// computes through one: the paged training state (train/paged_state.h), or a FlatAccess over
// flat buffers its caller owns (flat_access.h).
//
// Mixture-of-experts layers: the experts of a layer are part of its group, but the model only
// touches the experts its router sent tokens to. After routing, it begins that subset with
// begin_experts() and ends it with end_experts(), inside the layer's begin()/end(); an
// implementation may leave the experts out of begin() and fetch just these (PagedState does).
#pragma once

#include <cstdint>
#include <span>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "model/params.h"

namespace strata::model {

// Groups: 0 = embed_tokens, 1 + l = decoder layer l, num_layers + 1 = final norm and the
// untied LM head (with tied embeddings the head reads group 0, which the model then also
// begins). Every tensor of ParamLayout belongs to exactly one group.
int param_group_count(const ParamLayout& layout);
// The group of the tensor starting at `offset` in the flat layout. REQUIRES: a tensor offset.
int param_group_of(const ParamLayout& layout, const TensorSpec& tensor);
// The expert of its MoE layer (0 .. E-1) a tensor belongs to (its gate, up or down projection),
// or -1 for every other tensor, the router and the shared expert included. An expert's LoRA
// factors belong to it.
int param_expert_of(const ParamLayout& layout, const TensorSpec& tensor);
// Whether the tensor is the weight matrix of a linear layer the model computes with
// linear_forward/linear_backward or the experts' ops (attention and MLP projections, the
// experts, the shared expert's projections): the tensors the fp8 recipe keeps as E4M3 blocks.
// Not the embedding, the LM head, norms, biases, the router or the shared expert's gate.
bool param_is_linear_weight(const ParamLayout& layout, const TensorSpec& tensor);

// Activation offload (DESIGN §3.3): the layer checkpoints (saved activations: the input of
// layer l is layer checkpoint l) the model hands to offload_saved_activation() during forward and takes
// back with fetch_saved_activation() during backward are 0 .. saved_activation_count(L) - 1. The
// model keeps layer checkpoints in two rotating slots (layer checkpoint l in slot l % 2) plus one
// for layer checkpoint L, so after forward the inputs of the last two layers are still resident
// and only the earlier ones travel.
inline int saved_activation_count(int num_layers) { return num_layers > 2 ? num_layers - 2 : 0; }

class ParamAccess {
 public:
  virtual ~ParamAccess() = default;
  // Makes the group's parameters (read-only) and/or gradients (read-write, accumulated)
  // addressable until end(). IOError and the like reach the caller of the model.
  virtual Status begin(int group, bool params, bool grads) = 0;
  virtual void end(int group, bool params, bool grads) = 0;
  // The tensor starting at flat-layout `offset`. REQUIRES: its group has begun for that kind.
  // Parameters are the compute copy, of param_dtype() elements (what the model's backend
  // reads: fp32 on the CPU reference, bf16 in the GPU recipe; kF8E4M3 names the fp8 recipe,
  // whose linear weights (param_is_linear_weight) are E4M3 blocks in kernels/fp8.h's matrix
  // layout and whose other tensors are bf16); gradients are fp32.
  virtual const void* param(int64_t offset) = 0;
  virtual float* grad(int64_t offset) = 0;
  virtual DType param_dtype() const { return DType::kF32; }
  // True when the access orders its moves after the model's queued ops itself (a compute stream
  // it was given): the model then hands groups back without waiting for its ops to finish.
  virtual bool stream_ordered() const { return false; }
  // The model tells the access, when it is set, the stream its ops are queued on (null: they
  // run in the caller), so that moves are ordered after them, and null when it lets the access
  // go (set_access with another), having waited for its ops. The default ignores it.
  virtual void set_compute_stream(Stream* stream) { (void)stream; }

  // Makes the tensors of `experts` (ascending expert indices of the MoE layer of `group`, each
  // with at least one token in this micro-batch) addressable like begin() does, until
  // end_experts() with the same arguments. REQUIRES: the group has begun for the same kinds.
  // The default: begin() already made every expert addressable.
  virtual Status begin_experts(int group, std::span<const int> experts, bool params, bool grads) {
    (void)group, (void)experts, (void)params, (void)grads;
    return Status::OK();
  }
  virtual void end_experts(int group, std::span<const int> experts, bool params, bool grads) {
    (void)group, (void)experts, (void)params, (void)grads;
  }
  // A collective of the model's own failed (expert parallelism's token exchange): the ranks'
  // sequences of collectives no longer match, so an access that makes collectives of its own
  // (data parallelism's gathers and sums) makes no more, and reports `error` from then on. The
  // default: none to stop.
  virtual void collectives_failed(const Status& error) { (void)error; }

  // Activation offload. When offloads_activations(), the model plans two layer checkpoint slots
  // (plus one for the last) instead of L + 1; in a step with backward it calls
  // offload_saved_activation(l, ...) as soon as forward has written layer checkpoint l (the input of
  // layer l) and fetch_saved_activation(l, ...) before it recomputes layer l in backward, in reverse
  // order, for l < saved_activation_count(L).
  // `bytes` = tokens of the micro-batch * hidden size * the activation type's size. The data
  // pointers are borrowed for the call only. The defaults mean "not offloading" and are never
  // called then.
  virtual bool offloads_activations() const { return false; }
  virtual Status offload_saved_activation(int index, const void* data, uint64_t bytes) {
    (void)index, (void)data, (void)bytes;
    return Status::Internal("offload_saved_activation without activation offload");
  }
  virtual Status fetch_saved_activation(int index, void* data, uint64_t bytes) {
    (void)index, (void)data, (void)bytes;
    return Status::Internal("fetch_saved_activation without activation offload");
  }
};

}  // namespace strata::model
