// Tensors saved in slices: the ranks of a sharded save each write an element range of the same
// tensors (ZeRO over element ranges) through the real writer and an in-process exchange; the
// reader joins them into whole tensors, reads any range across slice boundaries, verifies them,
// and refuses slices that do not tile their tensor. Python's safetensors reads the files.
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <set>

#include "ckpt_test_util.h"

namespace strata::ckpt::testing {
namespace {

constexpr int kWorld = 3;
using Files = std::map<std::string, FileRecord>;

// ShardedSave::exchange between the writers of one process, for one save: every rank's
// outcome and files are gathered; rank 0 gets them all (and commits), the others nothing, and
// every rank fails when any rank failed.
class LocalExchange {
 public:
  ShardedSave shard(int rank) {
    ShardedSave s;
    s.rank = rank;
    s.world = kWorld;
    s.exchange = [this, rank](const Status& own, const Files& files) { return exchange(rank, own, files); };
    return s;
  }
  // Rank `rank` failed before its writer started: it reports without waiting for the others.
  void report_failure(int rank, const Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    arrive(rank, st, {});
  }

 private:
  Result<Files> exchange(int rank, const Status& own, const Files& files) {
    std::unique_lock<std::mutex> lock(mu_);
    arrive(rank, own, files);
    cv_.wait(lock, [&] { return arrived_ == kWorld; });
    if (!failed_.empty()) return Status::IOError("the checkpoint was not committed: " + failed_);
    return rank == 0 ? merged_ : Files{};
  }
  void arrive(int rank, const Status& own, const Files& files) {  // REQUIRES: mu_ held
    if (!own.ok()) failed_ += "rank " + std::to_string(rank) + ": " + own.message() + "; ";
    merged_.insert(files.begin(), files.end());
    ++arrived_;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;     // GUARDED_BY(mu_)
  std::string failed_;  // GUARDED_BY(mu_)
  Files merged_;        // GUARDED_BY(mu_)
};

// What a rank saves of a tensor: a slice, nothing (an empty slice), or the whole tensor.
constexpr TensorSlice kNothing{0, 0};
constexpr TensorSlice kWhole{0, std::numeric_limits<uint64_t>::max()};

struct LogicalTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;           // of the parameter; the moments are F32
  std::vector<TensorSlice> share;      // per rank
  std::vector<DType> rank_dtype = {};  // per rank, when a rank writes another dtype
  uint64_t numel() const { return *checked_numel(shape); }
};

// The logical tensors of every kind (param, adam_m, adam_v, each split the same way), random
// but finite, and each rank's regions holding only its shares, packed with odd gaps.
struct SlicedState {
  std::vector<LogicalTensor> tensors = {
      {"model.embed_tokens.weight", {64, 50}, DType::kF32, {{0, 1000}, {1000, 2200}, kNothing}},
      {"model.layers.0.mlp.up_proj.weight", {24, 37}, DType::kF32, {{0, 300}, {300, 1}, {301, 587}}},
      {"model.layers.0.self_attn.o_proj.weight", {16, 33}, DType::kBF16, {{0, 171}, kNothing, {171, 357}}},
      {"model.norm.weight", {37}, DType::kF32, {kNothing, kWhole, kNothing}},
      {"lm_head.weight", {50, 21}, DType::kF32, {{0, 500}, {500, 277}, {777, 273}}},
  };
  static constexpr TensorKind kKinds[] = {TensorKind::kParam, TensorKind::kAdamM, TensorKind::kAdamV};
  std::map<std::string, std::vector<char>> truth;  // qualified name -> the whole tensor's bytes
  std::vector<std::unique_ptr<HostBuffer>> buffers;

  SlicedState() {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    for (TensorKind kind : kKinds) {
      for (const LogicalTensor& t : tensors) {
        const DType dtype = dtype_of(kind, t, 0);
        std::vector<char>& bytes = truth[qualified_name(kind, t.name)];
        bytes.resize(t.numel() * dtype_size(dtype));
        for (uint64_t i = 0; i < t.numel(); ++i) {
          const float v = dist(rng);
          std::memcpy(bytes.data() + i * dtype_size(dtype), reinterpret_cast<const char*>(&v) + 4 - dtype_size(dtype),
                      dtype_size(dtype));  // bf16: the high half
        }
      }
    }
  }
  static DType dtype_of(TensorKind kind, const LogicalTensor& t, int rank) {
    if (!t.rank_dtype.empty()) return t.rank_dtype[rank];
    return kind == TensorKind::kParam ? t.dtype : DType::kF32;
  }
  LogicalTensor& tensor(const std::string& name) {
    for (LogicalTensor& t : tensors)
      if (t.name == name) return t;
    ADD_FAILURE() << "no tensor " << name;
    return tensors[0];
  }

  // Rank `rank`'s save of its shares (the bytes of `truth`, converted when the rank writes
  // another dtype than the truth's).
  SaveRequest request(const std::string& dir, int64_t step, int rank) {
    TrainState base;
    SaveRequest req = base.request(dir, step);
    req.regions.clear();
    for (TensorKind kind : kKinds) {
      Region r;
      r.kind = kind;
      uint64_t off = 6;
      for (const LogicalTensor& t : tensors) {
        const TensorSlice share = t.share[rank];
        RegionTensor rt{t.name, t.shape, dtype_of(kind, t, rank), off};
        if (share.count != kWhole.count) rt.slice = share;
        r.tensors.push_back(rt);
        off += elements(t, share) * dtype_size(rt.dtype) + 10;
      }
      buffers.push_back(std::make_unique<HostBuffer>(off));
      for (const RegionTensor& rt : r.tensors) {
        const LogicalTensor& t = tensor(rt.name);
        const TensorSlice share = t.share[rank];
        const uint64_t first = rt.slice ? share.first : 0;
        const std::vector<char>& whole = truth[qualified_name(kind, t.name)];
        const uint64_t tsize = whole.size() / t.numel();
        for (uint64_t i = 0; i < elements(t, share); ++i) {
          char* dst = buffers.back()->data() + rt.offset + i * dtype_size(rt.dtype);
          const char* src = whole.data() + (first + i) * tsize;
          // F32 truth written as BF16: its high half.
          std::memcpy(dst, tsize == dtype_size(rt.dtype) ? src : src + 2, dtype_size(rt.dtype));
        }
      }
      r.data = buffers.back()->data();
      r.size = off;
      req.regions.push_back(std::move(r));
    }
    return req;
  }
  static uint64_t elements(const LogicalTensor& t, const TensorSlice& share) {
    return share.count == kWhole.count ? t.numel() : share.count;
  }
};

// Saves step `step` of `state` by three writers at once; the first failure.
Status save_world(const std::string& dir, SlicedState& state, int64_t step, CheckpointWriterOptions options = {}) {
  options.engine_factory = engine_of_kind("threads");
  options.staging_bytes = 256 * kKiB;
  LocalExchange exchange;
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  for (int rank = 0; rank < kWorld; ++rank) {
    SaveRequest req = state.request(dir, step, rank);
    req.shard = exchange.shard(rank);
    writers.push_back(std::make_unique<CheckpointWriter>(options));
    Result<SaveStart> started = writers.back()->begin_save(req);
    if (!started.ok()) {
      // The ranks already started wait in their exchange for this one and the rest.
      for (int k = rank; k < kWorld; ++k) exchange.report_failure(k, started.status());
      for (auto& w : writers) (void)w->wait();
      return started.status();
    }
  }
  Status first;
  for (auto& w : writers) {
    Status st = w->wait();
    if (first.ok()) first = st;
  }
  return first;
}

float f32_of(DType dtype, const char* p) {
  float f = 0;
  if (dtype == DType::kF32) {
    std::memcpy(&f, p, 4);
  } else {
    uint32_t u = 0;
    std::memcpy(reinterpret_cast<char*>(&u) + 2, p, 2);
    std::memcpy(&f, &u, 4);
  }
  return f;
}

class SliceTest : public CkptTest {
 protected:
  std::unique_ptr<CheckpointReader> save_and_open(int64_t step = 4) {
    Status st = save_world(dir(), state_, step);
    EXPECT_TRUE(st.ok()) << st.to_string();
    auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? std::move(r).value() : nullptr;
  }
  // The error of opening a checkpoint saved with a damaged split of up_proj.
  Status open_error_after(const std::function<void(LogicalTensor&)>& damage) {
    damage(state_.tensor("model.layers.0.mlp.up_proj.weight"));
    Status saved = save_world(dir(), state_, 4);
    EXPECT_TRUE(saved.ok()) << "the writers cannot see another rank's slices: " << saved.to_string();
    return CheckpointReader::open(dir()).status();
  }
  std::string file(const char* kind, int rank) const {
    return (dir_ / "step-4" / shard_file_name(kind, rank, kWorld)).string();
  }

  SlicedState state_;
};

TEST_F(SliceTest, SlicesOfThreeRanksReadBackAsWholeTensorsBitForBit) {
  std::unique_ptr<CheckpointReader> r = save_and_open();
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->files().size(), 2u * kWorld);
  EXPECT_EQ(r->tensors().size(), state_.truth.size()) << "one logical tensor per name";
  for (TensorKind kind : SlicedState::kKinds) {
    for (const LogicalTensor& t : state_.tensors) {
      const std::string q = qualified_name(kind, t.name);
      const SavedTensor* saved = r->find(q);
      ASSERT_NE(saved, nullptr) << q;
      EXPECT_EQ(saved->shape, t.shape) << q;
      EXPECT_EQ(saved->numel, t.numel()) << q;
      EXPECT_EQ(saved->kind, kind) << q;
      size_t slices = 0;
      for (const TensorSlice& s : t.share) slices += s.count > 0 && s.count != kWhole.count;
      EXPECT_EQ(saved->slices.size(), slices) << q;
      const std::vector<char>& want = state_.truth[q];
      std::vector<char> got(saved->nbytes);
      ASSERT_TRUE(r->read_raw(q, got.data(), got.size()).ok()) << q;
      EXPECT_EQ(got, want) << q << " differs";
      std::vector<float> f(t.numel());
      ASSERT_TRUE(r->read_f32(q, f.data(), f.size()).ok()) << q;
      for (uint64_t i = 0; i < t.numel(); ++i)
        ASSERT_EQ(f[i], f32_of(saved->dtype, want.data() + i * dtype_size(saved->dtype))) << q << " element " << i;
      EXPECT_TRUE(r->check_f32(q, t.numel()).ok()) << q;
    }
  }
  const SavedTensor* up = r->find("adam_v/model.layers.0.mlp.up_proj.weight");
  ASSERT_EQ(up->slices.size(), 3u);
  EXPECT_EQ(up->slices[1].first, 300u);
  EXPECT_EQ(up->slices[1].count, 1u);
  EXPECT_EQ(r->files()[up->slices[1].file].name, shard_file_name(kOptimizerFile, 1, kWorld));
  std::vector<ScannedTensor> non_finite;
  ASSERT_TRUE(r->verify(&non_finite).ok());
  EXPECT_TRUE(non_finite.empty());
}

TEST_F(SliceTest, RangedReadsAcrossSliceBoundariesEqualTheTensor) {
  std::unique_ptr<CheckpointReader> r = save_and_open();
  ASSERT_NE(r, nullptr);
  for (TensorKind kind : SlicedState::kKinds) {
    for (const LogicalTensor& t : state_.tensors) {
      const std::string q = qualified_name(kind, t.name);
      const SavedTensor* saved = r->find(q);
      const std::vector<char>& want = state_.truth[q];
      // Every range between points at and around the slice boundaries.
      std::set<uint64_t> points = {0, 1, t.numel() - 1, t.numel()};
      for (const SavedSlice& s : saved->slices)
        for (uint64_t p : {s.first - 1, s.first, s.first + 1, s.first + s.count - 1})
          if (p <= t.numel()) points.insert(p);
      for (uint64_t first : points) {
        for (uint64_t end : points) {
          if (end < first) continue;
          std::vector<float> got(end - first + 1, -7.f);
          ASSERT_TRUE(r->read_f32_range(q, first, end - first, got.data()).ok()) << q << " [" << first << ", " << end;
          for (uint64_t i = first; i < end; ++i)
            ASSERT_EQ(got[i - first], f32_of(saved->dtype, want.data() + i * dtype_size(saved->dtype)))
                << q << " [" << first << ", " << end << ") element " << i;
          EXPECT_EQ(got.back(), -7.f) << "wrote past the range";
        }
      }
    }
  }
  const std::string q = "lm_head.weight";
  float f[2];
  EXPECT_EQ(r->read_f32_range(q, 1050, 1, f).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r->read_f32_range(q, 1049, 2, f).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r->read_f32_range(q, std::numeric_limits<uint64_t>::max(), 2, f).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r->read_f32_range(q, 0, 1051, f).message().find("'lm_head.weight'"), std::string::npos);
  EXPECT_TRUE(r->read_f32_range(q, 1050, 0, f).ok());
  EXPECT_EQ(r->read_f32_range("nope", 0, 1, f).code(), StatusCode::kNotFound);
}

TEST_F(SliceTest, SlicesThatDoNotTileTheirTensorAreRefusedNamingItAndTheFiles) {
  struct Case {
    const char* what;
    std::function<void(LogicalTensor&)> damage;
    std::vector<std::string> words;
  };
  // Of up_proj's three kinds, adam_m's slices are joined first (by name); whole tensors are
  // met file by file, the model's files first.
  const std::string slices = "tensor 'adam_m/model.layers.0.mlp.up_proj.weight'";
  const std::vector<Case> cases = {
      {"a gap", [](LogicalTensor& t) { t.share[1] = kNothing; },
       {slices, "no elements [300, 301)", file(kOptimizerFile, 0), file(kOptimizerFile, 2)}},
      {"an overlap", [](LogicalTensor& t) { t.share[2] = {299, 589}; },
       {slices, "elements [299, 300) in two slices", file(kOptimizerFile, 0), file(kOptimizerFile, 2)}},
      {"a missing last slice", [](LogicalTensor& t) { t.share[2] = {301, 586}; },
       {slices, "no elements [887, 888)", file(kOptimizerFile, 2)}},
      {"a missing first slice", [](LogicalTensor& t) { t.share[0] = kNothing; },
       {slices, "no elements [0, 300)", file(kOptimizerFile, 1)}},
      {"another dtype", [](LogicalTensor& t) { t.rank_dtype = {DType::kF32, DType::kF32, DType::kBF16}; },
       {slices, "different dtypes", file(kOptimizerFile, 0), file(kOptimizerFile, 2)}},
      {"whole and sliced", [](LogicalTensor& t) { t.share[1] = kWhole; },
       {slices, "stored whole in " + file(kOptimizerFile, 1) + " and in slices in " + file(kOptimizerFile, 0)}},
      {"whole twice", [](LogicalTensor& t) { t.share = {kWhole, kNothing, kWhole}; },
       {"tensor 'model.layers.0.mlp.up_proj.weight' appears twice", file(kModelFile, 0), file(kModelFile, 2)}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    state_ = SlicedState();
    Status st = open_error_after(c.damage);
    ASSERT_EQ(st.code(), StatusCode::kCorruption) << st.to_string();
    for (const std::string& w : c.words)
      EXPECT_NE(st.message().find(w), std::string::npos) << w << " not in: " << st.message();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
}

TEST_F(SliceTest, ASliceOutsideItsTensorIsRefusedByTheWriterNamingIt) {
  HostBuffer buf(4096);
  SaveRequest req = TrainState().request(dir(), 1);
  req.regions = {Region{TensorKind::kAdamM, buf.data(), 4096, {{"w", {10, 10}, DType::kF32, 0, TensorSlice{90, 11}}}}};
  CheckpointWriter w;
  Result<SaveStart> st = w.begin_save(req);
  ASSERT_EQ(st.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.status().message().find("'w'"), std::string::npos) << st.status().message();
  EXPECT_NE(st.status().message().find("past its 100 elements"), std::string::npos) << st.status().message();
  req.regions[0].tensors[0].slice = TensorSlice{std::numeric_limits<uint64_t>::max() - 1, 4};  // wraps around
  st = w.begin_save(req);
  ASSERT_EQ(st.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.status().message().find("'w'"), std::string::npos) << st.status().message();
  req.regions[0].tensors[0].slice = TensorSlice{0, 1025};  // inside the tensor, not the region
  req.regions[0].tensors[0].shape = {2000};
  EXPECT_EQ(w.begin_save(req).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir_ / "step-1.tmp"));
}

TEST_F(SliceTest, EmptyAndCompleteSlicesAreSavedAsIfUnsliced) {
  TrainState plain;
  TrainState sliced;
  for (Region& r : sliced.regions) {
    for (RegionTensor& t : r.tensors) t.slice = TensorSlice{0, uint64_t(t.shape[0])};
    r.tensors.push_back(RegionTensor{"extra", {4, 4}, DType::kF32, 0, TensorSlice{16, 0}});
  }
  CheckpointWriter w;
  ASSERT_TRUE(w.begin_save(plain.request((dir_ / "plain").string(), 2)).ok());
  ASSERT_TRUE(w.wait().ok());
  ASSERT_TRUE(w.begin_save(sliced.request((dir_ / "sliced").string(), 2)).ok());
  ASSERT_TRUE(w.wait().ok());
  for (const char* f : {kModelFile, kOptimizerFile}) {
    const std::string got = read_text(dir_ / "sliced" / "step-2" / f);
    EXPECT_EQ(got, read_text(dir_ / "plain" / "step-2" / f)) << f;
    EXPECT_EQ(got.find(kSlicesMetadataKey), std::string::npos) << f;
  }
  auto r = CheckpointReader::open((dir_ / "sliced").string());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (const SavedTensor& t : (*r)->tensors()) EXPECT_TRUE(t.slices.empty()) << t.name;
  EXPECT_EQ((*r)->find("extra"), nullptr);
  // A checkpoint of one process reads as before, ranges included.
  expect_checkpoint_equals(**r, plain, plain.snapshot());
  float f[3];
  ASSERT_TRUE((*r)->read_f32_range("adam_v/model.norm.weight", 93, 3, f).ok());
  EXPECT_EQ(0, std::memcmp(f, plain.snapshot()[2].data() + plain.regions[2].tensors[4].offset + 93 * 4, 12));
  EXPECT_EQ((*r)->read_f32_range("adam_v/model.norm.weight", 94, 3, f).code(), StatusCode::kInvalidArgument);
}

TEST_F(SliceTest, NonFiniteValuesInSlicesAreCountedOncePerTensorAndNeverCommitted) {
  LogicalTensor& head = state_.tensor("lm_head.weight");
  auto poison = [&](uint64_t element, float v) {
    std::memcpy(state_.truth["lm_head.weight"].data() + element * 4, &v, 4);
  };
  poison(3, NAN);                            // rank 0's slice
  poison(head.share[2].first + 5, INFINITY);  // rank 2's
  poison(head.share[2].first + 6, -INFINITY);
  Status refused = save_world(dir(), state_, 4);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("not finite"), std::string::npos) << refused.message();
  EXPECT_FALSE(fs::exists(dir_ / "step-4"));
  EXPECT_FALSE(fs::exists(dir_ / "step-4.tmp"));

  CheckpointWriterOptions opt;
  opt.refuse_non_finite = false;  // as an older strata wrote it
  ASSERT_TRUE(save_world(dir(), state_, 4, opt).ok());
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<ScannedTensor> bad;
  ASSERT_TRUE((*r)->verify(&bad).ok());
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].name, "lm_head.weight");
  EXPECT_EQ(bad[0].non_finite, 3u);
}

TEST_F(SliceTest, SlicedFilesLoadInPythonSafetensors) {
  if (std::system("/usr/bin/python3 -c 'from safetensors import safe_open; import numpy' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 with safetensors is not installed";
  }
  ASSERT_NE(save_and_open(), nullptr);
  const fs::path out = dir_ / "py";
  fs::create_directories(out);
  // Joins every F32 tensor from the slices the files' metadata records (numpy has no bf16).
  const std::string script = R"(import json, sys
import numpy as np
from safetensors import safe_open
whole = {}
for path in sys.argv[2:]:
    with safe_open(path, 'np') as f:
        slices = json.loads((f.metadata() or {}).get('strata_slices', '{}'))
        for k in f.keys():
            if f.get_slice(k).get_dtype() != 'F32':
                continue
            v = f.get_tensor(k)
            if k not in slices:
                whole[k] = v
                continue
            first, count, shape = slices[k]
            assert v.shape == (count,), (k, v.shape, count)
            w = whole.setdefault(k, np.full(shape, np.nan, dtype=np.float32))
            w.reshape(-1)[first:first + count] = v
for k, v in whole.items():
    assert not np.isnan(v).any(), k
    v.tofile(sys.argv[1] + '/' + k.replace('/', '__'))
print(len(whole))
)";
  std::ofstream(out / "join.py") << script;
  std::string cmd = "/usr/bin/python3 " + (out / "join.py").string() + " " + out.string();
  for (int rank = 0; rank < kWorld; ++rank)
    for (const char* kind : {kModelFile, kOptimizerFile}) cmd += " " + file(kind, rank);
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[4096] = {0};
  std::string text;
  while (fgets(line, sizeof line, p) != nullptr) text += line;
  ASSERT_EQ(pclose(p), 0) << text;
  EXPECT_EQ(text, std::to_string(state_.truth.size() - 1) + "\n") << "every tensor but the bf16 one";
  for (const auto& [q, bytes] : state_.truth) {
    if (q == "model.layers.0.self_attn.o_proj.weight") continue;
    std::string name;
    for (char c : q) name += c == '/' ? std::string("__") : std::string(1, c);
    EXPECT_EQ(read_text(out / name), std::string(bytes.begin(), bytes.end())) << q;
  }
}

}  // namespace
}  // namespace strata::ckpt::testing
