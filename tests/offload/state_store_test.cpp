// StateStore schedules with entries that are not prefetched: an expert fetched after routing
// is never moved ahead of time, yet eviction counts its next (likely) use, so an expert used
// in a layer's forward is not the first chunk pushed out before the layer's backward.
#include "offload/state_store.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <filesystem>
#include <utility>
#include <memory>
#include <optional>
#include <string>

#include "core/cpu_device.h"
#include "core/io_engine.h"

namespace strata {
namespace {

constexpr uint64_t kChunk = 16 * kKiB;
constexpr uint64_t kFloats = kChunk / sizeof(float);  // one tensor fills one chunk

// Groups: 0 dense "a"; 1 dense "b" with one expert "e"; 2 dense "c". The device holds two
// chunks, so acquiring c after b and e evicts one of them.
std::unique_ptr<StateStore> make_store(Device& device, size_t lookahead) {
  std::vector<StateTensor> tensors = {{"a", kFloats, 0, kDensePart},
                                      {"b", kFloats, 1, kDensePart},
                                      {"e", kFloats, 1, 0},
                                      {"c", kFloats, 2, kDensePart}};
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.device_bytes = 2 * kChunk;
  o.space.host_bytes = 64 * kChunk;
  o.lookahead = lookahead;
  o.home = [](int, StateKind, int) { return Tier::kHost; };
  Result<std::unique_ptr<StateStore>> store = StateStore::create(device, nullptr, std::move(tensors), o);
  CHECK_MSG(store.ok(), store.status().to_string());
  // Written once in host memory: a chunk never written is zero-filled where it is first
  // acquired, and would move nothing.
  for (auto [g, part] : {std::pair{0, kDensePart}, {1, kDensePart}, {1, 0}, {2, kDensePart}}) {
    CHECK((*store)->acquire_part(g, part, StateKind::kParam, Tier::kHost, AccessMode::kWrite).ok());
    (*store)->release_part(g, part, StateKind::kParam);
  }
  return std::move(store).value();
}

// b, its expert e (after routing), c, the expert again, a: as a layer's dense part and expert
// in forward, another layer, the expert in the first layer's backward, then the rest.
std::vector<GroupAccess> schedule(bool expert_entries) {
  auto dense = [](int g) { return GroupAccess::of_part(g, StateKind::kParam, kDensePart); };
  GroupAccess expert = GroupAccess::of_part(1, StateKind::kParam, 0);
  expert.prefetch = false;
  if (expert_entries) return {dense(1), expert, dense(2), expert, dense(0)};
  return {dense(1), dense(2), dense(0)};
}

// Runs the schedule's acquisitions once; the host -> device bytes moved.
uint64_t run(StateStore& store) {
  const uint64_t before = store.stats().host_to_device_bytes;
  const std::array<int, 1> expert = {0};
  auto use_dense = [&](int g) {
    EXPECT_TRUE(store.acquire_part(g, kDensePart, StateKind::kParam, Tier::kDevice, AccessMode::kRead).ok());
    store.release_part(g, kDensePart, StateKind::kParam);
  };
  auto use_expert = [&] {
    EXPECT_TRUE(store.acquire_parts(1, expert, StateKind::kParam, Tier::kDevice, AccessMode::kRead).ok());
    store.release_parts(1, expert, StateKind::kParam);
  };
  use_dense(1);
  use_expert();
  use_dense(2);
  use_expert();
  use_dense(0);
  EXPECT_TRUE(store.synchronize().ok());
  return store.stats().host_to_device_bytes - before;
}

TEST(StateStoreTest, ExpertEntriesKeepAnExpertForItsNextUseWithoutPrefetchingIt) {
  std::unique_ptr<CpuDevice> device = CpuDevice::create(0, 0).value();
  // Without expert entries the expert has no next use: c evicts it, and it is fetched again.
  std::unique_ptr<StateStore> unaware = make_store(*device, 0);
  unaware->set_schedule(schedule(false));
  const uint64_t without = run(*unaware);
  // With them, b (next used in the next step) goes instead, and e stays.
  std::unique_ptr<StateStore> aware = make_store(*device, 0);
  aware->set_schedule(schedule(true));
  const uint64_t with = run(*aware);
  EXPECT_EQ(without, 5 * kChunk);  // b, e, c, e, a
  EXPECT_EQ(with, 4 * kChunk);     // b, e, c, a
}

ChunkId param_chunk(StateStore& store, const std::string& tensor) {
  const std::optional<TensorId> id = store.space().find_tensor(std::string("param/") + tensor);
  CHECK_MSG(id.has_value(), "no tensor " + tensor);
  return store.space().tensor(*id).chunk;
}

// With two entries of lookahead, acquiring b prefetches what the schedule names next: the
// expert's entry is skipped (never moved ahead of routing) and does not use up the window, so
// c, the next dense part, is on its way; were the expert's entry prefetchable, e would be.
TEST(StateStoreTest, EntriesNotToPrefetchAreSkippedWithoutNarrowingTheWindow) {
  std::unique_ptr<CpuDevice> device = CpuDevice::create(0, 0).value();
  for (bool prefetch_expert : {false, true}) {
    SCOPED_TRACE(prefetch_expert ? "expert entries prefetchable" : "expert entries not prefetched");
    std::unique_ptr<StateStore> store = make_store(*device, 2);
    std::vector<GroupAccess> s = schedule(true);
    for (GroupAccess& a : s) a.prefetch = a.part == kDensePart || prefetch_expert;
    store->set_schedule(s);
    ASSERT_TRUE(store->acquire_part(1, kDensePart, StateKind::kParam, Tier::kDevice, AccessMode::kRead).ok());
    store->release_part(1, kDensePart, StateKind::kParam);
    ASSERT_TRUE(store->synchronize().ok());
    const bool e_ahead = store->space().is_resident(param_chunk(*store, "e"), Tier::kDevice);
    const bool c_ahead = store->space().is_resident(param_chunk(*store, "c"), Tier::kDevice);
    EXPECT_EQ(e_ahead, prefetch_expert);
    EXPECT_EQ(c_ahead, !prefetch_expert);  // with e prefetchable, the window (b, e) ends before c
  }
}

// Two experts of a quarter chunk share one chunk. Acquiring one of them to overwrite it whole
// must not drop the other's bytes: the shared chunk is loaded first.
TEST(StateStoreTest, SmallPartsShareAChunkAndAWholeWriteOfOneKeepsTheOther) {
  std::unique_ptr<CpuDevice> device = CpuDevice::create(0, 0).value();
  const uint64_t quarter = kFloats / 4;
  std::vector<StateTensor> tensors = {{"dense", kFloats, 0, kDensePart}, {"e0", quarter, 0, 0}, {"e1", quarter, 0, 1}};
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.device_bytes = 2 * kChunk;
  o.space.host_bytes = 64 * kChunk;
  o.home = [](int, StateKind, int) { return Tier::kHost; };
  std::unique_ptr<StateStore> store = StateStore::create(*device, nullptr, std::move(tensors), o).value();
  EXPECT_EQ(store->part_chunk_count(0, 0, StateKind::kParam), 1u);
  EXPECT_EQ(store->part_chunk_count(0, 1, StateKind::kParam), 1u);
  EXPECT_EQ(store->space().num_chunks(), 2 * o.layout.kinds().size());  // dense + both experts, per kind
  const std::array<int, 2> both = {0, 1};
  ASSERT_TRUE(store->acquire_parts(0, both, StateKind::kParam, Tier::kHost, AccessMode::kReadWrite).ok());
  for (uint64_t i = 0; i < quarter; ++i) store->pointer(1, StateKind::kParam)[i] = 1.0f + static_cast<float>(i);
  for (uint64_t i = 0; i < quarter; ++i) store->pointer(2, StateKind::kParam)[i] = -2.0f;
  store->release_parts(0, both, StateKind::kParam);
  // e0 overwritten whole on the device, where the chunk has no copy yet.
  ASSERT_TRUE(store->acquire_part(0, 0, StateKind::kParam, Tier::kDevice, AccessMode::kWrite).ok());
  for (uint64_t i = 0; i < quarter; ++i) store->pointer(1, StateKind::kParam)[i] = 7.0f;
  store->release_part(0, 0, StateKind::kParam);
  ASSERT_TRUE(store->acquire_parts(0, both, StateKind::kParam, Tier::kHost, AccessMode::kRead).ok());
  for (uint64_t i = 0; i < quarter; ++i) {
    ASSERT_EQ(store->pointer(1, StateKind::kParam)[i], 7.0f) << i;
    ASSERT_EQ(store->pointer(2, StateKind::kParam)[i], -2.0f) << "e1 lost at " << i;
  }
  store->release_parts(0, both, StateKind::kParam);
}

// Experts that share chunks open new ones as they fill up; when their home tier is full those
// fall back to the tier below, as a part with chunks of its own does.
TEST(StateStoreTest, SharedChunksFallBackToTheTierBelowWhenTheHomeIsFull) {
  std::unique_ptr<CpuDevice> device = CpuDevice::create(0, 0).value();
  std::vector<StateTensor> tensors = {{"dense", kFloats, 0, kDensePart}};
  for (int e = 0; e < 8; ++e) tensors.push_back({"e" + std::to_string(e), kFloats / 4, 0, e});  // two chunks' worth
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.device_bytes = 2 * kChunk;  // the dense chunk and one experts' chunk of parameters
  o.space.host_bytes = 64 * kChunk;
  o.home = [](int, StateKind kind, int) { return kind == StateKind::kParam ? Tier::kDevice : Tier::kHost; };
  Result<std::unique_ptr<StateStore>> store = StateStore::create(*device, nullptr, std::move(tensors), o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_EQ((*store)->space().home(param_chunk(**store, "e0")), Tier::kDevice);
  EXPECT_EQ((*store)->space().home(param_chunk(**store, "e7")), Tier::kHost);
}

// Each part opens its chunks in the home asked for it (the planner's part rows): experts 0 and 1
// of full size on the device and in host memory, the small experts 2 and 3 sharing the chunk
// expert 1 opened, and with it its home; part_chunks() counts what each part opens.
TEST(StateStoreTest, PartsOpenTheirChunksInTheirOwnHomes) {
  std::unique_ptr<CpuDevice> device = CpuDevice::create(0, 0).value();
  std::vector<StateTensor> tensors = {{"dense", kFloats, 0, kDensePart},
                                      {"e0", kFloats, 0, 0},
                                      {"e1", kFloats / 2, 0, 1},
                                      {"e2", kFloats / 4, 0, 2},
                                      {"e3", kFloats / 4, 0, 3}};
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.device_bytes = 8 * kChunk;
  o.space.host_bytes = 64 * kChunk;
  o.home = [](int, StateKind kind, int part) {
    if (kind != StateKind::kParam) return Tier::kHost;
    return part == 0 ? Tier::kDevice : part == kDensePart ? Tier::kHost : part == 1 ? Tier::kHost : Tier::kDevice;
  };
  const std::vector<StateTensor> described = tensors;
  Result<std::unique_ptr<StateStore>> store = StateStore::create(*device, nullptr, std::move(tensors), o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  StateStore& s = **store;
  EXPECT_EQ(s.space().home(param_chunk(s, "dense")), Tier::kHost);
  EXPECT_EQ(s.space().home(param_chunk(s, "e0")), Tier::kDevice);
  EXPECT_EQ(s.space().home(param_chunk(s, "e1")), Tier::kHost);
  EXPECT_EQ(param_chunk(s, "e2"), param_chunk(s, "e1"));  // too small for a chunk of its own
  EXPECT_EQ(s.part_home(0, 3, StateKind::kParam), Tier::kHost);  // asked for the device, shares e1's
  EXPECT_EQ(s.home(0, StateKind::kParam), Tier::kHost);
  EXPECT_EQ(s.part_home(0, 0, StateKind::kParam), Tier::kDevice);
  const auto parts = StateStore::part_chunks(described, kChunk, StateLayout{}, StateKind::kParam);
  ASSERT_EQ(parts.size(), 1u);
  ASSERT_EQ(parts[0].size(), 5u);
  const bool own[] = {true, true, true, false, false};
  const uint64_t chunks[] = {1, 1, 1, 0, 0};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(parts[0][i].part, static_cast<int>(i) - 1);
    EXPECT_EQ(parts[0][i].own, own[i]) << i;
    EXPECT_EQ(parts[0][i].chunks, chunks[i]) << i;
  }
  EXPECT_EQ(StateStore::group_chunks(described, kChunk, StateLayout{}, StateKind::kParam), (std::vector<uint64_t>{3}));
}

// A sliced kind holds each tensor's slice alone, packed as slices (the chunk count the planner
// reads from group_chunks(..., sliced) is the store's), and pointer() points at the slice's
// first element; the other kinds hold every element.
TEST(StateStoreTest, ASlicedKindHoldsEachTensorsSliceAlone) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  const uint64_t n = kFloats / 2;  // two whole tensors fill one chunk
  std::vector<StateTensor> tensors = {{"a", n, 0}, {"b", n, 0}, {"c", n, 0}, {"d", n, 1}};
  // Each holds a quarter; "d" holds nothing (an empty range).
  for (StateTensor& t : tensors) t.slice = ElementRange{n / 4, t.name == "d" ? 0 : n / 4};
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.host_bytes = 64 * kChunk;
  o.layout = StateLayout::of(Precision::kBf16);
  o.home = [](int, StateKind, int) { return Tier::kHost; };
  o.sliced = [](int, StateKind k) { return k == StateKind::kMaster || k == StateKind::kAdamM; };
  auto store = StateStore::create(**device, nullptr, tensors, o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  StateStore& s = **store;
  // Whole: a and b fill one chunk, c another, d (group 1) a third. Sliced: a, b and c share one,
  // and group 1's (empty) slice continues in it.
  const std::vector<uint64_t> whole = StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamV);
  const std::vector<uint64_t> sliced = StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamM, true);
  EXPECT_EQ(whole, (std::vector<uint64_t>{2, 1}));
  EXPECT_EQ(sliced, (std::vector<uint64_t>{1, 0}));
  uint64_t adam_m = 0, adam_v = 0;
  for (ChunkId c = 0; c < s.space().num_chunks(); ++c) {
    adam_m += s.space().chunk_kind(c) == ChunkKind::kAdamM ? 1 : 0;
    adam_v += s.space().chunk_kind(c) == ChunkKind::kAdamV ? 1 : 0;
  }
  EXPECT_EQ(adam_m, sliced[0] + sliced[1]);
  EXPECT_EQ(adam_v, whole[0] + whole[1]);
  EXPECT_TRUE(s.sliced(0, StateKind::kAdamM));
  EXPECT_FALSE(s.sliced(0, StateKind::kAdamV));
  EXPECT_EQ(s.held(0, StateKind::kAdamM), (ElementRange{n / 4, n / 4}));
  EXPECT_EQ(s.held(0, StateKind::kAdamV), (ElementRange{0, n}));
  EXPECT_EQ(s.held(3, StateKind::kMaster).count, 0u);
  // Writing a slice and reading it back through read_tensor, whose offsets count from the slice.
  ASSERT_TRUE(s.acquire_group(0, StateKind::kAdamM, Tier::kHost, AccessMode::kWrite).ok());
  for (size_t i = 0; i < 3; ++i)
    for (uint64_t e = 0; e < n / 4; ++e) s.pointer(i, StateKind::kAdamM)[e] = static_cast<float>(i * 1000 + e);
  s.release_group(0, StateKind::kAdamM);
  std::vector<float> back(4);
  ASSERT_TRUE(s.read_tensor(2, StateKind::kAdamM, 10, 4, back.data()).ok());
  EXPECT_EQ(back, (std::vector<float>{2010, 2011, 2012, 2013}));
}

// Every kind homed in a host tier of 64 chunks, the Adam first moments held as slices.
StateStoreOptions host_options_slicing_adam_m() {
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.host_bytes = 64 * kChunk;
  o.home = [](int, StateKind, int) { return Tier::kHost; };
  o.sliced = [](int, StateKind k) { return k == StateKind::kAdamM; };
  return o;
}

// A part's slices are packed largest first, the smaller filling the tails the larger leave: slices
// of 1/2, 3/8, 1/2, 1/8 and 1/2 of a chunk take three chunks in order (the 1/8 and 3/8 tails stay
// empty) and two so. The static count is the store's, and every slice keeps its own bytes.
TEST(StateStoreTest, SlicesFillTheTailsOfTheirChunks) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  const uint64_t eighth = kFloats / 8;
  std::vector<StateTensor> tensors;
  for (uint64_t eighths : {4, 3, 4, 1, 4}) tensors.push_back({"t" + std::to_string(tensors.size()), 2 * eighths * eighth, 0});
  for (StateTensor& t : tensors) t.slice = ElementRange{t.elements / 2, t.elements / 2};  // this rank's half
  const StateStoreOptions o = host_options_slicing_adam_m();
  auto store = StateStore::create(**device, nullptr, tensors, o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  StateStore& s = **store;
  EXPECT_EQ(StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamM, true), (std::vector<uint64_t>{2}));
  uint64_t adam_m = 0;
  for (ChunkId c = 0; c < s.space().num_chunks(); ++c) adam_m += s.space().chunk_kind(c) == ChunkKind::kAdamM ? 1 : 0;
  EXPECT_EQ(adam_m, 2u);
  ASSERT_TRUE(s.acquire_group(0, StateKind::kAdamM, Tier::kHost, AccessMode::kWrite).ok());
  for (size_t i = 0; i < tensors.size(); ++i)
    for (uint64_t e = 0; e < tensors[i].elements / 2; ++e) s.pointer(i, StateKind::kAdamM)[e] = static_cast<float>(i * 100000 + e);
  bool same = true;
  for (size_t i = 0; i < tensors.size(); ++i)
    for (uint64_t e = 0; e < tensors[i].elements / 2; ++e)
      same = same && s.pointer(i, StateKind::kAdamM)[e] == static_cast<float>(i * 100000 + e);
  EXPECT_TRUE(same);
  s.release_group(0, StateKind::kAdamM);
}

// The groups' slices of a sliced kind share chunks where the groups are homed alike, so a rank's
// share is its slices' bytes, not a chunk per group; a group homed elsewhere opens a chunk of its
// own. Writing one group's slices whole (kWrite) keeps the other group's bytes in the chunk they
// share, and the static count (group_chunks with the homes) is the store's.
TEST(StateStoreTest, GroupsSlicesShareChunksWhereHomedAlike) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  const uint64_t n = kFloats;  // each tensor a chunk whole; a rank holds an eighth of each
  std::vector<StateTensor> tensors;
  for (int g = 0; g < 6; ++g) tensors.push_back({"t" + std::to_string(g), n, g});
  for (StateTensor& t : tensors) t.slice = ElementRange{n / 8, n / 8};
  StateStoreOptions o;
  o.space.chunk_bytes = kChunk;
  o.space.host_bytes = 64 * kChunk;
  o.space.nvme_bytes = 64 * kChunk;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("strata_state_store_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  o.space.nvme_dir = dir.string();
  o.layout = StateLayout::of(Precision::kBf16);
  // Groups 0-3 on the host, 4-5 on nvme (every kind).
  o.home = [](int g, StateKind, int) { return g < 4 ? Tier::kHost : Tier::kNvme; };
  o.sliced = [](int, StateKind k) { return k == StateKind::kAdamM; };
  IoEngineOptions io_options;
  io_options.kind = "threads";
  auto io = make_io_engine(io_options);
  ASSERT_TRUE(io.ok()) << io.status().to_string();
  auto store = StateStore::create(**device, io->get(), tensors, o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  StateStore& s = **store;
  // Sliced: groups 0-3 in one chunk, 4-5 in another; whole: a chunk each.
  const std::vector<uint64_t> sliced =
      StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamM, true, o.home);
  EXPECT_EQ(sliced, (std::vector<uint64_t>{1, 0, 0, 0, 1, 0}));
  EXPECT_EQ(StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamM, true),
            (std::vector<uint64_t>{1, 0, 0, 0, 0, 0}));  // without homes: one chunk for all
  uint64_t adam_m = 0;
  for (ChunkId c = 0; c < s.space().num_chunks(); ++c) adam_m += s.space().chunk_kind(c) == ChunkKind::kAdamM ? 1 : 0;
  EXPECT_EQ(adam_m, 2u);
  for (int g = 0; g < 6; ++g) EXPECT_EQ(s.home(g, StateKind::kAdamM), g < 4 ? Tier::kHost : Tier::kNvme) << g;
  // Each group written whole in turn, then read back: no group's write loses another's bytes.
  for (int g = 0; g < 6; ++g) {
    ASSERT_TRUE(s.acquire_group(g, StateKind::kAdamM, Tier::kHost, AccessMode::kWrite).ok());
    float* p = s.pointer(static_cast<size_t>(g), StateKind::kAdamM);
    for (uint64_t e = 0; e < n / 8; ++e) p[e] = static_cast<float>(g * 100000 + static_cast<int>(e));
    s.release_group(g, StateKind::kAdamM);
  }
  for (int g = 5; g >= 0; --g) {
    ASSERT_TRUE(s.acquire_group(g, StateKind::kAdamM, Tier::kHost, AccessMode::kRead).ok());
    const float* p = s.pointer(static_cast<size_t>(g), StateKind::kAdamM);
    bool same = true;
    for (uint64_t e = 0; e < n / 8; ++e) same = same && p[e] == static_cast<float>(g * 100000 + static_cast<int>(e));
    EXPECT_TRUE(same) << "group " << g;
    s.release_group(g, StateKind::kAdamM);
  }
  // Two neighbours acquired together pin their one chunk twice.
  ASSERT_TRUE(s.acquire_group(1, StateKind::kAdamM, Tier::kHost, AccessMode::kReadWrite).ok());
  ASSERT_TRUE(s.acquire_group(2, StateKind::kAdamM, Tier::kHost, AccessMode::kReadWrite).ok());
  s.release_group(1, StateKind::kAdamM);
  s.release_group(2, StateKind::kAdamM);
  store->reset();
  std::filesystem::remove_all(dir);
}

// Saved-activation buffers no larger than a chunk are packed whole, as many to a chunk as fit;
// each keeps its own bytes when its neighbours are written. A larger buffer takes chunks of its
// own. (A 70B shape: 78 buffers of 64 MiB in 896 MiB chunks take 6 chunks, not 78.)
TEST(StateStoreTest, ActivationBuffersArePackedAndKeepTheirBytes) {
  EXPECT_EQ(StateStore::activation_chunks(78, 64ull << 20, 896ull << 20), 6u);
  EXPECT_EQ(StateStore::activation_chunks(5, kChunk / 4, kChunk), 2u);  // 4 to a chunk
  EXPECT_EQ(StateStore::activation_chunks(5, kChunk / 3, kChunk), 3u);  // 2: starts on 256-byte multiples
  EXPECT_EQ(StateStore::activation_chunks(2, kChunk + 1, kChunk), 4u);  // 2 pieces each
  EXPECT_EQ(StateStore::activation_chunks(0, kChunk, kChunk), 0u);
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  for (const uint64_t bytes : {kChunk / 3, kChunk / 4, kChunk + 100}) {
    StateStoreOptions o;
    o.space.chunk_bytes = kChunk;
    o.space.host_bytes = 64 * kChunk;
    auto store = StateStore::create(**device, nullptr, {{"a", kFloats, 0}}, o);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    StateStore& s = **store;
    const uint64_t before = s.space().num_chunks();
    const int count = 5;
    ASSERT_TRUE(s.add_activations(count, bytes).ok());
    EXPECT_EQ(s.space().num_chunks() - before, StateStore::activation_chunks(count, bytes, kChunk)) << bytes;
    std::vector<std::vector<uint8_t>> written;
    for (int i = 0; i < count; ++i) {
      std::vector<uint8_t>& w = written.emplace_back(bytes);
      for (uint64_t b = 0; b < bytes; ++b) w[b] = static_cast<uint8_t>(b * 7 + static_cast<uint64_t>(i) * 31);
      ASSERT_TRUE(s.write_activation(i, w.data(), bytes).ok());
    }
    for (int i = count - 1; i >= 0; --i) {
      std::vector<uint8_t> back(bytes);
      ASSERT_TRUE(s.read_activation(i, back.data(), bytes).ok());
      EXPECT_TRUE(back == written[static_cast<size_t>(i)]) << "buffer " << i << " of " << bytes << " bytes";
    }
  }
}

// Of a sliced kind, an expert part is sized by what its slices hold: experts another rank owns
// whole (the fp8 recipe's matrices) hold nothing there and open no chunk, and the store packs as
// group_chunks counts.
TEST(StateStoreTest, ExpertsASlicedKindHoldsNothingOfOpenNoChunk) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  std::vector<StateTensor> tensors = {{"dense", kFloats, 0}};
  for (int e = 0; e < 4; ++e) tensors.push_back({"expert" + std::to_string(e), kFloats / 2, 0, e});
  for (StateTensor& t : tensors) t.slice = ElementRange{0, t.part == 1 || t.part == kDensePart ? t.elements : 0};
  const StateStoreOptions o = host_options_slicing_adam_m();
  auto store = StateStore::create(**device, nullptr, tensors, o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  // Whole: the dense part and each expert a chunk (each is half a chunk, so it pages alone).
  EXPECT_EQ(StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamV), (std::vector<uint64_t>{5}));
  // Sliced: the dense part and expert 1; the three empty experts share the chunk before them.
  const std::vector<uint64_t> sliced = StateStore::group_chunks(tensors, kChunk, o.layout, StateKind::kAdamM, true);
  EXPECT_EQ(sliced, (std::vector<uint64_t>{2}));
  uint64_t adam_m = 0;
  for (ChunkId c = 0; c < (*store)->space().num_chunks(); ++c)
    adam_m += (*store)->space().chunk_kind(c) == ChunkKind::kAdamM ? 1 : 0;
  EXPECT_EQ(adam_m, sliced[0]);
  // The optimizer acquires the whole group, empty experts included.
  ASSERT_TRUE((*store)->acquire_group(0, StateKind::kAdamM, Tier::kHost, AccessMode::kReadWrite).ok());
  (*store)->release_group(0, StateKind::kAdamM);
}

// Update slices: a group's tensors in order, in runs whose state of each kind lies in one chunk.
// Ten tensors of a third of a chunk span four chunks of each kind; in the bf16 recipe the compute
// copy packs more densely than the fp32 kinds, and slices break where any kind changes chunk.
// Acquired slice by slice, a tier of one chunk per kind holds what the whole group (four of
// each) could not, and the bytes written through slices are the group's.
TEST(StateStoreTest, UpdateSlicesHoldAChunkOfEachKindAtATime) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(precision_name(precision));
    std::vector<StateTensor> tensors;
    for (int i = 0; i < 10; ++i) tensors.push_back({"t" + std::to_string(i), kFloats / 3 - 64, 0, kDensePart});
    tensors.push_back({"other", kFloats / 3, 1, kDensePart});
    const StateLayout layout = StateLayout::of(precision);
    const std::vector<StateKind> kinds = layout.kinds();
    StateStoreOptions o;
    o.layout = layout;
    o.space.chunk_bytes = kChunk;
    o.space.device_bytes = kinds.size() * kChunk;  // one chunk of each kind
    o.space.host_bytes = 64 * kChunk;
    o.home = [](int, StateKind, int) { return Tier::kHost; };
    auto store = StateStore::create(**device, nullptr, tensors, o);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    StateStore& s = **store;
    // In order, every tensor once.
    std::vector<size_t> order;
    for (int sl = 0; sl < s.update_slices(0); ++sl)
      for (size_t i : s.slice_tensors(0, sl)) order.push_back(i);
    EXPECT_EQ(order, s.group_tensors(0));
    // Three tensors to a chunk of an fp32 kind; five of the bf16 copy (256-byte aligned): the
    // fp32 kinds change chunk after tensors 3, 6 and 9, the bf16 copy after 5 as well.
    EXPECT_EQ(s.update_slices(0), precision == Precision::kFp32 ? 4 : 5);
    EXPECT_EQ(s.update_slices(1), 1);
    // Each slice's tensors of each kind in one chunk, acquired in a device tier of one chunk per
    // kind, and written: tensor i's first element of kind k is 1000 i + k.
    for (int sl = 0; sl < s.update_slices(0); ++sl) {
      for (StateKind k : kinds) ASSERT_TRUE(s.acquire_slice(0, sl, k, Tier::kDevice, AccessMode::kReadWrite).ok()) << sl;
      for (StateKind k : kinds) {
        if (!layout.is_f32(k)) continue;
        for (size_t i : s.slice_tensors(0, sl)) s.pointer(i, k)[0] = static_cast<float>(1000 * i + static_cast<int>(k));
      }
      for (StateKind k : kinds) s.release_slice(0, sl, k);
    }
    // The whole group's kinds at once do not fit that tier.
    Status whole = Status::OK();
    size_t acquired = 0;
    for (StateKind k : kinds) {
      whole = s.acquire_group(0, k, Tier::kDevice, AccessMode::kRead);
      if (!whole.ok()) break;
      ++acquired;
    }
    EXPECT_EQ(whole.code(), StatusCode::kOutOfMemory);
    for (size_t k = 0; k < acquired; ++k) s.release_group(0, kinds[k]);
    // What the slices wrote, read back group by group in host memory.
    for (StateKind k : kinds) {
      if (!layout.is_f32(k)) continue;
      ASSERT_TRUE(s.acquire_group(0, k, Tier::kHost, AccessMode::kRead).ok());
      for (size_t i : s.group_tensors(0))
        EXPECT_EQ(s.pointer(i, k)[0], static_cast<float>(1000 * i + static_cast<int>(k))) << i;
      s.release_group(0, k);
    }
  }
}

}  // namespace
}  // namespace strata
