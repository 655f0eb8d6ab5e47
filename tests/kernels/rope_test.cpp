// RoPE: inv_freq against transformers' formulas, fast path against the
// reference, backward against finite differences, forward then backward =
// identity, in-place use.
#include "kernels/rope.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <ostream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::max_scaled_error;
using strata::testing::random_vector;
using strata::testing::relative_error;

struct RopeShape {
  int64_t B, T, H, D;
};
// Readable parameter names in test output.
void PrintTo(const RopeShape &s, std::ostream *os) {
  *os << "B=" << s.B << " "
      << "T=" << s.T << " "
      << "H=" << s.H << " "
      << "D=" << s.D;
}
const RopeShape kShapes[] = {
    {1, 1, 1, 8}, {2, 7, 3, 16}, {1, 33, 2, 64}, {2, 65, 4, 64}};

RopeConfig llama3_config() {
  RopeConfig config;
  config.theta = 500000.0;
  config.scaling = RopeScaling::kLlama3;
  config.factor = 8.0;
  config.low_freq_factor = 1.0;
  config.high_freq_factor = 4.0;
  config.original_max_position_embeddings = 8192;
  return config;
}

std::vector<float> inv_freq_for(int64_t D, const RopeConfig &config) {
  std::vector<float> f(static_cast<size_t>(D / 2));
  rope_inv_freq(f.data(), D, config);
  return f;
}

// Expected values were produced with PyTorch 1.13 (fp32) by running
// transformers' _compute_default_rope_parameters formula, 1.0 / (base **
// (arange(0, dim, 2).float() / dim)).
TEST(RopeTest, InvFreqMatchesTransformersDefault) {
  RopeConfig config; // theta 10000, no scaling
  std::vector<float> f = inv_freq_for(64, config);
  const struct {
    int index;
    float expected;
  } cases[] = {{0, 1.0f},
               {1, 0.7498942017555237f},
               {5, 0.23713736236095428f},
               {17, 0.007498942315578461f},
               {31, 0.0001333521504420787f}};
  for (const auto &c : cases) {
    // A couple of ulps: PyTorch's vectorised pow and libm's powf may round
    // differently.
    EXPECT_WITHIN(max_scaled_error(&f[c.index], &c.expected, 1, 0, 3e-7), 1.0)
        << c.index;
  }
}

// Linear scaling (position interpolation) by 4: the default frequencies divided by the factor,
// as transformers' _compute_linear_scaling_rope_parameters does (values from PyTorch 1.13, fp32:
// `1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)) / 4.0`).
TEST(RopeTest, InvFreqMatchesTransformersLinear) {
  RopeConfig config;
  config.scaling = RopeScaling::kLinear;
  config.factor = 4.0;
  std::vector<float> f = inv_freq_for(64, config);
  const struct {
    int index;
    float expected;
  } cases[] = {{0, 0.25f},
               {1, 0.18747355043888092f},
               {5, 0.05928434059023857f},
               {17, 0.0018747355788946152f},
               {31, 3.333803761051968e-05f}};
  for (const auto &c : cases) {
    EXPECT_WITHIN(max_scaled_error(&f[c.index], &c.expected, 1, 0, 3e-7), 1.0)
        << c.index;
  }
}

// Expected values were produced with PyTorch 1.13 (fp32) by running the body of
// transformers' _compute_llama3_parameters for Llama 3.1's rope_scaling (theta
// 500000, head_dim 128, factor 8, low_freq_factor 1, high_freq_factor 4,
// original_max_position_embeddings 8192). Indices 0..28 are in the
// high-frequency band (unchanged), 29..34 in the medium band (smoothed), 35..63
// in the low-frequency band (divided by factor).
TEST(RopeTest, InvFreqMatchesTransformersLlama3) {
  std::vector<float> f = inv_freq_for(128, llama3_config());
  const struct {
    int index;
    float expected;
  } cases[] = {{0, 1.0f},
               {1, 0.8146172165870667f},
               {20, 0.016560440883040428f},
               {28, 0.0032114461064338684f},
               {29, 0.0021665706299245358f},
               {31, 0.0008567514596506953f},
               {34, 0.0001785077911335975f},
               {35, 9.556212171446532e-05f},
               {50, 4.411534519022098e-06f},
               {63, 3.068925877869333e-07f}};
  for (const auto &c : cases) {
    EXPECT_WITHIN(max_scaled_error(&f[c.index], &c.expected, 1, 0, 3e-7), 1.0)
        << c.index;
  }
}

// Dynamic NTK scaling, against transformers 4.40's LlamaDynamicNTKScalingRotaryEmbedding run
// with PyTorch 1.13 (fp32) on positions 0 .. seq_len - 1: past max_position_embeddings the base
// grows, below it the frequencies are the default ones.
TEST(RopeTest, InvFreqMatchesTransformersDynamicNtk) {
  struct Case {
    int64_t dim, max_positions;
    double factor, theta;
    int64_t seq_len;
    std::vector<std::pair<int, float>> expected;
  };
  const Case cases[] = {
      {64, 256, 2.0, 10000.0, 1000,
       {{0, 1.0f}, {1, 0.7048864364624023f}, {5, 0.17401862144470215f}, {17, 0.002618336584419012f},
        {31, 1.95746270037489e-05f}}},
      {128, 2048, 4.0, 500000.0, 5000,
       {{0, 1.0f}, {1, 0.7902674674987793f}, {5, 0.30822688341140747f}, {17, 0.01828772760927677f},
        {63, 3.628845774983347e-07f}}},
      {64, 256, 2.0, 10000.0, 200,  // shorter than the context: the default frequencies
       {{0, 1.0f}, {1, 0.7498942017555237f}, {5, 0.23713736236095428f}, {17, 0.007498942315578461f},
        {31, 0.0001333521504420787f}}},
  };
  for (const Case& c : cases) {
    RopeConfig config;
    config.scaling = RopeScaling::kDynamic;
    config.factor = c.factor;
    config.theta = c.theta;
    config.max_position_embeddings = c.max_positions;
    std::vector<float> f(static_cast<size_t>(c.dim / 2));
    rope_inv_freq(f.data(), c.dim, config, c.seq_len);
    for (const auto& [index, expected] : c.expected) {
      EXPECT_WITHIN(max_scaled_error(&f[index], &expected, 1, 0, 3e-7), 1.0)
          << "dim " << c.dim << " seq_len " << c.seq_len << " index " << index;
    }
  }
}

TEST(RopeTest, Llama3ScalingOnlyLowersFrequencies) {
  RopeConfig plain = llama3_config();
  plain.scaling = RopeScaling::kNone;
  std::vector<float> base = inv_freq_for(128, plain);
  std::vector<float> scaled = inv_freq_for(128, llama3_config());
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_LE(scaled[i], base[i]) << i;
    EXPECT_GE(scaled[i], base[i] / 8.0f) << i;
  }
}

// YaRN, against transformers 4.57.1's _compute_yarn_parameters run on PyTorch 1.13 (fp32):
// tests/fixtures/rope/yarn_transformers_4.57.1.txt, written by tests/kernels/yarn_reference.py
// (it says how). Every frequency of each case, and the attention factor.
struct YarnCase {
  std::string name;
  int64_t head_dim = 0, max_positions = 0;
  RopeConfig config;
  double attention_factor = 0;
  std::vector<float> inv_freq;
};

std::vector<YarnCase> yarn_cases() {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) +
                   "/tests/fixtures/rope/yarn_transformers_4.57.1.txt");
  std::vector<YarnCase> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream is(line);
    YarnCase c;
    std::string scaling;
    is >> c.name >> c.head_dim >> c.config.theta >> c.max_positions >> scaling >>
        c.attention_factor;
    const nlohmann::json j = nlohmann::json::parse(scaling);
    c.config.scaling = RopeScaling::kYarn;
    c.config.max_position_embeddings = c.max_positions;
    c.config.factor = j.at("factor").get<double>();
    c.config.original_max_position_embeddings =
        j.value("original_max_position_embeddings", int64_t{0});
    c.config.beta_fast = j.value("beta_fast", 0.0);
    c.config.beta_slow = j.value("beta_slow", 0.0);
    c.config.attention_factor = j.value("attention_factor", 0.0);
    c.config.mscale = j.value("mscale", 0.0);
    c.config.mscale_all_dim = j.value("mscale_all_dim", 0.0);
    c.config.truncate = j.value("truncate", true);
    double v;
    while (is >> v)
      c.inv_freq.push_back(static_cast<float>(v));
    out.push_back(std::move(c));
  }
  return out;
}

TEST(RopeTest, YarnMatchesTransformersTables) {
  const std::vector<YarnCase> cases = yarn_cases();
  ASSERT_EQ(cases.size(), 5u) << "the fixture file is missing or changed";
  for (const YarnCase &c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_EQ(static_cast<int64_t>(c.inv_freq.size()), c.head_dim / 2);
    const std::vector<float> f = inv_freq_for(c.head_dim, c.config);
    for (int64_t i = 0; i < c.head_dim / 2; ++i) {
      EXPECT_WITHIN(max_scaled_error(&f[i], &c.inv_freq[i], 1, 0, 3e-7), 1.0)
          << "index " << i << ": " << f[i] << " vs " << c.inv_freq[i];
    }
    const double factor = rope_attention_factor(c.config);
    EXPECT_TRUE(std::abs(factor - c.attention_factor) <= 1e-15) << factor;
  }
  // Every other scaling leaves cos and sin as they are.
  EXPECT_EQ(rope_attention_factor(llama3_config()), 1.0);
  EXPECT_EQ(rope_attention_factor(RopeConfig{}), 1.0);
}

// The attention factor multiplies cos and sin: forward is the unscaled rotation times it, and
// backward its transpose (the same factor), in both the reference and the fast path.
TEST(RopeTest, AScaleMultipliesTheRotationForwardAndBackward) {
  const int64_t B = 2, T = 9, H = 3, D = 16, n = B * T * H * D;
  const float scale = 1.2079441f;
  std::vector<float> inv_freq = inv_freq_for(D, yarn_cases().at(1).config);
  std::vector<float> x = random_vector(n, 8), plain(n), scaled(n), expect(n);
  for (bool fast : {false, true}) {
    auto fwd = fast ? cpu::rope_forward : ref::rope_forward;
    auto bwd = fast ? cpu::rope_backward : ref::rope_backward;
    fwd(plain.data(), x.data(), inv_freq.data(), B, T, H, D, 1.0f, 0, nullptr);
    fwd(scaled.data(), x.data(), inv_freq.data(), B, T, H, D, scale, 0, nullptr);
    for (int64_t i = 0; i < n; ++i)
      expect[i] = plain[i] * scale;
    EXPECT_WITHIN(max_scaled_error(scaled.data(), expect.data(), n, 1e-6, 1e-6), 1.0) << fast;
    bwd(plain.data(), x.data(), inv_freq.data(), B, T, H, D, 1.0f, 0, nullptr);
    bwd(scaled.data(), x.data(), inv_freq.data(), B, T, H, D, scale, 0, nullptr);
    for (int64_t i = 0; i < n; ++i)
      expect[i] = plain[i] * scale;
    EXPECT_WITHIN(max_scaled_error(scaled.data(), expect.data(), n, 1e-6, 1e-6), 1.0) << fast;
  }
  // Fast against reference with the scale.
  std::vector<float> a(n), b(n);
  ref::rope_forward(a.data(), x.data(), inv_freq.data(), B, T, H, D, scale);
  cpu::rope_forward(b.data(), x.data(), inv_freq.data(), B, T, H, D, scale);
  EXPECT_WITHIN(max_scaled_error(b.data(), a.data(), n, 1e-6, 1e-5), 1.0);
}

// Tokens after `past` positions (a KV cache in generation) rotate exactly as the same
// positions of the whole sequence, on both paths.
TEST(RopeTest, PastShiftsThePositionsBitwise) {
  const int64_t T = 23, H = 2, D = 16, past = 17, n = T - past;
  std::vector<float> inv_freq = inv_freq_for(D, llama3_config());
  std::vector<float> x = random_vector(T * H * D, 9), full(T * H * D), tail(n * H * D);
  for (bool fast : {false, true}) {
    auto fwd = fast ? cpu::rope_forward : ref::rope_forward;
    fwd(full.data(), x.data(), inv_freq.data(), 1, T, H, D, 1.0f, 0, nullptr);
    fwd(tail.data(), x.data() + past * H * D, inv_freq.data(), 1, n, H, D, 1.0f, past, nullptr);
    for (int64_t i = 0; i < n * H * D; ++i) ASSERT_EQ(tail[i], full[past * H * D + i]) << fast;
  }
}

// Per-token positions (packed documents restarting at 0) rotate each token as
// the token at that position of a sequence of its own, forward and backward,
// on both paths; rows of the batch may differ.
TEST(RopeTest, DocumentPositionsRotateEachDocumentAsAlone) {
  const int64_t B = 2, T = 11, H = 3, D = 16;
  const int32_t positions[B * T] = {0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1,
                                    0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3};
  std::vector<float> inv_freq = inv_freq_for(D, llama3_config());
  std::vector<float> x = random_vector(B * T * H * D, 11);
  std::vector<float> packed(x.size()), alone(T * H * D);
  for (bool fast : {false, true}) {
    for (bool backward : {false, true}) {
      auto op = backward ? (fast ? cpu::rope_backward : ref::rope_backward)
                         : (fast ? cpu::rope_forward : ref::rope_forward);
      op(packed.data(), x.data(), inv_freq.data(), B, T, H, D, 1.0f, 0, positions);
      for (int64_t i = 0; i < B * T; ++i) {
        const int64_t p = positions[i];
        // Token i alone at position p: the row of a sequence of p + 1 tokens.
        std::vector<float> seq((p + 1) * H * D, 0.0f);
        std::copy_n(x.data() + i * H * D, H * D, seq.data() + p * H * D);
        op(alone.data(), seq.data(), inv_freq.data(), 1, p + 1, H, D, 1.0f, 0, nullptr);
        for (int64_t j = 0; j < H * D; ++j)
          ASSERT_EQ(packed[i * H * D + j], alone[p * H * D + j]) << fast << backward << " token " << i;
      }
    }
  }
}

class RopeShapeTest : public ::testing::TestWithParam<RopeShape> {};

TEST_P(RopeShapeTest, FastMatchesReference) {
  const auto [B, T, H, D] = GetParam();
  const int64_t n = B * T * H * D;
  for (const RopeConfig &config : {RopeConfig{}, llama3_config()}) {
    std::vector<float> inv_freq = inv_freq_for(D, config);
    std::vector<float> x = random_vector(n, 1), dout = random_vector(n, 2);
    std::vector<float> out_ref(n), out_cpu(n), dx_ref(n), dx_cpu(n);
    ref::rope_forward(out_ref.data(), x.data(), inv_freq.data(), B, T, H, D);
    cpu::rope_forward(out_cpu.data(), x.data(), inv_freq.data(), B, T, H, D);
    ref::rope_backward(dx_ref.data(), dout.data(), inv_freq.data(), B, T, H, D);
    cpu::rope_backward(dx_cpu.data(), dout.data(), inv_freq.data(), B, T, H, D);
    EXPECT_WITHIN(
        max_scaled_error(out_cpu.data(), out_ref.data(), n, 1e-6, 1e-5), 1.0);
    EXPECT_WITHIN(max_scaled_error(dx_cpu.data(), dx_ref.data(), n, 1e-6, 1e-5),
                  1.0);
  }
}

TEST_P(RopeShapeTest, ForwardThenBackwardIsIdentity) {
  const auto [B, T, H, D] = GetParam();
  const int64_t n = B * T * H * D;
  std::vector<float> inv_freq = inv_freq_for(D, llama3_config());
  std::vector<float> x = random_vector(n, 3), y(n), back(n);
  ref::rope_forward(y.data(), x.data(), inv_freq.data(), B, T, H, D);
  ref::rope_backward(back.data(), y.data(), inv_freq.data(), B, T, H, D);
  EXPECT_WITHIN(max_scaled_error(back.data(), x.data(), n, 1e-6, 1e-6), 1.0);
  cpu::rope_forward(y.data(), x.data(), inv_freq.data(), B, T, H, D);
  cpu::rope_backward(back.data(), y.data(), inv_freq.data(), B, T, H, D);
  EXPECT_WITHIN(max_scaled_error(back.data(), x.data(), n, 1e-6, 1e-6), 1.0);
}

TEST_P(RopeShapeTest, InPlaceMatchesOutOfPlace) {
  const auto [B, T, H, D] = GetParam();
  const int64_t n = B * T * H * D;
  std::vector<float> inv_freq = inv_freq_for(D, RopeConfig{});
  std::vector<float> x = random_vector(n, 4), out(n);
  cpu::rope_forward(out.data(), x.data(), inv_freq.data(), B, T, H, D);
  std::vector<float> inplace = x;
  cpu::rope_forward(inplace.data(), inplace.data(), inv_freq.data(), B, T, H,
                    D);
  EXPECT_EQ(inplace, out);
  cpu::rope_backward(out.data(), x.data(), inv_freq.data(), B, T, H, D);
  inplace = x;
  cpu::rope_backward(inplace.data(), inplace.data(), inv_freq.data(), B, T, H,
                     D);
  EXPECT_EQ(inplace, out);
  ref::rope_forward(out.data(), x.data(), inv_freq.data(), B, T, H, D);
  inplace = x;
  ref::rope_forward(inplace.data(), inplace.data(), inv_freq.data(), B, T, H,
                    D);
  EXPECT_EQ(inplace, out);
}

TEST_P(RopeShapeTest, SameResultForAnyThreadCount) {
  const auto [B, T, H, D] = GetParam();
  const int64_t n = B * T * H * D;
  std::vector<float> inv_freq = inv_freq_for(D, llama3_config());
  std::vector<float> x = random_vector(n, 5), many(n), one(n);
  cpu::rope_forward(many.data(), x.data(), inv_freq.data(), B, T, H, D);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  cpu::rope_forward(one.data(), x.data(), inv_freq.data(), B, T, H, D);
  omp_set_num_threads(threads);
  EXPECT_EQ(one, many);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeShapeTest, ::testing::ValuesIn(kShapes));

// Far positions amplify any difference in inv_freq or in how the angle is
// rounded. Expected cos/sin were produced with PyTorch 1.13 the way
// transformers' LlamaRotaryEmbedding does it: freqs = position (fp32) *
// inv_freq (fp32, Llama 3.1 scaling above), then cos/sin in fp32.
TEST(RopeTest, FarPositionsRotateLikeTransformers) {
  const int64_t T = 8192, D = 128, half = D / 2;
  std::vector<float> inv_freq = inv_freq_for(D, llama3_config());
  // x = (1, 0) in every pair, so out[i] = cos(angle_i) and out[i + D/2] =
  // sin(angle_i).
  std::vector<float> x(T * D, 0.0f), out(T * D);
  for (int64_t t = 0; t < T; ++t)
    std::fill_n(x.begin() + t * D, half, 1.0f);
  const struct {
    int64_t t, i;
    float cos, sin;
  } cases[] = {{8191, 3, -0.175013467669487f, -0.9845660328865051f},
               {1000, 0, 0.5623790621757507f, 0.8268795609474182f},
               {5000, 30, 0.8384937644004822f, 0.5449111461639404f},
               {8191, 63, 0.9999968409538269f, 0.0025137546472251415f}};
  for (bool fast : {false, true}) {
    if (fast) {
      cpu::rope_forward(out.data(), x.data(), inv_freq.data(), 1, T, 1, D);
    } else {
      ref::rope_forward(out.data(), x.data(), inv_freq.data(), 1, T, 1, D);
    }
    for (const auto &c : cases) {
      EXPECT_NEAR(out[c.t * D + c.i], c.cos, 2e-6)
          << "fast=" << fast << " t=" << c.t;
      EXPECT_NEAR(out[c.t * D + c.i + half], c.sin, 2e-6)
          << "fast=" << fast << " t=" << c.t;
    }
  }
}

// L = sum(w * rope_forward(x)); dL/dx must equal rope_backward(w).
TEST(RopeTest, BackwardMatchesFiniteDifference) {
  const int64_t B = 2, T = 7, H = 2, D = 8, n = B * T * H * D;
  std::vector<float> inv_freq = inv_freq_for(D, llama3_config());
  std::vector<float> x = random_vector(n, 6), w = random_vector(n, 7), out(n),
                     dx(n);
  const float scale = 1.25f;  // as YaRN's attention factor scales cos and sin
  auto loss = [&]() {
    ref::rope_forward(out.data(), x.data(), inv_freq.data(), B, T, H, D, scale);
    double s = 0;
    for (int64_t i = 0; i < n; ++i)
      s += double(w[i]) * out[i];
    return s;
  };
  ref::rope_backward(dx.data(), w.data(), inv_freq.data(), B, T, H, D, scale);
  std::vector<float> numeric(n);
  for (int64_t i = 0; i < n; ++i)
    numeric[i] = float(finite_difference(loss, &x[i], 1e-2));
  EXPECT_WITHIN(relative_error(numeric, dx), 2e-5);
}

} // namespace
} // namespace strata::kernels
