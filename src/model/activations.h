// The activation table of the decoder (model/decoder.h): every buffer forward and backward use,
// planned in one list of (field, size), allocated as ONE block and handed out as pointers (as
// llm.c does). N = B * T tokens; C hidden; F the widest dense MLP (ModelConfig::dense_mlp_width:
// dense layers and the shared expert); Hq, Hkv heads; D head dim; L layers. MoE: E experts, K
// per token, S = N * K expert rows, Fe one expert's width. Buffers a config does not use are
// empty. Expert parallelism over P ranks (model/expert_parallel.h): a rank's experts may receive
// the rows of all P ranks, so the experts' own buffers have R = P * S rows (R = S without it).
//
// Ops is the backend's op set (model/decoder.h): its Act is the activation storage type (float,
// or bf16 in the GPU recipe) and its activation_block() the memory (host memory on the CPU,
// the device's budgeted arena on CUDA). Saved statistics (rstd, lse) and the router's buffers
// are fp32 on every backend.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/micro_batch_shape.h"
#include "model/config.h"

namespace strata::model {

// The dimensions an op set sizes its per-micro-batch buffers by, for N tokens of `config`.
// expert_ranks: the expert group's (expert_parallel.h), whose rows an expert may compute.
inline kernels::MicroBatchShape micro_batch_shape(const ModelConfig& config, int64_t N, int64_t expert_ranks = 1) {
  kernels::MicroBatchShape s;
  s.P = config.is_moe() ? expert_ranks : 1;
  s.N = N;
  s.E = config.is_moe() ? config.num_experts : 0;
  s.K = config.is_moe() ? config.num_experts_per_tok : 0;
  s.C = config.hidden_size;
  s.F = std::max({config.q_dim(), config.kv_dim(), config.dense_mlp_width(),
                  config.is_moe() ? config.moe_intermediate_size : int64_t{0}});
  s.V = config.vocab_size;
  return s;
}

template <class Ops>
class ActivationTable {
 public:
  using Act = typename Ops::Act;
  // Plans for B x T tokens. Every size depends on N = B * T only; the block is reallocated
  // only when N grows or `offload_activations` changes, and the pointers below are valid until
  // then. With offload_activations the layer checkpoints get min(3, L + 1) slots (see below).
  // The block comes from ops.activation_block(), which may fail (OutOfMemory on a device).
  // keep_layers: every layer but the last also keeps its own copy of what its backward reads
  // (layer(l)), so that backward recomputes nothing. kv_tokens > 0: generation's buffers too, a
  // KV cache of that many positions and one row of logits (kv_cache, logits); the block is then
  // planned for exactly these arguments (a call with others plans it anew, the cache lost).
  // expert_ranks: P above (1: no expert parallelism). mlp_tile > 0: the dense MLP and the shared
  // expert run over tiles of that many tokens (Decoder::set_mlp_tile_tokens), so gate, up, act
  // and their gradients hold min(N, mlp_tile) rows (mlp_rows()) and no layer keeps them; and
  // without expert parallelism the routed experts run over tiles of that many rows of the expert
  // order (expert_rows(): expert_gate .. d_expert_act, none kept by a layer either).
  // context_ranks: the context group's ranks with context parallelism, whose ring buffers the
  // table then holds too (ring_k .. ring_dq); 0 without.
  Status reserve(Ops& ops, const ModelConfig& config, int64_t B, int64_t T, bool offload_activations = false,
                 bool keep_layers = false, int64_t kv_tokens = 0, int64_t expert_ranks = 1, int64_t mlp_tile = 0,
                 int64_t context_ranks = 0);
  // Bytes held (for logging and tests).
  int64_t bytes() const { return bytes_; }
  // The tokens per micro-batch the buffers hold (N; 0 before reserve()).
  int64_t planned_tokens() const { return planned_tokens_; }
  // The bytes reserve() would take, the backend's own per-micro-batch buffers included, without
  // allocating.
  static int64_t bytes_for(const ModelConfig& config, int64_t N, bool offload_activations, bool keep_layers = false,
                           int64_t expert_ranks = 1, int64_t mlp_tile = 0, int64_t context_ranks = 0);
  // Rows of the dense MLP's buffers (gate .. act, d_gate .. d_act): N, or the token tile.
  int64_t mlp_rows() const { return mlp_rows_; }
  // Whether the routed experts run in tiles of expert_rows() rows of the expert order (their
  // intermediates expert_gate .. d_expert_act hold that many; expert_tile_offsets the tile's
  // offsets), rather than on all R rows at once.
  bool experts_tiled() const { return experts_tiled_; }
  int64_t expert_rows() const { return expert_rows_; }
  // Whether the table was planned with the MLP in token tiles: its kept layers then hold none of
  // the MLP's intermediates, so the MLP runs tile by tile whatever the micro-batch (a later one
  // may be no larger than a tile).
  bool mlp_tiled() const { return mlp_tiled_; }
  // The buffers layer l's forward writes and its backward reads: its own when the table keeps
  // layers (l < L - 1, and l = L - 1 with an MTP module), the shared ones otherwise (the MTP
  // block's always).
  const ActivationTable& layer(int64_t l) const {
    return static_cast<size_t>(l) < layer_views_.size() ? layer_views_[static_cast<size_t>(l)] : *this;
  }
  // Slots of N * C elements in `layer_checkpoints`: L + 1, or min(3, L + 1) when planned for
  // offload.
  int64_t layer_checkpoint_slots() const { return layer_checkpoint_slots_; }

  // Kept across the whole forward/backward.
  // (slots, N, C) the saved activations at layer boundaries (layer checkpoints). Without offload,
  // slot l holds the input of layer l and slot L feeds the final norm. With offload, layer
  // checkpoint l < L rotates through slots l % 2 and layer checkpoint L is slot min(L, 2).
  Act* layer_checkpoints = nullptr;
  Act* final_out = nullptr;    // (N, C) final RMSNorm output, the LM head's input
  float* final_rstd = nullptr;   // (N)
  Act* d_final = nullptr;      // (N, C) gradient of final_out
  Act* dres = nullptr;         // (N, C) gradient of the residual stream

  // The MTP module (ModelConfig::trains_mtp; decoder_impl.h, mtp_forward_backward): the embedding
  // of the tokens one ahead and its norm, the norm of the model's last hidden state, their
  // concatenation (embedding first) and its gradient, the block's input and output, and the
  // gradient of the block's output.
  Act* mtp_embed = nullptr;     // (N, C)
  Act* mtp_en = nullptr;        // (N, C) enorm output, later its gradient
  Act* mtp_hn = nullptr;        // (N, C) hnorm output, later its gradient
  float* mtp_e_rstd = nullptr;  // (N)
  float* mtp_h_rstd = nullptr;  // (N)
  Act* mtp_cat = nullptr;       // (N, 2C) eh_proj's input
  Act* d_mtp_cat = nullptr;     // (N, 2C)
  Act* mtp_x = nullptr;         // (N, C) the block's input, later the embedding's gradient
  Act* mtp_out = nullptr;       // (N, C) the block's output
  Act* mtp_dres = nullptr;      // (N, C) gradient through the block
  // With D > 1 modules: modules 1 .. D-1's outputs (the next module's input hidden state) and
  // their gradients.
  Act* mtp_hidden = nullptr;    // (D - 1, N, C)
  Act* mtp_d_hidden = nullptr;  // (D - 1, N, C)

  // One layer's intermediates, written by forward and again by backward's recomputation.
  Act* ln1 = nullptr;       // (N, C) input_layernorm output
  float* ln1_rstd = nullptr;  // (N)
  Act* q = nullptr;         // (N, Hq*D) after RoPE
  Act* k = nullptr;         // (N, Hkv*D) after RoPE
  Act* q_raw = nullptr;     // (N, Hq*D) q_proj output before q_norm (qk_norm only)
  Act* k_raw = nullptr;     // (N, Hkv*D) k_proj output before k_norm (qk_norm only)
  float* q_norm_rstd = nullptr;  // (N*Hq) (qk_norm only)
  float* k_norm_rstd = nullptr;  // (N*Hkv) (qk_norm only)
  Act* v = nullptr;         // (N, Hkv*Dv) (Dv: ModelConfig::value_head_dim)
  Act* att = nullptr;       // (N, Hq*Dv) attention output before o_proj
  // Multi-head latent attention (model/mla_layer.h): the low-rank q and its norm (q_lora_rank),
  // the compressed kv and its norm.
  Act* mla_q_a = nullptr;         // (N, q_lora_rank)
  Act* mla_q_an = nullptr;        // (N, q_lora_rank)
  float* mla_q_a_rstd = nullptr;  // (N)
  Act* mla_ckv = nullptr;         // (N, kv_lora_rank)
  Act* mla_kv_an = nullptr;       // (N, kv_lora_rank)
  float* mla_kv_rstd = nullptr;   // (N)
  float* lse = nullptr;       // (B, Hq, T) softmax log-sum-exp
  Act* h = nullptr;         // (N, C) residual after attention
  Act* ln2 = nullptr;       // (N, C) post_attention_layernorm output
  float* ln2_rstd = nullptr;  // (N)
  Act* gate = nullptr;      // (mlp_rows(), F)
  Act* up = nullptr;        // (mlp_rows(), F)
  Act* act = nullptr;       // (mlp_rows(), F) silu(gate) * up

  // One MoE layer's intermediates (MoE models only). The shared expert runs in gate/up/act.
  float* router_logits = nullptr;  // (N, E)
  float* router_probs = nullptr;   // (N, E) softmax over all experts
  float* route_weights = nullptr;  // (N, K)
  int32_t* expert_idx = nullptr;   // (N, K)
  int32_t* slot_of = nullptr;      // (N, K) row of assignment (n, k) in the expert order
  int32_t* token_of_slot = nullptr;  // (S)
  int64_t* expert_offsets = nullptr;  // (E+1)
  int64_t* expert_tile_offsets = nullptr;  // (E+1) one tile's (experts_tiled(); moe_tile_offsets)
  Act* expert_xs = nullptr;      // (S, C) tokens gathered in expert order
  Act* expert_gate = nullptr;    // (expert_rows(), Fe): R, or a tile's rows
  Act* expert_up = nullptr;      // (expert_rows(), Fe)
  Act* expert_act = nullptr;     // (expert_rows(), Fe)
  Act* expert_ys = nullptr;      // (S, C)
  // Expert parallelism only (P > 1): the rows this rank's experts received from every rank, in
  // expert order (each expert's rows by source rank, then as the source sent them), their
  // outputs, the two permutations between that order and the order of arrival (source rank,
  // then expert), and the local experts' row offsets (other experts have none).
  Act* ep_xs = nullptr;            // (R, C)
  Act* ep_ys = nullptr;            // (R, C)
  int32_t* ep_order = nullptr;     // (R) ep_xs[i] = arrival row ep_order[i]
  int32_t* ep_unorder = nullptr;   // (R) arrival row j = ep_ys[ep_unorder[j]]
  int64_t* ep_offsets = nullptr;   // (E+1)
  Act* shared_out = nullptr;     // (N, C) shared expert output before its sigmoid gate
  float* shared_logit = nullptr;   // (N) shared_expert_gate(x)

  // Generation (kv_tokens > 0 only). The cache holds every layer's keys (after RoPE) and values
  // of one sequence: layer l's keys are the (kv_tokens, Hkv*D) rows at kv_cache + 2*l*kv_tokens*Hkv*D,
  // its values the next as many.
  Act* kv_cache = nullptr;  // (L, 2, kv_tokens, Hkv*D)
  float* logits = nullptr;  // (V) the last position's
  int64_t kv_tokens() const { return planned_kv_; }

  // The micro-batch's token ids where the ops read them (backends whose ops cannot read host
  // memory copy them here; the CPU reads the caller's arrays).
  int32_t* tokens_in = nullptr;      // (N)
  int32_t* tokens_target = nullptr;  // (N)
  int32_t* tokens_pos = nullptr;     // (N) positions in their documents (packed documents only)
  int32_t* tokens_mtp_in = nullptr;      // (N) the MTP module's input tokens (one ahead)
  int32_t* tokens_mtp_target = nullptr;  // (N) and its targets (two ahead)

  // One layer's gradient scratch.
  Act* d_ln = nullptr;    // (N, C) gradient of a norm's output
  Act* d_tmp = nullptr;   // (N, C) partial input gradients before they are summed
  Act* d_q = nullptr;     // (N, Hq*D)
  Act* d_k = nullptr;     // (N, Hkv*D)
  Act* d_v = nullptr;     // (N, Hkv*Dv)
  Act* d_att = nullptr;   // (N, Hq*Dv)
  // Latent attention's scratch, in forward and backward: RoPE dims (N*Hq, rope dims), kv_b_proj's
  // output or its gradient (N, Hq*(nope + Dv)), kv_a_proj_with_mqa's output or its gradient,
  // and the gradients through the two norms.
  Act* mla_pe = nullptr;
  Act* mla_kv = nullptr;
  Act* mla_kv_a = nullptr;
  Act* d_mla_q_an = nullptr;   // (N, q_lora_rank)
  Act* d_mla_q_a = nullptr;    // (N, q_lora_rank)
  Act* d_mla_kv_an = nullptr;  // (N, kv_lora_rank)
  Act* d_mla_ckv = nullptr;    // (N, kv_lora_rank)
  Act* d_gate = nullptr;  // (mlp_rows(), F)
  Act* d_up = nullptr;    // (mlp_rows(), F)
  Act* d_act = nullptr;   // (mlp_rows(), F)
  Act* d_qk_raw = nullptr;  // (N, Hq*D) gradient of q_raw or k_raw (qk_norm only)
  float* d_route_weights = nullptr;  // (N, K)
  float* d_router_logits = nullptr;  // (N, E)
  Act* d_expert_ys = nullptr;      // (S, C)
  Act* d_expert_xs = nullptr;      // (S, C)
  Act* d_expert_gate = nullptr;    // (expert_rows(), Fe)
  Act* d_expert_up = nullptr;      // (expert_rows(), Fe)
  Act* d_expert_act = nullptr;     // (expert_rows(), Fe)
  // Expert parallelism only: rows in the order of arrival (what is sent and received), and the
  // experts' output and input gradients in expert order.
  Act* ep_arrival = nullptr;       // (R, C)
  Act* ep_dys = nullptr;           // (R, C)
  Act* ep_dxs = nullptr;           // (R, C)
  float* d_shared_logit = nullptr;   // (N)
  // Context parallelism only (model/ring_attention.h): the keys and values held and passed on,
  // two of each; the fp32 sums of their gradients travelling beside them, two of each; the fp32
  // sums of the attention output and of dq.
  Act* ring_k[2] = {nullptr, nullptr};    // (N, Hkv*D)
  Act* ring_v[2] = {nullptr, nullptr};    // (N, Hkv*D)
  float* ring_dk[2] = {nullptr, nullptr}; // (N, Hkv*D)
  float* ring_dv[2] = {nullptr, nullptr}; // (N, Hkv*D)
  float* ring_out = nullptr;              // (N, Hq*D)
  float* ring_dq = nullptr;               // (N, Hq*D)

 private:
  int64_t planned_tokens_ = 0;
  int64_t planned_kv_ = 0;
  int64_t planned_ranks_ = 1;
  int64_t planned_context_ = 0;
  bool planned_offload_ = false;
  int64_t layer_checkpoint_slots_ = 0;
  int64_t bytes_ = 0;
  int64_t planned_mlp_tile_ = 0;
  int64_t mlp_rows_ = 0;
  bool experts_tiled_ = false;
  int64_t expert_rows_ = 0;
  bool mlp_tiled_ = false;

  // Hands out every field for N tokens from `base` (null: only measures); returns the bytes.
  int64_t carve(char* base, const ModelConfig& config, int64_t N, bool offload_activations, bool keep_layers,
                int64_t kv_tokens, int64_t expert_ranks, int64_t mlp_tile, int64_t context_ranks);
  bool planned_keep_ = false;
  std::vector<ActivationTable> layer_views_;  // per layer 0 .. L-2 when keeping layers
};

template <class Ops>
Status ActivationTable<Ops>::reserve(Ops& ops, const ModelConfig& config, int64_t B, int64_t T,
                                     bool offload_activations, bool keep_layers, int64_t kv_tokens,
                                     int64_t expert_ranks, int64_t mlp_tile, int64_t context_ranks) {
  int64_t N = B * T;
  if (N <= planned_tokens_ && offload_activations == planned_offload_ && keep_layers == planned_keep_ &&
      kv_tokens == planned_kv_ && expert_ranks == planned_ranks_ && mlp_tile == planned_mlp_tile_ &&
      context_ranks == planned_context_)
    return Status::OK();
  if (kv_tokens == planned_kv_) N = std::max(N, planned_tokens_);
  const int64_t bytes = ActivationTable().carve(nullptr, config, N, offload_activations, keep_layers, kv_tokens,
                                                expert_ranks, mlp_tile, context_ranks);
  // The backend frees the old block first: after a failure nothing is planned any more.
  planned_tokens_ = 0;
  planned_kv_ = 0;
  bytes_ = 0;
  ASSIGN_OR_RETURN(void* base,
                   ops.activation_block(static_cast<uint64_t>(bytes), micro_batch_shape(config, N, expert_ranks)));
  carve(static_cast<char*>(base), config, N, offload_activations, keep_layers, kv_tokens, expert_ranks, mlp_tile,
        context_ranks);
  planned_mlp_tile_ = mlp_tile;
  planned_context_ = context_ranks;
  planned_keep_ = keep_layers;
  planned_ranks_ = expert_ranks;
  planned_kv_ = kv_tokens;
  bytes_ = bytes;
  planned_tokens_ = N;
  planned_offload_ = offload_activations;
  layer_checkpoint_slots_ = offload_activations ? std::min<int64_t>(3, config.num_hidden_layers + 1)
                                                : config.num_hidden_layers + 1;
  return Status::OK();
}

template <class Ops>
int64_t ActivationTable<Ops>::bytes_for(const ModelConfig& config, int64_t N, bool offload_activations,
                                        bool keep_layers, int64_t expert_ranks, int64_t mlp_tile,
                                        int64_t context_ranks) {
  ActivationTable<Ops> measured;
  return measured.carve(nullptr, config, N, offload_activations, keep_layers, /*kv_tokens=*/0, expert_ranks,
                        mlp_tile, context_ranks) +
         static_cast<int64_t>(Ops::extra_activation_bytes(micro_batch_shape(config, N, expert_ranks)));
}

template <class Ops>
int64_t ActivationTable<Ops>::carve(char* base, const ModelConfig& config, int64_t N, bool offload_activations,
                                    bool keep_layers, int64_t kv_tokens, int64_t expert_ranks, int64_t mlp_tile,
                                    int64_t context_ranks) {
  const int64_t C = config.hidden_size;
  const int64_t F = config.dense_mlp_width();
  const int64_t L = config.num_hidden_layers;
  const int64_t q_dim = config.q_dim();
  const int64_t kv_dim = config.kv_dim();
  const int64_t v_dim = config.v_dim();
  const int64_t att_dim = config.att_dim();
  const bool mla = config.is_mla();
  const int64_t Rq = mla ? config.q_lora_rank : 0, Rkv = mla ? config.kv_lora_rank : 0;
  const int64_t Dr = mla ? config.qk_rope_head_dim : 0;
  const int64_t Hq = config.num_attention_heads;
  const int64_t Hkv = config.num_key_value_heads;
  const bool qk = config.qk_norm;
  const bool moe = config.is_moe();
  const int64_t E = moe ? config.num_experts : 0;
  const int64_t K = moe ? config.num_experts_per_tok : 0;
  const int64_t S = N * K;
  const int64_t P = moe ? expert_ranks : 1;
  const int64_t R = P * S;               // rows the experts of this rank may receive
  const int64_t ep = P > 1 ? R : 0;      // the expert-parallel buffers' rows
  const int64_t Fe = moe ? config.moe_intermediate_size : 0;
  const int64_t layer_checkpoint_slots = offload_activations ? std::min<int64_t>(3, L + 1) : L + 1;
  const int64_t shared = moe && config.shared_expert_intermediate_size > 0 ? 1 : 0;
  // The dense MLP's (and shared expert's) rows: a token tile.
  const bool tiled = mlp_tile > 0 && mlp_tile < N;
  const int64_t Nf = tiled ? mlp_tile : N;
  mlp_rows_ = Nf;
  mlp_tiled_ = tiled;
  // The routed experts' rows: a tile of the expert order, without expert parallelism (whose
  // experts take the rows the ranks send them at once), and not in the fp8 recipe: its weight
  // gradients quantise 128-row blocks counted from each expert's first row, which a tile that
  // splits an expert elsewhere would move (the dense MLP's tiles of 128-multiples keep them).
  const bool block_scaled = Ops::kWeightDType == DType::kF8E4M3;
  const bool experts_tiled = moe && P == 1 && mlp_tile > 0 && mlp_tile < R && !block_scaled;
  const int64_t Re = experts_tiled ? mlp_tile : R;
  experts_tiled_ = experts_tiled;
  expert_rows_ = Re;

  // Each buffer starts on a 64-byte boundary of the block.
  int64_t offset = 0;  // bytes
  auto take = [&](auto*& field, int64_t n) {
    field = base == nullptr ? nullptr : reinterpret_cast<std::remove_reference_t<decltype(field)>>(base + offset);
    offset += (n * static_cast<int64_t>(sizeof(*field)) + 63) / 64 * 64;
  };
  // What a layer's forward writes and its backward reads (its router's choices included).
  // A layer kept for backward keeps no MLP intermediates when they are tiled: its backward
  // recomputes them tile by tile into the shared buffers.
  auto intermediates = [&](ActivationTable& t, int64_t mlp_rows, int64_t expert_rows) {
    take(t.ln1, N * C);
    take(t.ln1_rstd, N);
    take(t.q, N * q_dim);
    take(t.k, N * kv_dim);
    take(t.q_raw, qk ? N * q_dim : 0);
    take(t.k_raw, qk ? N * kv_dim : 0);
    take(t.q_norm_rstd, qk ? N * Hq : 0);
    take(t.k_norm_rstd, qk ? N * Hkv : 0);
    take(t.v, N * v_dim);
    take(t.att, N * att_dim);
    take(t.mla_q_a, N * Rq);
    take(t.mla_q_an, N * Rq);
    take(t.mla_q_a_rstd, Rq > 0 ? N : 0);
    take(t.mla_ckv, N * Rkv);
    take(t.mla_kv_an, N * Rkv);
    take(t.mla_kv_rstd, mla ? N : 0);
    take(t.lse, N * Hq);  // (B, Hq, T)
    take(t.h, N * C);
    take(t.ln2, N * C);
    take(t.ln2_rstd, N);
    take(t.gate, mlp_rows * F);
    take(t.up, mlp_rows * F);
    take(t.act, mlp_rows * F);
    take(t.router_logits, N * E);
    take(t.router_probs, N * E);
    take(t.route_weights, N * K);
    take(t.expert_idx, S);
    take(t.slot_of, S);
    take(t.token_of_slot, S);
    take(t.expert_offsets, E + 1);
    take(t.expert_tile_offsets, experts_tiled && expert_rows > 0 ? E + 1 : 0);  // (not a kept view's)
    take(t.expert_xs, S * C);
    take(t.expert_gate, expert_rows * Fe);
    take(t.expert_up, expert_rows * Fe);
    take(t.expert_act, expert_rows * Fe);
    take(t.expert_ys, S * C);
    take(t.ep_xs, ep * C);
    take(t.ep_ys, ep * C);
    take(t.ep_order, ep);
    take(t.ep_unorder, ep);
    take(t.ep_offsets, P > 1 ? E + 1 : 0);
    take(t.shared_out, shared * N * C);
    take(t.shared_logit, shared * N);
  };
  take(layer_checkpoints, layer_checkpoint_slots * N * C);
  take(final_out, N * C);
  take(final_rstd, N);
  take(d_final, N * C);
  take(dres, N * C);
  const int64_t mtp = config.trains_mtp() && kv_tokens == 0 ? N : 0;
  take(mtp_embed, mtp * C);
  take(mtp_en, mtp * C);
  take(mtp_hn, mtp * C);
  take(mtp_e_rstd, mtp);
  take(mtp_h_rstd, mtp);
  take(mtp_cat, mtp * 2 * C);
  take(d_mtp_cat, mtp * 2 * C);
  take(mtp_x, mtp * C);
  take(mtp_out, mtp * C);
  take(mtp_dres, mtp * C);
  const int64_t depths = config.trains_mtp() ? config.num_nextn_predict_layers - 1 : 0;
  take(mtp_hidden, depths * mtp * C);
  take(mtp_d_hidden, depths * mtp * C);
  intermediates(*this, Nf, Re);
  take(d_ln, N * C);
  take(d_tmp, N * C);
  take(d_q, N * q_dim);
  take(d_k, N * kv_dim);
  take(d_v, N * v_dim);
  take(d_att, N * att_dim);
  take(mla_pe, mla ? N * Hq * Dr : 0);
  take(mla_kv, mla ? N * Hq * (config.qk_nope_head_dim + config.v_head_dim) : 0);
  take(mla_kv_a, mla ? N * (Rkv + Dr) : 0);
  take(d_mla_q_an, N * Rq);
  take(d_mla_q_a, N * Rq);
  take(d_mla_kv_an, N * Rkv);
  take(d_mla_ckv, N * Rkv);
  take(d_gate, Nf * F);
  take(d_up, Nf * F);
  take(d_act, Nf * F);
  take(d_qk_raw, qk ? N * q_dim : 0);
  take(d_route_weights, N * K);
  take(d_router_logits, N * E);
  take(d_expert_ys, S * C);
  take(d_expert_xs, S * C);
  take(d_expert_gate, Re * Fe);
  take(d_expert_up, Re * Fe);
  take(d_expert_act, Re * Fe);
  take(ep_arrival, ep * C);
  take(ep_dys, ep * C);
  take(ep_dxs, ep * C);
  take(d_shared_logit, shared * N);
  const int64_t ring = context_ranks > 0 ? N : 0;
  for (int i = 0; i < 2; ++i) {
    take(ring_k[i], ring * kv_dim);
    take(ring_v[i], ring * kv_dim);
    take(ring_dk[i], ring * kv_dim);
    take(ring_dv[i], ring * kv_dim);
  }
  take(ring_out, ring * q_dim);
  take(ring_dq, ring * q_dim);
  take(tokens_in, N);
  take(tokens_target, N);
  take(tokens_pos, N);
  take(tokens_mtp_in, mtp);
  take(tokens_mtp_target, mtp);
  take(kv_cache, kv_tokens > 0 ? L * 2 * kv_tokens * kv_dim : 0);
  take(logits, kv_tokens > 0 ? config.vocab_size : 0);
  // Kept layers: layers 0 .. L-2 get intermediates of their own (the last layer's are the shared
  // ones, still intact when its backward, the first, runs), and the last layer too when the MTP
  // block, which runs in the shared ones, comes between its forward and its backward.
  layer_views_.clear();
  if (keep_layers) {
    const int64_t own = config.trains_mtp() ? L : L - 1;
    std::vector<ActivationTable> views(static_cast<size_t>(std::max<int64_t>(own, 0)), *this);
    for (ActivationTable& view : views) intermediates(view, tiled ? 0 : N, experts_tiled ? 0 : R);
    if (base != nullptr) layer_views_ = std::move(views);
  }
  return offset;
}

}  // namespace strata::model
