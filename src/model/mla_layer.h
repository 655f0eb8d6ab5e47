// Multi-head latent attention (DeepSeek-V2/V3), written once over a backend's op set (the Ops of
// model/decoder.h). From a layer's normalised input x (N, C), with H heads, nope = qk_nope_head_dim,
// r = qk_rope_head_dim, dv = v_head_dim, D = nope + r:
//   q   = q_proj(x), or q_b_proj(rmsnorm(q_a_proj(x)))          (N, H, D)
//   kva = kv_a_proj_with_mqa(x)                                (N, kv_lora_rank + r)
//   kv  = kv_b_proj(rmsnorm(kva[:, :kv_lora_rank]))            (N, H, nope + dv)
//   k   = [kv[..., :nope], rope(kva[:, kv_lora_rank:])]        the RoPE key shared by the heads
//   v   = kv[..., nope:]
//   q[..., nope:] = rope(q[..., nope:])
//   att = softmax(q k^T * scale, causal) v                      (N, H, dv), o_proj's input
// RoPE dims are de-interleaved before they turn, as DeepSeek's modeling code does
// (kernels/columns.h). scale = D^-1/2, times mscale^2 under YaRN with mscale_all_dim (DeepSeek's
// softmax_scale). Intermediates live in the ActivationTable: the layer's own (a) are kept for
// backward, the scratch (t, the table itself) is reused by every layer.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/columns.h"
#include "kernels/rope.h"
#include "model/activations.h"
#include "model/config.h"
#include "model/params.h"

namespace strata::model {

// DeepSeek's softmax scale: head_dim^-1/2, times yarn_get_mscale(factor, mscale_all_dim)^2 when
// YaRN scaling gives mscale_all_dim (0.1 * m * ln(factor) + 1 for factor > 1).
inline double mla_softmax_scale(const ModelConfig& c) {
  double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  if (c.rope.scaling == kernels::RopeScaling::kYarn && c.rope.mscale_all_dim != 0 && c.rope.factor > 1) {
    const double m = 0.1 * c.rope.mscale_all_dim * std::log(c.rope.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

// Where RoPE's inputs and the sequence's layout come from (the decoder's staged copies).
struct MlaRope {
  const float* inv_freq = nullptr;  // (r/2), where the ops read it
  float scale = 1.0f;               // YaRN's attention factor on cos and sin
  const int32_t* positions = nullptr;       // document positions (attention masks) or null
  const int32_t* rope_positions = nullptr;  // the positions RoPE turns by, or null
};

// Writes a.q, a.k, a.v, a.att and a.lse (and the latent intermediates a keeps) from x = a.ln1.
template <class Ops>
void mla_attention_forward(Ops& ops, const ModelConfig& c, const LayerTensors<const typename Ops::W>& p,
                           const ActivationTable<Ops>& a, const ActivationTable<Ops>& t, int64_t B, int64_t T,
                           const MlaRope& rope) {
  using kernels::ColumnOrder;
  const int64_t N = B * T, C = c.hidden_size, H = c.num_attention_heads;
  const int64_t nope = c.qk_nope_head_dim, r = c.qk_rope_head_dim, dv = c.v_head_dim, D = c.head_dim;
  const int64_t Rq = c.q_lora_rank, Rkv = c.kv_lora_rank;
  // DeepSeek's modeling code builds the two latent norms with RMSNorm's default eps, whatever
  // rms_norm_eps says.
  constexpr float eps = 1e-6f;

  // Queries, and RoPE on each head's last r dims through a contiguous copy.
  if (Rq > 0) {
    ops.linear_forward(a.mla_q_a, a.ln1, p.q_a_proj, nullptr, N, C, Rq);
    ops.rmsnorm_forward(a.mla_q_an, a.mla_q_a_rstd, a.mla_q_a, p.q_a_layernorm, N, Rq, eps);
    ops.linear_forward(a.q, a.mla_q_an, p.q_b_proj, nullptr, N, Rq, H * D);
  } else {
    ops.linear_forward(a.q, a.ln1, p.q_proj, nullptr, N, C, H * D);
  }
  ops.copy_columns(t.mla_pe, r, a.q + nope, D, N * H, r, ColumnOrder::kDeinterleave);
  ops.rope_forward(t.mla_pe, t.mla_pe, rope.inv_freq, B, T, H, r, rope.scale, 0, rope.rope_positions);
  ops.copy_columns(a.q + nope, D, t.mla_pe, r, N * H, r, ColumnOrder::kSame);

  // The latent: its normalised part for kv_b_proj, its RoPE key for every head.
  ops.linear_forward(t.mla_kv_a, a.ln1, p.kv_a_proj, nullptr, N, C, Rkv + r);
  ops.copy_columns(a.mla_ckv, Rkv, t.mla_kv_a, Rkv + r, N, Rkv, ColumnOrder::kSame);
  ops.rmsnorm_forward(a.mla_kv_an, a.mla_kv_rstd, a.mla_ckv, p.kv_a_layernorm, N, Rkv, eps);
  ops.linear_forward(t.mla_kv, a.mla_kv_an, p.kv_b_proj, nullptr, N, Rkv, H * (nope + dv));
  ops.copy_columns(t.mla_pe, r, t.mla_kv_a + Rkv, Rkv + r, N, r, ColumnOrder::kDeinterleave);
  ops.rope_forward(t.mla_pe, t.mla_pe, rope.inv_freq, B, T, 1, r, rope.scale, 0, rope.rope_positions);

  // Each head's key and value, contiguous for attention.
  ops.copy_columns(a.k, D, t.mla_kv, nope + dv, N * H, nope, ColumnOrder::kSame);
  for (int64_t h = 0; h < H; ++h) ops.copy_columns(a.k + h * D + nope, H * D, t.mla_pe, r, N, r, ColumnOrder::kSame);
  ops.copy_columns(a.v, dv, t.mla_kv + nope, nope + dv, N * H, dv, ColumnOrder::kSame);
  ops.attention_forward(a.att, a.lse, a.q, a.k, a.v, B, T, H, H, D, 0, rope.positions, dv, mla_softmax_scale(c));
}

// From a.d_att (dL/d att), adds the layer's attention weight gradients into g and writes dL/dx
// (x = a.ln1) into dx. Uses t's scratch and a.d_tmp.
template <class Ops>
void mla_attention_backward(Ops& ops, const ModelConfig& c, const LayerTensors<const typename Ops::W>& p,
                            const LayerTensors<float>& g, const ActivationTable<Ops>& a,
                            const ActivationTable<Ops>& t, int64_t B, int64_t T, const MlaRope& rope,
                            typename Ops::Act* dx /*(N,C)*/) {
  using kernels::ColumnOrder;
  const int64_t N = B * T, C = c.hidden_size, H = c.num_attention_heads;
  const int64_t nope = c.qk_nope_head_dim, r = c.qk_rope_head_dim, dv = c.v_head_dim, D = c.head_dim;
  const int64_t Rq = c.q_lora_rank, Rkv = c.kv_lora_rank;

  ops.attention_backward(t.d_q, t.d_k, t.d_v, t.d_att, a.q, a.k, a.v, a.att, a.lse, B, T, H, H, D, rope.positions,
                         dv, mla_softmax_scale(c));
  // Queries: RoPE's backward on the RoPE dims, back in the checkpoint's interleaved order.
  ops.copy_columns(t.mla_pe, r, t.d_q + nope, D, N * H, r, ColumnOrder::kSame);
  ops.rope_backward(t.mla_pe, t.mla_pe, rope.inv_freq, B, T, H, r, rope.scale, rope.rope_positions);
  ops.copy_columns(t.d_q + nope, D, t.mla_pe, r, N * H, r, ColumnOrder::kInterleave);
  if (Rq > 0) {
    ops.linear_backward(t.d_mla_q_an, g.q_b_proj, nullptr, t.d_q, a.mla_q_an, p.q_b_proj, N, Rq, H * D);
    ops.rmsnorm_backward(t.d_mla_q_a, g.q_a_layernorm, t.d_mla_q_an, a.mla_q_a, p.q_a_layernorm, a.mla_q_a_rstd, N,
                         Rq);
    ops.linear_backward(dx, g.q_a_proj, nullptr, t.d_mla_q_a, a.ln1, p.q_a_proj, N, C, Rq);
  } else {
    ops.linear_backward(dx, g.q_proj, nullptr, t.d_q, a.ln1, p.q_proj, N, C, H * D);
  }

  // Keys and values back into kv_b_proj's output; the shared RoPE key's gradient is the sum over
  // the heads.
  ops.copy_columns(t.mla_kv, nope + dv, t.d_k, D, N * H, nope, ColumnOrder::kSame);
  ops.copy_columns(t.mla_kv + nope, nope + dv, t.d_v, dv, N * H, dv, ColumnOrder::kSame);
  ops.sum_head_columns(t.mla_pe, t.d_k + nope, H * D, D, N, H, r);
  ops.rope_backward(t.mla_pe, t.mla_pe, rope.inv_freq, B, T, 1, r, rope.scale, rope.rope_positions);
  ops.copy_columns(t.mla_kv_a + Rkv, Rkv + r, t.mla_pe, r, N, r, ColumnOrder::kInterleave);
  ops.linear_backward(t.d_mla_kv_an, g.kv_b_proj, nullptr, t.mla_kv, a.mla_kv_an, p.kv_b_proj, N, Rkv,
                      H * (nope + dv));
  ops.rmsnorm_backward(t.d_mla_ckv, g.kv_a_layernorm, t.d_mla_kv_an, a.mla_ckv, p.kv_a_layernorm, a.mla_kv_rstd, N,
                       Rkv);
  ops.copy_columns(t.mla_kv_a, Rkv + r, t.d_mla_ckv, Rkv, N, Rkv, ColumnOrder::kSame);
  ops.linear_backward(t.d_tmp, g.kv_a_proj, nullptr, t.mla_kv_a, a.ln1, p.kv_a_proj, N, C, Rkv + r);
  ops.add_inplace(dx, t.d_tmp, N * C);
}

}  // namespace strata::model
