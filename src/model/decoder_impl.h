// The definitions of Decoder<Ops> (decoder.h): the layer graph, written once. Included by the
// translation units that instantiate it for a backend (decoder_cpu.cpp, and the CUDA backend's).
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>

#include <fmt/format.h>

#include "core/checked_math.h"
#include "core/trace.h"
#include "kernels/moe.h"
#include "kernels/rope.h"
#include "model/decoder.h"
#include "model/context_parallel.h"
#include "model/mla_layer.h"
#include "model/moe_layer.h"

namespace strata::model {

template <class Ops>
Decoder<Ops>::Decoder(const ModelConfig& config, Ops ops) : config_(config), layout_(config), ops_(std::move(ops)) {
  Status st = config_.validate("model config");
  CHECK_MSG(st.ok(), st.to_string());
  inv_freq_.resize(static_cast<size_t>(config_.rope_dim() / 2));
  update_rope(1);
  if (config_.is_moe()) {
    const size_t E = static_cast<size_t>(config_.num_experts);
    expert_counts_.assign(static_cast<size_t>(config_.num_blocks()) * E, 0);
    expert_bias_.assign(expert_counts_.size(), 0.0f);
    forward_counts_.assign(E, 0);
    forward_prob_sums_.assign(E, 0.0);
  }
}

template <class Ops>
void Decoder<Ops>::set_access(ParamAccess* access) {
  CHECK_MSG(access == nullptr || access->param_dtype() == Ops::kWeightDType,
            fmt::format("the model's backend ({}) reads {} weights; its ParamAccess holds {}", Ops::kName,
                        dtype_name(Ops::kWeightDType), dtype_name(access->param_dtype())));
  // The previous access is done with: the queued ops have finished with its groups, and it
  // must not order later moves on this model's stream (it may outlive the model).
  ops_.synchronize();
  if (access_ != nullptr) access_->set_compute_stream(nullptr);
  access_ = access;
  if (access_ != nullptr) access_->set_compute_stream(ops_.compute_stream());
}

template <class Ops>
void Decoder<Ops>::set_context_comm(parallel::Comm* comm) {
  CHECK_MSG(comm == nullptr || kv_capacity_ == 0, "context parallelism while a sequence is generated");
  CHECK_MSG(comm == nullptr || expert_comm_ == nullptr, "context parallelism beside expert parallelism");
  context_comm_ = comm;
}

template <class Ops>
void Decoder<Ops>::set_expert_comm(parallel::Comm* comm) {
  if (comm != nullptr) {
    CHECK_MSG(config_.is_moe(), "expert parallelism for a model without experts");
    CHECK_MSG(config_.num_experts % comm->world_size() == 0,
              fmt::format("{} experts cannot be split evenly over an expert group of {} ranks", config_.num_experts,
                          comm->world_size()));
    CHECK_MSG(kv_capacity_ == 0, "expert parallelism while a sequence is generated");
    CHECK_MSG(context_comm_ == nullptr, "expert parallelism beside context parallelism");
  }
  expert_comm_ = comm;
  expert_routes_.assign(comm != nullptr ? static_cast<size_t>(config_.num_blocks()) : 0, ExpertRoute{});
}

template <class Ops>
void Decoder<Ops>::reset_expert_token_counts() {
  std::fill(expert_counts_.begin(), expert_counts_.end(), int64_t{0});
}

template <class Ops>
const float* Decoder<Ops>::layer_selection_bias(int64_t layer) const {
  // DeepSeek-V3's routers hold one (e_score_correction_bias) whether or not it is moved.
  if (config_.router_bias_update_rate <= 0 && !config_.router_selection_bias) return nullptr;
  return expert_bias_.data() + layer * config_.num_experts;
}

template <class Ops>
void Decoder<Ops>::update_expert_bias() {
  if (config_.router_bias_update_rate <= 0) return;
  const int64_t E = config_.num_experts;
  for (int64_t l = 0; l < config_.num_blocks(); ++l) {
    // An MTP block training does not compute routes nothing: its bias stays.
    if (!config_.is_moe_layer(l) || (config_.is_mtp_block(l) && !config_.trains_mtp())) continue;
    kernels::moe_update_selection_bias(expert_bias_.data() + l * E, expert_counts_.data() + l * E, E,
                                       static_cast<float>(config_.router_bias_update_rate));
  }
}

template <class Ops>
void Decoder<Ops>::check_tokens(const int32_t* inputs, const int32_t* targets, int64_t n) const {
  const int64_t V = config_.vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    CHECK_MSG(inputs[i] >= 0 && inputs[i] < V,
              fmt::format("input token {} at position {} is outside the vocabulary [0, {})", inputs[i], i, V));
    CHECK_MSG(targets[i] < V,
              fmt::format("target token {} at position {} is outside the vocabulary [0, {})", targets[i], i, V));
  }
}

template <class Ops>
void Decoder<Ops>::check_positions(const int32_t* positions, int64_t B, int64_t T) const {
  if (positions == nullptr) return;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int32_t p = positions[b * T + t];
      const bool ok = t == 0 ? p == 0 : p == 0 || p == positions[b * T + t - 1] + 1;
      CHECK_MSG(ok, fmt::format("document position {} of token {} in row {} follows {}: a row's positions start "
                                "at 0 and each next is 0 (a new document) or one more",
                                p, t, b, t == 0 ? -1 : positions[b * T + t - 1]));
    }
  }
}

template <class Ops>
Status Decoder<Ops>::layer_forward(int64_t layer, const Act* x /*(N,C)*/, Act* out /*(N,C)*/, int64_t B,
                                   int64_t T, const RouterStats* stats, bool grads, const KvSlot* kv) {
  const auto p = LayerTensors<const W>::bind_with(param_at(), layout_.layer(layer));
  const ActivationTable<Ops>& a = acts_.layer(layer);
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  const int64_t Hq = config_.num_attention_heads;
  const int64_t Hkv = config_.num_key_value_heads;
  const int64_t D = config_.head_dim;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  // Attention block: h = x + o_proj(attention(rope(q), rope(k), v)); with qk_norm, q and k
  // are RMS-normalised per head (rows of D) before RoPE. In generation the keys and values go
  // to the cache after the `past` positions already there, and attention reads them all.
  const int64_t past = kv != nullptr ? kv->past : 0;
  Act* k = kv != nullptr ? kv->k + past * Hkv * D : a.k;  // (N, Hkv*D)
  Act* v = kv != nullptr ? kv->v + past * Hkv * D : a.v;  // (N, Hkv*D)
  ops_.rmsnorm_forward(a.ln1, a.ln1_rstd, x, p.input_layernorm, N, C, eps);
  if (config_.is_mla()) {
    // Latent attention (model/mla_layer.h); generation and context parallelism refuse it before.
    CHECK_MSG(kv == nullptr && context_comm_ == nullptr,
              "multi-head latent attention with a KV cache or context parallelism");
    mla_attention_forward(ops_, config_, p, a, acts_, B, T, mla_rope());
    ops_.linear_forward_residual(a.h, a.att, p.o_proj, x, N, config_.att_dim(), C);
  } else {
  const LayerOffsets& o = layout_.layer(layer);
  if (p.q_norm != nullptr) {
    ops_.linear_forward(a.q_raw, a.ln1, p.q_proj, p.q_bias, N, C, Hq * D);
    lora_forward(o.q_proj, a.q_raw, a.ln1, N, C, Hq * D);
    ops_.linear_forward(a.k_raw, a.ln1, p.k_proj, p.k_bias, N, C, Hkv * D);
    lora_forward(o.k_proj, a.k_raw, a.ln1, N, C, Hkv * D);
    ops_.rmsnorm_forward(a.q, a.q_norm_rstd, a.q_raw, p.q_norm, N * Hq, D, eps);
    ops_.rmsnorm_forward(k, a.k_norm_rstd, a.k_raw, p.k_norm, N * Hkv, D, eps);
  } else {
    ops_.linear_forward(a.q, a.ln1, p.q_proj, p.q_bias, N, C, Hq * D);
    lora_forward(o.q_proj, a.q, a.ln1, N, C, Hq * D);
    ops_.linear_forward(k, a.ln1, p.k_proj, p.k_bias, N, C, Hkv * D);
    lora_forward(o.k_proj, k, a.ln1, N, C, Hkv * D);
  }
  ops_.linear_forward(v, a.ln1, p.v_proj, p.v_bias, N, C, Hkv * D);
  lora_forward(o.v_proj, v, a.ln1, N, C, Hkv * D);
  // Packed documents (training only): positions restart at each document, and attention stays
  // inside it.
  // With context parallelism RoPE rotates by the tokens' places in their sequences and attention
  // runs over the context group's ring.
  const int32_t* positions = kv != nullptr ? nullptr : staged_positions_;
  const int32_t* rope_positions = kv != nullptr ? nullptr : staged_rope_positions_;
  ops_.rope_forward(a.q, a.q, inv_freq_ops_, B, T, Hq, D, rope_scale_, past, rope_positions);
  ops_.rope_forward(k, k, inv_freq_ops_, B, T, Hkv, D, rope_scale_, past, rope_positions);
  if (context_comm_ != nullptr && kv == nullptr) {
    RETURN_IF_ERROR(ring_attention_forward(layer, a, k, v, B, T));
  } else {
    ops_.attention_forward(a.att, a.lse, a.q, kv != nullptr ? kv->k : a.k, kv != nullptr ? kv->v : a.v, B, T, Hq, Hkv,
                           D, past, positions);
  }
  ops_.linear_forward_residual(a.h, a.att, p.o_proj, x, N, Hq * D, C);
  lora_forward(o.o_proj, a.h, a.att, N, Hq * D, C);
  }

  // MLP block: out = h + mlp(ln2), mlp = down(silu(gate(ln2)) * up(ln2)) or the experts.
  ops_.rmsnorm_forward(a.ln2, a.ln2_rstd, a.h, p.post_attention_layernorm, N, C, eps);
  if (config_.is_moe_layer(layer)) {
    // Only the experts the router picks are needed: route first, then fetch them.
    moe_route(ops_, config_, param(layout_.layer(layer).moe.router), layer_selection_bias(layer), a, a.ln2, stats,
              N);
    // With expert parallelism the rows go to their experts' ranks first, and this rank's
    // experts that receive any (from any rank) are the ones begun.
    if (expert_comm_ != nullptr) {
      CHECK_MSG(!acts_.experts_tiled(), "expert parallelism with the routed experts in tiles (the table plans none)");
      ExpertRoute& route = expert_routes_[static_cast<size_t>(layer)];
      const int64_t* offsets = ops_.expert_offsets_on_host(a.expert_offsets, config_.num_experts);
      if (Status st = ep_plan(ops_, *expert_comm_, config_, a, offsets, route); !st.ok()) {
        access_->collectives_failed(st);
        return st.with_context(fmt::format("layer {}", layer));
      }
      // The table holds P times this rank's rows for its experts: every rank's micro-batch is
      // as large as this one's (the ranks run the same shapes).
      CHECK_MSG(route.received <= expert_ranks() * acts_.planned_tokens() * config_.num_experts_per_tok,
                fmt::format("layer {}'s experts received {} rows; the activation table holds {} (a rank of the "
                            "expert group ran a larger micro-batch)",
                            layer, route.received, expert_ranks() * acts_.planned_tokens() * config_.num_experts_per_tok));
    }
    RETURN_IF_ERROR(begin_experts(layer, /*params=*/true, grads));
    const auto m = MoeTensors<const W>::bind_with(param_at(), moe_offsets(layer));
    const MoeAdapters<Ops> adapters = moe_adapters(layer);
    if (expert_comm_ != nullptr) {
      if (Status st = ep_experts_forward(ops_, *expert_comm_, config_, m.experts(), a,
                                         expert_routes_[static_cast<size_t>(layer)], lora_of_moe(adapters));
          !st.ok()) {
        // No more collectives of the access either; the experts begun are ended (the caller
        // ends only a layer that succeeded).
        access_->collectives_failed(st);
        end_experts(layer, true, grads);
        return st.with_context(fmt::format("layer {}", layer));
      }
    }
    moe_mlp_forward(ops_, config_, m, a, acts_, a.ln2, out, N, /*experts_done=*/expert_comm_ != nullptr,
                    lora_of_moe(adapters));
    if (out != nullptr) ops_.add_inplace(out, a.h, N * C);
    return Status::OK();
  }
  const int64_t tile = acts_.mlp_rows();
  if (acts_.mlp_tiled()) {
    // Token tiles: each tile's gate, up and activation live only while its rows are computed
    // (backward recomputes them), so the recompute before backward has nothing to do here.
    if (out == nullptr) return Status::OK();
    for (int64_t r0 = 0; r0 < N; r0 += tile) {
      const int64_t n = std::min(tile, N - r0);
      mlp_tile_forward(layer, p, a.ln2 + r0 * C, n, r0);
      ops_.linear_forward_residual(out + r0 * C, acts_.act, p.down_proj, a.h + r0 * C, n, F, C);
      lora_forward(layout_.layer(layer).down_proj, out + r0 * C, acts_.act, n, F, C, r0);
    }
    return Status::OK();
  }
  mlp_tile_forward(layer, p, a.ln2, N, 0, &a);
  if (out == nullptr) return Status::OK();
  ops_.linear_forward_residual(out, a.act, p.down_proj, a.h, N, F, C);
  lora_forward(layout_.layer(layer).down_proj, out, a.act, N, F, C);
  return Status::OK();
}

template <class Ops>
void Decoder<Ops>::mlp_tile_forward(int64_t layer, const LayerTensors<const W>& p, const Act* x /*(n,C)*/, int64_t n,
                                    int64_t row0, const ActivationTable<Ops>* into) {
  const ActivationTable<Ops>& a = into != nullptr ? *into : acts_;
  const LayerOffsets& o = layout_.layer(layer);
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  ops_.linear_forward(a.gate, x, p.gate_proj, nullptr, n, C, F);
  lora_forward(o.gate_proj, a.gate, x, n, C, F, row0);
  ops_.linear_forward(a.up, x, p.up_proj, nullptr, n, C, F);
  lora_forward(o.up_proj, a.up, x, n, C, F, row0);
  ops_.swiglu_forward(a.act, a.gate, a.up, n * F);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
template <class Ops>
Status Decoder<Ops>::layer_backward(int64_t layer, const Act* x /*(N,C)*/, Act* dres /*(N,C)*/, int64_t B,
                                    int64_t T, const float* prob_grad) {
  const auto p = LayerTensors<const W>::bind_with(param_at(), layout_.layer(layer));
  const LayerGrads g = LayerGrads::bind_with(grad_at(), layout_.layer(layer));
  const LayerOffsets& o = layout_.layer(layer);
  const ActivationTable<Ops>& a = acts_.layer(layer);
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t F = config_.intermediate_size;
  const int64_t Hq = config_.num_attention_heads;
  const int64_t Hkv = config_.num_key_value_heads;
  const int64_t D = config_.head_dim;

  // MLP block. out = h + mlp(ln2): dres is dL/dout, and dL/dh starts as dres.
  if (config_.is_moe_layer(layer)) {
    const MoeOffsets mo = moe_offsets(layer);
    const auto mp = MoeTensors<const W>::bind_with(param_at(), mo);
    const MoeGrads mg = MoeGrads::bind_with(grad_at(), mo);
    const MoeAdapters<Ops> adapters = moe_adapters(layer);
    const MoeAdapters<Ops>* lora = lora_of_moe(adapters);
    if (expert_comm_ == nullptr) {
      RETURN_IF_ERROR(moe_mlp_backward(ops_, config_, mp, mg, a, acts_, a.ln2, dres, prob_grad, a.d_ln, N, lora));
    } else {
      const ExpertRoute& route = expert_routes_[static_cast<size_t>(layer)];
      auto exchange = [&] {
        Status st = ep_experts_backward(ops_, *expert_comm_, config_, mp.experts(), mg.experts(), a, route, lora);
        if (!st.ok()) access_->collectives_failed(st);  // before end_experts' sums
        return st.with_context(fmt::format("layer {}", layer));
      };
      RETURN_IF_ERROR(
          moe_mlp_backward(ops_, config_, mp, mg, a, acts_, a.ln2, dres, prob_grad, a.d_ln, N, lora, exchange));
    }
  } else {
    // Token tiles (set_mlp_tile_tokens): each tile's intermediates recomputed, then its
    // backward; the weight gradients add up tile by tile.
    const bool tiled = acts_.mlp_tiled();
    const int64_t tile = tiled ? acts_.mlp_rows() : N;
    const ActivationTable<Ops>& m = tiled ? acts_ : a;  // where gate .. act live
    for (int64_t r0 = 0; r0 < N; r0 += tile) {
      const int64_t n = std::min(tile, N - r0);
      const Act* x2 = a.ln2 + r0 * C;
      if (tiled) mlp_tile_forward(layer, p, x2, n, r0);
      ops_.linear_backward(m.d_act, g.down_proj, nullptr, dres + r0 * C, m.act, p.down_proj, n, F, C);
      lora_backward(o.down_proj, m.d_act, dres + r0 * C, m.act, n, F, C, r0);
      ops_.swiglu_backward(m.d_gate, m.d_up, m.d_act, m.gate, m.up, n * F);
      ops_.linear_backward(a.d_ln + r0 * C, g.gate_proj, nullptr, m.d_gate, x2, p.gate_proj, n, C, F);
      lora_backward(o.gate_proj, a.d_ln + r0 * C, m.d_gate, x2, n, C, F, r0);
      ops_.linear_backward(a.d_tmp + r0 * C, g.up_proj, nullptr, m.d_up, x2, p.up_proj, n, C, F);
      lora_backward(o.up_proj, a.d_tmp + r0 * C, m.d_up, x2, n, C, F, r0);
    }
    ops_.add_inplace(a.d_ln, a.d_tmp, N * C);
  }
  ops_.rmsnorm_backward(a.d_tmp, g.post_attention_layernorm, a.d_ln, a.h, p.post_attention_layernorm,
                      a.ln2_rstd, N, C);
  ops_.add_inplace(dres, a.d_tmp, N * C);  // dres is now dL/dh

  // Attention block. h = x + o_proj(att): dL/dx starts as dL/dh.
  ops_.linear_backward(a.d_att, g.o_proj, nullptr, dres, a.att, p.o_proj, N, config_.att_dim(), C);
  lora_backward(o.o_proj, a.d_att, dres, a.att, N, config_.att_dim(), C);
  if (config_.is_mla()) {
    mla_attention_backward(ops_, config_, p, g, a, acts_, B, T, mla_rope(), a.d_ln);
  } else {
  if (context_comm_ != nullptr) {
    RETURN_IF_ERROR(ring_attention_backward(layer, a, B, T));
  } else {
    ops_.attention_backward(a.d_q, a.d_k, a.d_v, a.d_att, a.q, a.k, a.v, a.att, a.lse, B, T, Hq, Hkv, D,
                            staged_positions_);
  }
  ops_.rope_backward(a.d_q, a.d_q, inv_freq_ops_, B, T, Hq, D, rope_scale_, staged_rope_positions_);
  ops_.rope_backward(a.d_k, a.d_k, inv_freq_ops_, B, T, Hkv, D, rope_scale_, staged_rope_positions_);
  if (p.q_norm != nullptr) {
    // Through the per-head norms; d_qk_raw serves q, then k.
    ops_.rmsnorm_backward(a.d_qk_raw, g.q_norm, a.d_q, a.q_raw, p.q_norm, a.q_norm_rstd, N * Hq, D);
    ops_.linear_backward(a.d_ln, g.q_proj, g.q_bias, a.d_qk_raw, a.ln1, p.q_proj, N, C, Hq * D);
    lora_backward(o.q_proj, a.d_ln, a.d_qk_raw, a.ln1, N, C, Hq * D);
    ops_.rmsnorm_backward(a.d_qk_raw, g.k_norm, a.d_k, a.k_raw, p.k_norm, a.k_norm_rstd, N * Hkv, D);
    ops_.linear_backward(a.d_tmp, g.k_proj, g.k_bias, a.d_qk_raw, a.ln1, p.k_proj, N, C, Hkv * D);
    lora_backward(o.k_proj, a.d_tmp, a.d_qk_raw, a.ln1, N, C, Hkv * D);
  } else {
    ops_.linear_backward(a.d_ln, g.q_proj, g.q_bias, a.d_q, a.ln1, p.q_proj, N, C, Hq * D);
    lora_backward(o.q_proj, a.d_ln, a.d_q, a.ln1, N, C, Hq * D);
    ops_.linear_backward(a.d_tmp, g.k_proj, g.k_bias, a.d_k, a.ln1, p.k_proj, N, C, Hkv * D);
    lora_backward(o.k_proj, a.d_tmp, a.d_k, a.ln1, N, C, Hkv * D);
  }
  ops_.add_inplace(a.d_ln, a.d_tmp, N * C);
  ops_.linear_backward(a.d_tmp, g.v_proj, g.v_bias, a.d_v, a.ln1, p.v_proj, N, C, Hkv * D);
  lora_backward(o.v_proj, a.d_tmp, a.d_v, a.ln1, N, C, Hkv * D);
  ops_.add_inplace(a.d_ln, a.d_tmp, N * C);
  }
  ops_.rmsnorm_backward(a.d_tmp, g.input_layernorm, a.d_ln, x, p.input_layernorm, a.ln1_rstd, N, C);
  ops_.add_inplace(dres, a.d_tmp, N * C);  // dres is now dL/dx
  return Status::OK();
}

template <class Ops>
Status Decoder<Ops>::begin_group(int group, bool params, bool grads) {
  return access_->begin(group, params, grads);
}

template <class Ops>
void Decoder<Ops>::end_group(int group, bool params, bool grads) {
  // The queued ops must be done with the group before it may be evicted: the access orders its
  // moves after them on the compute stream, or the host waits here.
  if (!access_->stream_ordered()) ops_.synchronize();
  access_->end(group, params, grads);
}

template <class Ops>
std::vector<const typename Decoder<Ops>::W*> Decoder<Ops>::param_blocks(int64_t offset) {
  const TensorSpec& t = layout_.at(offset);
  std::vector<const W*> out;
  for (int64_t b = 0; b < t.num_blocks(); ++b) out.push_back(param(t.block_offset(b)));
  return out;
}

template <class Ops>
std::vector<float*> Decoder<Ops>::grad_blocks(int64_t offset) {
  const TensorSpec& t = layout_.at(offset);
  std::vector<float*> out;
  for (int64_t b = 0; b < t.num_blocks(); ++b) out.push_back(t.frozen ? nullptr : access_->grad(t.block_offset(b)));
  return out;
}

template <class Ops>
int64_t Decoder<Ops>::block_rows(int64_t offset) const {
  const TensorSpec& t = layout_.at(offset);
  return t.block_rows > 0 ? t.block_rows : t.shape[0];
}

template <class Ops>
Status Decoder<Ops>::begin_experts(int64_t layer, bool params, bool grads) {
  active_experts_.clear();
  if (!config_.is_moe_layer(layer)) return Status::OK();
  if (expert_comm_ != nullptr) {
    active_experts_ = expert_routes_[static_cast<size_t>(layer)].active;
  } else {
    const int64_t* offsets = ops_.expert_offsets_on_host(acts_.layer(layer).expert_offsets, config_.num_experts);
    for (int64_t e = 0; e < config_.num_experts; ++e)
      if (offsets[e + 1] > offsets[e]) active_experts_.push_back(static_cast<int>(e));
  }
  Status st = access_->begin_experts(static_cast<int>(1 + layer), active_experts_, params, grads);
  if (!st.ok()) active_experts_.clear();
  return st;
}

template <class Ops>
void Decoder<Ops>::end_experts(int64_t layer, bool params, bool grads) {
  if (!config_.is_moe_layer(layer)) return;
  if (!access_->stream_ordered()) ops_.synchronize();
  access_->end_experts(static_cast<int>(1 + layer), active_experts_, params, grads);
  active_experts_.clear();
}

template <class Ops>
MoeOffsets Decoder<Ops>::moe_offsets(int64_t layer) const {
  MoeOffsets o = layout_.layer(layer).moe;
  std::vector<bool> active(o.expert_gate.size(), false);
  for (int e : active_experts_) active[static_cast<size_t>(e)] = true;
  for (size_t e = 0; e < active.size(); ++e) {
    if (active[e]) continue;
    o.expert_gate[e] = o.expert_up[e] = o.expert_down[e] = -1;
  }
  return o;
}

template <class Ops>
typename Decoder<Ops>::Act* Decoder<Ops>::layer_checkpoint(int64_t l, int64_t N) {
  const int64_t L = config_.num_hidden_layers;
  int64_t slot = l;
  if (acts_.layer_checkpoint_slots() < L + 1) slot = l == L ? std::min<int64_t>(L, 2) : l % 2;
  return acts_.layer_checkpoints + slot * N * config_.hidden_size;
}

template <class Ops>
Status Decoder<Ops>::forward_layers(const int32_t* inputs, const int32_t* positions, int64_t B, int64_t T,
                                    bool count_tokens, bool offload) {
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t L = config_.num_hidden_layers;
  const int64_t E = config_.num_experts;
  {
    Status window = config_.check_sequence_length(context_comm_ != nullptr ? 2 * context_comm_->world_size() * T : T,
                                                  "model config");
    CHECK_MSG(window.ok(), window.to_string());
  }
  RETURN_IF_ERROR(
      acts_.reserve(ops_, config_, B, T, access_->offloads_activations(), keep_layers_, 0, expert_ranks(), mlp_tile_,
                    context_comm_ != nullptr ? context_ranks() : 0));
  const int64_t offloaded = offload ? saved_activation_count(static_cast<int>(L)) : 0;
  std::fill(forward_counts_.begin(), forward_counts_.end(), int64_t{0});
  std::fill(forward_prob_sums_.begin(), forward_prob_sums_.end(), 0.0);
  std::vector<int64_t> layer_counts(static_cast<size_t>(E));
  const int32_t* tokens = staged_inputs_ = ops_.stage_tokens(inputs, N, acts_.tokens_in);
  staged_positions_ = positions != nullptr ? ops_.stage_tokens(positions, N, acts_.tokens_pos) : nullptr;
  staged_rope_positions_ = staged_positions_;
  if (context_comm_ != nullptr) {
    // Each token's place in its sequence (B = 2S rows of T = C tokens, S sequences of 2NC).
    CHECK_MSG(positions == nullptr, "context parallelism with document masks");
    CHECK_MSG(B % 2 == 0, "context parallelism takes two chunks of every sequence: B must be even");
    const int64_t ranks = context_comm_->world_size();
    context_positions_.resize(static_cast<size_t>(N));
    context_positions(context_positions_.data(), B / 2, 2 * ranks * T, ranks, context_comm_->rank());
    staged_rope_positions_ = ops_.stage_tokens(context_positions_.data(), N, acts_.tokens_pos);
  }
  {
    trace::Span span("compute", "embedding forward");
    ops_.trace_phase("embedding forward");
    RETURN_IF_ERROR(begin_group(0, true, false));
    ops_.embedding_forward(layer_checkpoint(0, N), tokens, param_blocks(layout_.embed_tokens()).data(),
                           block_rows(layout_.embed_tokens()), N, C, config_.vocab_size);
    end_group(0, true, false);
  }
  const uint64_t layer_checkpoint_bytes = static_cast<uint64_t>(N * C) * sizeof(Act);
  if (offloaded > 0) {
    ops_.synchronize();
    RETURN_IF_ERROR(access_->offload_saved_activation(0, layer_checkpoint(0, N), layer_checkpoint_bytes));
  }
  for (int64_t l = 0; l < L; ++l) {
    const Act* x = layer_checkpoint(l, N);  // (N, C)
    std::fill(layer_counts.begin(), layer_counts.end(), int64_t{0});
    const RouterStats stats{layer_counts.data(), forward_prob_sums_.data()};
    trace::Span span("compute", "forward", l);
    ops_.trace_phase("forward", l);
    RETURN_IF_ERROR(begin_group(static_cast<int>(1 + l), true, false));
    const Status st = layer_forward(l, x, layer_checkpoint(l + 1, N), B, T, &stats, /*grads=*/false);
    if (st.ok()) end_experts(l, true, false);
    end_group(static_cast<int>(1 + l), true, false);
    span.end();
    RETURN_IF_ERROR(st);
    if (l + 1 < offloaded) {
      ops_.synchronize();
      RETURN_IF_ERROR(
          access_->offload_saved_activation(static_cast<int>(l + 1), layer_checkpoint(l + 1, N), layer_checkpoint_bytes));
    }
    if (!config_.is_moe_layer(l)) continue;
    for (int64_t e = 0; e < E; ++e) {
      forward_counts_[e] += layer_counts[e];
      if (count_tokens) expert_counts_[l * E + e] += layer_counts[e];
    }
  }
  // With context parallelism the auxiliary loss is the whole micro-batch's, as in one process:
  // the statistics of the group's shares summed (the same bits on every rank of it).
  int64_t aux_tokens = config_.num_moe_layers() * N;
  if (context_comm_ != nullptr && config_.is_moe()) {
    Status st = parallel::sum_over_ranks(*context_comm_, std::span<int64_t>(forward_counts_));
    if (st.ok()) st = parallel::sum_over_ranks(*context_comm_, std::span<double>(forward_prob_sums_));
    if (!st.ok()) {
      access_->collectives_failed(st);
      return st.with_context("summing the router statistics over the context group");
    }
    aux_tokens *= context_comm_->world_size();
  }
  last_aux_loss_ = config_.is_moe() ? kernels::moe_aux_loss(forward_counts_.data(), forward_prob_sums_.data(),
                                                            aux_tokens, E)
                                    : 0.0;
  return Status::OK();
}

template <class Ops>
double Decoder<Ops>::forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T) {
  Result<double> loss = compute(inputs, targets, B, T, 1.0f, /*backward=*/false);
  CHECK_MSG(loss.ok(), loss.status().to_string());
  return *loss;
}

template <class Ops>
double Decoder<Ops>::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                    float grad_scale) {
  Result<double> loss = compute(inputs, targets, B, T, grad_scale, /*backward=*/true);
  CHECK_MSG(loss.ok(), loss.status().to_string());
  return *loss;
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
// RoPE's frequencies for sequences of T tokens. They are fixed but under dynamic scaling, which
// changes them for sequences longer than max_position_embeddings: each micro-batch gets those of
// its own length, as transformers computes them from the largest position. (transformers keeps
// the longest length's until a sequence within the context comes, so with lengths mixed past the
// context the two differ; a training run's fixed train.seq_len agrees.)
template <class Ops>
void Decoder<Ops>::update_rope(int64_t T) {
  const bool dynamic = config_.rope.scaling == kernels::RopeScaling::kDynamic;
  const int64_t length = dynamic ? std::max(T, config_.max_position_embeddings) : 0;
  if (inv_freq_ops_ != nullptr && length == rope_length_) return;
  // Ops queued earlier may still read the old ones (the cpu ops read inv_freq_ itself).
  if (inv_freq_ops_ != nullptr) ops_.synchronize();
  kernels::RopeConfig rope = config_.rope;
  rope.max_position_embeddings = config_.max_position_embeddings;
  kernels::rope_inv_freq(inv_freq_.data(), config_.rope_dim(), rope, length);
  inv_freq_ops_ = ops_.stage_constants(inv_freq_.data(), static_cast<int64_t>(inv_freq_.size()));
  rope_length_ = length;
  rope_scale_ = static_cast<float>(kernels::rope_attention_factor(rope));
}

template <class Ops>
MlaRope Decoder<Ops>::mla_rope() const {
  return {inv_freq_ops_, rope_scale_, staged_positions_, staged_rope_positions_};
}

template <class Ops>
Result<double> Decoder<Ops>::compute(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                   float grad_scale, bool backward, const int32_t* positions) {
  CHECK(B > 0 && T > 0);
  // With context parallelism the sequences are 2N chunks of T tokens.
  update_rope(context_comm_ != nullptr ? 2 * context_comm_->world_size() * T : T);
  CHECK_MSG(access_ != nullptr, "the model computes through a ParamAccess: set_access() first");
  check_tokens(inputs, targets, B * T);
  check_positions(positions, B, T);
  dropout_on_ = backward;
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t L = config_.num_hidden_layers;
  const bool offload = backward && access_->offloads_activations();
  const int64_t offloaded = offload ? saved_activation_count(static_cast<int>(L)) : 0;
  RETURN_IF_ERROR(forward_layers(inputs, positions, B, T, /*count_tokens=*/backward, offload));
  const int32_t* staged_targets = ops_.stage_tokens(targets, N, acts_.tokens_target);

  // The head: final norm, LM head and cross-entropy (and their backward). With tied
  // embeddings the head reads (and accumulates into) the embedding's group as well.
  const int head = static_cast<int>(layout_.num_layers() + 1);
  const bool tied = layout_.lm_head() == layout_.embed_tokens();
  // The final norm, LM head and loss, forward and backward together.
  trace::Span head_span("compute", "head");
  ops_.trace_phase("head");
  if (tied) RETURN_IF_ERROR(begin_group(0, true, backward));
  if (Status st = begin_group(head, true, backward); !st.ok()) {
    if (tied) end_group(0, true, backward);
    return st;
  }
  ops_.rmsnorm_forward(acts_.final_out, acts_.final_rstd, layer_checkpoint(L, N), param(layout_.final_norm()), N, C,
                       static_cast<float>(config_.rms_norm_eps));
  if (!backward) {
    const double loss = ops_.lm_head_cross_entropy(
        nullptr, nullptr, acts_.final_out, param_blocks(layout_.lm_head()).data(), block_rows(layout_.lm_head()),
        staged_targets, N, C, config_.vocab_size, 1.0f, ops_.lm_head_chunk_tokens(N, C, config_.vocab_size));
    end_group(head, true, false);
    if (tied) end_group(0, true, false);
    ops_.trace_phase(nullptr);
    return loss;
  }

  // The auxiliary loss's gradient with respect to the router softmax (see decoder.h).
  std::vector<float> prob_grad;
  if (config_.is_moe() && config_.output_router_logits && config_.router_aux_loss_coef > 0) {
    // Over the whole micro-batch with context parallelism (its targets and routed tokens).
    double valid = static_cast<double>(count_valid_targets(targets, N));
    int64_t aux_tokens = config_.num_moe_layers() * N;
    if (context_comm_ != nullptr) {
      Result<double> summed = parallel::sum_over_ranks(*context_comm_, valid);
      if (!summed.ok()) {
        access_->collectives_failed(summed.status());
        end_group(head, true, true);
        if (tied) end_group(0, true, true);
        return summed.status().with_context("summing the valid targets over the context group");
      }
      valid = *summed;
      aux_tokens *= context_comm_->world_size();
    }
    const double weight = static_cast<double>(grad_scale) * valid * config_.router_aux_loss_coef;
    prob_grad.resize(static_cast<size_t>(config_.num_experts));
    kernels::moe_aux_loss_prob_grad(prob_grad.data(), forward_counts_.data(), aux_tokens, config_.num_experts,
                                    weight);
  }

  // With tied embeddings lm_head() is the embedding's offset, so both gradients add up there.
  const double loss = ops_.lm_head_cross_entropy(
      acts_.d_final, grad_blocks_or_null(grad_blocks(layout_.lm_head())), acts_.final_out, param_blocks(layout_.lm_head()).data(),
      block_rows(layout_.lm_head()), staged_targets, N, C, config_.vocab_size, grad_scale,
      ops_.lm_head_chunk_tokens(N, C, config_.vocab_size));
  ops_.rmsnorm_backward(acts_.dres, grad(layout_.final_norm()), acts_.d_final, layer_checkpoint(L, N),
                        param(layout_.final_norm()), acts_.final_rstd, N, C);
  end_group(head, true, true);
  if (tied) end_group(0, true, true);
  head_span.end();
  last_mtp_nll_ = 0.0;
  last_mtp_targets_ = 0;
  if (config_.trains_mtp()) RETURN_IF_ERROR(mtp_forward_backward(inputs, targets, positions, B, T, grad_scale));
  for (int64_t l = L - 1; l >= 0; --l) {
    Act* x = layer_checkpoint(l, N);  // (N, C)
    // The scratch still holds the last layer's intermediates (and routing) from forward, and
    // with kept layers every layer's are in its own set; otherwise the layer is recomputed from
    // its layer checkpoint. Either way the experts that received tokens are begun, parameters
    // and gradients, for the backward.
    // (The MTP block ran in the scratch since the last layer's forward.)
    const bool recompute = (l != L - 1 || config_.trains_mtp()) && !keep_layers_;
    // Fetching the layer's state (and its offloaded layer checkpoint) belongs to the recompute
    // span when there is one, else to the backward's.
    trace::Span recompute_span("compute", recompute ? "recompute" : "backward", l);
    ops_.trace_phase(recompute ? "recompute" : "backward", l);
    // An offloaded layer checkpoint's slot has been reused since forward: fetch it back first.
    if (l < offloaded)
      RETURN_IF_ERROR(access_->fetch_saved_activation(static_cast<int>(l), x, static_cast<uint64_t>(N * C) * sizeof(Act)));
    RETURN_IF_ERROR(begin_group(static_cast<int>(1 + l), true, true));
    const Status st = recompute ? layer_forward(l, x, /*out=*/nullptr, B, T, /*stats=*/nullptr, /*grads=*/true)
                                : begin_experts(l, true, true);
    if (recompute) recompute_span.end();
    std::optional<trace::Span> backward_span;  // releasing the group belongs to the backward
    if (recompute) {
      backward_span.emplace("compute", "backward", l);
      ops_.trace_phase("backward", l);
    }
    Status done = st;
    if (st.ok()) {
      done = layer_backward(l, x, acts_.dres, B, T, prob_grad.empty() ? nullptr : prob_grad.data());
      end_experts(l, true, true);
    }
    end_group(static_cast<int>(1 + l), true, true);
    backward_span.reset();
    RETURN_IF_ERROR(done);
  }
  // A frozen embedding (LoRA) takes no gradient.
  if (frozen(layout_.embed_tokens())) {
    ops_.trace_phase(nullptr);
    return loss;
  }
  trace::Span span("compute", "embedding backward");
  ops_.trace_phase("embedding backward");
  RETURN_IF_ERROR(begin_group(0, false, true));
  ops_.embedding_backward(grad_blocks(layout_.embed_tokens()).data(), block_rows(layout_.embed_tokens()), acts_.dres,
                          staged_inputs_, N, C, config_.vocab_size);
  end_group(0, false, true);
  ops_.trace_phase(nullptr);
  return loss;
}

template <class Ops>
Status Decoder<Ops>::mtp_forward_backward(const int32_t* inputs, const int32_t* targets, const int32_t* positions,
                                          int64_t B, int64_t T, float grad_scale) {
  CHECK_MSG(context_comm_ == nullptr && expert_comm_ == nullptr,
            "multi-token prediction with context or expert parallelism");
  const int64_t D = config_.num_nextn_predict_layers;
  trace::Span span("compute", "mtp");
  ops_.trace_phase("mtp");
  // The hidden states of the modules before the last, then each module's forward again with its
  // backward, the last first: module k's backward gives module k - 1's output its gradient.
  for (int64_t k = 1; k < D; ++k) RETURN_IF_ERROR(mtp_module(k, inputs, targets, positions, B, T, grad_scale, false));
  for (int64_t k = D; k >= 1; --k) RETURN_IF_ERROR(mtp_module(k, inputs, targets, positions, B, T, grad_scale, true));
  ops_.trace_phase(nullptr);
  return Status::OK();
}

template <class Ops>
Status Decoder<Ops>::mtp_module(int64_t k, const int32_t* inputs, const int32_t* targets, const int32_t* positions,
                                int64_t B, int64_t T, float grad_scale, bool backward) {
  const int64_t N = B * T;
  const int64_t C = config_.hidden_size;
  const int64_t V = config_.vocab_size;
  const int64_t D = config_.num_nextn_predict_layers;
  const int64_t block = config_.num_hidden_layers + k - 1;  // the module's block
  const float eps = static_cast<float>(config_.rms_norm_eps);
  // Module k's input hidden state (the last layer's output, or module k - 1's), where its
  // gradient goes (added to dres, or written for module k - 1's backward), and for k < D its own
  // output and the gradient module k + 1 gave it.
  const Act* hidden = k == 1 ? layer_checkpoint(config_.num_hidden_layers, N) : acts_.mtp_hidden + (k - 2) * N * C;
  Act* d_hidden = k == 1 ? nullptr : acts_.mtp_d_hidden + (k - 2) * N * C;
  Act* out = k < D ? acts_.mtp_hidden + (k - 1) * N * C : acts_.mtp_out;
  const Act* d_out = k < D ? acts_.mtp_d_hidden + (k - 1) * N * C : nullptr;

  // Its tokens: position t reads the input at t + k (the token after the row at t + k = T: the
  // row's last target, or 0 where that is ignored; beyond it 0, where nothing is predicted) and
  // predicts the target at t + k. With document masks a position predicts nothing across the start
  // of a document.
  ops_.synchronize();  // queued ops may still read the host arrays
  mtp_tokens_.resize(static_cast<size_t>(2 * N));
  int32_t* in = mtp_tokens_.data();
  int32_t* target = in + N;
  int64_t valid = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t, ahead = t + k;
      in[i] = ahead < T ? inputs[i + k] : ahead == T ? std::max(targets[b * T + T - 1], 0) : 0;
      bool crosses = false;
      for (int64_t j = t + 1; positions != nullptr && j <= ahead && j < T; ++j) crosses = crosses || positions[b * T + j] == 0;
      target[i] = ahead < T && !crosses ? targets[i + k] : -1;
      valid += target[i] >= 0 ? 1 : 0;
    }
  }
  const int32_t* staged_in = ops_.stage_tokens(in, N, acts_.tokens_mtp_in);
  const int32_t* staged_target = ops_.stage_tokens(target, N, acts_.tokens_mtp_target);

  RETURN_IF_ERROR(begin_group(0, true, false));
  ops_.embedding_forward(acts_.mtp_embed, staged_in, param_blocks(layout_.embed_tokens()).data(),
                         block_rows(layout_.embed_tokens()), N, C, V);
  end_group(0, true, false);

  const int group = static_cast<int>(1 + block);
  RETURN_IF_ERROR(begin_group(group, true, backward));
  const auto p = LayerTensors<const W>::bind_with(param_at(), layout_.layer(block));
  ops_.rmsnorm_forward(acts_.mtp_en, acts_.mtp_e_rstd, acts_.mtp_embed, p.mtp_enorm, N, C, eps);
  ops_.rmsnorm_forward(acts_.mtp_hn, acts_.mtp_h_rstd, hidden, p.mtp_hnorm, N, C, eps);
  ops_.copy_columns(acts_.mtp_cat, 2 * C, acts_.mtp_en, C, N, C, kernels::ColumnOrder::kSame);
  ops_.copy_columns(acts_.mtp_cat + C, 2 * C, acts_.mtp_hn, C, N, C, kernels::ColumnOrder::kSame);
  ops_.linear_forward(acts_.mtp_x, acts_.mtp_cat, p.mtp_eh_proj, nullptr, N, 2 * C, C);
  // The expert counts (the selection bias's) once per module: in the pass with backward.
  std::vector<int64_t> counts(static_cast<size_t>(config_.num_experts), 0);
  std::vector<double> prob_sums(counts.size(), 0.0);
  const RouterStats stats{counts.data(), prob_sums.data()};
  Status st = layer_forward(block, acts_.mtp_x, out, B, T, backward ? &stats : nullptr, /*grads=*/backward);
  if (!st.ok() || !backward) {
    if (st.ok()) end_experts(block, true, false);
    end_group(group, true, backward);
    return st;
  }
  for (size_t e = 0; e < counts.size(); ++e) expert_counts_[static_cast<size_t>(block) * counts.size() + e] += counts[e];
  const LayerGrads g = LayerGrads::bind_with(grad_at(), layout_.layer(block));

  // Its head: shared_head.norm, then the model's LM head and cross-entropy (with tied
  // embeddings the head reads the embedding's group).
  const int head = static_cast<int>(layout_.num_layers() + 1);
  const bool tied = layout_.lm_head() == layout_.embed_tokens();
  st = tied ? begin_group(0, true, true) : Status::OK();
  if (st.ok()) {
    st = begin_group(head, true, true);
    if (!st.ok() && tied) end_group(0, true, true);
  }
  if (!st.ok()) {
    end_experts(block, true, true);
    end_group(group, true, true);
    return st;
  }
  const float scale = grad_scale * static_cast<float>(config_.mtp_loss_weight / static_cast<double>(D));
  ops_.rmsnorm_forward(acts_.final_out, acts_.final_rstd, out, p.mtp_head_norm, N, C, eps);
  last_mtp_nll_ += ops_.lm_head_cross_entropy(
      acts_.d_final, grad_blocks_or_null(grad_blocks(layout_.lm_head())), acts_.final_out, param_blocks(layout_.lm_head()).data(),
      block_rows(layout_.lm_head()), staged_target, N, C, V, scale, ops_.lm_head_chunk_tokens(N, C, V));
  last_mtp_targets_ += valid;
  ops_.rmsnorm_backward(acts_.mtp_dres, g.mtp_head_norm, acts_.d_final, out, p.mtp_head_norm, acts_.final_rstd, N, C);
  end_group(head, true, true);
  if (tied) end_group(0, true, true);
  if (d_out != nullptr) ops_.add_inplace(acts_.mtp_dres, d_out, N * C);

  // Back through the block, eh_proj and the two norms: the hidden state's part goes to the
  // module before (or adds to dres).
  st = layer_backward(block, acts_.mtp_x, acts_.mtp_dres, B, T, /*prob_grad=*/nullptr);
  end_experts(block, true, true);
  if (!st.ok()) {
    end_group(group, true, true);
    return st;
  }
  ops_.linear_backward(acts_.d_mtp_cat, g.mtp_eh_proj, nullptr, acts_.mtp_dres, acts_.mtp_cat, p.mtp_eh_proj, N,
                       2 * C, C);
  ops_.copy_columns(acts_.mtp_en, C, acts_.d_mtp_cat, 2 * C, N, C, kernels::ColumnOrder::kSame);
  ops_.copy_columns(acts_.mtp_hn, C, acts_.d_mtp_cat + C, 2 * C, N, C, kernels::ColumnOrder::kSame);
  ops_.rmsnorm_backward(acts_.mtp_x, g.mtp_enorm, acts_.mtp_en, acts_.mtp_embed, p.mtp_enorm, acts_.mtp_e_rstd, N, C);
  if (d_hidden != nullptr) {
    ops_.rmsnorm_backward(d_hidden, g.mtp_hnorm, acts_.mtp_hn, hidden, p.mtp_hnorm, acts_.mtp_h_rstd, N, C);
  } else {
    ops_.rmsnorm_backward(acts_.d_tmp, g.mtp_hnorm, acts_.mtp_hn, hidden, p.mtp_hnorm, acts_.mtp_h_rstd, N, C);
    ops_.add_inplace(acts_.dres, acts_.d_tmp, N * C);
  }
  end_group(group, true, true);

  if (frozen(layout_.embed_tokens())) return Status::OK();
  RETURN_IF_ERROR(begin_group(0, false, true));
  ops_.embedding_backward(grad_blocks(layout_.embed_tokens()).data(), block_rows(layout_.embed_tokens()), acts_.mtp_x,
                          staged_in, N, C, V);
  end_group(0, false, true);
  return Status::OK();
}

// ---- LoRA ------------------------------------------------------------------------------------

template <class Ops>
kernels::LoraDropout Decoder<Ops>::lora_dropout(int64_t weight, int64_t row0) const {
  kernels::LoraDropout d;
  if (!dropout_on_ || !(config_.lora.dropout > 0)) return d;
  d.p = static_cast<float>(config_.lora.dropout);
  // One mask per adapted weight: the step's seed mixed with the weight's offset.
  uint64_t z = dropout_seed_ ^ (static_cast<uint64_t>(weight) * 0xD1B54A32D192ED03ull);
  z = (z ^ (z >> 32)) * 0x9E3779B97F4A7C15ull;
  d.seed = z ^ (z >> 29);
  d.row0 = row0;
  return d;
}

template <class Ops>
void Decoder<Ops>::lora_forward(int64_t weight, Act* y, const Act* x, int64_t n, int64_t IC, int64_t OC, int64_t row0) {
  const LoraOffsets* lo = layout_.lora_of(weight);
  if (lo == nullptr) return;
  ops_.lora_forward(y, x, param(lo->a), param(lo->b), config_.lora.scale(), lora_dropout(weight, row0), n, IC, OC,
                    config_.lora.rank);
}

template <class Ops>
void Decoder<Ops>::lora_backward(int64_t weight, Act* dx, const Act* dy, const Act* x, int64_t n, int64_t IC,
                                 int64_t OC, int64_t row0) {
  const LoraOffsets* lo = layout_.lora_of(weight);
  if (lo == nullptr) return;
  ops_.lora_backward(dx, grad(lo->a), grad(lo->b), dy, x, param(lo->a), param(lo->b), config_.lora.scale(), lora_dropout(weight, row0),
                     n, IC, OC, config_.lora.rank);
}

template <class Ops>
MoeAdapters<Ops> Decoder<Ops>::moe_adapters(int64_t layer) {
  MoeAdapters<Ops> m;
  m.offsets = &layout_.layer(layer).moe;
  m.experts = config_.lora.targets_any(kLoraExperts);
  m.forward = [this](int64_t weight, Act* y, const Act* x, int64_t n, int64_t IC, int64_t OC, int64_t row0) {
    lora_forward(weight, y, x, n, IC, OC, row0);
  };
  m.backward = [this](int64_t weight, Act* dx, const Act* dy, const Act* x, int64_t n, int64_t IC, int64_t OC,
                      int64_t row0) { lora_backward(weight, dx, dy, x, n, IC, OC, row0); };
  return m;
}

// ---- generation ------------------------------------------------------------------------------

template <class Ops>
Status Decoder<Ops>::begin_sequence(int64_t capacity, int64_t max_chunk) {
  CHECK_MSG(access_ != nullptr, "the model computes through a ParamAccess: set_access() first");
  CHECK_MSG(expert_comm_ == nullptr, "generation with expert parallelism (set_expert_comm(nullptr) first)");
  CHECK_MSG(context_comm_ == nullptr, "generation with context parallelism (set_context_comm(nullptr) first)");
  kv_capacity_ = kv_chunk_ = kv_length_ = 0;
  RETURN_IF_ERROR(config_.check_generation());
  if (capacity < 1 || max_chunk < 1 || max_chunk > capacity) {
    return Status::InvalidArgument(fmt::format("a sequence of {} tokens decoded {} at a time: both must be positive, "
                                               "the second at most the first",
                                               capacity, max_chunk));
  }
  RETURN_IF_ERROR(config_.check_sequence_length(capacity, "model config"));
  const std::optional<int64_t> cache_bytes =
      checked_product(config_.num_hidden_layers, int64_t{2}, capacity, config_.kv_dim(),
                      static_cast<int64_t>(sizeof(Act)));
  if (!cache_bytes) {
    return Status::InvalidArgument(
        fmt::format("a KV cache of {} tokens for this model does not fit in 64-bit sizes", capacity));
  }
  RETURN_IF_ERROR(acts_.reserve(ops_, config_, 1, max_chunk, /*offload_activations=*/false, /*keep_layers=*/false,
                                capacity));
  kv_capacity_ = capacity;
  kv_chunk_ = max_chunk;
  return Status::OK();
}

template <class Ops>
Status Decoder<Ops>::decode(const int32_t* tokens, int64_t n, float* logits) {
  CHECK_MSG(access_ != nullptr, "the model computes through a ParamAccess: set_access() first");
  dropout_on_ = false;
  if (kv_capacity_ == 0 || acts_.kv_tokens() != kv_capacity_) {
    return Status::InvalidArgument("decode needs a sequence: call begin_sequence first (a compute() ends one)");
  }
  if (n < 1 || n > kv_chunk_ || kv_length_ + n > kv_capacity_) {
    return Status::InvalidArgument(fmt::format("decode of {} tokens after {}: at most {} at a time and {} in all", n,
                                               kv_length_, kv_chunk_, kv_capacity_));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) {
      return Status::InvalidArgument(fmt::format("token {} at position {} is outside the model's vocabulary [0, {})",
                                                 tokens[i], kv_length_ + i, config_.vocab_size));
    }
  }
  const int64_t past = kv_length_;
  const int64_t C = config_.hidden_size;
  const int64_t L = config_.num_hidden_layers;
  const int64_t layer_kv = kv_capacity_ * config_.kv_dim();  // elements of one layer's keys
  update_rope(past + n);
  // The residual stream alternates between two slots of the layer checkpoints.
  auto residual = [&](int64_t l) { return acts_.layer_checkpoints + (l % 2) * n * C; };
  const int32_t* staged = staged_inputs_ = ops_.stage_tokens(tokens, n, acts_.tokens_in);
  staged_positions_ = nullptr;
  staged_rope_positions_ = nullptr;
  RETURN_IF_ERROR(begin_group(0, true, false));
  ops_.embedding_forward(residual(0), staged, param_blocks(layout_.embed_tokens()).data(),
                         block_rows(layout_.embed_tokens()), n, C, config_.vocab_size);
  end_group(0, true, false);
  for (int64_t l = 0; l < L; ++l) {
    const KvSlot kv{acts_.kv_cache + 2 * l * layer_kv, acts_.kv_cache + (2 * l + 1) * layer_kv, past};
    RETURN_IF_ERROR(begin_group(static_cast<int>(1 + l), true, false));
    const Status st = layer_forward(l, residual(l), residual(l + 1), 1, n, /*stats=*/nullptr, /*grads=*/false, &kv);
    if (st.ok()) end_experts(l, true, false);
    end_group(static_cast<int>(1 + l), true, false);
    RETURN_IF_ERROR(st);
  }
  RETURN_IF_ERROR(decode_head(residual(L) + (n - 1) * C, logits));
  kv_length_ += n;
  return Status::OK();
}

template <class Ops>
Status Decoder<Ops>::decode_head(const Act* x /*(C)*/, float* logits /*(V)*/) {
  const int64_t C = config_.hidden_size;
  const int64_t V = config_.vocab_size;
  const int head = static_cast<int>(layout_.num_layers() + 1);
  const bool tied = layout_.lm_head() == layout_.embed_tokens();
  if (tied) RETURN_IF_ERROR(begin_group(0, true, false));
  if (Status st = begin_group(head, true, false); !st.ok()) {
    if (tied) end_group(0, true, false);
    return st;
  }
  ops_.rmsnorm_forward(acts_.final_out, acts_.final_rstd, x, param(layout_.final_norm()), 1, C,
                       static_cast<float>(config_.rms_norm_eps));
  // The LM head block by block of vocabulary rows (the last block may be shorter).
  const std::vector<const W*> blocks = param_blocks(layout_.lm_head());
  const int64_t rows = block_rows(layout_.lm_head());
  for (size_t b = 0; b < blocks.size(); ++b) {
    const int64_t first = static_cast<int64_t>(b) * rows;
    ops_.linear_forward_f32(acts_.logits + first, acts_.final_out, blocks[b], 1, C, std::min(rows, V - first));
  }
  ops_.copy_to_host(logits, acts_.logits, V);
  end_group(head, true, false);
  if (tied) end_group(0, true, false);
  return Status::OK();
}

}  // namespace strata::model

#include "model/ring_attention.h"
