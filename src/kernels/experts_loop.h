// The experts of an MoE layer as a loop over experts, each expert's rows through its gate and up
// projections, the SwiGLU and the down projection with the op set's own linear ops, so that
// every GEMM rounds (and quantises) where the recipe's linear layers do. The emulated bf16 and
// fp8 recipes on the CPU (CpuBf16Ops, CpuFp8Ops) and the fp8 recipe on CUDA (CudaFp8Ops) run
// their experts this way; the CUDA bf16 recipe runs the same products as grouped GEMMs.
// Backward: dxs = dgate @ W_gate rounded, then + dup @ W_up rounded again, as a GEMM accumulating
// onto a bf16 output does (Ops::accumulate_data_grad); dW_up += dup^T @ xs.
// expert_offsets: HOST memory (E+1); every other pointer is the op set's memory.
#pragma once

#include <cstdint>

#include "kernels/moe.h"

namespace strata::kernels::looped_experts {

template <class Ops, class Act = typename Ops::Act, class W = typename Ops::W>
void forward(Ops& ops, Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
             const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e], rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    ops.linear_forward(gate + r0 * F, xs + r0 * C, w.gate[e], nullptr, rows, C, F);
    ops.linear_forward(up + r0 * F, xs + r0 * C, w.up[e], nullptr, rows, C, F);
    ops.swiglu_forward(act + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    ops.linear_forward(ys + r0 * C, act + r0 * F, w.down[e], nullptr, rows, F, C);
  }
}

template <class Ops, class Act = typename Ops::Act, class W = typename Ops::W>
void backward(Ops& ops, Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact, const Act* dys,
              const Act* xs, const Act* gate, const Act* up, const Act* act, const int64_t* expert_offsets,
              const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e], rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    ops.linear_backward(dact + r0 * F, dw.down[e], nullptr, dys + r0 * C, act + r0 * F, w.down[e], rows, F, C);
    ops.swiglu_backward(dgate + r0 * F, dup + r0 * F, dact + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    ops.linear_backward(dxs + r0 * C, dw.gate[e], nullptr, dgate + r0 * F, xs + r0 * C, w.gate[e], rows, C, F);
    ops.accumulate_data_grad(dxs + r0 * C, dw.up[e], dup + r0 * F, xs + r0 * C, w.up[e], rows, C, F);
  }
}

}  // namespace strata::kernels::looped_experts
