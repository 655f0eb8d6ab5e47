// NF4 dequantisation on the GPU (kernels/cuda/nf4.h) against the CPU reference: bitwise the
// reference's fp32 values rounded to bf16, for lengths that end mid-block, mid-byte and past
// one scale block, with blocks whose absmax differ by orders of magnitude.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/nf4.h"
#include "kernels/nf4.h"

namespace strata::testing {
namespace {

TEST(Nf4Parity, DequantisedBf16IsTheReferenceRounded) {
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{64}, int64_t{129}, int64_t{64 * 256 + 1}, int64_t{64 * 1000 + 7}}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = normal(rng) * ((i / 64) % 7 == 0 ? 50.0f : 1.0f);
    const kernels::Nf4Layout l = kernels::nf4_layout(n);
    std::vector<uint8_t> q(l.bytes);
    kernels::nf4_quantize(x.data(), n, q.data());
    std::vector<float> want(static_cast<size_t>(n));
    kernels::nf4_dequantize(q.data(), n, want.data());

    uint8_t* dq = nullptr;
    bf16* dout = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dq), l.bytes));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dout), static_cast<size_t>(n) * sizeof(bf16)));
    CUDA_CHECK(cudaMemcpy(dq, q.data(), l.bytes, cudaMemcpyHostToDevice));
    kernels::cuda::nf4_dequantize_bf16(dout, dq, n, nullptr);
    std::vector<uint16_t> got(static_cast<size_t>(n));
    CUDA_CHECK(cudaMemcpy(got.data(), dout, got.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(dq));
    CUDA_CHECK(cudaFree(dout));
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[static_cast<size_t>(i)], bf16_bits(want[static_cast<size_t>(i)])) << "n " << n << " element " << i;
  }
}

}  // namespace
}  // namespace strata::testing
