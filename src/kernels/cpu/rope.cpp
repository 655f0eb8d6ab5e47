// Rotary position embedding on the CPU: the reference (double arithmetic) and
// the fast path (fp32, cos/sin computed once per position and shared by every
// batch row and head).
#include "kernels/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/check.h"

namespace strata::kernels {

namespace {

// transformers' get_mscale: 0.1 * mscale * ln(scale) + 1 beyond a scale of 1.
double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// YaRN, over the default frequencies already in inv_freq (1 / theta^(2i/D)): each dimension's
// frequency is blended between the interpolated one (divided by factor) and the original by a
// ramp that is 0 below the `beta_fast` boundary and 1 past `beta_slow`. The boundaries are in
// double (Python floats), the blend in fp32, as _compute_yarn_parameters does them.
void yarn_inv_freq(float *inv_freq, int64_t head_dim, const RopeConfig &config) {
  const int64_t half = head_dim / 2;
  const double dim = static_cast<double>(head_dim);
  const double base = config.theta;
  const int64_t original = config.original_max_position_embeddings > 0
                               ? config.original_max_position_embeddings
                               : config.max_position_embeddings;
  CHECK_MSG(original > 0, "yarn rope scaling needs original_max_position_embeddings or "
                          "max_position_embeddings");
  const double beta_fast = config.beta_fast != 0 ? config.beta_fast : 32.0;
  const double beta_slow = config.beta_slow != 0 ? config.beta_slow : 1.0;
  // The dimension whose wavelength fits `rotations` turns into the original context.
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(static_cast<double>(original) /
                           (rotations * 2.0 * std::numbers::pi))) /
           (2.0 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (config.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high)
    high += 0.001; // as transformers avoids the singular ramp
  const float ramp_low = static_cast<float>(low);
  const float ramp_width = static_cast<float>(high - low);
  const float factor = static_cast<float>(config.factor);
  for (int64_t i = 0; i < half; ++i) {
    // inv_freq[i] is 1 / pos_freq; transformers divides 1 by pos_freq and by
    // factor * pos_freq, so pos_freq is recovered first.
    const float pos_freq = std::pow(static_cast<float>(config.theta),
                                    static_cast<float>(2 * i) /
                                        static_cast<float>(head_dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (factor * pos_freq);
    const float ramp = std::clamp(
        (static_cast<float>(i) - ramp_low) / ramp_width, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv_freq[i] = interpolation * (1.0f - extrapolation_factor) +
                  extrapolation * extrapolation_factor;
  }
}

} // namespace

double rope_attention_factor(const RopeConfig &config) {
  if (config.scaling != RopeScaling::kYarn)
    return 1.0;
  if (config.attention_factor != 0)
    return config.attention_factor;
  if (config.mscale != 0 && config.mscale_all_dim != 0)
    return yarn_mscale(config.factor, config.mscale) /
           yarn_mscale(config.factor, config.mscale_all_dim);
  return yarn_mscale(config.factor, 1.0);
}

// Every step is done in fp32 in the order transformers evaluates it, because
// the angles a checkpoint was trained with are whatever those fp32 roundings
// produced. Python scalars meet fp32 tensors there, so they are rounded to fp32
// first; `scalar / tensor` is evaluated by PyTorch as reciprocal(tensor) *
// scalar, which is reproduced below.
void rope_inv_freq(float *inv_freq, int64_t head_dim,
                   const RopeConfig &config, int64_t seq_len) {
  CHECK_MSG(head_dim > 0 && head_dim % 2 == 0,
            "rope head_dim must be positive and even, got " +
                std::to_string(head_dim));
  const int64_t half = head_dim / 2;
  float theta = static_cast<float>(config.theta);
  if (config.scaling == RopeScaling::kDynamic &&
      seq_len > config.max_position_embeddings) {
    CHECK_MSG(config.max_position_embeddings > 0 && head_dim > 2,
              "dynamic rope scaling needs max_position_embeddings and a "
              "head_dim above 2");
    // base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2)),
    // a 0-d fp32 tensor: seq_len is one, and every Python number meeting it is
    // rounded to fp32 (factor - 1 and the exponent are formed in double first).
    const float scaled =
        static_cast<float>(config.factor) * static_cast<float>(seq_len) /
            static_cast<float>(config.max_position_embeddings) -
        static_cast<float>(config.factor - 1.0);
    const float exponent = static_cast<float>(
        static_cast<double>(head_dim) / static_cast<double>(head_dim - 2));
    theta = theta * std::pow(scaled, exponent);
  }
  for (int64_t i = 0; i < half; ++i) {
    const float exponent =
        static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / std::pow(theta, exponent);
  }
  if (config.scaling == RopeScaling::kLinear) {
    const float factor = static_cast<float>(config.factor);
    for (int64_t i = 0; i < half; ++i)
      inv_freq[i] /= factor;
    return;
  }
  if (config.scaling == RopeScaling::kYarn) {
    yarn_inv_freq(inv_freq, head_dim, config);
    return;
  }
  if (config.scaling != RopeScaling::kLlama3)
    return;

  CHECK_MSG(config.high_freq_factor != config.low_freq_factor,
            "llama3 rope scaling needs high_freq_factor != low_freq_factor");
  const float factor = static_cast<float>(config.factor);
  const float low = static_cast<float>(config.low_freq_factor);
  const float high = static_cast<float>(config.high_freq_factor);
  const double old_context =
      static_cast<double>(config.original_max_position_embeddings);
  // Python floats in transformers; comparing them with an fp32 tensor rounds
  // them to fp32.
  const float low_freq_wavelen =
      static_cast<float>(old_context / config.low_freq_factor);
  const float high_freq_wavelen =
      static_cast<float>(old_context / config.high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
  for (int64_t i = 0; i < half; ++i) {
    const float f = inv_freq[i];
    const float wavelen = (1.0f / f) * two_pi;
    if (wavelen > low_freq_wavelen) {
      inv_freq[i] = f / factor; // long wavelengths: plain interpolation
    } else if (!(wavelen < high_freq_wavelen)) {
      // Medium band: blend the interpolated and the original frequency.
      const float smooth =
          ((1.0f / wavelen) * static_cast<float>(old_context) - low) /
          (high - low);
      inv_freq[i] = (1.0f - smooth) * f / factor + smooth * f;
    }
    // Short wavelengths (high frequencies) are left unchanged.
  }
}

namespace ref {

namespace {
// Rotates every (i, i + D/2) pair of every head by sign * t * inv_freq[i].
void rotate(float *out, const float *x, const float *inv_freq, int64_t B,
            int64_t T, int64_t H, int64_t D, double sign, double scale,
            int64_t past, const int32_t *positions) {
  CHECK(D % 2 == 0);
  CHECK(positions == nullptr || past == 0);
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = positions != nullptr ? positions[b * T + t] : past + t;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          // The angle is rounded to fp32 like transformers' freqs; the rest is
          // exact-ish.
          const float angle = static_cast<float>(pos) * inv_freq[i];
          const double c = std::cos(static_cast<double>(angle)) * scale;
          const double s = sign * std::sin(static_cast<double>(angle)) * scale;
          const double x1 = x[base + i];
          const double x2 = x[base + i + half];
          out[base + i] = static_cast<float>(x1 * c - x2 * s);
          out[base + i + half] = static_cast<float>(x2 * c + x1 * s);
        }
      }
    }
  }
}
} // namespace

void rope_forward(float *out, const float *x, const float *inv_freq, int64_t B,
                  int64_t T, int64_t H, int64_t D, float scale, int64_t past,
                  const int32_t *positions) {
  rotate(out, x, inv_freq, B, T, H, D, 1.0, scale, past, positions);
}

// dx = scale * (rotation by -angle) dout: the transpose of a rotation is its
// inverse.
void rope_backward(float *dx, const float *dout, const float *inv_freq,
                   int64_t B, int64_t T, int64_t H, int64_t D, float scale,
                   int64_t past, const int32_t *positions) {
  rotate(dx, dout, inv_freq, B, T, H, D, -1.0, scale, past, positions);
}

} // namespace ref

namespace cpu {

namespace {
// Parallel over positions: each thread computes cos/sin of its position once
// and applies them to all B x H rows there (with per-token positions, to the H
// rows of one token). Every output element depends only on its own inputs, so
// results do not depend on the thread count.
void rotate(float *out, const float *x, const float *inv_freq, int64_t B,
            int64_t T, int64_t H, int64_t D, float sign, float scale,
            int64_t past, const int32_t *positions) {
  CHECK(D % 2 == 0);
  CHECK(positions == nullptr || past == 0);
  const int64_t half = D / 2;
  // Units: the T positions shared by every sequence, or each of the B * T tokens.
  const int64_t units = positions != nullptr ? B * T : T;
#pragma omp parallel
  {
    std::vector<float> cos_t(static_cast<size_t>(half));
    std::vector<float> sin_t(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t t = positions != nullptr ? u % T : u;
      const int64_t pos = positions != nullptr ? positions[u] : past + t;
      const int64_t b_begin = positions != nullptr ? u / T : 0;
      const int64_t b_end = positions != nullptr ? b_begin + 1 : B;
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pos) * inv_freq[i];
        // cos and sin times the scale in fp32, as transformers scales them
        // (exact for the usual scale of 1).
        cos_t[i] = std::cos(angle) * scale;
        sin_t[i] = sign * (std::sin(angle) * scale);
      }
      for (int64_t b = b_begin; b < b_end; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t base = ((b * T + t) * H + h) * D;
          const float *xr = x + base;
          float *o = out + base;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            // Both inputs are read before either output is written, so out may
            // alias x.
            const float x1 = xr[i];
            const float x2 = xr[i + half];
            o[i] = x1 * cos_t[i] - x2 * sin_t[i];
            o[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
          }
        }
      }
    }
  }
}
} // namespace

void rope_forward(float *out, const float *x, const float *inv_freq, int64_t B,
                  int64_t T, int64_t H, int64_t D, float scale, int64_t past,
                  const int32_t *positions) {
  rotate(out, x, inv_freq, B, T, H, D, 1.0f, scale, past, positions);
}

void rope_backward(float *dx, const float *dout, const float *inv_freq,
                   int64_t B, int64_t T, int64_t H, int64_t D, float scale,
                   int64_t past, const int32_t *positions) {
  rotate(dx, dout, inv_freq, B, T, H, D, -1.0f, scale, past, positions);
}

} // namespace cpu
} // namespace strata::kernels
