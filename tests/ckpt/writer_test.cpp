// CheckpointWriter: round trips on every engine, the file format seen by Python's safetensors,
// copy-on-write while the optimizer runs, atomic commit, retention, and busy handling.
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <cstring>
#include <set>

#include "ckpt/save_plan.h"
#include "ckpt_test_util.h"
#include "core/io_faulty.h"
#include "core/io_uring_engine.h"

namespace strata::ckpt::testing {
namespace {

// The thread-pool engine with `latency` added to every write.
IoEngineFactory slow_disk(std::chrono::microseconds latency) {
  return [latency] {
    FaultOptions f;
    f.write_latency = latency;
    return make_faulty_io_engine({.kind = "threads"}, f);
  };
}

void save_and_wait(CheckpointWriter& w, const SaveRequest& req) {
  Result<SaveStart> st = w.begin_save(req);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  ASSERT_EQ(*st, SaveStart::kStarted);
  Status done = w.wait();
  ASSERT_TRUE(done.ok()) << done.to_string();
}

void round_trip(const std::string& dir, const std::string& engine, uint64_t misalign) {
  TrainState state(1, misalign);
  CheckpointWriterOptions opt;
  opt.engine_factory = engine_of_kind(engine);
  opt.staging_bytes = 256 * kKiB;  // many pieces, several slots
  CheckpointWriter w(opt);
  save_and_wait(w, state.request(dir, 7));
  EXPECT_EQ(w.last_stats().engine, engine);
  EXPECT_GT(w.last_stats().direct_bytes, 0u) << "aligned parameters should be written in place";
  EXPECT_EQ(read_text(fs::path(dir) / "latest"), "step-7\n");
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-7.tmp"));

  ReaderOpenOptions ro;
  ro.verify = true;
  Result<std::unique_ptr<CheckpointReader>> r = CheckpointReader::open(dir, ro);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_checkpoint_equals(**r, state, state.snapshot());
  const Manifest& m = (*r)->manifest();
  EXPECT_EQ(m.step, 7);
  EXPECT_EQ(m.fields.tokens_seen, 7u * 4096);
  EXPECT_EQ(m.fields.data_cursor.epoch, 1);
  EXPECT_EQ(m.fields.data_cursor.index, 56);
  EXPECT_EQ(m.fields.optimizer_step, 7);
  EXPECT_EQ(m.fields.rng["data"], "0123456789abcdef");
  EXPECT_EQ(m.fields.model_config["hidden_size"], 96);
  EXPECT_EQ(m.fields.strata_version, "test");
  // Both files have their data at a 4 KiB boundary and their exact size on disk.
  for (const SavedFile& f : (*r)->files()) EXPECT_EQ(fs::file_size(f.path), f.size) << f.path;
  EXPECT_EQ((*r)->tensors().front().offset % 4096, 0u);
}

TEST_F(CkptTest, RoundTripIsBitwiseWithThreadPoolEngine) { round_trip(dir(), "threads", 0); }

TEST_F(CkptTest, RoundTripIsBitwiseWithIoUring) {
  IoEngineOptions o;
  if (!IoUringEngine::create(o).ok()) GTEST_SKIP() << "io_uring unavailable here";
  round_trip(dir(), "io_uring", 0);
}

TEST_F(CkptTest, RoundTripWithMisalignedRegionStagesIt) { round_trip(dir(), "threads", 12); }

TEST_F(CkptTest, Bf16TensorsReadBackAsF32) {
  HostBuffer buf(4096);
  uint16_t* h = reinterpret_cast<uint16_t*>(buf.data());
  const float values[4] = {1.0f, -2.5f, 0.15625f, 65536.0f};  // exact in bf16
  for (int i = 0; i < 4; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    h[i + 3] = static_cast<uint16_t>(u >> 16);
  }
  SaveRequest req;
  req.dir = dir();
  req.step = 1;
  req.regions.push_back(Region{TensorKind::kParam, buf.data(), 4096, {{"w", {2, 2}, DType::kBF16, 6}}});
  CheckpointWriter w;
  save_and_wait(w, req);
  auto r = CheckpointReader::open(dir());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ((*r)->find("w")->dtype, DType::kBF16);
  float out[4];
  ASSERT_TRUE((*r)->read_f32("w", out, 4).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], values[i]);
  EXPECT_EQ((*r)->read_f32("w", out, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->read_f32("nope", out, 4).code(), StatusCode::kNotFound);
}

TEST_F(CkptTest, ModelFileLoadsInPythonSafetensors) {
  if (std::system("/usr/bin/python3 -c 'from safetensors.numpy import load_file' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 with safetensors is not installed";
  }
  TrainState state;
  CheckpointWriter w;
  save_and_wait(w, state.request(dir(), 3));
  const fs::path out = dir_ / "py";
  fs::create_directories(out);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string script =
        "import sys\nfrom safetensors.numpy import load_file\nfrom safetensors import safe_open\n"
        "d = load_file(sys.argv[1])\n"
        "for k, v in d.items():\n"
        "    assert v.dtype.name == 'float32', v.dtype\n"
        "    v.tofile(sys.argv[2] + '/' + k.replace('/', '__'))\n"
        "with safe_open(sys.argv[1], 'np') as f:\n"
        "    assert f.metadata()['format'] == 'pt'\n"
        "print(len(d))\n";
    std::ofstream(out / "load.py") << script;
    const std::string cmd = "/usr/bin/python3 " + (out / "load.py").string() + " " + (dir_ / "step-3" / file).string() +
                            " " + out.string() + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    char line[4096] = {0};
    std::string text;
    while (fgets(line, sizeof line, p) != nullptr) text += line;
    ASSERT_EQ(pclose(p), 0) << text;
  }
  const auto snap = state.snapshot();
  for (size_t r = 0; r < state.regions.size(); ++r) {
    for (const RegionTensor& t : state.regions[r].tensors) {
      std::string q;
      for (char c : qualified_name(state.regions[r].kind, t.name)) q += c == '/' ? std::string("__") : std::string(1, c);
      const std::string got = read_text(out / q);
      ASSERT_EQ(got.size(), uint64_t(t.shape[0]) * 4) << q;
      EXPECT_EQ(0, std::memcmp(got.data(), snap[r].data() + t.offset, got.size())) << q;
    }
  }
}

// The request's regions, read through readers (as the trainer's chunk space is) instead of
// from memory. `fail_after` > 0: the reader fails from that call on.
SaveRequest with_readers(SaveRequest req, int fail_after = 0) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  for (Region& r : req.regions) {
    const char* data = static_cast<const char*>(r.data);
    r.data = nullptr;
    r.read = [data, calls, fail_after](uint64_t offset, uint64_t length, void* dst) {
      if (fail_after > 0 && ++*calls >= fail_after) return Status::IOError("injected read failure");
      std::memcpy(dst, data + offset, length);
      return Status::OK();
    };
  }
  return req;
}

// The optimizer overwrites every region piece by piece while the save runs; the checkpoint
// still holds the values of the save point, whichever way each piece was protected.
void cow_case(const std::string& dir, uint64_t staging, uint64_t misalign, bool expect_waits, bool readers = false) {
  TrainState state(24, misalign);  // ~12 MiB per region
  const auto at_save = state.snapshot();
  CheckpointWriterOptions opt;
  opt.staging_bytes = staging;
  opt.max_in_flight = 2;
  opt.engine_factory = slow_disk(std::chrono::microseconds(3000));
  CheckpointWriter w(opt);
  ASSERT_TRUE(w.begin_save(readers ? with_readers(state.request(dir, 5)) : state.request(dir, 5)).ok());
  // A step of the optimizer: regions in order, 100 KiB at a time (not aligned to pieces).
  std::mt19937 rng(9);
  const uint64_t step = 100 * 1000;
  for (int r = 0; r < 3; ++r) {
    const int region = (r + 1) % 3;  // not the order of the files
    char* data = state.buffers[region]->data();
    const uint64_t size = state.regions[region].size;
    for (uint64_t b = 0; b < size; b += step) {
      const uint64_t e = std::min(size, b + step);
      w.before_modify(region, b, e);
      for (uint64_t i = b; i < e; ++i) data[i] = static_cast<char>(rng());
    }
  }
  ASSERT_TRUE(w.wait().ok());
  const SaveStats s = w.last_stats();
  EXPECT_GT(s.cow_copied_bytes, 0u);
  if (readers) {
    EXPECT_EQ(s.direct_bytes, 0u) << "a region without memory cannot be written in place";
  }
  if (expect_waits) {
    EXPECT_GT(s.cow_waits, 0u);
  }
  auto r = CheckpointReader::open(dir, ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_checkpoint_equals(**r, state, at_save);
  // Modifying after the save ended costs nothing and changes nothing.
  w.before_modify(0, 0, state.regions[0].size);
}

TEST_F(CkptTest, CopyOnWriteKeepsTheStateOfTheSavePoint) { cow_case(dir(), 64 * kKiB, 0, true); }

TEST_F(CkptTest, CopyOnWriteWithRoomyStagingCopiesInsteadOfWaiting) { cow_case(dir(), 8 * kMiB, 20, false); }

TEST_F(CkptTest, CopyOnWriteThroughReadersWithTightStaging) { cow_case(dir(), 64 * kKiB, 0, true, true); }

TEST_F(CkptTest, CopyOnWriteThroughReadersWithRoomyStaging) { cow_case(dir(), 8 * kMiB, 0, false, true); }

TEST_F(CkptTest, RoundTripThroughReadersIsBitwise) {
  TrainState state(1, 0);
  CheckpointWriterOptions opt;
  opt.engine_factory = engine_of_kind("threads");
  opt.staging_bytes = 256 * kKiB;
  CheckpointWriter w(opt);
  save_and_wait(w, with_readers(state.request(dir(), 4)));
  EXPECT_EQ(w.last_stats().direct_bytes, 0u);
  EXPECT_GT(w.last_stats().staged_bytes, 0u);
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_checkpoint_equals(**r, state, state.snapshot());
}

TEST_F(CkptTest, ReaderErrorFailsTheSaveAndKeepsTheLatest) {
  TrainState state(4, 0);
  CheckpointWriterOptions opt;
  opt.engine_factory = engine_of_kind("threads");
  opt.staging_bytes = 256 * kKiB;
  CheckpointWriter w(opt);
  save_and_wait(w, state.request(dir(), 1));
  const auto at_one = state.snapshot();
  state.fill(7);
  ASSERT_TRUE(w.begin_save(with_readers(state.request(dir(), 2), /*fail_after=*/5)).ok());
  // The optimizer touches everything meanwhile; it must never hang on the failed save.
  for (int region = 0; region < 3; ++region) w.before_modify(region, 0, state.regions[region].size);
  Status st = w.wait();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("injected read failure"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(fs::path(dir()) / "step-2.tmp"));
  EXPECT_FALSE(fs::exists(fs::path(dir()) / "step-2"));
  EXPECT_EQ(read_text(fs::path(dir()) / "latest"), "step-1\n");
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_checkpoint_equals(**r, state, at_one);
  // The writer saves again afterwards.
  save_and_wait(w, with_readers(state.request(dir(), 3)));
}

TEST_F(CkptTest, CommitIsAtomicAndRetentionKeepsTheLastK) {
  TrainState state;
  fs::create_directories(dir_ / "step-99.tmp");  // left by a crash
  std::ofstream(dir_ / "step-99.tmp" / "model.safetensors") << "partial";
  CheckpointWriterOptions opt;
  opt.keep_last = 2;
  CheckpointWriter w(opt);
  for (int step = 1; step <= 5; ++step) {
    state.fill(step * 10);
    save_and_wait(w, state.request(dir(), step * 100));
    EXPECT_EQ(read_text(dir_ / "latest"), "step-" + std::to_string(step * 100) + "\n");
  }
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"latest", "step-400", "step-500"}));
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->step(), 500);
  expect_checkpoint_equals(**r, state, state.snapshot());
  auto old = CheckpointReader::open((dir_ / "step-400").string(), ReaderOpenOptions{true});
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_EQ(old.value()->step(), 400);
}

TEST_F(CkptTest, RetentionNeverDeletesTheStepLatestNames) {
  TrainState state;
  CheckpointWriter w;
  for (int step : {5, 6, 7}) save_and_wait(w, state.request(dir(), step));
  std::ofstream(dir_ / "latest") << "step-5\n";  // e.g. a manual rollback
  ASSERT_TRUE(apply_retention(dir(), 1, "step-5").ok());
  EXPECT_TRUE(fs::exists(dir_ / "step-5"));
  EXPECT_FALSE(fs::exists(dir_ / "step-6"));
  EXPECT_TRUE(fs::exists(dir_ / "step-7"));
}

TEST_F(CkptTest, ASaveMarkedBestIsNamedInBestAndKeptBesideTheLastK) {
  TrainState state;
  CheckpointWriterOptions opt;
  opt.keep_last = 1;
  CheckpointWriter w(opt);
  SaveRequest best = state.request(dir(), 2);
  save_and_wait(w, state.request(dir(), 1));
  best.best_note = "eval_loss 1.5";
  save_and_wait(w, best);
  for (int step : {3, 4}) save_and_wait(w, state.request(dir(), step));
  EXPECT_EQ(read_text(dir_ / "best"), "step-2\neval_loss 1.5\n");
  EXPECT_EQ(read_best_step(dir()), "step-2");
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"best", "latest", "step-2", "step-4"}));
  // A later best replaces it, and the old one goes at the next retention.
  SaveRequest better = state.request(dir(), 5);
  better.best_note = "eval_loss 1.25";
  save_and_wait(w, better);
  EXPECT_EQ(read_best_step(dir()), "step-5");
  EXPECT_FALSE(fs::exists(dir_ / "step-2"));
  EXPECT_FALSE(fs::exists(dir_ / "step-4"));
  EXPECT_TRUE(fs::exists(dir_ / "step-5"));
  // The best step saved again without a note (a run resumed from before it) holds other weights
  // now: best names nothing until the next best save.
  save_and_wait(w, state.request(dir(), 5));
  EXPECT_FALSE(fs::exists(dir_ / "best"));
  EXPECT_EQ(read_best_step(dir()), "");
}

// A removal that stops part-way (a kill during keep-last cleanup) leaves the half-deleted
// checkpoint out of the committed names, so no reader takes it for one; the next save removes it.
TEST_F(CkptTest, RetentionInterruptedMidRemovalLeavesNoHalfCheckpointBehindACommittedName) {
  TrainState state;
  CheckpointWriter w;
  for (int step : {1, 2, 3}) save_and_wait(w, state.request(dir(), step));
  // Removes one file of the tree, then fails, as a process killed mid-removal leaves it.
  int calls = 0;
  auto remove_one_file_then_fail = [&](const std::string& path) -> Status {
    if (!fs::exists(path)) return Status::OK();
    ++calls;
    for (const auto& e : fs::recursive_directory_iterator(path)) {
      if (e.is_regular_file()) {
        fs::remove(e.path());
        break;
      }
    }
    return Status::IOError("killed");
  };
  EXPECT_FALSE(apply_retention(dir(), 1, "step-3", remove_one_file_then_fail).ok());
  EXPECT_EQ(calls, 1);
  std::vector<StepEntry> committed, unfinished;
  ASSERT_TRUE(list_step_dirs(dir(), &committed, &unfinished).ok());
  for (const StepEntry& e : committed) {
    auto r = CheckpointReader::open((dir_ / e.name).string(), ReaderOpenOptions{true});
    EXPECT_TRUE(r.ok()) << e.name << " is committed but does not load: " << r.status().to_string();
  }
  ASSERT_EQ(unfinished.size(), 1u);
  EXPECT_EQ(unfinished[0].name, "step-1.deleting");
  // The next save clears the leftover, and retention then goes on as usual.
  CheckpointWriterOptions opt;
  opt.keep_last = 1;
  CheckpointWriter next(opt);
  save_and_wait(next, state.request(dir(), 4));
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"latest", "step-4"}));
}

TEST_F(CkptTest, SavingAStepAgainReplacesItAtomically) {
  TrainState state;
  CheckpointWriter w;
  save_and_wait(w, state.request(dir(), 3));
  state.fill(77);
  save_and_wait(w, state.request(dir(), 3));
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_checkpoint_equals(**r, state, state.snapshot());
  EXPECT_FALSE(fs::exists(dir_ / "step-3.tmp"));
}

TEST_F(CkptTest, BusyWriterSkipsOrWaitsAsConfigured) {
  TrainState state;
  for (IfBusy mode : {IfBusy::kSkip, IfBusy::kWait}) {
    CheckpointWriterOptions opt;
    opt.if_busy = mode;
    opt.max_in_flight = 1;
    opt.engine_factory = slow_disk(std::chrono::microseconds(20000));
    CheckpointWriter w(opt);
    ASSERT_EQ(w.begin_save(state.request(dir(), 1)).value(), SaveStart::kStarted);
    EXPECT_TRUE(w.in_flight());
    EXPECT_TRUE(w.poll().ok());
    Result<SaveStart> second = w.begin_save(state.request(dir(), 2));
    ASSERT_TRUE(second.ok());
    EXPECT_EQ(*second, mode == IfBusy::kSkip ? SaveStart::kSkippedBusy : SaveStart::kStarted);
    ASSERT_TRUE(w.wait().ok());
    EXPECT_FALSE(w.in_flight());
    EXPECT_EQ(read_text(dir_ / "latest"), mode == IfBusy::kSkip ? "step-1\n" : "step-2\n");
    fs::remove_all(dir_);
  }
}

TEST_F(CkptTest, CancelRemovesTheTmpDirAndKeepsLatest) {
  TrainState state(8);
  CheckpointWriterOptions opt;
  opt.max_in_flight = 1;
  CheckpointWriter w(opt);
  save_and_wait(w, state.request(dir(), 1));
  CheckpointWriterOptions slow = opt;
  slow.engine_factory = slow_disk(std::chrono::microseconds(20000));
  CheckpointWriter w2(slow);
  ASSERT_TRUE(w2.begin_save(state.request(dir(), 2)).ok());
  w2.cancel();
  Status st = w2.wait();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cancelled"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(dir_ / "step-2.tmp"));
  EXPECT_FALSE(fs::exists(dir_ / "step-2"));
  EXPECT_EQ(read_text(dir_ / "latest"), "step-1\n");
}

TEST_F(CkptTest, InvalidRequestsNameTheTensor) {
  HostBuffer buf(4096);
  SaveRequest req;
  req.dir = dir();
  req.step = 1;
  req.regions.push_back(Region{TensorKind::kParam, buf.data(), 4096,
                               {{"a", {512}, DType::kF32, 0}, {"b", {16}, DType::kF32, 2000}}});
  CheckpointWriter w;
  Result<SaveStart> st = w.begin_save(req);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("overlapping"), std::string::npos) << st.status().message();
  req.regions[0].tensors = {{"a", {2048}, DType::kF32, 0}};
  st = w.begin_save(req);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("'a'"), std::string::npos) << st.status().message();
  EXPECT_FALSE(fs::exists(dir_ / "step-1.tmp"));
}

TEST(SavePlanTest, PiecesTileEachFileAndSpansCoverEveryTensor) {
  TrainState state(3, 4);
  SaveRequest req = state.request("/nonexistent", 1);
  Result<SavePlan> plan = make_save_plan(req, 64 * kKiB);
  ASSERT_TRUE(plan.ok());
  for (const PlannedFile& f : plan->files) {
    EXPECT_EQ(f.data_start % kFileAlign, 0u);
    uint64_t pos = 0;
    for (int i = f.first_piece; i < f.end_piece; ++i) {
      const Piece& p = plan->pieces[i];
      EXPECT_EQ(p.offset, pos);
      EXPECT_EQ(p.offset % kFileAlign, 0u);
      EXPECT_EQ(p.length % kFileAlign, 0u);
      EXPECT_LE(p.length, 64 * kKiB);
      uint64_t covered = 0;
      for (const PieceSource& s : p.sources) {
        EXPECT_EQ(s.dst, covered);
        covered += s.length;
      }
      EXPECT_EQ(covered, p.real);
      pos += p.length;
    }
    EXPECT_EQ(pos, round_up(f.size, kFileAlign));
  }
  for (size_t r = 0; r < req.regions.size(); ++r) {
    uint64_t bytes = 0;
    for (const RegionSpan& s : plan->region_spans[r]) bytes += s.end - s.begin;
    uint64_t expect = 0;
    for (const RegionTensor& t : req.regions[r].tensors) expect += uint64_t(t.shape[0]) * 4;
    EXPECT_EQ(bytes, expect);
  }
}

}  // namespace
}  // namespace strata::ckpt::testing
