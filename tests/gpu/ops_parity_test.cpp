// Backend parity: every op of the CUDA backend, forward and backward, over a grid of shapes
// (odd sizes included), against the CPU reference (kernels::ref) fed the same inputs. Inputs
// are rounded to bf16 before either side sees them, so only the computation differs.
//
// Tolerances (relative L2 error, ||gpu - ref|| / ||ref||; NaN or Inf fails):
//   kBf16Tol  outputs stored in bf16, and fp32 outputs computed from a bf16-rounded
//             intermediate (cross-entropy dweight: dlogits are bf16);
//   kF32Tol   fp32 outputs accumulated in fp32 from bf16 inputs (parameter gradients, rstd,
//             lse, losses);
//   exact     ops with one rounding per element (embedding forward, scale, AdamW).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/columns.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/ops.h"
#include "kernels/embedding.h"
#include "kernels/grad_norm.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace strata::testing {
namespace {

namespace ref = kernels::ref;
namespace cu = kernels::cuda;

constexpr double kBf16Tol = 1e-2;
constexpr double kF32Tol = 1e-5;
// Gradients whose exact value is zero (attention dq, dk at T = 1): fp32 cancellation leaves
// ~1e-6 on the GPU.
constexpr double kZeroGradAbsTol = 1e-3;

std::string shape(std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::string s;
  for (const auto& [name, value] : dims) {
    if (!s.empty()) s += " ";
    s += std::string(name) + "=" + std::to_string(value);
  }
  return s;
}

void expect_close(const std::vector<float>& gpu, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  const double err = relative_error(gpu, want);
  EXPECT_TRUE(err <= tol) << what << ": relative error " << err << " exceeds " << tol;
}

// Every element finite and at most `bound` in magnitude.
void expect_tiny(const std::vector<float>& gpu, double bound, const std::string& what) {
  double worst = 0;
  for (float x : gpu) worst = std::isfinite(x) ? std::max(worst, double(std::fabs(x))) : INFINITY;
  EXPECT_TRUE(worst <= bound) << what << ": max |value| " << worst << " exceeds " << bound;
}

void expect_equal(const std::vector<float>& gpu, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (!(std::memcmp(&gpu[i], &want[i], sizeof(float)) == 0)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at " << first << " ("
                           << (first >= 0 ? gpu[first] : 0) << " vs "
                           << (first >= 0 ? want[first] : 0) << ")";
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed, double masked = 0.0) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, V - 1);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = coin(rng) < masked ? -1 : static_cast<int32_t>(dist(rng));
  return t;
}

// ---- embedding ------------------------------------------------------------------------------

TEST(OpsParity, Embedding) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  for (int64_t N : {1, 7, 33, 1000}) {
    for (int64_t C : {64, 96, 257}) {
      const int64_t V = 50;  // small, so that tokens repeat
      const std::string what = "embedding " + shape({{"N", N}, {"C", C}, {"V", V}});
      std::vector<int32_t> tokens = random_tokens(N, V, 1 + N * C);
      std::vector<float> table = random_vector(V * C, 2 + N);
      std::vector<float> dout = random_vector(N * C, 3 + C);
      std::vector<float> dtable = random_vector(V * C, 4);  // accumulates into existing values
      DeviceBuffer<int32_t> d_tokens(tokens);
      DeviceBuffer<bf16> d_table = upload_bf16(table);
      DeviceBuffer<bf16> d_dout = upload_bf16(dout);
      DeviceBuffer<bf16> d_out(N * C);
      DeviceBuffer<float> d_dtable(dtable);

      cu::embedding_forward(d_out.get(), d_tokens.get(), d_table.get(), N, C, V, stream.get());
      cu::embedding_backward(ctx, d_dtable.get(), d_dout.get(), d_tokens.get(), N, C, V,
                             stream.get());
      std::vector<float> out(N * C);
      ref::embedding_forward(out.data(), tokens.data(), table.data(), N, C);
      ref::embedding_backward(dtable.data(), dout.data(), tokens.data(), N, C);
      expect_equal(download_bf16(d_out), out, what + " forward");
      expect_close(download_f32(d_dtable), dtable, kF32Tol, what + " dtable");
    }
  }
}

// ---- RMSNorm --------------------------------------------------------------------------------

TEST(OpsParity, RmsNorm) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  for (int64_t N : {1, 7, 33, 600}) {
    for (int64_t C : {64, 96, 257, 4096}) {
      const std::string what = "rmsnorm " + shape({{"N", N}, {"C", C}});
      const float eps = 1e-5f;
      std::vector<float> x = random_vector(N * C, 10 + N + C, -2.f, 2.f);
      std::vector<float> w = random_vector(C, 11, 0.5f, 1.5f);
      std::vector<float> dout = random_vector(N * C, 12 + N);
      std::vector<float> dweight = random_vector(C, 13);
      DeviceBuffer<bf16> d_x = upload_bf16(x), d_w = upload_bf16(w), d_dout = upload_bf16(dout);
      DeviceBuffer<bf16> d_out(N * C), d_dx(N * C);
      DeviceBuffer<float> d_rstd(N), d_dweight(dweight);

      std::vector<float> out(N * C), rstd(N), dx(N * C);
      ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
      cu::rmsnorm_forward(d_out.get(), d_rstd.get(), d_x.get(), d_w.get(), N, C, eps,
                          stream.get());
      expect_close(download_bf16(d_out), out, kBf16Tol, what + " out");
      expect_close(download_f32(d_rstd), rstd, kF32Tol, what + " rstd");

      // Backward from the reference's rstd on both sides.
      DeviceBuffer<float> d_rstd_ref(rstd);
      cu::rmsnorm_backward(ctx, d_dx.get(), d_dweight.get(), d_dout.get(), d_x.get(), d_w.get(),
                           d_rstd_ref.get(), N, C, stream.get());
      ref::rmsnorm_backward(dx.data(), dweight.data(), dout.data(), x.data(), w.data(),
                            rstd.data(), N, C);
      expect_close(download_bf16(d_dx), dx, kBf16Tol, what + " dx");
      expect_close(download_f32(d_dweight), dweight, kF32Tol, what + " dweight");
    }
  }
}

// ---- RoPE -----------------------------------------------------------------------------------

TEST(OpsParity, Rope) {
  StreamGuard stream;
  for (int64_t T : {1, 17, 128, 257}) {
    for (int64_t D : {64, 128}) {
      for (bool llama3 : {false, true}) {
        const int64_t B = 2, H = 3;
        const std::string what = "rope " + shape({{"T", T}, {"D", D}, {"llama3", llama3}});
        kernels::RopeConfig config;
        config.theta = 500000.0;
        config.scaling = llama3 ? kernels::RopeScaling::kLlama3 : kernels::RopeScaling::kNone;
        std::vector<float> inv_freq(D / 2);
        kernels::rope_inv_freq(inv_freq.data(), D, config);
        std::vector<float> x = random_vector(B * T * H * D, 20 + T + D);
        std::vector<float> dout = random_vector(B * T * H * D, 21 + T);
        DeviceBuffer<float> d_freq(inv_freq);
        DeviceBuffer<bf16> d_x = upload_bf16(x), d_dout = upload_bf16(dout);
        DeviceBuffer<bf16> d_out(x.size());

        std::vector<float> out(x.size()), dx(x.size());
        // The unscaled tables also rotate with a YaRN-style attention factor on cos and sin.
        const float scale = llama3 ? 1.0f : 1.2079441f;
        ref::rope_forward(out.data(), x.data(), inv_freq.data(), B, T, H, D, scale);
        ref::rope_backward(dx.data(), dout.data(), inv_freq.data(), B, T, H, D, scale);
        cu::rope_forward(d_out.get(), d_x.get(), d_freq.get(), B, T, H, D, scale, 0, stream.get());
        // Backward in place (dx aliases dout).
        cu::rope_backward(d_dout.get(), d_dout.get(), d_freq.get(), B, T, H, D, scale, stream.get());
        expect_close(download_bf16(d_out), out, kBf16Tol, what + " forward");
        expect_close(download_bf16(d_dout), dx, kBf16Tol, what + " backward (in place)");
      }
    }
  }
}

// ---- SwiGLU ---------------------------------------------------------------------------------

TEST(OpsParity, SwiGlu) {
  StreamGuard stream;
  for (int64_t n : {1, 7, 1000, 65537}) {
    const std::string what = "swiglu " + shape({{"n", n}});
    std::vector<float> gate = random_vector(n, 30 + n, -6.f, 6.f);
    std::vector<float> up = random_vector(n, 31 + n, -2.f, 2.f);
    std::vector<float> dout = random_vector(n, 32 + n);
    DeviceBuffer<bf16> d_gate = upload_bf16(gate), d_up = upload_bf16(up);
    DeviceBuffer<bf16> d_dout = upload_bf16(dout);
    DeviceBuffer<bf16> d_out(n), d_dgate(n), d_dup(n);
    std::vector<float> out(n), dgate(n), dup(n);
    ref::swiglu_forward(out.data(), gate.data(), up.data(), n);
    ref::swiglu_backward(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), n);
    cu::swiglu_forward(d_out.get(), d_gate.get(), d_up.get(), n, stream.get());
    cu::swiglu_backward(d_dgate.get(), d_dup.get(), d_dout.get(), d_gate.get(), d_up.get(), n,
                        stream.get());
    expect_close(download_bf16(d_out), out, kBf16Tol, what + " out");
    expect_close(download_bf16(d_dgate), dgate, kBf16Tol, what + " dgate");
    expect_close(download_bf16(d_dup), dup, kBf16Tol, what + " dup");
  }
}

// Latent attention's column ops (kernels/columns.h): the CUDA kernels give the CPU bf16 ops' bits.
TEST(OpsParity, ColumnCopiesAndHeadSums) {
  StreamGuard stream;
  const int64_t rows = 37, heads = 5, nope = 16, r = 8, D = nope + r;
  std::vector<float> x = random_vector(rows * heads * D, 91, -3.f, 3.f);
  for (float& v : x) v = kernels::to_f32(kernels::to_bf16(v));
  std::vector<kernels::Bf16> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = kernels::to_bf16(x[i]);
  DeviceBuffer<bf16> d_x = upload_bf16(x);
  for (int order = 0; order < 3; ++order) {
    const std::string what = "copy_columns order " + std::to_string(order);
    std::vector<kernels::Bf16> want(static_cast<size_t>(rows * heads * r));
    kernels::cpu::copy_columns(want.data(), r, xb.data() + nope, D, rows * heads, r,
                               static_cast<kernels::ColumnOrder>(order));
    DeviceBuffer<bf16> d_out(rows * heads * r);
    cu::copy_columns(d_out.get(), r, d_x.get() + nope, D, rows * heads, r, order, stream.get());
    std::vector<float> wantf(want.size());
    for (size_t i = 0; i < want.size(); ++i) wantf[i] = kernels::to_f32(want[i]);
    expect_equal(download_bf16(d_out), wantf, what);
  }
  std::vector<kernels::Bf16> want(static_cast<size_t>(rows * r));
  kernels::cpu::sum_head_columns(want.data(), xb.data() + nope, heads * D, D, rows, heads, r);
  DeviceBuffer<bf16> d_sum(rows * r);
  cu::sum_head_columns(d_sum.get(), d_x.get() + nope, heads * D, D, rows, heads, r, stream.get());
  std::vector<float> wantf(want.size());
  for (size_t i = 0; i < want.size(); ++i) wantf[i] = kernels::to_f32(want[i]);
  expect_equal(download_bf16(d_sum), wantf, "sum_head_columns");
}

// ---- linear ---------------------------------------------------------------------------------

TEST(OpsParity, Linear) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  struct Case {
    int64_t N, IC, OC;
  };
  for (const Case& c : {Case{1, 64, 96}, Case{7, 257, 33}, Case{33, 96, 257},
                        Case{128, 512, 384}, Case{1000, 64, 64}}) {
    for (bool with_bias : {false, true}) {
      const int64_t N = c.N, IC = c.IC, OC = c.OC;
      const std::string what =
          "linear " + shape({{"N", N}, {"IC", IC}, {"OC", OC}, {"bias", with_bias}});
      std::vector<float> x = random_vector(N * IC, 40 + N + IC);
      std::vector<float> w = random_vector(OC * IC, 41 + OC, -0.2f, 0.2f);
      std::vector<float> bias = random_vector(OC, 42);
      std::vector<float> dout = random_vector(N * OC, 43 + N);
      std::vector<float> dweight = random_vector(OC * IC, 44);
      std::vector<float> dbias = random_vector(OC, 45);
      DeviceBuffer<bf16> d_x = upload_bf16(x), d_w = upload_bf16(w), d_b = upload_bf16(bias);
      DeviceBuffer<bf16> d_dout = upload_bf16(dout);
      DeviceBuffer<bf16> d_out(N * OC), d_dx(N * IC);
      DeviceBuffer<float> d_dweight(dweight), d_dbias(dbias);

      std::vector<float> out(N * OC), dx(N * IC);
      ref::linear_forward(out.data(), x.data(), w.data(), with_bias ? bias.data() : nullptr, N,
                          IC, OC);
      ref::linear_backward(dx.data(), dweight.data(), with_bias ? dbias.data() : nullptr,
                           dout.data(), x.data(), w.data(), N, IC, OC);
      cu::linear_forward(ctx, d_out.get(), d_x.get(), d_w.get(), with_bias ? d_b.get() : nullptr,
                         N, IC, OC, stream.get());
      cu::linear_backward(ctx, d_dx.get(), d_dweight.get(), with_bias ? d_dbias.get() : nullptr,
                          d_dout.get(), d_x.get(), d_w.get(), N, IC, OC, stream.get());
      expect_close(download_bf16(d_out), out, kBf16Tol, what + " out");
      expect_close(download_bf16(d_dx), dx, kBf16Tol, what + " dx");
      expect_close(download_f32(d_dweight), dweight, kF32Tol, what + " dweight");
      if (with_bias) expect_close(download_f32(d_dbias), dbias, kF32Tol, what + " dbias");
    }
  }
}

// Row-major GEMM with every transpose combination against the CPU sgemm on the same values.
TEST(OpsParity, GemmTransposes) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  const int64_t M = 37, N = 53, K = 70;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const std::string what = "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
      std::vector<float> a = random_vector(M * K, 50), b = random_vector(K * N, 51);
      std::vector<float> c = random_vector(M * N, 52);
      DeviceBuffer<bf16> d_a = upload_bf16(a), d_b = upload_bf16(b);
      DeviceBuffer<float> d_c(c);
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      kernels::sgemm(ta, tb, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, c.data(), N);
      cu::gemm(ctx, ta, tb, M, N, K, 0.5f, d_a.get(), lda, d_b.get(), ldb, 1.0f, d_c.get(), N,
               /*c_is_fp32=*/true, nullptr, stream.get());
      expect_close(download_f32(d_c), c, kF32Tol, what);
    }
  }
}

// ---- attention ------------------------------------------------------------------------------

// Fills a device buffer with NaN (all bits set, in bf16 and fp32), so that an element a
// kernel fails to write fails the comparison instead of keeping an earlier run's value.
template <typename T>
void poison(DeviceBuffer<T>& buffer, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(buffer.get(), 0xFF, buffer.size() * sizeof(T), stream));
}

// Every shape runs with both tile sizes (32 and 64 rows; the launchers pick 64 where the
// device's opt-in shared memory allows, 32 on 99 KiB GPUs), each a variant the device can take,
// and with the launchers' own choice.
TEST(OpsParity, Attention) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const auto fits = [&](size_t need) { return need <= static_cast<size_t>(optin); };
  for (int64_t D : {64, 128}) {
    for (int tile : {32, 64}) {
      const size_t fwd = cu::attention_forward_shared_bytes(D, tile);
      const size_t bwd = cu::attention_backward_shared_bytes(D, tile);
      if (!fits(fwd) || !fits(bwd)) {
        std::printf("note: attention D=%lld tile=%d skipped for%s%s: needs %zu / %zu bytes of "
                    "shared memory per block, the device allows %d\n",
                    static_cast<long long>(D), tile, fits(fwd) ? "" : " forward",
                    fits(bwd) ? "" : " backward", fwd, bwd, optin);
      }
    }
  }
  struct Heads {
    int64_t Hq, Hkv;
  };
  for (int64_t T : {1, 17, 128, 257}) {
    for (int64_t D : {64, 128}) {
      for (const Heads& hh : {Heads{2, 2}, Heads{4, 2}, Heads{4, 1}}) {  // groups 1, 2, 4
        const int64_t B = 2, Hq = hh.Hq, Hkv = hh.Hkv;
        const std::string what = "attention " + shape({{"B", B}, {"T", T}, {"Hq", Hq},
                                                       {"Hkv", Hkv}, {"D", D}});
        const int64_t nq = B * T * Hq * D, nkv = B * T * Hkv * D;
        std::vector<float> q = random_vector(nq, 60 + T + D, -1.5f, 1.5f);
        std::vector<float> k = random_vector(nkv, 61 + T + Hq, -1.5f, 1.5f);
        std::vector<float> v = random_vector(nkv, 62 + T + Hkv);
        std::vector<float> dout = random_vector(nq, 63 + T);
        DeviceBuffer<bf16> d_q = upload_bf16(q), d_k = upload_bf16(k), d_v = upload_bf16(v);
        DeviceBuffer<bf16> d_dout = upload_bf16(dout);
        DeviceBuffer<bf16> d_out(nq), d_dq(nq), d_dk(nkv), d_dv(nkv);
        DeviceBuffer<float> d_lse(B * Hq * T);

        std::vector<float> out(nq), lse(B * Hq * T);
        ref::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, Hq,
                               Hkv, D);
        for (int tile : {0, 32, 64}) {  // 0: the launchers' own choice
          if (tile != 0 && !fits(cu::attention_forward_shared_bytes(D, tile))) continue;  // noted above
          const std::string at = what + " tile=" + (tile == 0 ? "auto" : std::to_string(tile));
          poison(d_out, stream.get());
          poison(d_lse, stream.get());
          cu::attention_forward(d_out.get(), d_lse.get(), d_q.get(), d_k.get(), d_v.get(), B, T,
                                Hq, Hkv, D, stream.get(), tile);
          expect_close(download_bf16(d_out), out, kBf16Tol, at + " out");
          expect_close(download_f32(d_lse), lse, kF32Tol, at + " lse");
        }

        // Backward from the reference's out and lse on both sides: upload_bf16 rounds `out` in
        // place, so the reference backward below reads the same bf16 values as the GPU.
        DeviceBuffer<bf16> d_out_ref = upload_bf16(out);
        DeviceBuffer<float> d_lse_ref(lse);
        std::vector<float> dq(nq), dk(nkv), dv(nkv);
        ref::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                v.data(), out.data(), lse.data(), B, T, Hq, Hkv, D);
        // Auto may pick different tiles for the dk/dv and dq kernels (A100, D=128), a mix no
        // forced tile gives.
        for (int tile : {0, 32, 64}) {
          if (tile != 0 && !fits(cu::attention_backward_shared_bytes(D, tile))) continue;  // noted above
          const std::string at = what + " tile=" + (tile == 0 ? "auto" : std::to_string(tile));
          poison(d_dq, stream.get());
          poison(d_dk, stream.get());
          poison(d_dv, stream.get());
          cu::attention_backward(ctx, d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(),
                                 d_q.get(), d_k.get(), d_v.get(), d_out_ref.get(),
                                 d_lse_ref.get(), B, T, Hq, Hkv, D, stream.get(), tile);
          if (T == 1) {
            // A softmax over one key has no gradient with respect to its score: the reference
            // dq and dk are exactly zero, while on the GPU dP - delta cancels only to fp32
            // rounding (the two dot products are summed in different orders), so a relative
            // error would divide by zero. Bound them absolutely; a wrong term gives values of
            // order 1.
            expect_tiny(download_bf16(d_dq), kZeroGradAbsTol, at + " dq");
            expect_tiny(download_bf16(d_dk), kZeroGradAbsTol, at + " dk");
          } else {
            expect_close(download_bf16(d_dq), dq, kBf16Tol, at + " dq");
            expect_close(download_bf16(d_dk), dk, kBf16Tol, at + " dk");
          }
          expect_close(download_bf16(d_dv), dv, kBf16Tol, at + " dv");
        }
      }
    }
  }
}

// ---- LM head + cross-entropy ----------------------------------------------------------------

// Document masks (data.packing: document): rows cut into documents of cycling lengths (long
// ones spanning tiles, single tokens, some starting mid-tile), positions restarting at each; the
// WMMA kernel and RoPE against the masked reference, the way CudaOps runs every document-masked
// batch (the cuDNN graphs take no masks).
std::vector<int32_t> document_positions(int64_t B, int64_t T) {
  const int64_t lengths[] = {37, 5, 1, 70, 20};
  std::vector<int32_t> positions;
  for (int64_t b = 0; b < B; ++b) {
    int64_t doc = 2 * b, pos = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (pos == lengths[doc % 5]) pos = 0, ++doc;
      positions.push_back(static_cast<int32_t>(pos++));
    }
  }
  return positions;
}

TEST(OpsParity, DocumentMaskedAttentionAndRope) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const auto fits = [&](size_t need) { return need <= static_cast<size_t>(optin); };
  for (int64_t T : {17, 128, 257}) {
    for (int64_t D : {64, 128}) {
      const int64_t B = 2, Hq = 4, Hkv = 2;
      const std::string what = "document-masked attention " + shape({{"T", T}, {"D", D}});
      std::vector<int32_t> positions = document_positions(B, T);
      DeviceBuffer<int32_t> d_pos(positions);
      const int64_t nq = B * T * Hq * D, nkv = B * T * Hkv * D;
      std::vector<float> q = random_vector(nq, 160 + T + D, -1.5f, 1.5f);
      std::vector<float> k = random_vector(nkv, 161 + T, -1.5f, 1.5f);
      std::vector<float> v = random_vector(nkv, 162 + T);
      std::vector<float> dout = random_vector(nq, 163 + T);
      DeviceBuffer<bf16> d_q = upload_bf16(q), d_k = upload_bf16(k), d_v = upload_bf16(v);
      DeviceBuffer<bf16> d_dout = upload_bf16(dout);
      DeviceBuffer<bf16> d_out(nq), d_dq(nq), d_dk(nkv), d_dv(nkv);
      DeviceBuffer<float> d_lse(B * Hq * T);

      std::vector<float> out(nq), lse(B * Hq * T);
      ref::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, Hq, Hkv, D, 0,
                             positions.data());
      for (int tile : {0, 32, 64}) {
        if (tile != 0 && !fits(cu::attention_forward_shared_bytes(D, tile))) continue;
        const std::string at = what + " tile=" + (tile == 0 ? "auto" : std::to_string(tile));
        poison(d_out, stream.get());
        poison(d_lse, stream.get());
        cu::attention_forward(d_out.get(), d_lse.get(), d_q.get(), d_k.get(), d_v.get(), B, T, Hq, Hkv, D,
                              stream.get(), tile, /*past=*/0, d_pos.get());
        expect_close(download_bf16(d_out), out, kBf16Tol, at + " out");
        expect_close(download_f32(d_lse), lse, kF32Tol, at + " lse");
      }
      DeviceBuffer<bf16> d_out_ref = upload_bf16(out);
      DeviceBuffer<float> d_lse_ref(lse);
      std::vector<float> dq(nq), dk(nkv), dv(nkv);
      ref::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                              out.data(), lse.data(), B, T, Hq, Hkv, D, positions.data());
      for (int tile : {0, 32, 64}) {
        if (tile != 0 && !fits(cu::attention_backward_shared_bytes(D, tile))) continue;
        const std::string at = what + " tile=" + (tile == 0 ? "auto" : std::to_string(tile));
        poison(d_dq, stream.get());
        poison(d_dk, stream.get());
        poison(d_dv, stream.get());
        cu::attention_backward(ctx, d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(), d_q.get(), d_k.get(),
                               d_v.get(), d_out_ref.get(), d_lse_ref.get(), B, T, Hq, Hkv, D, stream.get(), tile,
                               d_pos.get());
        // Single-token documents have exactly zero dq and dk in the reference (see Attention):
        // the relative error over the whole tensor is dominated by the other documents.
        expect_close(download_bf16(d_dq), dq, kBf16Tol, at + " dq");
        expect_close(download_bf16(d_dk), dk, kBf16Tol, at + " dk");
        expect_close(download_bf16(d_dv), dv, kBf16Tol, at + " dv");
      }

      // RoPE at the documents' positions.
      const int64_t H = 3;
      std::vector<float> inv_freq(D / 2);
      kernels::rope_inv_freq(inv_freq.data(), D, kernels::RopeConfig{});
      std::vector<float> x = random_vector(B * T * H * D, 170 + T), gx = random_vector(B * T * H * D, 171 + T);
      DeviceBuffer<float> d_freq(inv_freq);
      DeviceBuffer<bf16> d_x = upload_bf16(x), d_gx = upload_bf16(gx), d_rot(x.size());
      std::vector<float> rot(x.size()), grot(x.size());
      ref::rope_forward(rot.data(), x.data(), inv_freq.data(), B, T, H, D, 1.0f, 0, positions.data());
      ref::rope_backward(grot.data(), gx.data(), inv_freq.data(), B, T, H, D, 1.0f, 0, positions.data());
      cu::rope_forward(d_rot.get(), d_x.get(), d_freq.get(), B, T, H, D, 1.0f, 0, stream.get(), d_pos.get());
      cu::rope_backward(d_gx.get(), d_gx.get(), d_freq.get(), B, T, H, D, 1.0f, stream.get(), d_pos.get());
      expect_close(download_bf16(d_rot), rot, kBf16Tol, what + " rope forward");
      expect_close(download_bf16(d_gx), grot, kBf16Tol, what + " rope backward (in place)");
    }
  }
}

TEST(OpsParity, LmHeadCrossEntropy) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  for (int64_t N : {1, 7, 33, 100}) {
    for (int64_t C : {64, 96}) {
      for (int64_t V : {50, 257, 1000}) {
        for (int64_t chunk : {int64_t{1}, int64_t{16}, int64_t{5000}}) {
          const std::string what = "lm_head_cross_entropy " +
                                   shape({{"N", N}, {"C", C}, {"V", V}, {"chunk", chunk}});
          std::vector<float> x = random_vector(N * C, 70 + N + C);
          std::vector<float> w = random_vector(V * C, 71 + V);
          std::vector<int32_t> targets = random_tokens(N, V, 72 + N, /*masked=*/0.2);
          std::vector<float> dweight = random_vector(V * C, 73, -0.01f, 0.01f);
          const float grad_scale = 1.0f / static_cast<float>(N);
          DeviceBuffer<bf16> d_x = upload_bf16(x), d_w = upload_bf16(w);
          DeviceBuffer<int32_t> d_targets(targets);
          DeviceBuffer<float> d_losses(N), d_dweight(dweight);
          DeviceBuffer<bf16> d_dx(N * C);
          DeviceBuffer<double> d_sum(1);

          std::vector<float> dx(N * C);
          const double loss = ref::lm_head_cross_entropy(dx.data(), dweight.data(), x.data(),
                                                         w.data(), targets.data(), N, C, V,
                                                         grad_scale, chunk);
          cu::lm_head_cross_entropy(ctx, d_losses.get(), d_dx.get(), d_dweight.get(), d_x.get(),
                                    d_w.get(), d_targets.get(), N, C, V, grad_scale, chunk,
                                    stream.get());
          cu::sum(ctx, d_sum.get(), d_losses.get(), N, false, stream.get());
          const double gpu_loss = d_sum.download<double>()[0];
          EXPECT_TRUE(std::fabs(gpu_loss - loss) <= kF32Tol * std::max(1.0, std::fabs(loss)))
              << what << ": loss " << gpu_loss << " vs " << loss;
          expect_close(download_bf16(d_dx), dx, kBf16Tol, what + " dx");
          // dweight is fp32 but computed from bf16 dlogits.
          expect_close(download_f32(d_dweight), dweight, kBf16Tol, what + " dweight");
        }
      }
    }
  }
}

// ---- AdamW ----------------------------------------------------------------------------------

TEST(OpsParity, AdamWMatchesTheReferenceBitwise) {
  StreamGuard stream;
  // 40 tensors (more than one launch holds), one of them empty.
  std::vector<int64_t> sizes = {1, 7, 4097, 100000, 0};
  for (int i = 0; i < 35; ++i) sizes.push_back(1 + 37 * i);
  for (float beta1 : {0.9f, 0.3f}) {  // both of PyTorch's lerp formulas
    const std::string what = "adamw beta1=" + std::to_string(beta1);
    std::vector<std::vector<float>> p, g, m, v;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> dp, dg, dm, dv;
    std::vector<std::unique_ptr<DeviceBuffer<bf16>>> dbf;
    std::vector<cu::AdamWTensor> list;
    for (size_t t = 0; t < sizes.size(); ++t) {
      const int64_t n = sizes[t];
      p.push_back(random_vector(n, 80 + t));
      g.push_back(random_vector(n, 81 + t, -0.1f, 0.1f));
      m.push_back(random_vector(n, 82 + t, -0.01f, 0.01f));
      v.push_back(random_vector(n, 83 + t, 0.0f, 0.001f));
      dp.push_back(std::make_unique<DeviceBuffer<float>>(p.back()));
      dg.push_back(std::make_unique<DeviceBuffer<float>>(g.back()));
      dm.push_back(std::make_unique<DeviceBuffer<float>>(m.back()));
      dv.push_back(std::make_unique<DeviceBuffer<float>>(v.back()));
      dbf.push_back(std::make_unique<DeviceBuffer<bf16>>(n));
      list.push_back({dp.back()->get(), dg.back()->get(), dm.back()->get(), dv.back()->get(),
                      t % 2 == 0 ? dbf.back()->get() : nullptr, n});
    }
    for (int64_t step = 1; step <= 3; ++step) {
      kernels::AdamWParams params;
      params.lr = 3e-4f;
      params.beta1 = beta1;
      params.weight_decay = 0.1f;
      params.step = step;
      for (size_t t = 0; t < sizes.size(); ++t) {
        ref::adamw_step(p[t].data(), g[t].data(), m[t].data(), v[t].data(), sizes[t], params);
      }
      cu::adamw_step(list.data(), static_cast<int>(list.size()), params, stream.get());
    }
    for (size_t t = 0; t < sizes.size(); ++t) {
      const std::string tw = what + " tensor " + std::to_string(t);
      expect_equal(download_f32(*dp[t]), p[t], tw + " param");
      expect_equal(download_f32(*dm[t]), m[t], tw + " m");
      expect_equal(download_f32(*dv[t]), v[t], tw + " v");
      if (t % 2 == 0) {
        std::vector<float> rounded = p[t];
        round_to_bf16(rounded);
        expect_equal(download_bf16(*dbf[t]), rounded, tw + " bf16 copy");
      }
    }
  }
}

// ---- reductions -----------------------------------------------------------------------------

TEST(OpsParity, SumSquaresSumAndScale) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  for (int64_t n : {0, 1, 1000, 3000001}) {
    const std::string what = "reductions " + shape({{"n", n}});
    std::vector<float> x = random_vector(n, 90 + n);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<double> d_out(2);
    cu::sum_squares(ctx, d_out.get(), d_x.get(), n, false, stream.get());
    cu::sum_squares(ctx, d_out.get(), d_x.get(), n, true, stream.get());  // twice the value
    cu::sum(ctx, d_out.get() + 1, d_x.get(), n, false, stream.get());
    const std::vector<double> got = d_out.download<double>();
    const double ss = ref::sum_squares(x.data(), n);
    double s = 0;
    for (float xi : x) s += xi;
    EXPECT_TRUE(std::fabs(got[0] - 2 * ss) <= 1e-10 * std::max(1.0, 2 * ss))
        << what << ": sum_squares " << got[0] << " vs " << 2 * ss;
    EXPECT_TRUE(std::fabs(got[1] - s) <= 1e-10 * std::max(1.0, std::sqrt(ss)))
        << what << ": sum " << got[1] << " vs " << s;

    cu::scale_inplace(d_x.get(), n, 0.37f, stream.get());
    ref::scale_inplace(x.data(), n, 0.37f);
    expect_equal(download_f32(d_x), x, what + " scale");
  }
}

// ---- determinism ----------------------------------------------------------------------------

// The ops with reductions across rows give bitwise identical results on a second run.
TEST(OpsParity, BackwardReductionsAreBitwiseReproducible) {
  StreamGuard stream;
  TestContext ctx(64 << 20);
  const int64_t N = 4096, C = 256, V = 30, B = 2, T = 200, Hq = 4, Hkv = 2, D = 64;
  std::vector<int32_t> tokens = random_tokens(N, V, 100);
  std::vector<float> g = random_vector(N * C, 101), x = random_vector(N * C, 102);
  std::vector<float> w = random_vector(C, 103);
  std::vector<float> qkv = random_vector(B * T * Hq * D, 104);
  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<bf16> d_g = upload_bf16(g), d_x = upload_bf16(x), d_w = upload_bf16(w);
  DeviceBuffer<bf16> d_q = upload_bf16(qkv), d_dx(N * C), d_out(B * T * Hq * D);
  DeviceBuffer<bf16> d_dq(B * T * Hq * D), d_dk(B * T * Hkv * D), d_dv(B * T * Hkv * D);
  DeviceBuffer<float> d_rstd(N), d_lse(B * Hq * T);
  cu::rmsnorm_forward(d_dx.get(), d_rstd.get(), d_x.get(), d_w.get(), N, C, 1e-5f, stream.get());
  cu::attention_forward(d_out.get(), d_lse.get(), d_q.get(), d_q.get(), d_q.get(), B, T, Hq,
                        Hkv, D, stream.get());
  auto run = [&] {
    DeviceBuffer<float> d_dtable(V * C), d_dweight(C);
    CUDA_CHECK(cudaMemsetAsync(d_dtable.get(), 0, V * C * sizeof(float), stream.get()));
    CUDA_CHECK(cudaMemsetAsync(d_dweight.get(), 0, C * sizeof(float), stream.get()));
    cu::embedding_backward(ctx, d_dtable.get(), d_g.get(), d_tokens.get(), N, C, V,
                           stream.get());
    cu::rmsnorm_backward(ctx, d_dx.get(), d_dweight.get(), d_g.get(), d_x.get(), d_w.get(),
                         d_rstd.get(), N, C, stream.get());
    cu::attention_backward(ctx, d_dq.get(), d_dk.get(), d_dv.get(), d_q.get(), d_q.get(),
                           d_q.get(), d_q.get(), d_out.get(), d_lse.get(), B, T, Hq, Hkv, D,
                           stream.get());
    std::vector<float> all = download_f32(d_dtable);
    for (const auto* buf : {&d_dweight}) {
      std::vector<float> part = download_f32(*buf);
      all.insert(all.end(), part.begin(), part.end());
    }
    for (const auto* buf : {&d_dx, &d_dq, &d_dk, &d_dv}) {
      std::vector<float> part = download_bf16(*buf);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  };
  const std::vector<float> first = run();
  expect_equal(run(), first, "second run");
}

}  // namespace
}  // namespace strata::testing
