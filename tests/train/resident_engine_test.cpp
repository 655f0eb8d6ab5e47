// The resident engine (the CUDA model's path through the trainer) over a CPU model with the
// same contract: training, checkpoints, resume and export through it must give bitwise what
// the paged CPU engine gives, and its host copy must never change under a save in flight.
#include "train/resident_engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ckpt/reader.h"
#include "memory/io_faulty.h"
#include "model/decoder.h"
#include "train/checkpointing.h"
#include "train/trainer.h"
#include "train_test_util.h"
#if STRATA_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

model::ModelConfig tiny_preset() { return model::ModelConfig::preset("tiny").value(); }

TrainConfig resuming(TrainConfig t, const fs::path& checkpoint) {
  t.resume = checkpoint.string();
  return t;
}

// The CPU model on flat buffers with the flat AdamW: what CudaLlama is to the GPU.
class FlatCpuModel final : public ResidentModel {
 public:
  FlatCpuModel(const model::ModelConfig& mc, const OptimizerConfig& oc) : net_(mc), adam_(net_.layout(), oc) {}

  const model::ParamLayout& layout() const override { return net_.layout(); }
  std::string device_name() const override { return "cpu (flat)"; }
  uint64_t resident_bytes() const override { return static_cast<uint64_t>(net_.layout().total_size()) * 16; }
  void load_params(const float* flat) override {
    std::memcpy(net_.params(), flat, bytes());
  }
  void store_params(float* flat) override { std::memcpy(flat, net_.params(), bytes()); }
  void load_moments(const float* m, const float* v) override {
    std::memcpy(adam_.m(), m, bytes());
    std::memcpy(adam_.v(), v, bytes());
  }
  void store_moments(float* m, float* v) override {
    std::memcpy(m, adam_.m(), bytes());
    std::memcpy(v, adam_.v(), bytes());
  }
  void zero_grads() override { net_.zero_grads(); }
  Result<double> forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                  float grad_scale) override {
    return net_.compute(inputs, targets, B, T, grad_scale, /*backward=*/true);
  }
  Result<double> adamw_step(float lr) override {
    const double norm = adam_.clip_gradients(net_.grads(), adam_.config().grad_clip);
    adam_.step(net_.params(), net_.grads(), lr);
    return norm;
  }
  int64_t step_count() const override { return adam_.step_count(); }
  void set_step_count(int64_t steps) override { adam_.set_step_count(steps); }

 private:
  size_t bytes() const { return static_cast<size_t>(net_.layout().total_size()) * sizeof(float); }
  model::LlamaModel net_;
  AdamW adam_;
};

Result<std::unique_ptr<TrainEngine>> flat_resident_engine(const model::ModelConfig& mc, const TrainConfig&,
                                                          const OptimizerConfig& oc) {
  return std::unique_ptr<TrainEngine>(new ResidentEngine(std::make_unique<FlatCpuModel>(mc, oc)));
}

class ResidentEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("strata_resident_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A TrainConfig for a short run in dir_/NAME: the tiny preset learning the license texts,
  // tight budgets (every kind pages through host and nvme on the paged engine).
  TrainConfig config(const std::string& name, int64_t steps, std::vector<std::string> extra = {}) {
    const fs::path run = dir_ / name;
    std::vector<std::string> overrides = {"model.preset=tiny",
                                          "data.paths=[builtin:licenses]",
                                          "train.micro_batch=2",
                                          "train.seq_len=32",
                                          "train.grad_accum=2",
                                          "train.steps=" + std::to_string(steps),
                                          "optim.warmup_steps=1",
                                          "optim.grad_clip=0.5",
                                          "memory.device=24MiB",
                                          "memory.host=10MiB",
                                          "memory.nvme.path=" + (run / "nvme").string(),
                                          "memory.nvme.size=64MiB",
                                          "run.device=cpu",
                                          "run.dir=" + run.string(),
                                          "ckpt.dir=" + (dir_ / "ckpt").string(),
                                          "ckpt.every=2",
                                          "run.export=" + (run / "export").string()};
    overrides.insert(overrides.end(), extra.begin(), extra.end());
    Result<Config> c = Config::parse(train_schema(), "", "<test>", overrides);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    Result<TrainConfig> t = make_train_config(*c);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return *t;
  }
  fs::path dir_;
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// (loss, grad_norm) of every step in RUN/metrics.jsonl, as their JSON text (exact digits).
std::vector<std::string> step_figures(const fs::path& run) {
  std::vector<std::string> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    out.push_back(j["loss"].dump() + " " + j["grad_norm"].dump());
  }
  return out;
}

// Every tensor of two checkpoints equal bitwise, and the same run position.
void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  auto ra = ckpt::CheckpointReader::open(a.string(), ckpt::ReaderOpenOptions{true});
  auto rb = ckpt::CheckpointReader::open(b.string(), ckpt::ReaderOpenOptions{true});
  ASSERT_TRUE(ra.ok()) << ra.status().to_string();
  ASSERT_TRUE(rb.ok()) << rb.status().to_string();
  EXPECT_EQ((*ra)->step(), (*rb)->step());
  EXPECT_EQ((*ra)->manifest().fields.optimizer_step, (*rb)->manifest().fields.optimizer_step);
  EXPECT_EQ((*ra)->manifest().fields.data_cursor.index, (*rb)->manifest().fields.data_cursor.index);
  model::ParamLayout layout(tiny_preset());
  for (ckpt::TensorKind kind : {ckpt::TensorKind::kParam, ckpt::TensorKind::kAdamM, ckpt::TensorKind::kAdamV}) {
    for (const auto& t : layout.tensors()) {
      const std::string name = ckpt::qualified_name(kind, t.name);
      std::vector<float> x(static_cast<size_t>(t.numel)), y(x.size());
      ASSERT_TRUE((*ra)->read_f32(name, x.data(), x.size()).ok()) << name;
      ASSERT_TRUE((*rb)->read_f32(name, y.data(), y.size()).ok()) << name;
      EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << name << " differs";
    }
  }
}

// Four steps on each engine, saving every two; then each engine resumes from the other's
// step-2 checkpoint: the checkpoint format is the same whichever engine wrote or reads it.
TEST_F(ResidentEngineTest, TrainsResumesAndExportsBitwiseLikeThePagedEngine) {
  ASSERT_TRUE(run_training(config("paged", 4, {"ckpt.dir=" + (dir_ / "ckpt_paged").string()}), "").ok());
  Result<TrainSummary> r =
      run_training(config("resident", 4, {"ckpt.dir=" + (dir_ / "ckpt_resident").string()}), "", flat_resident_engine);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->steps_done, 4);
  const auto figures = step_figures(dir_ / "resident");
  ASSERT_EQ(figures.size(), 4u);
  EXPECT_EQ(figures, step_figures(dir_ / "paged"));
  expect_same_checkpoint(dir_ / "ckpt_paged" / "step-2", dir_ / "ckpt_resident" / "step-2");
  expect_same_checkpoint(dir_ / "ckpt_paged" / "step-4", dir_ / "ckpt_resident" / "step-4");
  const std::string exported = read_file(dir_ / "paged" / "export" / "model.safetensors");
  ASSERT_FALSE(exported.empty());
  EXPECT_TRUE(exported == read_file(dir_ / "resident" / "export" / "model.safetensors"));

  // The paged engine resumes the resident engine's step 2, and the other way round.
  ASSERT_TRUE(run_training(resuming(config("paged2", 4, {"ckpt.dir=" + (dir_ / "ckpt_paged2").string()}),
                                    dir_ / "ckpt_resident" / "step-2"),
                           "")
                  .ok());
  r = run_training(resuming(config("resident2", 4, {"ckpt.dir=" + (dir_ / "ckpt_resident2").string()}),
                            dir_ / "ckpt_paged" / "step-2"),
                   "", flat_resident_engine);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (const char* run : {"paged2", "resident2"}) {
    EXPECT_EQ(step_figures(dir_ / run), std::vector<std::string>(figures.begin() + 2, figures.end())) << run;
    EXPECT_TRUE(exported == read_file(dir_ / run / "export" / "model.safetensors")) << run;
  }
  expect_same_checkpoint(dir_ / "ckpt_paged" / "step-4", dir_ / "ckpt_resident2" / "step-4");
  expect_same_checkpoint(dir_ / "ckpt_paged" / "step-4", dir_ / "ckpt_paged2" / "step-4");
}

// A save writes the host copy in place while training goes on; refreshing that copy (an export,
// the next save) while the save still reads it must wait for it, so the checkpoint holds the
// state of its step. A slow disk keeps the save in flight across the next step and the read.
TEST_F(ResidentEngineTest, HostCopyIsNotOverwrittenUnderASaveInFlight) {
  const model::ModelConfig mc = tiny_config(false);
  const OptimizerConfig oc = optimizer_config(0.5f);
  auto model = std::make_unique<FlatCpuModel>(mc, oc);
  std::vector<float> init(static_cast<size_t>(model::ParamLayout(mc).total_size()));
  {
    model::LlamaModel net(mc);
    net.init_weights(3);
    std::memcpy(init.data(), net.params(), init.size() * sizeof(float));
  }
  model->load_params(init.data());
  ResidentEngine engine(std::move(model));
  const std::vector<Batch> batches = make_batches(4, 2 * 16, 5);
  auto step = [&](const Batch& b) {
    ASSERT_TRUE(engine.zero_grads().ok());
    ASSERT_TRUE(engine.micro_batch(b.inputs.data(), b.targets.data(), 2, 16, 1.0f / 32, true, 1e-2f).ok());
    ASSERT_TRUE(engine.step(1e-2f).ok());
  };
  step(batches[0]);
  const size_t n = init.size();
  std::vector<std::vector<float>> at_save(3, std::vector<float>(n));
  const StateKind kinds[] = {StateKind::kParam, StateKind::kAdamM, StateKind::kAdamV};
  for (int k = 0; k < 3; ++k)
    ASSERT_TRUE(engine.state().read_flat(kinds[k], 0, n * sizeof(float), at_save[k].data()).ok());

  CheckpointOptions co;
  co.dir = (dir_ / "ckpt").string();
  co.staging_bytes = 64 << 10;
  TrainCheckpointer checkpointer(co, engine.layout(), engine.state(), faulty_engine(std::chrono::milliseconds(20)));
  RunPosition pos;
  pos.step = 1;
  pos.optimizer_step = 1;
  ASSERT_TRUE(checkpointer.save(engine.state(), pos, mc.to_json(), 0).ok());
  EXPECT_TRUE(checkpointer.in_flight());
  step(batches[1]);
  std::vector<float> now(n);
  ASSERT_TRUE(engine.state().read_flat(StateKind::kParam, 0, n * sizeof(float), now.data()).ok());
  EXPECT_NE(0, std::memcmp(now.data(), at_save[0].data(), n * sizeof(float))) << "the step changed nothing";
  ASSERT_TRUE(checkpointer.wait().ok());

  auto reader = ckpt::CheckpointReader::open(co.dir, ckpt::ReaderOpenOptions{true});
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  const ckpt::TensorKind saved[] = {ckpt::TensorKind::kParam, ckpt::TensorKind::kAdamM, ckpt::TensorKind::kAdamV};
  for (int k = 0; k < 3; ++k) {
    for (const auto& t : engine.layout().tensors()) {
      std::vector<float> got(static_cast<size_t>(t.numel));
      ASSERT_TRUE((*reader)->read_f32(ckpt::qualified_name(saved[k], t.name), got.data(), got.size()).ok());
      ASSERT_EQ(0, std::memcmp(got.data(), at_save[k].data() + t.offset, got.size() * sizeof(float)))
          << ckpt::tensor_kind_name(saved[k]) << " " << t.name << " is not the state of the saved step";
    }
  }
}

// With skip_if_busy, a save due while another is being written is skipped and says so (the
// trainer then keeps its last saved step, and its final save waits instead of skipping).
TEST_F(ResidentEngineTest, SaveSaysWhenItWasSkippedBecauseTheWriterWasBusy) {
  const model::ModelConfig mc = tiny_config(false);
  ResidentEngine engine(std::make_unique<FlatCpuModel>(mc, optimizer_config(0.5f)));
  CheckpointOptions co;
  co.dir = (dir_ / "ckpt").string();
  co.skip_if_busy = true;
  TrainCheckpointer checkpointer(co, engine.layout(), engine.state(), faulty_engine(std::chrono::milliseconds(20)));
  RunPosition pos;
  pos.step = 1;
  Result<bool> first = checkpointer.save(engine.state(), pos, mc.to_json(), 0);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_TRUE(*first);
  ASSERT_TRUE(checkpointer.in_flight());
  pos.step = 2;
  Result<bool> second = checkpointer.save(engine.state(), pos, mc.to_json(), 0);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_FALSE(*second);
  ASSERT_TRUE(checkpointer.wait().ok());
  EXPECT_TRUE(fs::exists(dir_ / "ckpt" / "step-1"));
  EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "step-2"));
}

TEST_F(ResidentEngineTest, DeviceChoiceSaysWhyWithoutAGpu) {
#if STRATA_HAVE_CUDA
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: run.device=cuda would use it";
#endif
  const model::ModelConfig mc = tiny_preset();
  TrainConfig t = config("choice", 1, {"run.device=cuda"});
  Result<std::unique_ptr<TrainEngine>> cuda = make_train_engine(mc, t, optimizer_config(1.0f));
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("run.device=cuda"), std::string::npos) << cuda.status().message();
#if STRATA_HAVE_CUDA
  EXPECT_EQ(cuda.status().code(), StatusCode::kNotFound) << cuda.status().to_string();
#else
  EXPECT_NE(cuda.status().message().find("-DSTRATA_CUDA=ON"), std::string::npos) << cuda.status().message();
#endif
  t.device = "auto";
  Result<std::unique_ptr<TrainEngine>> automatic = make_train_engine(mc, t, optimizer_config(1.0f));
  ASSERT_TRUE(automatic.ok()) << automatic.status().to_string();
  EXPECT_EQ((*automatic)->device_name(), "cpu");
}

}  // namespace
}  // namespace strata
