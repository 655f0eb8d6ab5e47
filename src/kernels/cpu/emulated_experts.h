// The experts of an MoE layer in the emulated bf16 and fp8 recipes (CpuBf16Ops, CpuFp8Ops): each
// expert's rows through its gate and up projections, the SwiGLU and the down projection, with the
// recipe's own linear ops, so that every GEMM rounds (and quantises) where the recipe's does.
// Backward: dxs = dgate @ W_gate rounded, then + dup @ W_up rounded again, as a GEMM accumulating
// onto a bf16 output does (Ops::accumulate_data_grad); dW_up += dup^T @ xs.
#pragma once

#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/moe.h"

namespace strata::kernels::emulated {

template <class Ops>
void experts_forward(Ops& ops, Bf16* ys, Bf16* gate, Bf16* up, Bf16* act, const Bf16* xs,
                     const int64_t* expert_offsets, const ExpertTensors<const Bf16>& w, int64_t E, int64_t C,
                     int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e], rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    ops.linear_forward(gate + r0 * F, xs + r0 * C, w.gate[e], nullptr, rows, C, F);
    ops.linear_forward(up + r0 * F, xs + r0 * C, w.up[e], nullptr, rows, C, F);
    ops.swiglu_forward(act + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    ops.linear_forward(ys + r0 * C, act + r0 * F, w.down[e], nullptr, rows, F, C);
  }
}

template <class Ops>
void experts_backward(Ops& ops, Bf16* dxs, const ExpertTensors<float>& dw, Bf16* dgate, Bf16* dup, Bf16* dact,
                      const Bf16* dys, const Bf16* xs, const Bf16* gate, const Bf16* up, const Bf16* act,
                      const int64_t* expert_offsets, const ExpertTensors<const Bf16>& w, int64_t E, int64_t C,
                      int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e], rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    ops.linear_backward(dact + r0 * F, dw.down[e], nullptr, dys + r0 * C, act + r0 * F, w.down[e], rows, F, C);
    ops.swiglu_backward(dgate + r0 * F, dup + r0 * F, dact + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    ops.linear_backward(dxs + r0 * C, dw.gate[e], nullptr, dgate + r0 * F, xs + r0 * C, w.gate[e], rows, C, F);
    ops.accumulate_data_grad(dxs + r0 * C, dw.up[e], dup + r0 * F, xs + r0 * C, w.up[e], rows, C, F);
  }
}

}  // namespace strata::kernels::emulated
