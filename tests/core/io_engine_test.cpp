// IoEngine: every engine moves exactly the bytes asked for (O_DIRECT and buffered, many
// requests in flight, several submitters), and every failure — end of file, bad descriptor,
// injected EIO/ENOSPC — is a Status naming the file and offset, never silently zeroed data.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/io_engine.h"
#include "core/io_faulty.h"
#include "core/io_uring_engine.h"
#include "core/units.h"
#include "test_util.h"

namespace strata {
namespace {

// 4 KiB-aligned host memory, freed on destruction.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t size) : size_(size) {
    void* p = nullptr;
    CHECK(posix_memalign(&p, 4096, std::max<uint64_t>(size, 4096)) == 0);
    data_ = static_cast<char*>(p);
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  uint64_t size_;
};

// A file in a temporary directory, closed and removed on destruction.
class TempFile {
 public:
  TempFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  std::string path_;
  int fd_;
};

std::vector<std::string> temp_dirs() {
  std::vector<std::string> dirs = {::testing::TempDir(), "/tmp", "/var/tmp"};
  for (auto& d : dirs) {
    while (d.size() > 1 && d.back() == '/') d.pop_back();
  }
  return dirs;
}

std::string unique_name(const char* stem) {
  static std::atomic<int> counter{0};
  return std::string("/strata_io_") + stem + "_" + std::to_string(::getpid()) + "_" +
         std::to_string(counter++);
}

std::unique_ptr<TempFile> open_buffered(const char* stem, int flags = O_RDWR) {
  const std::string path = temp_dirs()[0] + unique_name(stem);
  const int fd = ::open(path.c_str(), flags | O_CREAT | O_TRUNC, 0600);
  CHECK_MSG(fd >= 0, "cannot create " + path);
  return std::make_unique<TempFile>(path, fd);
}

// An O_DIRECT file in the first temp directory whose filesystem accepts O_DIRECT I/O, or null
// (tmpfs refuses O_DIRECT at open; some filesystems only at the first transfer).
std::unique_ptr<TempFile> open_direct(const char* stem) {
  AlignedBuffer probe(4096);
  std::memset(probe.data(), 0x5a, 4096);
  for (const auto& dir : temp_dirs()) {
    const std::string path = dir + unique_name(stem);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0) continue;
    auto file = std::make_unique<TempFile>(path, fd);
    if (::pwrite(fd, probe.data(), 4096, 0) == 4096 && ::ftruncate(fd, 0) == 0) return file;
  }
  return nullptr;
}

uint64_t checksum(const char* data, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
  return h;
}

void fill_random(char* data, uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(data + i, &v, 8);
  }
}

// Non-overlapping regions of 64 KiB..8 MiB (multiples of 64 KiB) covering [0, total), in a
// shuffled order so requests land at random offsets.
struct Region {
  uint64_t offset, length;
};
std::vector<Region> random_regions(uint64_t total, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Region> regions;
  uint64_t offset = 0;
  while (offset < total) {
    const uint64_t len = std::min<uint64_t>(total - offset, 64 * kKiB * (1 + rng() % 128));
    regions.push_back({offset, len});
    offset += len;
  }
  std::shuffle(regions.begin(), regions.end(), rng);
  return regions;
}

Result<std::unique_ptr<IoEngine>> make_engine(const std::string& kind, uint32_t depth = 8) {
  IoEngineOptions o;
  o.kind = kind;
  o.queue_depth = depth;
  o.threads = 4;
  return make_io_engine(o);
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Writes random data to every region with all requests in flight at once (beyond the queue
// depth), reads it back in another order, and compares checksums region by region.
void round_trip(IoEngine& engine, int file, uint64_t total, uint64_t seed) {
  AlignedBuffer src(total), dst(total);
  fill_random(src.data(), total, seed);
  std::memset(dst.data(), 0, total);
  std::vector<Region> regions = random_regions(total, seed + 1);
  ASSERT_GT(regions.size(), 8u);
  std::vector<IoTicket> tickets;
  for (const Region& r : regions) {
    Result<IoTicket> t = engine.submit({IoOp::kWrite, file, src.data() + r.offset, r.length, r.offset});
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  for (IoTicket t : tickets) ASSERT_TRUE(engine.wait(t).ok());
  std::shuffle(regions.begin(), regions.end(), std::mt19937_64(seed + 2));
  tickets.clear();
  for (const Region& r : regions) {
    Result<IoTicket> t = engine.submit({IoOp::kRead, file, dst.data() + r.offset, r.length, r.offset});
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  for (size_t i = tickets.size(); i-- > 0;) {
    Status st = engine.wait(tickets[i]);
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  for (const Region& r : regions) {
    ASSERT_EQ(checksum(src.data() + r.offset, r.length), checksum(dst.data() + r.offset, r.length))
        << engine.name() << ": region at " << r.offset << " of " << r.length << " bytes differs";
  }
}

class IoEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  // The engine under test, or null after GTEST_SKIP when io_uring is refused here.
  std::unique_ptr<IoEngine> engine(uint32_t depth = 8) {
    Result<std::unique_ptr<IoEngine>> e = make_engine(GetParam(), depth);
    if (!e.ok() && e.status().code() == StatusCode::kUnimplemented) return nullptr;
    CHECK_MSG(e.ok(), e.status().to_string());
    return std::move(e).value();
  }
};

#define ENGINE_OR_SKIP(var, ...)                                                          \
  std::unique_ptr<IoEngine> var = engine(__VA_ARGS__);                                     \
  if (var == nullptr) GTEST_SKIP() << "io_uring cannot be set up here (see make_io_engine)"

TEST_P(IoEngineTest, DirectRoundTripOfRandomRequestsMatchesChecksums) {
  ENGINE_OR_SKIP(e);
  auto file = open_direct("rt");
  if (file == nullptr) GTEST_SKIP() << "no temp filesystem here accepts O_DIRECT";
  Result<int> f = e->register_file(file->fd(), file->path());
  ASSERT_TRUE(f.ok());
  round_trip(*e, *f, 96 * kMiB, 11);
}

TEST_P(IoEngineTest, BufferedRoundTripOfRandomRequestsMatchesChecksums) {
  ENGINE_OR_SKIP(e);
  auto file = open_buffered("rtb");
  Result<int> f = e->register_file(file->fd(), file->path());
  ASSERT_TRUE(f.ok());
  round_trip(*e, *f, 48 * kMiB, 12);
}

TEST_P(IoEngineTest, ManyRequestsBeyondQueueDepthAllComplete) {
  ENGINE_OR_SKIP(e, 4);
  auto file = open_buffered("depth");
  const int f = e->register_file(file->fd(), file->path()).value();
  constexpr int kRequests = 256;
  constexpr uint64_t kLen = 64 * kKiB;
  AlignedBuffer src(kRequests * kLen), dst(kRequests * kLen);
  fill_random(src.data(), src.size(), 3);
  std::vector<IoTicket> tickets;
  for (int i = 0; i < kRequests; ++i) {
    tickets.push_back(e->submit({IoOp::kWrite, f, src.data() + i * kLen, kLen, i * kLen}).value());
  }
  // Completed-but-unwaited requests must not hold queue slots: waiting in reverse order
  // means the first 252 submitted have long completed when their turn comes.
  for (int i = kRequests; i-- > 0;) ASSERT_TRUE(e->wait(tickets[i]).ok());
  tickets.clear();
  for (int i = 0; i < kRequests; ++i) {
    tickets.push_back(e->submit({IoOp::kRead, f, dst.data() + i * kLen, kLen, i * kLen}).value());
  }
  for (IoTicket t : tickets) {
    while (!e->done(t)) std::this_thread::yield();
    ASSERT_TRUE(e->wait(t).ok());
  }
  EXPECT_EQ(checksum(src.data(), src.size()), checksum(dst.data(), dst.size()));
}

TEST_P(IoEngineTest, FourConcurrentSubmittersEachGetTheirOwnData) {
  ENGINE_OR_SKIP(e, 8);
  std::unique_ptr<TempFile> file = open_direct("conc");
  if (file == nullptr) file = open_buffered("conc");
  const int f = e->register_file(file->fd(), file->path()).value();
  constexpr int kThreads = 4, kPerThread = 48;
  constexpr uint64_t kLen = 256 * kKiB;
  AlignedBuffer src(kThreads * kPerThread * kLen), dst(kThreads * kPerThread * kLen);
  fill_random(src.data(), src.size(), 4);
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::vector<IoTicket> tickets;
    for (int i = 0; i < kPerThread; ++i) {
      const uint64_t off = (static_cast<uint64_t>(i) * kThreads + t) * kLen;  // interleaved
      Result<IoTicket> r = e->submit({IoOp::kWrite, f, src.data() + off, kLen, off});
      if (!r.ok()) ++failures;
      else tickets.push_back(*r);
    }
    for (IoTicket k : tickets) failures += e->wait(k).ok() ? 0 : 1;
    tickets.clear();
    for (int i = 0; i < kPerThread; ++i) {
      const uint64_t off = (static_cast<uint64_t>(i) * kThreads + t) * kLen;
      Result<IoTicket> r = e->submit({IoOp::kRead, f, dst.data() + off, kLen, off});
      if (!r.ok()) ++failures;
      else tickets.push_back(*r);
    }
    for (IoTicket k : tickets) failures += e->wait(k).ok() ? 0 : 1;
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(checksum(src.data(), src.size()), checksum(dst.data(), dst.size()));
}

TEST_P(IoEngineTest, ReadPastEndOfFileIsAnErrorNotZeroFill) {
  ENGINE_OR_SKIP(e);
  auto file = open_buffered("eof");
  AlignedBuffer data(100 * kKiB);
  fill_random(data.data(), data.size(), 5);
  ASSERT_EQ(::pwrite(file->fd(), data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  const int f = e->register_file(file->fd(), file->path()).value();
  AlignedBuffer out(256 * kKiB);
  Status st = e->read(f, out.data(), out.size(), 0);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.message(), file->path())) << st.message();
  EXPECT_TRUE(contains(st.message(), "end of file")) << st.message();
  EXPECT_TRUE(contains(st.message(), "at offset 0")) << st.message();
  // The part that exists was read, the rest was not invented.
  EXPECT_EQ(checksum(data.data(), data.size()), checksum(out.data(), data.size()));
  st = e->read(f, out.data(), 4096, 1 * kMiB);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.message(), "at offset 1048576")) << st.message();
  // Exactly to the end is fine.
  EXPECT_TRUE(e->read(f, out.data(), data.size(), 0).ok());
}

TEST_P(IoEngineTest, BadDescriptorsAndIndicesFailWithTheirPath) {
  ENGINE_OR_SKIP(e);
  AlignedBuffer buf(64 * kKiB);
  EXPECT_FALSE(e->register_file(-1, "/nowhere").ok());
  const int not_open = e->register_file(999999, "/nvme/strata/slots.9").value();
  Status st = e->read(not_open, buf.data(), buf.size(), 65536);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.message(), "read of 64.00 KiB at offset 65536 from /nvme/strata/slots.9 failed"))
      << st.message();
  EXPECT_TRUE(contains(st.message(), "(EBADF)")) << st.message();

  auto file = open_buffered("ro", O_RDONLY);
  const int read_only = e->register_file(file->fd(), file->path()).value();
  st = e->write(read_only, buf.data(), buf.size(), 0);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.message(), "write of 64.00 KiB at offset 0 to " + file->path())) << st.message();

  Result<IoTicket> t = e->submit({IoOp::kRead, 42, buf.data(), buf.size(), 0});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
}

// A FaultyIoEngine around the engine under test.
std::unique_ptr<FaultyIoEngine> faulty(std::unique_ptr<IoEngine> inner, const FaultOptions& o) {
  Result<std::unique_ptr<FaultyIoEngine>> f = FaultyIoEngine::create(std::move(inner), o);
  CHECK_MSG(f.ok(), f.status().to_string());
  return std::move(f).value();
}

TEST_P(IoEngineTest, ShortTransfersAndEagainAreResubmittedToCompletion) {
  ENGINE_OR_SKIP(inner);
  IoUringEngine* uring = dynamic_cast<IoUringEngine*>(inner.get());
  FaultOptions o;
  o.seed = 7;
  o.short_read.probability = o.short_write.probability = 1.0;
  o.eagain_read.every = o.eagain_write.every = 2;
  auto e = faulty(std::move(inner), o);
  EXPECT_EQ(std::string(e->name()), "faulty(" + GetParam() + ")");
  std::unique_ptr<TempFile> file = open_direct("short");
  if (file == nullptr) file = open_buffered("short");
  const int f = e->register_file(file->fd(), file->path()).value();
  round_trip(*e, f, 32 * kMiB, 13);
  const FaultyIoEngine::Counts c = e->counts();
  EXPECT_GT(c.short_transfers, 100u);
  EXPECT_GT(c.eagains, 4u);
  if (uring != nullptr) {  // the real engine's resubmission path did the work
    EXPECT_GE(uring->stats().short_resubmits, c.short_transfers);
    EXPECT_EQ(uring->stats().eagain_resubmits, c.eagains);
  }
}

TEST_P(IoEngineTest, InjectedEioNamesPathAndOffsetAndSparesOtherRequests) {
  ENGINE_OR_SKIP(inner);
  FaultOptions o;
  o.eio_read.every = 3;
  auto e = faulty(std::move(inner), o);
  auto file = open_buffered("eio");
  const int f = e->register_file(file->fd(), file->path()).value();
  constexpr uint64_t kLen = 1 * kMiB;
  AlignedBuffer src(6 * kLen), dst(6 * kLen);
  fill_random(src.data(), src.size(), 8);
  ASSERT_TRUE(e->write(f, src.data(), src.size(), 0).ok());
  for (int i = 0; i < 6; ++i) {
    Status st = e->read(f, dst.data() + i * kLen, kLen, i * kLen);
    if (i % 3 == 2) {  // the 3rd and 6th reads
      ASSERT_FALSE(st.ok()) << "read " << i;
      EXPECT_EQ(st.code(), StatusCode::kIOError);
      const std::string want = "read of 1.00 MiB at offset " + std::to_string(i * kLen) + " from " + file->path() +
                               " failed at offset " + std::to_string(i * kLen + kLen / 2);
      EXPECT_TRUE(contains(st.message(), want)) << st.message();
      EXPECT_TRUE(contains(st.message(), "Input/output error (EIO)")) << st.message();
    } else {
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(checksum(src.data() + i * kLen, kLen), checksum(dst.data() + i * kLen, kLen));
    }
  }
  EXPECT_EQ(e->counts().eios, 2u);
}

TEST_P(IoEngineTest, InjectedEnospcStopsWritesWithAdvice) {
  ENGINE_OR_SKIP(inner);
  FaultOptions o;
  o.enospc_after_bytes = 1 * kMiB + 256 * kKiB;
  auto e = faulty(std::move(inner), o);
  auto file = open_buffered("enospc");
  const int f = e->register_file(file->fd(), file->path()).value();
  AlignedBuffer src(512 * kKiB);
  fill_random(src.data(), src.size(), 9);
  EXPECT_TRUE(e->write(f, src.data(), src.size(), 0).ok());
  EXPECT_TRUE(e->write(f, src.data(), src.size(), 512 * kKiB).ok());
  Status st = e->write(f, src.data(), src.size(), 1 * kMiB);  // 256 KiB fit, then the disk is full
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.message(), "write of 512.00 KiB at offset 1048576 to " + file->path() +
                                         " failed at offset 1310720 (256.00 KiB done): No space left on device (ENOSPC); "
                                         "free space there or move to a larger disk (memory.nvme.path for the nvme "
                                         "tier, ckpt.dir for checkpoints)"))
      << st.message();
  EXPECT_FALSE(e->write(f, src.data(), 4096, 0).ok());
  // Reads are unaffected.
  AlignedBuffer dst(512 * kKiB);
  ASSERT_TRUE(e->read(f, dst.data(), dst.size(), 512 * kKiB).ok());
  EXPECT_EQ(checksum(src.data(), src.size()), checksum(dst.data(), dst.size()));
}

TEST_P(IoEngineTest, InjectedLatencyDelaysCompletion) {
  ENGINE_OR_SKIP(inner);
  FaultOptions o;
  o.read_latency = std::chrono::milliseconds(80);
  auto e = faulty(std::move(inner), o);
  auto file = open_buffered("lat");
  const int f = e->register_file(file->fd(), file->path()).value();
  AlignedBuffer buf(4096);
  ASSERT_TRUE(e->write(f, buf.data(), 4096, 0).ok());
  const auto start = std::chrono::steady_clock::now();
  const IoTicket t = e->submit({IoOp::kRead, f, buf.data(), 4096, 0}).value();
  EXPECT_FALSE(e->done(t));
  ASSERT_TRUE(e->wait(t).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(80));
}

TEST_P(IoEngineTest, SameSeedInjectsTheSameFaults) {
  auto run = [&](uint64_t seed) -> std::vector<bool> {
    std::unique_ptr<IoEngine> inner = engine();
    FaultOptions o;
    o.seed = seed;
    o.eio_write.probability = 0.3;
    auto e = faulty(std::move(inner), o);
    auto file = open_buffered("seed");
    const int f = e->register_file(file->fd(), file->path()).value();
    AlignedBuffer buf(64 * kKiB);
    std::vector<bool> failed;
    for (int i = 0; i < 64; ++i) failed.push_back(!e->write(f, buf.data(), buf.size(), i * buf.size()).ok());
    return failed;
  };
  if (engine() == nullptr) GTEST_SKIP() << "io_uring cannot be set up here";
  const std::vector<bool> a = run(21), b = run(21), c = run(22);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_GT(std::count(a.begin(), a.end(), true), 5);
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineTest, ::testing::Values("threads", "io_uring"),
                         [](const auto& info) { return info.param; });

TEST(IoUringEngineTest, UsesFixedFilesFixedBuffersAndBatchedSubmission) {
  IoEngineOptions o;
  o.queue_depth = 16;
  Result<std::unique_ptr<IoUringEngine>> r = IoUringEngine::create(o);
  if (!r.ok()) GTEST_SKIP() << r.status().message();
  IoUringEngine& e = **r;
  auto file = open_direct("fixed");
  if (file == nullptr) file = open_buffered("fixed");
  const int f = e.register_file(file->fd(), file->path()).value();
  EXPECT_TRUE(e.uses_fixed_files());
  constexpr int kRequests = 40;
  constexpr uint64_t kLen = 128 * kKiB;
  AlignedBuffer src(kRequests * kLen), dst(kRequests * kLen);
  fill_random(src.data(), src.size(), 10);
  ASSERT_TRUE(e.register_buffer(src.data(), src.size()).ok());
  ASSERT_TRUE(e.register_buffer(dst.data(), dst.size()).ok());
  std::vector<IoRequest> writes, reads;
  for (int i = 0; i < kRequests; ++i) {
    writes.push_back({IoOp::kWrite, f, src.data() + i * kLen, kLen, i * kLen});
    reads.push_back({IoOp::kRead, f, dst.data() + i * kLen, kLen, i * kLen});
  }
  std::vector<IoTicket> tickets;
  ASSERT_TRUE(e.submit_batch(writes, &tickets).ok());
  for (IoTicket t : tickets) ASSERT_TRUE(e.wait(t).ok());
  tickets.clear();
  ASSERT_TRUE(e.submit_batch(reads, &tickets).ok());
  for (IoTicket t : tickets) ASSERT_TRUE(e.wait(t).ok());
  EXPECT_EQ(checksum(src.data(), src.size()), checksum(dst.data(), dst.size()));
  const IoUringEngine::Stats s = e.stats();
  EXPECT_EQ(s.requests, 2u * kRequests);
  if (e.fixed_buffer_count() > 0) {
    EXPECT_EQ(s.fixed_buffer_sqes, s.sqes);
  }
  EXPECT_LT(s.submit_calls, s.sqes);  // batched: fewer io_uring_enter calls than SQEs
}

TEST(MakeIoEngineTest, UnknownKindIsRejectedAndAutoAlwaysYieldsAnEngine) {
  IoEngineOptions o;
  o.kind = "aio";
  Result<std::unique_ptr<IoEngine>> bad = make_io_engine(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(contains(bad.status().message(), "auto, io_uring or threads"));
  o.kind = "auto";
  Result<std::unique_ptr<IoEngine>> e = make_io_engine(o);
  ASSERT_TRUE(e.ok());
  const std::string name = (*e)->name();
  EXPECT_TRUE(name == "io_uring" || name == "threads") << name;
}

TEST(MakeIoEngineTest, AutoFallsBackToThreadsWhenTheRingIsRefused) {
  IoEngineOptions o;
  o.queue_depth = 1u << 20;  // above the kernel's ring size limit: io_uring_queue_init fails
  o.kind = "io_uring";
  Result<std::unique_ptr<IoEngine>> uring = make_io_engine(o);
  ASSERT_FALSE(uring.ok());
  EXPECT_EQ(uring.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(contains(uring.status().message(), "io_uring_queue_init(1048576) failed")) << uring.status().message();
  o.kind = "auto";
  Result<std::unique_ptr<IoEngine>> e = make_io_engine(o);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(std::string((*e)->name()), "threads");
  auto file = open_buffered("fallback");
  const int f = (*e)->register_file(file->fd(), file->path()).value();
  AlignedBuffer buf(4096);
  fill_random(buf.data(), 4096, 14);
  EXPECT_TRUE((*e)->write(f, buf.data(), 4096, 0).ok());
}

}  // namespace
}  // namespace strata
