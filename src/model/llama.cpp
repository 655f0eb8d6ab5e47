#include "model/llama.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "model/safetensors_min.h"

namespace strata::model {
namespace {

// a (n) += b (n)
void add_inplace(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace

int64_t count_valid_targets(const int32_t* targets, int64_t n) {
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) valid += targets[i] >= 0 ? 1 : 0;
  return valid;
}

LlamaModel::LlamaModel(const ModelConfig& config) : config_(config), layout_(config) {
  Status st = config_.validate("LlamaModel config");
  CHECK_MSG(st.ok(), st.to_string());
  params_.assign(static_cast<size_t>(layout_.total_size()), 0.0f);
  grads_.assign(static_cast<size_t>(layout_.total_size()), 0.0f);
  inv_freq_.resize(static_cast<size_t>(config_.head_dim / 2));
  kernels::rope_inv_freq(inv_freq_.data(), config_.head_dim, config_.rope);
}

void LlamaModel::init_weights(uint64_t seed) { model::init_weights(layout_, params_.data(), seed); }

Status LlamaModel::load_safetensors(const std::string& path) {
  ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(path));
  std::vector<float> loaded(params_.size(), 0.0f);
  for (const TensorSpec& t : layout_.tensors()) {
    RETURN_IF_ERROR(reader.read_f32(t.name, t.shape, loaded.data() + t.offset));
  }
  params_.swap(loaded);
  return Status::OK();
}

void LlamaModel::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void LlamaModel::check_tokens(const int32_t* inputs, const int32_t* targets, int64_t n) const {
  const int64_t V = config_.vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    CHECK_MSG(inputs[i] >= 0 && inputs[i] < V,
              fmt::format("input token {} at position {} is outside the vocabulary [0, {})", inputs[i], i, V));
    CHECK_MSG(targets[i] < V,
              fmt::format("target token {} at position {} is outside the vocabulary [0, {})", targets[i], i, V));
  }
}

void LlamaModel::layer_forward(int64_t layer, const float* x /*(N,C)*/, float* out /*(N,C)*/,
                               int64_t B, int64_t T) {
  namespace k = kernels::cpu;
  const LayerParams p = LayerParams::bind(params_.data(), layout_.layer(layer));
  const ActivationTable& a = acts_;
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  const int64_t Hq = config_.num_attention_heads;
  const int64_t Hkv = config_.num_key_value_heads;
  const int64_t D = config_.head_dim;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  // Attention block: h = x + o_proj(attention(rope(q), rope(k), v)).
  k::rmsnorm_forward(a.ln1, a.ln1_rstd, x, p.input_layernorm, N, C, eps);
  k::linear_forward(a.q, a.ln1, p.q_proj, p.q_bias, N, C, Hq * D);
  k::linear_forward(a.k, a.ln1, p.k_proj, p.k_bias, N, C, Hkv * D);
  k::linear_forward(a.v, a.ln1, p.v_proj, p.v_bias, N, C, Hkv * D);
  k::rope_forward(a.q, a.q, inv_freq_.data(), B, T, Hq, D);
  k::rope_forward(a.k, a.k, inv_freq_.data(), B, T, Hkv, D);
  k::attention_forward(a.att, a.lse, a.q, a.k, a.v, B, T, Hq, Hkv, D);
  k::linear_forward(a.h, a.att, p.o_proj, nullptr, N, Hq * D, C);
  add_inplace(a.h, x, N * C);

  // MLP block: out = h + down(silu(gate(ln2)) * up(ln2)).
  k::rmsnorm_forward(a.ln2, a.ln2_rstd, a.h, p.post_attention_layernorm, N, C, eps);
  k::linear_forward(a.gate, a.ln2, p.gate_proj, nullptr, N, C, F);
  k::linear_forward(a.up, a.ln2, p.up_proj, nullptr, N, C, F);
  k::swiglu_forward(a.act, a.gate, a.up, N * F);
  if (out == nullptr) return;
  k::linear_forward(out, a.act, p.down_proj, nullptr, N, F, C);
  add_inplace(out, a.h, N * C);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
void LlamaModel::layer_backward(int64_t layer, const float* x /*(N,C)*/, float* dres /*(N,C)*/,
                                int64_t B, int64_t T) {
  namespace k = kernels::cpu;
  const LayerParams p = LayerParams::bind(params_.data(), layout_.layer(layer));
  const LayerGrads g = LayerGrads::bind(grads_.data(), layout_.layer(layer));
  const ActivationTable& a = acts_;
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  const int64_t Hq = config_.num_attention_heads;
  const int64_t Hkv = config_.num_key_value_heads;
  const int64_t D = config_.head_dim;

  // MLP block. out = h + down(act): dres is dL/dout, and dL/dh starts as dres.
  k::linear_backward(a.d_act, g.down_proj, nullptr, dres, a.act, p.down_proj, N, F, C);
  k::swiglu_backward(a.d_gate, a.d_up, a.d_act, a.gate, a.up, N * F);
  k::linear_backward(a.d_ln, g.gate_proj, nullptr, a.d_gate, a.ln2, p.gate_proj, N, C, F);
  k::linear_backward(a.d_tmp, g.up_proj, nullptr, a.d_up, a.ln2, p.up_proj, N, C, F);
  add_inplace(a.d_ln, a.d_tmp, N * C);
  k::rmsnorm_backward(a.d_tmp, g.post_attention_layernorm, a.d_ln, a.h, p.post_attention_layernorm,
                      a.ln2_rstd, N, C);
  add_inplace(dres, a.d_tmp, N * C);  // dres is now dL/dh

  // Attention block. h = x + o_proj(att): dL/dx starts as dL/dh.
  k::linear_backward(a.d_att, g.o_proj, nullptr, dres, a.att, p.o_proj, N, Hq * D, C);
  k::attention_backward(a.d_q, a.d_k, a.d_v, a.d_att, a.q, a.k, a.v, a.att, a.lse, B, T, Hq, Hkv, D);
  k::rope_backward(a.d_q, a.d_q, inv_freq_.data(), B, T, Hq, D);
  k::rope_backward(a.d_k, a.d_k, inv_freq_.data(), B, T, Hkv, D);
  k::linear_backward(a.d_ln, g.q_proj, g.q_bias, a.d_q, a.ln1, p.q_proj, N, C, Hq * D);
  k::linear_backward(a.d_tmp, g.k_proj, g.k_bias, a.d_k, a.ln1, p.k_proj, N, C, Hkv * D);
  add_inplace(a.d_ln, a.d_tmp, N * C);
  k::linear_backward(a.d_tmp, g.v_proj, g.v_bias, a.d_v, a.ln1, p.v_proj, N, C, Hkv * D);
  add_inplace(a.d_ln, a.d_tmp, N * C);
  k::rmsnorm_backward(a.d_tmp, g.input_layernorm, a.d_ln, x, p.input_layernorm, a.ln1_rstd, N, C);
  add_inplace(dres, a.d_tmp, N * C);  // dres is now dL/dx
}

void LlamaModel::forward(const int32_t* inputs, int64_t B, int64_t T) {
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t L = config_.num_hidden_layers;
  acts_.reserve(config_, B, T);
  kernels::cpu::embedding_forward(acts_.checkpoints, inputs, params_.data() + layout_.embed_tokens(), N, C);
  for (int64_t l = 0; l < L; ++l) {
    const float* x = acts_.checkpoints + l * N * C;  // (N, C)
    layer_forward(l, x, acts_.checkpoints + (l + 1) * N * C, B, T);
  }
  kernels::cpu::rmsnorm_forward(acts_.final_out, acts_.final_rstd, acts_.checkpoints + L * N * C,
                                params_.data() + layout_.final_norm(), N, C,
                                static_cast<float>(config_.rms_norm_eps));
}

double LlamaModel::forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T) {
  CHECK(B > 0 && T > 0);
  check_tokens(inputs, targets, B * T);
  forward(inputs, B, T);
  return kernels::cpu::lm_head_cross_entropy(
      nullptr, nullptr, acts_.final_out, params_.data() + layout_.lm_head(), targets, B * T,
      config_.hidden_size, config_.vocab_size, 1.0f, kLossChunkTokens);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
double LlamaModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                    int64_t T, float grad_scale) {
  CHECK(B > 0 && T > 0);
  check_tokens(inputs, targets, B * T);
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t L = config_.num_hidden_layers;
  forward(inputs, B, T);

  // With tied embeddings lm_head() is the embedding's offset, so both gradients add up there.
  const double loss = kernels::cpu::lm_head_cross_entropy(
      acts_.d_final, grads_.data() + layout_.lm_head(), acts_.final_out,
      params_.data() + layout_.lm_head(), targets, N, C, config_.vocab_size, grad_scale,
      kLossChunkTokens);
  kernels::cpu::rmsnorm_backward(acts_.dres, grads_.data() + layout_.final_norm(), acts_.d_final,
                                 acts_.checkpoints + L * N * C, params_.data() + layout_.final_norm(),
                                 acts_.final_rstd, N, C);
  for (int64_t l = L - 1; l >= 0; --l) {
    const float* x = acts_.checkpoints + l * N * C;  // (N, C)
    // The scratch still holds the last layer's intermediates from forward; every other layer
    // is recomputed from its checkpoint.
    if (l != L - 1) layer_forward(l, x, /*out=*/nullptr, B, T);
    layer_backward(l, x, acts_.dres, B, T);
  }
  kernels::cpu::embedding_backward(grads_.data() + layout_.embed_tokens(), acts_.dres, inputs, N, C);
  return loss;
}

}  // namespace strata::model
