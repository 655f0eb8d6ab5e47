// ZeRO-2 and 3 with the collectives overlapped (PagedStateOptions::overlap_reduction): two ranks
// as threads of this process, Gloo over the loopback, each with its own CPU device (compute
// stream), PagedState and communication stream. The gathers (the next group's prefetched along
// the program) and the gradient sums run on the communication stream against the compute
// stream's ops by events, and must give the bits of the same collectives made in line, with
// micro-batches accumulated, tied embeddings (gathered at the head and the embedding), an MoE
// model (whose experts' gathers and sums go with their layer's), one or three groups gathered
// ahead, and the gradients' slices paged through host memory; also in chaos mode, where a missing wait between
// the streams shows as other bits. At ZeRO-3 with an untied head the last layer's weights stay
// gathered from its forward to its backward when overlapped. Under ThreadSanitizer this is the
// suite that watches the communication stream's thread.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "model/decoder.h"
#include "offload/placement.h"
#include "parallel/comm.h"
#include "train/paged_state.h"
#include "train_test_util.h"

namespace strata {
namespace {

#if STRATA_HAVE_GLOO

namespace fs = std::filesystem;

constexpr int kWorld = 2;
constexpr int64_t kB = 2, kT = 16, kSteps = 3, kAccum = 2;

struct RankRun {
  std::vector<double> losses;
  std::vector<float> params;
  std::string error;
  uint64_t sent = 0;       // bytes this rank sent, over both communicators
  std::vector<uint64_t> group_bytes;  // per parameter group, the bytes of its weights this rank holds
};

// One rank's run: `steps` steps of kAccum micro-batches of its own batches, at ZeRO `zero`.
RankRun run_rank(int rank, int zero, bool overlap, bool tied, bool moe, int ahead, const fs::path& rendezvous) {
  RankRun out;
  parallel::LaunchInfo launch;
  launch.rank = launch.local_rank = rank;
  launch.world_size = launch.local_world_size = kWorld;
  launch.launcher = "test";
  parallel::CommOptions options;
  options.backend = "gloo";
  options.rendezvous_dir = rendezvous.string();
  options.timeout = std::chrono::seconds(60);
  options.name = "train";
  Result<std::unique_ptr<parallel::Comm>> comm = parallel::connect(launch, options);
  options.name = "grad";
  Result<std::unique_ptr<parallel::Comm>> grad = comm.ok() ? parallel::connect(launch, options) : comm.status();
  if (!comm.ok() || !grad.ok()) {
    out.error = (comm.ok() ? grad.status() : comm.status()).to_string();
    return out;
  }
  model::ModelConfig mc = moe ? fp8_moe_config() : tiny_config(tied);
  mc.tie_word_embeddings = tied;
  // Chaos mode (STRATA_STREAM_CHAOS, tests/train/tests.cmake) delays every stream task at random.
  Result<uint64_t> chaos = stream_chaos_from_env();
  CHECK_MSG(chaos.ok(), chaos.status().to_string());
  auto device = CpuDevice::create(0, 0, *chaos);
  CHECK(device.ok());
  auto io = make_io_engine({.kind = "threads"});
  CHECK(io.ok());
  model::LlamaModel net(mc, model::CpuF32Model(device->get()));
  const int groups = static_cast<int>(net.layout().num_layers()) + 2;
  Placement placement(groups);  // every kind homed in host memory, paged through a small device tier
  placement.shard_over(kWorld, zero);
  PagedStateOptions po;
  po.rank = rank;
  po.placement = placement;
  po.overlap_reduction = overlap;
  po.gather_ahead = ahead;
  po.grad_accum = kAccum;
  po.optimizer = optimizer_config(1.0f);
  // About a layer a chunk, six on the device: the groups' chunks move between the tiers.
  uint64_t largest = 0;
  for (const auto& t : net.layout().tensors()) largest = std::max<uint64_t>(largest, t.block_numel(0) * 4);
  const uint64_t layer = std::max<uint64_t>(largest, net.layout().total_size() * 4 / (mc.num_hidden_layers + 1));
  po.chunk_bytes = (layer + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;
  po.device_bytes = 6 * po.chunk_bytes;
  po.host_bytes = 64ull << 20;
  auto paged = PagedState::create(**device, io->get(), net.layout(), po);
  if (!paged.ok()) {
    out.error = paged.status().to_string();
    return out;
  }
  PagedState& ps = **paged;
  CHECK(ps.load_params(initial_params(net.layout(), 7).data()).ok());
  net.set_access(&ps);
  ps.set_comm(comm->get(), grad->get());
  const std::vector<Batch> batches = make_batches(kSteps * kAccum * kWorld, kB * kT, 11);
  for (int s = 0; s < kSteps && out.error.empty(); ++s) {
    Status st = ps.zero_grads();
    double loss = 0;
    for (int m = 0; m < kAccum && st.ok(); ++m) {
      const Batch& b = batches[static_cast<size_t>((s * kAccum + m) * kWorld + rank)];
      Result<double> l = net.compute(b.inputs.data(), b.targets.data(), kB, kT, 1.0f / (kWorld * kAccum * kB * kT), true);
      if (l.ok()) loss += *l;
      else st = l.status();
    }
    if (st.ok()) st = ps.clip_and_step(1e-2f).status();
    if (!st.ok()) out.error = st.to_string();
    out.losses.push_back(loss);
  }
  net.set_access(nullptr);
  out.sent = (*comm)->bytes_sent() + (*grad)->bytes_sent();
  // Groups: the embedding 0, layer l at l + 1, the head (final norm, lm_head) after them.
  const int64_t layers = mc.num_hidden_layers;
  out.group_bytes.assign(static_cast<size_t>(layers) + 2, 0);
  for (size_t i = 0; i < net.layout().tensors().size(); ++i) {
    const std::string& name = net.layout().tensors()[i].name;
    int64_t group = layers + 1;
    if (name.starts_with("model.embed_tokens.")) group = 0;
    else if (name.starts_with("model.layers.")) group = 1 + std::stoll(name.substr(13));
    out.group_bytes[static_cast<size_t>(group)] += ps.saved_range(net.layout().tensors()[i], i).count * sizeof(float);
  }
  // The ranges of the parameters this rank holds (at ZeRO-3 no rank holds the rest).
  out.params.assign(static_cast<size_t>(net.layout().total_size()), 0.0f);
  const auto& tensors = net.layout().tensors();
  for (size_t i = 0; i < tensors.size() && out.error.empty(); ++i) {
    const ElementRange r = ps.saved_range(tensors[i], i);
    const uint64_t first = static_cast<uint64_t>(tensors[i].offset) + r.first;
    Status st = ps.read_flat(StateKind::kParam, first * sizeof(float), r.count * sizeof(float), &out.params[first]);
    if (!st.ok()) out.error = st.to_string();
  }
  return out;
}

std::vector<RankRun> run_world(int zero, bool overlap, bool tied, bool moe, int ahead) {
  const fs::path dir = fs::path(::testing::TempDir()) /
                       fmt::format("overlap_{}_{}_{}_{}_{}_{}", ::getpid(), zero, overlap, tied, moe, ahead);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<RankRun> runs(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] { runs[static_cast<size_t>(r)] = run_rank(r, zero, overlap, tied, moe, ahead, dir); });
  for (std::thread& t : threads) t.join();
  fs::remove_all(dir);
  return runs;
}

class OverlappedCollectives : public ::testing::TestWithParam<std::tuple<int, bool, bool, int>> {};

TEST_P(OverlappedCollectives, AreTheBitsOfTheSameCollectivesInLine) {
  const auto [zero, tied, moe, ahead] = GetParam();
  const std::vector<RankRun> inline_runs = run_world(zero, false, tied, moe, 1);
  const std::vector<RankRun> overlapped = run_world(zero, true, tied, moe, ahead);
  for (int r = 0; r < kWorld; ++r) {
    const RankRun& a = inline_runs[static_cast<size_t>(r)];
    const RankRun& b = overlapped[static_cast<size_t>(r)];
    ASSERT_EQ(a.error, "") << "rank " << r;
    ASSERT_EQ(b.error, "") << "rank " << r;
    EXPECT_EQ(a.losses, b.losses) << "rank " << r;
    ASSERT_EQ(a.params.size(), b.params.size());
    size_t differ = 0;
    for (size_t i = 0; i < a.params.size(); ++i) differ += a.params[i] != b.params[i] ? 1 : 0;
    EXPECT_EQ(differ, 0u) << "rank " << r << ": parameters that differ from the run in line";
    // The same collectives, but that at ZeRO-3 a group kept from one batch to its next is not
    // gathered again: each micro-batch, a rank sends its range of it once less (an all-gather
    // over two ranks sends each its own range once).
    // The batches' gathers in order: the embedding, the layers, (a tied embedding,) the head,
    // the layers backward. Those whose weights stay in place from the batch before are not
    // gathered again (kept_gathers): the last layer around an untied head; with three ahead the
    // last layer around a tied one too, and the tied embedding from its forward to the head.
    const int64_t L = static_cast<int64_t>(a.group_bytes.size()) - 2;
    std::vector<int> order = {0};
    for (int l = 1; l <= L; ++l) order.push_back(l);
    if (tied) order.push_back(0);
    order.push_back(static_cast<int>(L) + 1);
    for (int l = static_cast<int>(L); l >= 1; --l) order.push_back(l);
    uint64_t kept = 0;
    const std::vector<bool> in_place = kept_gathers(order, ahead);
    for (size_t k = 0; k < order.size() && zero == 3; ++k)
      if (in_place[k]) kept += kSteps * kAccum * a.group_bytes[static_cast<size_t>(order[k])];
    if (zero == 3 && (!tied || ahead > 1)) EXPECT_GT(kept, 0u);
    EXPECT_EQ(a.sent - b.sent, kept) << "rank " << r << " sent " << a.sent << " in line, " << b.sent << " overlapped";
  }
  // Each rank held its own ranges: together, every parameter.
  size_t held = 0;
  for (size_t i = 0; i < overlapped[0].params.size(); ++i)
    held += overlapped[0].params[i] != 0.0f || overlapped[1].params[i] != 0.0f ? 1 : 0;
  EXPECT_EQ(held, overlapped[0].params.size());
}

// (zero, tied, moe, groups gathered ahead): the MoE model's experts' gathers and sums go with
// their layer's.
INSTANTIATE_TEST_SUITE_P(ZeroTwoAndThree, OverlappedCollectives,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(1, 3)));

#endif  // STRATA_HAVE_GLOO

}  // namespace
}  // namespace strata
