// LoRA adapters and frozen weights on CUDA: CudaOps' lora_forward and lora_backward against
// CpuBf16Ops (the bf16 recipe emulated on the CPU, kernels/cpu/lora.cpp) on the same bf16
// inputs, with and without dropout, without dx and without dA, dB; and the weight-gradient ops
// given a null gradient (a frozen weight, as the decoder passes them with LoRA on) compute
// everything else as before.
//
// Tolerances (relative L2 error; NaN or Inf fails):
//   kBf16Tol  y, dx (bf16) and dA, dB (fp32, but accumulated from the bf16-rounded t and dt,
//             which the GPU's GEMMs may round one ulp apart from the CPU's);
//   exact     the dropout mask: drop(x) through identity adapters is the CPU's bit for bit, and
//             dx's dropped elements are left as they were.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../test_util.h"
#include "core/check.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/bf16.h"
#include "kernels/cpu/backend.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/ops.h"
#include "kernels/lora.h"
#include "kernels/moe.h"

namespace strata::testing {
namespace {

namespace cu = kernels::cuda;
using kernels::LoraDropout;

constexpr double kBf16Tol = 1e-2;

void expect_close(const std::vector<float>& gpu, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  const double err = relative_error(gpu, want);
  std::printf("%s: relative L2 %.3g (bound %.3g)\n", what.c_str(), err, tol);
  EXPECT_TRUE(err <= tol) << what << ": relative error " << err << " exceeds " << tol;
}

void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " elements differ, the first at " << first;
}

// Host bf16 of values already rounded to bf16 (round_to_bf16), and back.
std::vector<kernels::Bf16> host_bf16(const std::vector<float>& rounded) {
  std::vector<kernels::Bf16> h(rounded.size());
  for (size_t i = 0; i < rounded.size(); ++i) h[i].bits = bf16_bits(rounded[i]);
  return h;
}
std::vector<float> host_values(const std::vector<kernels::Bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_value(v[i].bits);
  return f;
}

// after - before, element by element: what an accumulating op added.
std::vector<float> added(const std::vector<float>& after, const std::vector<float>& before) {
  std::vector<float> d(after.size());
  for (size_t i = 0; i < after.size(); ++i) d[i] = after[i] - before[i];
  return d;
}

// Random values rounded to bf16 in place, so that both sides see the same inputs.
std::vector<float> random_bf16(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v = random_vector(n, seed, lo, hi);
  round_to_bf16(v);
  return v;
}

// A CUDA op set over device 0 (2 GiB of arena: the kernels' scratch and GEMM workspace).
struct CudaOpSet {
  std::unique_ptr<Device> device;
  std::unique_ptr<kernels::CudaOps> ops;
};
CudaOpSet open_cuda_ops() {
  CudaOpSet set;
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, uint64_t{2} << 30);
  CHECK_MSG(device.ok(), device.status().to_string());
  set.device = std::move(device).value();
  Result<kernels::CudaOps> created = kernels::CudaOps::create(*set.device);
  CHECK_MSG(created.ok(), created.status().to_string());
  set.ops = std::make_unique<kernels::CudaOps>(std::move(created).value());
  return set;
}

struct LoraCase {
  int64_t N, IC, OC, R;
  float p;
  int64_t row0;
  bool with_dx;
  bool trained = true;  // dA and dB given (else null: an adapter that is not trained)
  std::string text() const {
    return "N=" + std::to_string(N) + " IC=" + std::to_string(IC) + " OC=" + std::to_string(OC) +
           " R=" + std::to_string(R) + " p=" + std::to_string(p) + " row0=" + std::to_string(row0) +
           (with_dx ? "" : " (no dx)") + (trained ? "" : " (no dA, dB)");
  }
};

// Whether element i of an N x IC input is dropped (kernels/lora.h).
bool dropped(const LoraDropout& drop, int64_t IC, int64_t i) {
  return drop.p > 0 && kernels::lora_dropped(drop.seed, static_cast<uint64_t>(drop.row0 * IC + i), drop.p);
}

void check_lora_case(kernels::CudaOps& ops, const LoraCase& c, uint64_t seed) {
  kernels::CpuBf16Ops cpu;
  const int64_t N = c.N, IC = c.IC, OC = c.OC, R = c.R;
  const float scale = 16.0f / static_cast<float>(R);  // lora_alpha 16
  const LoraDropout drop{c.p, 0x5EEDull + seed, c.row0};
  const std::string what = c.text();
  std::vector<float> x = random_bf16(N * IC, seed + 1), a = random_bf16(R * IC, seed + 2, -0.2f, 0.2f);
  std::vector<float> b = random_bf16(OC * R, seed + 3, -0.2f, 0.2f), y0 = random_bf16(N * OC, seed + 4);
  std::vector<float> dy = random_bf16(N * OC, seed + 5), dx0 = random_bf16(N * IC, seed + 6);
  const std::vector<float> dA0 = random_vector(R * IC, seed + 7), dB0 = random_vector(OC * R, seed + 8);
  const std::vector<kernels::Bf16> hx = host_bf16(x), ha = host_bf16(a), hb = host_bf16(b), hdy = host_bf16(dy);

  // Forward: y = round(y0 + scale * round(drop(x) A^T) B^T).
  std::vector<kernels::Bf16> want_y = host_bf16(y0);
  cpu.lora_forward(want_y.data(), hx.data(), ha.data(), hb.data(), scale, drop, N, IC, OC, R);
  DeviceBuffer<bf16> d_x = upload_bf16(x), d_a = upload_bf16(a), d_b = upload_bf16(b), d_y = upload_bf16(y0);
  DeviceBuffer<bf16> d_dy = upload_bf16(dy);
  ops.lora_forward(d_y.get(), d_x.get(), d_a.get(), d_b.get(), scale, drop, N, IC, OC, R);
  ops.synchronize();
  expect_close(download_bf16(d_y), host_values(want_y), kBf16Tol, what + " y");

  // Backward: dA, dB added to; dx = round(dx0 + drop'(dt A)) when asked for.
  std::vector<kernels::Bf16> want_dx = host_bf16(dx0);
  std::vector<float> want_dA = dA0, want_dB = dB0;
  cpu.lora_backward(c.with_dx ? want_dx.data() : nullptr, c.trained ? want_dA.data() : nullptr,
                    c.trained ? want_dB.data() : nullptr, hdy.data(), hx.data(), ha.data(), hb.data(), scale, drop, N,
                    IC, OC, R);
  DeviceBuffer<bf16> d_dx = upload_bf16(dx0);
  DeviceBuffer<float> d_dA(dA0), d_dB(dB0);
  ops.lora_backward(c.with_dx ? d_dx.get() : nullptr, c.trained ? d_dA.get() : nullptr,
                    c.trained ? d_dB.get() : nullptr, d_dy.get(), d_x.get(), d_a.get(), d_b.get(), scale, drop, N, IC,
                    OC, R);
  ops.synchronize();
  if (c.trained) {
    // What each side added (the starting values would otherwise dominate the error).
    expect_close(added(download_f32(d_dA), dA0), added(want_dA, dA0), kBf16Tol, what + " dA");
    expect_close(added(download_f32(d_dB), dB0), added(want_dB, dB0), kBf16Tol, what + " dB");
  } else {
    expect_bitwise(download_f32(d_dA), dA0, what + " dA (not asked for, left alone)");
    expect_bitwise(download_f32(d_dB), dB0, what + " dB (not asked for, left alone)");
  }
  const std::vector<float> got_dx = download_bf16(d_dx);
  if (!c.with_dx) {
    expect_bitwise(got_dx, dx0, what + " dx (not asked for, left alone)");
    return;
  }
  expect_close(got_dx, host_values(want_dx), kBf16Tol, what + " dx");
  // Where the input was dropped, dx gets nothing: the same bits as before, on both sides.
  std::vector<float> got_kept, want_kept;
  int64_t drops = 0;
  for (int64_t i = 0; i < N * IC; ++i) {
    if (!dropped(drop, IC, i)) continue;
    ++drops;
    got_kept.push_back(got_dx[static_cast<size_t>(i)]);
    want_kept.push_back(dx0[static_cast<size_t>(i)]);
  }
  expect_bitwise(got_kept, want_kept, what + " dx where dropped");
  if (c.p > 0) {
    EXPECT_GT(drops, 0) << what << ": the mask dropped nothing";
  }
}

TEST(LoraParity, ForwardAndBackwardMatchTheCpuBf16Recipe) {
  CudaOpSet set = open_cuda_ops();
  const LoraCase cases[] = {
      {37, 96, 80, 8, 0.0f, 0, true},         // odd token count, no dropout
      {37, 96, 80, 8, 0.1f, 5, true},         // dropout, rows after the micro-batch's first
      {128, 256, 192, 16, 0.1f, 0, false},    // dropout without dx (the first layer's input)
      {5, 24, 40, 4, 0.0f, 0, false},         // no dropout, no dx
      {64, 160, 48, 8, 0.1f, 300, true},      // OC < IC (a down projection)
      {37, 96, 80, 8, 0.0f, 0, true, false},  // dx alone (an adapter that is not trained)
      {37, 96, 80, 8, 0.1f, 5, true, false},
  };
  uint64_t seed = 100;
  for (const LoraCase& c : cases) check_lora_case(*set.ops, c, seed += 10);
}

// Identity adapters (R = IC = OC, A = B = I, scale 1, y = 0) make y = drop(x) exactly: the mask
// and the kept values' rounding are the CPU's bit for bit.
TEST(LoraParity, DropoutMaskIsTheCpusBitForBit) {
  CudaOpSet set = open_cuda_ops();
  kernels::CpuBf16Ops cpu;
  const int64_t N = 50, D = 64;
  const LoraDropout drop{0.25f, 0xC0FFEEull, 7};
  std::vector<float> x = random_bf16(N * D, 11), eye(static_cast<size_t>(D * D), 0.0f), zero(N * D, 0.0f);
  for (int64_t i = 0; i < D; ++i) eye[static_cast<size_t>(i * D + i)] = 1.0f;
  const std::vector<kernels::Bf16> hx = host_bf16(x), heye = host_bf16(eye);
  std::vector<kernels::Bf16> want = host_bf16(zero);
  cpu.lora_forward(want.data(), hx.data(), heye.data(), heye.data(), 1.0f, drop, N, D, D, D);
  DeviceBuffer<bf16> d_x = upload_bf16(x), d_eye = upload_bf16(eye), d_y = upload_bf16(zero);
  set.ops->lora_forward(d_y.get(), d_x.get(), d_eye.get(), d_eye.get(), 1.0f, drop, N, D, D, D);
  set.ops->synchronize();
  const std::vector<float> got = download_bf16(d_y);
  expect_bitwise(got, host_values(want), "drop(x) through identity adapters");
  int64_t drops = 0;
  for (int64_t i = 0; i < N * D; ++i) drops += dropped(drop, D, i) ? 1 : 0;
  EXPECT_GT(drops, N * D / 8) << "p = 0.25 dropped too few";
  EXPECT_LT(drops, N * D * 3 / 8) << "p = 0.25 dropped too many";
}

// Rows in chunks (a scratch too small for one): the same results as the CPU's.
TEST(LoraParity, RowsInChunksMatchTheCpuBf16Recipe) {
  StreamGuard stream;
  TestContext ctx(size_t{8} << 10);  // 8 KiB: 4 rows per chunk with dropout, 224 without
  kernels::CpuBf16Ops cpu;
  const int64_t N = 300, IC = 256, OC = 96, R = 8;
  const float scale = 2.0f;
  for (float p : {0.0f, 0.1f}) {
    const LoraDropout drop{p, 0xABCDull, 3};
    const std::string what = "chunked p=" + std::to_string(p);
    std::vector<float> x = random_bf16(N * IC, 21), a = random_bf16(R * IC, 22, -0.2f, 0.2f);
    std::vector<float> b = random_bf16(OC * R, 23, -0.2f, 0.2f), y0 = random_bf16(N * OC, 24);
    std::vector<float> dy = random_bf16(N * OC, 25), dx0 = random_bf16(N * IC, 26);
    const std::vector<float> dA0(R * IC, 0.0f), dB0(OC * R, 0.0f);
    const std::vector<kernels::Bf16> hx = host_bf16(x), ha = host_bf16(a), hb = host_bf16(b), hdy = host_bf16(dy);
    std::vector<kernels::Bf16> want_y = host_bf16(y0), want_dx = host_bf16(dx0);
    std::vector<float> want_dA = dA0, want_dB = dB0;
    cpu.lora_forward(want_y.data(), hx.data(), ha.data(), hb.data(), scale, drop, N, IC, OC, R);
    cpu.lora_backward(want_dx.data(), want_dA.data(), want_dB.data(), hdy.data(), hx.data(), ha.data(), hb.data(),
                      scale, drop, N, IC, OC, R);
    DeviceBuffer<bf16> d_x = upload_bf16(x), d_a = upload_bf16(a), d_b = upload_bf16(b), d_y = upload_bf16(y0);
    DeviceBuffer<bf16> d_dy = upload_bf16(dy), d_dx = upload_bf16(dx0);
    DeviceBuffer<float> d_dA(dA0), d_dB(dB0);
    cu::lora_forward(ctx, d_y.get(), d_x.get(), d_a.get(), d_b.get(), scale, drop, N, IC, OC, R, stream.get());
    cu::lora_backward(ctx, d_dx.get(), d_dA.get(), d_dB.get(), d_dy.get(), d_x.get(), d_a.get(), d_b.get(), scale, drop,
                      N, IC, OC, R, stream.get());
    CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    expect_close(download_bf16(d_y), host_values(want_y), kBf16Tol, what + " y");
    expect_close(download_bf16(d_dx), host_values(want_dx), kBf16Tol, what + " dx");
    expect_close(download_f32(d_dA), want_dA, kBf16Tol, what + " dA");
    expect_close(download_f32(d_dB), want_dB, kBf16Tol, what + " dB");
  }
}

// A null weight gradient (a frozen weight) skips that gradient only: dx is bitwise what the same
// op computes with the gradient, and matches the CPU recipe's.
TEST(FrozenWeights, LinearAndNormBackwardWithoutWeightGradientsKeepDx) {
  CudaOpSet set = open_cuda_ops();
  kernels::CudaOps& ops = *set.ops;
  kernels::CpuBf16Ops cpu;
  const int64_t N = 33, IC = 72, OC = 40;
  std::vector<float> x = random_bf16(N * IC, 31), w = random_bf16(OC * IC, 32), dout = random_bf16(N * OC, 33);
  const std::vector<kernels::Bf16> hx = host_bf16(x), hw = host_bf16(w), hdout = host_bf16(dout);
  DeviceBuffer<bf16> d_x = upload_bf16(x), d_w = upload_bf16(w), d_dout = upload_bf16(dout);
  DeviceBuffer<bf16> d_dx_full(N * IC), d_dx_frozen(N * IC);
  DeviceBuffer<float> d_dw(std::vector<float>(OC * IC, 0.0f)), d_db(std::vector<float>(OC, 0.0f));

  // linear_backward
  std::vector<kernels::Bf16> want_dx(N * IC);
  cpu.linear_backward(want_dx.data(), nullptr, nullptr, hdout.data(), hx.data(), hw.data(), N, IC, OC);
  ops.linear_backward(d_dx_full.get(), d_dw.get(), d_db.get(), d_dout.get(), d_x.get(), d_w.get(), N, IC, OC);
  ops.linear_backward(d_dx_frozen.get(), nullptr, nullptr, d_dout.get(), d_x.get(), d_w.get(), N, IC, OC);
  ops.linear_backward(nullptr, nullptr, nullptr, d_dout.get(), d_x.get(), d_w.get(), N, IC, OC);  // nothing to do
  ops.synchronize();
  expect_bitwise(download_bf16(d_dx_frozen), download_bf16(d_dx_full), "linear_backward dx, frozen weight");
  expect_close(download_bf16(d_dx_frozen), host_values(want_dx), kBf16Tol, "linear_backward dx vs the CPU");

  // linear_backward_f32 (the router's and the shared expert gate's)
  const std::vector<float> dout32 = random_vector(N * OC, 34);
  DeviceBuffer<float> d_dout32(dout32);
  cpu.linear_backward_f32(want_dx.data(), nullptr, dout32.data(), hx.data(), hw.data(), N, IC, OC);
  ops.linear_backward_f32(d_dx_full.get(), d_dw.get(), d_dout32.get(), d_x.get(), d_w.get(), N, IC, OC);
  ops.linear_backward_f32(d_dx_frozen.get(), nullptr, d_dout32.get(), d_x.get(), d_w.get(), N, IC, OC);
  ops.synchronize();
  expect_bitwise(download_bf16(d_dx_frozen), download_bf16(d_dx_full), "linear_backward_f32 dx, frozen weight");
  expect_close(download_bf16(d_dx_frozen), host_values(want_dx), kBf16Tol, "linear_backward_f32 dx vs the CPU");

  // rmsnorm_backward, with C both a multiple of 8 (the vector path) and not
  for (int64_t C : {int64_t{64}, int64_t{70}}) {
    const std::string what = "rmsnorm_backward C=" + std::to_string(C);
    std::vector<float> nx = random_bf16(N * C, 35 + C), nw = random_bf16(C, 36 + C), ng = random_bf16(N * C, 37 + C);
    const std::vector<float> rstd = random_vector(N, 38 + C, 0.5f, 1.5f);
    const std::vector<kernels::Bf16> hnx = host_bf16(nx), hnw = host_bf16(nw), hng = host_bf16(ng);
    std::vector<kernels::Bf16> want(N * C);
    cpu.rmsnorm_backward(want.data(), nullptr, hng.data(), hnx.data(), hnw.data(), rstd.data(), N, C);
    DeviceBuffer<bf16> d_nx = upload_bf16(nx), d_nw = upload_bf16(nw), d_ng = upload_bf16(ng);
    DeviceBuffer<bf16> d_full(N * C), d_frozen(N * C);
    DeviceBuffer<float> d_rstd(rstd), d_ndw(std::vector<float>(C, 0.0f));
    ops.rmsnorm_backward(d_full.get(), d_ndw.get(), d_ng.get(), d_nx.get(), d_nw.get(), d_rstd.get(), N, C);
    ops.rmsnorm_backward(d_frozen.get(), nullptr, d_ng.get(), d_nx.get(), d_nw.get(), d_rstd.get(), N, C);
    ops.synchronize();
    expect_bitwise(download_bf16(d_frozen), download_bf16(d_full), what + " dx, frozen weight");
    expect_close(download_bf16(d_frozen), host_values(want), kBf16Tol, what + " dx vs the CPU");
  }
}

// The experts' backward with null gradients for some experts' weights (all three of expert 0,
// the gate of expert 2): dxs and the gradients that are given are bitwise those of a run with
// every gradient.
TEST(FrozenWeights, ExpertsBackwardSkipsNullGradients) {
  CudaOpSet set = open_cuda_ops();
  kernels::CudaOps& ops = *set.ops;
  const int64_t E = 3, C = 64, F = 96;
  const std::vector<int64_t> offsets = {0, 10, 10, 27};  // expert 1 has no rows
  const int64_t S = offsets.back();
  std::vector<float> xs = random_bf16(S * C, 41), dys = random_bf16(S * C, 42);
  std::vector<float> gate = random_bf16(S * F, 43), up = random_bf16(S * F, 44), act = random_bf16(S * F, 45);
  DeviceBuffer<bf16> d_xs = upload_bf16(xs), d_dys = upload_bf16(dys), d_gate = upload_bf16(gate);
  DeviceBuffer<bf16> d_up = upload_bf16(up), d_act = upload_bf16(act);
  DeviceBuffer<int64_t> d_offsets(offsets);
  DeviceBuffer<bf16> d_dgate(S * F), d_dup(S * F), d_dact(S * F), d_dxs_full(S * C), d_dxs_frozen(S * C);
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> weights;
  std::vector<const bf16*> wg, wu, wd;
  uint64_t seed = 50;
  for (int64_t e = 0; e < E; ++e) {
    for (std::vector<const bf16*>* list : {&wg, &wu, &wd}) {  // gate, up (F,C); down (C,F): F * C values each
      std::vector<float> v = random_bf16(F * C, seed++, -0.1f, 0.1f);
      weights.push_back(std::make_unique<DeviceBuffer<bf16>>(round_to_bf16(v)));
      list->push_back(weights.back()->get());
    }
  }
  const kernels::ExpertTensors<const bf16> w{wg.data(), wu.data(), wd.data()};
  // Gradients: 3 per expert, all zero at first, in two sets (full, frozen).
  std::vector<std::unique_ptr<DeviceBuffer<float>>> grads;
  auto zeros = [&] {
    grads.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(F * C, 0.0f)));
    return grads.back()->get();
  };
  std::vector<float*> full_g, full_u, full_d, frozen_g, frozen_u, frozen_d;
  for (int64_t e = 0; e < E; ++e) {
    full_g.push_back(zeros());
    full_u.push_back(zeros());
    full_d.push_back(zeros());
    frozen_g.push_back(e == 0 || e == 2 ? nullptr : zeros());
    frozen_u.push_back(e == 0 ? nullptr : zeros());
    frozen_d.push_back(e == 0 ? nullptr : zeros());
  }
  const kernels::ExpertTensors<float> dw_full{full_g.data(), full_u.data(), full_d.data()};
  const kernels::ExpertTensors<float> dw_frozen{frozen_g.data(), frozen_u.data(), frozen_d.data()};
  ops.moe_experts_backward(d_dxs_full.get(), dw_full, d_dgate.get(), d_dup.get(), d_dact.get(), d_dys.get(), d_xs.get(),
                           d_gate.get(), d_up.get(), d_act.get(), d_offsets.get(), w, E, C, F);
  ops.moe_experts_backward(d_dxs_frozen.get(), dw_frozen, d_dgate.get(), d_dup.get(), d_dact.get(), d_dys.get(),
                           d_xs.get(), d_gate.get(), d_up.get(), d_act.get(), d_offsets.get(), w, E, C, F);
  ops.synchronize();
  expect_bitwise(download_bf16(d_dxs_frozen), download_bf16(d_dxs_full), "experts' dxs with frozen experts");
  auto read = [&](float* p) {
    std::vector<float> host(static_cast<size_t>(F * C));
    CUDA_CHECK(cudaMemcpy(host.data(), p, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  };
  for (int64_t e = 0; e < E; ++e) {
    const std::string what = "expert " + std::to_string(e);
    if (frozen_g[e] != nullptr) expect_bitwise(read(frozen_g[e]), read(full_g[e]), what + " dW_gate");
    if (frozen_u[e] != nullptr) expect_bitwise(read(frozen_u[e]), read(full_u[e]), what + " dW_up");
    if (frozen_d[e] != nullptr) expect_bitwise(read(frozen_d[e]), read(full_d[e]), what + " dW_down");
  }
}

}  // namespace
}  // namespace strata::testing
