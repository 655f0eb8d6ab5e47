// CpuFp8Ops: the fp8 recipe on the CPU (see backend.h). Each GEMM operand is fake-quantised to
// E4M3 with its block scales (exact: the scales are powers of two), the GEMM runs in fp32, and
// bf16 outputs are rounded once, as in the bf16 recipe.
#include <vector>

#include "core/check.h"
#include "kernels/cpu/backend.h"
#include "kernels/experts_loop.h"
#include "kernels/fp8.h"
#include "kernels/linear.h"
#include "kernels/swiglu.h"

namespace strata::kernels {
namespace {

// The weight's E4M3 blocks (rows, cols), dequantised (exactly).
std::vector<float> weight_values(const Bf16* weight, int64_t rows, int64_t cols) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  cpu::dequantize_weight_e4m3(w.data(), reinterpret_cast<const uint8_t*>(weight), rows, cols);
  return w;
}

// dx (N, IC) = q(dout) @ W, dout in 1 x 128 tiles along OC (the GEMM's K): fp32, not rounded.
void data_grad(float* dx, const std::vector<float>& dout, const std::vector<float>& w, int64_t N, int64_t IC,
               int64_t OC) {
  std::vector<float> dq = dout;
  cpu::fake_quantize_rows_e4m3(dq.data(), dq.data(), N, OC);
  sgemm(false, false, N, IC, OC, 1.0f, dq.data(), OC, w.data(), IC, 0.0f, dx, IC);
}

// dweight (OC, IC) += q(dout)^T @ q(x), both in 128 x 1 tiles along the tokens (the GEMM's K).
void weight_grad(float* dweight, const std::vector<float>& dout, const std::vector<float>& x, int64_t N, int64_t IC,
                 int64_t OC) {
  if (dweight == nullptr) return;  // a frozen weight
  std::vector<float> dq(dout.size()), xq(x.size());
  cpu::fake_quantize_cols_e4m3(dq.data(), dout.data(), N, OC);
  cpu::fake_quantize_cols_e4m3(xq.data(), x.data(), N, IC);
  sgemm(true, false, OC, IC, N, 1.0f, dq.data(), OC, xq.data(), IC, 1.0f, dweight, IC);
}

}  // namespace

void CpuFp8Ops::linear_forward(Bf16* out, const Bf16* x, const Bf16* weight, const Bf16* bias, int64_t N,
                               int64_t IC, int64_t OC) {
  std::vector<float> xf = widen(x, N * IC);
  cpu::fake_quantize_rows_e4m3(xf.data(), xf.data(), N, IC);
  const std::vector<float> wf = weight_values(weight, OC, IC);
  const std::vector<float> bf = bias != nullptr ? widen(bias, OC) : std::vector<float>();
  std::vector<float> o(static_cast<size_t>(N * OC));
  cpu::linear_forward(o.data(), xf.data(), wf.data(), bias != nullptr ? bf.data() : nullptr, N, IC, OC);
  narrow(out, o.data(), N * OC);
}

void CpuFp8Ops::linear_forward_residual(Bf16* out, const Bf16* x, const Bf16* weight, const Bf16* residual,
                                        int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(out != residual, "linear_forward_residual: out must not alias the residual");
  // The fp8 GEMM in fp32 plus the widened residual, rounded once, as in the bf16 recipe.
  std::vector<float> xf = widen(x, N * IC);
  cpu::fake_quantize_rows_e4m3(xf.data(), xf.data(), N, IC);
  const std::vector<float> wf = weight_values(weight, OC, IC);
  std::vector<float> o(static_cast<size_t>(N * OC));
  cpu::linear_forward(o.data(), xf.data(), wf.data(), nullptr, N, IC, OC);
  for (int64_t i = 0; i < N * OC; ++i) o[static_cast<size_t>(i)] += to_f32(residual[i]);
  narrow(out, o.data(), N * OC);
}

void CpuFp8Ops::linear_backward(Bf16* dx, float* dweight, float* dbias, const Bf16* dout, const Bf16* x,
                                const Bf16* weight, int64_t N, int64_t IC, int64_t OC) {
  const std::vector<float> df = widen(dout, N * OC), xf = widen(x, N * IC);
  if (dx != nullptr) {
    std::vector<float> o(static_cast<size_t>(N * IC));
    data_grad(o.data(), df, weight_values(weight, OC, IC), N, IC, OC);
    narrow(dx, o.data(), N * IC);
  }
  weight_grad(dweight, df, xf, N, IC, OC);
  // The bias gradient is a column sum of the bf16 output gradient: no GEMM, nothing quantised.
  if (dbias != nullptr)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) dbias[o] += df[static_cast<size_t>(n * OC + o)];
}

void CpuFp8Ops::moe_experts_forward(Bf16* ys, Bf16* gate, Bf16* up, Bf16* act, const Bf16* xs,
                                    const int64_t* expert_offsets, const ExpertTensors<const Bf16>& w, int64_t E,
                                    int64_t C, int64_t F) {
  looped_experts::forward(*this, ys, gate, up, act, xs, expert_offsets, w, E, C, F);
}

void CpuFp8Ops::moe_experts_backward(Bf16* dxs, const ExpertTensors<float>& dw, Bf16* dgate, Bf16* dup,
                                     Bf16* dact, const Bf16* dys, const Bf16* xs, const Bf16* gate, const Bf16* up,
                                     const Bf16* act, const int64_t* expert_offsets,
                                     const ExpertTensors<const Bf16>& w, int64_t E, int64_t C, int64_t F) {
  looped_experts::backward(*this, dxs, dw, dgate, dup, dact, dys, xs, gate, up, act, expert_offsets, w, E, C, F);
}

void CpuFp8Ops::accumulate_data_grad(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight,
                                     int64_t N, int64_t IC, int64_t OC) {
  const std::vector<float> df = widen(dout, N * OC), xf = widen(x, N * IC);
  std::vector<float> acc = widen(dx, N * IC), part(static_cast<size_t>(N * IC));
  data_grad(part.data(), df, weight_values(weight, OC, IC), N, IC, OC);
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += part[i];
  narrow(dx, acc.data(), N * IC);
  weight_grad(dweight, df, xf, N, IC, OC);
}

}  // namespace strata::kernels
