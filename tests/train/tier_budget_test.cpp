// Tier budgets larger than the state: the device tier, like the host tier, reserves only the
// slots the state can occupy, so a huge memory.device costs nothing up front; and on the cpu
// backend, whose device memory is this machine's, a reservation the machine cannot hold is
// refused by name before it is made.
#include <gtest/gtest.h>

#include <string>

#include "core/cpu_device.h"
#include "core/host_memory.h"
#include "model/params.h"
#include "train/paged_state.h"
#include "train_test_util.h"

namespace strata {
namespace {

constexpr uint64_t kTiB = uint64_t{1} << 40;

Result<std::unique_ptr<PagedState>> paged(Device& device, const model::ParamLayout& layout, uint64_t device_bytes) {
  PagedStateOptions po;
  po.precision = Precision::kFp32;
  po.device_bytes = device_bytes;
  po.host_bytes = 1ull << 20;
  po.optimizer = optimizer_config(0.0f);
  return PagedState::create(device, nullptr, layout, po);
}

TEST(TierBudget, AHugeDeviceBudgetReservesOnlyWhatTheStateCanUse) {
  const model::ModelConfig mc = tiny_config(false);
  const model::ParamLayout layout(mc);
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  Result<std::unique_ptr<PagedState>> ps = paged(**device, layout, 4 * kTiB);
  ASSERT_TRUE(ps.ok()) << ps.status().to_string();
  const ChunkSpaceStats stats = (*ps)->stats();
  const uint64_t state = static_cast<uint64_t>(layout.total_size()) * 4 * 4;  // fp32 param, grad, m, v
  const uint64_t capacity = stats.tiers[static_cast<int>(Tier::kDevice)].capacity_bytes;
  EXPECT_GE(capacity, state) << "every kind of the state fits on the device";
  // Each kind's chunks are padded at most one chunk per group and kind.
  const uint64_t chunk = (*ps)->store().chunk_bytes();
  const uint64_t groups = static_cast<uint64_t>(layout.num_layers()) + 2;
  EXPECT_LE(capacity, state + 4 * groups * chunk) << "the device tier reserved slots for the whole 4 TiB";
}

TEST(TierBudget, ACpuDeviceReservationTheMachineLacksIsRefusedByName) {
  const HostMemory machine = available_host_memory();
  if (!machine.known) GTEST_SKIP() << "this machine does not say how much memory it has available";
  // A model whose fp32 state needs more than the machine has: refused before anything is made.
  model::ModelConfig mc = tiny_config(false);
  mc.hidden_size = 4096;
  mc.intermediate_size = 16384;
  mc.num_attention_heads = 32;
  mc.num_key_value_heads = 8;
  mc.head_dim = 128;
  mc.num_hidden_layers = static_cast<int64_t>(machine.available / (16ull * 260'000'000)) + 2;  // ~0.26B per layer
  mc.vocab_size = 256;
  const model::ParamLayout layout(mc);
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  Result<std::unique_ptr<PagedState>> ps = paged(**device, layout, 4 * kTiB);
  ASSERT_FALSE(ps.ok()) << "a state larger than this machine was reserved in the cpu device's memory";
  EXPECT_EQ(ps.status().code(), StatusCode::kOutOfMemory) << ps.status().to_string();
  EXPECT_NE(ps.status().message().find("memory.device"), std::string::npos) << ps.status().to_string();
  EXPECT_NE(ps.status().message().find("available"), std::string::npos) << ps.status().to_string();
}

}  // namespace
}  // namespace strata
