// Checkpoints of a paged training state: a save streams the state out of the chunk space while
// the optimizer keeps changing it, and still holds exactly the state of its step; a save that
// runs out of disk fails alone (training goes on, the previous checkpoint stays); a restore
// under other budgets gives the same state back.
#include "train/checkpointing.h"
#include "train/paged_state.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/cpu_device.h"
#include "core/io_faulty.h"
#include "model/decoder.h"
#include "train_test_util.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kB = 2, kT = 16;

struct Budgets {
  uint64_t device = 0, host = 0, nvme = 0;  // in chunks of the test's chunk size
};

// A model and its paged state on the CPU backend, in a precision recipe, trained one step at a
// time.
class Trainer {
 public:
  Trainer(const fs::path& dir, Budgets b, Precision precision,
          kernels::MomentFormat moments = kernels::MomentFormat::kF32)
      : mc_(tiny_config(false)),
        device_(CpuDevice::create(0, 0).value()),
        net_(model::make_cpu_decoder(StateLayout::of(precision).compute_dtype(), mc_, device_.get())) {
    io_ = make_io_engine({.kind = "threads"}).value();
    std::vector<float> init(static_cast<size_t>(net_->layout().total_size()));
    model::init_weights(net_->layout(), init.data(), 7);
    // About a layer per chunk, so that small budgets page every kind.
    uint64_t chunk = 0;
    for (const auto& t : net_->layout().tensors()) chunk = std::max<uint64_t>(chunk, t.numel * 4);
    chunk = (chunk + 4095) / 4096 * 4096;
    PagedStateOptions po;
    po.chunk_bytes = chunk;
    po.device_bytes = b.device * chunk;
    po.host_bytes = b.host * chunk;
    po.nvme_bytes = b.nvme * chunk;
    po.nvme_dir = (dir / "nvme").string();
    fs::create_directories(po.nvme_dir);
    po.optimizer = optimizer_config(0.5f);
    po.precision = precision;
    po.moments = moments;
    state_ = PagedState::create(*device_, io_.get(), net_->layout(), po).value();
    CHECK(state_->load_params(init.data()).ok());
    net_->set_access(state_.get());
    batches_ = make_batches(64, kB * kT, 11);
  }
  ~Trainer() { net_->set_access(nullptr); }

  double step() {
    const double loss = forward_backward();
    update();
    return loss;
  }
  // The two halves of step(): the gradients, then the optimizer.
  double forward_backward() {
    const Batch& b = batches_[static_cast<size_t>(steps_++) % batches_.size()];
    EXPECT_TRUE(state_->zero_grads().ok());
    Result<double> loss = net_->compute(b.inputs.data(), b.targets.data(), kB, kT, 1.0f / (kB * kT), true);
    EXPECT_TRUE(loss.ok()) << loss.status().to_string();
    return loss.ok() ? *loss : NAN;
  }
  void update() { EXPECT_TRUE(state_->clip_and_step(1e-2f).ok()); }
  // Parameters, m and v as flat vectors.
  std::vector<std::vector<float>> snapshot() {
    const size_t n = static_cast<size_t>(net_->layout().total_size());
    std::vector<std::vector<float>> s(3, std::vector<float>(n));
    EXPECT_TRUE(state_->store_params(s[0].data()).ok());
    EXPECT_TRUE(state_->store_moments(s[1].data(), s[2].data()).ok());
    return s;
  }
  RunPosition position() const {
    RunPosition p;
    p.step = steps_;
    p.optimizer_step = state_->step_count();
    return p;
  }
  PagedState& state() { return *state_; }
  const model::ParamLayout& layout() const { return net_->layout(); }
  const model::ModelConfig& config() const { return mc_; }

 private:
  model::ModelConfig mc_;
  std::unique_ptr<CpuDevice> device_;
  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<model::Model> net_;
  std::unique_ptr<PagedState> state_;
  std::vector<Batch> batches_;
  int64_t steps_ = 0;
};

// Every saved tensor equals `want` (params, m, v) bitwise.
void expect_checkpoint_holds(const std::string& dir, const model::ParamLayout& layout,
                             const std::vector<std::vector<float>>& want) {
  auto reader = ckpt::CheckpointReader::open(dir, ckpt::ReaderOpenOptions{true});
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  const ckpt::TensorKind kinds[] = {ckpt::TensorKind::kParam, ckpt::TensorKind::kAdamM, ckpt::TensorKind::kAdamV};
  for (int k = 0; k < 3; ++k) {
    for (const auto& t : layout.tensors()) {
      std::vector<float> got(static_cast<size_t>(t.numel));
      ASSERT_TRUE((*reader)->read_f32(ckpt::qualified_name(kinds[k], t.name), got.data(), got.size()).ok());
      ASSERT_EQ(0, std::memcmp(got.data(), want[k].data() + t.offset, got.size() * sizeof(float)))
          << ckpt::tensor_kind_name(kinds[k]) << " " << t.name << " is not the state of the saved step";
    }
  }
}

// Model configs match key by key: a changed value, a key only one side has, or no recorded
// config at all is refused, naming the key.
TEST(CompareModelConfigsTest, EveryKeyMustMatch) {
  const nlohmann::json run = tiny_config(false).to_json();
  EXPECT_TRUE(compare_model_configs(run, run).ok());
  // As read back from a manifest: integers come back unsigned, floats as doubles.
  EXPECT_TRUE(compare_model_configs(nlohmann::json::parse(run.dump()), run).ok());
  nlohmann::json changed = run;
  changed["rms_norm_eps"] = 1e-3;
  Status st = compare_model_configs(changed, run);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'rms_norm_eps'"), std::string::npos) << st.message();
  nlohmann::json missing = run;
  missing.erase("num_hidden_layers");
  st = compare_model_configs(missing, run);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'num_hidden_layers'"), std::string::npos) << st.message();
  nlohmann::json extra = run;
  extra["num_experts"] = 8;
  st = compare_model_configs(extra, run);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'num_experts'"), std::string::npos) << st.message();
  EXPECT_FALSE(compare_model_configs(nlohmann::json::object(), run).ok());
  // The source's precision (saved for exports) may differ: a run from bf16 weights resumes.
  nlohmann::json bf16 = run;
  bf16["torch_dtype"] = "bfloat16";
  EXPECT_TRUE(compare_model_configs(bf16, run).ok());
  bf16.erase("torch_dtype");
  EXPECT_TRUE(compare_model_configs(bf16, run).ok());
}

// Every recipe: the bf16 and fp8 ones save and restore their fp32 master (the compute copy is
// made from it again), with a fifth kind of a group in host memory during AdamW (hence a little
// more host); compact moments are saved decoded and encode back to the same bytes.
struct CkptRecipe {
  Precision precision;
  kernels::MomentFormat moments;
};

class CheckpointingTest : public ::testing::TestWithParam<CkptRecipe> {
 protected:
  Budgets tight() const { return {6, GetParam().precision != Precision::kFp32 ? 10u : 8u, 96}; }
  Precision recipe() const { return GetParam().precision; }
  kernels::MomentFormat moments() const { return GetParam().moments; }
  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_checkpointing");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// A disk whose writes wait until the test opens it (or 60 s pass, after which it stays open, so
// that a mistake cannot hang the suite), over a slow faulty engine: the save stays in flight for
// as long as the test needs, however loaded the machine is (a fixed latency alone raced the
// steps on a busy one: a slow forward and backward let the save finish before the optimizer).
class GatedIoEngine final : public IoEngine {
 public:
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    void release() {
      {
        std::lock_guard<std::mutex> lock(mu);
        open = true;
      }
      cv.notify_all();
    }
    void pass() {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return open; })) open = true;
    }
  };
  GatedIoEngine(std::unique_ptr<IoEngine> inner, std::shared_ptr<Gate> gate)
      : inner_(std::move(inner)), gate_(std::move(gate)) {}
  const char* name() const override { return inner_->name(); }
  Result<int> register_file(int fd, const std::string& path) override { return inner_->register_file(fd, path); }
  Status register_buffer(void* base, uint64_t length) override { return inner_->register_buffer(base, length); }
  Result<IoTicket> submit(const IoRequest& request) override {
    if (request.op == IoOp::kWrite) gate_->pass();
    return inner_->submit(request);
  }
  Status wait(IoTicket ticket) override { return inner_->wait(ticket); }
  bool done(IoTicket ticket) override { return inner_->done(ticket); }
  bool set_transfer_hook(TransferHook* hook) override { return inner_->set_transfer_hook(hook); }
  std::string file_path(int file) const override { return inner_->file_path(file); }

 private:
  std::unique_ptr<IoEngine> inner_;
  std::shared_ptr<Gate> gate_;
};

// Tight budgets put parameters and moments in every tier; a closed disk (writes wait for the
// gate) and 64 KiB of staging keep the save in flight through the next step's forward and
// backward; the disk opens, slowly (100 ms per write: a loaded machine's optimizer must still
// outpace it), as its optimizer starts to change every byte of the state, and stays open for
// two more steps. (The optimizer may wait for bytes the
// save has not written yet, so the gate cannot stay shut through it.)
TEST_P(CheckpointingTest, SaveDuringTrainingHoldsTheStateOfItsStep) {
  Trainer tr(dir_, tight(), recipe(), moments());
  for (int i = 0; i < 2; ++i) tr.step();
  const auto at_save = tr.snapshot();
  CheckpointOptions co;
  co.dir = (dir_ / "ckpt").string();
  co.staging_bytes = 64 * 1024;
  auto gate = std::make_shared<GatedIoEngine::Gate>();
  const ckpt::IoEngineFactory slow = faulty_engine(std::chrono::milliseconds(100));
  ckpt::IoEngineFactory gated = [gate, slow]() -> Result<std::unique_ptr<IoEngine>> {
    ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> inner, slow());
    return std::unique_ptr<IoEngine>(std::make_unique<GatedIoEngine>(std::move(inner), gate));
  };
  TrainCheckpointer ck(co, tr.layout(), tr.state(), gated);
  ASSERT_TRUE(ck.save(tr.state(), tr.position(), tr.config().to_json(), 1).ok());
  EXPECT_TRUE(ck.in_flight());
  EXPECT_TRUE(std::isfinite(tr.forward_backward()));
  EXPECT_TRUE(ck.in_flight());
  gate->release();
  tr.update();
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(std::isfinite(tr.step()));
  ASSERT_TRUE(ck.wait().ok());
  const ckpt::SaveStats s = ck.last_stats();
  EXPECT_GT(s.cow_copied_bytes + s.cow_waits, 0u) << "the optimizer should have met bytes not yet written";
  expect_checkpoint_holds(co.dir, tr.layout(), at_save);
  EXPECT_NE(tr.snapshot()[0], at_save[0]) << "training went on";

  // Restored under other budgets (no nvme tier, more device memory): the same state.
  Trainer other(dir_ / "other", {12, 64, 0}, recipe(), moments());
  Result<RunPosition> pos = restore_checkpoint(co.dir, other.config().to_json(), other.layout(), other.state());
  ASSERT_TRUE(pos.ok()) << pos.status().to_string();
  EXPECT_EQ(pos->step, 2);
  EXPECT_EQ(other.state().step_count(), 2);
  const auto restored = other.snapshot();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(restored[k], at_save[k]) << "kind " << k;
}

// ENOSPC in the middle of a save: that save fails with a line naming the file, training goes
// on, DIR/latest still names the previous checkpoint, which verifies; the next save succeeds.
TEST_P(CheckpointingTest, OutOfSpaceDuringASaveKeepsTrainingAndThePreviousCheckpoint) {
  Trainer tr(dir_, tight(), recipe(), moments());
  tr.step();
  CheckpointOptions co;
  co.dir = (dir_ / "ckpt").string();
  co.staging_bytes = 256 * 1024;
  auto saves = std::make_shared<std::atomic<int>>(0);
  ckpt::IoEngineFactory factory = [saves]() {
    const bool full_disk = ++*saves == 2;  // the second save finds the disk full
    return faulty_engine(std::chrono::microseconds(0), full_disk ? 64 * 1024 : UINT64_MAX)();
  };
  TrainCheckpointer ck(co, tr.layout(), tr.state(), factory);
  ASSERT_TRUE(ck.save(tr.state(), tr.position(), tr.config().to_json(), 1).ok());
  ASSERT_TRUE(ck.wait().ok());
  const auto at_one = tr.snapshot();

  tr.step();
  ASSERT_TRUE(ck.save(tr.state(), tr.position(), tr.config().to_json(), 1).ok());
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(std::isfinite(tr.step()));
  Status failed = ck.wait();
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("No space left on device"), std::string::npos) << failed.message();
  EXPECT_NE(failed.message().find(".safetensors"), std::string::npos) << "names the file: " << failed.message();
  EXPECT_FALSE(fs::exists(fs::path(co.dir) / "step-2.tmp"));
  EXPECT_FALSE(fs::exists(fs::path(co.dir) / "step-2"));
  std::ifstream latest(fs::path(co.dir) / "latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-1");
  expect_checkpoint_holds(co.dir, tr.layout(), at_one);

  for (int i = 0; i < 2; ++i) EXPECT_TRUE(std::isfinite(tr.step()));
  const auto at_six = tr.snapshot();
  ASSERT_TRUE(ck.save(tr.state(), tr.position(), tr.config().to_json(), 1).ok());
  ASSERT_TRUE(ck.wait().ok());
  expect_checkpoint_holds(co.dir, tr.layout(), at_six);
}

INSTANTIATE_TEST_SUITE_P(Recipes, CheckpointingTest,
                         ::testing::Values(CkptRecipe{Precision::kFp32, kernels::MomentFormat::kF32},
                                           CkptRecipe{Precision::kBf16, kernels::MomentFormat::kF32},
                                           CkptRecipe{Precision::kFp8, kernels::MomentFormat::kF32},
                                           CkptRecipe{Precision::kFp8, kernels::MomentFormat::kInt8},
                                           CkptRecipe{Precision::kBf16, kernels::MomentFormat::kBf16}),
                         [](const ::testing::TestParamInfo<CkptRecipe>& info) {
                           return std::string(precision_name(info.param.precision)) + "_" +
                                  kernels::moment_format_name(info.param.moments);
                         });

}  // namespace
}  // namespace strata
