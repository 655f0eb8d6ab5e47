// ZeRO-1, 2 and 3 with the collectives overlapped (PagedStateOptions::overlap_reduction): two ranks
// as threads of this process, Gloo over the loopback, each with its own CPU device (compute
// stream), PagedState and communication stream. The gathers (the next group's prefetched along
// the program), the gradient sums and, at ZeRO-1 and 2, the gathers of the updated weights after
// the optimizer run on the communication stream against the compute stream's ops by events, and
// must give the bits of the same collectives made in line, with micro-batches accumulated, tied
// embeddings (gathered at the head and the embedding), an MoE model (whose experts' gathers and
// sums go with their layer's), one or three groups gathered ahead, and the gradients' slices
// paged through host memory; also in chaos mode, where a missing wait between the streams shows
// as other bits. Four ranks in expert groups of two gather and sum their experts' state over the
// ranks holding the same experts, on the same stream. At ZeRO-3 with an untied head the last
// layer's weights stay gathered from its forward to its backward when overlapped. Under
// ThreadSanitizer this is the suite that watches the communication stream's thread.
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

constexpr int64_t kOverlapB = 2, kOverlapT = 16, kOverlapSteps = 3, kOverlapAccum = 2;

struct RankRun {
  std::vector<double> losses;
  std::vector<float> params;
  std::string error;
  uint64_t sent = 0;       // bytes this rank sent, over all its communicators
  uint64_t expert_handover_sent = 0;  // of them, through the holders' Comm of the communication stream
  int64_t queued_copy_gathers = 0;    // groups whose updated weights were gathered on that stream
  int64_t groups = 0;
  std::vector<uint64_t> group_bytes;  // per parameter group, the bytes of its weights this rank holds
};

// What a world runs: `world` ranks at ZeRO `zero`, an MoE model or a dense one (`tied`), with
// expert groups of `experts` ranks (1: none), `ahead` groups gathered ahead.
struct WorldCase {
  int world = 2;
  int zero = 2;
  bool tied = false;
  bool moe = false;
  int ahead = 1;
  int experts = 1;
};

// A Comm over the world ranks `members` (in its rank order) named `name`, for world rank `rank`.
Result<std::unique_ptr<parallel::Comm>> connect_among(const std::vector<int>& members, int rank,
                                                      const std::string& name, const fs::path& rendezvous) {
  parallel::LaunchInfo launch;
  launch.world_size = launch.local_world_size = static_cast<int>(members.size());
  launch.rank = launch.local_rank =
      static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  launch.launcher = "test";
  parallel::CommOptions options;
  options.backend = "gloo";
  options.rendezvous_dir = rendezvous.string();
  options.timeout = std::chrono::seconds(60);
  options.name = name;
  return parallel::connect(launch, options);
}

// One rank's run: `steps` steps of kOverlapAccum micro-batches of its own batches.
RankRun run_rank(int rank, const WorldCase& w, bool overlap, const fs::path& rendezvous) {
  RankRun out;
  const int world = w.world, P = w.experts;
  std::vector<int> everyone, group, holders;
  for (int q = 0; q < world; ++q) everyone.push_back(q);
  for (int q = rank / P * P; q < rank / P * P + P; ++q) group.push_back(q);
  for (int q = rank % P; q < world; q += P) holders.push_back(q);
  std::vector<std::unique_ptr<parallel::Comm>> comms;  // world, grad, experts, holders, grad holders
  for (const auto& [members, name] : std::vector<std::pair<std::vector<int>, std::string>>{
           {everyone, "train"},
           {everyone, "grad"},
           {group, fmt::format("experts-{}", rank / P)},
           {holders, fmt::format("holders-{}", rank % P)},
           {holders, fmt::format("grad-holders-{}", rank % P)}}) {
    if (P == 1 && comms.size() == 2) break;
    Result<std::unique_ptr<parallel::Comm>> c = connect_among(members, rank, name, rendezvous);
    if (!c.ok()) {
      out.error = c.status().to_string();
      return out;
    }
    comms.push_back(std::move(*c));
  }
  const bool moe = w.moe, tied = w.tied;
  const int zero = w.zero;
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
  placement.shard_over(world, zero);
  PagedStateOptions po;
  po.rank = rank;
  po.placement = placement;
  po.overlap_reduction = overlap;
  po.gather_ahead = w.ahead;
  po.expert_ranks = P;
  po.grad_accum = kOverlapAccum;
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
  if (P > 1) net.set_expert_comm(comms[2].get());
  ps.set_comm(comms[0].get(), comms[1].get(), P > 1 ? comms[3].get() : nullptr, P > 1 ? comms[4].get() : nullptr);
  const std::vector<Batch> batches = make_batches(kOverlapSteps * kOverlapAccum * world, kOverlapB * kOverlapT, 11);
  for (int s = 0; s < kOverlapSteps && out.error.empty(); ++s) {
    Status st = ps.zero_grads();
    double loss = 0;
    for (int m = 0; m < kOverlapAccum && st.ok(); ++m) {
      const Batch& b = batches[static_cast<size_t>((s * kOverlapAccum + m) * world + rank)];
      if (m == kOverlapAccum - 1) ps.begin_last_micro_batch(1e-2f);  // (ZeRO-1's sums at handover)
      Result<double> l = net.compute(b.inputs.data(), b.targets.data(), kOverlapB, kOverlapT, 1.0f / (world * kOverlapAccum * kOverlapB * kOverlapT), true);
      if (l.ok()) loss += *l;
      else st = l.status();
    }
    if (st.ok()) st = ps.clip_and_step(1e-2f).status();
    if (!st.ok()) out.error = st.to_string();
    out.losses.push_back(loss);
  }
  net.set_access(nullptr);
  if (P > 1) net.set_expert_comm(nullptr);
  for (const auto& c : comms) out.sent += c->bytes_sent();
  if (P > 1) out.expert_handover_sent = comms[4]->bytes_sent();
  out.queued_copy_gathers = ps.queued_copy_gathers();
  out.groups = groups;
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

std::vector<RankRun> run_world(const WorldCase& w, bool overlap) {
  const fs::path dir = fs::path(::testing::TempDir()) /
                       fmt::format("overlap_{}_{}_{}_{}_{}_{}_{}_{}", ::getpid(), w.world, w.zero, overlap, w.tied,
                                   w.moe, w.ahead, w.experts);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<RankRun> runs(static_cast<size_t>(w.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < w.world; ++r)
    threads.emplace_back([&, r] { runs[static_cast<size_t>(r)] = run_rank(r, w, overlap, dir); });
  for (std::thread& t : threads) t.join();
  fs::remove_all(dir);
  return runs;
}

// The same losses and parameters on every rank; each rank held its own ranges, so that together
// the ranks hold every parameter.
void expect_same_bits(const std::vector<RankRun>& inline_runs, const std::vector<RankRun>& overlapped) {
  std::vector<bool> held(overlapped[0].params.size(), false);
  for (size_t r = 0; r < inline_runs.size(); ++r) {
    const RankRun& a = inline_runs[r];
    const RankRun& b = overlapped[r];
    ASSERT_EQ(a.error, "") << "rank " << r;
    ASSERT_EQ(b.error, "") << "rank " << r;
    EXPECT_EQ(a.losses, b.losses) << "rank " << r;
    ASSERT_EQ(a.params.size(), b.params.size());
    size_t differ = 0;
    for (size_t i = 0; i < a.params.size(); ++i) {
      differ += a.params[i] != b.params[i] ? 1 : 0;
      if (b.params[i] != 0.0f) held[i] = true;
    }
    EXPECT_EQ(differ, 0u) << "rank " << r << ": parameters that differ from the run in line";
  }
  EXPECT_EQ(static_cast<size_t>(std::count(held.begin(), held.end(), true)), held.size());
}

class OverlappedCollectives : public ::testing::TestWithParam<std::tuple<int, bool, bool, int>> {};

TEST_P(OverlappedCollectives, AreTheBitsOfTheSameCollectivesInLine) {
  const auto [zero, tied, moe, ahead] = GetParam();
  const WorldCase w{.world = 2, .zero = zero, .tied = tied, .moe = moe, .ahead = ahead};
  WorldCase in_line = w;
  in_line.ahead = 1;
  const std::vector<RankRun> inline_runs = run_world(in_line, false);
  const std::vector<RankRun> overlapped = run_world(w, true);
  expect_same_bits(inline_runs, overlapped);
  if (HasFatalFailure()) return;
  for (int r = 0; r < w.world; ++r) {
    const RankRun& a = inline_runs[static_cast<size_t>(r)];
    const RankRun& b = overlapped[static_cast<size_t>(r)];
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
      if (in_place[k]) kept += kOverlapSteps * kOverlapAccum * a.group_bytes[static_cast<size_t>(order[k])];
    if (zero == 3 && (!tied || ahead > 1)) EXPECT_GT(kept, 0u);
    EXPECT_EQ(a.sent - b.sent, kept) << "rank " << r << " sent " << a.sent << " in line, " << b.sent << " overlapped";
    // ZeRO-1 and 2 gather each group's updated weights after the optimizer, overlapped on the
    // communication stream while the next groups update.
    EXPECT_EQ(a.queued_copy_gathers, 0) << "rank " << r;
    EXPECT_EQ(b.queued_copy_gathers, zero <= 2 ? kOverlapSteps * b.groups : 0) << "rank " << r;
  }
}

// Expert groups of 2 over 4 ranks: each MoE layer's experts' gathers and gradient sums go with
// the layer's on the communication stream, over the 2 ranks holding the same experts (a Comm of
// their own for that stream), while the model's token exchanges run in its expert group.
TEST(OverlappedExpertGroups, AreTheBitsOfTheSameCollectivesInLine) {
  for (const int zero : {2, 3}) {
    SCOPED_TRACE(fmt::format("ZeRO-{}", zero));
    const WorldCase w{.world = 4, .zero = zero, .moe = true, .ahead = 2, .experts = 2};
    WorldCase in_line = w;
    in_line.ahead = 1;
    const std::vector<RankRun> inline_runs = run_world(in_line, false);
    const std::vector<RankRun> overlapped = run_world(w, true);
    expect_same_bits(inline_runs, overlapped);
    for (size_t r = 0; r < overlapped.size(); ++r) {
      EXPECT_EQ(inline_runs[r].expert_handover_sent, 0u) << "rank " << r;
      EXPECT_GT(overlapped[r].expert_handover_sent, 0u) << "rank " << r;
      EXPECT_EQ(overlapped[r].queued_copy_gathers, zero == 2 ? kOverlapSteps * overlapped[r].groups : 0) << "rank " << r;
      // At ZeRO-3 the last layer's weights, its experts' among them, stay gathered around the head.
      if (zero == 3) EXPECT_LT(overlapped[r].sent, inline_runs[r].sent) << "rank " << r;
    }
  }
}

// (zero, tied, moe, groups gathered ahead): the MoE model's experts' gathers and sums go with
// their layer's.
INSTANTIATE_TEST_SUITE_P(ZeroTwoAndThree, OverlappedCollectives,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(1, 3)));
// ZeRO-1: the gradient sums start on a thread of their own as backward hands each group over,
// and the updated weights' gathers run on the communication stream.
INSTANTIATE_TEST_SUITE_P(ZeroOne, OverlappedCollectives,
                         ::testing::Combine(::testing::Values(1), ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(1)));

#endif  // STRATA_HAVE_GLOO

}  // namespace
}  // namespace strata
