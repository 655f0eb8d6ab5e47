// Rotary position embedding in the Hugging Face Llama convention ("rotate_half": element i
// pairs with element i + D/2), with optional frequency scaling as config.json's rope_scaling
// names it: linear ({rope_type: linear, factor}: position interpolation, every frequency
// divided by factor), dynamic NTK ({rope_type | type: dynamic, factor}: for sequences longer than
// max_position_embeddings, the base theta raised so that the longest wavelength stretches over
// them; shorter ones rotate as without scaling), Llama-3's ({rope_type: llama3, factor,
// low_freq_factor, high_freq_factor, original_max_position_embeddings}) or YaRN ({rope_type |
// type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor,
// mscale, mscale_all_dim, truncate}: frequencies blended between interpolated and original by a
// linear ramp over the dimensions, and cos and sin multiplied by an attention factor).
#pragma once
#include <cstdint>

namespace strata::kernels {

enum class RopeScaling : uint8_t { kNone, kLinear, kLlama3, kDynamic, kYarn };

struct RopeConfig {
  double theta = 10000.0;
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 8.0;  // linear, dynamic, llama3 and yarn
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;  // llama3 and yarn (0: max_position_embeddings)
  // dynamic: the context the model was trained for (config.json's max_position_embeddings); yarn:
  // the context it now has, whose original_max_position_embeddings (when 0) it stands for.
  int64_t max_position_embeddings = 0;
  // yarn (transformers' defaults; 0 = not given where a default is derived).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 0.0;  // 0: from factor (and mscale / mscale_all_dim when both given)
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  bool truncate = true;  // round the ramp's ends to whole dimensions
};

// What cos and sin are multiplied by: YaRN's attention factor, 1 for every other scaling.
// Computed in double as transformers does (a Python float).
double rope_attention_factor(const RopeConfig& config);

// inv_freq (D/2): theta^(-2i/D), then the scaling. Computed in fp32 exactly as transformers does
// (_compute_default/linear_scaling/llama3/dynamic_ntk/yarn_parameters), so that positions rotate by
// the same angles. seq_len: the sequence length the frequencies are for (dynamic scaling only,
// which changes them beyond max_position_embeddings; transformers takes the largest position
// plus one).
void rope_inv_freq(float* inv_freq /*(D/2)*/, int64_t head_dim, const RopeConfig& config, int64_t seq_len = 0);

// The ops rotate by the angles and multiply by `scale` (YaRN's attention factor, which
// transformers applies to cos and sin; 1 otherwise).
#define STRATA_ROPE_OPS                                                                            \
  /* position of token t is past + t (past: positions already in a KV cache, 0 in training), or  \
     positions[b, t] when positions (B,T) is given (packed documents restart at 0; past = 0).  \
     out may alias x. */                                                                           \
  void rope_forward(float* out /*(B,T,H,D)*/, const float* x /*(B,T,H,D)*/,                        \
                    const float* inv_freq /*(D/2)*/, int64_t B, int64_t T, int64_t H, int64_t D,   \
                    float scale = 1.0f, int64_t past = 0,                                          \
                    const int32_t* positions /*(B,T) or null*/ = nullptr);                         \
  /* dx = scale * (rotation by -angle) dout. dx may alias dout. */                                 \
  void rope_backward(float* dx /*(B,T,H,D)*/, const float* dout /*(B,T,H,D)*/,                     \
                     const float* inv_freq /*(D/2)*/, int64_t B, int64_t T, int64_t H, int64_t D,  \
                     float scale = 1.0f, int64_t past = 0,                                         \
                     const int32_t* positions /*(B,T) or null*/ = nullptr);
namespace ref { STRATA_ROPE_OPS }
namespace cpu { STRATA_ROPE_OPS }
#undef STRATA_ROPE_OPS
}  // namespace strata::kernels
