// RunDirs: unnamed runs get a new version folder, --resume auto takes the newest; one writer
// per folder (flock, the holder named); a requeued run with nothing to resume starts again and
// keeps the earlier metrics.
#include "train/run_dirs.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

namespace strata {
namespace {

namespace fs = std::filesystem;

class RunDirsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_rundirs");
  }
  void TearDown() override { fs::remove_all(dir_); }
  TrainConfig unnamed() {
    TrainConfig t;
    t.run_dir = (dir_ / "runs").string();
    return t;
  }
  fs::path dir_;
};

std::string read(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST_F(RunDirsTest, UnnamedRunsGetNewVersionsAndResumeAutoTakesTheNewest) {
  TrainConfig a = unnamed();
  a.nvme_path = "nvme";
  std::optional<RunDirs> first;
  {
    Result<RunDirs> r = RunDirs::open(a);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    first.emplace(std::move(r).value());
  }
  EXPECT_EQ(a.run_dir, (dir_ / "runs" / "version_0").string());
  EXPECT_EQ(a.ckpt_dir, (dir_ / "runs" / "version_0" / "checkpoints").string());
  EXPECT_EQ(a.nvme_path, (dir_ / "runs" / "version_0" / "nvme").string()) << "a relative nvme path is inside run.dir";
  std::ofstream(fs::path(a.run_dir) / "metrics.jsonl") << "{}\n";
  // A second run while the first still holds version_0 takes version_1.
  TrainConfig b = unnamed();
  Result<RunDirs> second = RunDirs::open(b);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_EQ(b.run_dir, (dir_ / "runs" / "version_1").string());
  // A failed start leaves no empty version behind; one with metrics stays.
  second->discard_if_unused();
  EXPECT_FALSE(fs::exists(b.run_dir));
  first->discard_if_unused();
  EXPECT_TRUE(fs::exists(a.run_dir));
  first.reset();
  // --resume auto continues the newest version.
  TrainConfig c = unnamed();
  c.resume = "auto";
  fs::create_directories(dir_ / "runs" / "version_3" / "checkpoints");
  std::ofstream(dir_ / "runs" / "version_3" / "checkpoints" / "latest") << "step-5\n";
  Result<RunDirs> resumed = RunDirs::open(c);
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  EXPECT_EQ(c.run_dir, (dir_ / "runs" / "version_3").string());
  // A named run.dir is taken as it is, and an absolute nvme path stays.
  TrainConfig named;
  named.run_dir = (dir_ / "mine").string();
  named.run_dir_named = true;
  named.nvme_path = "/somewhere/nvme";
  ASSERT_TRUE(RunDirs::open(named).ok());
  EXPECT_EQ(named.run_dir, (dir_ / "mine").string());
  EXPECT_EQ(named.nvme_path, "/somewhere/nvme");
}

TEST_F(RunDirsTest, ASecondWriterIsRefusedWithTheHoldersPid) {
  TrainConfig t;
  t.run_dir = (dir_ / "run").string();
  t.run_dir_named = true;
  auto held = std::make_unique<Result<RunDirs>>(RunDirs::open(t));
  ASSERT_TRUE(held->ok()) << held->status().to_string();
  // flock conflicts between two open files even within one process.
  TrainConfig again = t;
  again.ckpt_dir.clear();
  Result<RunDirs> refused = RunDirs::open(again);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("in use by another strata run (pid " + std::to_string(::getpid())),
            std::string::npos)
      << refused.status().message();
  // The ckpt.dir is locked too: another run.dir sharing it is refused.
  TrainConfig other;
  other.run_dir = (dir_ / "other").string();
  other.run_dir_named = true;
  other.ckpt_dir = t.ckpt_dir;
  other.ckpt_dir_named = true;
  Result<RunDirs> shared = RunDirs::open(other);
  ASSERT_FALSE(shared.ok());
  EXPECT_NE(shared.status().message().find("ckpt.dir '" + t.ckpt_dir + "' is in use"), std::string::npos)
      << shared.status().message();
  // Released with its holder.
  held.reset();
  EXPECT_TRUE(RunDirs::open(again).ok());
}

// A refused run removes only the folders it made itself: never a user's existing folder, and
// nothing is left behind when the refusal comes from opening the folders.
TEST_F(RunDirsTest, ARefusedRunRemovesOnlyTheFoldersItMade) {
  TrainConfig existing;
  existing.run_dir = (dir_ / "mine").string();
  existing.run_dir_named = true;
  fs::create_directories(existing.run_dir);
  std::ofstream(fs::path(existing.run_dir) / "notes.txt") << "keep me\n";
  {
    Result<RunDirs> r = RunDirs::open(existing);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    r->discard_if_unused();
  }
  EXPECT_EQ(read(fs::path(existing.run_dir) / "notes.txt"), "keep me\n");
  EXPECT_FALSE(fs::exists(fs::path(existing.run_dir) / "checkpoints")) << "the ckpt.dir it made goes";
  // The ckpt.dir is held by another run: the new run.dir made for this one is gone again.
  TrainConfig holder;
  holder.run_dir = (dir_ / "holder").string();
  holder.run_dir_named = true;
  Result<RunDirs> held = RunDirs::open(holder);
  ASSERT_TRUE(held.ok());
  TrainConfig refused;
  refused.run_dir = (dir_ / "new").string();
  refused.run_dir_named = true;
  refused.ckpt_dir = holder.ckpt_dir;
  refused.ckpt_dir_named = true;
  ASSERT_FALSE(RunDirs::open(refused).ok());
  EXPECT_FALSE(fs::exists(refused.run_dir));
  EXPECT_TRUE(fs::exists(holder.ckpt_dir));
}

TEST_F(RunDirsTest, ResumeAutoWithNothingToResumeKeepsTheOldMetricsAndStarts) {
  TrainConfig t;
  t.run_dir = (dir_ / "run").string();
  t.run_dir_named = true;
  fs::create_directories(t.run_dir);
  std::ofstream(fs::path(t.run_dir) / "metrics.jsonl") << "{\"step\":1}\n";
  // Without --resume the old run is protected.
  {
    TrainConfig fresh = t;
    Result<RunDirs> r = RunDirs::open(fresh);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("already holds a run's metrics"), std::string::npos);
  }
  for (int k = 1; k <= 2; ++k) {
    TrainConfig requeued = t;
    requeued.resume = "auto";
    std::ofstream(fs::path(t.run_dir) / "metrics.jsonl") << "{\"step\":" << k << "}\n";
    ASSERT_TRUE(RunDirs::open(requeued).ok());
    EXPECT_FALSE(fs::exists(fs::path(t.run_dir) / "metrics.jsonl"));
    EXPECT_EQ(read(fs::path(t.run_dir) / ("metrics.restart-" + std::to_string(k) + ".jsonl")),
              "{\"step\":" + std::to_string(k) + "}\n");
  }
}

}  // namespace
}  // namespace strata
