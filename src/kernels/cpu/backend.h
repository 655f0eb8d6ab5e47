// The CPU backends of the decoder's op set (model/decoder.h): one struct per precision recipe,
// each naming its storage types and implementing every op the layer graph calls. The graph is
// written once as a template over the backend, so the fp32 reference, the bf16 recipe emulated
// on the CPU and the CUDA backend (kernels/cuda/backend.h) run the same control flow.
//
// Storage types:
//   Act  activations and activation gradients (the residual stream, saved layer activations included)
//   W    the compute copy of the parameters that the ops read
// Always fp32: parameter gradients (accumulated with `+=` over micro-batches), saved
// statistics (rstd, lse), the router (logits, probabilities, weights, their gradients) and
// the shared expert's gate logit.
//
// CpuF32Ops: fp32 everywhere; every op is the kernels::cpu op (bitwise the reference path).
// CpuBf16Ops: the GPU's bf16 recipe emulated. Each op widens its bf16 inputs to fp32, computes
// in fp32 with the kernels::cpu op, and rounds each bf16 output once to nearest even — the
// points where the CUDA ops (kernels/cuda/ops.h) round. Where a CUDA op rounds inside, this
// does too: the LM head's dlogits, the experts' SwiGLU intermediates, and the experts' dx
// (dgate @ W_gate rounded, then + dup @ W_up rounded again). What it does not emulate is the
// order of fp32 accumulation inside a GEMM or the attention kernel's tiling (the CUDA kernel
// rounds P to bf16 before P @ V); tests/gpu states the tolerance this leaves.
//
// CpuFp8Ops: the fp8 recipe (DeepSeek-V3's) emulated: the bf16 recipe, except that the GEMMs of
// the linear layers (attention and MLP projections, the experts, the shared expert) read E4M3
// operands with power-of-two block scales (kernels/fp8.h): the forward's input in 1 x 128 tiles
// along K, the weight in 128 x 128 blocks, the data gradient's output gradient in 1 x 128 tiles,
// and both operands of the weight gradient in 128 x 1 tiles along the tokens. Each operand is
// quantised and dequantised exactly (fake quantisation; the scales are powers of two), then the
// GEMM runs in fp32 — what the GPU's FP8 GEMMs compute up to the order of fp32 accumulation
// (they promote partial sums to fp32 every 128 elements of K). Embedding, norms, attention,
// router, the shared expert's gate and the LM head stay as in the bf16 recipe. In this recipe
// the compute copy of a linear layer's weight is its E4M3 blocks (kernels/fp8.h's matrix
// layout): the `weight` pointers of linear_forward, linear_backward and the experts' tensors
// point at those bytes, typed as the W pointers every other tensor has.
//
// Backward conventions: parameter gradients accumulate (`+=`), activation gradients overwrite
// (`=`). Every pointer is host memory. An op set belongs to one model (it owns the model's
// activation block); not thread-safe.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/columns.h"
#include "kernels/lora.h"
#include "kernels/micro_batch_shape.h"
#include "kernels/moe.h"

namespace strata::kernels {

// The shared expert's gate, in fp32 for both CPU recipes.
inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// What both CPU recipes share: the memory of the activation table, the fp32 routing ops, and the
// staging hooks the CUDA backend needs (no-ops here: the CPU ops read host memory).
struct CpuCommonOps {
  // device: the cpu Device whose arena (under its budget) holds the activation table; null:
  // ordinary host memory. REQUIRES: the device outlives the ops.
  explicit CpuCommonOps(Device* device = nullptr) : device_(device) {}
  // The activation table's one block (model/activations.h), zero-filled; replaces the previous
  // block, which nothing may use any more (in chaos mode it is filled with NaN bytes first, so a
  // stale read shows). From the device's arena when there is one: its OutOfMemory names the
  // tier, the request and the budget.
  Result<void*> activation_block(uint64_t bytes, const MicroBatchShape& /*shape*/) { return activation_block(bytes); }
  Result<void*> activation_block(uint64_t bytes);
  // Memory the ops keep for themselves per micro-batch of that shape (none here).
  static uint64_t extra_activation_bytes(const MicroBatchShape& /*shape*/) { return 0; }
  // Tokens per LM-head chunk: a fixed 256 (the logits chunk is a host vector, chunk x V floats).
  // The fp32 recipe's weight gradient sums chunk by chunk, so this number is part of its bits.
  static constexpr int64_t kLossChunkTokens = 256;
  int64_t lm_head_chunk_tokens(int64_t /*N*/, int64_t /*C*/, int64_t /*V*/) const { return kLossChunkTokens; }
  // Waits for the queued ops: a no-op, the CPU ops run in the caller.
  void synchronize() {}
  Stream* compute_stream() { return nullptr; }
  // The ops' buffers are host memory, which a Comm moves without a stream from the calling
  // thread once a host mark says the ops that touch them are done (ring attention's exchanges).
  static constexpr bool kHostMemory = true;
  // A point in the ops' queue the caller can wait for (the ops called so far): nothing here.
  using HostMark = int;
  HostMark host_mark() { return 0; }
  void wait_host_mark(HostMark /*mark*/) {}
  // Constants the ops read (RoPE frequencies), where they can read them.
  const float* stage_constants(const float* host, int64_t /*n*/) { return host; }

  void moe_route_forward(int32_t* expert_idx /*(N,K)*/, float* weights /*(N,K)*/, float* probs /*(N,E)*/,
                         const float* logits /*(N,E)*/, const float* selection_bias /*(E) or null*/, int64_t N,
                         const RouterConfig& config);
  void moe_route_backward(float* dlogits /*(N,E)*/, const float* dweights /*(N,K)*/,
                          const float* prob_grad /*(E) or null*/, const float* probs /*(N,E)*/,
                          const int32_t* expert_idx /*(N,K)*/, const float* weights /*(N,K)*/, int64_t N,
                          const RouterConfig& config);
  void moe_permute(int32_t* slot_of /*(N,K)*/, int32_t* token_of_slot /*(N*K)*/, int64_t* expert_offsets /*(E+1)*/,
                   const int32_t* expert_idx /*(N,K)*/, int64_t N, int64_t K, int64_t E);
  void moe_router_stats(int64_t* counts /*(E)*/, double* prob_sums /*(E)*/, const int32_t* expert_idx /*(N,K)*/,
                        const float* probs /*(N,E)*/, int64_t N, int64_t K, int64_t E);
  void moe_tile_offsets(int64_t* tile_offsets /*(E+1)*/, const int64_t* expert_offsets /*(E+1)*/, int64_t E,
                        int64_t row0, int64_t rows) {
    kernels::moe_tile_offsets(tile_offsets, expert_offsets, E, row0, rows);
  }
  // The expert offsets where the host can read them (begin_experts picks experts by them).
  const int64_t* expert_offsets_on_host(const int64_t* offsets /*(E+1)*/, int64_t /*E*/) { return offsets; }
  // Token ids where the ops can read them: the host arrays themselves.
  const int32_t* stage_tokens(const int32_t* host /*(N)*/, int64_t /*N*/, int32_t* /*slot*/) { return host; }
  // Row offsets the host computed (expert parallelism's), likewise.
  const int64_t* stage_offsets(const int64_t* host /*(n)*/, int64_t /*n*/, int64_t* /*slot*/) { return host; }
  // host (n) = src (n): fp32 results of the ops (generation's logits) read back by the host.
  void copy_to_host(float* host, const float* src, int64_t n) { std::copy_n(src, n, host); }

 private:
  Device* device_ = nullptr;
  DeviceAllocation device_block_;
  std::vector<float> block_;
};

// One op set per recipe. Both declare the same members with their own Act and W.
#define STRATA_CPU_BACKEND_OPS(Act, W)                                                                              \
  void embedding_forward(Act* out /*(N,C)*/, const int32_t* tokens /*(N)*/, const W* const* table_blocks,          \
                         int64_t block_rows, int64_t N, int64_t C, int64_t V);                                      \
  void embedding_backward(float* const* dtable_blocks, int64_t block_rows, const Act* dout /*(N,C)*/,              \
                          const int32_t* tokens /*(N)*/, int64_t N, int64_t C, int64_t V);                          \
  void rmsnorm_forward(Act* out /*(N,C)*/, float* rstd /*(N)*/, const Act* x /*(N,C)*/, const W* weight /*(C)*/,   \
                       int64_t N, int64_t C, float eps);                                                            \
  void rmsnorm_backward(Act* dx /*(N,C)*/, float* dweight /*(C)*/, const Act* dout /*(N,C)*/,                      \
                        const Act* x /*(N,C)*/, const W* weight /*(C)*/, const float* rstd /*(N)*/, int64_t N,     \
                        int64_t C);                                                                                 \
  void linear_forward(Act* out /*(N,OC)*/, const Act* x /*(N,IC)*/, const W* weight /*(OC,IC)*/,                   \
                      const W* bias /*(OC) or null*/, int64_t N, int64_t IC, int64_t OC);                           \
  void linear_backward(Act* dx /*(N,IC) or null*/, float* dweight /*(OC,IC)*/, float* dbias /*(OC) or null*/,      \
                       const Act* dout /*(N,OC)*/, const Act* x /*(N,IC)*/, const W* weight /*(OC,IC)*/,          \
                       int64_t N, int64_t IC, int64_t OC);                                                          \
  /* out (N,OC) = x @ weight^T + residual (N,OC): a projection added to the residual stream (o_proj, down_proj), \
     the sum rounded once (the CUDA op adds the residual inside the GEMM). REQUIRES out != residual. */            \
  void linear_forward_residual(Act* out /*(N,OC)*/, const Act* x /*(N,IC)*/, const W* weight /*(OC,IC)*/,          \
                               const Act* residual /*(N,OC)*/, int64_t N, int64_t IC, int64_t OC);                  \
  /* The same with fp32 outputs / output gradients: the router and the shared expert's gate. The backward        \
     rounds dout to the activation type before its GEMMs, as the GPU must (its GEMMs read bf16). */                \
  void linear_forward_f32(float* out /*(N,OC)*/, const Act* x /*(N,IC)*/, const W* weight /*(OC,IC)*/, int64_t N,  \
                          int64_t IC, int64_t OC);                                                                  \
  void linear_backward_f32(Act* dx /*(N,IC)*/, float* dweight /*(OC,IC)*/, const float* dout /*(N,OC)*/,           \
                           const Act* x /*(N,IC)*/, const W* weight /*(OC,IC)*/, int64_t N, int64_t IC,             \
                           int64_t OC);                                                                             \
  /* past: positions before these T (kernels/rope.h); positions (B,T) or null: each token's position in its     \
     document (packed documents, kernels/attention.h) */                                                           \
  void rope_forward(Act* out, const Act* x /*(B,T,H,D)*/, const float* inv_freq /*(D/2)*/, int64_t B, int64_t T,   \
                    int64_t H, int64_t D, float scale, int64_t past = 0, const int32_t* positions = nullptr);      \
  void rope_backward(Act* dx, const Act* dout /*(B,T,H,D)*/, const float* inv_freq /*(D/2)*/, int64_t B,           \
                     int64_t T, int64_t H, int64_t D, float scale, const int32_t* positions = nullptr);            \
  /* past: cached positions before the T queries; k and v hold past + T rows; positions: document masks;         \
     Dv: the value head dim (0: D); scale: the softmax scale (0: 1/sqrt(D)) (kernels/attention.h) */               \
  void attention_forward(Act* out /*(B,T,Hq,Dv)*/, float* lse /*(B,Hq,T)*/, const Act* q /*(B,T,Hq,D)*/,           \
                         const Act* k /*(B,past+T,Hkv,D)*/, const Act* v /*(B,past+T,Hkv,Dv)*/, int64_t B,         \
                         int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past = 0,                           \
                         const int32_t* positions = nullptr, int64_t Dv = 0, double scale = 0);                     \
  void attention_backward(Act* dq, Act* dk, Act* dv, const Act* dout, const Act* q, const Act* k, const Act* v,     \
                          const Act* out, const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,          \
                          int64_t D, const int32_t* positions = nullptr, int64_t Dv = 0, double scale = 0);         \
  /* Ring attention's blocks (context parallelism, model/context_parallel.h): out and lse merged, and dq, dk, dv    \
     written or added to, in fp32 (kernels/attention.h); round_activations then writes them in the activation     \
     type. */                                                                                                       \
  void attention_block_forward(float* out /*(B,Tq,Hq,Dv)*/, float* lse /*(B,Hq,Tq)*/, const Act* q, const Act* k,   \
                               const Act* v, int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, \
                               AttentionBlock mask, bool accumulate, int64_t Dv = 0, double scale = 0);              \
  void attention_block_backward(float* dq, float* dk, float* dv, const Act* dout, const Act* q, const Act* k,      \
                                const Act* v, const Act* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,  \
                                int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock mask, bool accumulate_dq,        \
                                bool accumulate_dkv, int64_t Dv = 0, double scale = 0);                             \
  /* LoRA (kernels/lora.h): y (N,OC) = y + scale * (drop(x) A^T) B^T, rounded once; backward: dA, dB += and    \
     dx (null: skipped) = dx + drop'(dt A), rounded once. A (R,IC) and B (OC,R) are the adapter's compute copy. */  \
  void lora_forward(Act* y, const Act* x /*(N,IC)*/, const W* A, const W* B, float scale, const LoraDropout& drop,  \
                    int64_t N, int64_t IC, int64_t OC, int64_t R);                                                  \
  void lora_backward(Act* dx, float* dA, float* dB, const Act* dy /*(N,OC)*/, const Act* x /*(N,IC)*/, const W* A, \
                     const W* B, float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC,          \
                     int64_t R);                                                                                    \
  /* dst (n) = src rounded to the activation type */                                                                \
  void round_activations(Act* dst, const float* src, int64_t n);                                                    \
  void swiglu_forward(Act* out /*(n)*/, const Act* gate /*(n)*/, const Act* up /*(n)*/, int64_t n);                 \
  void swiglu_backward(Act* dgate, Act* dup, const Act* dout, const Act* gate, const Act* up, int64_t n);           \
  /* a (n) += b (n) */                                                                                               \
  void add_inplace(Act* a, const Act* b, int64_t n);                                                                \
  STRATA_COLUMN_OPS(Act)                                                                                            \
  /* The LM head and cross-entropy over vocabulary row blocks (kernels/cross_entropy.h): returns the sum of       \
     token NLLs; dx (N,C) = (null: skipped), dweight blocks += (null: skipped). */                                  \
  double lm_head_cross_entropy(Act* dx, float* const* dweight_blocks, const Act* x /*(N,C)*/,                       \
                               const W* const* weight_blocks, int64_t block_rows, const int32_t* targets /*(N)*/,   \
                               int64_t N, int64_t C, int64_t V, float grad_scale, int64_t chunk_tokens);            \
  void moe_gather(Act* xs /*(S,C)*/, const Act* x /*(N,C)*/, const int32_t* token_of_slot /*(S)*/, int64_t S,       \
                  int64_t C);                                                                                       \
  void moe_gather_backward(Act* dx /*(N,C)*/, const Act* dxs /*(N*K,C)*/, const int32_t* slot_of /*(N,K)*/,         \
                           int64_t N, int64_t K, int64_t C);                                                        \
  void moe_combine_forward(Act* out /*(N,C)*/, const Act* ys /*(N*K,C)*/, const float* weights /*(N,K)*/,           \
                           const int32_t* slot_of /*(N,K)*/, int64_t N, int64_t K, int64_t C);                      \
  void moe_combine_backward(Act* dys /*(N*K,C)*/, float* dweights /*(N,K)*/, const Act* dout /*(N,C)*/,             \
                            const Act* ys /*(N*K,C)*/, const float* weights /*(N,K)*/,                              \
                            const int32_t* slot_of /*(N,K)*/, int64_t N, int64_t K, int64_t C);                     \
  void moe_experts_forward(Act* ys /*(S,C)*/, Act* gate /*(S,F)*/, Act* up /*(S,F)*/, Act* act /*(S,F)*/,           \
                           const Act* xs /*(S,C)*/, const int64_t* expert_offsets /*(E+1)*/,                        \
                           const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F);                       \
  void moe_experts_backward(Act* dxs /*(S,C)*/, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact,    \
                            const Act* dys, const Act* xs, const Act* gate, const Act* up, const Act* act,          \
                            const int64_t* expert_offsets /*(E+1)*/, const ExpertTensors<const W>& w, int64_t E,   \
                            int64_t C, int64_t F);                                                                  \
  /* The shared expert's sigmoid gate: out (N,C) += sigmoid(logit) * shared_out; backward:                        \
     dshared (N,C) = sigmoid(logit) * dout, dlogit (N) = dot(dout, shared_out) * s * (1 - s). */                    \
  void shared_expert_combine(Act* out, const Act* shared_out, const float* logit /*(N)*/, int64_t N, int64_t C);    \
  void shared_expert_backward(Act* dshared, float* dlogit, const Act* dout, const Act* shared_out,                  \
                              const float* logit, int64_t N, int64_t C);

struct CpuF32Ops : CpuCommonOps {
  using Act = float;
  using W = float;
  static constexpr DType kWeightDType = DType::kF32;
  static constexpr const char* kName = "cpu fp32";
  using CpuCommonOps::CpuCommonOps;
  STRATA_CPU_BACKEND_OPS(float, float)
};

struct CpuBf16Ops : CpuCommonOps {
  using Act = Bf16;
  using W = Bf16;
  static constexpr DType kWeightDType = DType::kBF16;
  static constexpr const char* kName = "cpu bf16 (the GPU recipe emulated)";
  using CpuCommonOps::CpuCommonOps;
  STRATA_CPU_BACKEND_OPS(Bf16, Bf16)
  // dx (N,IC) = round(dx + dout @ weight) and dweight += dout^T @ x: the experts' second
  // data-gradient GEMM accumulating onto its bf16 output (kernels/experts_loop.h).
  void accumulate_data_grad(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight, int64_t N,
                            int64_t IC, int64_t OC);
};

// The bf16 recipe's ops with the linear layers' GEMMs in fp8 (above). The members declared here
// hide CpuBf16Ops' of the same name; the others are the bf16 recipe's.
struct CpuFp8Ops : CpuBf16Ops {
  static constexpr DType kWeightDType = DType::kF8E4M3;
  static constexpr const char* kName = "cpu fp8 (the GPU recipe emulated)";
  using CpuBf16Ops::CpuBf16Ops;
  // weight: E4M3 blocks of (OC, IC).
  void linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC, int64_t OC);
  void linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N, int64_t IC,
                               int64_t OC);
  void linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                       int64_t N, int64_t IC, int64_t OC);
  // w: each expert's gate, up (F, C) and down (C, F) as E4M3 blocks.
  void moe_experts_forward(Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
                           const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F);
  void moe_experts_backward(Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact,
                            const Act* dys, const Act* xs, const Act* gate, const Act* up, const Act* act,
                            const int64_t* expert_offsets, const ExpertTensors<const W>& w, int64_t E, int64_t C,
                            int64_t F);
  void accumulate_data_grad(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight, int64_t N,
                            int64_t IC, int64_t OC);
};

// The nf4 base (LoRA's frozen linear weights in NF4, kernels/nf4.h) on the bf16 recipe: the
// `weight` pointers of the linear layers and the experts point at NF4 bytes, which each op
// decodes and rounds to bf16 (what the CUDA backend's dequantised bf16 tiles hold), then computes
// as CpuBf16Ops does. The weights are frozen: their gradients must be null. Every other op (norms,
// attention, the LoRA adapters, in bf16) is the bf16 recipe's.
struct CpuNf4Ops : CpuBf16Ops {
  static constexpr DType kWeightDType = DType::kNF4;
  static constexpr const char* kName = "cpu nf4 base (the bf16 recipe emulated, NF4 linear weights)";
  using CpuBf16Ops::CpuBf16Ops;
  void linear_forward(Act* out, const Act* x, const W* weight, const W* bias, int64_t N, int64_t IC, int64_t OC);
  void linear_forward_residual(Act* out, const Act* x, const W* weight, const Act* residual, int64_t N, int64_t IC,
                               int64_t OC);
  void linear_backward(Act* dx, float* dweight, float* dbias, const Act* dout, const Act* x, const W* weight,
                       int64_t N, int64_t IC, int64_t OC);
  void moe_experts_forward(Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
                           const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F);
  void moe_experts_backward(Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact,
                            const Act* dys, const Act* xs, const Act* gate, const Act* up, const Act* act,
                            const int64_t* expert_offsets, const ExpertTensors<const W>& w, int64_t E, int64_t C,
                            int64_t F);
  void accumulate_data_grad(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight, int64_t N,
                            int64_t IC, int64_t OC);
};

#undef STRATA_CPU_BACKEND_OPS

}  // namespace strata::kernels
