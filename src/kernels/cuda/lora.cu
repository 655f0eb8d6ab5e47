// LoRA adapters on CUDA (kernels/lora.h, declared in ops.h): two cuBLASLt GEMMs per forward and
// up to five per backward through gemm(), and, with dropout, two element-wise kernels that draw
// the mask from kernels::lora_dropped's hash: one writes drop(x), one adds the kept elements of
// the fp32 product dt A to dx. Per-element arithmetic is CpuBf16Ops's (kernels/cpu/lora.cpp): x times
// 1 / (1 - p) rounded to bf16; dx plus the product times 1 / (1 - p), rounded once.
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/lora.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// ---- CUDA kernels -----------------------------------------------------------------------------

// xd (rows * IC) = drop(x): 0 where lora_dropped, else round(x * keep). Element i of the chunk is
// element (first_row * IC + i) of the micro-batch's mask.
__global__ void lora_dropout_kernel(bf16* xd, const bf16* x, int64_t n, int64_t IC, int64_t first_row, uint64_t seed,
                                    float p, float keep) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t base = first_row * IC;
  for (int64_t i = first; i < n; i += stride) {
    const bool dropped = lora_dropped(seed, static_cast<uint64_t>(base + i), p);
    xd[i] = to_bf16(dropped ? 0.0f : __fmul_rn(to_float(x[i]), keep));
  }
}

// dx (rows * IC) = round(dx + g * keep) where kept; dropped elements keep their (bf16) value.
__global__ void lora_masked_add_kernel(bf16* dx, const float* g, int64_t n, int64_t IC, int64_t first_row,
                                       uint64_t seed, float p, float keep) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t base = first_row * IC;
  for (int64_t i = first; i < n; i += stride) {
    if (lora_dropped(seed, static_cast<uint64_t>(base + i), p)) continue;
    dx[i] = to_bf16(__fadd_rn(to_float(dx[i]), __fmul_rn(g[i], keep)));
  }
}

// ---- launchers and scratch ----------------------------------------------------------------------

struct Mask {
  uint64_t seed;
  float p;
  float keep;  // 1 / (1 - p), in fp32 as the CPU computes it
  int64_t row0;
};
Mask mask_of(const LoraDropout& drop) { return {drop.seed, drop.p, 1.0f / (1.0f - drop.p), drop.row0}; }

void dropout(bf16* xd, const bf16* x, int64_t rows, int64_t IC, int64_t r0, const Mask& m, cudaStream_t stream) {
  const int64_t n = rows * IC;
  lora_dropout_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(xd, x, n, IC, m.row0 + r0, m.seed, m.p,
                                                                                m.keep);
  CUDA_CHECK_LAUNCH();
}

void masked_add(bf16* dx, const float* g, int64_t rows, int64_t IC, int64_t r0, const Mask& m, cudaStream_t stream) {
  const int64_t n = rows * IC;
  lora_masked_add_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(dx, g, n, IC, m.row0 + r0, m.seed,
                                                                                   m.p, m.keep);
  CUDA_CHECK_LAUNCH();
}

// One chunk's buffers in the Context's scratch, each 256-byte aligned, those asked for: t and dt
// (rows, R) bf16, drop(x) (rows, IC) bf16 and the fp32 product g (rows, IC).
struct ChunkScratch {
  bf16* t = nullptr;
  bf16* dt = nullptr;
  bf16* xd = nullptr;
  float* g = nullptr;
};
struct ChunkNeeds {
  bool t, dt, xd, g;
};

// The chunk's bytes before alignment, per row.
size_t row_bytes(int64_t IC, int64_t R, const ChunkNeeds& needs) {
  const auto ic = static_cast<size_t>(IC), r = static_cast<size_t>(R);
  return (needs.t ? r * sizeof(bf16) : 0) + (needs.dt ? r * sizeof(bf16) : 0) + (needs.xd ? ic * sizeof(bf16) : 0) +
         (needs.g ? ic * sizeof(float) : 0);
}

size_t chunk_bytes(int64_t rows, int64_t IC, int64_t R, const ChunkNeeds& needs) {
  const auto r = static_cast<size_t>(rows), ic = static_cast<size_t>(IC), rank = static_cast<size_t>(R);
  size_t bytes = 0;
  if (needs.t) bytes += align_up(r * rank * sizeof(bf16));
  if (needs.dt) bytes += align_up(r * rank * sizeof(bf16));
  if (needs.xd) bytes += align_up(r * ic * sizeof(bf16));
  if (needs.g) bytes += align_up(r * ic * sizeof(float));
  return bytes;
}

// Rows per chunk: all N when they fit the scratch, else as many as fit (each of the at most four
// buffers loses under kAlign bytes to alignment), a multiple of 16 so that the chunks' row
// offsets keep the operands' alignment and their GEMMs share plans.
int64_t chunk_rows(const Context& ctx, int64_t N, int64_t IC, int64_t R, const ChunkNeeds& needs, const char* what) {
  if (chunk_bytes(N, IC, R, needs) <= ctx.scratch_bytes()) return N;
  const size_t room = ctx.scratch_bytes() > 4 * kAlign ? ctx.scratch_bytes() - 4 * kAlign : 0;
  int64_t rows = static_cast<int64_t>(room / row_bytes(IC, R, needs));
  if (rows > 16) rows -= rows % 16;
  CHECK_MSG(rows >= 1 && chunk_bytes(rows, IC, R, needs) <= ctx.scratch_bytes(),
            std::string(what) + ": one row of the adapter's buffers does not fit the kernels' scratch");
  return rows;
}

ChunkScratch take_scratch(const Context& ctx, int64_t rows, int64_t IC, int64_t R, const ChunkNeeds& needs,
                          const char* what) {
  char* base = static_cast<char*>(ctx.scratch(chunk_bytes(rows, IC, R, needs), what));
  const auto r = static_cast<size_t>(rows), ic = static_cast<size_t>(IC), rank = static_cast<size_t>(R);
  ChunkScratch s;
  auto take = [&](size_t bytes) {
    char* p = base;
    base += align_up(bytes);
    return p;
  };
  if (needs.t) s.t = reinterpret_cast<bf16*>(take(r * rank * sizeof(bf16)));
  if (needs.dt) s.dt = reinterpret_cast<bf16*>(take(r * rank * sizeof(bf16)));
  if (needs.xd) s.xd = reinterpret_cast<bf16*>(take(r * ic * sizeof(bf16)));
  if (needs.g) s.g = reinterpret_cast<float*>(take(r * ic * sizeof(float)));
  return s;
}

void check_lora_shape(const char* what, int64_t N, int64_t IC, int64_t OC, int64_t R, const LoraDropout& drop) {
  CHECK_MSG(N >= 0 && IC > 0 && OC > 0 && R > 0, std::string(what) + ": bad shape N=" + std::to_string(N) +
                                                     " IC=" + std::to_string(IC) + " OC=" + std::to_string(OC) +
                                                     " R=" + std::to_string(R));
  CHECK_MSG(drop.p >= 0 && drop.p < 1,
            std::string(what) + ": dropout must be in [0, 1), got " + std::to_string(drop.p));
}

}  // namespace

void lora_forward(Context& ctx, bf16* y, const bf16* x, const bf16* A, const bf16* B, float scale,
                  const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R, cudaStream_t stream) {
  check_lora_shape("lora_forward", N, IC, OC, R, drop);
  if (N == 0) return;
  const bool dropping = drop.p > 0;
  const Mask mask = mask_of(drop);
  const ChunkNeeds needs{/*t=*/true, /*dt=*/false, /*xd=*/dropping, /*g=*/false};
  const int64_t chunk = chunk_rows(ctx, N, IC, R, needs, "lora_forward");
  const ChunkScratch s = take_scratch(ctx, chunk, IC, R, needs, "lora_forward");
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t rows = chunk < N - r0 ? chunk : N - r0;
    const bf16* xin = x + r0 * IC;
    if (dropping) {
      dropout(s.xd, xin, rows, IC, r0, mask, stream);
      xin = s.xd;
    }
    // t (rows,R) = drop(x) (rows,IC) @ A (R,IC)^T, rounded to bf16
    gemm(ctx, false, true, rows, R, IC, 1.0f, xin, IC, A, IC, 0.0f, s.t, R, /*c_is_fp32=*/false, nullptr, stream);
    // y (rows,OC) = scale * t (rows,R) @ B (OC,R)^T + y, rounded once
    gemm(ctx, false, true, rows, OC, R, scale, s.t, R, B, R, 1.0f, y + r0 * OC, OC, false, nullptr, stream);
  }
}

void lora_backward(Context& ctx, bf16* dx, float* dA, float* dB, const bf16* dy, const bf16* x, const bf16* A,
                   const bf16* B, float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R,
                   cudaStream_t stream) {
  check_lora_shape("lora_backward", N, IC, OC, R, drop);
  if (N == 0 || (dx == nullptr && dA == nullptr && dB == nullptr)) return;
  const bool dropping = drop.p > 0;
  const Mask mask = mask_of(drop);
  // t serves dB only; dt serves dA and dx; drop(x) serves t and dA (dx applies the mask itself).
  const ChunkNeeds needs{/*t=*/dB != nullptr, /*dt=*/dA != nullptr || dx != nullptr,
                         /*xd=*/dropping && (dA != nullptr || dB != nullptr), /*g=*/dropping && dx != nullptr};
  const int64_t chunk = chunk_rows(ctx, N, IC, R, needs, "lora_backward");
  const ChunkScratch s = take_scratch(ctx, chunk, IC, R, needs, "lora_backward");
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t rows = chunk < N - r0 ? chunk : N - r0;
    const bf16* dyc = dy + r0 * OC;
    const bf16* xin = x + r0 * IC;
    if (needs.xd) {
      dropout(s.xd, xin, rows, IC, r0, mask, stream);
      xin = s.xd;
    }
    if (dB != nullptr) {
      // t (rows,R) = drop(x) @ A^T, recomputed and rounded as in the forward
      gemm(ctx, false, true, rows, R, IC, 1.0f, xin, IC, A, IC, 0.0f, s.t, R, false, nullptr, stream);
      // dB (OC,R) += scale * dy^T (OC,rows) @ t (rows,R), fp32
      gemm(ctx, true, false, OC, R, rows, scale, dyc, OC, s.t, R, 1.0f, dB, R, /*c_is_fp32=*/true, nullptr, stream);
    }
    if (!needs.dt) continue;
    // dt (rows,R) = scale * dy (rows,OC) @ B (OC,R), rounded to bf16
    gemm(ctx, false, false, rows, R, OC, scale, dyc, OC, B, R, 0.0f, s.dt, R, false, nullptr, stream);
    if (dA != nullptr) {
      // dA (R,IC) += dt^T (R,rows) @ drop(x) (rows,IC), fp32
      gemm(ctx, true, false, R, IC, rows, 1.0f, s.dt, R, xin, IC, 1.0f, dA, IC, true, nullptr, stream);
    }
    if (dx == nullptr) continue;
    bf16* dxc = dx + r0 * IC;
    if (!dropping) {
      // dx (rows,IC) = dt (rows,R) @ A (R,IC) + dx, rounded once
      gemm(ctx, false, false, rows, IC, R, 1.0f, s.dt, R, A, IC, 1.0f, dxc, IC, false, nullptr, stream);
    } else {
      // g (rows,IC) = dt @ A in fp32; dx += its kept elements times 1 / (1 - p)
      gemm(ctx, false, false, rows, IC, R, 1.0f, s.dt, R, A, IC, 0.0f, s.g, IC, true, nullptr, stream);
      masked_add(dxc, s.g, rows, IC, r0, mask, stream);
    }
  }
}

}  // namespace strata::kernels::cuda
