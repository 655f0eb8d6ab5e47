// IdleComm: one rank of a data-parallel world whose collectives move nothing, for tests that run
// a single rank's engine in one process and look at what it does to its own state (its chunk
// traffic, its tiers), not at what the ranks exchange. A gather hands every rank this rank's
// values, as though each rank had sent the same; every other operation leaves the buffers as
// they are. Counts nothing as sent.
#pragma once

#include <cstring>

#include "parallel/comm.h"

namespace strata::testing {

class IdleComm : public parallel::Comm {
 public:
  IdleComm(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return "idle"; }
  Status all_gather(const void* send, void* recv, size_t bytes, Stream* stream) override {
    if (stream != nullptr) stream->synchronize();
    for (int r = 0; r < world_; ++r) std::memmove(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes, send, bytes);
    return Status::OK();
  }
  Status reduce_scatter_sum(const float*, float*, size_t, Stream*) override { return Status::OK(); }
  Status all_reduce_sum(float*, size_t, Stream*) override { return Status::OK(); }
  Status reduce_sum(float*, size_t, int, Stream*) override { return Status::OK(); }
  Status all_to_all_v(const void*, std::span<const size_t>, void*, std::span<const size_t>, Stream*) override {
    return Status::OK();
  }
  Status broadcast(void*, size_t, int, Stream*) override { return Status::OK(); }
  Status send_recv(const void*, int, void*, int, size_t, Stream*) override { return Status::OK(); }
  Status all_gather_v(void*, std::span<const size_t>, Stream*) override { return Status::OK(); }
  Status reduce_scatter_v_sum(float*, std::span<const size_t>, Stream*) override { return Status::OK(); }
  Status barrier() override { return Status::OK(); }
  uint64_t bytes_sent() const override { return 0; }

 private:
  int rank_, world_;
};

}  // namespace strata::testing
