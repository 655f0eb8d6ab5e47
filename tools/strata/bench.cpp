// strata bench io: throughput of the IoEngines against dd on the same disk, in the same run.
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/units.h"
#include "core/io_engine.h"
#include "core/io_uring_engine.h"
#include "train/machine_bench.h"
#include "tools/strata/bench_adam.h"
#include "tools/strata/bench_attention.h"
#include "tools/strata/bench_machine.h"
#include "tools/strata/bench_queue.h"
#include "tools/strata/bench_trace.h"
#include "tools/strata/bench_train_gpu.h"
#include "tools/strata/commands.h"

extern char** environ;

namespace strata::tools {
namespace {

constexpr const char* kBenchUsage = R"(Usage: strata bench machine [--out FILE] [--device cpu|cuda] [--quick] ...   (see strata bench machine --help)
       strata bench adam [--params N] [--threads T]   (see strata bench adam --help)
       strata bench attention [--seq 4096,8192,16384] ...   (see strata bench attention --help)
       strata bench train-gpu [--preset 0.44b|tiny] [--steps N] ...   (see strata bench train-gpu --help)
       strata bench trace [CONFIG.yaml] [key=value ...] [--steps N]   (see strata bench trace --help)
       strata bench queue [CONFIG.yaml] [key=value ...] [--steps N]   (see strata bench queue --help)
       strata bench io --dir DIR --size SIZE [--chunk 64MiB] [--engine all|auto|io_uring|threads]
                       [--depth 8] [--max-transfer 4MiB] [--repeat 3]

Measures sequential disk throughput the way the nvme tier uses it: writes SIZE bytes to a
file in DIR in chunk-sized O_DIRECT requests (DEPTH in flight, fsync inside the timing), then
reads them back, through each engine (--engine all: io_uring and threads). In the same run and
directory it times the reference
  dd if=/dev/zero of=DIR/dd.tmp bs=4M count=N oflag=direct conv=fsync
  dd if=DIR/dd.tmp of=/dev/null bs=4M iflag=direct
and prints GB/s (10^9 bytes/s) of both and their ratio. Each round runs dd and every engine,
each round starting with a different one; the median of --repeat rounds is printed, which
steadies the numbers on shared or virtual disks. --max-transfer is the engines' largest
single transfer (IoEngineOptions::max_transfer; 0: a whole request at once). Temporary files
are removed.
)";

constexpr uint64_t kDdBlock = 4 * kMiB;

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "strata bench: error: %s (see strata bench --help)\n", msg.c_str());
  return 2;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata bench: error: %s\n", st.message().c_str());
  return 1;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Removes a path when it goes out of scope.
class RemoveOnExit {
 public:
  explicit RemoveOnExit(std::string path) : path_(std::move(path)) {}
  ~RemoveOnExit() { ::unlink(path_.c_str()); }
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;

 private:
  std::string path_;
};

// 4 KiB-aligned host memory (what pinned memory is on a CUDA machine), freed on exit.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t size) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, size) == 0) data_ = static_cast<char*>(p);
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }

 private:
  char* data_ = nullptr;
};

// Runs argv (found on PATH) and returns its wall time in seconds.
Result<double> time_command(const std::vector<std::string>& argv) {
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  std::string line;
  for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ);
  if (err != 0) return Status::NotFound("cannot run `" + line + "`: " + std::strerror(err));
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return Status::Internal("waitpid for `" + line + "` failed: " + std::strerror(errno));
  }
  const double secs = seconds_since(start);
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return Status::IOError("`" + line + "` failed (exit status " + std::to_string(WEXITSTATUS(wstatus)) + ")");
  }
  return secs;
}

struct Timing {
  double write_s = 0, read_s = 0;
};

Result<Timing> run_dd(const std::string& dir, uint64_t size) {
  const std::string path = dir + "/dd.tmp";
  RemoveOnExit remove(path);
  const std::string count = "count=" + std::to_string((size + kDdBlock - 1) / kDdBlock);
  Timing t;
  ASSIGN_OR_RETURN(t.write_s, time_command({"dd", "if=/dev/zero", "of=" + path, "bs=4M", count, "oflag=direct",
                                            "conv=fsync", "status=none"}));
  ASSIGN_OR_RETURN(t.read_s, time_command({"dd", "if=" + path, "of=/dev/null", "bs=4M", "iflag=direct", "status=none"}));
  return t;
}

Result<Timing> run_engine(IoEngine& engine, const std::string& dir, uint64_t size, uint64_t chunk,
                          const std::vector<char*>& buffers) {
  ASSIGN_OR_RETURN(DiskTiming d, time_disk(engine, dir, size, chunk, buffers));
  return Timing{d.write_s, d.read_s};
}

int bench_io(const std::vector<std::string>& args) {
  std::string dir, engines = "all";
  uint64_t size = 0, chunk = 64 * kMiB, depth = 8, max_transfer = 4 * kMiB, repeat = 3;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kBenchUsage, stdout);
      return 0;
    }
    if (i + 1 >= args.size()) return usage_error("option '" + a + "' needs a value");
    const std::string& v = args[++i];
    if (a == "--dir") {
      dir = v;
    } else if (a == "--engine") {
      engines = v;
    } else if (a == "--size" || a == "--chunk" || a == "--max-transfer") {
      Result<uint64_t> bytes = parse_bytes(v);
      if (!bytes.ok()) return usage_error(bytes.status().message());
      (a == "--size" ? size : a == "--chunk" ? chunk : max_transfer) = *bytes;
    } else if (a == "--depth" || a == "--repeat") {
      (a == "--depth" ? depth : repeat) = std::strtoull(v.c_str(), nullptr, 10);
    } else {
      return usage_error("unknown option '" + a + "'");
    }
  }
  if (dir.empty() || size == 0) return usage_error("--dir and --size are required");
  if (chunk == 0 || chunk % 4096 != 0) return usage_error("--chunk must be a positive multiple of 4 KiB");
  if (depth == 0 || depth > 1024) return usage_error("--depth must be between 1 and 1024");
  if (repeat == 0 || repeat > 100) return usage_error("--repeat must be between 1 and 100");
  if (max_transfer % 4096 != 0) return usage_error("--max-transfer must be a multiple of 4 KiB");
  if (engines != "all" && engines != "auto" && engines != "io_uring" && engines != "threads") {
    return usage_error("--engine must be all, auto, io_uring or threads");
  }
  size = (size + chunk - 1) / chunk * chunk;
  size = (size + kDdBlock - 1) / kDdBlock * kDdBlock;  // dd moves whole 4 MiB blocks
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return fail(Status::NotFound("cannot use --dir " + dir + ": " + std::strerror(errno)));
  const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (free_bytes < size + 256 * kMiB) {
    return fail(Status::OutOfMemory(dir + " has " + format_bytes(free_bytes) + " free; the benchmark needs " +
                                    format_bytes(size) + " (lower --size or pick another --dir)"));
  }

  std::vector<std::unique_ptr<AlignedBuffer>> owned;
  std::vector<char*> buffers;
  for (uint64_t i = 0; i < depth; ++i) {
    owned.push_back(std::make_unique<AlignedBuffer>(chunk));
    if (owned.back()->data() == nullptr) return fail(Status::OutOfMemory("cannot allocate " + format_bytes(chunk) + " of aligned host memory"));
    std::memset(owned.back()->data(), static_cast<int>(0x11 * (i + 1)), chunk);
    buffers.push_back(owned.back()->data());
  }

  std::printf("io benchmark: %s in %s requests, %llu in flight, transfers of at most %s, O_DIRECT, in %s, "
              "median of %llu rounds\n",
              format_bytes(size).c_str(), format_bytes(chunk).c_str(), static_cast<unsigned long long>(depth),
              max_transfer > 0 ? format_bytes(max_transfer).c_str() : "a whole request", dir.c_str(),
              static_cast<unsigned long long>(repeat));
  std::fflush(stdout);

  std::vector<std::string> kinds;
  if (engines == "all") kinds = {"io_uring", "threads"};
  else kinds = {engines};
  std::vector<std::unique_ptr<IoEngine>> engine_list;
  for (const std::string& kind : kinds) {
    IoEngineOptions o;
    o.kind = kind;
    o.queue_depth = static_cast<uint32_t>(depth);
    o.threads = static_cast<uint32_t>(depth);
    o.max_transfer = max_transfer;
    Result<std::unique_ptr<IoEngine>> engine = make_io_engine(o);
    if (!engine.ok()) {
      std::printf("%s: skipped (%s)\n", kind.c_str(), engine.status().message().c_str());
      continue;
    }
    for (char* b : buffers) {
      Status st = (*engine)->register_buffer(b, chunk);
      if (!st.ok()) return fail(st);
    }
    if (auto* uring = dynamic_cast<IoUringEngine*>(engine->get())) {
      std::printf("io_uring: registered files %s, %zu fixed buffers\n", uring->uses_fixed_files() ? "yes" : "no",
                  uring->fixed_buffer_count());
    }
    engine_list.push_back(std::move(engine).value());
  }
  // seconds[0] is dd, seconds[1 + e] engine e; [op][round] with op 0 write, 1 read.
  std::vector<std::vector<std::vector<double>>> seconds(1 + engine_list.size(),
                                                          std::vector<std::vector<double>>(2));
  // Round r starts with runner r mod n (dd is runner 0), so no runner always goes first on a
  // disk whose speed drifts.
  const size_t runners = 1 + engine_list.size();
  for (uint64_t round = 0; round < repeat; ++round) {
    for (size_t k = 0; k < runners; ++k) {
      const size_t runner = (round + k) % runners;
      Result<Timing> t = runner == 0 ? run_dd(dir, size)
                                     : run_engine(*engine_list[runner - 1], dir, size, chunk, buffers);
      if (!t.ok()) return fail(t.status());
      seconds[runner][0].push_back(t->write_s);
      seconds[runner][1].push_back(t->read_s);
    }
  }
  const double gb = static_cast<double>(size) / 1e9;
  auto median_rate = [&](std::vector<double> s) {
    std::sort(s.begin(), s.end());
    return gb / s[s.size() / 2];
  };
  std::printf("\n%-10s %-10s %8s %8s %7s\n", "operation", "engine", "GB/s", "dd GB/s", "ratio");
  for (int op = 0; op < 2; ++op) {
    const double dd_rate = median_rate(seconds[0][op]);
    for (size_t e = 0; e < engine_list.size(); ++e) {
      const double rate = median_rate(seconds[1 + e][op]);
      std::printf("%-10s %-10s %8.2f %8.2f %7.2f\n", op == 0 ? "write" : "read", engine_list[e]->name(), rate,
                  dd_rate, rate / dd_rate);
    }
  }
  return 0;
}

}  // namespace

int bench_command(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kBenchUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "io") return bench_io(std::vector<std::string>(args.begin() + 1, args.end()));
  if (args[0] == "machine") return bench_machine_command(std::vector<std::string>(args.begin() + 1, args.end()));
  if (args[0] == "adam") return bench_adam_command(std::vector<std::string>(args.begin() + 1, args.end()));
  if (args[0] == "attention") return bench_attention_command(std::vector<std::string>(args.begin() + 1, args.end()));
  if (args[0] == "trace") return bench_trace_command(std::vector<std::string>(args.begin() + 1, args.end()));
  if (args[0] == "queue") return bench_queue_command(std::vector<std::string>(args.begin() + 1, args.end()));
  if (args[0] == "train-gpu") {
    return bench_train_gpu_command(std::vector<std::string>(args.begin() + 1, args.end()));
  }
  return usage_error("unknown benchmark '" + args[0] + "'; available: machine, io, adam, attention, train-gpu, trace, queue");
}

}  // namespace strata::tools
