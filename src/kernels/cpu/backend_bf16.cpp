// CpuBf16Ops: the GPU's bf16 recipe on the CPU (see backend.h). Each op widens its inputs, runs
// the fp32 kernels::cpu op (or, where the CUDA op rounds inside, the same steps with the
// rounding in between) and rounds each bf16 output once.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "kernels/attention.h"
#include "kernels/cpu/backend.h"
#include "kernels/experts_loop.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace strata::kernels {
namespace {

// Rows [b * block_rows, ...) of a (V, C) table in blocks, widened into one contiguous (V, C).
std::vector<float> widen_blocks(const Bf16* const* blocks, int64_t block_rows, int64_t V, int64_t C) {
  std::vector<float> out(static_cast<size_t>(V * C));
  for (int64_t r0 = 0, b = 0; r0 < V; r0 += block_rows, ++b) {
    const int64_t rows = std::min(block_rows, V - r0);
    for (int64_t i = 0; i < rows * C; ++i) out[static_cast<size_t>(r0 * C + i)] = to_f32(blocks[b][i]);
  }
  return out;
}

}  // namespace

void CpuBf16Ops::embedding_forward(Bf16* out, const int32_t* tokens, const Bf16* const* table_blocks,
                                   int64_t block_rows, int64_t N, int64_t C, int64_t /*V*/) {
  // A copy of rows: exact.
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = tokens[n];
    std::copy_n(table_blocks[t / block_rows] + (t % block_rows) * C, C, out + n * C);
  }
}
void CpuBf16Ops::embedding_backward(float* const* dtable_blocks, int64_t block_rows, const Bf16* dout,
                                    const int32_t* tokens, int64_t N, int64_t C, int64_t /*V*/) {
  const std::vector<float> d = widen(dout, N * C);
  cpu::embedding_backward_blocked(dtable_blocks, block_rows, d.data(), tokens, N, C);
}
void CpuBf16Ops::rmsnorm_forward(Bf16* out, float* rstd, const Bf16* x, const Bf16* weight, int64_t N, int64_t C,
                                 float eps) {
  const std::vector<float> xf = widen(x, N * C), wf = widen(weight, C);
  std::vector<float> o(static_cast<size_t>(N * C));
  cpu::rmsnorm_forward(o.data(), rstd, xf.data(), wf.data(), N, C, eps);
  narrow(out, o.data(), N * C);
}
void CpuBf16Ops::rmsnorm_backward(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight,
                                  const float* rstd, int64_t N, int64_t C) {
  const std::vector<float> df = widen(dout, N * C), xf = widen(x, N * C), wf = widen(weight, C);
  std::vector<float> o(static_cast<size_t>(N * C));
  cpu::rmsnorm_backward(o.data(), dweight, df.data(), xf.data(), wf.data(), rstd, N, C);
  narrow(dx, o.data(), N * C);
}
void CpuBf16Ops::linear_forward(Bf16* out, const Bf16* x, const Bf16* weight, const Bf16* bias, int64_t N,
                                int64_t IC, int64_t OC) {
  const std::vector<float> xf = widen(x, N * IC), wf = widen(weight, OC * IC);
  const std::vector<float> bf = bias != nullptr ? widen(bias, OC) : std::vector<float>();
  std::vector<float> o(static_cast<size_t>(N * OC));
  cpu::linear_forward(o.data(), xf.data(), wf.data(), bias != nullptr ? bf.data() : nullptr, N, IC, OC);
  narrow(out, o.data(), N * OC);
}
void CpuBf16Ops::linear_backward(Bf16* dx, float* dweight, float* dbias, const Bf16* dout, const Bf16* x,
                                 const Bf16* weight, int64_t N, int64_t IC, int64_t OC) {
  const std::vector<float> df = widen(dout, N * OC), xf = widen(x, N * IC), wf = widen(weight, OC * IC);
  std::vector<float> o(dx != nullptr ? static_cast<size_t>(N * IC) : 0);
  cpu::linear_backward(dx != nullptr ? o.data() : nullptr, dweight, dbias, df.data(), xf.data(), wf.data(), N, IC,
                       OC);
  if (dx != nullptr) narrow(dx, o.data(), N * IC);
}
void CpuBf16Ops::linear_forward_residual(Bf16* out, const Bf16* x, const Bf16* weight, const Bf16* residual,
                                         int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(out != residual, "linear_forward_residual: out must not alias the residual");
  // As cuBLASLt with beta = 1 and a separate bf16 C: the fp32 product plus the widened residual,
  // rounded once (not the product rounded, then the sum rounded again).
  const std::vector<float> xf = widen(x, N * IC), wf = widen(weight, OC * IC);
  std::vector<float> o(static_cast<size_t>(N * OC));
  cpu::linear_forward(o.data(), xf.data(), wf.data(), nullptr, N, IC, OC);
  for (int64_t i = 0; i < N * OC; ++i) o[static_cast<size_t>(i)] += to_f32(residual[i]);
  narrow(out, o.data(), N * OC);
}
void CpuBf16Ops::linear_forward_f32(float* out, const Bf16* x, const Bf16* weight, int64_t N, int64_t IC,
                                    int64_t OC) {
  const std::vector<float> xf = widen(x, N * IC), wf = widen(weight, OC * IC);
  cpu::linear_forward(out, xf.data(), wf.data(), nullptr, N, IC, OC);
}
void CpuBf16Ops::linear_backward_f32(Bf16* dx, float* dweight, const float* dout, const Bf16* x,
                                     const Bf16* weight, int64_t N, int64_t IC, int64_t OC) {
  // dout rounded to bf16 first: the GPU's GEMMs read bf16.
  std::vector<float> df(static_cast<size_t>(N * OC));
  for (int64_t i = 0; i < N * OC; ++i) df[static_cast<size_t>(i)] = to_f32(to_bf16(dout[i]));
  const std::vector<float> xf = widen(x, N * IC), wf = widen(weight, OC * IC);
  std::vector<float> o(static_cast<size_t>(N * IC));
  cpu::linear_backward(o.data(), dweight, nullptr, df.data(), xf.data(), wf.data(), N, IC, OC);
  narrow(dx, o.data(), N * IC);
}
void CpuBf16Ops::rope_forward(Bf16* out, const Bf16* x, const float* inv_freq, int64_t B, int64_t T, int64_t H,
                              int64_t D, float scale, int64_t past, const int32_t* positions) {
  std::vector<float> f = widen(x, B * T * H * D);
  cpu::rope_forward(f.data(), f.data(), inv_freq, B, T, H, D, scale, past, positions);
  narrow(out, f.data(), B * T * H * D);
}
void CpuBf16Ops::rope_backward(Bf16* dx, const Bf16* dout, const float* inv_freq, int64_t B, int64_t T, int64_t H,
                               int64_t D, float scale, const int32_t* positions) {
  std::vector<float> f = widen(dout, B * T * H * D);
  cpu::rope_backward(f.data(), f.data(), inv_freq, B, T, H, D, scale, 0, positions);
  narrow(dx, f.data(), B * T * H * D);
}
void CpuBf16Ops::attention_forward(Bf16* out, float* lse, const Bf16* q, const Bf16* k, const Bf16* v, int64_t B,
                                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t past,
                                   const int32_t* positions, int64_t Dv, double scale) {
  CHECK(Dv >= 0);
  const int64_t Tk = past + T, dv_ = Dv == 0 ? D : Dv;
  const std::vector<float> qf = widen(q, B * T * Hq * D), kf = widen(k, B * Tk * Hkv * D),
                           vf = widen(v, B * Tk * Hkv * dv_);
  std::vector<float> o(static_cast<size_t>(B * T * Hq * dv_));
  cpu::attention_forward(o.data(), lse, qf.data(), kf.data(), vf.data(), B, T, Hq, Hkv, D, past, positions, Dv,
                         scale);
  narrow(out, o.data(), B * T * Hq * dv_);
}
void CpuBf16Ops::attention_block_forward(float* out, float* lse, const Bf16* q, const Bf16* k, const Bf16* v,
                                         int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                                         AttentionBlock mask, bool accumulate, int64_t Dv, double scale) {
  CHECK(Dv >= 0);
  const int64_t dv_ = Dv == 0 ? D : Dv;
  const std::vector<float> qf = widen(q, B * Tq * Hq * D), kf = widen(k, B * Tk * Hkv * D),
                           vf = widen(v, B * Tk * Hkv * dv_);
  cpu::attention_block_forward(out, lse, qf.data(), kf.data(), vf.data(), B, Tq, Tk, Hq, Hkv, D, mask, accumulate, Dv,
                               scale);
}
void CpuBf16Ops::attention_block_backward(float* dq, float* dk, float* dv, const Bf16* dout, const Bf16* q,
                                          const Bf16* k, const Bf16* v, const Bf16* out, const float* lse, int64_t B,
                                          int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D,
                                          AttentionBlock mask, bool accumulate_dq, bool accumulate_dkv,
                                          int64_t Dv, double scale) {
  CHECK(Dv >= 0);
  const int64_t dv_ = Dv == 0 ? D : Dv;
  const std::vector<float> df = widen(dout, B * Tq * Hq * dv_), qf = widen(q, B * Tq * Hq * D),
                           kf = widen(k, B * Tk * Hkv * D), vf = widen(v, B * Tk * Hkv * dv_),
                           of = widen(out, B * Tq * Hq * dv_);
  cpu::attention_block_backward(dq, dk, dv, df.data(), qf.data(), kf.data(), vf.data(), of.data(), lse, B, Tq, Tk, Hq,
                                Hkv, D, mask, accumulate_dq, accumulate_dkv, Dv, scale);
}
void CpuBf16Ops::round_activations(Bf16* dst, const float* src, int64_t n) { narrow(dst, src, n); }
namespace {
// Rounds fp32 values to the nearest bf16 in place (the recipe's activation rounding).
void round_bf16_values(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = to_f32(to_bf16(v[i]));
}
}  // namespace
void CpuBf16Ops::lora_forward(Bf16* y, const Bf16* x, const Bf16* A, const Bf16* B, float scale,
                              const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R) {
  std::vector<float> yf = widen(y, N * OC), t(static_cast<size_t>(N * R));
  const std::vector<float> xf = widen(x, N * IC), af = widen(A, R * IC), bf = widen(B, OC * R);
  cpu::lora_forward(yf.data(), t.data(), xf.data(), af.data(), bf.data(), scale, drop, N, IC, OC, R,
                    round_bf16_values);
  narrow(y, yf.data(), N * OC);
}
void CpuBf16Ops::lora_backward(Bf16* dx, float* dA, float* dB, const Bf16* dy, const Bf16* x, const Bf16* A,
                               const Bf16* B, float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC,
                               int64_t R) {
  std::vector<float> dxf = dx != nullptr ? widen(dx, N * IC) : std::vector<float>();
  const std::vector<float> dyf = widen(dy, N * OC), xf = widen(x, N * IC), af = widen(A, R * IC),
                           bf = widen(B, OC * R);
  cpu::lora_backward(dx != nullptr ? dxf.data() : nullptr, dA, dB, dyf.data(), xf.data(), af.data(), bf.data(), scale,
                     drop, N, IC, OC, R, round_bf16_values);
  if (dx != nullptr) narrow(dx, dxf.data(), N * IC);
}
void CpuBf16Ops::attention_backward(Bf16* dq, Bf16* dk, Bf16* dv, const Bf16* dout, const Bf16* q, const Bf16* k,
                                    const Bf16* v, const Bf16* out, const float* lse, int64_t B, int64_t T,
                                    int64_t Hq, int64_t Hkv, int64_t D, const int32_t* positions, int64_t Dv,
                                    double scale) {
  CHECK(Dv >= 0);
  const int64_t dv_ = Dv == 0 ? D : Dv;
  const int64_t nq = B * T * Hq * D, nkv = B * T * Hkv * D, no = B * T * Hq * dv_, nv = B * T * Hkv * dv_;
  const std::vector<float> df = widen(dout, no), qf = widen(q, nq), kf = widen(k, nkv), vf = widen(v, nv),
                           of = widen(out, no);
  std::vector<float> dqf(static_cast<size_t>(nq)), dkf(static_cast<size_t>(nkv)), dvf(static_cast<size_t>(nv));
  cpu::attention_backward(dqf.data(), dkf.data(), dvf.data(), df.data(), qf.data(), kf.data(), vf.data(), of.data(),
                          lse, B, T, Hq, Hkv, D, positions, Dv, scale);
  narrow(dq, dqf.data(), nq);
  narrow(dk, dkf.data(), nkv);
  narrow(dv, dvf.data(), nv);
}
void CpuBf16Ops::swiglu_forward(Bf16* out, const Bf16* gate, const Bf16* up, int64_t n) {
  const std::vector<float> g = widen(gate, n), u = widen(up, n);
  std::vector<float> o(static_cast<size_t>(n));
  cpu::swiglu_forward(o.data(), g.data(), u.data(), n);
  narrow(out, o.data(), n);
}
void CpuBf16Ops::swiglu_backward(Bf16* dgate, Bf16* dup, const Bf16* dout, const Bf16* gate, const Bf16* up,
                                 int64_t n) {
  const std::vector<float> d = widen(dout, n), g = widen(gate, n), u = widen(up, n);
  std::vector<float> dg(static_cast<size_t>(n)), du(static_cast<size_t>(n));
  cpu::swiglu_backward(dg.data(), du.data(), d.data(), g.data(), u.data(), n);
  narrow(dgate, dg.data(), n);
  narrow(dup, du.data(), n);
}
void CpuBf16Ops::add_inplace(Bf16* a, const Bf16* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = to_bf16(to_f32(a[i]) + to_f32(b[i]));
}

// As the CUDA op: per chunk of tokens, fp32 logits, the per-token loss, dlogits =
// (softmax - onehot) * grad_scale rounded to bf16 (0 for masked tokens), then dx = dlogits @ W
// rounded once and dW += dlogits^T @ x in fp32.
double CpuBf16Ops::lm_head_cross_entropy(Bf16* dx, float* const* dweight_blocks, const Bf16* x,
                                         const Bf16* const* weight_blocks, int64_t block_rows,
                                         const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale,
                                         int64_t chunk_tokens) {
  const std::vector<float> w = widen_blocks(weight_blocks, block_rows, V, C);
  const std::vector<float> xf = widen(x, N * C);
  const bool backward = dx != nullptr || dweight_blocks != nullptr;
  std::vector<float> logits(static_cast<size_t>(chunk_tokens * V));
  std::vector<float> dxf(dx != nullptr ? static_cast<size_t>(chunk_tokens * C) : 0);
  double total = 0;
  for (int64_t t0 = 0; t0 < N; t0 += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, N - t0);
    sgemm(false, true, n, V, C, 1.0f, xf.data() + t0 * C, C, w.data(), C, 0.0f, logits.data(), V);
    for (int64_t i = 0; i < n; ++i) {
      float* row = logits.data() + i * V;
      const int32_t target = targets[t0 + i];
      const float m = *std::max_element(row, row + V);
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - m);
      if (target >= 0) total += std::log(sum) + m - row[target];
      if (!backward) continue;
      for (int64_t v = 0; v < V; ++v) {
        if (target < 0) {
          row[v] = 0.0f;
          continue;
        }
        const float p = static_cast<float>(std::exp(static_cast<double>(row[v]) - m) / sum);
        row[v] = to_f32(to_bf16((p - (v == target ? 1.0f : 0.0f)) * grad_scale));
      }
    }
    if (!backward) continue;
    if (dx != nullptr) {
      sgemm(false, false, n, C, V, 1.0f, logits.data(), V, w.data(), C, 0.0f, dxf.data(), C);
      narrow(dx + t0 * C, dxf.data(), n * C);
    }
    if (dweight_blocks != nullptr) {
      for (int64_t r0 = 0, b = 0; r0 < V; r0 += block_rows, ++b) {
        const int64_t rows = std::min(block_rows, V - r0);
        sgemm(true, false, rows, C, n, 1.0f, logits.data() + r0, V, xf.data() + t0 * C, C, 1.0f, dweight_blocks[b],
              C);
      }
    }
  }
  return total;
}

void CpuBf16Ops::moe_gather(Bf16* xs, const Bf16* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
  for (int64_t s = 0; s < S; ++s) std::copy_n(x + static_cast<int64_t>(token_of_slot[s]) * C, C, xs + s * C);
}
void CpuBf16Ops::moe_gather_backward(Bf16* dx, const Bf16* dxs, const int32_t* slot_of, int64_t N, int64_t K,
                                     int64_t C) {
  const std::vector<float> d = widen(dxs, N * K * C);
  std::vector<float> o(static_cast<size_t>(N * C));
  cpu::moe_gather_backward(o.data(), d.data(), slot_of, N, K, C);
  narrow(dx, o.data(), N * C);
}
void CpuBf16Ops::moe_combine_forward(Bf16* out, const Bf16* ys, const float* weights, const int32_t* slot_of,
                                     int64_t N, int64_t K, int64_t C) {
  const std::vector<float> y = widen(ys, N * K * C);
  std::vector<float> o(static_cast<size_t>(N * C));
  cpu::moe_combine_forward(o.data(), y.data(), weights, slot_of, N, K, C);
  narrow(out, o.data(), N * C);
}
void CpuBf16Ops::moe_combine_backward(Bf16* dys, float* dweights, const Bf16* dout, const Bf16* ys,
                                      const float* weights, const int32_t* slot_of, int64_t N, int64_t K,
                                      int64_t C) {
  const std::vector<float> d = widen(dout, N * C), y = widen(ys, N * K * C);
  std::vector<float> o(static_cast<size_t>(N * K * C));
  cpu::moe_combine_backward(o.data(), dweights, d.data(), y.data(), weights, slot_of, N, K, C);
  narrow(dys, o.data(), N * K * C);
}
void CpuBf16Ops::moe_experts_forward(Bf16* ys, Bf16* gate, Bf16* up, Bf16* act, const Bf16* xs,
                                     const int64_t* expert_offsets, const ExpertTensors<const Bf16>& w, int64_t E,
                                     int64_t C, int64_t F) {
  looped_experts::forward(*this, ys, gate, up, act, xs, expert_offsets, w, E, C, F);
}
void CpuBf16Ops::moe_experts_backward(Bf16* dxs, const ExpertTensors<float>& dw, Bf16* dgate, Bf16* dup,
                                      Bf16* dact, const Bf16* dys, const Bf16* xs, const Bf16* gate, const Bf16* up,
                                      const Bf16* act, const int64_t* expert_offsets,
                                      const ExpertTensors<const Bf16>& w, int64_t E, int64_t C, int64_t F) {
  looped_experts::backward(*this, dxs, dw, dgate, dup, dact, dys, xs, gate, up, act, expert_offsets, w, E, C, F);
}
// dx (N, IC) = bf16(dx + dout @ W) (the GEMM with beta = 1 on a bf16 output: one rounding);
// dW += dout^T @ x in fp32.
void CpuBf16Ops::accumulate_data_grad(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight,
                                      int64_t N, int64_t IC, int64_t OC) {
  const std::vector<float> df = widen(dout, N * OC), wf = widen(weight, OC * IC), xf = widen(x, N * IC);
  std::vector<float> acc = widen(dx, N * IC);
  sgemm(false, false, N, IC, OC, 1.0f, df.data(), OC, wf.data(), IC, 1.0f, acc.data(), IC);
  narrow(dx, acc.data(), N * IC);
  if (dweight != nullptr) sgemm(true, false, OC, IC, N, 1.0f, df.data(), OC, xf.data(), IC, 1.0f, dweight, IC);
}
void CpuBf16Ops::shared_expert_combine(Bf16* out, const Bf16* shared_out, const float* logit, int64_t N,
                                       int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float s = sigmoid(logit[n]);
    for (int64_t c = 0; c < C; ++c)
      out[n * C + c] = to_bf16(to_f32(out[n * C + c]) + s * to_f32(shared_out[n * C + c]));
  }
}
void CpuBf16Ops::shared_expert_backward(Bf16* dshared, float* dlogit, const Bf16* dout, const Bf16* shared_out,
                                        const float* logit, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float s = sigmoid(logit[n]);
    float dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      const float d = to_f32(dout[n * C + c]);
      dot += d * to_f32(shared_out[n * C + c]);
      dshared[n * C + c] = to_bf16(s * d);
    }
    dlogit[n] = dot * s * (1.0f - s);
  }
}

void CpuBf16Ops::copy_columns(Bf16* dst, int64_t ld_dst, const Bf16* src, int64_t ld_src, int64_t rows, int64_t cols,
                              ColumnOrder order) {
  cpu::copy_columns(dst, ld_dst, src, ld_src, rows, cols, order);
}
void CpuBf16Ops::sum_head_columns(Bf16* dst, const Bf16* src, int64_t ld_src, int64_t head_stride, int64_t rows,
                                  int64_t heads, int64_t cols) {
  cpu::sum_head_columns(dst, src, ld_src, head_stride, rows, heads, cols);
}

}  // namespace strata::kernels
