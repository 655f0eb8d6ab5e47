// Perf mode of the parity runner (STRATA_PERF=1, or `test_gpu --perf`): times every CUDA op
// at the shapes of a Llama-3-8B layer (8192 tokens) and prints achieved TFLOP/s (GEMM-like
// ops) or GB/s (memory-bound ops) beside ceilings measured in the same run: a plain cuBLAS
// bf16 GEMM 8192^3 and a device-to-device cudaMemcpy (bytes read + bytes written); each
// memory-bound op is set beside a copy of its own traffic, timed just after it.
// One line per op, "PERF|op|shape|ms|value|unit|ceiling|percent", is for tools/gpu_check.sh.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/ops.h"
#include "kernels/fp8.h"
#include "kernels/rope.h"

namespace strata::testing {
namespace {

namespace cu = kernels::cuda;

bool perf_enabled() {
  const char* env = std::getenv("STRATA_PERF");
  return env != nullptr && std::string(env) == "1";
}

// Milliseconds per call of f, after one warm-up call.
double time_ms(cudaStream_t stream, int iters, const std::function<void()>& f) {
  f();
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) f();
  CUDA_CHECK(cudaEventRecord(stop, stream));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return ms / iters;
}

// Device buffer of n bf16 values in [-1, 1) (a fast host generator; values only need to be
// non-trivial so that power draw is realistic).
std::unique_ptr<DeviceBuffer<bf16>> random_bf16(size_t n, uint32_t seed) {
  std::vector<uint16_t> bits(n);
  uint32_t s = seed * 2654435761u + 1u;
  for (auto& b : bits) {
    s = s * 1664525u + 1013904223u;
    b = bf16_bits(static_cast<float>(s >> 8) / 8388608.0f - 1.0f);
  }
  return std::make_unique<DeviceBuffer<bf16>>(bits);
}
std::unique_ptr<DeviceBuffer<float>> zeros_f32(size_t n) {
  auto buffer = std::make_unique<DeviceBuffer<float>>(n);
  CUDA_CHECK(cudaMemset(buffer->get(), 0, n * sizeof(float)));
  return buffer;
}

struct Row {
  std::string op, shape;
  double ms, value;
  bool flops;  // value in TFLOP/s (else GB/s)
};

void print(const Row& r, double gemm_ceiling, double bw_ceiling) {
  const double ceiling = r.flops ? gemm_ceiling : bw_ceiling;
  const char* unit = r.flops ? "TFLOP/s" : "GB/s";
  std::printf("  %-26s %-34s %9.3f ms %9.1f %-7s (%5.1f%% of %.1f)\n", r.op.c_str(),
              r.shape.c_str(), r.ms, r.value, unit, 100.0 * r.value / ceiling, ceiling);
  std::printf("PERF|%s|%s|%.4f|%.2f|%s|%.2f|%.1f\n",
              r.op.c_str(), r.shape.c_str(), r.ms, r.value, unit, ceiling,
              100.0 * r.value / ceiling);
}

TEST(OpsPerf, Report) {
  if (!perf_enabled()) GTEST_SKIP() << "perf mode is off: set STRATA_PERF=1 or pass --perf";
  StreamGuard stream_guard;
  const cudaStream_t stream = stream_guard.get();
  TestContext ctx(size_t{1} << 30);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("perf on %s\n", prop.name);

  // ---- ceilings ----
  double gemm_ceiling = 0, bw_ceiling = 0;
  {
    const int n = 8192;
    auto a = random_bf16(size_t{n} * n, 1), b = random_bf16(size_t{n} * n, 2);
    DeviceBuffer<bf16> c(size_t{n} * n);
    cublasHandle_t handle;
    ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(handle, stream), CUBLAS_STATUS_SUCCESS);
    const float alpha = 1.0f, beta = 0.0f;
    const double ms = time_ms(stream, 20, [&] {
      const cublasStatus_t status = cublasGemmEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a->get(), CUDA_R_16BF, n, b->get(),
          CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      CHECK(status == CUBLAS_STATUS_SUCCESS);
    });
    cublasDestroy(handle);
    gemm_ceiling = 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
  }
  // Device-to-device copies: the 1 GiB ceiling, and per memory-bound op a copy that reads and
  // writes as many bytes as the op moves (up to 2 x 2 GiB), timed beside it.
  const size_t copy_capacity = size_t{2} << 30;
  DeviceBuffer<char> copy_src(copy_capacity), copy_dst(copy_capacity);
  CUDA_CHECK(cudaMemset(copy_src.get(), 1, copy_capacity));
  auto copy_rate = [&](size_t bytes) {  // GB/s, read + write, of a copy of `bytes` bytes
    const double ms = time_ms(stream, 20, [&] {
      CUDA_CHECK(cudaMemcpyAsync(copy_dst.get(), copy_src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
  };
  bw_ceiling = copy_rate(size_t{1} << 30);
  std::printf("  %-26s %-34s %9.1f TFLOP/s\n", "ceiling: cuBLAS bf16 GEMM", "8192^3", gemm_ceiling);
  std::printf("  %-26s %-34s %9.1f GB/s (read + write)\n", "ceiling: D2D cudaMemcpy", "1 GiB",
              bw_ceiling);
  std::printf("PERF|ceiling: cuBLAS GEMM|bf16 8192^3|0|%.2f|TFLOP/s|%.2f|100.0\n", gemm_ceiling,
              gemm_ceiling);
  std::printf("PERF|ceiling: D2D memcpy|1 GiB, read + write|0|%.2f|GB/s|%.2f|100.0\n",
              bw_ceiling, bw_ceiling);

  auto flops_row = [&](const std::string& op, const std::string& shape, double flops,
                       const std::function<void()>& f) {
    const double ms = time_ms(stream, 10, f);
    print({op, shape, ms, flops / (ms * 1e-3) / 1e12, true}, gemm_ceiling, bw_ceiling);
  };
  // Memory-bound ops against a copy of the same traffic (half read, half written); the
  // target is 80% of its rate.
  auto bytes_row = [&](const std::string& op, const std::string& shape, double bytes,
                       const std::function<void()>& f) {
    const double ms = time_ms(stream, 20, f);
    const size_t half = std::min(copy_capacity, static_cast<size_t>(bytes / 2));
    print({op, shape, ms, bytes / (ms * 1e-3) / 1e9, false}, gemm_ceiling, copy_rate(half));
  };

  // ---- a Llama-3-8B layer at 8192 tokens ----
  const int64_t N = 8192, C = 4096, F = 14336, V = 128256;
  const int64_t B = 4, T = 2048, Hq = 32, Hkv = 8, D = 128;
  auto x = random_bf16(N * F, 3);      // (N, max(C, F)) activations
  auto y = random_bf16(N * F, 4);
  auto z = random_bf16(N * F, 5);
  auto w = random_bf16(F * C, 6);      // (F, C) weight
  auto dw = zeros_f32(F * C);

  flops_row("linear_forward", "N=8192 IC=4096 OC=14336", 2.0 * N * C * F, [&] {
    cu::linear_forward(ctx, y->get(), x->get(), w->get(), nullptr, N, C, F, stream);
  });
  flops_row("linear_backward", "N=8192 IC=4096 OC=14336", 4.0 * N * C * F, [&] {
    cu::linear_backward(ctx, z->get(), dw->get(), nullptr, y->get(), x->get(), w->get(), N, C,
                        F, stream);
  });

  {
    auto q = random_bf16(B * T * Hq * D, 7), k = random_bf16(B * T * Hkv * D, 8);
    auto v = random_bf16(B * T * Hkv * D, 9), out = random_bf16(B * T * Hq * D, 10);
    auto dout = random_bf16(B * T * Hq * D, 11);
    DeviceBuffer<bf16> dq(B * T * Hq * D), dk(B * T * Hkv * D), dv(B * T * Hkv * D);
    DeviceBuffer<float> lse(B * Hq * T);
    // Causal: half of the 2 * 2 * B * Hq * T^2 * D of full attention.
    const double fwd = 2.0 * B * Hq * double(T) * T * D;
    const std::string shape = "B=4 T=2048 Hq=32 Hkv=8 D=128";
    // Both tile sizes, where the device's opt-in shared memory per block takes them: without
    // forcing, the launchers use 64 rows where they fit, else 32.
    int device = 0, optin = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    for (int tile : {32, 64}) {
      const std::string suffix = " tile=" + std::to_string(tile);
      if (cu::attention_forward_shared_bytes(D, tile) <= static_cast<size_t>(optin)) {
        flops_row("attention_forward" + suffix, shape, fwd, [&] {
          cu::attention_forward(out->get(), lse.get(), q->get(), k->get(), v->get(), B, T, Hq,
                                Hkv, D, stream, tile);
        });
      } else {
        std::printf("  %-26s skipped: the device allows %d bytes of shared memory per block\n",
                    ("attention_forward" + suffix).c_str(), optin);
      }
      if (cu::attention_backward_shared_bytes(D, tile) <= static_cast<size_t>(optin)) {
        flops_row("attention_backward" + suffix, shape + " (2.5x fwd)", 2.5 * fwd, [&] {
          cu::attention_backward(ctx, dq.get(), dk.get(), dv.get(), dout->get(), q->get(),
                                 k->get(), v->get(), out->get(), lse.get(), B, T, Hq, Hkv, D,
                                 stream, tile);
        });
      } else {
        std::printf("  %-26s skipped: the device allows %d bytes of shared memory per block\n",
                    ("attention_backward" + suffix).c_str(), optin);
      }
    }
    // cuDNN's fused SDPA on the same shape; its target is 60% of the cuBLAS GEMM rate above.
    const cu::CudnnAttentionPlan plan = cu::cudnn_attention_prepare(ctx, B, T, Hq, Hkv, D);
    if (plan.ready) {
      if (!plan.deterministic) std::printf("  note: cuDNN attention: %s\n", plan.note.c_str());
      flops_row("attention_forward cudnn", shape, fwd, [&] {
        cu::cudnn_attention_forward(ctx, out->get(), lse.get(), q->get(), k->get(), v->get(), B, T,
                                    Hq, Hkv, D, stream);
      });
      // The forward above left a real out and lse for the backward to read.
      flops_row("attention_backward cudnn", shape + " (2.5x fwd)", 2.5 * fwd, [&] {
        cu::cudnn_attention_backward(ctx, dq.get(), dk.get(), dv.get(), dout->get(), q->get(),
                                     k->get(), v->get(), out->get(), lse.get(), B, T, Hq, Hkv, D,
                                     stream);
      });
      std::printf("  (target for the cudnn rows: >= 60%% of the cuBLAS bf16 GEMM rate, %.1f TFLOP/s)\n",
                  0.6 * gemm_ceiling);
    } else {
      std::printf("  %-26s skipped: %s\n", "attention cudnn", plan.note.c_str());
    }
  }

  {
    auto head = random_bf16(V * C, 12);
    auto dhead = zeros_f32(V * C);
    DeviceBuffer<float> losses(N);
    std::vector<int32_t> targets(N);
    for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 7919) % V);
    DeviceBuffer<int32_t> d_targets(targets);
    flops_row("lm_head_cross_entropy", "N=8192 C=4096 V=128256 chunk=1024", 6.0 * N * C * V,
              [&] {
                cu::lm_head_cross_entropy(ctx, losses.get(), z->get(), dhead->get(), x->get(),
                                          head->get(), d_targets.get(), N, C, V, 1.0f / N, 1024,
                                          stream);
              });
  }

  {
    auto weight = random_bf16(C, 13);
    auto dweight = zeros_f32(C);
    DeviceBuffer<float> rstd(N);
    const std::string shape = "N=8192 C=4096";
    bytes_row("rmsnorm_forward", shape, 2.0 * N * C * 2, [&] {
      cu::rmsnorm_forward(y->get(), rstd.get(), x->get(), weight->get(), N, C, 1e-5f, stream);
    });
    bytes_row("rmsnorm_backward", shape, 3.0 * N * C * 2, [&] {
      cu::rmsnorm_backward(ctx, z->get(), dweight->get(), y->get(), x->get(), weight->get(),
                           rstd.get(), N, C, stream);
    });
  }
  {
    std::vector<float> inv_freq(D / 2);
    kernels::RopeConfig config;
    config.theta = 500000.0;
    kernels::rope_inv_freq(inv_freq.data(), D, config);
    DeviceBuffer<float> freq(inv_freq);
    const int64_t n = B * T * Hq * D;
    bytes_row("rope_forward", "B=4 T=2048 H=32 D=128", 2.0 * n * 2, [&] {
      cu::rope_forward(y->get(), x->get(), freq.get(), B, T, Hq, D, 1.0f, 0, stream);
    });
    bytes_row("rope_backward", "B=4 T=2048 H=32 D=128 (in place)", 2.0 * n * 2, [&] {
      cu::rope_backward(y->get(), y->get(), freq.get(), B, T, Hq, D, 1.0f, stream);
    });
  }
  {
    const int64_t n = N * F;
    bytes_row("swiglu_forward", "n=8192*14336", 3.0 * n * 2, [&] {
      cu::swiglu_forward(z->get(), x->get(), y->get(), n, stream);
    });
    auto dup = random_bf16(n, 14), dout = random_bf16(n, 16);
    bytes_row("swiglu_backward", "n=8192*14336", 5.0 * n * 2, [&] {
      cu::swiglu_backward(z->get(), dup->get(), dout->get(), x->get(), y->get(), n, stream);
    });
  }
  {
    auto table = random_bf16(V * C, 15);
    auto dtable = zeros_f32(V * C);
    std::vector<int32_t> tokens(N);
    for (int64_t i = 0; i < N; ++i) tokens[i] = static_cast<int32_t>((i * 104729) % V);
    DeviceBuffer<int32_t> d_tokens(tokens);
    bytes_row("embedding_forward", "N=8192 C=4096", 2.0 * N * C * 2, [&] {
      cu::embedding_forward(y->get(), d_tokens.get(), table->get(), N, C, V, stream);
    });
    bytes_row("embedding_backward", "N=8192 C=4096 (dout + fp32 rmw)", N * C * (2.0 + 8.0), [&] {
      cu::embedding_backward(ctx, dtable->get(), y->get(), d_tokens.get(), N, C, V, stream);
    });
  }
  {
    const int64_t n = int64_t{1} << 27;  // 134M parameters in 4 tensors
    auto p = zeros_f32(n), g = zeros_f32(n), m = zeros_f32(n), v = zeros_f32(n);
    DeviceBuffer<bf16> pb(n);
    std::vector<cu::AdamWTensor> list;
    for (int i = 0; i < 4; ++i) {
      const int64_t off = i * (n / 4);
      list.push_back({p->get() + off, g->get() + off, m->get() + off, v->get() + off,
                      pb.get() + off, n / 4});
    }
    kernels::AdamWParams params;
    bytes_row("adamw_step", "n=2^27 (4 tensors, bf16 copy)", 30.0 * n, [&] {
      cu::adamw_step(list.data(), static_cast<int>(list.size()), params, stream);
    });
    DeviceBuffer<double> out(1), norm(1);
    DeviceBuffer<float> factor(1);
    bytes_row("sum_squares", "n=2^27", 4.0 * n, [&] {
      cu::sum_squares(ctx, out.get(), g->get(), n, false, stream);
    });
    // The clipped step without a host round trip: every gradient buffer's squares in one
    // launch (a few hundred tensors of mixed sizes), the factor on the device,
    // AdamW reading it.
    std::vector<cu::NormTensor> table;
    for (int64_t off = 0, i = 0; off < n; ++i) {
      const int64_t len = std::min(n - off, (i % 4 == 3) ? int64_t{4096} : (n / 200));
      table.push_back({g->get() + off, len});
      off += len;
    }
    bytes_row("multi_tensor_sum_squares", "n=2^27 (" + std::to_string(table.size()) + " tensors)", 4.0 * n, [&] {
      cu::multi_tensor_sum_squares(ctx, out.get(), table.data(), static_cast<int>(table.size()), false, stream);
    });
    bytes_row("norm + clip + adamw_step", "n=2^27 (4 tensors, bf16 copy)", 34.0 * n, [&] {
      cu::multi_tensor_sum_squares(ctx, out.get(), table.data(), static_cast<int>(table.size()), false, stream);
      cu::clip_factor(factor.get(), norm.get(), out.get(), 1.0, stream);
      cu::adamw_step(list.data(), static_cast<int>(list.size()), params, factor.get(), stream);
    });
    bytes_row("scale_inplace", "n=2^27", 8.0 * n, [&] {
      cu::scale_inplace(g->get(), n, 1.0f, stream);
    });
  }
  {
    // The decoder's element-wise ops at a layer's activation size.
    const int64_t n = N * C;
    auto f = zeros_f32(n);
    DeviceBuffer<float> logit(N), dlogit(N);
    CUDA_CHECK(cudaMemset(logit.get(), 0, N * sizeof(float)));
    const std::string shape = "N=8192 C=4096";
    bytes_row("add_inplace", shape, 3.0 * n * 2, [&] { cu::add_inplace(y->get(), x->get(), n, stream); });
    bytes_row("f32_to_bf16", shape, n * (4.0 + 2.0), [&] { cu::f32_to_bf16(y->get(), f->get(), n, stream); });
    bytes_row("shared_expert_combine", shape, 3.0 * n * 2, [&] {
      cu::shared_expert_combine(y->get(), x->get(), logit.get(), N, C, stream);
    });
    bytes_row("shared_expert_backward", shape, 3.0 * n * 2, [&] {
      cu::shared_expert_backward(z->get(), dlogit.get(), y->get(), x->get(), logit.get(), N, C, stream);
    });
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

// FP8 block-scaled GEMM (cuBLASLt, 1x128 activation tiles, 128x128 weight blocks or 1x128
// tiles) against the bf16 cuBLASLt GEMM of linear_forward, at the 0.44B model's shapes
// (16384 tokens, C = 1024, F = 4096). Prints TFLOP/s of both and their ratio; the recipe's
// target is >= 1.6x. Never fails on speed. "fp8 + quant" also times quantising the bf16
// activation (quantize_rows_e4m3), as a forward pass must.
TEST(OpsPerf, Fp8GemmAgainstBf16) {
  if (!perf_enabled()) GTEST_SKIP() << "perf mode is off: set STRATA_PERF=1 or pass --perf";
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) GTEST_SKIP() << "cuBLASLt FP8 block scaling as built here needs sm_90";
  StreamGuard stream_guard;
  const cudaStream_t stream = stream_guard.get();
  TestContext ctx(size_t{256} << 20);
  const int64_t T = 16384, C = 1024, F = 4096;
  struct Shape {
    const char* name;
    int64_t M, N, K;
    bool b_blocks;
  };
  // Forward GEMMs (activation @ weight^T: weight in blocks) and the weight gradient of gate/up
  // (dY^T @ X over the tokens: both operands in 1 x 128 tiles along the token dimension).
  const Shape shapes[] = {{"q/k/v/o", T, C, C, true},
                          {"gate/up", T, F, C, true},
                          {"down", T, C, F, true},
                          {"gate/up dweight", F, C, T, false}};
  auto x = random_bf16(T * F, 21);
  auto w = random_bf16(F * C > T * F ? F * C : T * F, 22);  // (N, K) bf16 operand of the bf16 GEMM
  DeviceBuffer<bf16> y(T * F);
  std::vector<float> w_host(static_cast<size_t>(F * T));
  for (size_t i = 0; i < w_host.size(); ++i) w_host[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
  DeviceBuffer<float> w_f32(w_host);
  DeviceBuffer<uint8_t> a_codes(T * F), b_codes(kernels::fp8_matrix_bytes(F, T));
  DeviceBuffer<float> a_scales(T * F / 128 + 1), b_scales(T * F / 128 + 1);
  std::printf("fp8 block-scaled GEMM vs bf16 GEMM (cuBLASLt) on %s\n", prop.name);
  for (const Shape& s : shapes) {
    const double flops = 2.0 * s.M * s.N * s.K;
    const std::string shape = "M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) + " K=" + std::to_string(s.K);
    const double bf16_ms = time_ms(stream, 20, [&] {
      cu::gemm(ctx, false, true, s.M, s.N, s.K, 1.0f, x->get(), s.K, w->get(), s.K, 0.0f, y.get(), s.N, false,
               nullptr, stream);
    });
    cu::quantize_rows_e4m3(a_codes.get(), a_scales.get(), x->get(), s.M, s.K, stream);
    const float* b_scale_ptr = b_scales.get();
    if (s.b_blocks) {
      cu::quantize_weight_e4m3(b_codes.get(), w_f32.get(), s.N, s.K, stream);
      b_scale_ptr = reinterpret_cast<const float*>(b_codes.get() + kernels::fp8_matrix_scale_offset(s.N, s.K));
    } else {
      cu::quantize_rows_e4m3(b_codes.get(), b_scales.get(), w_f32.get(), s.N, s.K, stream);
    }
    const double fp8_ms = time_ms(stream, 20, [&] {
      cu::fp8_gemm_nt(ctx, y.get(), true, a_codes.get(), a_scales.get(), b_codes.get(), b_scale_ptr, s.b_blocks,
                      s.M, s.N, s.K, 0.0f, stream);
    });
    const double fp8_quant_ms = time_ms(stream, 20, [&] {
      cu::quantize_rows_e4m3(a_codes.get(), a_scales.get(), x->get(), s.M, s.K, stream);
      cu::fp8_gemm_nt(ctx, y.get(), true, a_codes.get(), a_scales.get(), b_codes.get(), b_scale_ptr, s.b_blocks,
                      s.M, s.N, s.K, 0.0f, stream);
    });
    const double bf16_tf = flops / (bf16_ms * 1e-3) / 1e12, fp8_tf = flops / (fp8_ms * 1e-3) / 1e12;
    const double fp8_quant_tf = flops / (fp8_quant_ms * 1e-3) / 1e12;
    std::printf("  %-16s %-26s bf16 %7.1f  fp8 %7.1f (%.2fx)  fp8 + quant %7.1f (%.2fx) TFLOP/s%s\n", s.name,
                shape.c_str(), bf16_tf, fp8_tf, fp8_tf / bf16_tf, fp8_quant_tf, fp8_quant_tf / bf16_tf,
                fp8_tf / bf16_tf >= 1.6 ? "" : "  [below the 1.6x target]");
    std::printf("PERF|fp8_gemm_nt %s|%s|%.4f|%.2f|TFLOP/s|%.2f|%.1f\n", s.name, shape.c_str(), fp8_ms, fp8_tf,
                bf16_tf, 100.0 * fp8_tf / bf16_tf);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace
}  // namespace strata::testing
