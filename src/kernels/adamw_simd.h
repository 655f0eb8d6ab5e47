// AdamW for optimizer chunks that live in host memory (DESIGN.md §3.3): explicit AVX-512 /
// AVX2 code chosen at run time, a scalar fallback, OpenMP across all cores.
//
// Every level gives bitwise the result of kernels::ref::adamw_step (torch.optim.AdamW's
// single-tensor order): the vector code performs the reference's multiplies, adds, divides and
// square roots one by one (never fused), and IEEE division and square root are correctly
// rounded in vector registers too. Elements are independent, so the result does not depend on
// the thread count either. Safe for concurrent use on disjoint buffers.
#pragma once

#include <cstdint>

#include "kernels/adamw.h"

namespace strata::kernels {

enum class SimdLevel { kScalar, kAvx2, kAvx512 };

// "scalar", "avx2" or "avx512".
const char* simd_level_name(SimdLevel level);

// Whether this CPU (and OS) can run `level`: kAvx2 needs AVX2, kAvx512 needs AVX-512 F, BW and
// VL. kScalar is always supported.
bool simd_level_supported(SimdLevel level);

// The best supported level, capped by the environment variable STRATA_SIMD (scalar | avx2 |
// avx512) when it is set; an unknown value is ignored with a warning. The CPU is probed once;
// the variable is read on every call so tests can change it.
SimdLevel detect_simd_level();

// Each step returns whether every master value it wrote is finite (no NaN or Inf): every level
// folds the check into the loop that writes them (a few ALU operations per vector, tested once
// at the end), so the pass over memory stays the only one.

// fp32 master weights and fp32 gradients. REQUIRES: simd_level_supported(level); the four
// arrays do not overlap.
bool adamw_step_f32(float* param /*(n)*/, const float* grad /*(n)*/, float* m /*(n)*/, float* v /*(n)*/, int64_t n,
                    const AdamWParams& p, SimdLevel level);

// The same with the gradients read as grad * grad_scale (the clip coefficient): bitwise what
// scaling them in place first (kernels::cpu::scale_inplace) and then updating gives, one pass
// over memory instead of two, the gradients left unchanged. When param_bf16_out is set, the new
// master is also rounded to bf16 into it (round to nearest even, as kernels::round_to_bf16):
// the host tier's update of the bf16 recipe in one pass. REQUIRES: as adamw_step_f32, and
// param_bf16_out overlaps no other array.
bool adamw_step_f32_clipped(float* param /*(n)*/, const float* grad /*(n)*/, float grad_scale, float* m /*(n)*/,
                            float* v /*(n)*/, uint16_t* param_bf16_out /*(n) or null*/, int64_t n,
                            const AdamWParams& p, SimdLevel level);

// The GPU layout's mixed precision: bf16 gradients in, fp32 master weights and moments updated
// in place, and a bf16 copy of the new master (round to nearest even, kernels/bf16.h) written
// to param_bf16_out. Bitwise equal to widening the gradients to fp32, running adamw_step_f32
// and narrowing the master. REQUIRES: simd_level_supported(level); no arrays overlap.
bool adamw_step_mixed(float* master /*(n)*/, const uint16_t* grad_bf16 /*(n)*/, float* m /*(n)*/, float* v /*(n)*/,
                      uint16_t* param_bf16_out /*(n)*/, int64_t n, const AdamWParams& p, SimdLevel level);

}  // namespace strata::kernels
