// strata ckpt inspect DIR | verify DIR | bench --dir DIR --size SIZE
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/reader.h"
#include "ckpt/writer.h"
#include "core/cpu_device.h"
#include "core/units.h"
#include "memory/chunk_space.h"
#include "tools/strata/ckpt_command.h"

extern char** environ;

namespace strata::tools {
namespace {

constexpr const char* kCkptUsage = R"(Usage: strata ckpt <inspect|verify> PATH
       strata ckpt bench --dir DIR --size SIZE [--engine auto|io_uring|threads] [--staging 64MiB] [--repeat 3]

PATH is a checkpoint directory (its `latest` is followed), DIR/latest, or DIR/step-N.

  inspect   step, tokens seen, data cursor, the files with sizes and checksums, tensor count
            and bytes per kind (param, master, adam_m, adam_v, state) and a model config summary.
  verify    recomputes every file's xxh3_64 and compares it with the manifest, and checks that
            no tensor holds NaN or Inf; prints OK and exits 0, or names the damaged file (or
            each non-finite tensor with its count) and exits 1.
  bench     writes a SIZE-byte checkpoint into DIR through the asynchronous writer (O_DIRECT,
            checksums, fsync and commit inside the timing) twice: from one host buffer, and
            read piece by piece out of a chunk space (host tier, 64 MiB chunks) into staging,
            as a training run saves; in the same run it times `dd if=/dev/zero of=DIR/dd.tmp
            bs=4M count=N oflag=direct conv=fsync`. Prints each in GB/s (10^9 bytes/s) and its
            ratio to dd, the median of --repeat rounds. Removing the files of a round is not
            timed, for either. Everything it writes in DIR is removed afterwards.
)";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "strata ckpt: error: %s (see strata ckpt --help)\n", msg.c_str());
  return 2;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata ckpt: error: %s\n", st.message().c_str());
  return 1;
}

std::string json_scalar(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  return j.dump();
}

int inspect(const std::string& path) {
  Result<std::unique_ptr<ckpt::CheckpointReader>> opened = ckpt::CheckpointReader::open(path);
  if (!opened.ok()) return fail(opened.status());
  const ckpt::CheckpointReader& r = **opened;
  const ckpt::Manifest& m = r.manifest();
  std::printf("checkpoint       %s\n", r.step_dir().c_str());
  std::printf("step             %lld\n", static_cast<long long>(m.step));
  std::printf("tokens seen      %llu\n", static_cast<unsigned long long>(m.fields.tokens_seen));
  std::printf("optimizer step   %lld\n", static_cast<long long>(m.fields.optimizer_step));
  std::printf("data cursor      epoch %lld, index %lld\n", static_cast<long long>(m.fields.data_cursor.epoch),
              static_cast<long long>(m.fields.data_cursor.index));
  std::printf("written by       strata %s (format %d)\n",
              m.fields.strata_version.empty() ? "?" : m.fields.strata_version.c_str(), m.format_version);
  // The recipe and moment format the run trained in (checkpoints before they were recorded: none).
  const nlohmann::json& p = m.fields.precision;
  auto text = [&](const char* key) {
    return p.contains(key) && p[key].is_string() ? p[key].get<std::string>() : std::string("?");
  };
  if (p.contains("recipe") || p.contains("moments"))
    std::printf("trained in       %s; Adam moments stored as %s (the checkpoint holds them decoded)\n",
                text("recipe").c_str(), text("moments").c_str());
  // How it was written: by one process, or each data-parallel rank its share.
  const nlohmann::json& layout = m.fields.layout;
  if (layout.contains("sharding") && layout["sharding"].is_object()) {
    const nlohmann::json& sh = layout["sharding"];
    const std::string world = sh.value("world_size", nlohmann::json("?")).dump();
    const std::string by = sh.contains("by") && sh["by"].is_string() ? sh["by"].get<std::string>() : "share";
    if (by == "element ranges") {
      // Every rank wrote a slice of every tensor; the reader joins them.
      std::printf("written as       sharded over %s ranks by element ranges (any number of ranks resumes it)\n",
                  world.c_str());
      if (sh.contains("expert_parallel") && sh["expert_parallel"].is_number_integer())
        std::printf("                 experts split over groups of %s ranks: each expert's ranges by the ranks "
                    "holding it (any expert groups resume it)\n",
                    sh["expert_parallel"].dump().c_str());
    } else {
      std::printf("written as       %s ranks, each its %s (any number of ranks resumes it)\n", world.c_str(),
                  by.c_str());
    }
  } else {
    std::printf("written as       one process\n");
  }
  std::printf("\n%-40s %14s  %s\n", "file", "size", "xxh3_64");
  for (const ckpt::SavedFile& f : r.files()) {
    std::printf("%-40s %14s  %s\n", f.name.c_str(), format_bytes(f.size).c_str(), ckpt::xxh3_hex(f.xxh3).c_str());
  }
  uint64_t counts[ckpt::kTensorKindCount] = {0}, bytes[ckpt::kTensorKindCount] = {0};
  uint64_t sliced = 0;
  for (const ckpt::SavedTensor& t : r.tensors()) {
    counts[static_cast<int>(t.kind)]++;
    bytes[static_cast<int>(t.kind)] += t.nbytes;
    sliced += !t.slices.empty();
  }
  std::printf("\n%-8s %8s %14s\n", "kind", "tensors", "bytes");
  for (int k = 0; k < ckpt::kTensorKindCount; ++k) {
    std::printf("%-8s %8llu %14s\n", ckpt::tensor_kind_name(static_cast<ckpt::TensorKind>(k)),
                static_cast<unsigned long long>(counts[k]), format_bytes(bytes[k]).c_str());
  }
  if (sliced > 0) {
    std::printf("(%llu of them stored in slices across the ranks' files)\n", static_cast<unsigned long long>(sliced));
  }
  const nlohmann::json& cfg = m.fields.model_config;
  std::string summary;
  for (const char* key : {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "intermediate_size", "vocab_size", "num_local_experts",
                          "num_experts", "torch_dtype"}) {
    auto it = cfg.find(key);
    if (it == cfg.end()) continue;
    summary += (summary.empty() ? "" : ", ") + std::string(key) + " " + json_scalar(*it);
  }
  std::printf("\nmodel            %s\n", summary.empty() ? "(no model config recorded)" : summary.c_str());
  return 0;
}

int verify(const std::string& path) {
  Result<std::unique_ptr<ckpt::CheckpointReader>> opened = ckpt::CheckpointReader::open(path);
  if (!opened.ok()) return fail(opened.status());
  std::vector<ckpt::ScannedTensor> non_finite;
  Status st = (*opened)->verify(&non_finite);
  if (!st.ok()) return fail(st);
  if (!non_finite.empty()) {
    // Checksums match, but the state is of a diverged run: not a checkpoint to resume from.
    for (const ckpt::ScannedTensor& t : non_finite)
      std::fprintf(stderr, "non-finite  %s: %llu NaN/Inf values\n", t.name.c_str(),
                   static_cast<unsigned long long>(t.non_finite));
    return fail(Status::Corruption((*opened)->step_dir() + ": " + std::to_string(non_finite.size()) +
                                   " tensor(s) hold NaN or Inf values (listed above); the checkpoint is of a "
                                   "diverged run, resume from an earlier step"));
  }
  std::printf("OK %s: %zu files, %zu tensors, checksums match, all values finite\n", (*opened)->step_dir().c_str(),
              (*opened)->files().size(), (*opened)->tensors().size());
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

Result<double> time_dd(const std::string& dir, uint64_t size) {
  const std::string out = dir + "/dd.tmp";
  std::vector<std::string> argv = {"dd", "if=/dev/zero", "of=" + out, "bs=4M",
                                   "count=" + std::to_string((size + 4 * kMiB - 1) / (4 * kMiB)),
                                   "oflag=direct", "conv=fsync", "status=none"};
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, "dd", nullptr, nullptr, cargv.data(), environ);
  if (err != 0) return Status::NotFound(std::string("cannot run dd: ") + std::strerror(err));
  int ws = 0;
  while (::waitpid(pid, &ws, 0) < 0) {
    if (errno != EINTR) return Status::Internal(std::string("waitpid for dd failed: ") + std::strerror(errno));
  }
  const double secs = seconds_since(start);
  ::unlink(out.c_str());
  if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) return Status::IOError("dd writing " + out + " failed");
  return secs;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int bench(const std::vector<std::string>& args) {
  std::string dir, size_text, engine = "auto", staging_text = "64MiB";
  int repeat = 3;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kCkptUsage, stdout);
      return 0;
    }
    if (i + 1 >= args.size()) return usage_error(a + " needs a value");
    if (a == "--dir") dir = args[++i];
    else if (a == "--size") size_text = args[++i];
    else if (a == "--engine") engine = args[++i];
    else if (a == "--staging") staging_text = args[++i];
    else if (a == "--repeat") repeat = std::atoi(args[++i].c_str());
    else return usage_error("unknown argument '" + a + "'");
  }
  if (dir.empty() || size_text.empty()) return usage_error("bench needs --dir and --size");
  if (repeat < 1) return usage_error("--repeat must be at least 1");
  Result<uint64_t> size = parse_bytes(size_text);
  if (!size.ok()) return usage_error(size.status().message());
  Result<uint64_t> staging = parse_bytes(staging_text);
  if (!staging.ok()) return usage_error(staging.status().message());
  const uint64_t bytes = round_up(std::max<uint64_t>(*size, 4096), 4 * kMiB);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return fail(Status::IOError("cannot create " + dir + ": " + ec.message()));
  const std::string ckpt_dir = dir + "/strata-ckpt-bench";

  std::unique_ptr<char, decltype(&std::free)> region(static_cast<char*>(std::aligned_alloc(4096, bytes)), &std::free);
  if (region == nullptr) return fail(Status::OutOfMemory("cannot allocate " + format_bytes(bytes)));
  uint64_t x = 0x9E3779B97F4A7C15ull;
  uint64_t* words = reinterpret_cast<uint64_t*>(region.get());
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    // Clearing each float's top exponent bit keeps the data finite, so the save's NaN/Inf
    // check runs as in training instead of refusing random bits.
    words[i] = x & ~0x4000000040000000ull;
  }
  // The same bytes in a chunk space, one tensor per 64 MiB chunk, as a training run holds them.
  constexpr uint64_t kChunk = 64 * kMiB;
  Result<std::unique_ptr<CpuDevice>> device = CpuDevice::create(0, 0);
  if (!device.ok()) return fail(device.status());
  ChunkSpaceOptions so;
  so.chunk_bytes = kChunk;
  so.host_bytes = round_up(bytes, kChunk);
  Result<std::unique_ptr<ChunkSpace>> space = ChunkSpace::create(**device, nullptr, so);
  if (!space.ok()) return fail(space.status());
  std::vector<TensorId> pieces;
  for (uint64_t off = 0; off < bytes; off += kChunk) {
    const uint64_t n = std::min(kChunk, bytes - off);
    Result<TensorId> id = (*space)->add_tensor("bench." + std::to_string(pieces.size()), ChunkKind::kParam, n, Tier::kHost);
    if (!id.ok()) return fail(id.status());
    Result<void*> p = (*space)->acquire_tensor(*id, Tier::kHost, AccessMode::kWrite);
    if (!p.ok()) return fail(p.status());
    std::memcpy(*p, region.get() + off, n);
    (*space)->release_tensor(*id);
    pieces.push_back(*id);
  }

  ckpt::SaveRequest req;
  req.dir = ckpt_dir;
  req.regions.push_back(ckpt::Region{ckpt::TensorKind::kParam, region.get(), bytes,
                                     {{"bench.weight", {int64_t(bytes / 4)}, ckpt::DType::kF32, 0}}});
  req.manifest.strata_version = "bench";
  ckpt::SaveRequest from_chunks = req;
  from_chunks.regions[0].data = nullptr;
  from_chunks.regions[0].read = [&](uint64_t offset, uint64_t length, void* dst) -> Status {
    char* out = static_cast<char*>(dst);
    while (length > 0) {
      const uint64_t i = offset / kChunk, at = offset % kChunk, n = std::min(length, kChunk - at);
      RETURN_IF_ERROR((*space)->read_tensor(pieces[i], at, n, out));
      offset += n, length -= n, out += n;
    }
    return Status::OK();
  };
  ckpt::CheckpointWriterOptions opt;
  opt.staging_bytes = *staging;
  opt.keep_last = 0;  // the previous step is removed outside the timing, as dd's file is
  opt.io.kind = engine;
  ckpt::CheckpointWriter writer(opt);

  // Per round, in rotating order: dd, the save from memory, the save from chunks.
  std::vector<double> seconds[3];
  std::string engine_name;
  int64_t step = 0;
  for (int round = 0; round < repeat; ++round) {
    for (int k = 0; k < 3; ++k) {
      const int which = (k + round) % 3;
      if (which == 0) {
        Result<double> t = time_dd(dir, bytes);
        if (!t.ok()) return fail(t.status());
        seconds[0].push_back(*t);
        continue;
      }
      ckpt::SaveRequest& r = which == 1 ? req : from_chunks;
      r.step = ++step;
      const auto start = std::chrono::steady_clock::now();
      Result<ckpt::SaveStart> st = writer.begin_save(r);
      if (!st.ok()) return fail(st.status());
      Status done = writer.wait();
      if (!done.ok()) return fail(done);
      seconds[which].push_back(seconds_since(start));
      engine_name = writer.last_stats().engine;
      (void)ckpt::remove_tree(ckpt_dir + "/" + ckpt::step_dir_name(r.step));
    }
  }
  (void)ckpt::remove_tree(ckpt_dir);
  const double dd_rate = bytes / median(seconds[0]) / 1e9;
  const double memory_rate = bytes / median(seconds[1]) / 1e9;
  const double chunks_rate = bytes / median(seconds[2]) / 1e9;
  std::printf("checkpoint of %s into %s, median of %d rounds\n", format_bytes(bytes).c_str(), dir.c_str(), repeat);
  std::printf("  %-62s %6s %6s\n", "", "GB/s", "vs dd");
  std::printf("  %-62s %6.2f %6.2f\n", ("strata ckpt from a host buffer (" + engine_name + ", O_DIRECT, xxh3, commit)").c_str(),
              memory_rate, memory_rate / dd_rate);
  std::printf("  %-62s %6.2f %6.2f\n", "strata ckpt read out of chunks into staging (training path)", chunks_rate,
              chunks_rate / dd_rate);
  std::printf("  %-62s %6.2f %6.2f\n", "dd bs=4M oflag=direct conv=fsync", dd_rate, 1.0);
  return 0;
}

}  // namespace

int ckpt_command(const std::vector<std::string>& args) {
  if (args.empty()) return usage_error("missing sub-command");
  const std::string& sub = args[0];
  if (sub == "--help" || sub == "-h" || sub == "help") {
    std::fputs(kCkptUsage, stdout);
    return 0;
  }
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (sub == "bench") return bench(rest);
  if (sub == "inspect" || sub == "verify") {
    if (!rest.empty() && (rest[0] == "--help" || rest[0] == "-h")) {
      std::fputs(kCkptUsage, stdout);
      return 0;
    }
    if (rest.size() != 1) return usage_error(sub + " takes one checkpoint path");
    return sub == "inspect" ? inspect(rest[0]) : verify(rest[0]);
  }
  return usage_error("unknown sub-command '" + sub + "'");
}

}  // namespace strata::tools
