// CpuF32Ops and CpuCommonOps: the kernels::cpu ops under the decoder's op-set names.
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "kernels/attention.h"
#include "kernels/cpu/backend.h"
#include "kernels/cross_entropy.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace strata::kernels {

Result<void*> CpuCommonOps::activation_block(uint64_t bytes) {
  if (device_ == nullptr) {
    block_.assign((bytes + sizeof(float) - 1) / sizeof(float), 0.0f);
    return static_cast<void*>(block_.data());
  }
  // Chaos mode: the block being let go reads as NaN (0xFF bytes) to whatever still holds it.
  if (device_block_ && device_->chaos_seed() != 0) std::memset(device_block_.data(), 0xFF, device_block_.size());
  device_block_.reset();
  Result<DeviceAllocation> a = device_->allocate(bytes);
  if (!a.ok()) return a.status().with_context("the activation table");
  device_block_ = std::move(a).value();
  std::memset(device_block_.data(), 0, bytes);
  return device_block_.data();
}

void CpuCommonOps::moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                                      const float* selection_bias, int64_t N, const RouterConfig& config) {
  cpu::moe_route_forward(expert_idx, weights, probs, logits, selection_bias, N, config);
}
void CpuCommonOps::moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad,
                                       const float* probs, const int32_t* expert_idx, const float* weights,
                                       int64_t N, const RouterConfig& config) {
  cpu::moe_route_backward(dlogits, dweights, prob_grad, probs, expert_idx, weights, N, config);
}
void CpuCommonOps::moe_permute(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets,
                                const int32_t* expert_idx, int64_t N, int64_t K, int64_t E) {
  cpu::moe_permute(slot_of, token_of_slot, expert_offsets, expert_idx, N, K, E);
}
void CpuCommonOps::moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx,
                                     const float* probs, int64_t N, int64_t K, int64_t E) {
  cpu::moe_router_stats(counts, prob_sums, expert_idx, probs, N, K, E);
}

void CpuF32Ops::embedding_forward(float* out, const int32_t* tokens, const float* const* table_blocks,
                                  int64_t block_rows, int64_t N, int64_t C, int64_t /*V*/) {
  cpu::embedding_forward_blocked(out, tokens, table_blocks, block_rows, N, C);
}
void CpuF32Ops::embedding_backward(float* const* dtable_blocks, int64_t block_rows, const float* dout,
                                   const int32_t* tokens, int64_t N, int64_t C, int64_t /*V*/) {
  cpu::embedding_backward_blocked(dtable_blocks, block_rows, dout, tokens, N, C);
}
void CpuF32Ops::rmsnorm_forward(float* out, float* rstd, const float* x, const float* weight, int64_t N, int64_t C,
                                float eps) {
  cpu::rmsnorm_forward(out, rstd, x, weight, N, C, eps);
}
void CpuF32Ops::rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight,
                                 const float* rstd, int64_t N, int64_t C) {
  cpu::rmsnorm_backward(dx, dweight, dout, x, weight, rstd, N, C);
}
void CpuF32Ops::linear_forward(float* out, const float* x, const float* weight, const float* bias, int64_t N,
                               int64_t IC, int64_t OC) {
  cpu::linear_forward(out, x, weight, bias, N, IC, OC);
}
void CpuF32Ops::linear_backward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                                const float* weight, int64_t N, int64_t IC, int64_t OC) {
  cpu::linear_backward(dx, dweight, dbias, dout, x, weight, N, IC, OC);
}
void CpuF32Ops::linear_forward_f32(float* out, const float* x, const float* weight, int64_t N, int64_t IC,
                                   int64_t OC) {
  cpu::linear_forward(out, x, weight, nullptr, N, IC, OC);
}
void CpuF32Ops::linear_backward_f32(float* dx, float* dweight, const float* dout, const float* x,
                                    const float* weight, int64_t N, int64_t IC, int64_t OC) {
  cpu::linear_backward(dx, dweight, nullptr, dout, x, weight, N, IC, OC);
}
void CpuF32Ops::rope_forward(float* out, const float* x, const float* inv_freq, int64_t B, int64_t T, int64_t H,
                             int64_t D, float scale, int64_t past, const int32_t* positions) {
  cpu::rope_forward(out, x, inv_freq, B, T, H, D, scale, past, positions);
}
void CpuF32Ops::rope_backward(float* dx, const float* dout, const float* inv_freq, int64_t B, int64_t T, int64_t H,
                              int64_t D, float scale, const int32_t* positions) {
  cpu::rope_backward(dx, dout, inv_freq, B, T, H, D, scale, 0, positions);
}
void CpuF32Ops::attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                                  int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past,
                                  const int32_t* positions, int64_t Dv, double scale) {
  cpu::attention_forward(out, lse, q, k, v, B, T, Hq, Hkv, D, past, positions, Dv, scale);
}
void CpuF32Ops::attention_block_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                                        int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                                        AttentionBlock mask, bool accumulate, int64_t Dv, double scale) {
  cpu::attention_block_forward(out, lse, q, k, v, B, Tq, Tk, Hq, Hkv, D, mask, accumulate, Dv, scale);
}
void CpuF32Ops::attention_block_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                         const float* k, const float* v, const float* out, const float* lse,
                                         int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                                         AttentionBlock mask, bool accumulate_dq, bool accumulate_dkv, int64_t Dv,
                                         double scale) {
  cpu::attention_block_backward(dq, dk, dv, dout, q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, D, mask, accumulate_dq,
                                accumulate_dkv, Dv, scale);
}
void CpuF32Ops::lora_forward(float* y, const float* x, const float* A, const float* B, float scale,
                             const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R) {
  std::vector<float> t(static_cast<size_t>(N * R));
  cpu::lora_forward(y, t.data(), x, A, B, scale, drop, N, IC, OC, R, [](float*, int64_t) {});
}
void CpuF32Ops::lora_backward(float* dx, float* dA, float* dB, const float* dy, const float* x, const float* A,
                              const float* B, float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC,
                              int64_t R) {
  cpu::lora_backward(dx, dA, dB, dy, x, A, B, scale, drop, N, IC, OC, R, [](float*, int64_t) {});
}
void CpuF32Ops::round_activations(float* dst, const float* src, int64_t n) {
  if (dst != src) std::copy_n(src, n, dst);
}
void CpuF32Ops::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                   const float* k, const float* v, const float* out, const float* lse, int64_t B,
                                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const int32_t* positions,
                                   int64_t Dv, double scale) {
  cpu::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, positions, Dv, scale);
}
void CpuF32Ops::swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  cpu::swiglu_forward(out, gate, up, n);
}
void CpuF32Ops::swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                                int64_t n) {
  cpu::swiglu_backward(dgate, dup, dout, gate, up, n);
}
void CpuF32Ops::linear_forward_residual(float* out, const float* x, const float* weight, const float* residual,
                                        int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(out != residual, "linear_forward_residual: out must not alias the residual");
  // The GEMM, then the addition: bitwise linear_forward followed by add_inplace (an fp32 sum of
  // two values is the same in either order), so the fp32 recipe's results do not change.
  cpu::linear_forward(out, x, weight, nullptr, N, IC, OC);
  add_inplace(out, residual, N * OC);
}
void CpuF32Ops::add_inplace(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}
double CpuF32Ops::lm_head_cross_entropy(float* dx, float* const* dweight_blocks, const float* x,
                                        const float* const* weight_blocks, int64_t block_rows,
                                        const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale,
                                        int64_t chunk_tokens) {
  return cpu::lm_head_cross_entropy_blocked(dx, dweight_blocks, x, weight_blocks, block_rows, targets, N, C, V,
                                            grad_scale, chunk_tokens);
}
void CpuF32Ops::moe_gather(float* xs, const float* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
  cpu::moe_gather(xs, x, token_of_slot, S, C);
}
void CpuF32Ops::moe_gather_backward(float* dx, const float* dxs, const int32_t* slot_of, int64_t N, int64_t K,
                                    int64_t C) {
  cpu::moe_gather_backward(dx, dxs, slot_of, N, K, C);
}
void CpuF32Ops::moe_combine_forward(float* out, const float* ys, const float* weights, const int32_t* slot_of,
                                    int64_t N, int64_t K, int64_t C) {
  cpu::moe_combine_forward(out, ys, weights, slot_of, N, K, C);
}
void CpuF32Ops::moe_combine_backward(float* dys, float* dweights, const float* dout, const float* ys,
                                     const float* weights, const int32_t* slot_of, int64_t N, int64_t K,
                                     int64_t C) {
  cpu::moe_combine_backward(dys, dweights, dout, ys, weights, slot_of, N, K, C);
}
void CpuF32Ops::moe_experts_forward(float* ys, float* gate, float* up, float* act, const float* xs,
                                    const int64_t* expert_offsets, const ExpertTensors<const float>& w, int64_t E,
                                    int64_t C, int64_t F) {
  cpu::moe_experts_forward(ys, gate, up, act, xs, expert_offsets, w, E, C, F);
}
void CpuF32Ops::moe_experts_backward(float* dxs, const ExpertTensors<float>& dw, float* dgate, float* dup,
                                     float* dact, const float* dys, const float* xs, const float* gate,
                                     const float* up, const float* act, const int64_t* expert_offsets,
                                     const ExpertTensors<const float>& w, int64_t E, int64_t C, int64_t F) {
  cpu::moe_experts_backward(dxs, dw, dgate, dup, dact, dys, xs, gate, up, act, expert_offsets, w, E, C, F);
}

void CpuF32Ops::shared_expert_combine(float* out, const float* shared_out, const float* logit, int64_t N,
                                      int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float s = sigmoid(logit[n]);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] += s * shared_out[n * C + c];
  }
}
void CpuF32Ops::shared_expert_backward(float* dshared, float* dlogit, const float* dout, const float* shared_out,
                                       const float* logit, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float s = sigmoid(logit[n]);
    float dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      dot += dout[n * C + c] * shared_out[n * C + c];
      dshared[n * C + c] = s * dout[n * C + c];
    }
    dlogit[n] = dot * s * (1.0f - s);
  }
}

void CpuF32Ops::copy_columns(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols,
                              ColumnOrder order) {
  cpu::copy_columns(dst, ld_dst, src, ld_src, rows, cols, order);
}
void CpuF32Ops::sum_head_columns(float* dst, const float* src, int64_t ld_src, int64_t head_stride, int64_t rows,
                                  int64_t heads, int64_t cols) {
  cpu::sum_head_columns(dst, src, ld_src, head_stride, rows, heads, cols);
}

}  // namespace strata::kernels
