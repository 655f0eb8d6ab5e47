// AdamW with compact moments on CUDA: the bytes and parameters of
// kernels::cpu::adamw_step_compact, bit for bit. The per-element update (adamw_element.h) and
// the encodings (moment_codec.h) are the CPU's own code, compiled for the device with
// explicitly rounded intrinsics; what is left to this file is the parallel shape:
//   kBf16  a grid-stride loop, one element per thread (elements are independent).
//   kInt8  one 256-thread block per 256-element moment block: each thread decodes and updates
//          one element, the block takes the largest |m| and sqrt(v) (a max is exact, so the
//          order of the reduction does not matter), and each thread encodes its element.
// The two 8-bit tables travel as a kernel parameter (the constant bank) and are copied to
// shared memory, where the threads' binary searches read different entries without
// serialising; passing them per launch needs no per-device initialisation.
#include <cmath>

#include "kernels/adamw_element.h"
#include "kernels/cuda/common.cuh"
#include "kernels/moment_codec.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
static_assert(kMomentBlock == kThreads, "one thread per element of a moment block");

struct Tables {
  MomentTable m;
  MomentTable v;
};

struct Keys {
  uint64_t m;
  uint64_t v;
};

// grad_scale: see ops.h (null: 1; NaN: the step is skipped and nothing is written).
__device__ __forceinline__ float grad_factor(const float* grad_scale) {
  return grad_scale != nullptr ? *grad_scale : 1.0f;
}

// nonfinite: see ops.h (null: not checked).
__global__ void bf16_kernel(float* param, const float* grad, uint16_t* m, uint16_t* v, int64_t n, AdamWScalars s,
                            bool stochastic, Keys keys, const float* grad_scale, int* nonfinite) {
  const float factor = grad_factor(grad_scale);
  if (isnan(factor)) return;
  uint32_t bad = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float w = param[i];
    float mi = moment_bf16_decode(m[i]), vi = moment_bf16_decode(v[i]);
    adamw_update_element(mul_rn(grad[i], factor), w, mi, vi, s);
    const uint64_t index = static_cast<uint64_t>(i);
    param[i] = w;
    m[i] = moment_bf16_encode(mi, stochastic, stochastic ? moment_random_bits(keys.m, index) : 0);
    v[i] = moment_bf16_encode(vi, stochastic, stochastic ? moment_random_bits(keys.v, index) : 0);
    bad |= nonfinite_bits(w);
  }
  if (bad != 0 && nonfinite != nullptr) *nonfinite = 1;  // every writer stores the same value
}

// The largest of the block's values; every thread gets it. `shared` holds kThreads / 32.
__device__ float block_max(float x, float* shared) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  x = warp_max(x);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = 0.0f;  // as the CPU's running max starts: a block of NaN only gets scale 0
  for (int i = 0; i < kThreads / kWarpSize; ++i) x = fmaxf(x, shared[i]);
  return x;
}

// Encodes x (|m|, or sqrt(v), of this thread's element) with the block's scale.
__device__ uint8_t int8_encode(const float* table, float x, float scale, bool is_v, bool stochastic, uint64_t key,
                               uint64_t index) {
  if (scale == 0.0f) return static_cast<uint8_t>(is_v ? kUnsignedZeroCode : kSignedZeroCode);
  const uint64_t random = stochastic ? moment_random_bits(key, index) : 0;
  return static_cast<uint8_t>(moment_int8_encode(table, div_rn(x, scale), is_v, stochastic, random));
}

// grid (blocks of the tensor), block kThreads. m_codes/v_codes (n), m_scales/v_scales (blocks).
__global__ void int8_kernel(float* param, const float* grad, uint8_t* m_codes, float* m_scales, uint8_t* v_codes,
                            float* v_scales, int64_t n, AdamWScalars s, bool stochastic, Keys keys, Tables tables,
                            const float* grad_scale, int* nonfinite) {
  const float factor = grad_factor(grad_scale);
  if (isnan(factor)) return;  // the whole block returns: no thread is left at a barrier
  __shared__ float table_m[kMomentCodes];
  __shared__ float table_v[kMomentCodes];
  __shared__ float reduce[kThreads / kWarpSize];
  table_m[threadIdx.x] = tables.m.value[threadIdx.x];
  table_v[threadIdx.x] = tables.v.value[threadIdx.x];
  __syncthreads();

  const int64_t block = blockIdx.x;
  const int64_t i = block * kMomentBlock + threadIdx.x;
  const bool active = i < n;
  float mi = 0.0f, vi = 0.0f;
  if (active) {
    mi = mul_rn(table_m[m_codes[i]], m_scales[block]);
    const float root = mul_rn(table_v[v_codes[i]], v_scales[block]);
    vi = mul_rn(root, root);
    float w = param[i];
    adamw_update_element(mul_rn(grad[i], factor), w, mi, vi, s);
    param[i] = w;
    if (nonfinite_bits(w) != 0 && nonfinite != nullptr) *nonfinite = 1;
  }
  const float root = sqrt_rn(vi);
  // Inactive threads hold 0, which never exceeds a block's largest |x| (NaN is skipped by fmaxf).
  const float m_scale = block_max(fabsf(mi), reduce);
  const float v_scale = block_max(fabsf(root), reduce);
  if (active) {
    const uint64_t index = static_cast<uint64_t>(i);
    m_codes[i] = int8_encode(table_m, mi, m_scale, false, stochastic, keys.m, index);
    v_codes[i] = int8_encode(table_v, root, v_scale, true, stochastic, keys.v, index);
  }
  if (threadIdx.x == 0) {
    m_scales[block] = m_scale;
    v_scales[block] = v_scale;
  }
}

}  // namespace

void adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding, cudaStream_t stream) {
  adamw_step_compact(param, grad, m, v, format, n, p, rounding, nullptr, stream);
}

void adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding, const float* grad_scale,
                        cudaStream_t stream) {
  adamw_step_compact(param, grad, m, v, format, n, p, rounding, grad_scale, nullptr, stream);
}

void adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding, const float* grad_scale, int* nonfinite,
                        cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  if (format == MomentFormat::kF32) {
    const AdamWTensor t{param, grad, static_cast<float*>(m), static_cast<float*>(v), nullptr, n};
    adamw_step(&t, 1, p, grad_scale, nonfinite, stream);
    return;
  }
  const AdamWScalars s = adamw_scalars(p);
  const Keys keys{moment_stream_key(rounding.seed, false), moment_stream_key(rounding.seed, true)};
  if (format == MomentFormat::kBf16) {
    bf16_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(
        param, grad, static_cast<uint16_t*>(m), static_cast<uint16_t*>(v), n, s, rounding.stochastic, keys, grad_scale,
        nonfinite);
    CUDA_CHECK_LAUNCH();
    return;
  }
  CHECK_MSG(format == MomentFormat::kInt8, "adamw_step_compact: unknown moment format");
  CHECK_MSG(reinterpret_cast<uintptr_t>(m) % 4 == 0 && reinterpret_cast<uintptr_t>(v) % 4 == 0,
            "adamw_step_compact: int8 moments must be 4-byte aligned (their block scales are floats)");
  const int64_t blocks = ceil_div(n, kMomentBlock);
  CHECK_MSG(blocks < (int64_t{1} << 31), "adamw_step_compact: too many elements in one launch");
  const int64_t scales_offset = ceil_div(n, 16) * 16;  // the codes, padded to 16 bytes
  uint8_t* m_codes = static_cast<uint8_t*>(m);
  uint8_t* v_codes = static_cast<uint8_t*>(v);
  const Tables tables{kMomentTableM, kMomentTableV};
  int8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      param, grad, m_codes, reinterpret_cast<float*>(m_codes + scales_offset), v_codes,
      reinterpret_cast<float*>(v_codes + scales_offset), n, s, rounding.stochastic, keys, tables, grad_scale,
      nonfinite);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
