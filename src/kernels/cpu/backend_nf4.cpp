// CpuNf4Ops: the bf16 recipe with NF4 linear weights (backend.h). Each op decodes the weight's NF4
// bytes (kernels::nf4_dequantize), rounds the values to bf16 and runs the bf16 recipe's op on them.
#include <vector>

#include "core/check.h"
#include "kernels/cpu/backend.h"
#include "kernels/experts_loop.h"
#include "kernels/nf4.h"

namespace strata::kernels {
namespace {

// The (OC, IC) weight whose NF4 bytes `weight` points at, as the bf16 values the GEMMs read.
std::vector<Bf16> decoded(const Bf16* weight, int64_t OC, int64_t IC) {
  const int64_t n = OC * IC;
  std::vector<float> values(static_cast<size_t>(n));
  nf4_dequantize(reinterpret_cast<const uint8_t*>(weight), n, values.data());
  std::vector<Bf16> out(static_cast<size_t>(n));
  narrow(out.data(), values.data(), n);
  return out;
}

}  // namespace

void CpuNf4Ops::linear_forward(Bf16* out, const Bf16* x, const Bf16* weight, const Bf16* bias, int64_t N, int64_t IC,
                               int64_t OC) {
  CpuBf16Ops::linear_forward(out, x, decoded(weight, OC, IC).data(), bias, N, IC, OC);
}

void CpuNf4Ops::linear_forward_residual(Bf16* out, const Bf16* x, const Bf16* weight, const Bf16* residual, int64_t N,
                                        int64_t IC, int64_t OC) {
  CpuBf16Ops::linear_forward_residual(out, x, decoded(weight, OC, IC).data(), residual, N, IC, OC);
}

void CpuNf4Ops::linear_backward(Bf16* dx, float* dweight, float* dbias, const Bf16* dout, const Bf16* x,
                                const Bf16* weight, int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(dweight == nullptr, "a weight gradient of an NF4 weight: the nf4 base is frozen");
  CpuBf16Ops::linear_backward(dx, nullptr, dbias, dout, x, decoded(weight, OC, IC).data(), N, IC, OC);
}

void CpuNf4Ops::accumulate_data_grad(Bf16* dx, float* dweight, const Bf16* dout, const Bf16* x, const Bf16* weight,
                                     int64_t N, int64_t IC, int64_t OC) {
  CHECK_MSG(dweight == nullptr, "a weight gradient of an NF4 weight: the nf4 base is frozen");
  CpuBf16Ops::accumulate_data_grad(dx, nullptr, dout, x, decoded(weight, OC, IC).data(), N, IC, OC);
}

void CpuNf4Ops::moe_experts_forward(Bf16* ys, Bf16* gate, Bf16* up, Bf16* act, const Bf16* xs,
                                    const int64_t* expert_offsets, const ExpertTensors<const Bf16>& w, int64_t E,
                                    int64_t C, int64_t F) {
  looped_experts::forward(*this, ys, gate, up, act, xs, expert_offsets, w, E, C, F);
}

void CpuNf4Ops::moe_experts_backward(Bf16* dxs, const ExpertTensors<float>& dw, Bf16* dgate, Bf16* dup, Bf16* dact,
                                     const Bf16* dys, const Bf16* xs, const Bf16* gate, const Bf16* up,
                                     const Bf16* act, const int64_t* expert_offsets,
                                     const ExpertTensors<const Bf16>& w, int64_t E, int64_t C, int64_t F) {
  looped_experts::backward(*this, dxs, dw, dgate, dup, dact, dys, xs, gate, up, act, expert_offsets, w, E, C, F);
}

}  // namespace strata::kernels
