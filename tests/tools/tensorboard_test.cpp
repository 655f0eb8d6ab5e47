// TensorBoard event files: the record framing and CRC-32C against the format's definition (no
// Python needed), and a run and its resumption read back by TensorBoard's own loader: every
// scalar the run logged, each step once, with the values of metrics.jsonl.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/crc32c.h"
#include "tools/cli_util.h"
#include "train/tensorboard.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using strata::testing::CmdResult;
using strata::testing::run_strata;

TEST(Crc32c, MatchesTheCastagnoliCheckValues) {
  // The check value of CRC-32C ("123456789") and RFC 3720's 32 bytes of zeros and of 0xFF.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xFF');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  // Continuing from a prefix's CRC gives the whole's.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
}

TEST(TensorBoardRecords, AreFramedAsTfRecords) {
  const std::string data = "an event";
  const std::string r = tfrecord(data);
  ASSERT_EQ(r.size(), 8 + 4 + data.size() + 4);
  uint64_t length;
  uint32_t length_crc, data_crc;
  std::memcpy(&length, r.data(), 8);
  std::memcpy(&length_crc, r.data() + 8, 4);
  std::memcpy(&data_crc, r.data() + 12 + data.size(), 4);
  EXPECT_EQ(length, data.size());
  EXPECT_EQ(length_crc, mask_crc32c(crc32c(r.data(), 8)));
  EXPECT_EQ(r.substr(12, data.size()), data);
  EXPECT_EQ(data_crc, mask_crc32c(crc32c(data.data(), data.size())));
  // An Event: wall_time (field 1, fixed64), step (field 2, varint) and the body as given.
  const std::string e = tensorboard_event(1.5, 300, "");
  ASSERT_EQ(e.size(), 1 + 8 + 1 + 2);
  EXPECT_EQ(static_cast<uint8_t>(e[0]), 0x09);
  double wall;
  std::memcpy(&wall, e.data() + 1, 8);
  EXPECT_EQ(wall, 1.5);
  EXPECT_EQ(static_cast<uint8_t>(e[9]), 0x10);
  EXPECT_EQ(static_cast<uint8_t>(e[10]), 0xAC);  // 300 = 0b10_0101100: 0xAC 0x02
  EXPECT_EQ(static_cast<uint8_t>(e[11]), 0x02);
}

// The last value each step has in metrics.jsonl (a resumed run appends the steps it redoes).
std::map<int64_t, nlohmann::json> metrics_by_step(const fs::path& run) {
  std::map<int64_t, nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("step")) out[j["step"].get<int64_t>()] = j;
  }
  return out;
}

TEST(TensorBoardCli, ARunAndItsResumptionReadBackInTensorBoardWithEachStepOnce) {
  const fs::path dir = strata::testing::fresh_test_dir("strata_tensorboard");
  const fs::path run = dir / "run";
  const std::string keys = "train.steps=6 ckpt.every=2 optim.warmup_steps=1 run.dir=" + run.string() +
                           " ckpt.dir=" + (run / "ckpt").string();
  CmdResult first = run_strata("train " + keys);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Resumed from step 4 with another learning rate: steps 5 and 6 are logged again, differently.
  CmdResult again = run_strata("train " + keys + " optim.lr=1e-3 --resume " + (run / "ckpt" / "step-4").string());
  ASSERT_EQ(again.exit_code, 0) << again.output;
  int files = 0;
  for (const auto& e : fs::directory_iterator(run / "tensorboard"))
    files += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_EQ(files, 2);

  const std::string cmd = "/usr/bin/python3 " + std::string(STRATA_SOURCE_DIR) + "/tests/tools/tensorboard_reference.py " +
                          (run / "tensorboard").string() + " 2>/dev/null";  // TensorBoard logs the purge on stderr
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) GTEST_SKIP() << "python3 has no tensorboard package: " << out;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  const nlohmann::json scalars = nlohmann::json::parse(out);
  const std::map<int64_t, nlohmann::json> want = metrics_by_step(run);
  ASSERT_EQ(want.size(), 6u);
  for (const auto& [tag, field] : std::map<std::string, std::string>{
           {"train/loss", "loss"}, {"train/lr", "lr"}, {"train/grad_norm", "grad_norm"}}) {
    ASSERT_TRUE(scalars.contains(tag)) << out;
    const nlohmann::json& points = scalars[tag];
    ASSERT_EQ(points.size(), 6u) << tag << ": " << points.dump();
    for (size_t i = 0; i < points.size(); ++i) {
      const int64_t step = points[i][0].get<int64_t>();
      EXPECT_EQ(step, static_cast<int64_t>(i) + 1) << tag;
      const float got = points[i][1].get<float>();
      const float expected = static_cast<float>(want.at(step)[field].get<double>());
      EXPECT_EQ(got, expected) << tag << " at step " << step;
    }
  }
  for (const char* tag : {"perf/tokens_per_s", "perf/mfu", "memory/device_bytes", "memory/host_bytes",
                          "paging/moved_bytes", "paging/stall_ms", "run/goodput"})
    EXPECT_TRUE(scalars.contains(tag)) << tag << ": " << out;
  // The resumed lr shows from step 5 on: the values are the second run's.
  EXPECT_NE(scalars["train/lr"][3][1].get<float>(), scalars["train/lr"][4][1].get<float>());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
