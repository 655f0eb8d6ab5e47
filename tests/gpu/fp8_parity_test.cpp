// FP8 parity: the CUDA quantisers give bitwise the codes and scales of kernels::cpu::quantize_*
// (same inputs: bf16 activations are rounded on the host before either side sees them), and the
// cuBLASLt block-scaled GEMM matches ref::fp8_gemm_nt on the same codes and scales.
//
// GEMM bound. Products of E4M3 codes are exact, but cuBLASLt adds them inside a 128-block in its
// own order, with the tensor cores' accumulator (not IEEE fp32 adds in order of k), before the
// block's partial sum is scaled and promoted to fp32 (Hopper's FP8 accumulator keeps about 14
// bits, DeepSeek-V3 report). Per element we allow
//   |gpu - ref| <= 2^-10 * ||a_m|| * ||b_n||  (+ 2^-8 |ref| when C is bf16: its rounding),
// over the dequantised rows (Cauchy-Schwarz bounds sum_k |a_k b_k| by the norms; 2^-10 leaves
// a margin of 16 over a 14-bit accumulator), and a relative L2 error of 1e-3 (fp32 C) / 4e-3
// (bf16 C). A scale read from the wrong place is off by a power of two for a whole block, which is
// far outside both: the inputs are built with magnitudes that change from row to row and from
// K block to K block, so that every block has its own scale.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/cpu/backend.h"
#include "kernels/cuda/fp8.h"
#include "kernels/fp8.h"

namespace strata::testing {
namespace {

namespace cu = kernels::cuda;
namespace cpu = kernels::cpu;
namespace ref = kernels::ref;
using kernels::fp8_blocks;

std::string dims(int64_t a, int64_t b, int64_t c = -1) {
  std::string s = std::to_string(a) + "x" + std::to_string(b);
  return c < 0 ? s : s + "x" + std::to_string(c);
}

// Normal values whose magnitude is 2^((r % 7) - 3 + (r / 128) % 3) * 2^((c / 128 * 3) % 5 - 2)
// at (r, c), so that neighbouring rows and neighbouring 128-blocks (along both dimensions) get
// different power-of-two scales.
std::vector<float> graded(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int e = static_cast<int>(r % 7) - 3 + static_cast<int>((r / 128) % 3) +
                    static_cast<int>((c / 128 * 3) % 5) - 2;
      v[r * cols + c] = std::ldexp(normal(rng), e);
    }
  }
  return v;
}

// `graded` plus the edge cases of the spec: an all-zero block, blocks of huge and of tiny
// (subnormal) values, a block with one huge outlier, infinities, NaNs and signed zeros.
std::vector<float> with_specials(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> v = graded(rows, cols, seed);
  auto at = [&](int64_t r, int64_t c) -> float* { return r < rows && c < cols ? &v[r * cols + c] : nullptr; };
  const float kMax = std::numeric_limits<float>::max();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t rb = r / 128, cb = c / 128;
      if ((rb + cb) % 5 == 1) v[r * cols + c] = 0.0f;                       // all-zero block
      if ((rb + cb) % 5 == 2) v[r * cols + c] *= 1e36f;                     // huge
      if ((rb + cb) % 5 == 3) v[r * cols + c] *= 1e-40f;                    // subnormal or zero
      if ((rb + cb) % 5 == 4 && (r + c) % 97 == 0) v[r * cols + c] = 3e5f;  // outlier
    }
  }
  if (float* p = at(0, 1)) *p = std::numeric_limits<float>::infinity();
  if (float* p = at(0, 2)) *p = -std::numeric_limits<float>::infinity();
  if (float* p = at(1, 3)) *p = std::numeric_limits<float>::quiet_NaN();
  if (float* p = at(1, 4)) *p = -std::numeric_limits<float>::quiet_NaN();
  if (float* p = at(2, 5)) *p = -0.0f;
  if (float* p = at(2, 6)) *p = kMax;
  if (float* p = at(3, 7)) *p = -kMax;
  if (float* p = at(rows - 1, cols - 1)) *p = 1e-45f;  // the smallest subnormal
  return v;
}

template <typename T>
void expect_bitwise(const std::vector<T>& gpu, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (std::memcmp(&gpu[i], &want[i], sizeof(T)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at " << first << " (" << (first >= 0 ? double(gpu[first]) : 0.0)
                           << " vs " << (first >= 0 ? double(want[first]) : 0.0) << ")";
}

struct Shape {
  int64_t rows, cols;
};
const Shape kQuantShapes[] = {{1, 1}, {3, 130}, {128, 128}, {129, 127}, {257, 385}, {300, 1024}, {1024, 260}};

TEST(Fp8Parity, QuantizeRowsMatchesTheCpuBitwise) {
  StreamGuard stream;
  for (const Shape& s : kQuantShapes) {
    const int64_t rows = s.rows, cols = s.cols, L = fp8_blocks(cols);
    std::vector<float> x = with_specials(rows, cols, 10 + rows);
    std::vector<uint8_t> codes(rows * cols);
    std::vector<float> scales(rows * L);
    // fp32 input.
    cpu::quantize_rows_e4m3(codes.data(), scales.data(), x.data(), rows, cols);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<uint8_t> d_codes(rows * cols);
    DeviceBuffer<float> d_scales(rows * L);
    cu::quantize_rows_e4m3(d_codes.get(), d_scales.get(), d_x.get(), rows, cols, stream.get());
    expect_bitwise(d_codes.download<uint8_t>(), codes, "rows fp32 codes " + dims(rows, cols));
    expect_bitwise(d_scales.download<float>(), scales, "rows fp32 scales " + dims(rows, cols));
    // bf16 input (x is rounded in place, so the CPU sees the GPU's values).
    DeviceBuffer<bf16> d_xb = upload_bf16(x);
    cpu::quantize_rows_e4m3(codes.data(), scales.data(), x.data(), rows, cols);
    cu::quantize_rows_e4m3(d_codes.get(), d_scales.get(), d_xb.get(), rows, cols, stream.get());
    expect_bitwise(d_codes.download<uint8_t>(), codes, "rows bf16 codes " + dims(rows, cols));
    expect_bitwise(d_scales.download<float>(), scales, "rows bf16 scales " + dims(rows, cols));
  }
}

TEST(Fp8Parity, QuantizeColsMatchesTheCpuBitwise) {
  StreamGuard stream;
  for (const Shape& s : kQuantShapes) {
    const int64_t rows = s.rows, cols = s.cols, L = fp8_blocks(rows);
    std::vector<float> x = with_specials(rows, cols, 20 + cols);
    std::vector<uint8_t> codes(rows * cols);
    std::vector<float> scales(L * cols);
    cpu::quantize_cols_e4m3(codes.data(), scales.data(), x.data(), rows, cols);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<uint8_t> d_codes(rows * cols);
    DeviceBuffer<float> d_scales(L * cols);
    cu::quantize_cols_e4m3(d_codes.get(), d_scales.get(), d_x.get(), rows, cols, stream.get());
    expect_bitwise(d_codes.download<uint8_t>(), codes, "cols fp32 codes " + dims(rows, cols));
    expect_bitwise(d_scales.download<float>(), scales, "cols fp32 scales " + dims(rows, cols));
    DeviceBuffer<bf16> d_xb = upload_bf16(x);
    cpu::quantize_cols_e4m3(codes.data(), scales.data(), x.data(), rows, cols);
    cu::quantize_cols_e4m3(d_codes.get(), d_scales.get(), d_xb.get(), rows, cols, stream.get());
    expect_bitwise(d_codes.download<uint8_t>(), codes, "cols bf16 codes " + dims(rows, cols));
    expect_bitwise(d_scales.download<float>(), scales, "cols bf16 scales " + dims(rows, cols));
  }
}

TEST(Fp8Parity, QuantizeWeightMatchesTheCpuBitwise) {
  StreamGuard stream;
  for (const Shape& s : kQuantShapes) {
    const int64_t rows = s.rows, cols = s.cols;
    const std::vector<float> w = with_specials(rows, cols, 30 + rows * cols);
    const size_t bytes = kernels::fp8_matrix_bytes(rows, cols);
    std::vector<uint8_t> want(bytes, 0xAB);  // the padding must be written as zeros on both sides
    cpu::quantize_weight_e4m3(want.data(), w.data(), rows, cols);
    DeviceBuffer<float> d_w(w);
    DeviceBuffer<uint8_t> d_out(bytes);
    CUDA_CHECK(cudaMemsetAsync(d_out.get(), 0xAB, bytes, stream.get()));  // ordered before the kernel
    cu::quantize_weight_e4m3(d_out.get(), d_w.get(), rows, cols, stream.get());
    expect_bitwise(d_out.download<uint8_t>(), want, "weight " + dims(rows, cols));
  }
}

// The scale repacking kernels against their definition (fp8_scales.cu).
TEST(Fp8Parity, ScaleLayoutsForCublasLt) {
  StreamGuard stream;
  for (const Shape& s : {Shape{1, 1}, Shape{37, 5}, Shape{256, 32}, Shape{1000, 33}}) {
    const int64_t outer = s.rows, L = s.cols, L4 = (L + 3) / 4 * 4;
    std::vector<float> in(outer * L);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) + 0.5f;
    DeviceBuffer<float> d_in(in), d_t(outer * L), d_p(outer * L4);
    cu::fp8_tile_scales_k_major(d_t.get(), d_in.get(), outer, L, stream.get());
    cu::fp8_block_scales_padded(d_p.get(), d_in.get(), outer, L, stream.get());
    std::vector<float> t(outer * L), p(outer * L4, 0.0f);
    for (int64_t r = 0; r < outer; ++r) {
      for (int64_t kb = 0; kb < L; ++kb) {
        t[kb * outer + r] = in[r * L + kb];
        p[r * L4 + kb] = in[r * L + kb];
      }
    }
    expect_bitwise(d_t.download<float>(), t, "k-major " + dims(outer, L));
    expect_bitwise(d_p.download<float>(), p, "padded " + dims(outer, L));
  }
}

// ---- GEMM -----------------------------------------------------------------------------------------

std::vector<float> dequantize(const std::vector<uint8_t>& codes, const float* scales, int64_t rows, int64_t cols,
                              bool blocks) {
  const int64_t L = fp8_blocks(cols);
  std::vector<float> v(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = blocks ? scales[(r / 128) * L + c / 128] : scales[r * L + c / 128];
      v[r * cols + c] = kernels::e4m3_to_f32(codes[r * cols + c]) * s;
    }
  }
  return v;
}

std::vector<double> row_norms(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<double> norms(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c) s += double(v[r * cols + c]) * v[r * cols + c];
    norms[r] = std::sqrt(s);
  }
  return norms;
}

bool has_block_scaled_fp8() {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop.major == 9;  // the kernels are built for sm_90a; block-scaled FP8 GEMMs are Hopper's
}

TEST(Fp8Parity, GemmMatchesTheReferenceWithinTheBound) {
  if (!has_block_scaled_fp8()) GTEST_SKIP() << "cuBLASLt FP8 block scaling as built here needs sm_90";
  StreamGuard stream;
  TestContext ctx(64 << 20);
  struct Case {
    int64_t M, N, K;
  };
  // (128, 272, 640): fp8_blocks(K) = 5, so 128x128 block scales are padded to 8 per row, and N
  // ends in a partial block. (144, 272, 656) and (16, 48, 400): K ends in a short block (and M,
  // N in partial ones). (512, 384, 2048): model-like, small enough for the CPU reference.
  for (const Case& g : {Case{256, 384, 512}, Case{128, 272, 640}, Case{144, 272, 656}, Case{16, 48, 400},
                        Case{512, 384, 2048}}) {
    const int64_t M = g.M, N = g.N, K = g.K, L = fp8_blocks(K);
    std::vector<float> a = graded(M, K, 40 + M);
    std::vector<float> b = graded(N, K, 41 + N);
    DeviceBuffer<bf16> d_a = upload_bf16(a);
    DeviceBuffer<float> d_b(b);
    DeviceBuffer<uint8_t> d_a_codes(M * K);
    DeviceBuffer<float> d_a_scales(M * L);
    cu::quantize_rows_e4m3(d_a_codes.get(), d_a_scales.get(), d_a.get(), M, K, stream.get());
    const std::vector<uint8_t> a_codes = d_a_codes.download<uint8_t>();
    const std::vector<float> a_scales = d_a_scales.download<float>();
    const std::vector<double> a_norm = row_norms(dequantize(a_codes, a_scales.data(), M, K, false), M, K);

    for (bool b_blocks : {true, false}) {
      // B as a stored weight (128 x 128 blocks) or in 1 x 128 tiles.
      const size_t stored = kernels::fp8_matrix_bytes(N, K);
      DeviceBuffer<uint8_t> d_b_store(b_blocks ? stored : size_t(N * K));
      DeviceBuffer<float> d_b_tiles(b_blocks ? 1 : N * L);
      const uint8_t* b_codes_ptr = d_b_store.get();
      const float* b_scales_ptr = d_b_tiles.get();
      std::vector<uint8_t> b_codes(N * K);
      std::vector<float> b_scales;
      if (b_blocks) {
        cu::quantize_weight_e4m3(d_b_store.get(), d_b.get(), N, K, stream.get());
        const std::vector<uint8_t> all = d_b_store.download<uint8_t>();
        const uint64_t offset = kernels::fp8_matrix_scale_offset(N, K);
        std::memcpy(b_codes.data(), all.data(), N * K);
        b_scales.resize(fp8_blocks(N) * L);
        std::memcpy(b_scales.data(), all.data() + offset, b_scales.size() * sizeof(float));
        b_scales_ptr = reinterpret_cast<const float*>(d_b_store.get() + offset);
      } else {
        cu::quantize_rows_e4m3(d_b_store.get(), d_b_tiles.get(), d_b.get(), N, K, stream.get());
        b_codes = d_b_store.download<uint8_t>();
        b_scales = d_b_tiles.download<float>();
      }
      const std::vector<float> b_deq = dequantize(b_codes, b_scales.data(), N, K, b_blocks);

      std::vector<float> want(M * N);
      ref::fp8_gemm_nt(want.data(), a_codes.data(), a_scales.data(), b_codes.data(), b_scales.data(), b_blocks, M, N,
                       K);
      const std::vector<double> b_norm = row_norms(b_deq, N, K);

      for (bool c_bf16 : {false, true}) {
        for (float beta : {0.0f, 1.0f}) {
          if (beta != 0.0f && (c_bf16 || M > 256)) continue;  // accumulation: fp32 C, one small shape
          const std::string what = "fp8_gemm_nt " + dims(M, N, K) + (b_blocks ? " blocks" : " tiles") +
                                   (c_bf16 ? " bf16" : " fp32") + " beta=" + std::to_string(int(beta));
          std::vector<float> c0 = beta != 0.0f ? graded(M, N, 50) : std::vector<float>(M * N, NAN);
          std::vector<float> expect = want;
          if (beta != 0.0f) {
            for (size_t i = 0; i < expect.size(); ++i) expect[i] += c0[i];
          }
          std::vector<float> got;
          if (c_bf16) {
            DeviceBuffer<bf16> d_c = upload_bf16(c0);
            cu::fp8_gemm_nt(ctx, d_c.get(), true, d_a_codes.get(), d_a_scales.get(), b_codes_ptr, b_scales_ptr,
                            b_blocks, M, N, K, beta, stream.get());
            got = download_bf16(d_c);
          } else {
            DeviceBuffer<float> d_c(c0);
            cu::fp8_gemm_nt(ctx, d_c.get(), false, d_a_codes.get(), d_a_scales.get(), b_codes_ptr, b_scales_ptr,
                            b_blocks, M, N, K, beta, stream.get());
            got = download_f32(d_c);
          }
          double worst = 0;
          int64_t worst_at = 0;
          for (int64_t i = 0; i < M * N; ++i) {
            const double bound = std::ldexp(a_norm[i / N] * b_norm[i % N], -10) +
                                 (c_bf16 ? std::ldexp(std::fabs(double(expect[i])), -8) : 0.0) + 1e-30;
            const double e = std::fabs(double(got[i]) - double(expect[i])) / bound;
            if (!(e <= worst)) {
              worst = std::isfinite(e) ? e : INFINITY;
              worst_at = i;
            }
          }
          EXPECT_TRUE(worst <= 1.0) << what << ": element " << worst_at << " is " << got[worst_at] << " vs "
                                    << expect[worst_at] << ", " << worst << " times the bound";
          const double rel = relative_error(got, expect);
          EXPECT_TRUE(rel <= (c_bf16 ? 4e-3 : 1e-3)) << what << ": relative L2 error " << rel;
        }
      }
    }
  }
}

// ---- the fp8 recipe's linear layers ------------------------------------------------------------

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

TEST(Fp8Parity, TransposedColumnQuantizerIsTheCpusTransposed) {
  StreamGuard stream;
  for (const Shape& s : {Shape{1, 16}, Shape{3, 33}, Shape{129, 48}, Shape{300, 1024}, Shape{1024, 260}}) {
    const int64_t rows = s.rows, cols = s.cols, L = fp8_blocks(rows), ld = round16(rows);
    std::vector<float> x = with_specials(rows, cols, 70 + rows);
    DeviceBuffer<bf16> d_x = upload_bf16(x);  // rounds x, so the CPU sees the GPU's values
    std::vector<uint8_t> codes(rows * cols);
    std::vector<float> scales(L * cols);
    cpu::quantize_cols_e4m3(codes.data(), scales.data(), x.data(), rows, cols);
    std::vector<uint8_t> want_codes(cols * ld, 0);
    std::vector<float> want_scales(cols * L);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) want_codes[c * ld + r] = codes[r * cols + c];
    for (int64_t b = 0; b < L; ++b)
      for (int64_t c = 0; c < cols; ++c) want_scales[c * L + b] = scales[b * cols + c];
    DeviceBuffer<uint8_t> d_codes(std::vector<uint8_t>(cols * ld, 0xAB));  // the padding must be written
    DeviceBuffer<float> d_scales(cols * L);
    cu::quantize_cols_transposed_e4m3(d_codes.get(), d_scales.get(), d_x.get(), rows, cols, ld, stream.get());
    expect_bitwise(d_codes.download<uint8_t>(), want_codes, "transposed codes " + dims(rows, cols));
    expect_bitwise(d_scales.download<float>(), want_scales, "transposed scales " + dims(rows, cols));
  }
}

TEST(Fp8Parity, WeightTransposeIsExact) {
  StreamGuard stream;
  for (const Shape& s : {Shape{16, 16}, Shape{130, 272}, Shape{257, 385}, Shape{400, 128}}) {
    const int64_t rows = s.rows, cols = s.cols;
    const std::vector<float> w = graded(rows, cols, 90 + rows);
    std::vector<uint8_t> stored(kernels::fp8_matrix_bytes(rows, cols));
    cpu::quantize_weight_e4m3(stored.data(), w.data(), rows, cols);
    // W^T's stored form, built on the host: codes and block scales transposed.
    std::vector<uint8_t> want(kernels::fp8_matrix_bytes(cols, rows), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) want[c * rows + r] = stored[r * cols + c];
    const auto* in_scales = reinterpret_cast<const float*>(stored.data() + kernels::fp8_matrix_scale_offset(rows, cols));
    auto* out_scales = reinterpret_cast<float*>(want.data() + kernels::fp8_matrix_scale_offset(cols, rows));
    for (int64_t rb = 0; rb < fp8_blocks(rows); ++rb)
      for (int64_t cb = 0; cb < fp8_blocks(cols); ++cb)
        out_scales[cb * fp8_blocks(rows) + rb] = in_scales[rb * fp8_blocks(cols) + cb];
    DeviceBuffer<uint8_t> d_in(stored);
    DeviceBuffer<uint8_t> d_out(std::vector<uint8_t>(want.size(), 0xAB));
    cu::transpose_weight_e4m3(d_out.get(), d_in.get(), rows, cols, stream.get());
    expect_bitwise(d_out.download<uint8_t>(), want, "transposed weight " + dims(rows, cols));
  }
}

std::vector<kernels::Bf16> host_bf16(const std::vector<float>& rounded) {
  std::vector<kernels::Bf16> v(rounded.size());
  for (size_t i = 0; i < v.size(); ++i) v[i].bits = bf16_bits(rounded[i]);
  return v;
}
std::vector<float> host_values(const std::vector<kernels::Bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_value(v[i].bits);
  return f;
}

// The CUDA linear ops against CpuFp8Ops on the same bf16 inputs and the same stored weight. The
// two quantise identically (the tests above), so they differ by the GEMM's accumulation only:
// relative L2 within the GEMM test's bounds, 4e-3 for bf16 outputs and 1e-3 for the fp32
// weight gradient. Token counts that are not multiples of 16 take the padded path.
TEST(Fp8Parity, LinearLayersMatchTheCpuFp8Recipe) {
  if (!has_block_scaled_fp8()) GTEST_SKIP() << "cuBLASLt FP8 block scaling as built here needs sm_90";
  StreamGuard stream;
  TestContext ctx(64 << 20);
  kernels::CpuFp8Ops cpu_ops;
  struct Case {
    int64_t N, IC, OC;
  };
  for (const Case& g : {Case{50, 160, 288}, Case{256, 256, 400}, Case{7, 128, 144}, Case{300, 400, 128}}) {
    const int64_t N = g.N, IC = g.IC, OC = g.OC;
    const std::string what = "N=" + std::to_string(N) + " IC=" + std::to_string(IC) + " OC=" + std::to_string(OC);
    std::vector<float> x = graded(N, IC, 200 + N), dout = graded(N, OC, 201 + N), residual = graded(N, OC, 202);
    std::vector<float> bias = graded(1, OC, 203), dx0 = graded(N, IC, 204);
    const std::vector<float> w = graded(OC, IC, 205 + OC), dw0 = graded(OC, IC, 206);
    DeviceBuffer<bf16> d_x = upload_bf16(x), d_dout = upload_bf16(dout), d_res = upload_bf16(residual);
    DeviceBuffer<bf16> d_bias = upload_bf16(bias), d_dx0 = upload_bf16(dx0);
    std::vector<uint8_t> stored(kernels::fp8_matrix_bytes(OC, IC));
    cpu::quantize_weight_e4m3(stored.data(), w.data(), OC, IC);
    DeviceBuffer<uint8_t> d_w(stored);
    DeviceBuffer<uint8_t> operands(kernels::fp8_linear_operand_bytes(N, IC, OC));
    const auto* w_cpu = reinterpret_cast<const kernels::Bf16*>(stored.data());
    const std::vector<kernels::Bf16> hx = host_bf16(x), hdout = host_bf16(dout), hres = host_bf16(residual),
                                     hbias = host_bf16(bias);

    auto expect_close = [&](const std::vector<float>& got, const std::vector<float>& want, double tol,
                            const std::string& name) {
      const double rel = relative_error(got, want);
      std::printf("%s %s: relative L2 %.3g (bound %.3g)\n", what.c_str(), name.c_str(), rel, tol);
      EXPECT_TRUE(rel <= tol) << what << " " << name << ": relative L2 error " << rel;
    };

    // Forward, with a bias, then with a residual.
    std::vector<kernels::Bf16> want(N * OC);
    DeviceBuffer<bf16> d_out(N * OC);
    cpu_ops.linear_forward(want.data(), hx.data(), w_cpu, hbias.data(), N, IC, OC);
    cu::fp8_linear_forward(ctx, operands.get(), d_out.get(), d_x.get(), d_w.get(), d_bias.get(), nullptr, N, IC, OC,
                           stream.get());
    expect_close(download_bf16(d_out), host_values(want), 4e-3, "forward with bias");
    cpu_ops.linear_forward_residual(want.data(), hx.data(), w_cpu, hres.data(), N, IC, OC);
    cu::fp8_linear_forward(ctx, operands.get(), d_out.get(), d_x.get(), d_w.get(), nullptr, d_res.get(), N, IC, OC,
                           stream.get());
    expect_close(download_bf16(d_out), host_values(want), 4e-3, "forward with residual");

    // Backward: dx overwritten, then accumulated; dweight and dbias added to.
    std::vector<kernels::Bf16> want_dx(N * IC);
    std::vector<float> want_dw = dw0, want_db(OC, 0.5f);
    cpu_ops.linear_backward(want_dx.data(), want_dw.data(), want_db.data(), hdout.data(), hx.data(), w_cpu, N, IC, OC);
    DeviceBuffer<bf16> d_dx(N * IC);
    DeviceBuffer<float> d_dw(dw0), d_db(std::vector<float>(OC, 0.5f));
    cu::fp8_linear_backward(ctx, operands.get(), d_dx.get(), false, d_dw.get(), d_db.get(), d_dout.get(), d_x.get(),
                            d_w.get(), N, IC, OC, stream.get());
    expect_close(download_bf16(d_dx), host_values(want_dx), 4e-3, "dx");
    expect_close(download_f32(d_dw), want_dw, 1e-3, "dweight");
    expect_close(download_f32(d_db), want_db, 1e-5, "dbias");

    std::vector<kernels::Bf16> acc = host_bf16(dx0);
    std::vector<float> want_dw2 = dw0;
    cpu_ops.accumulate_data_grad(acc.data(), want_dw2.data(), hdout.data(), hx.data(), w_cpu, N, IC, OC);
    DeviceBuffer<float> d_dw2(dw0);
    cu::fp8_linear_backward(ctx, operands.get(), d_dx0.get(), true, d_dw2.get(), nullptr, d_dout.get(), d_x.get(),
                            d_w.get(), N, IC, OC, stream.get());
    expect_close(download_bf16(d_dx0), host_values(acc), 4e-3, "dx accumulated");
    expect_close(download_f32(d_dw2), want_dw2, 1e-3, "dweight (accumulating dx)");
  }
}

}  // namespace
}  // namespace strata::testing
