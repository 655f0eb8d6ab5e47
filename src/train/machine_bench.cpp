#include "train/machine_bench.h"

#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "core/check.h"
#include "core/config.h"
#include "core/units.h"
#include "kernels/adamw.h"
#include "kernels/adamw_simd.h"
#include "model/decoder.h"
#include "model/params.h"
#include "kernels/grad_norm.h"
#include "memory/tier.h"
#include "train/planning.h"
#include "train/train_config.h"

namespace strata {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char[], FreeDeleter>;

// Page-aligned memory, first touched (filled) by all threads as the kernels will use it.
Buffer aligned_buffer(uint64_t bytes, int fill) {
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  Buffer b(static_cast<char*>(std::aligned_alloc(4096, rounded)));
  if (!b) return b;
  char* p = b.get();
  const int64_t pages = static_cast<int64_t>(rounded / 4096);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pages; ++i) std::memset(p + i * 4096, fill, 4096);
  return b;
}

// Closes a descriptor and removes its file when it goes out of scope.
class TempFile {
 public:
  TempFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  int fd() const { return fd_; }

 private:
  std::string path_;
  int fd_;
};

std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M UTC", &tm);
  return text;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown host";
  return name;
}

}  // namespace

double median_seconds(int repeats, const std::function<void()>& fn) {
  fn();
  std::vector<double> s;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    s.push_back(seconds_since(start));
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

Result<std::unique_ptr<ComputeProbe>> ComputeProbe::create(const MachineBenchOptions& o) {
  if (o.device != "cpu")
    return Status::Unimplemented("measuring compute on '" + o.device + "' is not built yet; pass --device cpu, or set "
                                 "hardware.gpu_tflops from the GPU's GEMM figure (strata bench train-gpu)");
  std::unique_ptr<ComputeProbe> p(new ComputeProbe());
  p->B_ = o.micro_batch;
  p->T_ = o.seq_len;
  TrainConfig t;
  t.micro_batch = o.micro_batch;
  t.seq_len = o.seq_len;
  t.grad_accum = 1;
  t.keep_activations = o.keep_activations ? "true" : "false";
  p->flops_ = micro_batch_flops(make_plan_input(o.model, t, DeviceKind::kCpu));
  p->net_ = model::make_cpu_decoder(DType::kF32, o.model);
  const size_t n = static_cast<size_t>(p->net_->layout().total_size());
  p->params_.assign(n, 0.0f);
  p->grads_.assign(n, 0.0f);
  p->access_ = std::make_unique<model::FlatAccess>(DType::kF32, p->params_.data(), p->grads_.data());
  p->net_->set_access(p->access_.get());
  p->net_->set_keep_layer_activations(o.keep_activations);
  p->tokens_.resize(static_cast<size_t>(p->B_ * p->T_));
  for (size_t i = 0; i < p->tokens_.size(); ++i) p->tokens_[i] = static_cast<int32_t>((i * 7919) % o.model.vocab_size);
  return p;
}

Result<double> ComputeProbe::run_once() {
  const auto start = std::chrono::steady_clock::now();
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  net_->reset_expert_token_counts();
  ASSIGN_OR_RETURN(double loss, net_->compute(tokens_.data(), tokens_.data(), B_, T_,
                                              1.0f / static_cast<float>(B_ * T_), /*backward=*/true));
  (void)loss;
  return seconds_since(start);
}

Result<ComputeRate> measure_compute(const MachineBenchOptions& o) {
  ASSIGN_OR_RETURN(std::unique_ptr<ComputeProbe> probe, ComputeProbe::create(o));
  Status failed;
  auto step = [&] {
    Result<double> s = probe->run_once();
    if (!s.ok() && failed.ok()) failed = s.status();
  };
  // Enough repeats for about half a second (a quarter in quick mode): a small model's
  // micro-batch is short, and a median of few short runs is noise on a busy machine.
  const auto start = std::chrono::steady_clock::now();
  step();
  const double first = seconds_since(start);
  RETURN_IF_ERROR(failed);
  const int repeats = std::clamp(static_cast<int>((o.quick ? 0.25 : 0.5) / std::max(first, 1e-6)), o.quick ? 1 : 3, 25);
  ComputeRate r;
  r.seconds = median_seconds(repeats, step);
  RETURN_IF_ERROR(failed);
  r.flops_per_s = probe->flops() / r.seconds;

  // Copy overlap: memcpys on a CPU device's copy stream while the same micro-batch computes.
  ASSIGN_OR_RETURN(std::unique_ptr<Device> device, open_device("cpu", 0, 0));
  std::unique_ptr<Stream> stream = device->create_stream();
  const uint64_t bytes = 16ull << 20;
  Buffer src = aligned_buffer(bytes, 1), dst = aligned_buffer(bytes, 2);
  if (!src || !dst) return Status::OutOfMemory("cannot allocate the copy-overlap buffers");
  auto copies = [&](int n) {
    for (int i = 0; i < n; ++i) device->copy(dst.get(), src.get(), bytes, *stream);
  };
  // A slow micro-batch (a large model) is timed once more with the copies, not many times.
  const int overlap_repeats = r.seconds > 0.2 ? 1 : repeats;
  const double one_copy = median_seconds(overlap_repeats, [&] {
    copies(1);
    stream->synchronize();
  });
  // As many copies as take about as long as the compute.
  const int n = std::max(1, static_cast<int>(r.seconds / std::max(one_copy, 1e-9)));
  const double copy_s = one_copy * n;
  const double both_s = median_seconds(overlap_repeats, [&] {
    copies(n);
    step();
    stream->synchronize();
  });
  RETURN_IF_ERROR(failed);
  // Hidden: what running both at once saved over running one after the other, as a share of
  // the shorter of the two.
  r.copy_overlap = std::clamp((r.seconds + copy_s - both_s) / std::min(r.seconds, copy_s), 0.0, 1.0);
  return r;
}

std::vector<int64_t> default_probe_widths(bool quick) {
  if (quick) return {128, 512, 2048};
  return {128, 256, 512, 1024, 2048, 4096};
}

model::ModelConfig width_probe_model(int64_t width) {
  model::ModelConfig m = model::ModelConfig::preset("tiny").value();
  m.hidden_size = width;
  m.num_attention_heads = std::max<int64_t>(1, width / 64);
  m.num_key_value_heads = std::max<int64_t>(1, m.num_attention_heads / 4);
  m.head_dim = width / m.num_attention_heads;
  m.intermediate_size = (width * 7 / 2 + 63) / 64 * 64;
  m.num_hidden_layers = 1;
  m.vocab_size = 8192;
  return m;
}

Result<std::vector<WidthRate>> measure_compute_by_width(const std::vector<int64_t>& widths, bool quick) {
  std::vector<WidthRate> out;
  for (int64_t w : widths) {
    MachineBenchOptions o;
    o.model = width_probe_model(w);
    o.micro_batch = 2;
    o.seq_len = 256;
    ASSIGN_OR_RETURN(std::unique_ptr<ComputeProbe> probe, ComputeProbe::create(o));
    // A warm-up, then repeats for about a quarter (quick: a tenth) of a second, at least one:
    // a wide probe takes seconds, and its time varies less than a narrow one's.
    ASSIGN_OR_RETURN(double first, probe->run_once());
    const int repeats = std::clamp(static_cast<int>((quick ? 0.1 : 0.25) / std::max(first, 1e-6)), 1, 15);
    std::vector<double> s;
    for (int i = 0; i < repeats; ++i) {
      ASSIGN_OR_RETURN(double t, probe->run_once());
      s.push_back(t);
    }
    std::sort(s.begin(), s.end());
    const double median = s[s.size() / 2];
    out.push_back({w, probe->flops() / median, median});
  }
  return out;
}

Result<CopyRates> measure_copies(Device& device, uint64_t bytes, int repeats) {
  ASSIGN_OR_RETURN(DeviceAllocation up, device.allocate(bytes));
  ASSIGN_OR_RETURN(DeviceAllocation down, device.allocate(bytes));
  ASSIGN_OR_RETURN(HostAllocation host_src, device.allocate_pinned(bytes));
  ASSIGN_OR_RETURN(HostAllocation host_dst, device.allocate_pinned(bytes));
  std::memset(host_src.data(), 1, bytes);
  std::memset(host_dst.data(), 2, bytes);
  std::unique_ptr<Stream> h2d = device.create_stream(), d2h = device.create_stream();
  // Fill the device buffers once (the first touch of CPU "device" memory is a page fault).
  device.copy(up.data(), host_src.data(), bytes, *h2d);
  device.copy(down.data(), host_src.data(), bytes, *h2d);
  h2d->synchronize();
  CopyRates r;
  const double b = static_cast<double>(bytes);
  r.h2d = b / median_seconds(repeats, [&] {
    device.copy(up.data(), host_src.data(), bytes, *h2d);
    h2d->synchronize();
  });
  r.d2h = b / median_seconds(repeats, [&] {
    device.copy(host_dst.data(), down.data(), bytes, *d2h);
    d2h->synchronize();
  });
  r.both = 2 * b / median_seconds(repeats, [&] {
    device.copy(up.data(), host_src.data(), bytes, *h2d);
    device.copy(host_dst.data(), down.data(), bytes, *d2h);
    h2d->synchronize();
    d2h->synchronize();
  });
  // Many 4 KiB copies queued at once, each behind an event as a chunk move is: what one copy
  // costs beyond its bytes.
  constexpr int kSmall = 256;
  constexpr uint64_t kSmallBytes = 4096;
  std::unique_ptr<Event> event = device.create_event();
  const double small = median_seconds(repeats, [&] {
    for (int i = 0; i < kSmall; ++i) {
      h2d->wait(*event);
      device.copy(static_cast<char*>(up.data()) + (i % 64) * kSmallBytes, host_src.data(), kSmallBytes, *h2d);
      event->record(*h2d);
    }
    h2d->synchronize();
  });
  r.latency_s = std::max(0.0, small / kSmall - static_cast<double>(kSmallBytes) / r.h2d);
  return r;
}

double measure_memcpy(uint64_t bytes, int repeats) {
  Buffer src = aligned_buffer(bytes, 1), dst = aligned_buffer(bytes, 2);
  if (!src || !dst) return 0;
  const int64_t blocks = static_cast<int64_t>((bytes + (1 << 20) - 1) >> 20);
  const double all_threads = median_seconds(repeats, [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < blocks; ++i) {
      const uint64_t start = static_cast<uint64_t>(i) << 20;
      std::memcpy(dst.get() + start, src.get() + start, std::min<uint64_t>(1 << 20, bytes - start));
    }
  });
  // One thread can beat all of them on a machine whose other cores are busy.
  const double one_thread = median_seconds(repeats, [&] { std::memcpy(dst.get(), src.get(), bytes); });
  return 2.0 * static_cast<double>(bytes) / std::min(all_threads, one_thread);  // read + write
}

Result<AdamRates> measure_adamw(const std::vector<int64_t>& sizes, int repeats) {
  int64_t n = 0;
  for (int64_t s : sizes) n += s;
  const uint64_t bytes = static_cast<uint64_t>(n) * sizeof(float);
  Buffer w = aligned_buffer(bytes, 0), g = aligned_buffer(bytes, 0), m = aligned_buffer(bytes, 0),
         v = aligned_buffer(bytes, 0);
  if (!w || !g || !m || !v) return Status::OutOfMemory("cannot allocate the AdamW benchmark's " + format_bytes(4 * bytes));
  auto f = [](const Buffer& b) { return reinterpret_cast<float*>(b.get()); };
  float* grad = f(g);
  auto fill_grads = [&] {
    for (int64_t i = 0; i < n; ++i) grad[i] = 1e-3f * static_cast<float>(i % 997 - 498) / 498.0f + 1e-6f;
  };
  fill_grads();
  kernels::AdamWParams p{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  const kernels::SimdLevel level = kernels::detect_simd_level();
  // Each tensor at its offset, as the optimizer updates them one by one.
  auto each = [&](const std::function<void(int64_t offset, int64_t count)>& fn) {
    int64_t offset = 0;
    for (int64_t s : sizes) fn(offset, s), offset += s;
  };
  AdamRates r;
  r.simd = static_cast<double>(n) / median_seconds(repeats, [&] {
    ++p.step;
    each([&](int64_t o, int64_t c) { kernels::adamw_step_f32(f(w) + o, grad + o, f(m) + o, f(v) + o, c, p, level); });
  });
  r.device = static_cast<double>(n) / median_seconds(repeats, [&] {
    ++p.step;
    each([&](int64_t o, int64_t c) { kernels::cpu::adamw_step(f(w) + o, grad + o, f(m) + o, f(v) + o, c, p); });
  });
  double sink = 0;
  r.grad_passes = 2.0 * static_cast<double>(bytes) / median_seconds(repeats, [&] {
    each([&](int64_t o, int64_t c) { std::memset(grad + o, 0, static_cast<size_t>(c) * sizeof(float)); });
    each([&](int64_t o, int64_t c) { sink += kernels::cpu::sum_squares(grad + o, c); });
  });
  if (!(sink == 0)) return Status::Internal("the zeroed gradients summed to " + std::to_string(sink));
  return r;
}

Status stream_chunks(IoEngine& engine, int file, IoOp op, uint64_t size, uint64_t chunk,
                     const std::vector<char*>& buffers) {
  const uint64_t depth = buffers.size();
  const uint64_t chunks = size / chunk;
  std::vector<IoTicket> tickets(depth, 0);
  auto finish = [&](uint64_t i) -> Status {
    const uint64_t slot = i % depth;
    RETURN_IF_ERROR(engine.wait(tickets[slot]));
    tickets[slot] = 0;
    if (op == IoOp::kRead && std::memcmp(buffers[slot], &i, sizeof(i)) != 0) {
      return Status::Corruption("chunk " + std::to_string(i) + " read back with the wrong contents");
    }
    return Status::OK();
  };
  for (uint64_t i = 0; i < chunks; ++i) {
    const uint64_t slot = i % depth;
    if (tickets[slot] != 0) RETURN_IF_ERROR(finish(i - depth));
    if (op == IoOp::kWrite) std::memcpy(buffers[slot], &i, sizeof(i));
    ASSIGN_OR_RETURN(tickets[slot], engine.submit({op, file, buffers[slot], chunk, i * chunk}));
  }
  for (uint64_t i = chunks > depth ? chunks - depth : 0; i < chunks; ++i) RETURN_IF_ERROR(finish(i));
  return Status::OK();
}

Status stream_both(IoEngine& engine, int read_file, int write_file, uint64_t size, uint64_t chunk,
                   const std::vector<char*>& buffers) {
  const uint64_t depth = buffers.size();
  CHECK_MSG(depth >= 2 && depth % 2 == 0, "stream_both needs an even number of buffers");
  const uint64_t requests = 2 * (size / chunk);  // even: a read, odd: a write, of chunk i / 2
  std::vector<IoTicket> tickets(depth, 0);
  auto finish = [&](uint64_t i) -> Status {
    const uint64_t slot = i % depth, index = i / 2;
    RETURN_IF_ERROR(engine.wait(tickets[slot]));
    tickets[slot] = 0;
    if (i % 2 == 0 && std::memcmp(buffers[slot], &index, sizeof(index)) != 0)
      return Status::Corruption("chunk " + std::to_string(index) + " read back with the wrong contents");
    return Status::OK();
  };
  for (uint64_t i = 0; i < requests; ++i) {
    const uint64_t slot = i % depth, index = i / 2;
    if (tickets[slot] != 0) RETURN_IF_ERROR(finish(i - depth));
    const bool write = i % 2 == 1;
    if (write) std::memcpy(buffers[slot], &index, sizeof(index));
    ASSIGN_OR_RETURN(tickets[slot], engine.submit({write ? IoOp::kWrite : IoOp::kRead, write ? write_file : read_file,
                                                   buffers[slot], chunk, index * chunk}));
  }
  for (uint64_t i = requests > depth ? requests - depth : 0; i < requests; ++i) RETURN_IF_ERROR(finish(i));
  return Status::OK();
}

Result<DiskTiming> time_disk(IoEngine& engine, const std::string& dir, uint64_t size, uint64_t chunk,
                             const std::vector<char*>& buffers) {
  const std::string base = dir + "/strata_bench." + engine.name() + "." + std::to_string(::getpid());
  auto open_file = [](const std::string& path) {
    return std::make_unique<TempFile>(path, ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600));
  };
  auto opened = [&](const std::unique_ptr<TempFile>& f, const std::string& path) -> Status {
    if (f->fd() >= 0) return Status::OK();
    return Status::IOError("cannot open " + path + " with O_DIRECT: " + std::strerror(errno) +
                           "; the directory must be on a filesystem that supports O_DIRECT (not tmpfs)");
  };
  std::unique_ptr<TempFile> file = open_file(base + ".tmp");
  RETURN_IF_ERROR(opened(file, base + ".tmp"));
  std::unique_ptr<TempFile> second = open_file(base + ".2.tmp");
  RETURN_IF_ERROR(opened(second, base + ".2.tmp"));
  // Reserved on disk first, as the nvme tier reserves its files: the writes then time the
  // transfers, not the filesystem allocating blocks.
  for (const TempFile* f : {file.get(), second.get()})
    if (::fallocate(f->fd(), 0, 0, static_cast<off_t>(size)) != 0 && errno != EOPNOTSUPP && errno != ENOSYS)
      return Status::IOError("cannot reserve " + format_bytes(size) + " in " + dir + ": " + std::strerror(errno) +
                             "; the nvme tier's disk needs room for its files");
  ASSIGN_OR_RETURN(int id, engine.register_file(file->fd(), base + ".tmp"));
  ASSIGN_OR_RETURN(int id2, engine.register_file(second->fd(), base + ".2.tmp"));
  auto sync = [&](const TempFile& f) -> Status {
    if (::fsync(f.fd()) != 0) return Status::IOError("fsync of a file in " + dir + " failed: " + std::strerror(errno));
    return Status::OK();
  };
  // Written once before timing: the nvme tier overwrites its slots step after step, and a
  // first write into a reserved (unwritten) extent also converts it, which can halve the rate
  // on some filesystems and virtual disks.
  for (const int f : {id, id2}) RETURN_IF_ERROR(stream_chunks(engine, f, IoOp::kWrite, size, chunk, buffers));
  RETURN_IF_ERROR(sync(*file));
  RETURN_IF_ERROR(sync(*second));
  DiskTiming t;
  auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(stream_chunks(engine, id, IoOp::kWrite, size, chunk, buffers));
  RETURN_IF_ERROR(sync(*file));
  t.write_s = seconds_since(start);
  start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(stream_chunks(engine, id, IoOp::kRead, size, chunk, buffers));
  t.read_s = seconds_since(start);
  // Both at once, as the optimizer's phase pages state in and out: the first file read back
  // while the second is written, half the requests in flight each.
  start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(stream_both(engine, id, id2, size, chunk, buffers));
  RETURN_IF_ERROR(sync(*second));
  t.both_s = seconds_since(start);
  return t;
}

Result<MachineProfile> bench_machine(const MachineBenchOptions& o) {
  MachineProfile prof;
  MachineRates& r = prof.rates;
  const int repeats = o.quick ? 3 : 5;
  const uint64_t copy_bytes = o.quick ? (32ull << 20) : (256ull << 20);
  const double memcpy_rate = measure_memcpy(copy_bytes, repeats);
  if (!(memcpy_rate > 0)) return Status::OutOfMemory("cannot allocate the memcpy benchmark's buffers");
  auto add = [&](std::string name, double value, std::string unit, std::string reference, double ref) {
    prof.figures.push_back({std::move(name), value, std::move(unit), std::move(reference), ref});
  };

  // Compute, on the model's shapes, against the compute of the same micro-batch a dense GEMM
  // rate would predict is not measured here: the reference is the memcpy bound's FLOP-free
  // figure, so the compute line stands alone.
  if (o.device == "cpu") {
    ASSIGN_OR_RETURN(ComputeRate compute, measure_compute(o));
    r.compute_flops = compute.flops_per_s;
    r.copy_overlap = compute.copy_overlap;
    add("compute", compute.flops_per_s / 1e12, "TFLOP/s", fmt::format("one micro-batch, {:.3g} s", compute.seconds),
        compute.seconds);
    add("copy_overlap", compute.copy_overlap, "share", "1 = copies fully hidden behind compute", 1.0);
    std::vector<int64_t> widths = o.widths;
    std::sort(widths.begin(), widths.end());
    widths.erase(std::unique(widths.begin(), widths.end()), widths.end());
    ASSIGN_OR_RETURN(prof.compute_by_width, measure_compute_by_width(widths, o.quick));
    for (const WidthRate& w : prof.compute_by_width)
      add(fmt::format("compute@{}", w.width), w.flops_per_s / 1e12, "TFLOP/s",
          fmt::format("one micro-batch, {:.3g} s", w.seconds), w.seconds);
  }
  // On cuda the compute rate is not measured here yet: the profile keeps the default (an H200's
  // bf16 GEMM rate) and copy engines that run beside compute (copy_overlap 1).

  ASSIGN_OR_RETURN(std::unique_ptr<Device> device, open_device(o.device, 0, 0));
  ASSIGN_OR_RETURN(CopyRates copies, measure_copies(*device, copy_bytes, repeats));
  r.h2d_bytes_per_s = copies.h2d;
  r.d2h_bytes_per_s = copies.d2h;
  r.both_bytes_per_s = copies.both;
  r.copy_latency_s = copies.latency_s;
  const double half_memcpy = memcpy_rate / 2 / 1e9;  // a copy's bytes counted once, as memcpy moves them
  add("h2d", copies.h2d / 1e9, "GB/s", "memcpy", half_memcpy);
  add("d2h", copies.d2h / 1e9, "GB/s", "memcpy", half_memcpy);
  add("both", copies.both / 1e9, "GB/s", "memcpy", half_memcpy);
  add("copy_latency", copies.latency_s * 1e6, "us", "a 4 KiB memcpy", 4096.0 / (memcpy_rate / 2) * 1e6);

  // AdamW over the model's own tensors (the first ones up to a cap), one call per tensor.
  const int64_t cap = o.quick ? (int64_t{4} << 20) : (int64_t{32} << 20);
  std::vector<int64_t> sizes;
  int64_t total = 0;
  const model::ParamLayout layout(o.model);  // outlives the loop: tensors() is a reference into it
  for (const model::TensorSpec& spec : layout.tensors()) {
    if (total >= cap) break;
    sizes.push_back(std::min(spec.numel, cap - total));
    total += sizes.back();
  }
  ASSIGN_OR_RETURN(AdamRates adam, measure_adamw(sizes, repeats));
  r.cpu_adam_params_per_s = adam.simd;
  // AdamW reads and writes 28 B/param; the memcpy bound's rate in those bytes.
  add("cpu_adam", adam.simd / 1e9, "Gparam/s", "memcpy bound at 28 B/param", memcpy_rate / 28 / 1e9);
  if (o.device == "cpu") {
    // The CPU backend's device tier is host memory: its AdamW and its passes over the
    // gradients run on the same cores and memory.
    r.device_adam_params_per_s = adam.device;
    r.device_memory_bytes_per_s = adam.grad_passes;
    add("device_adam", adam.device / 1e9, "Gparam/s", "memcpy bound at 28 B/param", memcpy_rate / 28 / 1e9);
    add("grad_passes", adam.grad_passes / 1e9, "GB/s", "memcpy, read + write", memcpy_rate / 1e9);
  }
  add("memcpy", memcpy_rate / 1e9, "GB/s", "read + write", memcpy_rate / 1e9);

  if (!o.disk_dir.empty()) {
    // Sizes as the nvme tier moves them: chunks of tens of MiB, a gigabyte or more per phase.
    const uint64_t size = o.quick ? (64ull << 20) : (1ull << 30), chunk = 4ull << 20, depth = 32;
    IoEngineOptions io;
    io.queue_depth = depth;
    io.threads = depth;
    std::vector<double> w, rd, both;
    for (int i = 0; i < (o.quick ? 1 : 3); ++i) {
      // An engine per round: it holds the files it registered until it goes, and each round's
      // files take disk space until then.
      ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> engine, make_io_engine(io));
      // The buffers are host-tier slots, reserved and registered with the engine as the tier
      // does it: registering memory nothing has touched yet pins it in one go, and on some
      // machines (this project's 2-core VM among them) the disk then moves twice the bytes per
      // second it does into memory that was written first and registered after.
      ASSIGN_OR_RETURN(std::unique_ptr<TierSlots> slots,
                       TierSlots::create_host(*device, engine.get(), depth * chunk, chunk, depth * chunk));
      std::vector<char*> buffers;
      for (uint32_t b = 0; b < depth; ++b) {
        buffers.push_back(static_cast<char*>(slots->data(b)));
        std::memset(buffers.back(), static_cast<int>(b + 1), chunk);
      }
      ASSIGN_OR_RETURN(DiskTiming t, time_disk(*engine, o.disk_dir, size, chunk, buffers));
      w.push_back(t.write_s);
      rd.push_back(t.read_s);
      both.push_back(t.both_s);
    }
    std::sort(w.begin(), w.end());
    std::sort(rd.begin(), rd.end());
    std::sort(both.begin(), both.end());
    r.disk_write_bytes_per_s = static_cast<double>(size) / w[w.size() / 2];
    r.disk_read_bytes_per_s = static_cast<double>(size) / rd[rd.size() / 2];
    add("disk_write", r.disk_write_bytes_per_s / 1e9, "GB/s", "memcpy", half_memcpy);
    add("disk_read", r.disk_read_bytes_per_s / 1e9, "GB/s", "memcpy", half_memcpy);
    r.disk_both_bytes_per_s = 2.0 * static_cast<double>(size) / both[both.size() / 2];
    add("disk_both", r.disk_both_bytes_per_s / 1e9, "GB/s", "memcpy", half_memcpy);
  }
  prof.description = fmt::format("strata bench machine{}, {} backend, {} threads, on {}, {}", o.quick ? " --quick" : "",
                                 o.device, omp_get_max_threads(), host_name(), today());
  return prof;
}

std::string hardware_yaml(const MachineProfile& p) {
  const MachineRates& r = p.rates;
  std::string y = "# A hardware profile for `strata plan --hardware FILE` and `strata train --hardware FILE`.\n";
  y += "hardware:\n";
  y += fmt::format("  profile: \"{}\"\n", p.description);
  y += fmt::format("  gpu_tflops: {:.6g}          # compute rate on the model's shapes, 10^12 FLOP/s\n", r.compute_flops / 1e12);
  if (!p.compute_by_width.empty()) {
    y += "  cpu_tflops_by_width: [";
    for (size_t i = 0; i < p.compute_by_width.size(); ++i)
      y += fmt::format("{}\"{}:{:.6g}\"", i ? ", " : "", p.compute_by_width[i].width,
                       p.compute_by_width[i].flops_per_s / 1e12);
    y += "]  # cpu backend: compute rate by model width (hidden size), 10^12 FLOP/s\n";
  }
  y += fmt::format("  h2d_gbps: {:.6g}            # host to device, 10^9 bytes/s\n", r.h2d_bytes_per_s / 1e9);
  y += fmt::format("  d2h_gbps: {:.6g}            # device to host, 10^9 bytes/s\n", r.d2h_bytes_per_s / 1e9);
  y += fmt::format("  both_gbps: {:.6g}           # both directions at once, together, 10^9 bytes/s\n",
                   r.both_bytes_per_s / 1e9);
  y += fmt::format("  copy_latency_us: {:.4g}      # each chunk move's own cost beyond its bytes, microseconds\n",
                   r.copy_latency_s * 1e6);
  y += fmt::format("  copy_overlap: {:.3g}        # share of copy time hidden behind compute, 0..1\n", r.copy_overlap);
  y += fmt::format("  disk_read_gbps: {:.6g}      # 10^9 bytes/s\n", r.disk_read_bytes_per_s / 1e9);
  y += fmt::format("  disk_write_gbps: {:.6g}     # 10^9 bytes/s\n", r.disk_write_bytes_per_s / 1e9);
  if (r.disk_both_bytes_per_s > 0)
    y += fmt::format("  disk_both_gbps: {:.6g}      # reads and writes at once, together, 10^9 bytes/s\n",
                     r.disk_both_bytes_per_s / 1e9);
  y += fmt::format("  cpu_adam_gparams: {:.6g}    # 10^9 parameters/s\n", r.cpu_adam_params_per_s / 1e9);
  y += fmt::format("  device_adam_gparams: {:.6g} # 10^9 parameters/s\n", r.device_adam_params_per_s / 1e9);
  y += fmt::format("  device_mem_gbps: {:.6g}     # read + write, 10^9 bytes/s\n", r.device_memory_bytes_per_s / 1e9);
  for (const MachineFigure& f : p.figures)
    y += fmt::format("# measured {}: {:.4g} {} (reference, {}: {:.4g})\n", f.name, f.value, f.unit, f.reference,
                     f.reference_value);
  return y;
}

Result<std::vector<std::string>> hardware_overrides(const std::string& path) {
  ConfigSchema schema;
  for (const ConfigKey& k : train_schema().keys())
    if (k.name.rfind("hardware.", 0) == 0) schema.add(k);
  Result<Config> c = Config::load_file(schema, path);
  if (!c.ok())
    return c.status().with_context("hardware profile " + path)
        .with_note("a profile holds hardware.* keys only; `strata bench machine --out FILE` writes one");
  std::vector<std::string> out;
  for (const ConfigKey& k : schema.keys()) {
    if (k.name == "hardware.profile" || !c->is_set(k.name)) continue;
    if (k.type == ConfigType::kStringList) {
      std::string list;
      for (const std::string& item : c->get_list(k.name)) list += (list.empty() ? "" : ",") + item;
      out.push_back(fmt::format("{}=[{}]", k.name, list));
    } else {
      out.push_back(fmt::format("{}={}", k.name, c->get_float(k.name)));
    }
  }
  const std::string described = c->get_string("hardware.profile");
  out.push_back("hardware.profile=" + path + (described.empty() ? "" : " (" + described + ")"));
  return out;
}

}  // namespace strata
