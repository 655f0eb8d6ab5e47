#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include <fmt/format.h>

#include "core/check.h"
#include "core/checked_math.h"

namespace strata::model {

Status check_sampling_options(const SamplingOptions& options) {
  if (!(std::isfinite(options.temperature) && options.temperature >= 0)) {
    return Status::InvalidArgument(fmt::format(
        "temperature is {}; use 0 for greedy decoding or a positive number (1 samples from the model as it is)",
        options.temperature));
  }
  if (!(options.top_p > 0 && options.top_p <= 1)) {
    return Status::InvalidArgument(
        fmt::format("top-p is {}; use a probability in (0, 1] (1 keeps every token)", options.top_p));
  }
  return Status::OK();
}

Sampler::Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {
  const Status st = check_sampling_options(options);
  CHECK_MSG(st.ok(), st.to_string());
}

int32_t Sampler::next(std::span<const float> logits) {
  const int64_t V = static_cast<int64_t>(logits.size());
  CHECK(V > 0);
  if (options_.temperature == 0) {
    // The first of the highest: torch.argmax's choice among equal logits.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Softmax of logits / T in double.
  probs_.resize(static_cast<size_t>(V));
  double max_scaled = -INFINITY;
  for (int64_t i = 0; i < V; ++i) max_scaled = std::max(max_scaled, logits[i] / options_.temperature);
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) {
    probs_[i] = std::exp(logits[i] / options_.temperature - max_scaled);
    sum += probs_[i];
  }
  // Top-p: the most probable tokens (ties in id order) until their share reaches top_p.
  order_.resize(static_cast<size_t>(V));
  std::iota(order_.begin(), order_.end(), int32_t{0});
  std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) { return probs_[a] > probs_[b]; });
  const double target = options_.top_p * sum;
  double kept = 0;
  size_t n = 0;
  while (n < order_.size() && (n == 0 || kept < target)) kept += probs_[order_[n++]];
  // One draw over the kept tokens.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
  const double point = u * kept;
  double cumulative = 0;
  for (size_t i = 0; i < n; ++i) {
    cumulative += probs_[order_[i]];
    if (point < cumulative) return order_[i];
  }
  return order_[n - 1];  // u * kept rounded up to the total
}

Result<std::vector<int32_t>> generate(Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                                      const std::function<bool(int32_t)>& on_token) {
  if (prompt.empty()) return Status::InvalidArgument("the prompt has no tokens; generation starts from at least one");
  if (options.max_new_tokens < 0) {
    return Status::InvalidArgument(fmt::format("max new tokens is {}; use 0 or more", options.max_new_tokens));
  }
  RETURN_IF_ERROR(check_sampling_options(options.sampling));
  std::vector<int32_t> out;
  if (options.max_new_tokens == 0) return out;
  const int64_t P = static_cast<int64_t>(prompt.size());
  // The last new token is emitted, never run through the model: the cache needs one less.
  const std::optional<int64_t> capacity = checked_add(P, options.max_new_tokens - 1);
  if (!capacity) return Status::InvalidArgument(fmt::format("max new tokens {} is too large", options.max_new_tokens));
  RETURN_IF_ERROR(model.begin_sequence(*capacity, P));
  std::vector<float> logits(static_cast<size_t>(model.config().vocab_size));
  Sampler sampler(options.sampling);
  RETURN_IF_ERROR(model.decode(prompt.data(), P, logits.data()));
  for (;;) {
    const int32_t token = sampler.next(logits);
    out.push_back(token);
    if (on_token && !on_token(token)) break;
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end()) break;
    if (static_cast<int64_t>(out.size()) == options.max_new_tokens) break;
    RETURN_IF_ERROR(model.decode(&token, 1, logits.data()));
  }
  return out;
}

}  // namespace strata::model
