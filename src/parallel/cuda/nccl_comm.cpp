#include "parallel/cuda/nccl_comm.h"

#if STRATA_HAVE_NCCL

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <vector>

#include "core/check.h"
#include "core/cuda/cuda_device.h"

namespace strata::parallel {
namespace {

class NcclComm final : public Comm {
 public:
  NcclComm(std::unique_ptr<Comm> bootstrap, ncclComm_t comm)
      : bootstrap_(std::move(bootstrap)), comm_(comm), rank_(bootstrap_->rank()), world_(bootstrap_->world_size()) {}
  ~NcclComm() override {
    // A failed communicator was aborted already; a healthy one is destroyed once its work ends.
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return "nccl"; }
  uint64_t bytes_sent() const override { return bytes_sent_ + bootstrap_->bytes_sent(); }

  Status all_gather(const void* send, void* recv, size_t bytes, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->all_gather(send, recv, bytes);
    bytes_sent_ += bytes * (world_ - 1);
    return check(fmt::format("all_gather of {} bytes per rank", bytes),
                 ncclAllGather(send, recv, bytes, ncclUint8, comm_, handle(*stream)));
  }

  Status reduce_scatter_sum(const float* send, float* recv, size_t count, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->reduce_scatter_sum(send, recv, count);
    bytes_sent_ += count * sizeof(float) * (world_ - 1);
    return check(fmt::format("reduce_scatter_sum of {} floats per rank", count),
                 ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, comm_, handle(*stream)));
  }

  Status all_reduce_sum(float* data, size_t count, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->all_reduce_sum(data, count);
    // A ring all-reduce: a reduce-scatter and an all-gather of 1/world each.
    bytes_sent_ += 2 * count * sizeof(float) * (world_ - 1) / world_;
    return check(fmt::format("all_reduce_sum of {} floats", count),
                 ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_, handle(*stream)));
  }

  Status reduce_sum(float* data, size_t count, int root, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->reduce_sum(data, count, root);
    // A ring reduce: every rank but the root passes the whole buffer on once.
    if (rank_ != root) bytes_sent_ += count * sizeof(float);
    return check(fmt::format("reduce_sum of {} floats to rank {}", count, root),
                 ncclReduce(data, data, count, ncclFloat, ncclSum, root, comm_, handle(*stream)));
  }

  Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, void* recv,
                      std::span<const size_t> recv_bytes, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->all_to_all_v(send, send_bytes, recv, recv_bytes);
    CHECK(send_bytes.size() == static_cast<size_t>(world_) && recv_bytes.size() == static_cast<size_t>(world_));
    cudaStream_t s = handle(*stream);
    size_t total_send = 0, total_recv = 0;
    for (int r = 0; r < world_; ++r) total_send += send_bytes[r], total_recv += recv_bytes[r];
    const std::string what = fmt::format("all_to_all_v sending {} bytes, receiving {}", total_send, total_recv);
    const auto* in = static_cast<const uint8_t*>(send);
    auto* out = static_cast<uint8_t*>(recv);
    ncclResult_t result = ncclGroupStart();
    for (int r = 0; r < world_ && result == ncclSuccess; ++r) {
      if (send_bytes[r] > 0) result = ncclSend(in, send_bytes[r], ncclUint8, r, comm_, s);
      if (result == ncclSuccess && recv_bytes[r] > 0) result = ncclRecv(out, recv_bytes[r], ncclUint8, r, comm_, s);
      in += send_bytes[r];
      out += recv_bytes[r];
      if (r != rank_) bytes_sent_ += send_bytes[r];
    }
    const ncclResult_t end = ncclGroupEnd();
    return check(what, result != ncclSuccess ? result : end);
  }

  Status send_recv(const void* send, int to, void* recv, int from, size_t bytes, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->send_recv(send, to, recv, from, bytes);
    CHECK(to >= 0 && to < world_ && from >= 0 && from < world_);
    const std::string what = fmt::format("send_recv of {} bytes to rank {} from rank {}", bytes, to, from);
    if (bytes == 0) return Status::OK();
    cudaStream_t s = handle(*stream);
    ncclResult_t result = ncclGroupStart();
    if (result == ncclSuccess) result = ncclSend(send, bytes, ncclUint8, to, comm_, s);
    if (result == ncclSuccess) result = ncclRecv(recv, bytes, ncclUint8, from, comm_, s);
    const ncclResult_t end = ncclGroupEnd();
    if (to != rank_) bytes_sent_ += bytes;
    return check(what, result != ncclSuccess ? result : end);
  }

  Status broadcast(void* data, size_t bytes, int root, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->broadcast(data, bytes, root);
    CHECK(root >= 0 && root < world_);
    // Down a ring from the root: every rank but the last one passes the data on.
    if (rank_ != (root + world_ - 1) % world_) bytes_sent_ += bytes;
    return check(fmt::format("broadcast of {} bytes from rank {}", bytes, root),
                 ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, handle(*stream)));
  }

  Status all_gather_v(void* data, std::span<const size_t> bytes, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->all_gather_v(data, bytes);
    CHECK(bytes.size() == static_cast<size_t>(world_));
    cudaStream_t s = handle(*stream);
    size_t total = 0;
    for (size_t b : bytes) total += b;
    // A broadcast of each block from its rank, grouped into one launch.
    auto* at = static_cast<uint8_t*>(data);
    ncclResult_t result = ncclGroupStart();
    for (int r = 0; r < world_ && result == ncclSuccess; ++r) {
      if (bytes[r] > 0) result = ncclBroadcast(at, at, bytes[r], ncclUint8, r, comm_, s);
      if (rank_ != (r + world_ - 1) % world_) bytes_sent_ += bytes[r];
      at += bytes[r];
    }
    const ncclResult_t end = ncclGroupEnd();
    return check(fmt::format("all_gather_v of {} bytes", total), result != ncclSuccess ? result : end);
  }

  Status reduce_scatter_v_sum(float* data, std::span<const size_t> counts, Stream* stream) override {
    if (stream == nullptr) return bootstrap_->reduce_scatter_v_sum(data, counts);
    CHECK(counts.size() == static_cast<size_t>(world_));
    cudaStream_t s = handle(*stream);
    size_t total = 0;
    for (size_t c : counts) total += c;
    // A reduce of each block onto its rank, grouped into one launch.
    float* at = data;
    ncclResult_t result = ncclGroupStart();
    for (int r = 0; r < world_ && result == ncclSuccess; ++r) {
      if (counts[r] > 0) result = ncclReduce(at, at, counts[r], ncclFloat, ncclSum, r, comm_, s);
      if (rank_ != r) bytes_sent_ += counts[r] * sizeof(float);
      at += counts[r];
    }
    const ncclResult_t end = ncclGroupEnd();
    return check(fmt::format("reduce_scatter_v_sum of {} floats", total), result != ncclSuccess ? result : end);
  }

  Status barrier() override { return bootstrap_->barrier(); }

 private:
  static cudaStream_t handle(Stream& stream) { return as_cuda_stream(stream).handle(); }

  // NCCL reports errors when an operation is queued; one that fails later (a peer lost) shows
  // in ncclCommGetAsyncError. Either way the communicator is aborted: NCCL cannot recover it.
  Status check(const std::string& what, ncclResult_t result) {
    if (comm_ == nullptr) {
      return Status::IOError(
          fmt::format("rank {} of {}: cannot run {}: the NCCL communicator failed earlier", rank_, world_, what));
    }
    ncclResult_t async = ncclSuccess;
    if (result == ncclSuccess && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async == ncclSuccess) {
      return Status::OK();
    }
    const ncclResult_t error = result != ncclSuccess ? result : async;
    std::string detail = ncclGetErrorString(error);
    if (const char* last = ncclGetLastError(comm_); last != nullptr && *last != '\0')
      detail += std::string(": ") + last;
    ncclCommAbort(comm_);
    comm_ = nullptr;
    return Status::IOError(fmt::format("rank {} of {}: NCCL {} failed: {}; a rank may have exited or hung; see its log",
                                       rank_, world_, what, detail));
  }

  std::unique_ptr<Comm> bootstrap_;
  ncclComm_t comm_;
  const int rank_;
  const int world_;
  uint64_t bytes_sent_ = 0;
};

}  // namespace

Result<std::unique_ptr<Comm>> connect_nccl(std::unique_ptr<Comm> bootstrap) {
  const int rank = bootstrap->rank(), world = bootstrap->world_size();
  ncclUniqueId id = {};
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return Status::IOError(fmt::format("rank 0 of {}: ncclGetUniqueId failed: {}", world, ncclGetErrorString(r)));
    }
  }
  RETURN_IF_ERROR(bootstrap->broadcast(&id, sizeof(id), 0));
  int device = -1;
  cudaGetDevice(&device);
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRank(&comm, world, id, rank);
  if (r != ncclSuccess) {
    std::string detail = ncclGetErrorString(r);
    if (comm != nullptr) ncclCommAbort(comm);
    return Status::IOError(
        fmt::format("rank {} of {}: creating the NCCL communicator on CUDA device {} failed: {}; "
                    "check that every rank sees its own GPU (NCCL_DEBUG=INFO says more)",
                    rank, world, device, detail));
  }
  return std::unique_ptr<Comm>(new NcclComm(std::move(bootstrap), comm));
}

}  // namespace strata::parallel

#endif  // STRATA_HAVE_NCCL
