// One element of AdamW in the operation order of torch.optim.AdamW's single-tensor path, shared
// by the CPU reference (cpu/adamw.cpp), the compact-moment update (cpu/moments.cpp) and the CUDA
// kernels (cuda/adamw.cu, cuda/moments.cu), so that the formula exists once.
//
// Every product, sum, quotient and square root rounds on its own: on the GPU through the _rn
// intrinsics (nvcc would otherwise fuse a multiply and an add into one FMA), on the CPU through
// plain operators in files that turn floating-point contraction off. Compiles as C++17 under
// nvcc; includes nothing that pulls in the logging stack.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/adamw.h"

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define STRATA_HOST_DEVICE inline
#endif

namespace strata::kernels {

// fp32 operations rounded once each, identically on host and device.
STRATA_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
STRATA_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
STRATA_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
STRATA_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
STRATA_HOST_DEVICE float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// 0 when x is finite, nonzero (a NaN's bits) when x is NaN or Inf: x - x is +0 for every finite
// x. One subtraction, whose bits a loop ORs over the values it writes, so that the loop still
// vectorises: the finiteness check of an update is two operations per vector and no second
// pass over memory.
STRATA_HOST_DEVICE uint32_t nonfinite_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(__fsub_rn(x, x));
#else
  const float zero_if_finite = x - x;
  uint32_t bits;
  std::memcpy(&bits, &zero_if_finite, sizeof(bits));
  return bits;
#endif
}

// Updates one element: param, m and v in place, from gradient g and the step's scalars.
STRATA_HOST_DEVICE void adamw_update_element(float g, float& param, float& m, float& v, const AdamWScalars& s) {
  // param.mul_(1 - lr * weight_decay)
  float w = mul_rn(param, s.decay);
  // exp_avg.lerp_(grad, 1 - beta1): PyTorch's lerp picks the formula by the weight's size.
  float mi = m;
  if (s.lerp_small) {
    mi = add_rn(mi, mul_rn(s.lerp_weight, sub_rn(g, mi)));
  } else {
    mi = sub_rn(g, mul_rn(sub_rn(g, mi), s.one_minus_lerp));
  }
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  float vi = mul_rn(v, s.beta2);
  vi = add_rn(vi, mul_rn(mul_rn(s.one_minus_b2, g), g));
  // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
  const float denom = add_rn(div_rn(sqrt_rn(vi), s.bc2_sqrt), s.eps);
  // param.addcdiv_(exp_avg, denom, value=-step_size)
  w = add_rn(w, div_rn(mul_rn(s.neg_step_size, mi), denom));
  param = w;
  m = mi;
  v = vi;
}

}  // namespace strata::kernels
