// GroupWorkspace (train/group_workspace.h): the device memory where ZeRO-2's full gradients and
// ZeRO-3's gathered weights live for a while. Its size follows the step program; a place closed
// with a stream is reused only after that stream's work, and open() prefers places whose users
// are done with them, so that a group's gather or sums in flight on one stream and the next
// group's compute on another do not wait for each other. The choice of place depends on the
// order of opens and closes only.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "core/cpu_device.h"
#include "model/params.h"
#include "model/recording_access.h"
#include "train/group_workspace.h"
#include "train/paged_state.h"
#include "train_test_util.h"

namespace strata {
namespace {

// Groups 0..3 of `bytes` each (one tensor per group), and a program of one batch per group,
// each opening its group: at most one open at a time.
WorkspaceLayout layout_of(std::vector<uint64_t> bytes, int in_flight) {
  WorkspaceLayout w;
  for (size_t g = 0; g < bytes.size(); ++g) {
    w.tensor_bytes.push_back(bytes[g]);
    w.groups.push_back(static_cast<int>(g));
  }
  w.kind = StateKind::kParam;
  w.span = WorkspaceSpan::kBatch;
  w.in_flight = in_flight;
  return w;
}

std::vector<ProgramEvent> one_batch_each(int groups) {
  std::vector<ProgramEvent> p;
  for (int g = 0; g < groups; ++g) {
    ProgramEvent e;
    e.access = GroupAccess::of_part(g, StateKind::kParam, kDensePart);
    e.last = true;
    p.push_back(e);
  }
  return p;
}

TEST(GroupWorkspace, SizedForTheMostOpenAtOncePlusTheLargestGroupsInFlight) {
  const std::vector<uint64_t> bytes = {1000, 512, 3000, 256};  // 256-byte blocks: 1024, 512, 3072, 256
  EXPECT_EQ(GroupWorkspace::bytes_for(layout_of(bytes, 0), one_batch_each(4)), 3072u);
  EXPECT_EQ(GroupWorkspace::bytes_for(layout_of(bytes, 1), one_batch_each(4)), 3072u + 3072u);
  EXPECT_EQ(GroupWorkspace::bytes_for(layout_of(bytes, 2), one_batch_each(4)), 3072u + 2 * 3072u);
}

TEST(GroupWorkspace, WithoutStreamsAPlaceIsReusedAtOnce) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  auto w = GroupWorkspace::create(**device, layout_of({1024, 1024, 1024}, 0), one_batch_each(3), "test");
  ASSERT_TRUE(w.ok());
  w->open(0);
  void* first = w->at(0);
  w->close(0);
  w->open(1);
  EXPECT_EQ(w->at(1), first);
  EXPECT_FALSE(w->can_open(2));  // one place, taken
  w->close(1);
  EXPECT_TRUE(w->can_open(2));
}

// A place closed with a stream whose work is still running: the next group takes the spare room
// rather than wait, and the one after it the place closed the longest ago, its opener's stream
// waiting for that place's last user.
TEST(GroupWorkspace, APlaceInFlightIsAvoidedAndThenWaitedFor) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  auto w = GroupWorkspace::create(**device, layout_of({1024, 1024, 1024}, 1), one_batch_each(3), "test");
  ASSERT_TRUE(w.ok());
  std::unique_ptr<Stream> user = (*device)->create_stream(), next = (*device)->create_stream();
  std::atomic<bool> release{false}, wrote{false};
  w->open(0, user.get());
  char* place0 = static_cast<char*>(w->at(0));
  // The user's work on group 0 runs until the test lets it go.
  as_cpu_stream(*user).enqueue([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    place0[0] = 'a';
    wrote = true;
  });
  w->close(0, user.get());
  w->open(1, next.get());
  EXPECT_NE(static_cast<char*>(w->at(1)), place0);  // the spare room: no wait
  as_cpu_stream(*next).enqueue([] {});
  next->synchronize();  // returns while group 0's user still runs
  EXPECT_FALSE(wrote);
  w->close(1, next.get());
  // Group 2 reuses group 0's place (closed the longest ago): `next` waits for the user first.
  w->open(2, next.get());
  EXPECT_EQ(static_cast<char*>(w->at(2)), place0);
  std::atomic<bool> saw_write{false};
  as_cpu_stream(*next).enqueue([&] { saw_write = wrote.load(); });
  release = true;
  next->synchronize();
  EXPECT_TRUE(saw_write);
  w->close(2, next.get());
  user->synchronize();
  next->synchronize();
}

// The place a group gets depends on the order of opens and closes, not on which streams have
// finished: two workspaces driven alike, one whose users are done and one whose are not, choose
// the same places.
TEST(GroupWorkspace, PlacesDependOnTheOrderOnlyNotOnStreamProgress) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  const WorkspaceLayout layout = layout_of({1024, 512, 2048, 256, 768}, 1);
  auto a = GroupWorkspace::create(**device, layout, one_batch_each(5), "a");
  auto b = GroupWorkspace::create(**device, layout, one_batch_each(5), "b");
  ASSERT_TRUE(a.ok() && b.ok());
  std::unique_ptr<Stream> idle = (*device)->create_stream(), busy = (*device)->create_stream();
  std::unique_ptr<Stream> opener = (*device)->create_stream();
  std::atomic<bool> release{false};
  as_cpu_stream(*busy).enqueue([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  // Two groups open at a time at most (the one computing and the next, gathered ahead).
  const std::vector<int> order = {0, 1, 2, 3, 4, 2, 0, 1, 3, 4, 0, 2};
  std::vector<int> open_now;
  for (int g : order) {
    if (open_now.size() == 2) {
      a->close(open_now.front(), idle.get());
      b->close(open_now.front(), busy.get());
      open_now.erase(open_now.begin());
    }
    idle->synchronize();
    ASSERT_EQ(a->can_open(g), b->can_open(g)) << g;
    if (!a->can_open(g)) continue;
    a->open(g, opener.get());
    b->open(g, opener.get());
    EXPECT_EQ(a->place(g), b->place(g)) << "group " << g;
    open_now.push_back(g);
  }
  release = true;
  busy->synchronize();
  opener->synchronize();
}

// Layers of 960 bytes (1024 with the blocks) then a head of 1280, each gathered while the one
// before computes (two open at once), in a room of 2 x 1280: a layer opened beside the one in use
// goes to an end of the buffer, so once that one closes the head finds the other end whole. (In
// the first free place after the open layer, the head found 1024 and 256 on its two sides.)
TEST(GroupWorkspace, AGroupInFlightGoesToAnEndLeavingTheOtherWhole) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  const int head = 4;
  auto w = GroupWorkspace::create(**device, layout_of({960, 960, 960, 960, 1280}, 1), one_batch_each(5), "test");
  ASSERT_TRUE(w.ok());
  std::unique_ptr<Stream> compute = (*device)->create_stream();
  w->open(0, compute.get());
  for (int g = 1; g <= head; ++g) {
    ASSERT_TRUE(w->can_open(g)) << "group " << g << " beside group " << g - 1;
    w->open(g, compute.get());
    w->close(g - 1, compute.get());
  }
  w->close(head, compute.get());
  compute->synchronize();
}

// The real step program of a tied model whose embedding is smaller than a layer, opened and
// closed as PagedState does for several micro-batches (gradients: from a group's first batch to
// its last; weights: each batch), with and without room for a group in flight (closing with a
// stream then): every open finds a place, and no two open places overlap.
TEST(GroupWorkspace, ATiedModelsProgramFitsMicroBatchAfterMicroBatch) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  model::ModelConfig mc = tiny_config(/*tied=*/true);
  mc.vocab_size = 64;  // the embedding (64 x 32) smaller than a layer
  const model::ParamLayout layout(mc);
  const std::vector<ProgramEvent> program = model::record_micro_batch(mc, false);
  std::vector<StateTensor> tensors = PagedState::store_tensors(layout);
  std::unique_ptr<Stream> stream = (*device)->create_stream();
  for (StateKind kind : {StateKind::kGrad, StateKind::kParam}) {
    for (int in_flight : {0, 1}) {
      WorkspaceLayout w;
      for (const StateTensor& t : tensors) {
        w.tensor_bytes.push_back(t.elements * sizeof(float));
        w.groups.push_back(t.group);
      }
      w.kind = kind;
      w.span = kind == StateKind::kGrad ? WorkspaceSpan::kMicroBatch : WorkspaceSpan::kBatch;
      w.in_flight = in_flight;
      auto ws = GroupWorkspace::create(**device, w, program, "test");
      ASSERT_TRUE(ws.ok());
      const int groups = static_cast<int>(layout.num_layers()) + 2;
      std::vector<uint64_t> group_bytes(static_cast<size_t>(groups), 0);
      for (const StateTensor& t : tensors) group_bytes[static_cast<size_t>(t.group)] += (t.elements * 4 + 255) / 256 * 256;
      auto opens = [&](const GroupAccess& a) { return a.activation < 0 && a.kind == kind && a.part == kDensePart; };
      std::vector<int> batches(static_cast<size_t>(groups), 0), seen(static_cast<size_t>(groups), 0);
      std::vector<bool> in_batch(static_cast<size_t>(groups), false);
      for (const ProgramEvent& e : program) {
        if (opens(e.access)) in_batch[static_cast<size_t>(e.access.group)] = true;
        if (!e.last) continue;
        for (int g = 0; g < groups; ++g) batches[static_cast<size_t>(g)] += in_batch[static_cast<size_t>(g)] ? 1 : 0;
        in_batch.assign(static_cast<size_t>(groups), false);
      }
      Stream* user = in_flight > 0 ? stream.get() : nullptr;
      for (int micro_batch = 0; micro_batch < 4; ++micro_batch) {
        for (const ProgramEvent& e : program) {
          if (opens(e.access)) {
            const int g = e.access.group;
            in_batch[static_cast<size_t>(g)] = true;
            if (!ws->is_open(g)) {
              ASSERT_TRUE(ws->can_open(g)) << "kind " << static_cast<int>(kind) << " in flight " << in_flight;
              ws->open(g, user);
              for (int h = 0; h < groups; ++h) {
                if (h == g || !ws->is_open(h) || group_bytes[static_cast<size_t>(h)] == 0) continue;
                const uint64_t a = ws->place(g), b = ws->place(h);
                EXPECT_TRUE(a + group_bytes[static_cast<size_t>(g)] <= b || b + group_bytes[static_cast<size_t>(h)] <= a)
                    << "groups " << g << " and " << h << " overlap";
              }
            }
          }
          if (!e.last) continue;
          for (int g = 0; g < groups; ++g) {
            if (!in_batch[static_cast<size_t>(g)]) continue;
            in_batch[static_cast<size_t>(g)] = false;
            if (w.span == WorkspaceSpan::kBatch || ++seen[static_cast<size_t>(g)] == batches[static_cast<size_t>(g)]) {
              seen[static_cast<size_t>(g)] = 0;
              ws->close(g, user);
            }
          }
        }
      }
      stream->synchronize();
    }
  }
}

}  // namespace
}  // namespace strata
