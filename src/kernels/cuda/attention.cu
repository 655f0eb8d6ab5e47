// Causal grouped-query attention on CUDA, flash-style (FlashAttention-2 structure): the T x T
// scores live only in shared-memory tiles, never in global memory.
//
// Every kernel works on kTile-row tiles (a template parameter: 64 rows with 4 warps, or 32 rows
// with 2); warp w owns rows [16w, 16w + 16) of every per-row tile (scores, probabilities,
// accumulators), so after a tile of K/V (or Q/dO) is in shared memory, everything a warp does to
// its rows needs only __syncwarp(). The launchers take 64-row tiles where the device's opt-in
// shared memory per block holds them (all of D=128 only on Hopper), else 32-row tiles, which
// fit the 99 KiB of sm_86/sm_89 (table by forward_smem). The matrix products are bf16
// tensor-core WMMA (16x16x16, fp32 accumulate); accumulators are kept in shared memory (fp32)
// between tiles, because the register layout of a WMMA fragment is unspecified and the online
// softmax must rescale rows of the output.
//
//   forward   grid (q tiles, Hq, B): online softmax over key tiles; writes out and lse.
//   delta     delta (B,Hq,T) = rowsum(dout * out), in scratch.
//   dk/dv     grid (k tiles, Hkv, B): loops over the group's query heads and the query tiles
//             at or after the key tile; recomputes P from lse. No atomics: the block owns
//             its dk/dv rows.
//   dq        grid (q tiles, Hq, B): loops over key tiles at or before the query tile.
// Rows past T are loaded as zeros and masked, so no garbage reaches a product.
//
// Document masks (positions non-null, kernels/attention.h): query t sees keys t - positions[b, t]
// .. t. A document's first key t - positions[b, t] never decreases along a row, so the forward
// and dq blocks start at the key tile holding their first row's, and a dk/dv block stops at the
// first query tile whose documents all start after its keys.
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/attention_schedule.h"
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;

// Threads of a block of the tiled kernels: one warp per 16 rows of a kTile-row tile.
__host__ __device__ constexpr int block_threads(int tile_rows) {
  return tile_rows / 16 * kWarpSize;
}
// Columns of a kTile-wide score row each lane of the owning warp handles (lane + e * 32).
template <int kTile>
__host__ __device__ constexpr int lane_cols() {
  static_assert(kTile == 32 || kTile == 64, "attention tiles have 32 or 64 rows");
  return kTile / kWarpSize;
}

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// ---- device helpers -----------------------------------------------------------------------

// dst (kTile, D) = rows t0.. of head h of src (B,T,H,D); rows at or past T are zeros.
// REQUIRES src 16-byte aligned (checked by the launchers).
template <int D, int kTile>
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
template <int D, int kTile>
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
template <int D, int kTile>
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

// The first key query qi of sequence b sees: its document's start (kernels/attention.h), 0
// without document masks or past the end of the sequence.
__device__ __forceinline__ int64_t first_key(const int32_t* positions, int64_t b, int64_t T, int64_t qi) {
  return positions != nullptr && qi < T ? qi - positions[b * T + qi] : 0;
}

template <int D, int kTile>
constexpr size_t forward_smem() {
  return 3 * region(kTile * D * 2) + region(kTile * kTile * 4) + region(kTile * kTile * 2) +
         region(kTile * D * 4);
}
template <int D, int kTile>
constexpr size_t dkdv_smem() {
  return 4 * region(kTile * D * 2) + 2 * region(kTile * D * 4) + 2 * region(kTile * kTile * 4) +
         2 * region(kTile * kTile * 2) + 2 * region(kTile * 4);
}
template <int D, int kTile>
constexpr size_t dq_smem() {
  return 4 * region(kTile * D * 2) + region(kTile * D * 4) + 2 * region(kTile * kTile * 4) +
         region(kTile * kTile * 2) + 2 * region(kTile * 4);
}
// KiB per block:      forward  dk/dv   dq
//   D=64,  64 rows      64     112.5   88.5
//   D=64,  32 rows      26      44.25  34.25
//   D=128, 64 rows     104     176.5  136.5
//   D=128, 32 rows      46      76.25  58.25
// Opt-in limits: Hopper 227 KiB (everything), A100 163 KiB (all but the D=128 64-row dk/dv),
// sm_86/sm_89 99 KiB (32-row tiles for D=128). attention_shared_bytes reports the 32-row need.
constexpr size_t kSmallestOptin = 99 * 1024;  // sm_86, sm_89
static_assert(std::max({forward_smem<128, 32>(), dkdv_smem<128, 32>(), dq_smem<128, 32>()}) <=
                  kSmallestOptin,
              "the 32-row tiles must fit every supported GPU");

// ---- kernels --------------------------------------------------------------------------------

template <int D, int kTile>
__global__ void __launch_bounds__(block_threads(kTile))
    attention_forward_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                             int64_t T, int64_t Hq, int64_t Hkv, float scale, int64_t past,
                             const int32_t* positions) {
  extern __shared__ __align__(128) char smem[];
  Carver carve{smem};
  bf16* Qs = carve.take<bf16>(kTile * D);
  bf16* Ks = carve.take<bf16>(kTile * D);
  bf16* Vs = carve.take<bf16>(kTile * D);
  float* S = carve.take<float>(kTile * kTile);
  bf16* P = carve.take<bf16>(kTile * kTile);
  float* O = carve.take<float>(kTile * D);

  const int64_t q0 = attention_query_tile(blockIdx.x, gridDim.x) * kTile;  // longest first
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t g = h / (Hq / Hkv);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row0 = 16 * warp;
  constexpr int kCols = lane_cols<kTile>();

  load_tile<D, kTile>(Qs, q, b, q0, T, Hq, h);
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) O[i] = 0.0f;
  // Running max and sum of this warp's 16 rows; every lane holds the same values.
  float row_max[16], row_sum[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    row_max[rr] = -INFINITY;
    row_sum[rr] = 0.0f;
  }

  // Query qi is at position past + qi; k and v hold Tk = past + T rows per sequence.
  const int64_t Tk = past + T;
  const int64_t kv_end = min(past + q0 + kTile, Tk);  // causal: keys up to the last query row
  // Document masks: no row of the tile sees a key before its first row's document.
  const int64_t kv_begin = first_key(positions, b, T, q0) / kTile * kTile;
  for (int64_t k0 = kv_begin; k0 < kv_end; k0 += kTile) {
    __syncthreads();  // the previous tiles are no longer read
    load_tile<D, kTile>(Ks, k, b, k0, Tk, Hkv, g);
    load_tile<D, kTile>(Vs, v, b, k0, Tk, Hkv, g);
    __syncthreads();

    warp_abt<D, kTile>(S, Qs, Ks, row0);  // S rows of this warp = Q K^T
    __syncwarp();
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const int r = row0 + rr;
      const int64_t qi = q0 + r;
      const int64_t first = first_key(positions, b, T, qi);
      float s[kCols];
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        const int c = lane + e * kWarpSize;
        const int64_t kv = k0 + c;
        s[e] = (kv >= first && kv <= past + qi && kv < Tk) ? S[r * kTile + c] * scale : -INFINITY;
      }
      float s_max = s[0];
#pragma unroll
      for (int e = 1; e < kCols; ++e) s_max = fmaxf(s_max, s[e]);
      const float m_new = fmaxf(row_max[rr], warp_max(s_max));
      // A row with every score masked so far keeps max -inf; exponentiate against 0 then.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      float p[kCols];
#pragma unroll
      for (int e = 0; e < kCols; ++e) p[e] = expf(s[e] - m_use);
      const float alpha = expf(row_max[rr] - m_use);
      float p_sum = p[0];
#pragma unroll
      for (int e = 1; e < kCols; ++e) p_sum += p[e];
      row_sum[rr] = alpha * row_sum[rr] + warp_sum(p_sum);
      row_max[rr] = m_new;
#pragma unroll
      for (int e = 0; e < kCols; ++e) P[r * kTile + lane + e * kWarpSize] = to_bf16(p[e]);
      for (int d = lane; d < D; d += kWarpSize) O[r * D + d] *= alpha;
    }
    __syncwarp();
    warp_acc_pv<D, kTile>(O, P, Vs, row0);  // O rows of this warp += P V
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
template <int kTile>
__device__ void load_row_stats(float* lse_s, float* delta_s, const float* lse, const float* delta,
                               int64_t b, int64_t h, int64_t Hq, int64_t T, int64_t t0) {
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
    const int64_t t = t0 + i;
    const bool in = t < T;
    lse_s[i] = in ? lse[(b * Hq + h) * T + t] : 0.0f;
    delta_s[i] = in ? delta[(b * Hq + h) * T + t] : 0.0f;
  }
}

template <int D, int kTile>
__global__ void __launch_bounds__(block_threads(kTile))
    attention_dkdv_kernel(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                          const bf16* v, const float* lse, const float* delta, int64_t T,
                          int64_t Hq, int64_t Hkv, float scale, const int32_t* positions) {
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

  // The first key tiles are visited by the most query tiles: they go first.
  const int64_t k0 = attention_key_tile(blockIdx.x, gridDim.x) * kTile;
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t group = Hq / Hkv;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row0 = 16 * warp;  // this warp's key rows
  constexpr int kCols = lane_cols<kTile>();

  load_tile<D, kTile>(Ks, k, b, k0, T, Hkv, g);
  load_tile<D, kTile>(Vs, v, b, k0, T, Hkv, g);
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    dK[i] = 0.0f;
    dV[i] = 0.0f;
  }
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    // Causal: query rows before k0 see none of these keys. k0 is a multiple of kTile.
    for (int64_t q0 = k0; q0 < T; q0 += kTile) {
      // Document masks: this query tile's documents, and every later one's, start after these
      // keys (the same value for every thread, so the whole block leaves together).
      if (first_key(positions, b, T, q0) >= k0 + kTile) break;
      __syncthreads();  // the previous Q/dO tiles are no longer read
      load_tile<D, kTile>(Qs, q, b, q0, T, Hq, h);
      load_tile<D, kTile>(dOs, dout, b, q0, T, Hq, h);
      load_row_stats<kTile>(lse_s, delta_s, lse, delta, b, h, Hq, T, q0);
      __syncthreads();

      warp_abt<D, kTile>(St, Ks, Qs, row0);   // S^T = K Q^T
      warp_abt<D, kTile>(dPt, Vs, dOs, row0);  // dP^T = V dO^T
      __syncwarp();
      for (int rr = 0; rr < 16; ++rr) {
        const int r = row0 + rr;
        const int64_t kv = k0 + r;
#pragma unroll
        for (int e = 0; e < kCols; ++e) {
          const int c = lane + e * kWarpSize;
          const int64_t qi = q0 + c;
          float p = 0.0f, ds = 0.0f;
          if (kv <= qi && qi < T && kv < T && kv >= first_key(positions, b, T, qi)) {
            p = expf(St[r * kTile + c] * scale - lse_s[c]);
            ds = p * (dPt[r * kTile + c] - delta_s[c]) * scale;
          }
          Pt[r * kTile + c] = to_bf16(p);
          dSt[r * kTile + c] = to_bf16(ds);
        }
      }
      __syncwarp();
      warp_acc_pv<D, kTile>(dV, Pt, dOs, row0);  // dV += P^T dO
      warp_acc_pv<D, kTile>(dK, dSt, Qs, row0);  // dK += dS^T Q (scale folded into dS)
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

template <int D, int kTile>
__global__ void __launch_bounds__(block_threads(kTile))
    attention_dq_kernel(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                        const float* lse, const float* delta, int64_t T, int64_t Hq,
                        int64_t Hkv, float scale, const int32_t* positions) {
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

  const int64_t q0 = attention_query_tile(blockIdx.x, gridDim.x) * kTile;  // longest first
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t g = h / (Hq / Hkv);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int row0 = 16 * warp;  // this warp's query rows
  constexpr int kCols = lane_cols<kTile>();

  load_tile<D, kTile>(Qs, q, b, q0, T, Hq, h);
  load_tile<D, kTile>(dOs, dout, b, q0, T, Hq, h);
  load_row_stats<kTile>(lse_s, delta_s, lse, delta, b, h, Hq, T, q0);
  for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) dQ[i] = 0.0f;

  const int64_t kv_end = min(q0 + kTile, T);
  const int64_t kv_begin = first_key(positions, b, T, q0) / kTile * kTile;  // as in the forward
  for (int64_t k0 = kv_begin; k0 < kv_end; k0 += kTile) {
    __syncthreads();
    load_tile<D, kTile>(Ks, k, b, k0, T, Hkv, g);
    load_tile<D, kTile>(Vs, v, b, k0, T, Hkv, g);
    __syncthreads();

    warp_abt<D, kTile>(S, Qs, Ks, row0);    // S = Q K^T
    warp_abt<D, kTile>(dP, dOs, Vs, row0);  // dP = dO V^T
    __syncwarp();
    for (int rr = 0; rr < 16; ++rr) {
      const int r = row0 + rr;
      const int64_t qi = q0 + r;
      const int64_t first = first_key(positions, b, T, qi);
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        const int c = lane + e * kWarpSize;
        const int64_t kv = k0 + c;
        float ds = 0.0f;
        if (kv >= first && kv <= qi && qi < T && kv < T) {
          const float p = expf(S[r * kTile + c] * scale - lse_s[r]);
          ds = p * (dP[r * kTile + c] - delta_s[r]) * scale;
        }
        dS[r * kTile + c] = to_bf16(ds);
      }
    }
    __syncwarp();
    warp_acc_pv<D, kTile>(dQ, dS, Ks, row0);  // dQ += dS K
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

// Dynamic shared memory per block of each tiled kernel.
struct SmemNeeds {
  size_t forward, dkdv, dq;
};
template <int D, int kTile>
constexpr SmemNeeds smem_needs() {
  return {forward_smem<D, kTile>(), dkdv_smem<D, kTile>(), dq_smem<D, kTile>()};
}
SmemNeeds smem_needs(int64_t D, int tile_rows) {
  CHECK_MSG(D == 64 || D == 128,
            "the CUDA attention supports head dimensions 64 and 128, got " + std::to_string(D));
  CHECK_MSG(tile_rows == 32 || tile_rows == 64,
            "attention tiles have 32 or 64 rows, got " + std::to_string(tile_rows));
  if (D == 64) return tile_rows == 64 ? smem_needs<64, 64>() : smem_needs<64, 32>();
  return tile_rows == 64 ? smem_needs<128, 64>() : smem_needs<128, 32>();
}

// cudaDevAttrMaxSharedMemoryPerBlockOptin of the current device. Queried once per device: the
// launchers run for every layer of every step, and the limit never changes.
size_t shared_optin() {
  static std::mutex mutex;
  static std::vector<int> by_device;  // 0: not queried yet
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= by_device.size()) by_device.resize(device + 1, 0);
  int& optin = by_device[device];
  if (optin == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  }
  return static_cast<size_t>(optin);
}

// Rows of the tiles of one kernel: tile_rows when nonzero, else 64 when the kernel's 64-row
// need fits the device (each loaded K/V or Q/dO tile then serves twice the rows), else 32.
// CHECKs that the chosen tile fits.
int pick_tile(int tile_rows, size_t need64, size_t need32, const char* kernel, int64_t D) {
  CHECK_MSG(tile_rows == 0 || tile_rows == 32 || tile_rows == 64,
            "attention tile_rows must be 0 (automatic), 32 or 64, got " +
                std::to_string(tile_rows));
  const size_t optin = shared_optin();
  const int tile = tile_rows != 0 ? tile_rows : (need64 <= optin ? 64 : 32);
  const size_t need = tile == 64 ? need64 : need32;
  CHECK_MSG(need <= optin, std::string(kernel) + " for head dim " + std::to_string(D) +
                               " with " + std::to_string(tile) + "-row tiles needs " +
                               std::to_string(need) +
                               " bytes of shared memory per block; this device allows " +
                               std::to_string(optin) +
                               " (cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  return tile;
}

template <int D>
float softmax_scale() {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
}

template <int D, int kTile>
void launch_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                    int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t past, const int32_t* positions,
                    cudaStream_t stream) {
  const size_t smem = forward_smem<D, kTile>();
  allow_smem(attention_forward_kernel<D, kTile>, smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kTile)), static_cast<unsigned>(Hq),
                  static_cast<unsigned>(B));
  attention_forward_kernel<D, kTile><<<grid, block_threads(kTile), smem, stream>>>(
      out, lse, q, k, v, T, Hq, Hkv, softmax_scale<D>(), past, positions);
  CUDA_CHECK_LAUNCH();
}

template <int D, int kTile>
void launch_dkdv(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                 const bf16* v, const float* lse, const float* delta, int64_t B, int64_t T,
                 int64_t Hq, int64_t Hkv, const int32_t* positions, cudaStream_t stream) {
  const size_t smem = dkdv_smem<D, kTile>();
  allow_smem(attention_dkdv_kernel<D, kTile>, smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kTile)), static_cast<unsigned>(Hkv),
                  static_cast<unsigned>(B));
  attention_dkdv_kernel<D, kTile><<<grid, block_threads(kTile), smem, stream>>>(
      dk, dv, dout, q, k, v, lse, delta, T, Hq, Hkv, softmax_scale<D>(), positions);
  CUDA_CHECK_LAUNCH();
}

template <int D, int kTile>
void launch_dq(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
               const float* lse, const float* delta, int64_t B, int64_t T, int64_t Hq,
               int64_t Hkv, const int32_t* positions, cudaStream_t stream) {
  const size_t smem = dq_smem<D, kTile>();
  allow_smem(attention_dq_kernel<D, kTile>, smem);
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kTile)), static_cast<unsigned>(Hq),
                  static_cast<unsigned>(B));
  attention_dq_kernel<D, kTile><<<grid, block_threads(kTile), smem, stream>>>(
      dq, dout, q, k, v, lse, delta, T, Hq, Hkv, softmax_scale<D>(), positions);
  CUDA_CHECK_LAUNCH();
}

template <int D>
void forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B,
             int64_t T, int64_t Hq, int64_t Hkv, int64_t past, const int32_t* positions, int tile,
             cudaStream_t stream) {
  if (tile == 64) {
    launch_forward<D, 64>(out, lse, q, k, v, B, T, Hq, Hkv, past, positions, stream);
  } else {
    launch_forward<D, 32>(out, lse, q, k, v, B, T, Hq, Hkv, past, positions, stream);
  }
}

// The dk/dv and dq kernels only share lse and delta, so each gets its own tile size.
template <int D>
void backward(float* delta, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const bf16* out, const float* lse, int64_t B,
              int64_t T, int64_t Hq, int64_t Hkv, const int32_t* positions, int tile_kv, int tile_q,
              cudaStream_t stream) {
  const int64_t rows = B * T * Hq;
  constexpr int kDeltaThreads = 256;
  attention_delta_kernel<D>
      <<<static_cast<unsigned>(ceil_div(rows * kWarpSize, kDeltaThreads)), kDeltaThreads, 0,
         stream>>>(delta, dout, out, B, T, Hq);
  CUDA_CHECK_LAUNCH();

  if (tile_kv == 64) {
    launch_dkdv<D, 64>(dk, dv, dout, q, k, v, lse, delta, B, T, Hq, Hkv, positions, stream);
  } else {
    launch_dkdv<D, 32>(dk, dv, dout, q, k, v, lse, delta, B, T, Hq, Hkv, positions, stream);
  }
  if (tile_q == 64) {
    launch_dq<D, 64>(dq, dout, q, k, v, lse, delta, B, T, Hq, Hkv, positions, stream);
  } else {
    launch_dq<D, 32>(dq, dout, q, k, v, lse, delta, B, T, Hq, Hkv, positions, stream);
  }
}

}  // namespace

size_t attention_shared_bytes(int64_t D) {
  const SmemNeeds need = smem_needs(D, 32);
  return std::max({need.forward, need.dkdv, need.dq});
}

size_t attention_forward_shared_bytes(int64_t D, int tile_rows) {
  return smem_needs(D, tile_rows).forward;
}

size_t attention_backward_shared_bytes(int64_t D, int tile_rows) {
  const SmemNeeds need = smem_needs(D, tile_rows);
  return std::max(need.dkdv, need.dq);
}

void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                       int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                       cudaStream_t stream, int tile_rows, int64_t past, const int32_t* positions) {
  check_args(B, T, Hq, Hkv, D, {out, q, k, v});
  CHECK(past >= 0);
  CHECK_MSG(positions == nullptr || past == 0, "document-masked attention takes no cached keys");
  if (B == 0 || T == 0) return;
  const int tile = pick_tile(tile_rows, smem_needs(D, 64).forward, smem_needs(D, 32).forward,
                             "attention_forward", D);
  if (D == 64) {
    forward<64>(out, lse, q, k, v, B, T, Hq, Hkv, past, positions, tile, stream);
  } else {
    forward<128>(out, lse, q, k, v, B, T, Hq, Hkv, past, positions, tile, stream);
  }
}

void attention_backward(Context& ctx, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                        const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                        const float* lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                        int64_t D, cudaStream_t stream, int tile_rows, const int32_t* positions) {
  check_args(B, T, Hq, Hkv, D, {dq, dk, dv, dout, q, k, v, out});
  if (B == 0 || T == 0) return;
  const SmemNeeds need64 = smem_needs(D, 64), need32 = smem_needs(D, 32);
  const int tile_kv =
      pick_tile(tile_rows, need64.dkdv, need32.dkdv, "attention_backward (dk/dv)", D);
  const int tile_q = pick_tile(tile_rows, need64.dq, need32.dq, "attention_backward (dq)", D);
  auto* delta = static_cast<float*>(ctx.scratch(
      static_cast<size_t>(B * Hq * T) * sizeof(float), "attention_backward (delta)"));
  if (D == 64) {
    backward<64>(delta, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, positions, tile_kv,
                 tile_q, stream);
  } else {
    backward<128>(delta, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, positions, tile_kv,
                  tile_q, stream);
  }
}

}  // namespace strata::kernels::cuda
