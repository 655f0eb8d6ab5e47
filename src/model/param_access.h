// ParamAccess: where the model finds its parameters and accumulates its gradients while it
// computes. The model brackets every phase of compute with begin()/end() for the parameter
// group it touches (the embedding, one decoder layer, the head), so an implementation can
// page groups in and out of device memory around compute. Without one, LlamaModel uses flat
// buffers it owns.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "model/params.h"

namespace strata::model {

// Groups: 0 = embed_tokens, 1 + l = decoder layer l, num_layers + 1 = final norm and the
// untied LM head (with tied embeddings the head reads group 0, which the model then also
// begins). Every tensor of ParamLayout belongs to exactly one group.
int param_group_count(const ParamLayout& layout);
// The group of the tensor starting at `offset` in the flat layout. REQUIRES: a tensor offset.
int param_group_of(const ParamLayout& layout, const TensorSpec& tensor);

class ParamAccess {
 public:
  virtual ~ParamAccess() = default;
  // Makes the group's parameters (read-only) and/or gradients (read-write, accumulated)
  // addressable until end(). IOError and the like reach the caller of the model.
  virtual Status begin(int group, bool params, bool grads) = 0;
  virtual void end(int group, bool params, bool grads) = 0;
  // The tensor starting at flat-layout `offset`. REQUIRES: its group has begun for that kind.
  virtual const float* param(int64_t offset) = 0;
  virtual float* grad(int64_t offset) = 0;
};

}  // namespace strata::model
