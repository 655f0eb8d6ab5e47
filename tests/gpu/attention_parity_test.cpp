// Attention on both CUDA implementations against the CPU reference: cuDNN's fused SDPA
// (cudnn_attention_*) called directly, and the op set (CudaOps) with STRATA_ATTENTION forcing
// the fallback or left to choose. The WMMA kernel's own tile variants are covered by
// ops_parity_test.cpp. Inputs are rounded to bf16 before either side sees them.
//
// Tolerances (relative L2 error; NaN or Inf fails):
//   kBf16Tol   bf16 outputs (out, dq, dk, dv): one bf16 rounding of values computed in fp32,
//              plus bf16 probabilities inside the products;
//   kLseTol    the fp32 logsumexp: cuDNN computes exp and log in its own (exp2-based) way, so
//              it is held to 1e-4 rather than the 1e-5 of the WMMA kernel.
// A path the selection (kernels/attention_choice.h) says is unavailable on this machine is
// skipped with a note; where the selection says cuDNN serves a shape, cuDNN failing to build
// its graphs fails the test.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../test_util.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/attention.h"
#include "kernels/attention_choice.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/ops.h"

namespace strata::testing {
namespace {

namespace ref = kernels::ref;
namespace cu = kernels::cuda;
using kernels::AttentionCase;
using kernels::AttentionChoice;
using kernels::AttentionForce;
using kernels::AttentionImpl;

constexpr double kBf16Tol = 1e-2;
constexpr double kLseTol = 1e-4;

void expect_close(const std::vector<float>& gpu, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  const double err = relative_error(gpu, want);
  EXPECT_TRUE(err <= tol) << what << ": relative error " << err << " exceeds " << tol;
}

template <typename T>
void poison(DeviceBuffer<T>& buffer) {
  CUDA_CHECK(cudaMemset(buffer.get(), 0xFF, buffer.size() * sizeof(T)));
}

struct Shape {
  int64_t B, T, Hq, Hkv, D;
  std::string text() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " Hq=" + std::to_string(Hq) +
           " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D);
  }
};

AttentionCase case_of(const Shape& s) {
  AttentionCase c;
  c.d_qk = s.D;
  c.d_v = s.D;
  c.hq = s.Hq;
  c.hkv = s.Hkv;
  c.seq_len = s.T;
  return c;
}

// Head dims 64 and 128, MHA and GQA (groups 2 and 4), lengths that are no multiple of any
// tile (17, 257) and one that is (128).
std::vector<Shape> shapes() {
  std::vector<Shape> all;
  for (int64_t T : {17, 128, 257}) {
    for (int64_t D : {64, 128}) {
      all.push_back({2, T, 2, 2, D});
      all.push_back({2, T, 4, 2, D});
      all.push_back({1, T, 8, 2, D});
    }
  }
  return all;
}

// The reference's forward and backward of one shape, on bf16-rounded inputs.
struct Case {
  Shape s;
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
  explicit Case(const Shape& shape) : s(shape) {
    const int64_t nq = s.B * s.T * s.Hq * s.D, nkv = s.B * s.T * s.Hkv * s.D;
    q = random_vector(nq, 70 + s.T + s.D, -1.5f, 1.5f);
    k = random_vector(nkv, 71 + s.T + s.Hq, -1.5f, 1.5f);
    v = random_vector(nkv, 72 + s.T + s.Hkv);
    dout = random_vector(nq, 73 + s.T);
    for (std::vector<float>* x : {&q, &k, &v, &dout}) round_to_bf16(*x);
    out.resize(nq);
    lse.resize(s.B * s.Hq * s.T);
    ref::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T, s.Hq,
                           s.Hkv, s.D);
    round_to_bf16(out);  // the backward on both sides reads the bf16 out
    dq.resize(nq);
    dk.resize(nkv);
    dv.resize(nkv);
    ref::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                            v.data(), out.data(), lse.data(), s.B, s.T, s.Hq, s.Hkv, s.D);
  }
};

TEST(AttentionParity, CudnnMatchesTheReference) {
  const kernels::AttentionCapability cap = kernels::CudaOps::attention_capability();
  TestContext ctx(size_t{256} << 20);
  StreamGuard stream;
  for (const Shape& s : shapes()) {
    const std::string what = "cuDNN attention " + s.text();
    const AttentionChoice choice = kernels::choose_attention(cap, case_of(s), AttentionForce::kCudnn);
    if (choice.impl != AttentionImpl::kCudnn) {
      std::printf("note: %s skipped: %s\n", what.c_str(), choice.reason.c_str());
      continue;
    }
    const cu::CudnnAttentionPlan plan = cu::cudnn_attention_prepare(ctx, s.B, s.T, s.Hq, s.Hkv, s.D);
    if (!plan.ready) {
      ADD_FAILURE() << what << ": the selection says cuDNN serves it, but: " << plan.note;
      continue;
    }
    if (!plan.deterministic) std::printf("note: %s: %s\n", what.c_str(), plan.note.c_str());
    Case c(s);
    DeviceBuffer<bf16> d_q = upload_bf16(c.q), d_k = upload_bf16(c.k), d_v = upload_bf16(c.v);
    DeviceBuffer<bf16> d_dout = upload_bf16(c.dout);
    DeviceBuffer<bf16> d_out(c.out.size()), d_dq(c.q.size()), d_dk(c.k.size()), d_dv(c.v.size());
    DeviceBuffer<float> d_lse(c.lse.size());
    poison(d_out);
    poison(d_lse);
    cu::cudnn_attention_forward(ctx, d_out.get(), d_lse.get(), d_q.get(), d_k.get(), d_v.get(), s.B,
                                s.T, s.Hq, s.Hkv, s.D, stream.get());
    CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    expect_close(download_bf16(d_out), c.out, kBf16Tol, what + " out");
    // Same semantics and layout as the WMMA kernel's lse: natural-log logsumexp, (B,Hq,T).
    expect_close(download_f32(d_lse), c.lse, kLseTol, what + " lse");

    // The backward from the reference's out and lse: that cuDNN's stats input means the same
    // as the reference's lse is part of what this checks.
    DeviceBuffer<bf16> d_out_ref = upload_bf16(c.out);
    DeviceBuffer<float> d_lse_ref(c.lse);
    poison(d_dq);
    poison(d_dk);
    poison(d_dv);
    cu::cudnn_attention_backward(ctx, d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(), d_q.get(),
                                 d_k.get(), d_v.get(), d_out_ref.get(), d_lse_ref.get(), s.B, s.T,
                                 s.Hq, s.Hkv, s.D, stream.get());
    CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    expect_close(download_bf16(d_dq), c.dq, kBf16Tol, what + " dq");
    expect_close(download_bf16(d_dk), c.dk, kBf16Tol, what + " dk");
    expect_close(download_bf16(d_dv), c.dv, kBf16Tol, what + " dv");
  }
}

// A backward the plan calls deterministic gives the same bits when run again.
TEST(AttentionParity, CudnnDeterministicBackwardRepeatsBitwise) {
  const kernels::AttentionCapability cap = kernels::CudaOps::attention_capability();
  const Shape s{2, 1000, 8, 2, 128};
  const AttentionChoice choice = kernels::choose_attention(cap, case_of(s), AttentionForce::kCudnn);
  if (choice.impl != AttentionImpl::kCudnn) GTEST_SKIP() << choice.reason;
  TestContext ctx(size_t{256} << 20);
  StreamGuard stream;
  const cu::CudnnAttentionPlan plan = cu::cudnn_attention_prepare(ctx, s.B, s.T, s.Hq, s.Hkv, s.D);
  ASSERT_TRUE(plan.ready) << plan.note;
  if (!plan.deterministic) GTEST_SKIP() << plan.note;
  Case c(s);
  DeviceBuffer<bf16> d_q = upload_bf16(c.q), d_k = upload_bf16(c.k), d_v = upload_bf16(c.v);
  DeviceBuffer<bf16> d_dout = upload_bf16(c.dout), d_out = upload_bf16(c.out);
  DeviceBuffer<float> d_lse(c.lse);
  std::vector<uint16_t> first[3];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer<bf16> d_dq(c.q.size()), d_dk(c.k.size()), d_dv(c.v.size());
    cu::cudnn_attention_backward(ctx, d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(), d_q.get(),
                                 d_k.get(), d_v.get(), d_out.get(), d_lse.get(), s.B, s.T, s.Hq,
                                 s.Hkv, s.D, stream.get());
    CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const std::vector<uint16_t> got[3] = {d_dq.download<uint16_t>(), d_dk.download<uint16_t>(),
                                          d_dv.download<uint16_t>()};
    for (int i = 0; i < 3; ++i) {
      if (run == 0) {
        first[i] = got[i];
      } else {
        EXPECT_TRUE(got[i] == first[i]) << "gradient " << i << " (dq, dk, dv) differs between runs";
      }
    }
  }
}

// Sets STRATA_ATTENTION for the lifetime of the guard.
class AttentionEnv {
 public:
  explicit AttentionEnv(const char* value) {
    if (const char* old = std::getenv("STRATA_ATTENTION")) old_ = old, had_ = true;
    setenv("STRATA_ATTENTION", value, 1);
  }
  ~AttentionEnv() {
    if (had_) {
      setenv("STRATA_ATTENTION", old_.c_str(), 1);
    } else {
      unsetenv("STRATA_ATTENTION");
    }
  }

 private:
  std::string old_;
  bool had_ = false;
};

// Through the op set: the forced fallback and the automatic choice each run the
// implementation the selection names, forward then backward from that forward's own out and
// lse, and both match the reference.
void op_set_matches_reference(const char* setting, AttentionForce force) {
  AttentionEnv env(setting);
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, uint64_t{2} << 30);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Result<kernels::CudaOps> created = kernels::CudaOps::create(*device.value());
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  kernels::CudaOps& ops = created.value();
  const kernels::AttentionCapability cap = kernels::CudaOps::attention_capability();
  for (const Shape& s : shapes()) {
    const std::string what = std::string("STRATA_ATTENTION=") + setting + " " + s.text();
    const AttentionChoice expected = kernels::choose_attention(cap, case_of(s), force);
    if (expected.impl == AttentionImpl::kNone) {
      std::printf("note: %s skipped: %s\n", what.c_str(), expected.reason.c_str());
      continue;
    }
    Case c(s);
    DeviceBuffer<bf16> d_q = upload_bf16(c.q), d_k = upload_bf16(c.k), d_v = upload_bf16(c.v);
    DeviceBuffer<bf16> d_dout = upload_bf16(c.dout);
    DeviceBuffer<bf16> d_out(c.out.size()), d_dq(c.q.size()), d_dk(c.k.size()), d_dv(c.v.size());
    DeviceBuffer<float> d_lse(c.lse.size());
    poison(d_out);
    poison(d_lse);
    poison(d_dq);
    poison(d_dk);
    poison(d_dv);
    ops.attention_forward(d_out.get(), d_lse.get(), d_q.get(), d_k.get(), d_v.get(), s.B, s.T, s.Hq,
                          s.Hkv, s.D);
    ops.attention_backward(d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(), d_q.get(), d_k.get(),
                           d_v.get(), d_out.get(), d_lse.get(), s.B, s.T, s.Hq, s.Hkv, s.D);
    ops.synchronize();
    // The op set may only differ from the selection where cuDNN failed to build (and then it
    // names the fallback); on a machine where cuDNN is chosen that is a failure of its own.
    const AttentionImpl ran = ops.attention_impl(s.B, s.T, s.Hq, s.Hkv, s.D);
    EXPECT_EQ(ran, expected.impl) << what << ": selection said " << expected.reason;
    const std::string at = what + " (" + kernels::attention_impl_name(ran) + ")";
    expect_close(download_bf16(d_out), c.out, kBf16Tol, at + " out");
    expect_close(download_f32(d_lse), c.lse, kLseTol, at + " lse");
    expect_close(download_bf16(d_dq), c.dq, kBf16Tol, at + " dq");
    expect_close(download_bf16(d_dk), c.dk, kBf16Tol, at + " dk");
    expect_close(download_bf16(d_dv), c.dv, kBf16Tol, at + " dv");
  }
}

TEST(AttentionParity, OpSetWithTheFallbackForcedMatchesTheReference) {
  op_set_matches_reference("fallback", AttentionForce::kFallback);
}

TEST(AttentionParity, OpSetLeftToChooseMatchesTheReference) {
  op_set_matches_reference("auto", AttentionForce::kAuto);
}

// Ring attention's blocks (context parallelism) through the op set against the CPU's fp32 blocks
// on the same bf16 inputs: a chunk's queries against its own keys (the causal block) and then
// against an earlier chunk's (a full block, cuDNN's unmasked graph), merged into fp32 sums; then
// both blocks' gradients from the merged out (rounded to bf16, as the decoder keeps it) and lse,
// the earlier chunk's written and the own chunk's added to. The GPU rounds each block's output
// and gradients to bf16 before they join the sums: kBf16Tol. Chunk lengths a multiple of 128 and
// one that is not.
TEST(AttentionParity, RingBlocksMatchTheCpuBlocks) {
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, uint64_t{2} << 30);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Result<kernels::CudaOps> created = kernels::CudaOps::create(*device.value());
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  kernels::CudaOps& ops = created.value();
  namespace cpu = kernels::cpu;
  using kernels::AttentionBlock;
  for (const Shape& s : {Shape{2, 128, 4, 2, 64}, Shape{1, 256, 8, 2, 128}, Shape{2, 17, 4, 4, 64}}) {
    const std::string what = "ring blocks " + s.text();
    const cu::CudnnAttentionPlan full = cu::cudnn_attention_prepare(ops.context(), s.B, s.T, s.Hq, s.Hkv, s.D, false);
    if (!full.ready) {
      std::printf("note: %s skipped: cuDNN cannot serve the full block: %s\n", what.c_str(), full.note.c_str());
      continue;
    }
    const int64_t nq = s.B * s.T * s.Hq * s.D, nkv = s.B * s.T * s.Hkv * s.D, nl = s.B * s.Hq * s.T;
    std::vector<float> q = random_vector(nq, 81, -1.5f, 1.5f), dout = random_vector(nq, 82);
    std::vector<float> k_own = random_vector(nkv, 83, -1.5f, 1.5f), v_own = random_vector(nkv, 84);
    std::vector<float> k_prev = random_vector(nkv, 85, -1.5f, 1.5f), v_prev = random_vector(nkv, 86);
    DeviceBuffer<bf16> d_q = upload_bf16(q), d_dout = upload_bf16(dout), d_k_own = upload_bf16(k_own),
                       d_v_own = upload_bf16(v_own), d_k_prev = upload_bf16(k_prev), d_v_prev = upload_bf16(v_prev);
    // The CPU's blocks, fp32 on the bf16-rounded inputs.
    std::vector<float> out(nq), lse(nl);
    cpu::attention_block_forward(out.data(), lse.data(), q.data(), k_own.data(), v_own.data(), s.B, s.T, s.T, s.Hq,
                                 s.Hkv, s.D, AttentionBlock::kCausal, false);
    cpu::attention_block_forward(out.data(), lse.data(), q.data(), k_prev.data(), v_prev.data(), s.B, s.T, s.T, s.Hq,
                                 s.Hkv, s.D, AttentionBlock::kFull, true);
    DeviceBuffer<float> d_out(nq), d_lse(nl);
    poison(d_out);
    poison(d_lse);
    ops.attention_block_forward(d_out.get(), d_lse.get(), d_q.get(), d_k_own.get(), d_v_own.get(), s.B, s.T, s.T,
                                s.Hq, s.Hkv, s.D, AttentionBlock::kCausal, false);
    ops.attention_block_forward(d_out.get(), d_lse.get(), d_q.get(), d_k_prev.get(), d_v_prev.get(), s.B, s.T, s.T,
                                s.Hq, s.Hkv, s.D, AttentionBlock::kFull, true);
    ops.synchronize();
    expect_close(download_f32(d_out), out, kBf16Tol, what + " out");
    expect_close(download_f32(d_lse), lse, kLseTol, what + " lse");

    // Backward from the CPU's merged out (rounded) and lse on both sides.
    DeviceBuffer<bf16> d_att = upload_bf16(out);
    DeviceBuffer<float> d_lse_in(lse);
    std::vector<float> dq(nq), dk_own(nkv), dv_own(nkv), dk_prev(nkv), dv_prev(nkv);
    cpu::attention_block_backward(dq.data(), dk_own.data(), dv_own.data(), dout.data(), q.data(), k_own.data(),
                                  v_own.data(), out.data(), lse.data(), s.B, s.T, s.T, s.Hq, s.Hkv, s.D,
                                  AttentionBlock::kCausal, false, false);
    cpu::attention_block_backward(dq.data(), dk_prev.data(), dv_prev.data(), dout.data(), q.data(), k_prev.data(),
                                  v_prev.data(), out.data(), lse.data(), s.B, s.T, s.T, s.Hq, s.Hkv, s.D,
                                  AttentionBlock::kFull, true, false);
    DeviceBuffer<float> d_dq(nq), d_dk_own(nkv), d_dv_own(nkv), d_dk_prev(nkv), d_dv_prev(nkv);
    for (DeviceBuffer<float>* b : {&d_dq, &d_dk_own, &d_dv_own, &d_dk_prev, &d_dv_prev}) poison(*b);
    ops.attention_block_backward(d_dq.get(), d_dk_own.get(), d_dv_own.get(), d_dout.get(), d_q.get(), d_k_own.get(),
                                 d_v_own.get(), d_att.get(), d_lse_in.get(), s.B, s.T, s.T, s.Hq, s.Hkv, s.D,
                                 AttentionBlock::kCausal, false, false);
    ops.attention_block_backward(d_dq.get(), d_dk_prev.get(), d_dv_prev.get(), d_dout.get(), d_q.get(), d_k_prev.get(),
                                 d_v_prev.get(), d_att.get(), d_lse_in.get(), s.B, s.T, s.T, s.Hq, s.Hkv, s.D,
                                 AttentionBlock::kFull, true, false);
    ops.synchronize();
    expect_close(download_f32(d_dq), dq, kBf16Tol, what + " dq");
    expect_close(download_f32(d_dk_own), dk_own, kBf16Tol, what + " dk (own chunk)");
    expect_close(download_f32(d_dv_own), dv_own, kBf16Tol, what + " dv (own chunk)");
    expect_close(download_f32(d_dk_prev), dk_prev, kBf16Tol, what + " dk (earlier chunk)");
    expect_close(download_f32(d_dv_prev), dv_prev, kBf16Tol, what + " dv (earlier chunk)");
  }
}

TEST(AttentionParity, AnUnknownOverrideIsRefused) {
  AttentionEnv env("flash");
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, uint64_t{1} << 30);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Result<kernels::CudaOps> created = kernels::CudaOps::create(*device.value());
  ASSERT_FALSE(created.ok());
  EXPECT_NE(created.status().to_string().find("auto, cudnn, fallback"), std::string::npos);
}

}  // namespace
}  // namespace strata::testing
