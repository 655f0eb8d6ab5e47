// The memory-bound CUDA ops on both of their paths: 16-byte accesses (every pointer aligned,
// row lengths whole packs of 8) and one value per access (misaligned pointers, and row
// lengths that are not multiples of 8). Each case runs once with buffers at the start of
// their allocation (cudaMalloc aligns to 256 bytes) and once one element in (never 16-byte
// aligned), and compares both with the CPU reference; element-wise ops must also give the
// same bits on both paths. Then the device-side gradient clipping: the multi-tensor sum of
// squares, the clip factor and AdamW reading it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/adamw.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/ops.h"
#include "kernels/embedding.h"
#include "kernels/grad_norm.h"
#include "kernels/moments.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace strata::testing {
namespace {

namespace ref = kernels::ref;
namespace cu = kernels::cuda;

constexpr double kBf16Tol = 1e-2;  // as ops_parity_test.cpp
constexpr double kF32Tol = 1e-5;

// n values of T placed `offset` elements into a fresh allocation: offset 0 is 16-byte aligned,
// offset 1 is not (T = bf16 is handled as uint16_t on the host).
template <typename T>
class Placed {
 public:
  Placed(size_t n, size_t offset) : buffer_(n + offset), n_(n), offset_(offset) {}
  template <typename H>
  Placed(const std::vector<H>& host, size_t offset) : Placed(host.size(), offset) {
    upload(host);
  }
  T* get() const { return buffer_.get() + offset_; }
  template <typename H>
  void upload(const std::vector<H>& host) {
    static_assert(sizeof(H) == sizeof(T), "host and device element sizes differ");
    CHECK(host.size() == n_);
    CUDA_CHECK(cudaMemcpy(get(), host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  template <typename H>
  std::vector<H> download() const {
    std::vector<H> host(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host.data(), get(), n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  DeviceBuffer<T> buffer_;
  size_t n_, offset_;
};

// bf16 values (rounded in place first, so that the reference sees what the GPU sees).
Placed<bf16> placed_bf16(std::vector<float>& v, size_t offset) { return Placed<bf16>(round_to_bf16(v), offset); }
std::vector<float> values(const Placed<bf16>& b) { return bf16_to_float(b.download<uint16_t>()); }
std::vector<float> values(const Placed<float>& b) { return b.download<float>(); }

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double err = relative_error(got, want);
  EXPECT_TRUE(err <= tol) << what << ": relative error " << err << " exceeds " << tol;
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t first = -1, mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at " << first;
}

std::string path_name(size_t offset) { return offset == 0 ? " (aligned)" : " (offset by one element)"; }

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// ---- element-wise ops ---------------------------------------------------------------------------

TEST(MemopsParity, SwiGluBothPaths) {
  StreamGuard stream;
  for (int64_t n : {1, 7, 8, 9, 1001, 65537}) {
    std::vector<float> gate = random_vector(n, 1 + n, -6.f, 6.f), up = random_vector(n, 2 + n, -2.f, 2.f);
    std::vector<float> dout = random_vector(n, 3 + n);
    round_to_bf16(gate);
    round_to_bf16(up);
    round_to_bf16(dout);
    std::vector<float> out(n), dgate(n), dup(n);
    ref::swiglu_forward(out.data(), gate.data(), up.data(), n);
    ref::swiglu_backward(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), n);
    std::vector<std::vector<float>> results[2];
    for (size_t offset : {0, 1}) {
      const std::string what = "swiglu n=" + std::to_string(n) + path_name(offset);
      Placed<bf16> d_gate = placed_bf16(gate, offset), d_up = placed_bf16(up, offset),
                   d_dout = placed_bf16(dout, offset);
      Placed<bf16> d_out(n, offset), d_dgate(n, offset), d_dup(n, offset);
      cu::swiglu_forward(d_out.get(), d_gate.get(), d_up.get(), n, stream.get());
      cu::swiglu_backward(d_dgate.get(), d_dup.get(), d_dout.get(), d_gate.get(), d_up.get(), n, stream.get());
      results[offset] = {values(d_out), values(d_dgate), values(d_dup)};
      expect_close(results[offset][0], out, kBf16Tol, what + " out");
      expect_close(results[offset][1], dgate, kBf16Tol, what + " dgate");
      expect_close(results[offset][2], dup, kBf16Tol, what + " dup");
    }
    for (int k = 0; k < 3; ++k) expect_same_bits(results[0][k], results[1][k], "swiglu paths n=" + std::to_string(n));
  }
}

TEST(MemopsParity, AddAndRoundBothPaths) {
  StreamGuard stream;
  for (int64_t n : {1, 7, 8, 9, 1001, 65537}) {
    std::vector<float> a = random_vector(n, 10 + n), b = random_vector(n, 11 + n), f = random_vector(n, 12 + n);
    round_to_bf16(a);
    round_to_bf16(b);
    std::vector<float> sum(n), rounded(n);
    for (int64_t i = 0; i < n; ++i) {
      sum[i] = bf16_value(bf16_bits(a[i] + b[i]));  // one fp32 add, one rounding
      rounded[i] = bf16_value(bf16_bits(f[i]));
    }
    for (size_t offset : {0, 1}) {
      const std::string what = "n=" + std::to_string(n) + path_name(offset);
      Placed<bf16> d_a = placed_bf16(a, offset), d_b = placed_bf16(b, offset), d_r(n, offset);
      Placed<float> d_f(f, offset);
      cu::add_inplace(d_a.get(), d_b.get(), n, stream.get());
      cu::f32_to_bf16(d_r.get(), d_f.get(), n, stream.get());
      expect_same_bits(values(d_a), sum, "add_inplace " + what);
      expect_same_bits(values(d_r), rounded, "f32_to_bf16 " + what);
    }
  }
}

TEST(MemopsParity, SharedExpertGateBothPaths) {
  StreamGuard stream;
  for (int64_t N : {1, 5, 33}) {
    for (int64_t C : {8, 64, 67}) {
      std::vector<float> out = random_vector(N * C, 20 + N), y = random_vector(N * C, 21 + C);
      std::vector<float> dout = random_vector(N * C, 22 + N * C), logit = random_vector(N, 23, -4.f, 4.f);
      round_to_bf16(out);
      round_to_bf16(y);
      round_to_bf16(dout);
      std::vector<float> combined(N * C), dshared(N * C), dlogit(N);
      for (int64_t n = 0; n < N; ++n) {
        const float s = sigmoid(logit[n]);
        double dot = 0;
        for (int64_t c = 0; c < C; ++c) {
          const int64_t i = n * C + c;
          combined[i] = out[i] + s * y[i];
          dshared[i] = s * dout[i];
          dot += double(dout[i]) * y[i];
        }
        dlogit[n] = static_cast<float>(dot * s * (1.0 - s));
      }
      std::vector<float> results[2];
      for (size_t offset : {0, 1}) {
        const std::string what = "shared expert N=" + std::to_string(N) + " C=" + std::to_string(C) + path_name(offset);
        Placed<bf16> d_out = placed_bf16(out, offset), d_y = placed_bf16(y, offset), d_dout = placed_bf16(dout, offset);
        Placed<bf16> d_dshared(N * C, offset);
        Placed<float> d_logit(logit, offset), d_dlogit(N, offset);
        cu::shared_expert_combine(d_out.get(), d_y.get(), d_logit.get(), N, C, stream.get());
        cu::shared_expert_backward(d_dshared.get(), d_dlogit.get(), d_dout.get(), d_y.get(), d_logit.get(), N, C,
                                   stream.get());
        results[offset] = values(d_out);
        expect_close(results[offset], combined, kBf16Tol, what + " combine");
        expect_close(values(d_dshared), dshared, kBf16Tol, what + " dshared");
        expect_close(values(d_dlogit), dlogit, kF32Tol, what + " dlogit");
      }
      expect_same_bits(results[0], results[1], "combine paths N=" + std::to_string(N) + " C=" + std::to_string(C));
    }
  }
}

// ---- RoPE, embedding, RMSNorm -------------------------------------------------------------------

TEST(MemopsParity, RopeBothPaths) {
  StreamGuard stream;
  const int64_t B = 2, T = 33, H = 3;
  for (int64_t D : {2, 10, 16, 72, 128}) {  // D/2 = 36 (72) is not a whole number of packs
    kernels::RopeConfig config;
    config.theta = 500000.0;
    std::vector<float> inv_freq(D / 2);
    kernels::rope_inv_freq(inv_freq.data(), D, config);
    std::vector<float> x = random_vector(B * T * H * D, 30 + D), dout = random_vector(B * T * H * D, 31 + D);
    round_to_bf16(x);
    round_to_bf16(dout);
    std::vector<float> out(x.size()), dx(x.size());
    ref::rope_forward(out.data(), x.data(), inv_freq.data(), B, T, H, D);
    ref::rope_backward(dx.data(), dout.data(), inv_freq.data(), B, T, H, D);
    DeviceBuffer<float> d_freq(inv_freq);
    std::vector<float> results[2][2];
    for (size_t offset : {0, 1}) {
      const std::string what = "rope D=" + std::to_string(D) + path_name(offset);
      Placed<bf16> d_x = placed_bf16(x, offset), d_dout = placed_bf16(dout, offset), d_out(x.size(), offset);
      cu::rope_forward(d_out.get(), d_x.get(), d_freq.get(), B, T, H, D, 1.0f, 0, stream.get());
      cu::rope_backward(d_dout.get(), d_dout.get(), d_freq.get(), B, T, H, D, 1.0f, stream.get());  // in place
      results[offset][0] = values(d_out);
      results[offset][1] = values(d_dout);
      expect_close(results[offset][0], out, kBf16Tol, what + " forward");
      expect_close(results[offset][1], dx, kBf16Tol, what + " backward (in place)");
    }
    for (int k = 0; k < 2; ++k) expect_same_bits(results[0][k], results[1][k], "rope paths D=" + std::to_string(D));
  }
}

TEST(MemopsParity, EmbeddingBothPaths) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  const int64_t V = 50;
  for (int64_t N : {1, 33, 1000}) {
    for (int64_t C : {8, 64, 67}) {
      std::vector<int32_t> tokens(N);
      for (int64_t i = 0; i < N; ++i) tokens[i] = static_cast<int32_t>((i * 37 + N) % V);
      std::vector<float> table = random_vector(V * C, 40 + N), dout = random_vector(N * C, 41 + C);
      std::vector<float> dtable = random_vector(V * C, 42);
      round_to_bf16(table);
      round_to_bf16(dout);
      std::vector<float> out(N * C), want_dtable = dtable;
      ref::embedding_forward(out.data(), tokens.data(), table.data(), N, C);
      ref::embedding_backward(want_dtable.data(), dout.data(), tokens.data(), N, C);
      DeviceBuffer<int32_t> d_tokens(tokens);
      std::vector<float> results[2];
      for (size_t offset : {0, 1}) {
        const std::string what = "embedding N=" + std::to_string(N) + " C=" + std::to_string(C) + path_name(offset);
        Placed<bf16> d_table = placed_bf16(table, offset), d_dout = placed_bf16(dout, offset), d_out(N * C, offset);
        Placed<float> d_dtable(dtable, offset);
        cu::embedding_forward(d_out.get(), d_tokens.get(), d_table.get(), N, C, V, stream.get());
        cu::embedding_backward(ctx, d_dtable.get(), d_dout.get(), d_tokens.get(), N, C, V, stream.get());
        expect_same_bits(values(d_out), out, what + " forward");
        results[offset] = values(d_dtable);
        expect_close(results[offset], want_dtable, kF32Tol, what + " dtable");
      }
      // Both paths add each element's rows in the same order.
      expect_same_bits(results[0], results[1],
                       "embedding backward paths N=" + std::to_string(N) + " C=" + std::to_string(C));
    }
  }
}

TEST(MemopsParity, RmsNormBothPaths) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  // 8200 and 8201 take the wide backward kernel (rows above 512 * 16 columns), 40000 and
  // 40001 the one for rows above 512 * 64.
  for (int64_t N : {1, 7, 600}) {
    for (int64_t C : {8, 67, 4096, 8200, 8201, 40000, 40001}) {
      const float eps = 1e-5f;
      std::vector<float> x = random_vector(N * C, 50 + N + C, -2.f, 2.f), w = random_vector(C, 51, 0.5f, 1.5f);
      std::vector<float> dout = random_vector(N * C, 52 + N), dweight = random_vector(C, 53);
      round_to_bf16(x);
      round_to_bf16(w);
      round_to_bf16(dout);
      std::vector<float> out(N * C), rstd(N), dx(N * C), want_dweight = dweight;
      ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
      ref::rmsnorm_backward(dx.data(), want_dweight.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
      for (size_t offset : {0, 1}) {
        const std::string what = "rmsnorm N=" + std::to_string(N) + " C=" + std::to_string(C) + path_name(offset);
        Placed<bf16> d_x = placed_bf16(x, offset), d_w = placed_bf16(w, offset), d_dout = placed_bf16(dout, offset);
        Placed<bf16> d_out(N * C, offset), d_dx(N * C, offset);
        Placed<float> d_rstd(N, offset), d_rstd_ref(rstd, offset), d_dweight(dweight, offset);
        cu::rmsnorm_forward(d_out.get(), d_rstd.get(), d_x.get(), d_w.get(), N, C, eps, stream.get());
        cu::rmsnorm_backward(ctx, d_dx.get(), d_dweight.get(), d_dout.get(), d_x.get(), d_w.get(), d_rstd_ref.get(), N,
                             C, stream.get());
        expect_close(values(d_out), out, kBf16Tol, what + " out");
        expect_close(values(d_rstd), rstd, kF32Tol, what + " rstd");
        expect_close(values(d_dx), dx, kBf16Tol, what + " dx");
        expect_close(values(d_dweight), want_dweight, kF32Tol, what + " dweight");
      }
    }
  }
}

// ---- gradient clipping on the device ------------------------------------------------------------

TEST(MemopsParity, MultiTensorSumSquaresMatchesTheReferenceAndRepeats) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  // More tensors than one launch takes; sizes around the chunk size; every third one misaligned.
  std::vector<int64_t> sizes = {0, 1, 3, 16383, 16384, 16385, 100003};
  for (int i = 0; i < 70; ++i) sizes.push_back(1 + 613 * i);
  std::vector<std::unique_ptr<Placed<float>>> buffers;
  std::vector<cu::NormTensor> table;
  double want = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    const std::vector<float> x = random_vector(sizes[t], 60 + t);
    want += ref::sum_squares(x.data(), sizes[t]);
    buffers.push_back(std::make_unique<Placed<float>>(x, t % 3 == 1 ? 1 : 0));
    table.push_back({buffers.back()->get(), sizes[t]});
  }
  DeviceBuffer<double> d_out(2);
  const int count = static_cast<int>(table.size());
  cu::multi_tensor_sum_squares(ctx, d_out.get(), table.data(), count, false, stream.get());
  cu::multi_tensor_sum_squares(ctx, d_out.get() + 1, table.data(), count, false, stream.get());
  cu::multi_tensor_sum_squares(ctx, d_out.get() + 1, table.data(), count, true, stream.get());  // twice the sum
  const std::vector<double> got = d_out.download<double>();
  EXPECT_TRUE(std::fabs(got[0] - want) <= 1e-10 * want) << "sum of squares " << got[0] << " vs " << want;
  // The second sum repeats the first bit for bit, so doubling it is exact.
  EXPECT_EQ(got[1], 2 * got[0]) << "a second run differs";

  // An empty table writes zero (or leaves the sum alone when accumulating).
  cu::multi_tensor_sum_squares(ctx, d_out.get(), nullptr, 0, false, stream.get());
  cu::multi_tensor_sum_squares(ctx, d_out.get() + 1, nullptr, 0, true, stream.get());
  const std::vector<double> empty = d_out.download<double>();
  EXPECT_EQ(empty[0], 0.0);
  EXPECT_EQ(empty[1], 2 * got[0]);
}

TEST(MemopsParity, ClipFactorIsTheHostCoefficientBitwise) {
  StreamGuard stream;
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (double max_norm : {0.0, 1.0, 0.37}) {
    for (double ss : {0.0, 1e-14, 0.1, 0.99999, 1.0, 3.7, 1e12, inf, nan}) {
      const std::string what = "max_norm=" + std::to_string(max_norm) + " sum_squares=" + std::to_string(ss);
      DeviceBuffer<double> d_ss(std::vector<double>{ss}), d_norm(1);
      DeviceBuffer<float> d_factor(1);
      cu::clip_factor(d_factor.get(), d_norm.get(), d_ss.get(), max_norm, stream.get());
      const float factor = d_factor.download<float>()[0];
      const double norm = d_norm.download<double>()[0];
      const double want_norm = std::sqrt(ss);
      EXPECT_EQ(std::memcmp(&norm, &want_norm, sizeof(double)), 0) << what << ": norm " << norm;
      if (std::isfinite(want_norm)) {
        const float want = kernels::clip_coefficient(want_norm, max_norm);
        EXPECT_EQ(std::memcmp(&factor, &want, sizeof(float)), 0) << what << ": factor " << factor << " vs " << want;
      } else {
        EXPECT_TRUE(std::isnan(factor)) << what << ": a non-finite norm gives factor " << factor;
      }
    }
  }
}

TEST(MemopsParity, AdamWWithTheDeviceFactorMatchesScaledGradientsBitwise) {
  StreamGuard stream;
  const std::vector<int64_t> sizes = {1, 7, 4097, 100000};
  for (float factor : {1.0f, 0.3137f, std::numeric_limits<float>::quiet_NaN()}) {
    const bool skip = std::isnan(factor);
    const std::string what = "factor=" + std::to_string(factor);
    DeviceBuffer<float> d_factor(std::vector<float>{factor});
    kernels::AdamWParams params;
    params.lr = 3e-4f;
    params.weight_decay = 0.1f;
    params.step = 3;
    std::vector<cu::AdamWTensor> list;
    std::vector<std::vector<float>> p, m, v;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> keep;
    for (size_t t = 0; t < sizes.size(); ++t) {
      const int64_t n = sizes[t];
      std::vector<float> g = random_vector(n, 70 + t, -0.1f, 0.1f);
      p.push_back(random_vector(n, 71 + t));
      m.push_back(random_vector(n, 72 + t, -0.01f, 0.01f));
      v.push_back(random_vector(n, 73 + t, 0.0f, 0.001f));
      for (auto* host : {&p.back(), &g, &m.back(), &v.back()})
        keep.push_back(std::make_unique<DeviceBuffer<float>>(*host));
      const size_t k = keep.size();
      list.push_back({keep[k - 4]->get(), keep[k - 3]->get(), keep[k - 2]->get(), keep[k - 1]->get(), nullptr, n});
      if (!skip) {  // the engine's host path: scale the gradients, then AdamW
        ref::scale_inplace(g.data(), n, factor);
        ref::adamw_step(p[t].data(), g.data(), m[t].data(), v[t].data(), n, params);
      }
    }
    cu::adamw_step(list.data(), static_cast<int>(list.size()), params, d_factor.get(), stream.get());
    for (size_t t = 0; t < sizes.size(); ++t) {
      const std::string tw = what + " tensor " + std::to_string(t);
      expect_same_bits(keep[4 * t]->download<float>(), p[t], tw + " param");
      expect_same_bits(keep[4 * t + 2]->download<float>(), m[t], tw + " m");
      expect_same_bits(keep[4 * t + 3]->download<float>(), v[t], tw + " v");
    }
  }
}

TEST(MemopsParity, CompactAdamWWithTheDeviceFactorMatchesTheCpuBitwise) {
  StreamGuard stream;
  using kernels::MomentFormat;
  const int64_t n = 1000;
  for (MomentFormat format : {MomentFormat::kF32, MomentFormat::kBf16, MomentFormat::kInt8}) {
    for (float factor : {0.25f, std::numeric_limits<float>::quiet_NaN()}) {
      const std::string what = std::string(kernels::moment_format_name(format)) + " factor=" + std::to_string(factor);
      std::vector<float> p = random_vector(n, 80), g = random_vector(n, 81, -1e-2f, 1e-2f);
      std::vector<float> m0 = random_vector(n, 82, -1e-3f, 1e-3f), v0 = random_vector(n, 83, 0.0f, 1e-6f);
      std::vector<uint8_t> m(kernels::moment_bytes(format, n)), v(kernels::moment_bytes(format, n));
      kernels::cpu::encode_moments(m.data(), m0.data(), format, false, n);
      kernels::cpu::encode_moments(v.data(), v0.data(), format, true, n);
      DeviceBuffer<float> dp(p), dg(g), d_factor(std::vector<float>{factor});
      DeviceBuffer<uint8_t> dm(m), dv(v);
      kernels::AdamWParams params;
      params.lr = 3e-4f;
      params.weight_decay = 0.1f;
      params.step = 2;
      const kernels::MomentRounding rounding{true, 99};
      if (!std::isnan(factor)) {
        kernels::cpu::scale_inplace(g.data(), n, factor);
        kernels::cpu::adamw_step_compact(p.data(), g.data(), m.data(), v.data(), format, n, params, rounding);
      }
      cu::adamw_step_compact(dp.get(), dg.get(), dm.get(), dv.get(), format, n, params, rounding, d_factor.get(),
                             stream.get());
      expect_same_bits(dp.download<float>(), p, what + " param");
      EXPECT_TRUE(dm.download<uint8_t>() == m) << what << " m";
      EXPECT_TRUE(dv.download<uint8_t>() == v) << what << " v";
    }
  }
}

}  // namespace
}  // namespace strata::testing
