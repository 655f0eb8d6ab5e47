// The optimizer's check of what AdamW writes: finite gradients do not make a finite update
// (optim.eps = 0 divides 0 by 0 where a gradient and both moments are 0), so the kernels report
// any NaN or Inf among the parameters they write, and a step that wrote one is an error naming
// the first such tensor. Wherever the group is updated: in the device tier (the backend's
// StateKernels), in host memory (the SIMD path), with compact moments, with AdamW overlapped.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/cpu_device.h"
#include "model/params.h"
#include "offload/placement.h"
#include "offload/state_layout.h"
#include "train/paged_state.h"
#include "train_test_util.h"

namespace strata {
namespace {

// The tensor whose update goes wrong: a middle layer's, not the first in layout order.
constexpr const char* kBadTensor = "model.layers.1.mlp.up_proj.weight";

struct Case {
  Precision precision;
  kernels::MomentFormat moments;
  Tier moments_home;  // where AdamW runs
  bool overlap;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << precision_name(c.precision) << " moments " << kernels::moment_format_name(c.moments) << " in "
      << (c.moments_home == Tier::kDevice ? "device" : "host") << (c.overlap ? " overlapped" : "");
}

class NonFiniteUpdateTest : public ::testing::TestWithParam<Case> {
 protected:
  // One step from zero gradients with Adam moments of 1 everywhere but kBadTensor's, which are
  // 0: with eps = 0 its update is 0 / 0, every other tensor's stays finite.
  Result<double> step(float eps) {
    const Case& c = GetParam();
    const model::ModelConfig mc = tiny_config(false);
    const model::ParamLayout layout(mc);
    auto device = CpuDevice::create(0, 0);
    CHECK(device.ok());
    device_ = std::move(*device);
    PagedStateOptions po;
    po.precision = c.precision;
    po.moments = c.moments;
    po.device_bytes = po.host_bytes = 64ull << 20;
    po.optimizer = optimizer_config(c.overlap ? 0.0f : 0.5f);
    po.optimizer.eps = eps;
    po.overlap_optimizer = c.overlap;
    Placement placement(static_cast<int>(mc.num_hidden_layers) + 2);
    for (int g = 0; g < placement.num_groups(); ++g)
      for (StateKind k : StateLayout::of(c.precision, c.moments).kinds())
        placement.row(g, k).home =
            k == StateKind::kAdamM || k == StateKind::kAdamV || k == StateLayout::of(c.precision).master_kind()
                ? c.moments_home
                : Tier::kDevice;
    po.placement = placement;
    auto ps = PagedState::create(*device_, nullptr, layout, po);
    if (!ps.ok()) return ps.status();
    state_ = std::move(*ps);
    std::vector<float> params(static_cast<size_t>(layout.total_size()));
    model::init_weights(layout, params.data(), 7);
    EXPECT_TRUE(state_->load_params(params.data()).ok());
    std::vector<float> m(params.size(), 1.0f), v = m;
    const model::TensorSpec* bad = layout.find(kBadTensor);
    CHECK(bad != nullptr);
    std::fill_n(m.begin() + bad->offset, bad->numel, 0.0f);
    std::fill_n(v.begin() + bad->offset, bad->numel, 0.0f);
    EXPECT_TRUE(state_->load_moments(m.data(), v.data()).ok());
    EXPECT_TRUE(state_->zero_grads().ok());
    state_->begin_last_micro_batch(1e-2f);
    return state_->clip_and_step(1e-2f);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<PagedState> state_;
};

TEST_P(NonFiniteUpdateTest, ANaNWrittenByTheUpdateIsAnErrorNamingTheTensor) {
  Result<double> stepped = step(0.0f);
  ASSERT_FALSE(stepped.ok()) << "the update wrote 0 / 0 and the step went on";
  const std::string& message = stepped.status().message();
  EXPECT_NE(message.find(std::string("'") + kBadTensor + "'"), std::string::npos) << message;
  EXPECT_NE(message.find("set optim.eps > 0"), std::string::npos) << message;
  EXPECT_NE(message.find("stops without saving this state"), std::string::npos) << message;
}

TEST_P(NonFiniteUpdateTest, TheSameStepWithEpsIsFine) {
  Result<double> stepped = step(1e-8f);
  ASSERT_TRUE(stepped.ok()) << stepped.status().to_string();
  EXPECT_EQ(*stepped, 0.0) << "the gradients were all zero";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Precision precision : {Precision::kFp32, Precision::kBf16})
    for (kernels::MomentFormat moments :
         {kernels::MomentFormat::kF32, kernels::MomentFormat::kBf16, kernels::MomentFormat::kInt8})
      for (Tier home : {Tier::kDevice, Tier::kHost}) out.push_back({precision, moments, home, false});
  out.push_back({Precision::kFp32, kernels::MomentFormat::kF32, Tier::kDevice, true});
  out.push_back({Precision::kBf16, kernels::MomentFormat::kF32, Tier::kHost, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Tiers, NonFiniteUpdateTest, ::testing::ValuesIn(cases()));

}  // namespace
}  // namespace strata
