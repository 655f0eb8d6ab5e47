// One rank of a multi-process Comm test (tests/parallel/comm_test.cpp) or benchmark
// (tools/comm_bench.sh). Reads its rank and world from the launcher variables (RANK,
// WORLD_SIZE, ...) and the rendezvous folder from STRATA_RENDEZVOUS, runs the scenario named by
// argv[1] and exits nonzero with a message on stderr at the first mismatch.
//
//   ops    every operation against values computed here independently, sums bit-equal to a
//          sequential sum in rank order, repeats bit-equal, two Comms through one folder
//   exit   the last rank exits after a barrier; the others' all_reduce_sum must fail naming
//          their rank and the operation (prints "expected failure: ...")
//   hang   the last rank sleeps instead; the others must fail at the timeout
//   bench [MiB...]  reduce-scatter and all-gather bandwidth over Gloo, rank 0 prints a table
//   bench-nccl [MiB...]  the same over NCCL on GPU local_rank (CUDA builds)
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "parallel/comm.h"
#include "parallel/launch.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/cuda_device.h"
#endif

namespace strata::parallel {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const LaunchInfo& l, const std::string& msg) {
  std::fprintf(stderr, "worker rank %d of %d: %s\n", l.rank, l.world_size, msg.c_str());
  std::exit(1);
}

void expect_ok(const LaunchInfo& l, const Status& s, const char* what) {
  if (!s.ok()) fail(l, fmt::format("{} failed: {}", what, s.to_string()));
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank r's addend for element i: large values of both signs beside small ones, so that the
// order of a float sum shows in its bits.
float addend(int r, size_t i) {
  uint64_t h = mix((static_cast<uint64_t>(r) << 40) ^ i);
  switch (h % 6) {
    case 0:
      return 1e8f;
    case 1:
      return -1e8f;
    case 2:
      return 1.f;
    case 3:
      return -0.75f;
    case 4:
      return 3e-3f * static_cast<float>(h % 1000);
    default:
      return static_cast<float>(static_cast<int64_t>(h % 2001) - 1000) * 1e5f;
  }
}

// The sum of every rank's addend for element i, added one rank after another from rank 0.
float sum_in_rank_order(int world, size_t i) {
  float acc = addend(0, i);
  for (int r = 1; r < world; ++r) acc += addend(r, i);
  return acc;
}
float sum_in_reverse_order(int world, size_t i) {
  float acc = addend(world - 1, i);
  for (int r = world - 2; r >= 0; --r) acc += addend(r, i);
  return acc;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

uint8_t byte_of(int from, int to, size_t i) { return static_cast<uint8_t>(from * 37 + to * 11 + i * 7 + 1); }
// Bytes rank `from` sends rank `to` in the all_to_all_v check; zero for some pairs. With
// `idle` set, the last rank neither sends nor receives anything while the others exchange.
size_t a2a_bytes(int from, int to, int world, bool idle) {
  if (idle && (from == world - 1 || to == world - 1)) return 0;
  return static_cast<size_t>((from * 3 + to * 5) % 4) * 13;
}

void check_all_gather(const LaunchInfo& l, Comm& comm, size_t bytes) {
  const int w = l.world_size;
  std::vector<uint8_t> send(bytes), recv(bytes * w, 0xEE);
  for (size_t i = 0; i < bytes; ++i) send[i] = byte_of(l.rank, 0, i);
  const uint64_t before = comm.bytes_sent();
  expect_ok(l, comm.all_gather(send.data(), recv.data(), bytes), "all_gather");
  for (int r = 0; r < w; ++r) {
    for (size_t i = 0; i < bytes; ++i) {
      if (recv[r * bytes + i] != byte_of(r, 0, i)) {
        fail(l, fmt::format("all_gather of {} bytes: byte {} from rank {} is {}, expected {}", bytes, i, r,
                            recv[r * bytes + i], byte_of(r, 0, i)));
      }
    }
  }
  if (comm.bytes_sent() - before != bytes * (w - 1)) {
    fail(l, fmt::format("all_gather of {} bytes counted {} bytes sent, expected {}", bytes, comm.bytes_sent() - before,
                        bytes * (w - 1)));
  }
}

void check_all_to_all(const LaunchInfo& l, Comm& comm, bool idle = false) {
  const int w = l.world_size;
  std::vector<size_t> send_bytes(w), recv_bytes(w);
  std::vector<uint8_t> send;
  size_t to_others = 0;
  for (int r = 0; r < w; ++r) {
    send_bytes[r] = a2a_bytes(l.rank, r, w, idle);
    recv_bytes[r] = a2a_bytes(r, l.rank, w, idle);
    for (size_t i = 0; i < send_bytes[r]; ++i) send.push_back(byte_of(l.rank, r, i));
    if (r != l.rank) to_others += send_bytes[r];
  }
  size_t total_recv = 0;
  for (size_t b : recv_bytes) total_recv += b;
  std::vector<uint8_t> recv(total_recv, 0xEE);
  const uint64_t before = comm.bytes_sent();
  expect_ok(l, comm.all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes), "all_to_all_v");
  size_t at = 0;
  for (int r = 0; r < w; ++r) {
    for (size_t i = 0; i < recv_bytes[r]; ++i, ++at) {
      if (recv[at] != byte_of(r, l.rank, i)) {
        fail(l, fmt::format("all_to_all_v: byte {} from rank {} is {}, expected {}", i, r, recv[at],
                            byte_of(r, l.rank, i)));
      }
    }
  }
  if (comm.bytes_sent() - before != to_others) {
    fail(l, fmt::format("all_to_all_v counted {} bytes sent, expected {}", comm.bytes_sent() - before, to_others));
  }
}

void check_broadcast(const LaunchInfo& l, Comm& comm, int root, size_t bytes) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = l.rank == root ? byte_of(root, 99, i) : 0xEE;
  const uint64_t before = comm.bytes_sent();
  expect_ok(l, comm.broadcast(data.data(), bytes, root), "broadcast");
  // Whatever the tree, every rank but the root receives the bytes once.
  std::vector<int64_t> sent = {static_cast<int64_t>(comm.bytes_sent() - before)};
  expect_ok(l, sum_over_ranks(comm, std::span<int64_t>(sent)), "sum_over_ranks(bytes sent)");
  if (sent[0] != static_cast<int64_t>(bytes) * (l.world_size - 1)) {
    fail(l, fmt::format("broadcast of {} bytes counted {} bytes sent over all ranks, expected {}", bytes, sent[0],
                        bytes * (l.world_size - 1)));
  }
  for (size_t i = 0; i < bytes; ++i) {
    if (data[i] != byte_of(root, 99, i)) {
      fail(l, fmt::format("broadcast of {} bytes from rank {}: byte {} is {}, expected {}", bytes, root, i, data[i],
                          byte_of(root, 99, i)));
    }
  }
}

// A ring step `shift` ranks on: each rank sends to rank + shift and receives from rank - shift,
// then the ring's every step back to its own bytes (what ring attention's keys do).
void check_send_recv(const LaunchInfo& l, Comm& comm, int shift, size_t bytes) {
  const int w = l.world_size;
  const int to = (l.rank + shift) % w, from = (l.rank - shift % w + w) % w;
  std::vector<uint8_t> send(bytes), recv(bytes, 0xEE);
  for (size_t i = 0; i < bytes; ++i) send[i] = byte_of(l.rank, 7, i);
  const uint64_t before = comm.bytes_sent();
  expect_ok(l, comm.send_recv(send.data(), to, recv.data(), from, bytes), "send_recv");
  const uint64_t want_sent = to == l.rank ? 0 : bytes;
  if (comm.bytes_sent() - before != want_sent)
    fail(l, fmt::format("send_recv counted {} bytes sent, expected {}", comm.bytes_sent() - before, want_sent));
  for (size_t i = 0; i < bytes; ++i)
    if (recv[i] != byte_of(from, 7, i)) {
      fail(l, fmt::format("send_recv of {} bytes to rank {} from rank {}: byte {} is {}, expected {}", bytes, to, from,
                          i, recv[i], byte_of(from, 7, i)));
      return;
    }
  // Around the whole ring: after w steps each rank holds its own bytes again.
  std::vector<uint8_t> held = send, next(bytes);
  for (int step = 0; step < w; ++step) {
    expect_ok(l, comm.send_recv(held.data(), (l.rank + 1) % w, next.data(), (l.rank + w - 1) % w, bytes),
              "send_recv around the ring");
    held.swap(next);
  }
  if (held != send) fail(l, fmt::format("send_recv: {} bytes passed around the ring came back changed", bytes));
}

// Returns how many elements' sums depend on the order (the reverse order gives other bits).
size_t check_reduce_scatter(const LaunchInfo& l, Comm& comm, size_t count) {
  const int w = l.world_size;
  std::vector<float> send(count * w), recv(count, NAN), again(count, NAN);
  for (size_t i = 0; i < send.size(); ++i) send[i] = addend(l.rank, i);
  expect_ok(l, comm.reduce_scatter_sum(send.data(), recv.data(), count), "reduce_scatter_sum");
  expect_ok(l, comm.reduce_scatter_sum(send.data(), again.data(), count), "reduce_scatter_sum (repeat)");
  size_t order_matters = 0;
  for (size_t i = 0; i < count; ++i) {
    const size_t global = l.rank * count + i;
    const float want = sum_in_rank_order(w, global);
    if (!same_bits(recv[i], want)) {
      fail(l, fmt::format("reduce_scatter_sum of {} floats: element {} is {:.9g}, the sum in rank order is {:.9g}",
                          count, i, recv[i], want));
    }
    if (!same_bits(again[i], recv[i])) fail(l, fmt::format("reduce_scatter_sum repeated gave other bits at {}", i));
    if (!same_bits(want, sum_in_reverse_order(w, global))) ++order_matters;
  }
  return order_matters;
}

size_t check_all_reduce(const LaunchInfo& l, Comm& comm, size_t count) {
  std::vector<float> data(count), again(count);
  for (size_t i = 0; i < count; ++i) data[i] = again[i] = addend(l.rank, i);
  expect_ok(l, comm.all_reduce_sum(data.data(), count), "all_reduce_sum");
  expect_ok(l, comm.all_reduce_sum(again.data(), count), "all_reduce_sum (repeat)");
  size_t order_matters = 0;
  for (size_t i = 0; i < count; ++i) {
    const float want = sum_in_rank_order(l.world_size, i);
    if (!same_bits(data[i], want)) {
      fail(l, fmt::format("all_reduce_sum of {} floats: element {} is {:.9g}, the sum in rank order is {:.9g}", count,
                          i, data[i], want));
    }
    if (!same_bits(again[i], data[i])) fail(l, fmt::format("all_reduce_sum repeated gave other bits at {}", i));
    if (!same_bits(want, sum_in_reverse_order(l.world_size, i))) ++order_matters;
  }
  return order_matters;
}

// reduce_sum onto `root`: root holds the sum in rank order, the others their data unchanged,
// and each rank but root sent its count floats.
size_t check_reduce(const LaunchInfo& l, Comm& comm, size_t count, int root) {
  std::vector<float> data(count);
  for (size_t i = 0; i < count; ++i) data[i] = addend(l.rank, i);
  const uint64_t sent_before = comm.bytes_sent();
  expect_ok(l, comm.reduce_sum(data.data(), count, root), "reduce_sum");
  const uint64_t sent = comm.bytes_sent() - sent_before;
  const uint64_t want_sent = l.rank == root ? 0 : count * sizeof(float);
  if (sent != want_sent) fail(l, fmt::format("reduce_sum to rank {} counted {} bytes sent, expected {}", root, sent, want_sent));
  size_t order_matters = 0;
  for (size_t i = 0; i < count; ++i) {
    const float want = l.rank == root ? sum_in_rank_order(l.world_size, i) : addend(l.rank, i);
    if (!same_bits(data[i], want)) {
      fail(l, fmt::format("reduce_sum of {} floats to rank {}: element {} is {:.9g}, expected {:.9g}", count, root, i,
                          data[i], want));
    }
    if (!same_bits(sum_in_rank_order(l.world_size, i), sum_in_reverse_order(l.world_size, i))) ++order_matters;
  }
  return order_matters;
}

// Blocks per rank as a tensor shared out by ranges: uneven with rank 1's empty (kUneven), one
// rank's alone (kOneOwner: the last rank owns a whole fp8 matrix), or none at all (kEmpty).
enum class Blocks { kUneven, kOneOwner, kEmpty };
std::vector<size_t> blocks_of(int world, size_t unit, Blocks kind) {
  std::vector<size_t> sizes(static_cast<size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    if (kind == Blocks::kUneven) sizes[static_cast<size_t>(r)] = r == 1 ? 0 : unit * (r + 1) + r;
    if (kind == Blocks::kOneOwner && r == world - 1) sizes[static_cast<size_t>(r)] = unit * 3 + 1;
  }
  return sizes;
}

// all_gather_v: every rank ends with every rank's block in place; each rank counts the ring's
// bytes (all but its right neighbour's block).
void check_all_gather_v(const LaunchInfo& l, Comm& comm, Blocks kind) {
  const int w = l.world_size;
  const std::vector<size_t> bytes = blocks_of(w, 29, kind);
  size_t total = 0, mine = 0;
  for (int r = 0; r < w; ++r) {
    if (r == l.rank) mine = total;
    total += bytes[static_cast<size_t>(r)];
  }
  std::vector<uint8_t> data(total, 0xEE);
  for (size_t i = 0; i < bytes[static_cast<size_t>(l.rank)]; ++i) data[mine + i] = byte_of(l.rank, 7, i);
  const uint64_t before = comm.bytes_sent();
  expect_ok(l, comm.all_gather_v(data.data(), bytes), "all_gather_v");
  const uint64_t want_sent = total - bytes[static_cast<size_t>((l.rank + 1) % w)];
  if (comm.bytes_sent() - before != want_sent)
    fail(l, fmt::format("all_gather_v counted {} bytes sent, expected {}", comm.bytes_sent() - before, want_sent));
  size_t at = 0;
  for (int r = 0; r < w; ++r) {
    for (size_t i = 0; i < bytes[static_cast<size_t>(r)]; ++i, ++at) {
      if (data[at] != byte_of(r, 7, i))
        fail(l, fmt::format("all_gather_v: byte {} of rank {}'s block is {}, expected {}", i, r, data[at], byte_of(r, 7, i)));
    }
  }
}

// reduce_scatter_v_sum: this rank's block holds the sum in rank order, the others are as they were.
size_t check_reduce_scatter_v(const LaunchInfo& l, Comm& comm, Blocks kind) {
  const int w = l.world_size;
  const std::vector<size_t> counts = blocks_of(w, 41, kind);
  size_t total = 0, mine = 0;
  for (int r = 0; r < w; ++r) {
    if (r == l.rank) mine = total;
    total += counts[static_cast<size_t>(r)];
  }
  std::vector<float> data(total);
  for (size_t i = 0; i < total; ++i) data[i] = addend(l.rank, i);
  expect_ok(l, comm.reduce_scatter_v_sum(data.data(), counts), "reduce_scatter_v_sum");
  size_t order_matters = 0;
  for (size_t i = 0; i < total; ++i) {
    const bool own = i >= mine && i < mine + counts[static_cast<size_t>(l.rank)];
    const float want = own ? sum_in_rank_order(w, i) : addend(l.rank, i);
    if (!same_bits(data[i], want))
      fail(l, fmt::format("reduce_scatter_v_sum: element {} is {:.9g}, expected {:.9g}", i, data[i], want));
    if (own && !same_bits(want, sum_in_reverse_order(w, i))) ++order_matters;
  }
  return order_matters;
}

void check_sum_over_ranks(const LaunchInfo& l, Comm& comm) {
  const int w = l.world_size;
  // Doubles where the order shows: 1e17 and 1 do not add exactly.
  auto value = [](int r) { return r % 2 == 0 ? 1e17 * (r + 1) : 1.0 + r; };
  double want = value(0);
  for (int r = 1; r < w; ++r) want += value(r);
  Result<double> got = sum_over_ranks(comm, value(l.rank));
  expect_ok(l, got.status(), "sum_over_ranks(double)");
  if (std::memcmp(&*got, &want, sizeof(double)) != 0) {
    fail(l, fmt::format("sum_over_ranks(double) is {:.17g}, expected {:.17g}", *got, want));
  }
  std::vector<int64_t> counts = {l.rank, int64_t{1} << 40, -3 * l.rank};
  expect_ok(l, sum_over_ranks(comm, std::span<int64_t>(counts)), "sum_over_ranks(int64)");
  const int64_t ranks = int64_t{w} * (w - 1) / 2;
  if (counts[0] != ranks || counts[1] != (int64_t{1} << 40) * w || counts[2] != -3 * ranks) {
    fail(l, fmt::format("sum_over_ranks(int64) gave {} {} {}", counts[0], counts[1], counts[2]));
  }
  std::vector<double> values = {0.5 * l.rank, value(l.rank)};
  expect_ok(l, sum_over_ranks(comm, std::span<double>(values)), "sum_over_ranks(doubles)");
  if (values[0] != 0.5 * ranks || std::memcmp(&values[1], &want, sizeof(double)) != 0) {
    fail(l, fmt::format("sum_over_ranks(doubles) gave {} {}", values[0], values[1]));
  }
}

std::unique_ptr<Comm> connect_or_fail(const LaunchInfo& l, const std::string& name, std::chrono::milliseconds timeout) {
  const char* dir = std::getenv("STRATA_RENDEZVOUS");
  CommOptions options;
  options.backend = "gloo";
  options.rendezvous_dir = dir ? dir : "";
  options.name = name;
  options.timeout = timeout;
  Result<std::unique_ptr<Comm>> comm = connect(l, options);
  if (!comm.ok()) fail(l, "connect: " + comm.status().to_string());
  return std::move(comm).value();
}

int run_ops(const LaunchInfo& l) {
  std::unique_ptr<Comm> comm = connect_or_fail(l, "ops", std::chrono::seconds(30));
  if (comm->rank() != l.rank || comm->world_size() != l.world_size) fail(l, "the Comm reports another rank or world");
  const int w = l.world_size;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{37}, size_t{100003}}) check_all_gather(l, *comm, bytes);
  check_all_to_all(l, *comm);
  check_all_to_all(l, *comm, /*idle=*/true);
  check_broadcast(l, *comm, w - 1, 1000);
  check_broadcast(l, *comm, 0, 5);
  check_broadcast(l, *comm, 1, 77);
  for (int shift : {0, 1, w - 1}) check_send_recv(l, *comm, shift, 4099);
  check_send_recv(l, *comm, 1, 0);
  size_t order_matters = 0;
  for (size_t count : {size_t{0}, size_t{1}, size_t{257}}) order_matters += check_reduce_scatter(l, *comm, count);
  // Uneven splits: fewer elements than ranks, and a tail.
  for (size_t count : {size_t{0}, size_t{1}, size_t{2}, size_t{1000} + w - 1}) {
    order_matters += check_all_reduce(l, *comm, count);
  }
  for (int root : {0, w - 1}) order_matters += check_reduce(l, *comm, 333, root);
  for (Blocks kind : {Blocks::kUneven, Blocks::kOneOwner, Blocks::kEmpty}) {
    check_all_gather_v(l, *comm, kind);
    order_matters += check_reduce_scatter_v(l, *comm, kind);
  }
  // The data must be such that a sum in another order would have been caught (from three
  // ranks on: two addends commute exactly).
  if (w >= 3 && order_matters == 0) fail(l, "no element's sum depends on the order; the check proves nothing");
  check_sum_over_ranks(l, *comm);
  // A second Comm through the same folder, used interleaved with the first.
  std::unique_ptr<Comm> second = connect_or_fail(l, "second", std::chrono::seconds(30));
  check_all_gather(l, *second, 11);
  check_all_to_all(l, *comm);
  expect_ok(l, comm->barrier(), "barrier");
  expect_ok(l, second->barrier(), "barrier (second)");
  std::printf("rank %d of %d: ops ok (%zu order-dependent sums)\n", l.rank, w, order_matters);
  return 0;
}

// The last rank leaves (exit) or stops answering (hang) after a barrier; the others'
// all_reduce_sum must fail naming their rank and the operation.
int run_failure(const LaunchInfo& l, bool hang) {
  std::unique_ptr<Comm> comm = connect_or_fail(l, "failure", std::chrono::seconds(3));
  expect_ok(l, comm->barrier(), "barrier");
  check_all_to_all(l, *comm);
  if (l.rank == l.world_size - 1) {
    if (hang) std::this_thread::sleep_for(std::chrono::seconds(60));
    std::printf("rank %d of %d: leaving\n", l.rank, l.world_size);
    std::fflush(stdout);
    _exit(0);
  }
  std::vector<float> data(4096, 1.f);
  const auto start = Clock::now();
  Status s = comm->all_reduce_sum(data.data(), data.size());
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (s.ok()) fail(l, "all_reduce_sum succeeded without the last rank");
  // A later call fails at once, naming the earlier failure.
  Status later = comm->barrier();
  if (later.ok()) fail(l, "a barrier after the failure succeeded");
  std::printf("expected failure after %.2f s: %s\nthen: %s\n", seconds, s.to_string().c_str(),
              later.to_string().c_str());
  return 0;
}

double gbps(double bytes, double seconds) { return bytes / seconds / 1e9; }

// Buffers for the benchmark: host memory for Gloo, device memory and a stream for NCCL.
struct BenchBuffers {
  float* full = nullptr;  // world * count floats
  float* part = nullptr;  // count floats
  float* copy = nullptr;  // world * count floats, the memcpy's target
  Stream* stream = nullptr;
};

// Reduce-scatter and all-gather of `MiB`-sized buffers (the whole buffer, as nccl-tests sizes
// it); bus bandwidth = algorithm bandwidth * (n-1)/n, beside one memcpy of the same size.
int run_bench(const LaunchInfo& l, const std::vector<size_t>& mibs, bool nccl) {
  const int w = l.world_size;
#if STRATA_HAVE_CUDA
  std::unique_ptr<CudaStream> cuda_stream;
  if (nccl) {
    if (cudaSetDevice(l.local_rank) != cudaSuccess) fail(l, fmt::format("no CUDA device {}", l.local_rank));
    cuda_stream = std::make_unique<CudaStream>(l.local_rank);
  }
#else
  if (nccl) fail(l, "bench-nccl needs a CUDA build");
#endif
  const char* dir = std::getenv("STRATA_RENDEZVOUS");
  CommOptions options;
  options.backend = nccl ? "nccl" : "gloo";
  options.rendezvous_dir = dir ? dir : "";
  options.name = "bench";
  options.timeout = std::chrono::seconds(120);
  Result<std::unique_ptr<Comm>> connected = connect(l, options);
  if (!connected.ok()) fail(l, "connect: " + connected.status().to_string());
  Comm& comm = **connected;
  const double bus = double(w - 1) / w;
  if (l.rank == 0) {
    std::printf("world %d, %s\n%8s %14s %14s %14s\n", w, nccl ? "NCCL" : "loopback TCP (gloo)", "MiB", "rs busbw GB/s",
                "ag busbw GB/s", nccl ? "d2d copy GB/s" : "memcpy GB/s");
  }
  for (size_t mib : mibs) {
    const size_t bytes = mib << 20, count = bytes / sizeof(float) / w;
    std::vector<float> host_full, host_part, host_copy;
    BenchBuffers b;
    if (nccl) {
#if STRATA_HAVE_CUDA
      if (cudaMalloc(reinterpret_cast<void**>(&b.full), count * w * sizeof(float)) != cudaSuccess ||
          cudaMalloc(reinterpret_cast<void**>(&b.part), count * sizeof(float)) != cudaSuccess ||
          cudaMalloc(reinterpret_cast<void**>(&b.copy), count * w * sizeof(float)) != cudaSuccess) {
        fail(l, "cudaMalloc failed");
      }
      cudaMemset(b.full, 0, count * w * sizeof(float));
      b.stream = cuda_stream.get();
#endif
    } else {
      host_full.assign(count * w, 1.f), host_part.assign(count, 0.f), host_copy.assign(count * w, 0.f);
      b.full = host_full.data(), b.part = host_part.data(), b.copy = host_copy.data();
    }
    const int iters = nccl ? 20 : mib <= 4 ? 5 : mib <= 16 ? 3 : 2;
    auto time = [&](auto&& op) {
      expect_ok(l, op(), "warm-up");
      if (b.stream) b.stream->synchronize();
      expect_ok(l, comm.barrier(), "barrier");
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) expect_ok(l, op(), "timed op");
      if (b.stream) b.stream->synchronize();
      double s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      // The slowest rank's time is the operation's.
      std::vector<double> all(w);
      expect_ok(l, comm.all_gather(&s, all.data(), sizeof(double)), "gather times");
      double worst = 0;
      for (double t : all) worst = std::max(worst, t);
      return worst;
    };
    const double rs = time([&] { return comm.reduce_scatter_sum(b.full, b.part, count, b.stream); });
    const double ag = time([&] { return comm.all_gather(b.part, b.full, count * sizeof(float), b.stream); });
    double mc = 0;
    if (nccl) {
#if STRATA_HAVE_CUDA
      cudaMemcpy(b.copy, b.full, bytes, cudaMemcpyDeviceToDevice);
      cudaDeviceSynchronize();
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) cudaMemcpy(b.copy, b.full, bytes, cudaMemcpyDeviceToDevice);
      cudaDeviceSynchronize();
      mc = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      cudaFree(b.full), cudaFree(b.part), cudaFree(b.copy);
#endif
    } else {
      std::memcpy(b.copy, b.full, bytes);  // touch the pages once
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) std::memcpy(b.copy, b.full, bytes);
      mc = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    }
    if (l.rank == 0) {
      std::printf("%8zu %14.2f %14.2f %14.2f\n", mib, gbps(bytes, rs) * bus, gbps(bytes, ag) * bus, gbps(bytes, mc));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::parallel

int main(int argc, char** argv) {
  using namespace strata::parallel;
  strata::Result<LaunchInfo> launch = launch_from_env();
  if (!launch.ok()) {
    std::fprintf(stderr, "%s\n", launch.status().to_string().c_str());
    return 2;
  }
  const std::string scenario = argc > 1 ? argv[1] : "";
  if (scenario == "ops") return run_ops(*launch);
  if (scenario == "exit") return run_failure(*launch, false);
  if (scenario == "hang") return run_failure(*launch, true);
  if (scenario == "bench" || scenario == "bench-nccl") {
    std::vector<size_t> mibs;
    for (int i = 2; i < argc; ++i) mibs.push_back(std::strtoull(argv[i], nullptr, 10));
    if (mibs.empty()) mibs = {4, 16, 64};
    return run_bench(*launch, mibs, scenario == "bench-nccl");
  }
  std::fprintf(stderr, "usage: %s ops|exit|hang|bench|bench-nccl [MiB...]\n", argv[0]);
  return 2;
}
