// LlamaModel: a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) on the
// CPU backend in fp32, with explicit per-layer forward and backward.
//
// Activation memory: forward keeps only each layer's input (the layer-boundary checkpoint) plus
// what the final norm and the LM head need; backward recomputes one layer at a time from its
// checkpoint into a shared scratch workspace and then runs that layer's backward. All buffers
// come from one activation table planned for the largest (B, T) seen and reused afterwards.
//
// Not thread-safe; not copyable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/activations.h"
#include "model/config.h"
#include "model/params.h"

namespace strata::model {

// The LM head and cross-entropy run this many tokens at a time (logits never exceed
// kLossChunkTokens x V floats).
inline constexpr int64_t kLossChunkTokens = 256;

// Number of targets >= 0 (the tokens that count towards the loss).
int64_t count_valid_targets(const int32_t* targets, int64_t n);

class LlamaModel {
 public:
  // REQUIRES: config.validate(...) is OK. Parameters start at zero; call init_weights or
  // load_safetensors.
  explicit LlamaModel(const ModelConfig& config);
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  // Flat buffers of layout().total_size() elements.
  float* params() { return params_.data(); }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }

  void init_weights(uint64_t seed);
  // Fills every parameter from a single-file safetensors checkpoint by Hugging Face name
  // (F32/BF16/F16). On error the parameters are unchanged and the Status names file and tensor.
  Status load_safetensors(const std::string& path);

  void zero_grads();
  // Returns the SUM of token NLLs over targets >= 0 of this micro-batch and accumulates
  // grads += grad_scale * d(sum)/d(params); callers accumulating micro-batches pass
  // grad_scale = 1 / (valid tokens in the whole step) to get the mean loss's gradient.
  // inputs, targets: (B, T); inputs in [0, V), targets < V (negative = ignored).
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale);
  // Same sum of NLLs without touching the gradients.
  double forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T);

 private:
  // Embedding, all layers, final norm; leaves the final norm's output in acts_.final_out.
  void forward(const int32_t* inputs, int64_t B, int64_t T);
  // One decoder layer from x (its checkpoint). When out is non-null, writes the layer output
  // there; backward's recomputation passes null because only the intermediates are needed.
  void layer_forward(int64_t layer, const float* x, float* out, int64_t B, int64_t T);
  // dres (N, C): on entry dL/d(layer output), on return dL/d(layer input x).
  void layer_backward(int64_t layer, const float* x, float* dres, int64_t B, int64_t T);
  void check_tokens(const int32_t* inputs, const int32_t* targets, int64_t n) const;

  ModelConfig config_;
  ParamLayout layout_;
  std::vector<float> params_;  // (total_size)
  std::vector<float> grads_;   // (total_size)
  std::vector<float> inv_freq_;  // (D/2) RoPE frequencies
  ActivationTable acts_;
};

}  // namespace strata::model
