#include "offload/traffic_sim.h"

#include <algorithm>
#include <optional>
#include <set>
#include <tuple>

#include "core/check.h"

namespace strata {

TrafficMoves& TrafficMoves::operator+=(const TrafficMoves& o) {
  h2d += o.h2d;
  d2h += o.d2h;
  disk_read += o.disk_read;
  disk_write += o.disk_write;
  return *this;
}

TrafficMoves TrafficResult::total() const {
  TrafficMoves t = zero;
  t += forward;
  t += backward;
  t += norm;
  t += optimizer;
  return t;
}

namespace {

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);
constexpr int kNvme = static_cast<int>(Tier::kNvme);
constexpr uint64_t kNever = UINT64_MAX;

// One chunk acquisition of the step; `last` closes a batch: the chunks of a batch stay pinned
// until its last is acquired, then all are released (a layer's parameters and gradients, a
// group's optimizer kinds).
struct Access {
  uint32_t chunk;
  uint8_t tier;
  AccessMode mode;
  StepPhase phase;
  bool last;
  uint8_t prefetch_to = kNvme;  // kNvme: an entry prefetch skips (and does not count)
  uint32_t window = 0;          // > 0 on an entry's last chunk: prefetch this many entries on
};

struct Chunk {
  int home = kHost;
  bool slot[kNumTiers] = {};
  bool valid[kNumTiers] = {};
  int pinned_in = -1;
  uint64_t next = kNever;  // global position of the next use
  uint64_t last_use = 0;
};

// Eviction order: larger goes first (ChunkSpace::pick_victim's key), the chunk id last.
using Key = std::tuple<bool, uint64_t, bool, uint64_t, uint32_t>;

class Replay {
 public:
  Replay(const TrafficInput& in, std::vector<Access> accesses, uint32_t num_chunks, std::vector<int> homes)
      : accesses_(std::move(accesses)), chunks_(num_chunks), keys_(num_chunks) {
    uses_.resize(num_chunks);
    for (size_t i = 0; i < accesses_.size(); ++i) uses_[accesses_[i].chunk].push_back(i);
    for (uint32_t id = 0; id < num_chunks; ++id) chunks_[id].next = uses_[id].empty() ? kNever : uses_[id].front();
    capacity_[kDev] = in.device_slots;
    capacity_[kHost] = in.host_slots;
    used_[kHost] = in.host_other_homes;
    for (uint32_t id = 0; id < num_chunks; ++id) {
      Chunk& c = chunks_[id];
      c.home = homes[id];
      c.slot[c.home] = c.valid[c.home] = true;
      if (c.home != kNvme) ++used_[c.home];
    }
  }

  bool run(int steps, TrafficResult* out) {
    const uint64_t S = accesses_.size();
    for (int step = 0; step < steps; ++step) {
      counting_ = step + 1 == steps;
      std::vector<uint32_t> batch;
      for (uint64_t i = 0; i < S; ++i) {
        const Access& a = accesses_[i];
        phase_ = a.phase;
        position_ = static_cast<uint64_t>(step) * S + i;
        if (!acquire(a)) return false;
        if (a.window > 0 && !prefetch(a.window)) return false;
        batch.push_back(a.chunk);
        if (a.last) {
          for (uint32_t id : batch) release(id);
          batch.clear();
        }
      }
    }
    out->zero = moves_[static_cast<int>(StepPhase::kZero)];
    out->forward = moves_[static_cast<int>(StepPhase::kForward)];
    out->backward = moves_[static_cast<int>(StepPhase::kBackward)];
    out->norm = moves_[static_cast<int>(StepPhase::kNorm)];
    out->optimizer = moves_[static_cast<int>(StepPhase::kOptimizer)];
    out->ok = true;
    return true;
  }

 private:
  // The next use after global position p of chunk id, along the repeating schedule.
  uint64_t next_use(uint32_t id, uint64_t p) const {
    const std::vector<uint64_t>& u = uses_[id];
    if (u.empty()) return kNever;
    const uint64_t S = accesses_.size(), base = p / S * S, at = p % S;
    auto it = std::upper_bound(u.begin(), u.end(), at);
    return it != u.end() ? base + *it : base + S + u.front();
  }

  bool candidate(uint32_t id, int t) const {
    const Chunk& c = chunks_[id];
    return c.slot[t] && c.home != t && c.pinned_in != t && busy_ != id;
  }
  Key key(uint32_t id, int t) const {
    const Chunk& c = chunks_[id];
    const bool stale = !c.valid[t];
    bool clean = stale;
    for (int o = 0; o < kNumTiers; ++o) clean = clean || (o != t && c.valid[o]);
    return Key{stale, c.next, clean, UINT64_MAX - c.last_use, id};
  }
  // Every change to a chunk goes between detach and attach, which keep the victim sets current.
  void detach(uint32_t id) {
    for (int t : {kDev, kHost})
      if (keys_[id][t]) victims_[t].erase(*keys_[id][t]), keys_[id][t].reset();
  }
  void attach(uint32_t id) {
    detach(id);
    for (int t : {kDev, kHost}) {
      if (!candidate(id, t)) continue;
      keys_[id][t] = key(id, t);
      victims_[t].insert(*keys_[id][t]);
    }
  }

  void count(uint64_t TrafficMoves::*field) {
    if (counting_) moves_[static_cast<int>(phase_)].*field += 1;
  }

  // The copy that goes for a slot in t: none when every copy is pinned or home, or, for a
  // prefetch of a chunk due at `due`, when the farthest valid one is needed no later.
  std::optional<uint32_t> victim(int t, std::optional<uint64_t> due) const {
    if (victims_[t].empty()) return std::nullopt;
    const Key& k = *victims_[t].rbegin();
    if (due && !std::get<0>(k) && std::get<1>(k) <= *due) return std::nullopt;
    return std::get<4>(k);
  }

  bool take_slot(uint32_t id, int t, std::optional<uint64_t> due = std::nullopt) {
    if (used_[t] >= capacity_[t]) {
      const std::optional<uint32_t> victim = this->victim(t, due);
      if (!victim) return false;
      if (!evict(*victim, t)) return false;
    }
    ++used_[t];
    detach(id);
    chunks_[id].slot[t] = true;
    attach(id);
    return true;
  }

  bool evict(uint32_t id, int from) {
    detach(id);
    Chunk& c = chunks_[id];
    bool elsewhere = false;
    for (int o = 0; o < kNumTiers; ++o) elsewhere = elsewhere || (o != from && c.valid[o]);
    if (c.valid[from] && !elsewhere) {  // the only valid copy: write it down first
      if (from == kDev) {
        if (!c.slot[kHost] && !take_slot(id, kHost)) return false;
        c.valid[kHost] = true;
        count(&TrafficMoves::d2h);
      } else if (c.home == kDev) {
        c.valid[kDev] = true;
        count(&TrafficMoves::h2d);
      } else {
        c.valid[kNvme] = true;
        count(&TrafficMoves::disk_write);
      }
    }
    c.slot[from] = c.valid[from] = false;
    --used_[from];
    attach(id);
    return true;
  }

  bool fill(uint32_t id, int t) {
    Chunk& c = chunks_[id];
    if (t == kDev) {
      if (!c.valid[kHost]) {
        if (!c.slot[kHost] && !take_slot(id, kHost)) return false;
        c.valid[kHost] = true;
        count(&TrafficMoves::disk_read);
      }
      c.valid[kDev] = true;
      count(&TrafficMoves::h2d);
      return true;
    }
    if (c.valid[kDev]) {
      count(&TrafficMoves::d2h);
    } else {
      count(&TrafficMoves::disk_read);
    }
    c.valid[kHost] = true;
    return true;
  }

  bool acquire(const Access& a) {
    const uint32_t id = a.chunk;
    const int w = a.tier;
    busy_ = id;
    detach(id);
    Chunk& c = chunks_[id];
    c.last_use = position_ + 1;
    if (!c.slot[w] && !take_slot(id, w)) return false;
    detach(id);
    if (!c.valid[w] && a.mode != AccessMode::kWrite) {
      if (!fill(id, w)) return false;
    }
    if (a.mode != AccessMode::kRead)
      for (int t = 0; t < kNumTiers; ++t) c.valid[t] = t == w;
    c.valid[w] = true;
    c.pinned_in = w;
    c.next = next_use(id, position_);
    busy_.reset();
    attach(id);
    return true;
  }

  // ChunkSpace::prefetch: the next `window` entries that name a tier, each moved there when a
  // slot is free or a copy needed later than it can go; a chunk only on nvme goes to host
  // first (its device copy follows at a later call).
  bool prefetch(uint32_t window) {
    const uint64_t S = accesses_.size();
    bool full[2] = {false, false};
    uint32_t counted = 0;
    for (uint64_t k = 0; k < S && counted < window; ++k) {
      const Access& e = accesses_[(position_ + k) % S];
      const int to = e.prefetch_to;
      if (to == kNvme) continue;
      ++counted;
      if (full[to]) continue;
      const uint32_t id = e.chunk;
      Chunk& c = chunks_[id];
      if (c.valid[to] || (c.pinned_in >= 0 && c.pinned_in != to)) continue;
      const uint64_t due = c.next;
      busy_ = id;
      attach(id);
      if (to == kDev && !c.valid[kHost] && !c.valid[kDev]) {
        if (!c.slot[kHost]) {
          if (used_[kHost] >= capacity_[kHost] && !victim(kHost, due)) {
            busy_.reset(), attach(id);
            continue;
          }
          if (!take_slot(id, kHost, due)) return false;
        }
        c.valid[kHost] = true;
        count(&TrafficMoves::disk_read);
        busy_.reset(), attach(id);
        continue;
      }
      if (!c.slot[to]) {
        if (used_[to] >= capacity_[to] && !victim(to, due)) {
          full[to] = true;
          busy_.reset(), attach(id);
          continue;
        }
        if (!take_slot(id, to, due)) return false;
      }
      if (!fill(id, to)) return false;
      busy_.reset(), attach(id);
    }
    return true;
  }

  void release(uint32_t id) {
    detach(id);
    chunks_[id].pinned_in = -1;
    attach(id);
  }

  std::vector<Access> accesses_;
  std::vector<Chunk> chunks_;
  std::vector<std::array<std::optional<Key>, 2>> keys_;
  std::vector<std::vector<uint64_t>> uses_;
  std::set<Key> victims_[2];
  uint64_t capacity_[2] = {};
  uint64_t used_[2] = {};
  std::optional<uint32_t> busy_;
  uint64_t position_ = 0;
  StepPhase phase_ = StepPhase::kZero;
  bool counting_ = false;
  TrafficMoves moves_[kStepPhases];
};

// The replay's chunk accesses along the program: each access of a group's kind names its chunks
// (chunk ids run group by group, kind by kind from `first`), in the tier where it is made.
class ProgramChunks {
 public:
  ProgramChunks(const TrafficInput& in, std::vector<std::array<uint32_t, kTrafficKinds>> first)
      : in_(in), first_(std::move(first)), window_(static_cast<uint32_t>(std::max(0, in.lookahead))) {}

  void add(const ProgramEvent& e) {
    const GroupAccess& a = e.access;
    const bool counted = a.activation < 0 && !(in_.overlap_optimizer && e.phase == StepPhase::kNorm);
    if (counted) add_chunks(e);
    expert_run_ = counted && a.part >= 0 ? std::optional<std::pair<int, StateKind>>({a.group, a.kind}) : std::nullopt;
    if (e.last && out_.size() > batch_start_) out_.back().last = true, batch_start_ = out_.size();
  }
  std::vector<Access> take() { return std::move(out_); }

 private:
  // The chunks the access names: every chunk of the kind, the dense part's (all but the
  // experts'), or, at the first access of a run over a layer's experts, the experts' that the
  // micro-batch reaches.
  void add_chunks(const ProgramEvent& e) {
    const GroupAccess& a = e.access;
    const size_t g = static_cast<size_t>(a.group), k = static_cast<size_t>(a.kind);
    CHECK_MSG(g < in_.groups.size() && k < kTrafficKinds, "the step program names a group or kind the replay lacks");
    const TrafficGroup& tg = in_.groups[g];
    const uint64_t n = tg.chunks[k];
    const uint32_t f = first_[g][k];
    const bool param = a.kind == StateKind::kParam, grad = a.kind == StateKind::kGrad;
    const uint64_t experts = std::min(n, param ? tg.expert_param_chunks : grad ? tg.expert_grad_chunks : 0);
    const uint64_t idle = std::min(experts, param ? tg.idle_param_chunks : grad ? tg.idle_grad_chunks : 0);
    if (a.part == kAllParts) {
      entry(e, f, n);
    } else if (a.part == kDensePart) {
      entry(e, f, n - experts);
    } else if (expert_run_ != std::pair<int, StateKind>{a.group, a.kind}) {
      entry(e, f + static_cast<uint32_t>(n - experts), experts - idle);
    }
  }
  // Chunks [f, f + n) acquired where the access says; a prefetched access has its last chunk
  // prefetch the next entries.
  void entry(const ProgramEvent& e, uint32_t f, uint64_t n) {
    const uint8_t tier = static_cast<uint8_t>(e.access.prefetch_to);
    for (uint64_t i = 0; i < n; ++i) {
      out_.push_back({f + static_cast<uint32_t>(i), tier, e.mode, e.phase, false});
      out_.back().prefetch_to = e.access.prefetch ? tier : static_cast<uint8_t>(kNvme);
    }
    if (n > 0 && e.access.prefetch) out_.back().window = window_ * static_cast<uint32_t>(n);
  }

  const TrafficInput& in_;
  std::vector<std::array<uint32_t, kTrafficKinds>> first_;
  uint32_t window_;
  std::vector<Access> out_;
  size_t batch_start_ = 0;  // the first access of the open batch
  std::optional<std::pair<int, StateKind>> expert_run_;  // the previous access was of these experts
};

}  // namespace

TrafficResult simulate_traffic(const TrafficInput& in) {
  TrafficResult result;
  const int groups = static_cast<int>(in.groups.size());
  if (groups < 2) return result;
  // Chunk ids, group by group and kind by kind.
  std::vector<std::array<uint32_t, kTrafficKinds>> first(static_cast<size_t>(groups));
  std::vector<int> homes;
  for (int g = 0; g < groups; ++g) {
    const TrafficGroup& tg = in.groups[static_cast<size_t>(g)];
    for (int k = 0; k < kTrafficKinds; ++k) {
      first[static_cast<size_t>(g)][static_cast<size_t>(k)] = static_cast<uint32_t>(homes.size());
      homes.insert(homes.end(), tg.chunks[static_cast<size_t>(k)], static_cast<int>(tg.home[static_cast<size_t>(k)]));
    }
  }
  ProgramChunks chunks(in, std::move(first));
  for (const ProgramEvent& e : in.program) chunks.add(e);
  std::vector<Access> s = chunks.take();
  if (s.empty()) return result;
  const uint32_t num_chunks = static_cast<uint32_t>(homes.size());
  Replay replay(in, std::move(s), num_chunks, std::move(homes));
  if (!replay.run(std::max(2, in.steps), &result)) result = TrafficResult{};
  return result;
}

}  // namespace strata
