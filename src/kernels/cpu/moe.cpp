// Mixture-of-experts ops: routing, permutation, grouped expert MLPs, combine, balancing stats.
#include "kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/linear.h"
#include "kernels/swiglu.h"

namespace strata::kernels {
namespace {

// Writes the indices of the K largest scores (descending; ties to the lower index) into out,
// among the experts not `excluded` (null: all). Repeated arg-max: K * E comparisons, and exact
// ordering without a sort.
template <typename Score>
void top_k_indices(int32_t* out /*(K)*/, const Score* scores /*(E)*/, int64_t E, int64_t K,
                   const unsigned char* excluded = nullptr) {
  for (int64_t k = 0; k < K; ++k) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = excluded != nullptr && excluded[e] != 0;
      for (int64_t j = 0; j < k; ++j) taken = taken || out[j] == e;
      if (taken) continue;
      if (best < 0 || scores[e] > scores[best]) best = e;
    }
    out[k] = static_cast<int32_t>(best);
  }
}

// Group-limited routing: marks in excluded (E) the experts outside the config's top_groups
// groups by group score; all zero without groups.
template <typename Score>
void exclude_groups(unsigned char* excluded /*(E)*/, const Score* scores /*(E)*/, const RouterConfig& c) {
  const int64_t E = c.num_experts, G = c.num_groups, per = E / G;
  std::fill(excluded, excluded + E, static_cast<unsigned char>(0));
  if (G <= 1) return;
  std::vector<Score> group(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) {
    // The largest and second largest score in one pass from -inf (as the CUDA kernel does; a NaN
    // score is never taken).
    const Score* s = scores + g * per;
    Score first = -std::numeric_limits<Score>::infinity(), second = first;
    for (int64_t i = 0; i < per; ++i) {
      if (s[i] > first) {
        second = first;
        first = s[i];
      } else if (s[i] > second) {
        second = s[i];
      }
    }
    group[static_cast<size_t>(g)] = c.group_score == GroupScore::kMax ? first : first + second;
  }
  std::vector<int32_t> kept(static_cast<size_t>(c.top_groups));
  top_k_indices(kept.data(), group.data(), G, c.top_groups);
  std::fill(excluded, excluded + E, static_cast<unsigned char>(1));
  for (const int32_t g : kept) std::fill_n(excluded + g * per, per, static_cast<unsigned char>(0));
}

void check_router(const RouterConfig& c) {
  const char* why = nullptr;
  CHECK_MSG(router_config_ok(c, &why), std::string("router config: ") + why);
}

// Counting sort shared by both backends: it is already linear and exact.
void permute_impl(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets,
                  const int32_t* expert_idx, int64_t N, int64_t K, int64_t E) {
  std::fill(expert_offsets, expert_offsets + E + 1, int64_t{0});
  for (int64_t a = 0; a < N * K; ++a) {
    CHECK(expert_idx[a] >= 0 && expert_idx[a] < E);
    ++expert_offsets[expert_idx[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) expert_offsets[e + 1] += expert_offsets[e];
  std::vector<int64_t> next(expert_offsets, expert_offsets + E);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = next[static_cast<size_t>(expert_idx[n * K + k])]++;
      slot_of[n * K + k] = static_cast<int32_t>(slot);
      token_of_slot[slot] = static_cast<int32_t>(n);
    }
  }
}

}  // namespace

bool router_config_ok(const RouterConfig& c, const char** why) {
  auto fail = [&](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (!(c.num_experts > 0 && c.top_k >= 1 && c.top_k <= c.num_experts)) return fail("needs 1 <= top_k <= num_experts");
  if (c.num_groups < 1 || c.num_experts % c.num_groups != 0) return fail("num_groups must divide num_experts");
  if (c.top_groups < 1 || c.top_groups > c.num_groups) return fail("needs 1 <= top_groups <= num_groups");
  if (c.top_groups * (c.num_experts / c.num_groups) < c.top_k)
    return fail("the kept groups hold fewer experts than top_k");
  if (c.num_groups > 1 && c.group_score == GroupScore::kTopTwoSum && c.num_experts / c.num_groups < 2)
    return fail("a top-two group score needs groups of at least 2 experts");
  if (c.scoring == RouterScoring::kTopKThenSoftmax && (c.num_groups != 1 || c.scale != 1.0f))
    return fail("top-k-then-softmax routing takes neither groups nor a scale");
  if (!(c.scale > 0 && std::isfinite(c.scale))) return fail("the routing scale must be positive and finite");
  return true;
}

double moe_aux_loss(const int64_t* counts, const double* prob_sums, int64_t tokens, int64_t E) {
  if (tokens <= 0) return 0.0;
  const double t = static_cast<double>(tokens);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (static_cast<double>(counts[e]) / t) * (prob_sums[e] / t);
  return static_cast<double>(E) * sum;
}

void moe_aux_loss_prob_grad(float* prob_grad, const int64_t* counts, int64_t tokens, int64_t E,
                            double scale) {
  const double t = static_cast<double>(std::max<int64_t>(tokens, 1));
  for (int64_t e = 0; e < E; ++e) {
    prob_grad[e] = static_cast<float>(scale * static_cast<double>(E) *
                                      static_cast<double>(counts[e]) / (t * t));
  }
}

void moe_tile_offsets(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0, int64_t rows) {
  for (int64_t e = 0; e <= E; ++e) tile_offsets[e] = std::clamp<int64_t>(expert_offsets[e] - row0, 0, rows);
}

void moe_update_selection_bias(float* bias, const int64_t* counts, int64_t E, float rate) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += static_cast<double>(counts[e]);
  mean /= static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double load = static_cast<double>(counts[e]);
    const float sign = load < mean ? 1.0f : (load > mean ? -1.0f : 0.0f);
    bias[e] += rate * sign;
  }
}

namespace ref {

void moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                       const float* selection_bias, int64_t N, const RouterConfig& config) {
  check_router(config);
  const int64_t E = config.num_experts;
  const int64_t K = config.top_k;
  const bool sigmoid = config.scoring == RouterScoring::kSigmoidThenTopK;
  std::vector<double> p(static_cast<size_t>(E)), score(static_cast<size_t>(E));
  std::vector<unsigned char> excluded(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * E;
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.0 / (1.0 + std::exp(-double(l[e])));
    } else {
      double max_logit = l[0];
      for (int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, double(l[e]));
      double denom = 0;
      for (int64_t e = 0; e < E; ++e) denom += p[e] = std::exp(double(l[e]) - max_logit);
      for (int64_t e = 0; e < E; ++e) p[e] /= denom;
    }
    for (int64_t e = 0; e < E; ++e) {
      probs[n * E + e] = static_cast<float>(p[e]);
      const double base = config.scoring == RouterScoring::kTopKThenSoftmax ? double(l[e]) : p[e];
      score[e] = base + (selection_bias ? double(selection_bias[e]) : 0.0);
    }
    int32_t* idx = expert_idx + n * K;
    exclude_groups(excluded.data(), score.data(), config);
    top_k_indices(idx, score.data(), E, K, excluded.data());
    float* w = weights + n * K;
    if (config.scoring == RouterScoring::kTopKThenSoftmax) {
      double top_max = l[idx[0]];
      for (int64_t k = 1; k < K; ++k) top_max = std::max(top_max, double(l[idx[k]]));
      double z = 0;
      for (int64_t k = 0; k < K; ++k) z += std::exp(double(l[idx[k]]) - top_max);
      for (int64_t k = 0; k < K; ++k) w[k] = static_cast<float>(std::exp(double(l[idx[k]]) - top_max) / z);
    } else {
      double z = 0;
      for (int64_t k = 0; k < K; ++k) z += p[idx[k]];
      for (int64_t k = 0; k < K; ++k) {
        w[k] = static_cast<float>((config.normalize_top_k ? p[idx[k]] / z : p[idx[k]]) * double(config.scale));
      }
    }
  }
}

void moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad,
                        const float* probs, const int32_t* expert_idx, const float* weights,
                        int64_t N, const RouterConfig& config) {
  check_router(config);
  const int64_t E = config.num_experts;
  const int64_t K = config.top_k;
  std::vector<double> dl(static_cast<size_t>(E)), dp(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const int32_t* idx = expert_idx + n * K;
    const float* w = weights + n * K;
    const float* dw = dweights + n * K;
    const float* p = probs + n * E;
    std::fill(dl.begin(), dl.end(), 0.0);
    std::fill(dp.begin(), dp.end(), 0.0);
    double w_dot_dw = 0;
    for (int64_t k = 0; k < K; ++k) w_dot_dw += double(w[k]) * double(dw[k]);
    if (config.scoring == RouterScoring::kTopKThenSoftmax) {
      // w = softmax over the selected logits: dl_s = w_s (dw_s - <w, dw>).
      for (int64_t k = 0; k < K; ++k) dl[idx[k]] += double(w[k]) * (double(dw[k]) - w_dot_dw);
    } else if (config.normalize_top_k) {
      // w_k = c p_k / Z, Z = sum of the selected p, c the scale: dp_k = c (dw_k - <w, dw> / c) / Z.
      const double c = config.scale;
      double z = 0;
      for (int64_t k = 0; k < K; ++k) z += double(p[idx[k]]);
      for (int64_t k = 0; k < K; ++k) dp[idx[k]] += c * (double(dw[k]) - w_dot_dw / c) / z;
    } else {
      for (int64_t k = 0; k < K; ++k) dp[idx[k]] += double(config.scale) * double(dw[k]);
    }
    if (prob_grad) {
      for (int64_t e = 0; e < E; ++e) dp[e] += double(prob_grad[e]);
    }
    if (config.scoring == RouterScoring::kSigmoidThenTopK) {
      // Each score is its own logit's sigmoid: dl = dp * p (1 - p).
      for (int64_t e = 0; e < E; ++e) {
        dlogits[n * E + e] = static_cast<float>(dp[e] * double(p[e]) * (1.0 - double(p[e])));
      }
      continue;
    }
    // Softmax backward over all experts: dl += p * (dp - <p, dp>).
    double p_dot_dp = 0;
    for (int64_t e = 0; e < E; ++e) p_dot_dp += double(p[e]) * dp[e];
    for (int64_t e = 0; e < E; ++e) {
      dlogits[n * E + e] = static_cast<float>(dl[e] + double(p[e]) * (dp[e] - p_dot_dp));
    }
  }
}

void moe_permute(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets,
                 const int32_t* expert_idx, int64_t N, int64_t K, int64_t E) {
  // Written as the definition: expert by expert, tokens in order.
  int64_t slot = 0;
  for (int64_t e = 0; e < E; ++e) {
    expert_offsets[e] = slot;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        if (expert_idx[n * K + k] != e) continue;
        slot_of[n * K + k] = static_cast<int32_t>(slot);
        token_of_slot[slot] = static_cast<int32_t>(n);
        ++slot;
      }
    }
  }
  expert_offsets[E] = slot;
  CHECK_MSG(slot == N * K, "expert index outside [0, E)");
}

void moe_gather(float* xs, const float* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t c = 0; c < C; ++c) xs[s * C + c] = x[int64_t{token_of_slot[s]} * C + c];
  }
}

void moe_gather_backward(float* dx, const float* dxs, const int32_t* slot_of, int64_t N, int64_t K,
                         int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(dxs[int64_t{slot_of[n * K + k]} * C + c]);
      dx[n * C + c] = static_cast<float>(s);
    }
  }
}

void moe_combine_forward(float* out, const float* ys, const float* weights, const int32_t* slot_of,
                         int64_t N, int64_t K, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        s += double(weights[n * K + k]) * double(ys[int64_t{slot_of[n * K + k]} * C + c]);
      }
      out[n * C + c] = static_cast<float>(s);
    }
  }
}

void moe_combine_backward(float* dys, float* dweights, const float* dout, const float* ys,
                          const float* weights, const int32_t* slot_of, int64_t N, int64_t K,
                          int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = slot_of[n * K + k];
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        dys[slot * C + c] = static_cast<float>(double(weights[n * K + k]) * double(dout[n * C + c]));
        dot += double(dout[n * C + c]) * double(ys[slot * C + c]);
      }
      dweights[n * K + k] = static_cast<float>(dot);
    }
  }
}

void moe_experts_forward(float* ys, float* gate, float* up, float* act, const float* xs,
                         const int64_t* expert_offsets, const ExpertTensors<const float>& w,
                         int64_t E, int64_t C, int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e];
    const int64_t rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    linear_forward(gate + r0 * F, xs + r0 * C, w.gate[e], nullptr, rows, C, F);
    linear_forward(up + r0 * F, xs + r0 * C, w.up[e], nullptr, rows, C, F);
    swiglu_forward(act + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    linear_forward(ys + r0 * C, act + r0 * F, w.down[e], nullptr, rows, F, C);
  }
}

void moe_experts_backward(float* dxs, const ExpertTensors<float>& dw, float* dgate, float* dup,
                          float* dact, const float* dys, const float* xs, const float* gate,
                          const float* up, const float* act, const int64_t* expert_offsets,
                          const ExpertTensors<const float>& w, int64_t E, int64_t C, int64_t F) {
  std::vector<float> from_up;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e];
    const int64_t rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    linear_backward(dact + r0 * F, dw.down[e], nullptr, dys + r0 * C, act + r0 * F, w.down[e], rows, F, C);
    swiglu_backward(dgate + r0 * F, dup + r0 * F, dact + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    linear_backward(dxs + r0 * C, dw.gate[e], nullptr, dgate + r0 * F, xs + r0 * C, w.gate[e], rows, C, F);
    from_up.assign(static_cast<size_t>(rows * C), 0.0f);
    linear_backward(from_up.data(), dw.up[e], nullptr, dup + r0 * F, xs + r0 * C, w.up[e], rows, C, F);
    for (int64_t i = 0; i < rows * C; ++i) dxs[r0 * C + i] += from_up[static_cast<size_t>(i)];
  }
}

void moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx,
                      const float* probs, int64_t N, int64_t K, int64_t E) {
  for (int64_t a = 0; a < N * K; ++a) ++counts[expert_idx[a]];
  for (int64_t e = 0; e < E; ++e) {
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += double(probs[n * E + e]);
    prob_sums[e] += s;
  }
}

}  // namespace ref

namespace cpu {
namespace {
// Parallelise token loops only when there is enough work to pay for the threads.
constexpr int64_t kParallelWork = int64_t{1} << 15;
}  // namespace

void moe_route_forward(int32_t* expert_idx, float* weights, float* probs, const float* logits,
                       const float* selection_bias, int64_t N, const RouterConfig& config) {
  check_router(config);
  const int64_t E = config.num_experts;
  const int64_t K = config.top_k;
#pragma omp parallel if (N * E * K >= kParallelWork)
  {
    std::vector<float> score(static_cast<size_t>(E));
    std::vector<unsigned char> excluded(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* l = logits + n * E;
      float* p = probs + n * E;
      if (config.scoring == RouterScoring::kSigmoidThenTopK) {
        for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
      } else {
        float max_logit = l[0];
        for (int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, l[e]);
        float denom = 0;
        for (int64_t e = 0; e < E; ++e) denom += p[e] = std::exp(l[e] - max_logit);
        const float inv = 1.0f / denom;
        for (int64_t e = 0; e < E; ++e) p[e] *= inv;
      }
      for (int64_t e = 0; e < E; ++e) {
        const float base = config.scoring == RouterScoring::kTopKThenSoftmax ? l[e] : p[e];
        score[e] = base + (selection_bias ? selection_bias[e] : 0.0f);
      }
      int32_t* idx = expert_idx + n * K;
      exclude_groups(excluded.data(), score.data(), config);
      top_k_indices(idx, score.data(), E, K, excluded.data());
      float* w = weights + n * K;
      if (config.scoring == RouterScoring::kTopKThenSoftmax) {
        float top_max = l[idx[0]];
        for (int64_t k = 1; k < K; ++k) top_max = std::max(top_max, l[idx[k]]);
        float z = 0;
        for (int64_t k = 0; k < K; ++k) z += w[k] = std::exp(l[idx[k]] - top_max);
        for (int64_t k = 0; k < K; ++k) w[k] /= z;
      } else {
        float z = 0;
        for (int64_t k = 0; k < K; ++k) z += w[k] = p[idx[k]];
        if (config.normalize_top_k) {
          for (int64_t k = 0; k < K; ++k) w[k] /= z;
        }
        for (int64_t k = 0; k < K; ++k) w[k] *= config.scale;
      }
    }
  }
}

void moe_route_backward(float* dlogits, const float* dweights, const float* prob_grad,
                        const float* probs, const int32_t* expert_idx, const float* weights,
                        int64_t N, const RouterConfig& config) {
  check_router(config);
  const int64_t E = config.num_experts;
  const int64_t K = config.top_k;
#pragma omp parallel if (N * E >= kParallelWork)
  {
    std::vector<float> dp(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int32_t* idx = expert_idx + n * K;
      const float* w = weights + n * K;
      const float* dw = dweights + n * K;
      const float* p = probs + n * E;
      float* dl = dlogits + n * E;
      for (int64_t e = 0; e < E; ++e) {
        dl[e] = 0.0f;
        dp[e] = prob_grad ? prob_grad[e] : 0.0f;
      }
      float w_dot_dw = 0;
      for (int64_t k = 0; k < K; ++k) w_dot_dw += w[k] * dw[k];
      if (config.scoring == RouterScoring::kTopKThenSoftmax) {
        for (int64_t k = 0; k < K; ++k) dl[idx[k]] += w[k] * (dw[k] - w_dot_dw);
      } else if (config.normalize_top_k) {
        const float c = config.scale;
        float z = 0;
        for (int64_t k = 0; k < K; ++k) z += p[idx[k]];
        for (int64_t k = 0; k < K; ++k) dp[idx[k]] += c * (dw[k] - w_dot_dw / c) / z;
      } else {
        for (int64_t k = 0; k < K; ++k) dp[idx[k]] += config.scale * dw[k];
      }
      if (config.scoring == RouterScoring::kSigmoidThenTopK) {
        for (int64_t e = 0; e < E; ++e) dl[e] = dp[e] * p[e] * (1.0f - p[e]);
        continue;
      }
      float p_dot_dp = 0;
      for (int64_t e = 0; e < E; ++e) p_dot_dp += p[e] * dp[e];
      for (int64_t e = 0; e < E; ++e) dl[e] += p[e] * (dp[e] - p_dot_dp);
    }
  }
}

void moe_permute(int32_t* slot_of, int32_t* token_of_slot, int64_t* expert_offsets,
                 const int32_t* expert_idx, int64_t N, int64_t K, int64_t E) {
  permute_impl(slot_of, token_of_slot, expert_offsets, expert_idx, N, K, E);
}

void moe_gather(float* xs, const float* x, const int32_t* token_of_slot, int64_t S, int64_t C) {
#pragma omp parallel for schedule(static) if (S * C >= kParallelWork)
  for (int64_t s = 0; s < S; ++s) {
    std::memcpy(xs + s * C, x + int64_t{token_of_slot[s]} * C, static_cast<size_t>(C) * sizeof(float));
  }
}

void moe_gather_backward(float* dx, const float* dxs, const int32_t* slot_of, int64_t N, int64_t K,
                         int64_t C) {
#pragma omp parallel for schedule(static) if (N * K * C >= kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    float* d = dx + n * C;
    std::memcpy(d, dxs + int64_t{slot_of[n * K]} * C, static_cast<size_t>(C) * sizeof(float));
    for (int64_t k = 1; k < K; ++k) {
      const float* src = dxs + int64_t{slot_of[n * K + k]} * C;
      for (int64_t c = 0; c < C; ++c) d[c] += src[c];
    }
  }
}

void moe_combine_forward(float* out, const float* ys, const float* weights, const int32_t* slot_of,
                         int64_t N, int64_t K, int64_t C) {
#pragma omp parallel for schedule(static) if (N * K * C >= kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * C;
    std::fill(o, o + C, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float wk = weights[n * K + k];
      const float* y = ys + int64_t{slot_of[n * K + k]} * C;
      for (int64_t c = 0; c < C; ++c) o[c] += wk * y[c];
    }
  }
}

void moe_combine_backward(float* dys, float* dweights, const float* dout, const float* ys,
                          const float* weights, const int32_t* slot_of, int64_t N, int64_t K,
                          int64_t C) {
#pragma omp parallel for schedule(static) if (N * K * C >= kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* d = dout + n * C;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = slot_of[n * K + k];
      const float wk = weights[n * K + k];
      const float* y = ys + slot * C;
      float* dy = dys + slot * C;
      float dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        dy[c] = wk * d[c];
        dot += d[c] * y[c];
      }
      dweights[n * K + k] = dot;
    }
  }
}

// Grouped GEMM on the CPU: one sgemm per expert over its contiguous rows; each sgemm is
// parallel inside.
void moe_experts_forward(float* ys, float* gate, float* up, float* act, const float* xs,
                         const int64_t* expert_offsets, const ExpertTensors<const float>& w,
                         int64_t E, int64_t C, int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e];
    const int64_t rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    sgemm(false, true, rows, F, C, 1.0f, xs + r0 * C, C, w.gate[e], C, 0.0f, gate + r0 * F, F);
    sgemm(false, true, rows, F, C, 1.0f, xs + r0 * C, C, w.up[e], C, 0.0f, up + r0 * F, F);
    swiglu_forward(act + r0 * F, gate + r0 * F, up + r0 * F, rows * F);
    sgemm(false, true, rows, C, F, 1.0f, act + r0 * F, F, w.down[e], F, 0.0f, ys + r0 * C, C);
  }
}

void moe_experts_backward(float* dxs, const ExpertTensors<float>& dw, float* dgate, float* dup,
                          float* dact, const float* dys, const float* xs, const float* gate,
                          const float* up, const float* act, const int64_t* expert_offsets,
                          const ExpertTensors<const float>& w, int64_t E, int64_t C, int64_t F) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = expert_offsets[e];
    const int64_t rows = expert_offsets[e + 1] - r0;
    if (rows == 0) continue;
    const float* dy = dys + r0 * C;  // (rows, C)
    const float* x = xs + r0 * C;    // (rows, C)
    float* da = dact + r0 * F;       // (rows, F)
    float* dg = dgate + r0 * F;
    float* du = dup + r0 * F;
    // ys = act @ down^T: dact = dys @ down; ddown += dys^T @ act.
    sgemm(false, false, rows, F, C, 1.0f, dy, C, w.down[e], F, 0.0f, da, F);
    if (dw.down[e] != nullptr) sgemm(true, false, C, F, rows, 1.0f, dy, C, act + r0 * F, F, 1.0f, dw.down[e], F);
    swiglu_backward(dg, du, da, gate + r0 * F, up + r0 * F, rows * F);
    // gate = xs @ W_gate^T, up = xs @ W_up^T: dxs = dgate @ W_gate + dup @ W_up.
    sgemm(false, false, rows, C, F, 1.0f, dg, F, w.gate[e], C, 0.0f, dxs + r0 * C, C);
    sgemm(false, false, rows, C, F, 1.0f, du, F, w.up[e], C, 1.0f, dxs + r0 * C, C);
    // (Frozen experts, with LoRA on the model, have no gradients.)
    if (dw.gate[e] != nullptr) sgemm(true, false, F, C, rows, 1.0f, dg, F, x, C, 1.0f, dw.gate[e], C);
    if (dw.up[e] != nullptr) sgemm(true, false, F, C, rows, 1.0f, du, F, x, C, 1.0f, dw.up[e], C);
  }
}

void moe_router_stats(int64_t* counts, double* prob_sums, const int32_t* expert_idx,
                      const float* probs, int64_t N, int64_t K, int64_t E) {
  for (int64_t a = 0; a < N * K; ++a) ++counts[expert_idx[a]];
  // Row-major walk with one double accumulator per expert.
  std::vector<double> sums(static_cast<size_t>(E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) sums[static_cast<size_t>(e)] += double(probs[n * E + e]);
  }
  for (int64_t e = 0; e < E; ++e) prob_sums[e] += sums[static_cast<size_t>(e)];
}

}  // namespace cpu
}  // namespace strata::kernels
