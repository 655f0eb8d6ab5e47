// One step of each precision recipe against the fp32 reference, from the same master weights on
// the same tokens: the loss and every gradient of the bf16 and fp8 recipes stay within bounds
// that follow from their rounding, dense and MoE alike.
//
// Why one step and not a training run: a trajectory of hundreds of steps amplifies every
// rounding difference, including OpenBLAS's choice of kernel for the CPU it runs on, so where two
// recipes land after 200 steps differs from machine to machine (tools/fp8_loss_bench.sh
// measures that, and bench/results records it). One step's error is a few roundings deep and
// does not depend on the GEMM's summation order beyond fp32's own rounding (2^-24), far below
// the bounds.
//
// The bounds. A recipe rounds the operands of each op to a format with unit roundoff u (bf16:
// 2^-8; E4M3 with power-of-two block scales: 2^-4, its 3 stored mantissa bits). To first order
// every error is linear in u, so a bound written as a multiple of u holds for both recipes
// with the same multiple: the loss within u/4 relative (the cross-entropy at initialisation is
// near log(V) and moves only through the logits' rounding), the gradients within 5u in relative
// L2 (a gradient passes through the rounding of about a dozen GEMM operands per layer, whose
// errors add in quadrature: sqrt(12) x u/sqrt(3) x 2 for both operands = 4u, and 5u leaves
// room for the second-order terms). The bf16 recipe's bounds are those of
// tests/model/decoder_bf16_test.cpp. Each recipe must round (not equal fp32), and fp8, whose
// GEMM operands are coarser, must land farther from fp32 than bf16 does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "model/decoder.h"
#include "train/paged_state.h"
#include "train_test_util.h"

namespace strata {
namespace {

constexpr int64_t kStepB = 2, kStepT = 32;

struct StepResult {
  double loss = 0;
  std::vector<float> grads;
};

// One micro-batch's loss and gradients under `precision`, from init_weights(seed)'s fp32 master.
StepResult one_step(const model::ModelConfig& mc, Precision precision, const Batch& batch) {
  const std::vector<float> init = initial_params(model::ParamLayout(mc), 11);
  auto dev = CpuDevice::create(0, 0);
  CHECK(dev.ok());
  auto io = make_io_engine({.kind = "threads"});
  CHECK(io.ok());
  std::unique_ptr<model::Model> net =
      model::make_cpu_decoder(StateLayout::of(precision).compute_dtype(), mc, dev->get());
  PagedStateOptions po;
  po.precision = precision;
  po.device_bytes = 1ull << 30;
  po.host_bytes = 1ull << 30;
  po.optimizer = optimizer_config(0.0f);
  auto paged = PagedState::create(**dev, io->get(), net->layout(), po);
  CHECK_MSG(paged.ok(), paged.status().to_string());
  PagedState& ps = **paged;
  CHECK(ps.load_params(init.data()).ok());
  net->set_access(&ps);
  CHECK(ps.zero_grads().ok());
  Result<double> loss = net->compute(batch.inputs.data(), batch.targets.data(), kStepB, kStepT, 1.0f / (kStepB * kStepT), true);
  CHECK_MSG(loss.ok(), loss.status().to_string());
  net->set_access(nullptr);
  StepResult out;
  out.loss = *loss;
  out.grads.assign(static_cast<size_t>(net->layout().total_size()), 0.0f);
  CHECK(ps.store_grads(out.grads.data()).ok());
  return out;
}

double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

class RecipeStepTest : public ::testing::TestWithParam<bool> {};

TEST_P(RecipeStepTest, Bf16AndFp8TrackTheFp32StepWithinTheirUnitRoundoff) {
  const model::ModelConfig mc = GetParam() ? fp8_moe_config() : fp8_config();
  const Batch batch = make_batches(1, kStepB * kStepT, 3).front();
  const StepResult ref = one_step(mc, Precision::kFp32, batch);
  ASSERT_TRUE(std::isfinite(ref.loss));
  struct StepCase {
    Precision precision;
    double u;
  };
  const StepCase cases[] = {{Precision::kBf16, std::ldexp(1.0, -8)}, {Precision::kFp8, std::ldexp(1.0, -4)}};
  double grad_err[2] = {};
  for (int i = 0; i < 2; ++i) {
    const StepCase& c = cases[i];
    const StepResult got = one_step(mc, c.precision, batch);
    const double loss_err = std::fabs(got.loss - ref.loss) / std::fabs(ref.loss);
    grad_err[i] = relative_l2(got.grads, ref.grads);
    std::printf("%s vs fp32: loss %.6f vs %.6f (relative error %.3g, bound %.3g); gradients relative L2 %.3g "
                "(bound %.3g)\n",
                precision_name(c.precision), got.loss, ref.loss, loss_err, c.u / 4, grad_err[i], 5 * c.u);
    EXPECT_TRUE(loss_err <= c.u / 4) << precision_name(c.precision) << ": loss " << got.loss << " vs " << ref.loss;
    EXPECT_TRUE(grad_err[i] <= 5 * c.u) << precision_name(c.precision) << ": gradients " << grad_err[i];
    EXPECT_GT(grad_err[i], 0.0) << precision_name(c.precision) << " did not round";
  }
  EXPECT_GT(grad_err[1], grad_err[0]) << "fp8's operands are coarser than bf16's";
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, RecipeStepTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Moe") : std::string("Dense"); });

}  // namespace
}  // namespace strata
