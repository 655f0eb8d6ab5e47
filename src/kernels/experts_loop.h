// The experts of an MoE layer as a loop over experts, each expert's rows through its gate and up
// projections, the SwiGLU and the down projection with the op set's own linear ops, so that
// every GEMM rounds (and quantises) where the recipe's linear layers do. The emulated bf16 and
// fp8 recipes on the CPU (CpuBf16Ops, CpuFp8Ops) and the fp8 recipe on CUDA (CudaFp8Ops) run
// their experts this way; the CUDA bf16 recipe runs the same products as grouped GEMMs.
// Backward: dxs = dgate @ W_gate rounded, then + dup @ W_up rounded again, as a GEMM accumulating
// onto a bf16 output does (Ops::accumulate_data_grad); dW_up += dup^T @ xs.
// expert_offsets: HOST memory (E+1); every other pointer is the op set's memory. An optional
// hook adds adapters around each projection (NoAdapters below).
#pragma once

#include <cstdint>

#include "kernels/moe.h"

namespace strata::kernels::looped_experts {

// The projections of an expert, for an adapter hook.
enum class Projection { kGate, kUp, kDown };

// A hook that adds nothing: the experts as the op sets run them. A hook with adapters (LoRA,
// model/moe_layer.h) has forward(e, projection, y, x, rows, in, out, first_row), called after
// each projection to add to its output y (rows, out) from its input x (rows, in), and
// backward(e, projection, dx, dy, x, rows, in, out, first_row), called after each projection's
// data gradient to add to dx and to its own gradients; first_row is the rows' first index in the
// expert order. For op sets without accumulate_data_grad, scratch(first_row) gives (rows, C)
// activations backward may overwrite.
struct NoAdapters {
  template <class... Args>
  void forward(Args&&...) const {}
  template <class... Args>
  void backward(Args&&...) const {}
};

template <class Ops, class Act = typename Ops::Act, class W = typename Ops::W, class Adapters = NoAdapters>
void forward(Ops& ops, Act* ys, Act* gate, Act* up, Act* act, const Act* xs, const int64_t* expert_offsets,
             const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F, const Adapters& adapters = {}) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e], rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    ops.linear_forward(gate + r0 * F, xs + r0 * C, w.gate[e], nullptr, rows, C, F);
    adapters.forward(e, Projection::kGate, gate + r0 * F, xs + r0 * C, rows, C, F, r0);
    ops.linear_forward(up + r0 * F, xs + r0 * C, w.up[e], nullptr, rows, C, F);
    adapters.forward(e, Projection::kUp, up + r0 * F, xs + r0 * C, rows, C, F, r0);
    ops.swiglu_forward(act + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    ops.linear_forward(ys + r0 * C, act + r0 * F, w.down[e], nullptr, rows, F, C);
    adapters.forward(e, Projection::kDown, ys + r0 * C, act + r0 * F, rows, F, C, r0);
  }
}

template <class Ops, class Act = typename Ops::Act, class W = typename Ops::W, class Adapters = NoAdapters>
void backward(Ops& ops, Act* dxs, const ExpertTensors<float>& dw, Act* dgate, Act* dup, Act* dact, const Act* dys,
              const Act* xs, const Act* gate, const Act* up, const Act* act, const int64_t* expert_offsets,
              const ExpertTensors<const W>& w, int64_t E, int64_t C, int64_t F, const Adapters& adapters = {}) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e], rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    ops.linear_backward(dact + r0 * F, dw.down[e], nullptr, dys + r0 * C, act + r0 * F, w.down[e], rows, F, C);
    adapters.backward(e, Projection::kDown, dact + r0 * F, dys + r0 * C, act + r0 * F, rows, F, C, r0);
    ops.swiglu_backward(dgate + r0 * F, dup + r0 * F, dact + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    ops.linear_backward(dxs + r0 * C, dw.gate[e], nullptr, dgate + r0 * F, xs + r0 * C, w.gate[e], rows, C, F);
    adapters.backward(e, Projection::kGate, dxs + r0 * C, dgate + r0 * F, xs + r0 * C, rows, C, F, r0);
    if constexpr (requires { ops.accumulate_data_grad(dxs, dw.up[e], dup, xs, w.up[e], rows, C, F); }) {
      ops.accumulate_data_grad(dxs + r0 * C, dw.up[e], dup + r0 * F, xs + r0 * C, w.up[e], rows, C, F);
    } else {
      // An op set without it (only an adapters hook brings one here): the up projection's data
      // gradient in the hook's scratch rows (rows, C), added on.
      Act* part = adapters.scratch(r0);
      ops.linear_backward(part, dw.up[e], nullptr, dup + r0 * F, xs + r0 * C, w.up[e], rows, C, F);
      ops.add_inplace(dxs + r0 * C, part, rows * C);
    }
    adapters.backward(e, Projection::kUp, dxs + r0 * C, dup + r0 * F, xs + r0 * C, rows, C, F, r0);
  }
}

}  // namespace strata::kernels::looped_experts
