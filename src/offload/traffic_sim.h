// The chunk moves of one optimizer step, by replaying its step program (offload/step_program.h:
// zeroing, grad_accum x (forward, backward), the norm, the optimizer group by group, each
// acquisition where and how the code makes it) against a model of the chunk space: each chunk
// has a home tier and copies above it; a tier holds a fixed number of slots; acquiring for write
// leaves the acquired copy the only valid one; a full tier gives up the copy whose next use along
// the program is farthest (Belady), stale copies first and clean before dirty, and the only valid
// copy of a chunk is written one tier down before it goes (a device-homed one back up to the
// device); an nvme-homed chunk reaches the device through a host slot. These are ChunkSpace's
// rules (memory/chunk_space_moves.cpp). Prefetch is modelled as the chunk space runs it after each
// acquisition: it moves chunks the next entries name, even those an entry will overwrite whole
// (the gradients the zeroing pass writes), and it only evicts copies needed later than the one
// it brings. An nvme read is taken as finished by the next prefetch.
//
// The replay runs a few steps from the homes alone and counts the last, the steady state.
// Pure computation; thread-compatible. Cost O(chunk accesses x log chunks).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "memory/tier.h"
#include "offload/step_program.h"

namespace strata {

// Per state kind, in StateKind's order: param, grad, master, adam_m, adam_v.
inline constexpr int kTrafficKinds = 5;

struct TrafficGroup {
  std::array<uint64_t, kTrafficKinds> chunks{};  // 0: the kind is absent (no separate master)
  std::array<Tier, kTrafficKinds> home{};
  // Chunks of param and grad a micro-batch leaves untouched (experts without tokens); the
  // forward and backward acquire the group's chunks less these.
  uint64_t idle_param_chunks = 0, idle_grad_chunks = 0;
  // Of those, the experts' (the last chunks of the group): the program's accesses of a layer's
  // experts (one per expert, in a row) acquire these less the idle ones, not prefetched; its
  // accesses of the dense part acquire the others.
  uint64_t expert_param_chunks = 0, expert_grad_chunks = 0;
};

struct TrafficInput {
  // In the engine's order: the embedding, the L layers, the head.
  std::vector<TrafficGroup> groups;
  // The step, in order (StepProgram::events). Activation accesses are left out: their chunks
  // are homed in host memory and accessed there (host_other_homes counts their slots).
  std::vector<ProgramEvent> program;
  bool overlap_optimizer = false;  // the norm is taken inside the optimizer: no pass of its own
  // Slots of each tier, homes included. A host tier in front of nvme keeps one slot free of homes.
  uint64_t device_slots = 0;
  uint64_t host_slots = 0;
  uint64_t host_other_homes = 0;  // host slots homed by chunks not modelled (offloaded checkpoints)
  int lookahead = 2;              // entries prefetched ahead, in units of the entry just acquired
  int steps = 3;                  // replayed; the last is counted
};

// Chunk moves in one phase of the step.
struct TrafficMoves {
  uint64_t h2d = 0, d2h = 0, disk_read = 0, disk_write = 0;
  TrafficMoves& operator+=(const TrafficMoves& o);
};

struct TrafficResult {
  bool ok = false;  // false: some acquisition found no slot (every copy pinned or home)
  TrafficMoves zero, forward, backward, norm, optimizer;  // forward and backward: all micro-batches
  TrafficMoves total() const;
};

TrafficResult simulate_traffic(const TrafficInput& input);

}  // namespace strata
