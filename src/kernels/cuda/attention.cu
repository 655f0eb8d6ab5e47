// Causal grouped-query attention on CUDA, flash-style (FlashAttention-2 structure): the T x T
// scores live only in shared-memory tiles, never in global memory.
//
// Every kernel works on 64-row tiles with 4 warps; warp w owns rows [16w, 16w + 16) of every
// per-row tile (scores, probabilities, accumulators), so after a tile of K/V (or Q/dO) is in
// shared memory, everything a warp does to its rows needs only __syncwarp(). The matrix
// products are bf16 tensor-core WMMA (16x16x16, fp32 accumulate); accumulators are kept in
// shared memory (fp32) between tiles, because the register layout of a WMMA fragment is
// unspecified and the online softmax must rescale rows of the output.
//
//   forward   grid (q tiles, Hq, B): online softmax over key tiles; writes out and lse.
//   delta     delta (B,Hq,T) = rowsum(dout * out), in scratch.
//   dk/dv     grid (k tiles, Hkv, B): loops over the group's query heads and the query tiles
//             at or after the key tile; recomputes P from lse. No atomics: the block owns
//             its dk/dv rows.
//   dq        grid (q tiles, Hq, B): loops over key tiles at or before the query tile.
// Rows past T are loaded as zeros and masked, so no garbage reaches a product.
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;  // rows of a query tile and of a key tile
constexpr int kWarps = 4;  // kTile / 16
constexpr int kThreads = kWarps * kWarpSize;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// ---- device helpers -----------------------------------------------------------------------

// dst (kTile, D) = rows t0.. of head h of src (B,T,H,D); rows at or past T are zeros.
// REQUIRES src 16-byte aligned (checked by the launchers).
template <int D>
__device__ void load_tile(bf16* dst, const bf16* src, int64_t b, int64_t t0, int64_t T,
                          int64_t H, int64_t h) {
  constexpr int kVecs = D / 8;  // 16-byte vectors per row
  for (int i = threadIdx.x; i < kTile * kVecs; i += blockDim.x) {
    const int r = i / kVecs, c = i % kVecs;
    const int64_t t = t0 + r;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (t < T) value = *reinterpret_cast<const uint4*>(src + ((b * T + t) * H + h) * D + c * 8);
    *reinterpret_cast<uint4*>(dst + r * D + c * 8) = value;
  }
}

// rows [row0, row0 + 16) x all kTile columns of C (kTile wide, fp32) = A (rows, D) @ B^T, B
// being (kTile, D) row-major: both operands read along D. One warp.
template <int D>
__device__ void warp_abt(float* C, const bf16* A, const bf16* B, int row0) {
#pragma unroll
  for (int j = 0; j < kTile / 16; ++j) {
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      FragA a;
      FragBCol bt;
      wmma::load_matrix_sync(a, A + row0 * D + kk, D);
      wmma::load_matrix_sync(bt, B + (16 * j) * D + kk, D);  // element (k, n) = B[16j + n][kk + k]
      wmma::mma_sync(acc, a, bt, acc);
    }
    wmma::store_matrix_sync(C + row0 * kTile + 16 * j, acc, kTile, wmma::mem_row_major);
  }
}

// rows [row0, row0 + 16) of Acc (rows, D) fp32 += P (rows, kTile) bf16 @ V (kTile, D) bf16.
// One warp.
template <int D>
__device__ void warp_acc_pv(float* Acc, const bf16* P, const bf16* V, int row0) {
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    FragAcc acc;
    wmma::load_matrix_sync(acc, Acc + row0 * D + 16 * j, D, wmma::mem_row_major);
#pragma unroll
    for (int kk = 0; kk < kTile; kk += 16) {
      FragA a;
      FragBRow bv;
      wmma::load_matrix_sync(a, P + row0 * kTile + kk, kTile);
      wmma::load_matrix_sync(bv, V + kk * D + 16 * j, D);
      wmma::mma_sync(acc, a, bv, acc);
    }
    wmma::store_matrix_sync(Acc + row0 * D + 16 * j, acc, D, wmma::mem_row_major);
  }
}

// Shared-memory carving: consecutive regions, each a multiple of 128 bytes for these sizes.
struct Carver {
  char* p;
  template <typename T>
  __device__ T* take(int count) {
    T* r = reinterpret_cast<T*>(p);
    p += (static_cast<size_t>(count) * sizeof(T) + 127) / 128 * 128;
    return r;
  }
};
constexpr size_t region(size_t bytes) { return (bytes + 127) / 128 * 128; }

template <int D>
constexpr size_t forward_smem() {
  return 3 * region(kTile * D * 2) + region(kTile * kTile * 4) + region(kTile * kTile * 2) +
         region(kTile * D * 4);
}
template <int D>
constexpr size_t dkdv_smem() {
  return 4 * region(kTile * D * 2) + 2 * region(kTile * D * 4) + 2 * region(kTile * kTile * 4) +
         2 * region(kTile * kTile * 2) + 2 * region(kTile * 4);
}
template <int D>
constexpr size_t dq_smem() {
  return 4 * region(kTile * D * 2) + region(kTile * D * 4) + 2 * region(kTile * kTile * 4) +
         region(kTile * kTile * 2) + 2 * region(kTile * 4);
}

// ---- kernels --------------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                             int64_t T, int64_t Hq, int64_t Hkv, float scale) {
  extern __shared__ __align__(128) char smem[];
  Carver carve{smem};
  bf16* Qs = carve.take<bf16>(kTile * D);
  bf16* Ks = carve.take<bf16>(kTile * D);
  bf16* Vs = carve.take<bf16>(kTile * D);
  float* S = carve.take<float>(kTile * kTile);
  bf16* P = carve.take<bf16>(kTile * kTile);
  float* O = carve.take<float>(kTile * D);

  const int64_t q0 = (int64_t{gridDim.x} - 1 - blockIdx.x) * kTile;  // longest tiles first
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t g = h / (Hq / Hkv);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row0 = 16 * warp;

  load_tile<D>(Qs, q, b, q0, T, Hq, h);
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) O[i] = 0.0f;
  // Running max and sum of this warp's 16 rows; every lane holds the same values.
  float row_max[16], row_sum[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    row_max[rr] = -INFINITY;
    row_sum[rr] = 0.0f;
  }

  const int64_t kv_end = min(q0 + kTile, T);  // causal: keys up to the last query row
  for (int64_t k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();  // the previous tiles are no longer read
    load_tile<D>(Ks, k, b, k0, T, Hkv, g);
    load_tile<D>(Vs, v, b, k0, T, Hkv, g);
    __syncthreads();

    warp_abt<D>(S, Qs, Ks, row0);  // S rows of this warp = Q K^T
    __syncwarp();
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const int r = row0 + rr;
      const int64_t qi = q0 + r;
      float s[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = lane + e * kWarpSize;
        const int64_t kv = k0 + c;
        s[e] = (kv <= qi && kv < T) ? S[r * kTile + c] * scale : -INFINITY;
      }
      const float m_new = fmaxf(row_max[rr], warp_max(fmaxf(s[0], s[1])));
      // A row with every score masked so far keeps max -inf; exponentiate against 0 then.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float p0 = expf(s[0] - m_use), p1 = expf(s[1] - m_use);
      const float alpha = expf(row_max[rr] - m_use);
      row_sum[rr] = alpha * row_sum[rr] + warp_sum(p0 + p1);
      row_max[rr] = m_new;
      P[r * kTile + lane] = to_bf16(p0);
      P[r * kTile + lane + kWarpSize] = to_bf16(p1);
      for (int d = lane; d < D; d += kWarpSize) O[r * D + d] *= alpha;
    }
    __syncwarp();
    warp_acc_pv<D>(O, P, Vs, row0);  // O rows of this warp += P V
  }
  __syncwarp();
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    const int r = row0 + rr;
    const int64_t qi = q0 + r;
    if (qi >= T) continue;  // uniform across the warp
    const float inv = 1.0f / row_sum[rr];
    bf16* o = out + ((b * T + qi) * Hq + h) * D;
    for (int d = lane; d < D; d += kWarpSize) o[d] = to_bf16(O[r * D + d] * inv);
    if (lane == 0) lse[(b * Hq + h) * T + qi] = row_max[rr] + logf(row_sum[rr]);
  }
}

// delta (B,Hq,T) = rowsum(dout * out). One warp per row (b, t, h).
template <int D>
__global__ void attention_delta_kernel(float* delta, const bf16* dout, const bf16* out,
                                       int64_t B, int64_t T, int64_t Hq) {
  const int64_t row = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= B * T * Hq) return;  // uniform across the warp
  const bf16* a = dout + row * D;
  const bf16* o = out + row * D;
  float s = 0.0f;
  for (int d = lane; d < D; d += kWarpSize) s += to_float(a[d]) * to_float(o[d]);
  s = warp_sum(s);
  if (lane == 0) {
    const int64_t h = row % Hq, t = (row / Hq) % T, b = row / (Hq * T);
    delta[(b * Hq + h) * T + t] = s;
  }
}

// lse and delta of query rows t0.. of head h into shared arrays; rows at or past T get 0.
__device__ void load_row_stats(float* lse_s, float* delta_s, const float* lse, const float* delta,
                               int64_t b, int64_t h, int64_t Hq, int64_t T, int64_t t0) {
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
    const int64_t t = t0 + i;
    const bool in = t < T;
    lse_s[i] = in ? lse[(b * Hq + h) * T + t] : 0.0f;
    delta_s[i] = in ? delta[(b * Hq + h) * T + t] : 0.0f;
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                          const bf16* v, const float* lse, const float* delta, int64_t T,
                          int64_t Hq, int64_t Hkv, float scale) {
  extern __shared__ __align__(128) char smem[];
  Carver carve{smem};
  bf16* Ks = carve.take<bf16>(kTile * D);
  bf16* Vs = carve.take<bf16>(kTile * D);
  bf16* Qs = carve.take<bf16>(kTile * D);
  bf16* dOs = carve.take<bf16>(kTile * D);
  float* dK = carve.take<float>(kTile * D);
  float* dV = carve.take<float>(kTile * D);
  float* St = carve.take<float>(kTile * kTile);   // (key, query) scores: S transposed
  float* dPt = carve.take<float>(kTile * kTile);  // (key, query) dP transposed
  bf16* Pt = carve.take<bf16>(kTile * kTile);
  bf16* dSt = carve.take<bf16>(kTile * kTile);
  float* lse_s = carve.take<float>(kTile);
  float* delta_s = carve.take<float>(kTile);

  const int64_t k0 = (int64_t{gridDim.x} - 1 - blockIdx.x) * kTile;  // longest tiles first
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t group = Hq / Hkv;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row0 = 16 * warp;  // this warp's key rows

  load_tile<D>(Ks, k, b, k0, T, Hkv, g);
  load_tile<D>(Vs, v, b, k0, T, Hkv, g);
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    dK[i] = 0.0f;
    dV[i] = 0.0f;
  }
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    // Causal: query rows before k0 see none of these keys. k0 is a multiple of kTile.
    for (int64_t q0 = k0; q0 < T; q0 += kTile) {
      __syncthreads();  // the previous Q/dO tiles are no longer read
      load_tile<D>(Qs, q, b, q0, T, Hq, h);
      load_tile<D>(dOs, dout, b, q0, T, Hq, h);
      load_row_stats(lse_s, delta_s, lse, delta, b, h, Hq, T, q0);
      __syncthreads();

      warp_abt<D>(St, Ks, Qs, row0);   // S^T = K Q^T
      warp_abt<D>(dPt, Vs, dOs, row0);  // dP^T = V dO^T
      __syncwarp();
      for (int rr = 0; rr < 16; ++rr) {
        const int r = row0 + rr;
        const int64_t kv = k0 + r;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = lane + e * kWarpSize;
          const int64_t qi = q0 + c;
          float p = 0.0f, ds = 0.0f;
          if (kv <= qi && qi < T && kv < T) {
            p = expf(St[r * kTile + c] * scale - lse_s[c]);
            ds = p * (dPt[r * kTile + c] - delta_s[c]) * scale;
          }
          Pt[r * kTile + c] = to_bf16(p);
          dSt[r * kTile + c] = to_bf16(ds);
        }
      }
      __syncwarp();
      warp_acc_pv<D>(dV, Pt, dOs, row0);  // dV += P^T dO
      warp_acc_pv<D>(dK, dSt, Qs, row0);  // dK += dS^T Q (scale folded into dS)
    }
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int r = row0 + rr;
    const int64_t kv = k0 + r;
    if (kv >= T) continue;  // uniform across the warp
    bf16* dkr = dk + ((b * T + kv) * Hkv + g) * D;
    bf16* dvr = dv + ((b * T + kv) * Hkv + g) * D;
    for (int d = lane; d < D; d += kWarpSize) {
      dkr[d] = to_bf16(dK[r * D + d]);
      dvr[d] = to_bf16(dV[r * D + d]);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                        const float* lse, const float* delta, int64_t T, int64_t Hq,
                        int64_t Hkv, float scale) {
  extern __shared__ __align__(128) char smem[];
  Carver carve{smem};
  bf16* Qs = carve.take<bf16>(kTile * D);
  bf16* dOs = carve.take<bf16>(kTile * D);
  bf16* Ks = carve.take<bf16>(kTile * D);
  bf16* Vs = carve.take<bf16>(kTile * D);
  float* dQ = carve.take<float>(kTile * D);
  float* S = carve.take<float>(kTile * kTile);
  float* dP = carve.take<float>(kTile * kTile);
  bf16* dS = carve.take<bf16>(kTile * kTile);
  float* lse_s = carve.take<float>(kTile);
  float* delta_s = carve.take<float>(kTile);

  const int64_t q0 = (int64_t{gridDim.x} - 1 - blockIdx.x) * kTile;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t g = h / (Hq / Hkv);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row0 = 16 * warp;  // this warp's query rows

  load_tile<D>(Qs, q, b, q0, T, Hq, h);
  load_tile<D>(dOs, dout, b, q0, T, Hq, h);
  load_row_stats(lse_s, delta_s, lse, delta, b, h, Hq, T, q0);
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) dQ[i] = 0.0f;

  const int64_t kv_end = min(q0 + kTile, T);
  for (int64_t k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();
    load_tile<D>(Ks, k, b, k0, T, Hkv, g);
    load_tile<D>(Vs, v, b, k0, T, Hkv, g);
    __syncthreads();

    warp_abt<D>(S, Qs, Ks, row0);    // S = Q K^T
    warp_abt<D>(dP, dOs, Vs, row0);  // dP = dO V^T
    __syncwarp();
    for (int rr = 0; rr < 16; ++rr) {
      const int r = row0 + rr;
      const int64_t qi = q0 + r;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = lane + e * kWarpSize;
        const int64_t kv = k0 + c;
        float ds = 0.0f;
        if (kv <= qi && qi < T && kv < T) {
          const float p = expf(S[r * kTile + c] * scale - lse_s[r]);
          ds = p * (dP[r * kTile + c] - delta_s[r]) * scale;
        }
        dS[r * kTile + c] = to_bf16(ds);
      }
    }
    __syncwarp();
    warp_acc_pv<D>(dQ, dS, Ks, row0);  // dQ += dS K
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int r = row0 + rr;
    const int64_t qi = q0 + r;
    if (qi >= T) continue;
    bf16* dqr = dq + ((b * T + qi) * Hq + h) * D;
    for (int d = lane; d < D; d += kWarpSize) dqr[d] = to_bf16(dQ[r * D + d]);
  }
}

// ---- launchers ------------------------------------------------------------------------------

void check_args(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                std::initializer_list<const void*> pointers) {
  CHECK(B >= 0 && T >= 0);
  CHECK_MSG(Hkv > 0 && Hq > 0 && Hq % Hkv == 0,
            "attention needs Hq a multiple of Hkv, got Hq=" + std::to_string(Hq) +
                " Hkv=" + std::to_string(Hkv));
  CHECK_MSG(D == 64 || D == 128,
            "the CUDA attention supports head dimensions 64 and 128, got " + std::to_string(D));
  CHECK_MSG(Hq < 65536 && B < 65536, "attention: Hq and B must be below 65536");
  for (const void* p : pointers) {
    CHECK_MSG(reinterpret_cast<uintptr_t>(p) % 16 == 0,
              "attention tensors must be 16-byte aligned");
  }
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

template <int D>
void forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B,
             int64_t T, int64_t Hq, int64_t Hkv, cudaStream_t stream) {
  const size_t smem = forward_smem<D>();
  allow_smem(attention_forward_kernel<D>, smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kTile)), static_cast<unsigned>(Hq),
                  static_cast<unsigned>(B));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  attention_forward_kernel<D><<<grid, kThreads, smem, stream>>>(out, lse, q, k, v, T, Hq, Hkv,
                                                                scale);
  CUDA_CHECK_LAUNCH();
}

template <int D>
void backward(float* delta, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const bf16* out, const float* lse, int64_t B,
              int64_t T, int64_t Hq, int64_t Hkv, cudaStream_t stream) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const int64_t rows = B * T * Hq;
  constexpr int kDeltaThreads = 256;
  attention_delta_kernel<D>
      <<<static_cast<unsigned>(ceil_div(rows * kWarpSize, kDeltaThreads)), kDeltaThreads, 0,
         stream>>>(delta, dout, out, B, T, Hq);
  CUDA_CHECK_LAUNCH();

  const unsigned tiles = static_cast<unsigned>(ceil_div(T, kTile));
  const size_t smem_kv = dkdv_smem<D>();
  allow_smem(attention_dkdv_kernel<D>, smem_kv);
  attention_dkdv_kernel<D>
      <<<dim3(tiles, static_cast<unsigned>(Hkv), static_cast<unsigned>(B)), kThreads, smem_kv,
         stream>>>(dk, dv, dout, q, k, v, lse, delta, T, Hq, Hkv, scale);
  CUDA_CHECK_LAUNCH();

  const size_t smem_q = dq_smem<D>();
  allow_smem(attention_dq_kernel<D>, smem_q);
  attention_dq_kernel<D>
      <<<dim3(tiles, static_cast<unsigned>(Hq), static_cast<unsigned>(B)), kThreads, smem_q,
         stream>>>(dq, dout, q, k, v, lse, delta, T, Hq, Hkv, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t attention_shared_bytes(int64_t D) {
  if (D == 64) return std::max({forward_smem<64>(), dkdv_smem<64>(), dq_smem<64>()});
  return std::max({forward_smem<128>(), dkdv_smem<128>(), dq_smem<128>()});
}

void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                       int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                       cudaStream_t stream) {
  check_args(B, T, Hq, Hkv, D, {out, q, k, v});
  if (B == 0 || T == 0) return;
  if (D == 64) {
    forward<64>(out, lse, q, k, v, B, T, Hq, Hkv, stream);
  } else {
    forward<128>(out, lse, q, k, v, B, T, Hq, Hkv, stream);
  }
}

void attention_backward(Context& ctx, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                        const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                        const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                        int64_t D, cudaStream_t stream) {
  check_args(B, T, Hq, Hkv, D, {dq, dk, dv, dout, q, k, v, out});
  if (B == 0 || T == 0) return;
  auto* delta = static_cast<float*>(ctx.scratch(
      static_cast<size_t>(B * Hq * T) * sizeof(float), "attention_backward (delta)"));
  if (D == 64) {
    backward<64>(delta, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, stream);
  } else {
    backward<128>(delta, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, stream);
  }
}

}  // namespace strata::kernels::cuda
