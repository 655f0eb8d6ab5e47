// Mixture-of-experts ops on CUDA: routing, the stable permutation to experts, gather/combine,
// the experts' SwiGLU MLPs as grouped GEMMs on cuBLAS, and the router statistics. The router
// stays in fp32 (logits, probabilities, routing weights and their gradients: small, and the top-k
// choices must be the reference's); token activations and the experts' intermediates are bf16,
// with fp32 accumulation inside every op and fp32 expert weight gradients (the recipe of ops.h).
// Deterministic: the only atomics are integer counts; every float sum runs in an order fixed by
// the shapes.
#include <cublas_v2.h>

#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cublas_check.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxRouteWarps = 4;                       // tokens per routing block, one warp each
constexpr size_t kRouteSharedBytes = size_t{48} << 10;  // without opting in to more
constexpr int64_t kMaxRouteExperts = 2048;
constexpr int kStatsTile = 32;  // router stats: 32 experts x 32 row lanes per block

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Bits needed to hold every expert index in [0, E).
int key_bits(int64_t E) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < E) ++bits;
  return bits;
}

// ---- routing --------------------------------------------------------------------------------

// Per-warp shared memory of the routing kernels, in doubles: two arrays of E doubles, then E
// flag bytes rounded up to whole doubles.
__host__ __device__ inline int64_t route_shared_doubles(int64_t E) { return 2 * E + (E + 7) / 8; }

__device__ __forceinline__ void check_expert(int32_t e, int E) {
  if (e < 0 || e >= E) __trap();  // REQUIRES 0 <= expert index < E
}

// The score of group g of `per` experts (GroupScore): its largest selection score, or the sum of
// its two largest.
__device__ double group_score(const double* score, int g, int per, bool top_two) {
  double first = -INFINITY, second = -INFINITY;
  for (int i = g * per; i < (g + 1) * per; ++i) {
    if (score[i] > first) {
      second = first;
      first = score[i];
    } else if (score[i] > second) {
      second = score[i];
    }
  }
  return top_two ? first + second : first;
}

// One warp per token. probs = softmax(logits), or sigmoid(logits) for kSigmoidThenTopK, in
// double; score = logits or probs, plus the selection bias; with groups, lane 0 marks the experts
// outside the kept groups as taken; the K best scores by repeated warp arg-max (ties to the lower
// index, as the reference); then the weights of the selected experts, by lane 0 in k order.
__global__ void route_forward_kernel(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                                     const float* bias, int64_t N, RouterConfig c) {
  const int E = static_cast<int>(c.num_experts), K = static_cast<int>(c.top_k);
  const bool topk_then_softmax = c.scoring == RouterScoring::kTopKThenSoftmax;
  const bool sigmoid = c.scoring == RouterScoring::kSigmoidThenTopK;
  const bool normalize = c.normalize_top_k;
  extern __shared__ double route_shared[];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t n = int64_t{blockIdx.x} * (blockDim.x / kWarpSize) + warp;
  if (n >= N) return;                                         // the whole warp leaves together; no block barriers below
  double* p = route_shared + warp * route_shared_doubles(E);  // (E)
  double* score = p + E;                                      // (E)
  auto* taken = reinterpret_cast<unsigned char*>(score + E);  // (E)
  const float* l = logits + n * E;

  if (sigmoid) {
    for (int e = lane; e < E; e += kWarpSize) p[e] = 1.0 / (1.0 + exp(-double(l[e])));
  } else {
    double max_logit = -INFINITY;
    for (int e = lane; e < E; e += kWarpSize) max_logit = fmax(max_logit, double(l[e]));
    max_logit = warp_max(max_logit);
    double partial = 0.0;
    for (int e = lane; e < E; e += kWarpSize) {
      const double v = exp(double(l[e]) - max_logit);
      p[e] = v;
      partial += v;
    }
    const double denom = warp_sum(partial);
    for (int e = lane; e < E; e += kWarpSize) p[e] /= denom;
  }
  for (int e = lane; e < E; e += kWarpSize) {
    probs[n * E + e] = static_cast<float>(p[e]);
    const double base = topk_then_softmax ? double(l[e]) : p[e];
    score[e] = base + (bias != nullptr ? double(bias[e]) : 0.0);
    taken[e] = c.num_groups > 1 ? 1 : 0;  // with groups, every expert starts excluded
  }
  __syncwarp();
  if (c.num_groups > 1 && lane == 0) {
    // Group-limited routing: the top_groups best groups (ties to the lower one) become eligible.
    const int G = static_cast<int>(c.num_groups), per = E / G;
    const bool top_two = c.group_score == GroupScore::kTopTwoSum;
    for (int pick = 0; pick < c.top_groups; ++pick) {
      int best = -1;
      double best_score = 0.0;
      for (int g = 0; g < G; ++g) {
        if (taken[g * per] == 0) continue;  // already kept
        const double v = group_score(score, g, per, top_two);
        if (best < 0 || v > best_score) {
          best = g;
          best_score = v;
        }
      }
      for (int i = best * per; i < (best + 1) * per; ++i) taken[i] = 0;
    }
  }
  __syncwarp();

  int32_t* idx = expert_idx + n * K;
  for (int k = 0; k < K; ++k) {
    // Each lane's best untaken expert (its experts come in increasing index order)...
    int best = -1;
    double best_score = 0.0;
    for (int e = lane; e < E; e += kWarpSize) {
      if (taken[e] == 0 && (best < 0 || score[e] > best_score)) {
        best = e;
        best_score = score[e];
      }
    }
    // ...then the warp's: the higher score, on equal scores the lower index.
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const int other = __shfl_xor_sync(kFullMask, best, offset);
      const double other_score = __shfl_xor_sync(kFullMask, best_score, offset);
      if (other >= 0 && (best < 0 || other_score > best_score || (other_score == best_score && other < best))) {
        best = other;
        best_score = other_score;
      }
    }
    best = __shfl_sync(kFullMask, best, 0);  // one answer even if a score is NaN
    if (lane == 0) {
      idx[k] = best;
      taken[best] = 1;
    }
    __syncwarp();
  }

  if (lane == 0) {
    float* w = weights + n * K;
    if (topk_then_softmax) {
      double top_max = l[idx[0]];
      for (int k = 1; k < K; ++k) {
        const double v = l[idx[k]];
        top_max = top_max < v ? v : top_max;
      }
      double z = 0.0;
      for (int k = 0; k < K; ++k) z += exp(double(l[idx[k]]) - top_max);
      for (int k = 0; k < K; ++k) w[k] = static_cast<float>(exp(double(l[idx[k]]) - top_max) / z);
    } else {
      double z = 0.0;
      for (int k = 0; k < K; ++k) z += p[idx[k]];
      for (int k = 0; k < K; ++k) w[k] = static_cast<float>((normalize ? p[idx[k]] / z : p[idx[k]]) * double(c.scale));
    }
  }
}

// One warp per token: the gradient through the selected weights (lane 0, k order), plus
// prob_grad, then the softmax backward dl += p * (dp - <p, dp>) over all experts, or for sigmoid
// scores dl = dp * p (1 - p). Double.
__global__ void route_backward_kernel(float* dlogits, const float* dweights, const float* prob_grad, const float* probs,
                                      const int32_t* expert_idx, const float* weights, int64_t N, RouterConfig c) {
  const int E = static_cast<int>(c.num_experts), K = static_cast<int>(c.top_k);
  const bool topk_then_softmax = c.scoring == RouterScoring::kTopKThenSoftmax;
  const bool normalize = c.normalize_top_k;
  extern __shared__ double route_shared[];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t n = int64_t{blockIdx.x} * (blockDim.x / kWarpSize) + warp;
  if (n >= N) return;
  double* dl = route_shared + warp * route_shared_doubles(E);  // (E)
  double* dp = dl + E;                                         // (E)
  const float* p = probs + n * E;
  for (int e = lane; e < E; e += kWarpSize) {
    dl[e] = 0.0;
    dp[e] = 0.0;
  }
  __syncwarp();
  if (lane == 0) {
    const int32_t* idx = expert_idx + n * K;
    const float* w = weights + n * K;
    const float* dw = dweights + n * K;
    for (int k = 0; k < K; ++k) check_expert(idx[k], E);
    double w_dot_dw = 0.0;
    for (int k = 0; k < K; ++k) w_dot_dw += double(w[k]) * double(dw[k]);
    if (topk_then_softmax) {
      // w = softmax over the selected logits: dl_s = w_s (dw_s - <w, dw>).
      for (int k = 0; k < K; ++k) dl[idx[k]] += double(w[k]) * (double(dw[k]) - w_dot_dw);
    } else if (normalize) {
      // w_k = s p_k / Z, Z = sum of the selected p, s the scale: dp_k = s (dw_k - <w, dw> / s) / Z.
      const double scale = c.scale;
      double z = 0.0;
      for (int k = 0; k < K; ++k) z += double(p[idx[k]]);
      for (int k = 0; k < K; ++k) dp[idx[k]] += scale * (double(dw[k]) - w_dot_dw / scale) / z;
    } else {
      for (int k = 0; k < K; ++k) dp[idx[k]] += double(c.scale) * double(dw[k]);
    }
  }
  __syncwarp();
  if (c.scoring == RouterScoring::kSigmoidThenTopK) {
    // Each score is its own logit's sigmoid: dl = dp * p (1 - p).
    for (int e = lane; e < E; e += kWarpSize) {
      if (prob_grad != nullptr) dp[e] += double(prob_grad[e]);
      dlogits[n * E + e] = static_cast<float>(dp[e] * double(p[e]) * (1.0 - double(p[e])));
    }
    return;
  }
  double partial = 0.0;
  for (int e = lane; e < E; e += kWarpSize) {
    if (prob_grad != nullptr) dp[e] += double(prob_grad[e]);
    partial += double(p[e]) * dp[e];
  }
  const double p_dot_dp = warp_sum(partial);
  for (int e = lane; e < E; e += kWarpSize) {
    dlogits[n * E + e] = static_cast<float>(dl[e] + double(p[e]) * (dp[e] - p_dot_dp));
  }
}

// Launch shape of the routing kernels: as many warps per block as the shared memory allows.
struct RouteLaunch {
  unsigned blocks;
  int threads;
  size_t shared_bytes;
};

RouteLaunch route_launch(int64_t N, int64_t E) {
  CHECK_MSG(E <= kMaxRouteExperts, "MoE routing on CUDA supports at most " + std::to_string(kMaxRouteExperts) +
                                       " experts, got " + std::to_string(E));
  const size_t per_warp = static_cast<size_t>(route_shared_doubles(E)) * sizeof(double);
  int warps = kMaxRouteWarps;
  while (warps > 1 && warps * per_warp > kRouteSharedBytes) warps /= 2;
  CHECK(per_warp <= kRouteSharedBytes);
  const int64_t blocks = ceil_div(N, warps);
  CHECK(blocks <= INT_MAX);
  return {static_cast<unsigned>(blocks), warps * kWarpSize, warps * per_warp};
}

void check_router(const RouterConfig& c) {
  const char* why = nullptr;
  CHECK_MSG(router_config_ok(c, &why), std::string("router config: ") + why);
}

// ---- permutation ----------------------------------------------------------------------------

// keys (A) = expert of each assignment, assignments (A) = 0..A-1: the input of the stable sort.
__global__ void permute_input_kernel(uint32_t* keys, int32_t* assignments, const int32_t* expert_idx, int64_t A,
                                     int E) {
  for (int64_t a = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; a < A; a += int64_t{gridDim.x} * blockDim.x) {
    const int32_t e = expert_idx[a];
    check_expert(e, E);
    keys[a] = static_cast<uint32_t>(e);
    assignments[a] = static_cast<int32_t>(a);
  }
}

// Slot s holds the s-th assignment of the sorted order; a = n * K + k.
__global__ void permute_output_kernel(int32_t* slot_of, int32_t* token_of_slot, const int32_t* sorted_assignments,
                                      int64_t A, int64_t K) {
  for (int64_t s = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; s < A; s += int64_t{gridDim.x} * blockDim.x) {
    const int32_t a = sorted_assignments[s];
    slot_of[a] = static_cast<int32_t>(s);
    token_of_slot[s] = static_cast<int32_t>(a / K);
  }
}

// offsets[e] = the first slot whose expert is >= e. Position s in [0, A] writes the offsets of
// the experts in (key[s-1], key[s]] (key[-1] = -1, key[A] = E), so each is written once.
__global__ void expert_offsets_kernel(int64_t* offsets, const uint32_t* sorted_keys, int64_t A, int64_t E) {
  for (int64_t s = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; s <= A; s += int64_t{gridDim.x} * blockDim.x) {
    const int64_t prev = s > 0 ? int64_t{sorted_keys[s - 1]} : -1;
    const int64_t cur = s < A ? int64_t{sorted_keys[s]} : E;
    for (int64_t e = prev + 1; e <= cur; ++e) offsets[e] = s;
  }
}

struct PermuteScratch {
  uint32_t* keys_in;
  uint32_t* keys_out;
  int32_t* assignments_in;
  int32_t* assignments_out;
  void* cub_temp;
  size_t cub_temp_bytes;
  size_t total_bytes;
};

// Carves the scratch for A assignments starting at `base` (null: sizes only).
PermuteScratch permute_scratch(void* base, int64_t A, int64_t E) {
  PermuteScratch s{};
  size_t cub_bytes = 0;
  // A size query: no work is launched and no memory is touched.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(A), 0, key_bits(E)));
  const size_t keys = align256(static_cast<size_t>(A) * sizeof(uint32_t));
  const size_t assignments = align256(static_cast<size_t>(A) * sizeof(int32_t));
  auto* p = static_cast<char*>(base);
  s.keys_in = reinterpret_cast<uint32_t*>(p);
  s.keys_out = reinterpret_cast<uint32_t*>(p + keys);
  s.assignments_in = reinterpret_cast<int32_t*>(p + 2 * keys);
  s.assignments_out = reinterpret_cast<int32_t*>(p + 2 * keys + assignments);
  s.cub_temp = p + 2 * keys + 2 * assignments;
  s.cub_temp_bytes = cub_bytes;
  s.total_bytes = 2 * keys + 2 * assignments + align256(cub_bytes);
  return s;
}

// ---- gather and combine ---------------------------------------------------------------------

// kernels/moe.h moe_tile_offsets, one thread per offset.
__global__ void tile_offsets_kernel(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0,
                                    int64_t rows) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e > E) return;
  const int64_t r = expert_offsets[e] - row0;
  tile_offsets[e] = r < 0 ? 0 : (r > rows ? rows : r);
}

// xs (S,C) = x[token_of_slot]
__global__ void gather_kernel(bf16* xs, const bf16* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
  const int64_t total = S * C;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t s = i / C, c = i - s * C;
    xs[i] = x[int64_t{token_of_slot[s]} * C + c];
  }
}

// dx (N,C) = sum over k, in k order, of dxs[slot_of[n,k]]: fp32 sum, one rounding to bf16.
__global__ void gather_backward_kernel(bf16* dx, const bf16* dxs, const int32_t* slot_of, int64_t N, int64_t K,
                                       int64_t C) {
  const int64_t total = N * C;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / C, c = i - n * C;
    const int32_t* slots = slot_of + n * K;
    float acc = to_float(dxs[int64_t{slots[0]} * C + c]);
    for (int64_t k = 1; k < K; ++k) acc += to_float(dxs[int64_t{slots[k]} * C + c]);
    dx[i] = to_bf16(acc);
  }
}

// out (N,C) = sum over k, in k order, of weights[n,k] * ys[slot_of[n,k]]: fp32 weights and sum,
// one rounding to bf16.
__global__ void combine_forward_kernel(bf16* out, const bf16* ys, const float* weights, const int32_t* slot_of,
                                       int64_t N, int64_t K, int64_t C) {
  const int64_t total = N * C;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / C, c = i - n * C;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      acc += weights[n * K + k] * to_float(ys[int64_t{slot_of[n * K + k]} * C + c]);
    }
    out[i] = to_bf16(acc);
  }
}

// One warp per assignment a = (n, k): dys[slot] = w * dout[n] (the fp32 product, rounded once);
// dweights[a] = <dout[n], ys[slot]> in fp32 (lane partials in column order, then the fixed warp
// tree).
__global__ void combine_backward_kernel(bf16* dys, float* dweights, const bf16* dout, const bf16* ys,
                                        const float* weights, const int32_t* slot_of, int64_t A, int64_t K, int64_t C) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t a = int64_t{blockIdx.x} * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (a >= A) return;  // the whole warp leaves together
  const int64_t slot = slot_of[a];
  const float w = weights[a];
  const bf16* d = dout + (a / K) * C;
  const bf16* y = ys + slot * C;
  bf16* dy = dys + slot * C;
  float dot = 0.0f;
  for (int64_t c = lane; c < C; c += kWarpSize) {
    const float dc = to_float(d[c]);
    dy[c] = to_bf16(w * dc);
    dot += dc * to_float(y[c]);
  }
  dot = warp_sum(dot);
  if (lane == 0) dweights[a] = dot;
}

// ---- router statistics ----------------------------------------------------------------------

static_assert(sizeof(unsigned long long) == sizeof(int64_t), "counts are 64-bit");

// counts[e] += assignments to e. Integer atomics: the result does not depend on their order.
__global__ void count_assignments_kernel(int64_t* counts, const int32_t* expert_idx, int64_t A, int E) {
  for (int64_t a = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; a < A; a += int64_t{gridDim.x} * blockDim.x) {
    const int32_t e = expert_idx[a];
    check_expert(e, E);
    atomicAdd(reinterpret_cast<unsigned long long*>(counts + e), 1ull);
  }
}

// Block (kStatsTile, kStatsTile) per kStatsTile experts: thread (x, y) sums the rows y, y + 32,
// ... of expert x in double (coalesced across x), then thread (x, 0) adds the 32 partials in y
// order.
__global__ void prob_sums_kernel(double* prob_sums, const float* probs, int64_t N, int64_t E) {
  __shared__ double partial[kStatsTile][kStatsTile + 1];
  const int64_t e = int64_t{blockIdx.x} * kStatsTile + threadIdx.x;
  double acc = 0.0;
  if (e < E) {
    for (int64_t n = threadIdx.y; n < N; n += kStatsTile) acc += double(probs[n * E + e]);
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double sum = 0.0;
    for (int r = 0; r < kStatsTile; ++r) sum += partial[r][threadIdx.x];
    prob_sums[e] += sum;
  }
}

// ---- grouped GEMMs --------------------------------------------------------------------------

// One row-major GEMM on bf16 matrices: C (M,N) = op(A) @ op(B) + beta * C with op(X) = X or X^T,
// row strides lda/ldb/ldc (the conventions of gemm() in context.cpp), alpha = 1, fp32
// accumulation, C rounded to bf16 once (beta * C is added in fp32 before that rounding).
struct GemmProblem {
  bool trans_a, trans_b;
  int64_t M, N, K;
  const bf16* A;
  int64_t lda;
  const bf16* B;
  int64_t ldb;
  float beta;
  bf16* C;
  int64_t ldc;
};

int to_int(int64_t v) {
  CHECK_MSG(v >= 0 && v <= INT_MAX,
            "grouped GEMM dimension " + std::to_string(v) + " does not fit the 32-bit cuBLAS interface");
  return static_cast<int>(v);
}

// The grouped GEMM calls of one op, each a list of independent problems (no problem writes
// what another of the same call reads or writes). The device arrays of pointers of every call
// go to scratch in one host-to-device copy; then the calls run in the order of the stream, each
// as one cublasGemmGroupedBatchedEx (bf16 A, B and C, CUBLAS_COMPUTE_32F) with one group per
// problem (their shapes differ).
//
// Only the bf16 outputs go through here: cublasGemmGroupedBatchedEx takes bf16 A/B with
// CUBLAS_COMPUTE_32F only together with a bf16 C (its type table pairs bf16/bf16, fp16/fp16 and
// fp32/fp32 for A-B/C), so it cannot add into the fp32 weight gradients. Those go through gemm()
// (cuBLASLt: bf16 A/B, fp32 C, beta = 1), see add_weight_gradient.
//
// cuBLAS is column-major: a row-major (R, S) matrix with row stride ld is the column-major
// (S, R) matrix with leading dimension ld. So row-major C = op(A) @ op(B) is column-major
// C^T = op(B)^T @ op(A)^T: m = N, n = M, first operand B (transposed iff trans_b), second A.
class GroupedGemms {
 public:
  size_t add(std::vector<GemmProblem> call) {
    calls_.push_back(std::move(call));
    return calls_.size() - 1;
  }

  void upload(Context& ctx, cudaStream_t stream, const char* what) {
    std::vector<void*> table;
    for (const std::vector<GemmProblem>& call : calls_) {
      first_.push_back(table.size());
      // Column-major first operand, second operand, output (the operands are only read).
      for (const GemmProblem& p : call) table.push_back(const_cast<bf16*>(p.B));
      for (const GemmProblem& p : call) table.push_back(const_cast<bf16*>(p.A));
      for (const GemmProblem& p : call) table.push_back(p.C);
    }
    const size_t bytes = table.size() * sizeof(void*);
    device_table_ = static_cast<void**>(ctx.scratch(bytes, what));
    // From pageable memory: staged before the call returns, so `table` may go away after it.
    CUDA_CHECK(cudaMemcpyAsync(device_table_, table.data(), bytes, cudaMemcpyHostToDevice, stream));
  }

  void run(Context& ctx, size_t call_index, cudaStream_t stream) const {
    const std::vector<GemmProblem>& call = calls_[call_index];
    const size_t count = call.size();
    if (count == 0) return;
    std::vector<cublasOperation_t> trans_first(count), trans_second(count);
    std::vector<int> m(count), n(count), k(count), ld_first(count), ld_second(count), ldc(count);
    // The scale type of CUBLAS_COMPUTE_32F is fp32: host arrays of floats (host pointer mode).
    std::vector<float> alpha(count, 1.0f), beta(count);
    const std::vector<int> group_size(count, 1);
    for (size_t i = 0; i < count; ++i) {
      const GemmProblem& p = call[i];
      CHECK(p.M > 0 && p.N > 0 && p.K > 0);
      CHECK(p.ldc >= p.N);
      CHECK(p.ldb >= (p.trans_b ? p.K : p.N));
      CHECK(p.lda >= (p.trans_a ? p.M : p.K));
      trans_first[i] = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      trans_second[i] = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      m[i] = to_int(p.N);
      n[i] = to_int(p.M);
      k[i] = to_int(p.K);
      ld_first[i] = to_int(p.ldb);
      ld_second[i] = to_int(p.lda);
      ldc[i] = to_int(p.ldc);
      beta[i] = p.beta;
    }
    void** table = device_table_ + first_[call_index];
    CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
        ctx.blas(stream), trans_first.data(), trans_second.data(), m.data(), n.data(), k.data(), alpha.data(),
        const_cast<const void* const*>(table), CUDA_R_16BF, ld_first.data(),
        const_cast<const void* const*>(table + count), CUDA_R_16BF, ld_second.data(), beta.data(), table + 2 * count,
        CUDA_R_16BF, ldc.data(), static_cast<int>(count), group_size.data(), CUBLAS_COMPUTE_32F));
  }

 private:
  std::vector<std::vector<GemmProblem>> calls_;
  std::vector<size_t> first_;  // where each call's pointers start in the device table
  void** device_table_ = nullptr;
};

// dW (out_features, in_features) += dY^T @ X over one expert's rows: dY (rows, out_features) and
// X (rows, in_features) bf16, dW fp32. Weight gradients accumulate over micro-batches, so the
// product must reach them unrounded: one cuBLASLt GEMM per expert with fp32 C and beta = 1, as
// linear_backward does for the dense weights. (A grouped GEMM into bf16 scratch followed by an
// add would round every contribution to bf16 before it is accumulated.) A null dW is a frozen
// expert weight: no GEMM.
void add_weight_gradient(Context& ctx, float* dw, const bf16* dy, const bf16* x, int64_t rows, int64_t out_features,
                         int64_t in_features, cudaStream_t stream) {
  if (dw == nullptr) return;
  gemm(ctx, /*trans_a=*/true, /*trans_b=*/false, out_features, in_features, rows, 1.0f, dy, out_features, x,
       in_features, 1.0f, dw, in_features, /*c_is_fp32=*/true, nullptr, stream);
}

// The expert offsets on the host (the grouped GEMMs' shapes are host arguments): a copy of E+1
// int64s and a stream synchronisation. Checks that they are non-decreasing from >= 0.
std::vector<int64_t> host_offsets(const int64_t* expert_offsets, int64_t E, cudaStream_t stream) {
  std::vector<int64_t> offsets(static_cast<size_t>(E + 1));
  CUDA_CHECK(cudaMemcpyAsync(offsets.data(), expert_offsets, offsets.size() * sizeof(int64_t), cudaMemcpyDeviceToHost,
                             stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CHECK_MSG(offsets[0] >= 0, "expert offsets must start at a slot >= 0");
  for (int64_t e = 0; e < E; ++e) {
    CHECK_MSG(offsets[e] <= offsets[e + 1], "expert offsets must be non-decreasing");
  }
  return offsets;
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------

void moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                       const float* selection_bias, int64_t N, const RouterConfig& config, cudaStream_t stream) {
  check_router(config);
  CHECK(N >= 0);
  if (N == 0) return;
  const RouteLaunch launch = route_launch(N, config.num_experts);
  route_forward_kernel<<<launch.blocks, launch.threads, launch.shared_bytes, stream>>>(
      expert_idx, weights, probs, logits, selection_bias, N, config);
  CUDA_CHECK_LAUNCH();
}

void moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad, const float* probs,
                        const int32_t* expert_idx, const float* weights, int64_t N, const RouterConfig& config,
                        cudaStream_t stream) {
  check_router(config);
  CHECK(N >= 0);
  if (N == 0) return;
  const RouteLaunch launch = route_launch(N, config.num_experts);
  route_backward_kernel<<<launch.blocks, launch.threads, launch.shared_bytes, stream>>>(
      dlogits, dweights, prob_grad, probs, expert_idx, weights, N, config);
  CUDA_CHECK_LAUNCH();
}

size_t moe_permute_scratch_bytes(int64_t assignments, int64_t E) {
  return permute_scratch(nullptr, assignments, E).total_bytes;
}

void moe_permute(Context& ctx, int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets,
                 const int32_t* expert_idx, int64_t N, int64_t K, int64_t E, cudaStream_t stream) {
  CHECK(N >= 0 && K > 0 && E > 0 && E <= INT_MAX);
  const int64_t A = N * K;
  CHECK_MSG(A < (int64_t{1} << 31), "moe_permute: N * K must fit in int32");
  if (A > 0) {
    PermuteScratch s = permute_scratch(ctx.scratch(moe_permute_scratch_bytes(A, E), "moe_permute"), A, E);
    permute_input_kernel<<<elementwise_blocks(A, kThreads), kThreads, 0, stream>>>(s.keys_in, s.assignments_in,
                                                                                   expert_idx, A, static_cast<int>(E));
    CUDA_CHECK_LAUNCH();
    size_t cub_bytes = s.cub_temp_bytes;
    // Stable (LSD radix sort): equal experts keep the (token, k) order of the input.
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.cub_temp, cub_bytes, s.keys_in, s.keys_out, s.assignments_in,
                                               s.assignments_out, static_cast<int>(A), 0, key_bits(E), stream));
    permute_output_kernel<<<elementwise_blocks(A, kThreads), kThreads, 0, stream>>>(slot_of, token_of_slot,
                                                                                    s.assignments_out, A, K);
    CUDA_CHECK_LAUNCH();
    expert_offsets_kernel<<<elementwise_blocks(A + 1, kThreads), kThreads, 0, stream>>>(expert_offsets, s.keys_out, A,
                                                                                        E);
  } else {
    expert_offsets_kernel<<<1, kThreads, 0, stream>>>(expert_offsets, nullptr, 0, E);
  }
  CUDA_CHECK_LAUNCH();
}

void moe_tile_offsets(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0, int64_t rows,
                      cudaStream_t stream) {
  CHECK(E > 0 && row0 >= 0 && rows >= 0);
  tile_offsets_kernel<<<elementwise_blocks(E + 1, kThreads), kThreads, 0, stream>>>(tile_offsets, expert_offsets, E,
                                                                                     row0, rows);
  CUDA_CHECK_LAUNCH();
}

void moe_gather(bf16* xs, const bf16* x, const int32_t* token_of_slot, int64_t S, int64_t C, cudaStream_t stream) {
  CHECK(S >= 0 && C > 0);
  if (S == 0) return;
  gather_kernel<<<elementwise_blocks(S * C, kThreads), kThreads, 0, stream>>>(xs, x, token_of_slot, S, C);
  CUDA_CHECK_LAUNCH();
}

void moe_gather_backward(bf16* dx, const bf16* dxs, const int32_t* slot_of, int64_t N, int64_t K, int64_t C,
                         cudaStream_t stream) {
  CHECK(N >= 0 && K > 0 && C > 0);
  if (N == 0) return;
  gather_backward_kernel<<<elementwise_blocks(N * C, kThreads), kThreads, 0, stream>>>(dx, dxs, slot_of, N, K, C);
  CUDA_CHECK_LAUNCH();
}

void moe_combine_forward(bf16* out, const bf16* ys, const float* weights, const int32_t* slot_of, int64_t N,
                         int64_t K, int64_t C, cudaStream_t stream) {
  CHECK(N >= 0 && K > 0 && C > 0);
  if (N == 0) return;
  combine_forward_kernel<<<elementwise_blocks(N * C, kThreads), kThreads, 0, stream>>>(out, ys, weights, slot_of, N, K,
                                                                                       C);
  CUDA_CHECK_LAUNCH();
}

void moe_combine_backward(bf16* dys, float* dweights, const bf16* dout, const bf16* ys, const float* weights,
                          const int32_t* slot_of, int64_t N, int64_t K, int64_t C, cudaStream_t stream) {
  CHECK(N >= 0 && K > 0 && C > 0);
  const int64_t A = N * K;
  if (A == 0) return;
  constexpr int kWarps = kThreads / kWarpSize;
  const int64_t blocks = ceil_div(A, kWarps);
  CHECK(blocks <= INT_MAX);
  combine_backward_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dys, dweights, dout, ys, weights,
                                                                                  slot_of, A, K, C);
  CUDA_CHECK_LAUNCH();
}

void moe_experts_forward(Context& ctx, bf16* ys, bf16* gate, bf16* up, bf16* act, const bf16* xs,
                         const int64_t* expert_offsets, const ExpertTensors<const bf16>& w, int64_t E, int64_t C,
                         int64_t F, cudaStream_t stream) {
  CHECK(E > 0 && C > 0 && F > 0);
  const std::vector<int64_t> offsets = host_offsets(expert_offsets, E, stream);
  std::vector<GemmProblem> gate_up, down;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    // gate, up (rows,F) = xs (rows,C) @ W^T, W (F,C)
    gate_up.push_back({false, true, rows, F, C, xs + r0 * C, C, w.gate[e], C, 0.0f, gate + r0 * F, F});
    gate_up.push_back({false, true, rows, F, C, xs + r0 * C, C, w.up[e], C, 0.0f, up + r0 * F, F});
    // ys (rows,C) = act (rows,F) @ W_down^T, W_down (C,F)
    down.push_back({false, true, rows, C, F, act + r0 * F, F, w.down[e], F, 0.0f, ys + r0 * C, C});
  }
  if (down.empty()) return;
  GroupedGemms gemms;
  const size_t gate_up_call = gemms.add(std::move(gate_up));
  const size_t down_call = gemms.add(std::move(down));
  gemms.upload(ctx, stream, "moe_experts_forward (grouped GEMM pointers)");
  gemms.run(ctx, gate_up_call, stream);
  // The experts' rows are contiguous: [offsets[0], offsets[E]).
  const int64_t first = offsets[0] * F, n = (offsets[E] - offsets[0]) * F;
  swiglu_forward(act + first, gate + first, up + first, n, stream);
  gemms.run(ctx, down_call, stream);
}

void moe_experts_backward(Context& ctx, bf16* dxs, const ExpertTensors<float>& dw, bf16* dgate, bf16* dup,
                          bf16* dact, const bf16* dys, const bf16* xs, const bf16* gate, const bf16* up,
                          const bf16* act, const int64_t* expert_offsets, const ExpertTensors<const bf16>& w,
                          int64_t E, int64_t C, int64_t F, cudaStream_t stream) {
  CHECK(E > 0 && C > 0 && F > 0);
  const std::vector<int64_t> offsets = host_offsets(expert_offsets, E, stream);
  // The activation gradients, three grouped calls (dxs is written by the second and added to
  // by the third, so they cannot share one call):
  //   1: dact = dys @ W_down
  //   2: dxs = dgate @ W_gate
  //   3: dxs += dup @ W_up   (the bf16 dxs of call 2 plus the product, summed in fp32 and
  //                           rounded again: two roundings, as the dense MLP's dx gets)
  // The weight gradients, per expert: dW_down += dys^T @ act; dW_gate += dgate^T @ xs;
  // dW_up += dup^T @ xs.
  std::vector<GemmProblem> first_call, second_call, third_call;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    first_call.push_back({false, false, rows, F, C, dys + r0 * C, C, w.down[e], F, 0.0f, dact + r0 * F, F});
    second_call.push_back({false, false, rows, C, F, dgate + r0 * F, F, w.gate[e], C, 0.0f, dxs + r0 * C, C});
    third_call.push_back({false, false, rows, C, F, dup + r0 * F, F, w.up[e], C, 1.0f, dxs + r0 * C, C});
  }
  if (third_call.empty()) return;
  GroupedGemms gemms;
  const size_t call1 = gemms.add(std::move(first_call));
  const size_t call2 = gemms.add(std::move(second_call));
  const size_t call3 = gemms.add(std::move(third_call));
  gemms.upload(ctx, stream, "moe_experts_backward (grouped GEMM pointers)");
  gemms.run(ctx, call1, stream);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    add_weight_gradient(ctx, dw.down[e], dys + r0 * C, act + r0 * F, rows, C, F, stream);
  }
  const int64_t first = offsets[0] * F, n = (offsets[E] - offsets[0]) * F;
  swiglu_backward(dgate + first, dup + first, dact + first, gate + first, up + first, n, stream);
  gemms.run(ctx, call2, stream);
  gemms.run(ctx, call3, stream);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    add_weight_gradient(ctx, dw.gate[e], dgate + r0 * F, xs + r0 * C, rows, F, C, stream);
    add_weight_gradient(ctx, dw.up[e], dup + r0 * F, xs + r0 * C, rows, F, C, stream);
  }
}

void moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx, const float* probs, int64_t N,
                      int64_t K, int64_t E, cudaStream_t stream) {
  CHECK(N >= 0 && K > 0 && E > 0 && E <= INT_MAX);
  if (N == 0) return;
  const int64_t A = N * K;
  count_assignments_kernel<<<elementwise_blocks(A, kThreads), kThreads, 0, stream>>>(counts, expert_idx, A,
                                                                                     static_cast<int>(E));
  CUDA_CHECK_LAUNCH();
  const dim3 block(kStatsTile, kStatsTile);
  prob_sums_kernel<<<static_cast<unsigned>(ceil_div(E, kStatsTile)), block, 0, stream>>>(prob_sums, probs, N, E);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
