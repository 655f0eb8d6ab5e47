#include "parallel/gloo_comm.h"

#if STRATA_HAVE_GLOO

#include <atomic>

#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/cpu_device.h"
#include "parallel/peer_process.h"

namespace strata::parallel {
namespace {

constexpr const char* kHint = "a rank may have exited or hung; see its log";

// Room for one transport address ("[ip]:port") or process identity in the exchange after connecting.
constexpr size_t kAddressBytes = 128;

class GlooComm final : public Comm {
 public:
  GlooComm(std::shared_ptr<gloo::rendezvous::Context> context, std::chrono::milliseconds timeout)
      : context_(std::move(context)), timeout_(timeout) {}

  // Learns, from every other rank, what names it when it goes away, in one small all-to-all
  // right after connecting: the address its connection to this rank listens at (Gloo names a
  // closed connection by its peer's address, "Connection closed by peer [ip]:port", which is that
  // one when this rank connected and an ephemeral port when it accepted), and its process
  // (parallel/peer_process.h), which a rank on the same machine can check.
  void learn_peers() {
    const size_t world = this->world();
    constexpr size_t kEntry = 2 * kAddressBytes;
    std::vector<char> send(world * kEntry, '\0'), recv(world * kEntry, '\0');
    const std::string me = own_process_identity();
    for (size_t r = 0; r < world; ++r) {
      if (static_cast<int>(r) == rank()) continue;
      const std::string address = context_->getPair(static_cast<int>(r))->address().str();
      std::strncpy(&send[r * kEntry], address.c_str(), kAddressBytes - 1);
      std::strncpy(&send[r * kEntry + kAddressBytes], me.c_str(), kAddressBytes - 1);
    }
    gloo::AlltoallOptions opts(context_);
    opts.setInput(send.data(), send.size());
    opts.setOutput(recv.data(), recv.size());
    opts.setTimeout(timeout_);
    gloo::alltoall(opts);
    peer_addresses_.assign(world, std::string());
    peer_processes_.assign(world, std::string());
    auto text = [&](size_t at) { return std::string(&recv[at], strnlen(&recv[at], kAddressBytes)); };
    for (size_t r = 0; r < world; ++r) {
      if (static_cast<int>(r) == rank()) continue;
      peer_addresses_[r] = text(r * kEntry);
      peer_processes_[r] = text(r * kEntry + kAddressBytes);
    }
  }

  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }
  const char* backend() const override { return "gloo"; }
  uint64_t bytes_sent() const override { return bytes_sent_; }

  Status all_gather(const void* send, void* recv, size_t bytes, Stream* stream) override {
    const std::string what = fmt::format("all_gather of {} bytes per rank", bytes);
    return run(what, stream, [&] {
      if (bytes == 0) return;
      gloo::AllgatherOptions opts(context_);
      opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
      opts.setOutput(static_cast<uint8_t*>(recv), bytes * world());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      // A ring: each rank passes on every block but its right neighbour's.
      bytes_sent_ += bytes * (world() - 1);
    });
  }

  Status reduce_scatter_sum(const float* send, float* recv, size_t count, Stream* stream) override {
    const std::string what = fmt::format("reduce_scatter_sum of {} floats per rank", count);
    return run(what, stream, [&] {
      std::vector<size_t> counts(world(), count);
      reduce_scatter(send, counts, recv);
    });
  }

  Status all_reduce_sum(float* data, size_t count, Stream* stream) override {
    const std::string what = fmt::format("all_reduce_sum of {} floats", count);
    return run(what, stream, [&] {
      // Reduce-scatter into blocks as even as possible (the first count % W one float longer),
      // then gather the sums back: every element is added in rank order by its block's owner.
      const size_t w = world();
      std::vector<size_t> counts(w, count / w);
      for (size_t r = 0; r < count % w; ++r) counts[r] += 1;
      size_t offset = 0;
      for (size_t r = 0; r < static_cast<size_t>(rank()); ++r) offset += counts[r];
      // data's own block is both input and output: reduce into a copy first.
      std::vector<float> mine(counts[rank()]);
      reduce_scatter(data, counts, mine.data());
      if (count == 0) return;
      if (!mine.empty()) std::memcpy(data + offset, mine.data(), mine.size() * sizeof(float));
      // No input: this rank's sums already sit at their place in data.
      gloo::AllgathervOptions opts(context_);
      opts.setOutput(data, std::vector<size_t>(counts.begin(), counts.end()));
      opts.setTimeout(timeout_);
      gloo::allgatherv(opts);
      bytes_sent_ += (count - counts[(rank() + 1) % w]) * sizeof(float);
    });
  }

  Status reduce_sum(float* data, size_t count, int root, Stream* stream) override {
    CHECK(root >= 0 && root < world_size());
    const std::string what = fmt::format("reduce_sum of {} floats to rank {}", count, root);
    return run(what, stream, [&] {
      // A reduce-scatter whose one block is root's: every rank sends it all of data, and root
      // adds what it received in rank order (data itself was sent before it is overwritten).
      std::vector<size_t> counts(world(), 0);
      counts[static_cast<size_t>(root)] = count;
      reduce_scatter(data, counts, data);
    });
  }

  Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, void* recv,
                      std::span<const size_t> recv_bytes, Stream* stream) override {
    CHECK(send_bytes.size() == world() && recv_bytes.size() == world());
    size_t total_send = 0, total_recv = 0;
    for (size_t r = 0; r < world(); ++r) total_send += send_bytes[r], total_recv += recv_bytes[r];
    const std::string what = fmt::format("all_to_all_v sending {} bytes, receiving {}", total_send, total_recv);
    return run(what, stream, [&] {
      alltoallv(static_cast<const uint8_t*>(send), send_bytes, static_cast<uint8_t*>(recv), recv_bytes, 1);
    });
  }

  Status send_recv(const void* send, int to, void* recv, int from, size_t bytes, Stream* stream) override {
    CHECK(to >= 0 && to < world_size() && from >= 0 && from < world_size());
    // A rank exchanges with itself only whole (Gloo has no pair to itself).
    CHECK((to == rank()) == (from == rank()));
    const std::string what = fmt::format("send_recv of {} bytes to rank {} from rank {}", bytes, to, from);
    return run(what, stream, [&] {
      // Every rank takes the next slot, whatever it moves, so the pairs' tags stay matched.
      const uint64_t slot = context_->nextSlot();
      if (bytes == 0) return;
      if (to == rank()) {
        std::memcpy(recv, send, bytes);
        return;
      }
      auto out = context_->createUnboundBuffer(const_cast<void*>(send), bytes);
      auto in = context_->createUnboundBuffer(recv, bytes);
      in->recv(from, slot);
      out->send(to, slot);
      // (Gloo throws at the timeout; false means the wait was aborted.)
      if (!in->waitRecv(timeout_) || !out->waitSend(timeout_)) throw std::runtime_error("the exchange was aborted");
      bytes_sent_ += bytes;
    });
  }

  Status broadcast(void* data, size_t bytes, int root, Stream* stream) override {
    CHECK(root >= 0 && root < world_size());
    const std::string what = fmt::format("broadcast of {} bytes from rank {}", bytes, root);
    return run(what, stream, [&] {
      if (bytes == 0) return;
      gloo::BroadcastOptions opts(context_);
      // In place on every rank (an input at the root would be copied onto itself).
      opts.setOutput(static_cast<uint8_t*>(data), bytes);
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
      // Gloo broadcasts down a binomial tree: in round i, ranks below 2^i (counted from the
      // root) send to the rank 2^i above them.
      const size_t w = world(), v = (static_cast<size_t>(rank()) + w - root) % w;
      for (size_t step = 1; step < w; step *= 2) {
        if (v < step && v + step < w) bytes_sent_ += bytes;
      }
    });
  }

  Status all_gather_v(void* data, std::span<const size_t> bytes, Stream* stream) override {
    CHECK(bytes.size() == world());
    size_t total = 0;
    for (size_t b : bytes) total += b;
    const std::string what = fmt::format("all_gather_v of {} bytes", total);
    return run(what, stream, [&] {
      if (total == 0) return;
      // No input: this rank's block already sits at its place in data.
      gloo::AllgathervOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(data), std::vector<size_t>(bytes.begin(), bytes.end()));
      opts.setTimeout(timeout_);
      gloo::allgatherv(opts);
      // A ring: each rank passes on every block but its right neighbour's.
      bytes_sent_ += total - bytes[(static_cast<size_t>(rank()) + 1) % world()];
    });
  }

  Status reduce_scatter_v_sum(float* data, std::span<const size_t> counts, Stream* stream) override {
    CHECK(counts.size() == world());
    size_t total = 0, offset = 0;
    for (size_t r = 0; r < world(); ++r) {
      total += counts[r];
      if (r < static_cast<size_t>(rank())) offset += counts[r];
    }
    const std::string what = fmt::format("reduce_scatter_v_sum of {} floats", total);
    return run(what, stream, [&] {
      // The blocks are all sent before this rank's sum overwrites its own.
      reduce_scatter(data, std::vector<size_t>(counts.begin(), counts.end()), data + offset);
    });
  }

  Status barrier() override {
    return run("barrier", nullptr, [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  size_t world() const { return static_cast<size_t>(context_->size); }

  // Every rank sends its block r of `counts[r]` floats to rank r, then adds the blocks it
  // received in rank order: ((x_0 + x_1) + x_2) + ...
  void reduce_scatter(const float* send, const std::vector<size_t>& counts, float* recv) {
    const size_t w = world();
    const size_t mine = counts[rank()];
    std::vector<size_t> send_bytes(w), recv_bytes(w, mine * sizeof(float));
    for (size_t r = 0; r < w; ++r) send_bytes[r] = counts[r] * sizeof(float);
    // The received blocks, kept between calls: a fresh buffer each time costs page faults.
    if (scratch_.size() < mine * w) scratch_.resize(mine * w);
    std::vector<float>& blocks = scratch_;
    alltoallv(reinterpret_cast<const uint8_t*>(send), send_bytes, reinterpret_cast<uint8_t*>(blocks.data()), recv_bytes,
              sizeof(float));
    if (mine == 0) return;
    std::memcpy(recv, blocks.data(), mine * sizeof(float));
    for (size_t r = 1; r < w; ++r) {
      const float* b = blocks.data() + r * mine;
      for (size_t i = 0; i < mine; ++i) recv[i] += b[i];
    }
  }

  void alltoallv(const uint8_t* send, std::span<const size_t> send_bytes, uint8_t* recv,
                 std::span<const size_t> recv_bytes, size_t element) {
    const size_t w = world();
    std::vector<int64_t> send_n(w), recv_n(w);
    for (size_t r = 0; r < w; ++r) {
      CHECK(send_bytes[r] % element == 0 && recv_bytes[r] % element == 0);
      send_n[r] = static_cast<int64_t>(send_bytes[r] / element);
      recv_n[r] = static_cast<int64_t>(recv_bytes[r] / element);
      if (r != static_cast<size_t>(rank())) bytes_sent_ += send_bytes[r];
    }
    // Gloo's alltoallv needs an element type: move bytes as uint8_t, floats as float. It runs
    // even when this rank moves nothing (others may be exchanging among themselves), and Gloo
    // wants a buffer even then.
    uint8_t dummy[sizeof(float)] = {};
    gloo::AlltoallvOptions opts(context_);
    if (element == sizeof(float)) {
      opts.setInput(const_cast<float*>(reinterpret_cast<const float*>(send ? send : dummy)), send_n);
      opts.setOutput(reinterpret_cast<float*>(recv ? recv : dummy), recv_n);
    } else {
      opts.setInput(const_cast<uint8_t*>(send ? send : dummy), send_n);
      opts.setOutput(recv ? recv : dummy, recv_n);
    }
    opts.setTimeout(timeout_);
    gloo::alltoallv(opts);
  }

  // Runs one operation, turning what Gloo throws into a Status that names this rank, the
  // operation and its sizes. A failed Comm stays failed: its peers' state is unknown.
  template <typename F>
  Status run(const std::string& what, Stream* stream, F&& op) {
    // Gloo moves host memory: a stream can only be the CPU backend's (as_cpu_stream aborts on
    // any other), whose queued work must have written the buffers before the operation runs to
    // completion here.
    if (stream != nullptr) as_cpu_stream(*stream).synchronize();
    if (!failed_.empty()) {
      return Status::IOError(fmt::format("rank {} of {}: cannot run {}: this connection failed earlier ({})", rank(),
                                         world_size(), what, failed_));
    }
    std::string error;
    try {
      op();
      return Status::OK();
    } catch (const gloo::IoException& e) {
      error = e.what();
    } catch (const gloo::EnforceNotMet& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = e.what();
    }
    failed_ = what;
    if (const int peer = rank_that_went_away(error); peer >= 0) {
      return Status::IOError(fmt::format("rank {} of {}: {} failed: rank {} of {} closed its connection ({}); it has "
                                         "probably exited: see rank {}'s log",
                                         rank(), world_size(), what, peer, world_size(), error, peer));
    }
    // Of two ranks, the one waited for is the other (with more, the error does not say which).
    if (world_size() == 2) {
      const int other = 1 - rank();
      return Status::IOError(fmt::format("rank {} of 2: {} failed within the {} ms timeout or earlier: {}; rank {} of 2 "
                                         "may have exited or hung: see rank {}'s log",
                                         rank(), what, timeout_.count(), error, other, other));
    }
    return Status::IOError(fmt::format("rank {} of {}: {} failed within the {} ms timeout or earlier: {}; {}", rank(),
                                       world_size(), what, timeout_.count(), error, kHint));
  }

  // The rank a failure is owed to: the one whose address the error names, else (a connection
  // this rank accepted, named by an ephemeral port) one whose process on this machine has
  // exited, watched for up to a second since its sockets close before it is gone; -1 if none.
  int rank_that_went_away(const std::string& error) const {
    if (const int named = rank_named_in(error); named >= 0) return named;
    for (int attempt = 0; attempt < 20; ++attempt) {
      for (size_t r = 0; r < peer_processes_.size(); ++r)
        if (!peer_processes_[r].empty() && process_has_exited(peer_processes_[r])) return static_cast<int>(r);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return -1;
  }

  // The rank whose address (peer_addresses_) a Gloo error message names, or -1.
  int rank_named_in(const std::string& error) const {
    for (size_t r = 0; r < peer_addresses_.size(); ++r) {
      const std::string& address = peer_addresses_[r];
      if (address.empty()) continue;
      const size_t at = error.find(address);
      // The whole address: "[ip]:1922" must not match inside "[ip]:19220".
      if (at != std::string::npos && (at + address.size() == error.size() || !std::isdigit(static_cast<unsigned char>(
                                                                                  error[at + address.size()]))))
        return static_cast<int>(r);
    }
    return -1;
  }

  std::shared_ptr<gloo::rendezvous::Context> context_;
  const std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> bytes_sent_{0};  // read by other threads than the one issuing operations
  std::string failed_;
  std::vector<std::string> peer_addresses_;  // [r]: rank r's side of its connection to this rank
  std::vector<std::string> peer_processes_;  // [r]: rank r's process (own_process_identity)
  std::vector<float> scratch_;
};

// The address other ranks reach this one at; see CommOptions::hostname.
gloo::transport::tcp::attr device_attr(const LaunchInfo& launch, const CommOptions& options) {
  gloo::transport::tcp::attr attr;
  if (!options.hostname.empty()) {
    attr.hostname = options.hostname;
  } else if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface != nullptr && *iface != '\0') {
    attr.iface = iface;
  } else if (launch.local_world_size == launch.world_size) {
    attr.hostname = "127.0.0.1";
  } else {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) != 0) std::strcpy(name, "localhost");
    attr.hostname = name;
  }
  return attr;
}

// Gloo writes to its sockets without MSG_NOSIGNAL: a write to a peer that has exited raises
// SIGPIPE, whose default action kills this process before the error can be reported. Ignore it
// (write then fails with EPIPE, which Gloo turns into an exception), unless someone installed
// a handler of their own.
void ignore_sigpipe() {
  struct sigaction current = {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore = {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace

Result<std::unique_ptr<Comm>> connect_gloo(const LaunchInfo& launch, const CommOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(options.rendezvous_dir, ec);
  if (ec) {
    return Status::IOError(
        fmt::format("cannot create the rendezvous folder {}: {}; set parallel.rendezvous to a "
                    "folder every rank can write",
                    options.rendezvous_dir, ec.message()));
  }
  ignore_sigpipe();
  const std::string who = fmt::format("rank {} of {}", launch.rank, launch.world_size);
  gloo::transport::tcp::attr attr = device_attr(launch, options);
  const std::string where = attr.iface.empty() ? attr.hostname : "interface " + attr.iface;
  try {
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore files(options.rendezvous_dir);
    gloo::rendezvous::PrefixStore store(options.name, files);
    auto context = std::make_shared<gloo::rendezvous::Context>(launch.rank, launch.world_size);
    context->setTimeout(options.timeout);
    context->connectFullMesh(store, device);
    auto comm = std::make_unique<GlooComm>(std::move(context), options.timeout);
    comm->learn_peers();
    return std::unique_ptr<Comm>(std::move(comm));
  } catch (const std::exception& e) {
    return Status::IOError(fmt::format(
        "{}: connecting \"{}\" through {} (listening on {}) failed: {}; every rank must start within the {} ms "
        "timeout and reach the others' addresses (set GLOO_SOCKET_IFNAME or the hostname to pick an interface); {}",
        who, options.name, options.rendezvous_dir, where, e.what(), options.timeout.count(), kHint));
  }
}

}  // namespace strata::parallel

#endif  // STRATA_HAVE_GLOO
