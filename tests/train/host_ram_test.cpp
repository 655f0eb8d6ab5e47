// The host-memory plan: its items add up to the peak, each follows its setting, and a peak
// the machine does not have is refused with both numbers.
#include "train/host_ram.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "core/units.h"
#include "train_test_util.h"
#include "train/paged_state.h"
#include "train/planning.h"
#include "train/trainer.h"

namespace strata {
namespace {

// The embedded default's settings (with `overrides`), resolved as PagedEngine resolves them.
struct Planned {
  model::ModelConfig mc;
  TrainConfig t;
  Plan plan;
};

Planned planned(const std::vector<std::string>& overrides) {
  Planned p;
  Result<Config> config = load_train_config("", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  Result<TrainConfig> t = make_train_config(*config);
  EXPECT_TRUE(t.ok()) << t.status().message();
  p.t = *t;
  p.t.nvme_path = "/tmp/nvme";  // resolved inside run.dir by a run; any path plans the same
  Result<model::ModelConfig> mc = resolve_model_config(p.t);
  EXPECT_TRUE(mc.ok()) << mc.status().message();
  p.mc = *mc;
  if (p.t.chunk_size == 0) p.t.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(p.mc), p.t.precision);
  p.plan = make_plan(make_plan_input(p.mc, p.t, DeviceKind::kCpu));
  EXPECT_TRUE(p.plan.fits) << p.plan.problem;
  return p;
}

const std::vector<std::string> kMoe = {
    "model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96,model_type=mixtral,num_local_experts=4,"
    "num_experts_per_tok=2,router_bias_update_rate=0.05]"};

TEST(HostRamTest, ItemsAddUpToThePeakForTheDefaultAndAMoeRun) {
  for (const auto& overrides : {std::vector<std::string>{}, kMoe}) {
    const Planned p = planned(overrides);
    HostRamData data;
    data.mapped_bytes = 1 << 20;
    data.windows = 1000;
    const HostRamPlan ram = plan_host_ram(p.mc, p.t, p.plan, DeviceKind::kCpu, data);
    uint64_t sum = 0, pinned = 0;
    for (const HostRamItem& i : ram.items) {
      sum += i.bytes;
      pinned += i.pinned;
      EXPECT_LE(i.pinned, i.bytes) << i.name;
    }
    EXPECT_LE(ram.load_overlap, ram.bytes_of("weights"));
    EXPECT_EQ(ram.peak(), sum - ram.load_overlap);
    EXPECT_EQ(ram.pinned(), pinned);
    EXPECT_EQ(ram.reclaimable(), data.mapped_bytes);
    for (const char* name : {"chunks", "staging", "device", "checkpoint", "io", "data", "mapped data", "tokenizer",
                             "weights", "process", "compute"}) {
      bool found = false;
      for (const HostRamItem& i : ram.items) found = found || i.name == name;
      EXPECT_TRUE(found) << "no item " << name;
    }
    // The host tier is what the paged state reserves: the demo's nvme tier registers (pins) it.
    PagedStateOptions po;
    po.host_bytes = p.t.memory_host;
    po.nvme_bytes = p.t.nvme_size;
    po.chunk_bytes = p.t.chunk_size;
    po.offload_activations = p.plan.offload_activations;
    po.activation_tokens = p.t.micro_batch * p.t.seq_len;
    const HostTierSize tier = PagedState::host_tier_size(model::ParamLayout(p.mc), po);
    EXPECT_EQ(ram.bytes_of("chunks") + ram.bytes_of("staging"), tier.reserved_bytes);
    EXPECT_EQ(ram.pinned(), tier.reserved_bytes);
    // The baseline follows the process's peak so far, which only grows: a later call gives at
    // least as much, and never less than the 16 MiB floor.
    EXPECT_GE(ram.bytes_of("process"), uint64_t{16} << 20);
    EXPECT_LE(ram.bytes_of("process"), process_baseline_bytes(DeviceKind::kCpu));
    const std::string line = format_host_ram(ram);
    EXPECT_EQ(line.rfind("host RAM: peak ", 0), 0u) << line;
    EXPECT_NE(line.find("chunks "), std::string::npos) << line;
    const std::string items = format_host_ram_items(ram, "  ");
    EXPECT_NE(items.find("padding and slot rounding"), std::string::npos) << items;
  }
}

TEST(HostRamTest, EachItemFollowsItsSetting) {
  const Planned plain = planned({});
  const HostRamPlan base = plan_host_ram(plain.mc, plain.t, plain.plan, DeviceKind::kCpu);
  EXPECT_EQ(base.bytes_of("checkpoint"), 0u) << "no periodic saves, no staging";
  EXPECT_EQ(base.bytes_of("staging") % plain.t.chunk_size, 0u);

  const Planned saving = planned({"ckpt.every=10", "ckpt.staging=8MiB"});
  const HostRamPlan ckpt = plan_host_ram(saving.mc, saving.t, saving.plan, DeviceKind::kCpu);
  EXPECT_EQ(ckpt.bytes_of("checkpoint"), 8u << 20);
  EXPECT_GT(ckpt.bytes_of("io"), base.bytes_of("io")) << "a save writes through an engine of its own";
  // 64 MiB of staging in 8 MiB pieces: a save of the demo's 853,120 parameters (10.2 MB of
  // weights and moments) touches no more than those bytes and a piece of hashing scratch.
  const Planned roomy = planned({"ckpt.every=10"});
  EXPECT_EQ(plan_host_ram(roomy.mc, roomy.t, roomy.plan, DeviceKind::kCpu).bytes_of("checkpoint"),
            853120u * 12 + (8u << 20));

  const Planned smaller = planned({"train.micro_batch=4"});
  const HostRamPlan batch = plan_host_ram(smaller.mc, smaller.t, smaller.plan, DeviceKind::kCpu);
  EXPECT_EQ(base.bytes_of("data") - batch.bytes_of("data"), 2u * 4 * 128 * sizeof(int32_t))
      << "inputs and targets of 4 sequences of 128 fewer";

  const Planned bf16 = planned({"train.precision=bf16"});
  EXPECT_EQ(base.bytes_of("compute"), 0u);
  EXPECT_GT(plan_host_ram(bf16.mc, bf16.t, bf16.plan, DeviceKind::kCpu).bytes_of("compute"), 0u)
      << "the emulated bf16 ops widen their operands on the heap";

  const Planned resumed = planned({});
  TrainConfig t = resumed.t;
  t.resume = "auto";
  EXPECT_GT(plan_host_ram(resumed.mc, t, resumed.plan, DeviceKind::kCpu).bytes_of("weights"),
            base.bytes_of("weights"));
  EXPECT_GT(plan_host_ram(plain.mc, plain.t, plain.plan, DeviceKind::kCuda).bytes_of("process"),
            base.bytes_of("process"))
      << "the CUDA runtime's host memory";
}

// The host tier the paged state reserves is the one planned: with an nvme tier, one slot more
// than the state's chunks, for staging moves to and from disk (it used to be left out, as the
// nvme budget was read before it was set).
TEST(HostRamTest, ThePagedStateReservesThePlannedHostTierWithItsNvmeStagingSlot) {
  const model::ModelConfig mc = tiny_config(/*tied=*/false);
  const std::filesystem::path nvme = std::filesystem::path(::testing::TempDir()) / ("strata_host_ram_nvme_" + std::to_string(::getpid()));
  std::filesystem::create_directories(nvme);
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  auto io = make_io_engine({.kind = "threads"});
  ASSERT_TRUE(io.ok());
  PagedStateOptions po;
  po.device_bytes = 1 << 20;
  po.host_bytes = 1ull << 30;  // far more than the state: the reservation is what it needs
  po.nvme_bytes = 64 << 20;
  po.nvme_dir = nvme.string();
  const model::ParamLayout layout(mc);
  const HostTierSize planned = PagedState::host_tier_size(layout, po);
  EXPECT_EQ(planned.staging_chunks, 1u);
  auto state = PagedState::create(**device, io->get(), layout, po);
  ASSERT_TRUE(state.ok()) << state.status().to_string();
  EXPECT_EQ((*state)->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes, planned.reserved_bytes);
  EXPECT_EQ(planned.reserved_bytes, (planned.state_chunks + 1) * planned.chunk_bytes);
  state->reset();
  std::filesystem::remove_all(nvme);
}

// A host tier that is not pinned (the cpu backend without an nvme tier) is resident only where
// it is written: the state homed there and the few slots a load passes through, not its whole
// reservation; a pinned one (an nvme tier registers it) is resident whole.
TEST(HostRamTest, AnUnpinnedHostTierCountsTheStateHomedThereAndAFewSlots) {
  const Planned roomy = planned({"memory.nvme.path=", "memory.nvme.size=0", "memory.device=1GiB", "memory.host=1GiB"});
  const HostRamPlan ram = plan_host_ram(roomy.mc, roomy.t, roomy.plan, DeviceKind::kCpu);
  const uint64_t chunk = roomy.t.chunk_size;
  EXPECT_EQ(roomy.plan.host.total(), 0u) << "the roomy plan keeps everything on the device";
  EXPECT_EQ(ram.bytes_of("chunks"), 4 * chunk);
  EXPECT_EQ(ram.items[0].pinned, 0u);
  const Planned pinned = planned({"memory.device=1GiB", "memory.host=1GiB"});
  PagedStateOptions po;
  po.host_bytes = pinned.t.memory_host;
  po.nvme_bytes = pinned.t.nvme_size;
  po.chunk_bytes = pinned.t.chunk_size;
  po.placement = pinned.plan.placement;
  const HostTierSize tier = PagedState::host_tier_size(model::ParamLayout(pinned.mc), po);
  const HostRamPlan locked = plan_host_ram(pinned.mc, pinned.t, pinned.plan, DeviceKind::kCpu);
  EXPECT_EQ(locked.bytes_of("chunks") + locked.bytes_of("staging"), tier.reserved_bytes);
}

TEST(HostRamTest, APeakBeyondWhatIsAvailableIsRefusedWithBothNumbers) {
  const Planned p = planned({});
  HostRamData data;
  data.mapped_bytes = 1ull << 40;  // a terabyte of token files: file pages, not held against the machine
  const HostRamPlan ram = plan_host_ram(p.mc, p.t, p.plan, DeviceKind::kCpu, data);
  const uint64_t needed = ram.peak() - ram.reclaimable();
  EXPECT_TRUE(check_host_ram(ram, HostMemory{.known = true, .available = needed, .source = "MemAvailable"}).ok());
  EXPECT_TRUE(check_host_ram(ram, HostMemory{}).ok()) << "unknown: nothing to refuse against";
  const Status refused =
      check_host_ram(ram, HostMemory{.known = true, .available = needed / 2, .source = "MemAvailable"});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(refused.message().find(format_bytes(needed)), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find(format_bytes(needed / 2)), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("MemAvailable"), std::string::npos) << refused.message();
}

}  // namespace
}  // namespace strata
