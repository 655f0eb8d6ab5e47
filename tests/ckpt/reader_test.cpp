// CheckpointReader: path forms, and a clear error naming the file for every kind of damage;
// failed saves (ENOSPC, EIO) leave the previous checkpoint and `latest` untouched.
#include <unistd.h>

#include <cstdio>

#include "ckpt_test_util.h"
#include "core/io_faulty.h"

namespace strata::ckpt::testing {
namespace {

class ReaderTest : public CkptTest {
 protected:
  void SetUp() override {
    CkptTest::SetUp();
    CheckpointWriter w;
    ASSERT_TRUE(w.begin_save(state_.request(dir(), 12)).ok());
    ASSERT_TRUE(w.wait().ok());
    step_ = dir_ / "step-12";
  }
  // The error of opening the checkpoint (with checksums) after some damage.
  Status open_error(bool verify = true) {
    auto r = CheckpointReader::open(dir(), ReaderOpenOptions{verify});
    return r.status();
  }
  static void expect_mentions(const Status& st, const std::vector<std::string>& words) {
    ASSERT_FALSE(st.ok());
    for (const auto& w : words) EXPECT_NE(st.message().find(w), std::string::npos) << "'" << w << "' not in: " << st.message();
  }

  TrainState state_;
  fs::path step_;
};

TEST_F(ReaderTest, OpensDirLatestAndStepDirAlike) {
  for (const std::string& p : {dir(), dir() + "/", (dir_ / "latest").string(), step_.string()}) {
    auto r = CheckpointReader::open(p, ReaderOpenOptions{true});
    ASSERT_TRUE(r.ok()) << p << ": " << r.status().to_string();
    EXPECT_EQ((*r)->step(), 12);
    EXPECT_EQ((*r)->step_dir(), step_.string());
    expect_checkpoint_equals(**r, state_, state_.snapshot());
  }
}

TEST_F(ReaderTest, FlippedByteFailsTheChecksumNamingTheFile) {
  const fs::path f = step_ / "optimizer.safetensors";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(fs::file_size(f) - 100);
    char c;
    io.read(&c, 1);
    c ^= 0x10;
    io.seekp(fs::file_size(f) - 100);
    io.write(&c, 1);
  }
  Status st = open_error();
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  expect_mentions(st, {"checksum mismatch", f.string()});
  EXPECT_TRUE(open_error(false).ok()) << "without verify only sizes and headers are checked";
}

TEST_F(ReaderTest, TruncatedFileIsRefusedNamingTheFile) {
  const fs::path f = step_ / "model.safetensors";
  fs::resize_file(f, fs::file_size(f) - 4096);
  Status st = open_error(false);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  expect_mentions(st, {f.string(), "truncated"});
}

TEST_F(ReaderTest, MissingFileIsRefusedNamingTheFile) {
  const fs::path f = step_ / "optimizer.safetensors";
  fs::remove(f);
  Status st = open_error(false);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  expect_mentions(st, {f.string(), "missing"});
  fs::remove(step_ / "manifest.json");
  st = open_error(false);
  expect_mentions(st, {(step_ / "manifest.json").string()});
}

TEST_F(ReaderTest, NewerFormatAsksToUpgrade) {
  const fs::path m = step_ / "manifest.json";
  nlohmann::json j = nlohmann::json::parse(read_text(m));
  j["format_version"] = 2;
  std::ofstream(m) << j.dump(2);
  Status st = open_error(false);
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
  EXPECT_EQ(st.message(), "checkpoint " + step_.string() +
                              " was written by a newer strata (format 2; this build reads 1); upgrade strata");
}

TEST_F(ReaderTest, DamagedManifestAndHeaderAreRefused) {
  const fs::path m = step_ / "manifest.json";
  const std::string good = read_text(m);
  std::ofstream(m) << good.substr(0, good.size() / 2);
  expect_mentions(open_error(false), {m.string(), "not valid JSON"});
  std::ofstream(m) << good;
  // A header byte: the size stays, the JSON breaks.
  const fs::path f = step_ / "model.safetensors";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(8);
    io.write("X", 1);
  }
  expect_mentions(open_error(false), {f.string()});
}

// A manifest entry naming a file outside the step directory is refused before anything is
// read or hashed; so is a listed file that is a link.
TEST_F(ReaderTest, ManifestEntriesCannotLeaveTheStepDirectory) {
  const fs::path m = step_ / "manifest.json";
  const std::string good = read_text(m);
  const fs::path outside = dir_ / "outside.txt";
  std::ofstream(outside) << "not part of the checkpoint";
  nlohmann::json j = nlohmann::json::parse(good);
  j["files"]["../outside.txt"] = {{"size", 26}, {"xxh3_64", xxh3_hex(hash_file(outside.string()).value())}};
  std::ofstream(m) << j.dump(2);
  expect_mentions(open_error(), {m.string(), "plain file name"});

  std::ofstream(m) << good;
  const fs::path model = step_ / "model.safetensors";
  fs::rename(model, dir_ / "real.safetensors");
  fs::create_symlink(dir_ / "real.safetensors", model);
  expect_mentions(open_error(), {model.string(), "not a regular file"});
}

// The step a manifest records is the one its directory is named after.
TEST_F(ReaderTest, StepDisagreeingWithTheDirectoryNameIsRefused) {
  const fs::path m = step_ / "manifest.json";
  nlohmann::json j = nlohmann::json::parse(read_text(m));
  j["step"] = 7;
  j["optimizer_step"] = 7;
  std::ofstream(m) << j.dump(2);
  expect_mentions(open_error(false), {m.string(), "'step'", "step-12"});
}

// `latest` pointing at some other file (here a stand-in for /etc/passwd): refused without
// echoing what that file holds.
TEST_F(ReaderTest, LatestNamingAnythingButAStepIsRefusedWithoutEchoingIt) {
  const fs::path secret = dir_ / "passwd";
  std::ofstream(secret) << "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin\n";
  fs::remove(dir_ / "latest");
  fs::create_symlink(secret, dir_ / "latest");
  for (const std::string& p : {dir(), (dir_ / "latest").string()}) {
    Status st = CheckpointReader::open(p).status();
    expect_mentions(st, {(dir_ / "latest").string(), "step-N"});
    EXPECT_EQ(st.message().find("root"), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find("daemon"), std::string::npos) << st.message();
  }
  fs::remove(dir_ / "latest");
  for (const std::string& text : {std::string("../../etc\n"), std::string("step-12/../../x\n"),
                                  std::string("step-1\x1b]0;owned\x07\n")}) {
    std::ofstream(dir_ / "latest") << text;
    Status st = CheckpointReader::open(dir()).status();
    expect_mentions(st, {(dir_ / "latest").string(), "step-N"});
    EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << "control characters are not echoed";
    EXPECT_EQ(st.message().find("etc"), std::string::npos) << st.message();
  }
}

TEST_F(ReaderTest, NoCheckpointAtAll) {
  const fs::path empty = dir_ / "empty";
  fs::create_directories(empty);
  auto r = CheckpointReader::open(empty.string());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find((empty / "latest").string()), std::string::npos) << r.status().message();
}

// A writer whose engine fails while `inject` is set, and works normally otherwise.
struct FlakyDisk {
  bool inject = false;
  FaultOptions faults;
  IoEngineFactory factory() {
    return [this]() -> Result<std::unique_ptr<IoEngine>> {
      if (!inject) return make_io_engine({.kind = "threads"});
      return make_faulty_io_engine({.kind = "threads"}, faults);
    };
  }
};

void expect_failed_save_is_harmless(ReaderTest* t, const fs::path& dir, const TrainState& state, FlakyDisk* disk,
                                    const std::string& errno_word) {
  CheckpointWriterOptions opt;
  opt.engine_factory = disk->factory();
  opt.staging_bytes = 256 * kKiB;
  opt.keep_last = 1;
  CheckpointWriter w(opt);
  disk->inject = true;
  ASSERT_TRUE(w.begin_save(state.request(dir.string(), 13)).ok());
  Status st = w.wait();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find(errno_word), std::string::npos) << st.message();
  EXPECT_NE(st.message().find((dir / "step-13.tmp").string()), std::string::npos) << "names the file: " << st.message();
  EXPECT_FALSE(fs::exists(dir / "step-13.tmp"));
  EXPECT_FALSE(fs::exists(dir / "step-13"));
  EXPECT_EQ(read_text(dir / "latest"), "step-12\n");
  auto r = CheckpointReader::open(dir.string(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->step(), 12);
  // The same writer saves again once the disk behaves.
  disk->inject = false;
  ASSERT_TRUE(w.begin_save(state.request(dir.string(), 14)).ok());
  ASSERT_TRUE(w.wait().ok());
  EXPECT_EQ(read_text(dir / "latest"), "step-14\n");
  ASSERT_TRUE(CheckpointReader::open(dir.string(), ReaderOpenOptions{true}).ok());
  EXPECT_FALSE(fs::exists(dir / "step-12")) << "retention runs after a successful commit";
}

TEST_F(ReaderTest, EnospcFailsTheSaveAndLeavesThePreviousCheckpoint) {
  FlakyDisk disk;
  disk.faults.enospc_after_bytes = 300 * 1024;
  expect_failed_save_is_harmless(this, dir_, state_, &disk, "ENOSPC");
}

TEST_F(ReaderTest, EioFailsTheSaveAndLeavesThePreviousCheckpoint) {
  FlakyDisk disk;
  disk.faults.eio_write.every = 5;
  expect_failed_save_is_harmless(this, dir_, state_, &disk, "EIO");
}

}  // namespace
}  // namespace strata::ckpt::testing
