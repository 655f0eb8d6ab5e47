// Comm: the collective operations data and expert parallelism need (DESIGN §3.5), over one
// interface for every backend: Gloo over TCP for the CPU backend (what CI runs multi-process),
// NCCL for CUDA devices, and a local one for a single process.
//
// Every operation is collective: each rank calls the same operations in the same order with
// the same sizes. Buffers are host memory when `stream` is null; with a stream they are that
// stream's device's memory and the operation is queued on the stream (NCCL), returning before
// it completes. The CPU backend (Gloo) first waits for the work queued on a stream it is
// given (the CPU backend's own), then runs the operation to completion before it returns.
//
// Reproducibility: reduce_scatter_sum, reduce_scatter_v_sum, all_reduce_sum and reduce_sum add
// in rank order, every element computed as ((x_0 + x_1) + x_2) + ... on the Gloo and local
// backends, so a run repeats bit for bit and equals one process that accumulates the same
// addends in that order. NCCL sums in the order of its ring or tree, fixed for a given world
// size and topology.
//
// Failures: an operation that cannot complete within the timeout (a rank died or hangs)
// returns an error naming this rank, the operation and what was waited for; the Comm is then
// unusable and the process should exit. A rank that exits closes its connections, so the
// others usually learn at once rather than at the timeout.
//
// Not thread-safe: one thread issues a Comm's operations. Use another Comm (connect() with
// another name) for a second thread, e.g. checkpoint saves beside training.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/device.h"
#include "core/status.h"
#include "parallel/launch.h"

namespace strata::parallel {

class Comm {
 public:
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "local", "gloo" or "nccl".
  virtual const char* backend() const = 0;

  // recv (world_size * bytes) receives each rank's `bytes` of send, in rank order.
  virtual Status all_gather(const void* send, void* recv, size_t bytes, Stream* stream = nullptr) = 0;
  // send holds world_size blocks of `count` floats; this rank's recv gets the sum over ranks of
  // block rank(). send and recv may not overlap.
  virtual Status reduce_scatter_sum(const float* send, float* recv, size_t count, Stream* stream = nullptr) = 0;
  // data (count floats) becomes the sum over ranks, on every rank.
  virtual Status all_reduce_sum(float* data, size_t count, Stream* stream = nullptr) = 0;
  // root's data (count floats) becomes the sum over ranks; the others' data is left as it was.
  // Each rank but root sends its count floats once (what ZeRO-1's gradient reduction of a
  // range onto the rank that owns it costs).
  virtual Status reduce_sum(float* data, size_t count, int root, Stream* stream = nullptr) = 0;
  // Sends send_bytes[r] bytes (consecutive in send, in rank order) to rank r and receives
  // recv_bytes[r] bytes from rank r into recv, consecutive in rank order. Both spans have
  // world_size entries; what rank a sends to b must be what b expects from a.
  virtual Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, void* recv,
                              std::span<const size_t> recv_bytes, Stream* stream = nullptr) = 0;
  // data (bytes) becomes root's on every rank.
  virtual Status broadcast(void* data, size_t bytes, int root, Stream* stream = nullptr) = 0;
  // In place, over blocks of uneven sizes: data holds world_size blocks, consecutive in rank
  // order, block r of bytes[r] bytes (some may be empty). all_gather_v: every rank's block r
  // becomes rank r's. reduce_scatter_v_sum (blocks of counts[r] floats): rank r's block r
  // becomes the sum over ranks of block r (in the order above); the other blocks are left as
  // they were. One call moves what a broadcast (or reduce_sum) per block would, in one
  // collective: a tensor shared out over the ranks by contiguous ranges is gathered, or summed
  // onto its ranges' ranks, at once. `bytes` and `counts` have world_size entries, the same on
  // every rank.
  virtual Status all_gather_v(void* data, std::span<const size_t> bytes, Stream* stream = nullptr) = 0;
  virtual Status reduce_scatter_v_sum(float* data, std::span<const size_t> counts, Stream* stream = nullptr) = 0;
  // A step of a ring: sends `bytes` of send to rank `to` and receives `bytes` from rank `from`
  // into recv (send and recv may not overlap). The ranks that exchange call it together, each with
  // the same bytes (context parallelism's ring attention passes keys and values on so, every rank
  // sending to the next and receiving from the one before).
  virtual Status send_recv(const void* send, int to, void* recv, int from, size_t bytes, Stream* stream = nullptr) = 0;
  // Returns once every rank has called it.
  virtual Status barrier() = 0;

  // Bytes this rank has sent, counted per operation as the algorithm moves them (what the
  // planner's communication count is compared with).
  virtual uint64_t bytes_sent() const = 0;

 protected:
  Comm() = default;
};

// Host-side helpers over any Comm, for the scalars a step shares (loss sums, token counts,
// squared norms, expert counts): gathered and added in rank order, so every rank gets the same
// bits whatever the backend.
Result<double> sum_over_ranks(Comm& comm, double value);
Status sum_over_ranks(Comm& comm, std::span<double> values);
Status sum_over_ranks(Comm& comm, std::span<int64_t> values);

struct CommOptions {
  // "auto": local for a world of one, else gloo. "gloo", "nccl" or "local" force one (local
  // only serves a world of one). The trainer asks for nccl on CUDA devices.
  std::string backend = "auto";
  // Rendezvous: a folder every rank can read and write (a shared file system across nodes).
  // Each rank leaves its address there under `name`; use a fresh folder for each run (or a
  // launcher whose job id changes), since addresses left by an earlier run would be read as
  // this one's. Needed for a world above one.
  std::string rendezvous_dir;
  // Tells apart Comms connected through the same folder (e.g. "train" and "ckpt"); every rank
  // uses the same name for the same Comm.
  std::string name = "default";
  // How long an operation (and the rendezvous) waits for the other ranks before failing.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // The address this rank listens on, as other ranks reach it. Empty: the interface named by
  // GLOO_SOCKET_IFNAME when set, else 127.0.0.1 when the whole world runs on this node, else
  // this host's name (which must resolve to an address the other nodes can reach).
  std::string hostname;
  // The local backend copies buffers passed with a stream through this device (e.g. CUDA
  // memory); without it they must be host memory. The nccl backend uses the CUDA device
  // current on the calling thread, which the caller picks (usually from local_rank).
  Device* device = nullptr;
};

// Connects this rank to the others. A world of one gets the local backend unless one is forced.
// Errors: InvalidArgument for a bad backend name or a missing rendezvous folder; Unimplemented
// when this build lacks the backend; IOError when the rendezvous fails or times out.
Result<std::unique_ptr<Comm>> connect(const LaunchInfo& launch, const CommOptions& options);

// The backend of a single process: copies where the operation moves data, nothing else.
// `device`, when given, copies buffers passed with a stream; without it they must be host memory.
std::unique_ptr<Comm> make_local_comm(Device* device = nullptr);

}  // namespace strata::parallel
