// The cuBLASLt GEMM's plans cached per shape in the Context (kernels/cuda/lt_plan.h): a
// repeated shape builds no new plan and gives the same bits, interleaved shapes each build one
// plan and compute what a fresh Context computes, per-call pointers (bias) are not frozen into
// a plan, pointer alignment picks its own plan, and the residual form of the linear layer
// (cuBLASLt's separate C) matches the reference and leaves the residual unchanged.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/linear.h"

namespace strata::testing {
namespace {

namespace cu = kernels::cuda;

constexpr double kBf16Tol = 1e-2;
constexpr double kF32Tol = 1e-5;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One GEMM shape with its inputs on the device; run() restores C first, so every run computes
// the same thing.
struct GemmCase {
  bool ta, tb, c_fp32, with_bias;
  int64_t M, N, K;
  std::vector<float> a, b, c0, bias;
  DeviceBuffer<bf16> d_a, d_b, d_bias;
  DeviceBuffer<float> d_c32;
  DeviceBuffer<bf16> d_c16;

  GemmCase(bool ta_, bool tb_, bool c_fp32_, bool with_bias_, int64_t M_, int64_t N_, int64_t K_, uint64_t seed)
      : ta(ta_), tb(tb_), c_fp32(c_fp32_), with_bias(with_bias_), M(M_), N(N_), K(K_),
        a(random_vector(M_ * K_, seed)), b(random_vector(K_ * N_, seed + 1)), c0(random_vector(M_ * N_, seed + 2)),
        bias(random_vector(N_, seed + 3)), d_a(upload_bf16(a)), d_b(upload_bf16(b)), d_bias(upload_bf16(bias)),
        d_c32(c0), d_c16(M_ * N_) {}

  std::string name() const {
    return "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
           " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " c_fp32=" + std::to_string(c_fp32) +
           " bias=" + std::to_string(with_bias);
  }

  // C = op(A) @ op(B) + bias (beta 0), or C = 0.5 op(A) @ op(B) + C (beta 1) without bias.
  std::vector<float> run(cu::Context& ctx, cudaStream_t stream) {
    d_c32.upload(c0);
    std::vector<float> c16 = c0;
    d_c16.upload(round_to_bf16(c16));
    const float alpha = with_bias ? 1.0f : 0.5f, beta = with_bias ? 0.0f : 1.0f;
    void* C = c_fp32 ? static_cast<void*>(d_c32.get()) : static_cast<void*>(d_c16.get());
    cu::gemm(ctx, ta, tb, M, N, K, alpha, d_a.get(), ta ? M : K, d_b.get(), tb ? K : N, beta, C, N, c_fp32,
             with_bias ? d_bias.get() : nullptr, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return c_fp32 ? download_f32(d_c32) : download_bf16(d_c16);
  }

  std::vector<float> reference() const {
    std::vector<float> c = c0;
    if (!c_fp32) round_to_bf16(c);
    if (with_bias) {
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) c[i * N + j] = bias[j];
    }
    kernels::sgemm(ta, tb, M, N, K, with_bias ? 1.0f : 0.5f, a.data(), ta ? M : K, b.data(), tb ? K : N,
                   1.0f, c.data(), N);
    return c;
  }
};

TEST(GemmPlans, ARepeatedShapeBuildsOnePlanAndGivesIdenticalBits) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  GemmCase g(false, true, /*c_fp32=*/true, /*bias=*/false, 96, 160, 200, 1);
  EXPECT_EQ(ctx.gemm_plans().built(), 0);
  const std::vector<float> first = g.run(ctx, stream.get());
  EXPECT_EQ(ctx.gemm_plans().built(), 1);
  const std::vector<float> second = g.run(ctx, stream.get());
  EXPECT_EQ(ctx.gemm_plans().built(), 1);
  EXPECT_TRUE(same_bits(first, second)) << g.name();
  const double err = relative_error(first, g.reference());
  EXPECT_TRUE(err <= kF32Tol) << g.name() << ": relative error " << err;
}

TEST(GemmPlans, InterleavedShapesEachBuildOnePlanAndComputeWhatAFreshContextComputes) {
  StreamGuard stream;
  std::vector<std::unique_ptr<GemmCase>> cases;
  cases.push_back(std::make_unique<GemmCase>(false, true, false, true, 33, 96, 64, 10));    // forward with bias
  cases.push_back(std::make_unique<GemmCase>(false, false, false, false, 33, 64, 96, 20));  // data gradient
  cases.push_back(std::make_unique<GemmCase>(true, false, true, false, 96, 64, 33, 30));    // weight gradient
  cases.push_back(std::make_unique<GemmCase>(false, true, true, false, 33, 96, 64, 40));    // case 0 in fp32
  // Each shape alone, in its own Context: the bits the cached path must reproduce.
  std::vector<std::vector<float>> alone;
  for (auto& g : cases) {
    TestContext fresh(1 << 20);
    alone.push_back(g->run(fresh, stream.get()));
    EXPECT_EQ(fresh.gemm_plans().built(), 1);
    const double err = relative_error(alone.back(), g->reference());
    EXPECT_TRUE(err <= (g->c_fp32 ? kF32Tol : kBf16Tol)) << g->name() << ": relative error " << err;
  }
  TestContext ctx(1 << 20);
  for (int i : {0, 1, 0, 2, 1, 3, 0, 2, 3, 3, 1}) {
    const std::vector<float> got = cases[i]->run(ctx, stream.get());
    EXPECT_TRUE(same_bits(got, alone[i])) << cases[i]->name();
  }
  EXPECT_EQ(ctx.gemm_plans().built(), 4);
  EXPECT_EQ(ctx.gemm_plans().size(), 4u);
}

// The bias pointer is an attribute of the cached descriptor: every call sets its own.
TEST(GemmPlans, EachCallAddsItsOwnBias) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  const int64_t M = 17, N = 64, K = 48;
  std::vector<float> a = random_vector(M * K, 50), b = random_vector(N * K, 51);
  std::vector<float> bias1 = random_vector(N, 52), bias2 = random_vector(N, 53);
  DeviceBuffer<bf16> d_a = upload_bf16(a), d_b = upload_bf16(b), d_bias1 = upload_bf16(bias1),
                     d_bias2 = upload_bf16(bias2);
  DeviceBuffer<float> d_c(M * N);
  for (const auto& [d_bias, bias] : {std::pair{&d_bias1, &bias1}, std::pair{&d_bias2, &bias2}, std::pair{&d_bias1, &bias1}}) {
    cu::gemm(ctx, false, true, M, N, K, 1.0f, d_a.get(), K, d_b.get(), K, 0.0f, d_c.get(), N, true, d_bias->get(),
             stream.get());
    std::vector<float> want(M * N);
    kernels::ref::linear_forward(want.data(), a.data(), b.data(), bias->data(), M, K, N);
    const double err = relative_error(download_f32(d_c), want);
    EXPECT_TRUE(err <= kF32Tol) << "relative error " << err;
  }
  // Both biases are cudaMalloc'd (256-byte aligned): one plan serves them.
  EXPECT_EQ(ctx.gemm_plans().built(), 1);
}

// cuBLASLt may assume the alignment the plan was searched with: a less aligned operand gets a
// plan of its own (and the right result).
TEST(GemmPlans, ALessAlignedOperandGetsItsOwnPlan) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  const int64_t M = 16, N = 32, K = 64;
  std::vector<float> a = random_vector(M * K + 1, 60), b = random_vector(K * N, 61);
  DeviceBuffer<bf16> d_a = upload_bf16(a), d_b = upload_bf16(b);
  DeviceBuffer<float> d_c(M * N);
  for (int64_t shift : {0, 1}) {  // elements: 0 or 2 bytes off the allocation's 256-byte alignment
    cu::gemm(ctx, false, false, M, N, K, 1.0f, d_a.get() + shift, K, d_b.get(), N, 0.0f, d_c.get(), N, true,
             nullptr, stream.get());
    std::vector<float> want(M * N, 0.0f);
    kernels::sgemm(false, false, M, N, K, 1.0f, a.data() + shift, K, b.data(), N, 0.0f, want.data(), N);
    const double err = relative_error(download_f32(d_c), want);
    EXPECT_TRUE(err <= kF32Tol) << "shift " << shift << ": relative error " << err;
  }
  EXPECT_EQ(ctx.gemm_plans().built(), 2);
}

// out = x @ W^T + residual in one GEMM (residual as cuBLASLt's C, out as its D).
TEST(GemmPlans, LinearForwardResidualMatchesTheReferenceAndKeepsTheResidual) {
  StreamGuard stream;
  TestContext ctx(1 << 20);
  for (const auto& [N, IC, OC] : {std::tuple{int64_t{7}, int64_t{64}, int64_t{96}},
                                  std::tuple{int64_t{128}, int64_t{256}, int64_t{128}}}) {
    std::vector<float> x = random_vector(N * IC, 70), w = random_vector(OC * IC, 71, -0.2f, 0.2f);
    std::vector<float> r = random_vector(N * OC, 72);
    DeviceBuffer<bf16> d_x = upload_bf16(x), d_w = upload_bf16(w), d_r = upload_bf16(r), d_out(N * OC);
    cu::linear_forward_residual(ctx, d_out.get(), d_x.get(), d_w.get(), d_r.get(), N, IC, OC, stream.get());
    CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    std::vector<float> want(N * OC);
    kernels::ref::linear_forward(want.data(), x.data(), w.data(), nullptr, N, IC, OC);
    for (size_t i = 0; i < want.size(); ++i) want[i] += r[i];
    const double err = relative_error(download_bf16(d_out), want);
    EXPECT_TRUE(err <= kBf16Tol) << "N=" << N << ": relative error " << err;
    EXPECT_TRUE(same_bits(download_bf16(d_r), r)) << "N=" << N << ": the residual changed";
  }
}

}  // namespace
}  // namespace strata::testing
