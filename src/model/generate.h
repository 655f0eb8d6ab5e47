// Text generation over a Model (decoder.h): the prompt is run once through the model (prefill),
// then one token at a time with the model's KV cache, each next token chosen from the logits by
// a Sampler. `strata generate` (tools/strata/generate.cpp) is the front end; the tokenizer and
// the chat template stay with it (src/data).
//
// Sampling, in the order transformers applies it (TemperatureLogitsWarper, TopPLogitsWarper,
// then a draw from the softmax):
//   temperature 0  greedy: the highest logit, the lowest id among equal ones (torch.argmax's
//                  choice); top_p and the seed are not used.
//   temperature T  logits / T; then top-p: the smallest set of the most probable tokens whose
//                  probabilities sum to at least top_p (ties in probability kept in id order,
//                  at least one token); then one draw from the renormalised softmax over it.
// The draw uses std::mt19937_64 seeded with `seed` (a generator the C++ standard specifies bit
// for bit) and takes u = (x >> 11) * 2^-53 in [0, 1) from each 64-bit output x, one per token:
// the same seed, model and prompt give the same tokens on every machine whose logits agree
// bitwise (README: Determinism).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "core/status.h"
#include "model/decoder.h"

namespace strata::model {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy; else > 0
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;
};

// InvalidArgument naming the option when temperature is negative or not finite, or top_p is
// outside (0, 1].
Status check_sampling_options(const SamplingOptions& options);

// Not thread-safe; one per generated sequence.
class Sampler {
 public:
  // REQUIRES: check_sampling_options(options) is OK.
  explicit Sampler(const SamplingOptions& options);
  // The next token from logits (V) of one position. REQUIRES: V > 0; logits not NaN.
  int32_t next(std::span<const float> logits);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;  // token ids, reused between calls
  std::vector<double> probs_;   // (V)
};

struct GenerateOptions {
  int64_t max_new_tokens = 128;
  SamplingOptions sampling;
  // Generation stops after producing any of these (emitted like every other token).
  std::vector<int32_t> stop_ids;
};

// Generates after `prompt` (at least one token): begin_sequence(prompt + max_new_tokens), one
// decode() of the prompt, then one per new token. on_token (may be null) is called with each
// new token as soon as it is chosen; returning false stops early. Returns the new tokens.
// Errors of the model (OutOfMemory for the cache, a token outside the vocabulary, a sequence
// beyond its sliding window) are returned. REQUIRES: a ParamAccess is set on the model.
Result<std::vector<int32_t>> generate(Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                                      const std::function<bool(int32_t)>& on_token = nullptr);

}  // namespace strata::model
