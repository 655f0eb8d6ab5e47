#include "parallel/comm.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "core/check.h"

#if STRATA_HAVE_GLOO
#include "parallel/gloo_comm.h"
#endif
#if STRATA_HAVE_NCCL
#include "parallel/cuda/nccl_comm.h"
#endif

namespace strata::parallel {
namespace {

// Gathers every rank's values and adds them in rank order, so that all ranks hold the same bits.
template <typename T>
Status sum_in_rank_order(Comm& comm, std::span<T> values) {
  const size_t n = values.size();
  std::vector<T> all(n * static_cast<size_t>(comm.world_size()));
  RETURN_IF_ERROR(comm.all_gather(values.data(), all.data(), n * sizeof(T)));
  for (size_t i = 0; i < n; ++i) {
    T acc = all[i];
    for (int r = 1; r < comm.world_size(); ++r) acc += all[static_cast<size_t>(r) * n + i];
    values[i] = acc;
  }
  return Status::OK();
}

class LocalComm final : public Comm {
 public:
  explicit LocalComm(Device* device) : device_(device) {}

  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  const char* backend() const override { return "local"; }

  Status all_gather(const void* send, void* recv, size_t bytes, Stream* stream) override {
    copy(recv, send, bytes, stream);
    return Status::OK();
  }
  Status reduce_scatter_sum(const float* send, float* recv, size_t count, Stream* stream) override {
    copy(recv, send, count * sizeof(float), stream);
    return Status::OK();
  }
  Status all_reduce_sum(float*, size_t, Stream*) override { return Status::OK(); }
  Status reduce_sum(float*, size_t, int root, Stream*) override {
    CHECK(root == 0);
    return Status::OK();
  }
  Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, void* recv,
                      std::span<const size_t> recv_bytes, Stream* stream) override {
    CHECK(send_bytes.size() == 1 && recv_bytes.size() == 1 && send_bytes[0] == recv_bytes[0]);
    copy(recv, send, send_bytes[0], stream);
    return Status::OK();
  }
  Status send_recv(const void* send, int to, void* recv, int from, size_t bytes, Stream* stream) override {
    CHECK(to == 0 && from == 0);
    copy(recv, send, bytes, stream);
    return Status::OK();
  }
  Status broadcast(void*, size_t, int root, Stream*) override {
    CHECK(root == 0);
    return Status::OK();
  }
  Status all_gather_v(void*, std::span<const size_t> bytes, Stream*) override {
    CHECK(bytes.size() == 1);
    return Status::OK();
  }
  Status reduce_scatter_v_sum(float*, std::span<const size_t> counts, Stream*) override {
    CHECK(counts.size() == 1);
    return Status::OK();
  }
  Status barrier() override { return Status::OK(); }
  uint64_t bytes_sent() const override { return 0; }

 private:
  void copy(void* dst, const void* src, size_t bytes, Stream* stream) {
    if (bytes == 0 || dst == src) return;
    if (stream != nullptr && device_ != nullptr) {
      device_->copy(dst, src, bytes, *stream, "comm");
      return;
    }
    // Host memory: the stream's earlier work (a CPU stream's thread) must have written send.
    if (stream != nullptr) stream->synchronize();
    std::memcpy(dst, src, bytes);
  }

  Device* const device_;
};

}  // namespace

Result<double> sum_over_ranks(Comm& comm, double value) {
  RETURN_IF_ERROR(sum_in_rank_order(comm, std::span<double>(&value, 1)));
  return value;
}
Status sum_over_ranks(Comm& comm, std::span<double> values) { return sum_in_rank_order(comm, values); }
Status sum_over_ranks(Comm& comm, std::span<int64_t> values) { return sum_in_rank_order(comm, values); }

std::unique_ptr<Comm> make_local_comm(Device* device) { return std::make_unique<LocalComm>(device); }

namespace {

// A Comm over host memory across processes: Gloo when this build has it.
Result<std::unique_ptr<Comm>> connect_host(const LaunchInfo& launch, const CommOptions& options) {
  if (options.rendezvous_dir.empty()) {
    return Status::InvalidArgument(
        fmt::format("{} processes need a rendezvous folder that every rank can reach; set parallel.rendezvous to a "
                    "fresh folder on a file system all nodes share (started by {})",
                    launch.world_size, launch.launcher));
  }
#if STRATA_HAVE_GLOO
  return connect_gloo(launch, options);
#else
  return Status::Unimplemented(fmt::format(
      "{} processes need the Gloo library, which this build lacks; install libgloo-dev (scripts/setup.sh) and "
      "configure again",
      launch.world_size));
#endif
}

}  // namespace

Result<std::unique_ptr<Comm>> connect(const LaunchInfo& launch, const CommOptions& options) {
  const std::string& backend = options.backend;
  if (backend != "auto" && backend != "gloo" && backend != "nccl" && backend != "local") {
    return Status::InvalidArgument(
        fmt::format("parallel backend \"{}\" is not one of auto, gloo, nccl, local", backend));
  }
  CHECK(launch.world_size >= 1 && launch.rank >= 0 && launch.rank < launch.world_size);
  if (backend == "local" || (backend == "auto" && launch.world_size == 1)) {
    if (launch.world_size != 1) {
      return Status::InvalidArgument(fmt::format(
          "the local parallel backend serves one process, but the launcher ({}) started {}; choose gloo or nccl",
          launch.launcher, launch.world_size));
    }
    return make_local_comm(options.device);
  }
  if (backend == "nccl") {
#if STRATA_HAVE_NCCL
    // NCCL's bootstrap (its unique id, and the operations on host buffers): local for one
    // process, Gloo for more.
    std::unique_ptr<Comm> bootstrap;
    if (launch.world_size == 1) {
      bootstrap = make_local_comm();
    } else {
      ASSIGN_OR_RETURN(bootstrap, connect_host(launch, options));
    }
    return connect_nccl(std::move(bootstrap));
#else
    return Status::Unimplemented(
        "parallel backend nccl needs a CUDA build of strata (STRATA_CUDA=ON) with NCCL (libnccl-dev)");
#endif
  }
  return connect_host(launch, options);
}

}  // namespace strata::parallel
