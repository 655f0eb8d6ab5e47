// AdamW step in the operation order of torch.optim.AdamW's single-tensor path
// (foreach=False): every fp32 operation below rounds where PyTorch's tensor op rounds, and the
// scalar factors are formed in double (Python floats) before being cast to fp32 as PyTorch
// does for fp32 tensors.
//
// The reference and the fast path must agree bitwise. Fusing a multiply and an add into one
// FMA rounds once instead of twice, and a compiler may fuse the vectorised loop differently
// from the scalar one, so contraction is turned off for this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/adamw.h"

#include <cmath>

#include "core/check.h"
#include "kernels/adamw_element.h"

namespace strata::kernels {

AdamWScalars adamw_scalars(const AdamWParams& p) {
  CHECK_MSG(p.step >= 1, "adamw step counts from 1");
  const double lr = p.lr, beta1 = p.beta1, beta2 = p.beta2;
  const double step = static_cast<double>(p.step);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * double(p.weight_decay));
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.one_minus_lerp = 1.0f - s.lerp_weight;
  s.lerp_small = std::fabs(s.lerp_weight) < 0.5f;
  s.lerp_factor = s.lerp_small ? s.lerp_weight : s.one_minus_lerp;
  s.beta2 = p.beta2;
  s.one_minus_b2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  s.eps = p.eps;
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
  return s;
}

namespace ref {

bool adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  const AdamWScalars s = adamw_scalars(p);
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    adamw_update_element(grad[i], param[i], m[i], v[i], s);
    finite = finite && std::isfinite(param[i]);
  }
  return finite;
}

}  // namespace ref

namespace cpu {

bool adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  const AdamWScalars s = adamw_scalars(p);
  // The lerp formula is chosen once so the loop body has no branch and vectorises; each
  // expression repeats the reference's operations in the same order. The finiteness of the
  // new parameters is an integer OR over the values written, which vectorises too.
  const float lerp_factor = s.lerp_small ? s.lerp_weight : 1.0f - s.lerp_weight;
  const bool small = s.lerp_small;
  uint32_t nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(| : nonfinite) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float w = param[i] * s.decay;
    const float mi = small ? m[i] + lerp_factor * (g - m[i]) : g - (g - m[i]) * lerp_factor;
    const float vi = v[i] * s.beta2 + s.one_minus_b2 * g * g;
    const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    const float wi = w + s.neg_step_size * mi / denom;
    param[i] = wi;
    m[i] = mi;
    v[i] = vi;
    nonfinite |= nonfinite_bits(wi);
  }
  return nonfinite == 0;
}

}  // namespace cpu
}  // namespace strata::kernels
