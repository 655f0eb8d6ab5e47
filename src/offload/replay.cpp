#include "offload/replay.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/counting_backend.h"

namespace strata {

ReplayMoves& ReplayMoves::operator+=(const ReplayMoves& o) {
  h2d += o.h2d;
  d2h += o.d2h;
  disk_read += o.disk_read;
  disk_write += o.disk_write;
  return *this;
}

ReplayMoves ReplayResult::total() const {
  ReplayMoves t;
  for (const ReplayMoves& m : phase) t += m;
  return t;
}

uint64_t store_chunk_count(const std::vector<StateTensor>& tensors, const StateLayout& layout, uint64_t chunk_bytes,
                           int activations, uint64_t activation_bytes, const std::array<bool, kNumStateKinds>& sliced,
                           const HomeOf& home) {
  uint64_t chunks = 0;
  for (const StateKind kind : layout.kinds())
    for (uint64_t n :
         StateStore::group_chunks(tensors, chunk_bytes, layout, kind, sliced[static_cast<size_t>(kind)], home))
      chunks += n;
  return chunks + StateStore::activation_chunks(activations, activation_bytes, chunk_bytes);
}

namespace {

ReplayMoves moves_of(const ChunkSpaceStats& s) {
  return {s.host_to_device_bytes, s.device_to_host_bytes, s.nvme_to_host_bytes, s.host_to_nvme_bytes};
}

ReplayMoves operator-(const ReplayMoves& a, const ReplayMoves& b) {
  return {a.h2d - b.h2d, a.d2h - b.d2h, a.disk_read - b.disk_read, a.disk_write - b.disk_write};
}

// Drives a store along the program as the engine does (train/paged_state.cpp): what it acquires
// stays pinned until the event that closes its batch (an overlapped update's, until the next
// one begins or the step ends).
class Driver {
 public:
  Driver(StateStore& store, const ReplayInput& in, const std::vector<ProgramEvent>& program)
      : store_(store), in_(in), program_(program) {}

  // One step; the moves of each phase are added to `phase` when counting. On error nothing
  // stays acquired.
  Status step(std::array<ReplayMoves, kStepPhases>* phase) {
    Status st = run(phase);
    release_all();
    release(&applying_);
    return st;
  }

 private:
  Status run(std::array<ReplayMoves, kStepPhases>* phase) {
    const std::vector<ProgramEvent>& events = program_;
    for (size_t i = 0; i < events.size();) {
      const ProgramEvent& e = events[i];
      const ReplayMoves before = moves_of(store_.stats());
      size_t next = i + 1;
      bool closes = e.last;
      // The overlapped update before this one is settled as this one begins (step_program.h).
      if (e.overlapped && held_.empty()) release(&applying_);
      if (e.phase == StepPhase::kZero && store_.zero_by_discard(e.access.group, e.access.kind)) {
        // Zeroed as the engine zeroes it (PagedState::zero_grads): nothing is acquired.
      } else if (e.access.activation >= 0) {
        const int a = e.access.activation;
        RETURN_IF_ERROR(e.mode == AccessMode::kWrite ? store_.write_activation(a, nullptr, in_.activation_bytes)
                                                     : store_.read_activation(a, nullptr, in_.activation_bytes));
      } else if (e.access.part >= 0 && !e.access.prefetch) {
        // A run over one layer's experts of one kind: those the tokens reach, together.
        std::vector<int> experts;
        for (; i < events.size() && same_run(e, events[i]); ++i) {
          experts.push_back(events[i].access.part);
          closes = closes || events[i].last;
        }
        next = i;
        const size_t active = in_.every_expert[static_cast<size_t>(e.access.kind)]
                                  ? experts.size()
                                  : reached(experts.size(), e.access.group);
        experts.resize(active);
        if (!experts.empty()) {
          RETURN_IF_ERROR(store_.acquire_parts(e.access.group, experts, e.access.kind, e.access.prefetch_to, e.mode));
          held_.push_back({e.access, experts});
        }
      } else if (e.access.slice >= 0) {
        RETURN_IF_ERROR(store_.acquire_slice(e.access.group, e.access.slice, e.access.kind, e.access.prefetch_to, e.mode,
                                             e.access.cursor));
        held_.push_back({e.access, {}, e.discard});
      } else if (e.access.part == kAllParts) {
        RETURN_IF_ERROR(
            store_.acquire_group(e.access.group, e.access.kind, e.access.prefetch_to, e.mode, e.access.cursor));
        held_.push_back({e.access, {}, e.discard});
      } else {
        RETURN_IF_ERROR(
            store_.acquire_part(e.access.group, e.access.part, e.access.kind, e.access.prefetch_to, e.mode));
        held_.push_back({e.access, {}});
      }
      if (closes && e.overlapped) {
        applying_ = std::move(held_);  // while the optimizer's thread applies it
        held_.clear();
      } else if (closes) {
        release_all();
      }
      if (phase != nullptr) (*phase)[static_cast<size_t>(e.phase)] += moves_of(store_.stats()) - before;
      i = next;
    }
    return Status::OK();
  }

  struct Held {
    GroupAccess access;
    std::vector<int> experts;  // an expert run's parts
    bool discard = false;      // ProgramEvent::discard
  };

  static bool same_run(const ProgramEvent& first, const ProgramEvent& e) {
    return e.access.activation < 0 && e.access.part >= 0 && !e.access.prefetch && e.access.group == first.access.group &&
           e.access.kind == first.access.kind;
  }
  // Experts of `n` a micro-batch reaches in group `g`, the same in each of the layer's passes.
  // A share of f reaches f * n experts on average: the groups take turns at the one more the
  // fraction calls for (0.71 of 8: 6, 5, 6, 6, 5, ...), so the count summed over the layers is
  // within one of the shares' sum times n, where rounding every layer alike would be off by up
  // to 1/2n each.
  size_t reached(size_t n, int g) const {
    const auto share = [this](int h) {
      const std::vector<double>& by = in_.expert_fetch_by_group;
      const double f = by.empty() ? in_.expert_fetch_fraction : by.at(static_cast<size_t>(h));
      return std::clamp(f, 0.0, 1.0);
    };
    double before = 0;  // the shares of the groups before g
    for (int h = 0; h < g; ++h) before += share(h);
    const double N = static_cast<double>(n);
    const long long count = std::llround((before + share(g)) * N) - std::llround(before * N);
    return std::min(n, static_cast<size_t>(std::max(count, 0LL)));
  }
  void release_all() { release(&held_); }
  void release(std::vector<Held>* held) {
    for (const Held& h : *held) {
      const GroupAccess& a = h.access;
      if (!h.experts.empty()) {
        store_.release_parts(a.group, h.experts, a.kind);
      } else if (a.slice >= 0) {
        store_.release_slice(a.group, a.slice, a.kind);
        if (h.discard) store_.discard(a.group, a.slice, a.kind);
      } else if (a.part == kAllParts) {
        store_.release_group(a.group, a.kind);
        if (h.discard) store_.discard(a.group, kWholeGroup, a.kind);
      } else {
        store_.release_part(a.group, a.part, a.kind);
      }
    }
    held->clear();
  }

  StateStore& store_;
  const ReplayInput& in_;
  const std::vector<ProgramEvent>& program_;  // in.program with its update slices
  std::vector<Held> held_;
  std::vector<Held> applying_;  // the overlapped update being applied (ProgramEvent::overlapped)
};

}  // namespace

Result<ReplayResult> replay_step(const ReplayInput& in) {
  CountingDevice device;
  CountingIoEngine io;
  StateStoreOptions so = in.store;
  so.space.nvme_dir.clear();
  ASSIGN_OR_RETURN(std::unique_ptr<StateStore> store, StateStore::create(device, &io, in.tensors, so));
  if (in.activations > 0)
    RETURN_IF_ERROR(store->add_activations(in.activations, in.activation_bytes, in.activation_host_chunks));
  // Updates marked to go slice by slice, split by the store's slices.
  const std::vector<ProgramEvent> program =
      expand_update_slices(in.program, [&store](int g) { return store->update_slices(g); });
  std::vector<GroupAccess> schedule;
  for (const ProgramEvent& e : program) schedule.push_back(e.access);
  store->set_schedule(schedule);
  Driver driver(*store, in, program);
  ReplayResult result;
  const int counted = std::max(1, in.counted_steps);
  RETURN_IF_ERROR(driver.step(nullptr));
  std::array<ReplayMoves, kStepPhases> sums{};
  for (int s = 0; s < counted; ++s) RETURN_IF_ERROR(driver.step(&sums));
  const uint64_t n = static_cast<uint64_t>(counted);
  auto per_step = [n](uint64_t sum) { return (sum + n / 2) / n; };
  for (size_t p = 0; p < sums.size(); ++p)
    result.phase[p] = {per_step(sums[p].h2d), per_step(sums[p].d2h), per_step(sums[p].disk_read),
                       per_step(sums[p].disk_write)};
  const ChunkSpaceStats stats = store->stats();
  for (int t = 0; t < kNumTiers; ++t) result.peak_bytes[static_cast<size_t>(t)] = stats.tiers[static_cast<size_t>(t)].peak_bytes;
  return result;
}

}  // namespace strata
