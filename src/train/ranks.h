// The trainer's side of data parallelism: the ranks of a run launched as several processes
// (parallel/launch.h reads them from torchrun, mpirun or srun), connected through a Comm, and
// the few things the training loop shares between them besides gradients: rank 0's resolved
// folders, whether every rank started, and whether to stop.
//
// Rank 0 owns the run's files (run.dir, metrics, checkpoints, the export); every rank holds the
// whole state, computes its share of each step's micro-batches and reads the same checkpoints.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/format.h"
#include "core/status.h"
#include "model/param_access.h"
#include "model/params.h"
#include "parallel/comm.h"
#include "parallel/launch.h"
#include "train/train_config.h"

namespace strata {

struct Ranks {
  parallel::LaunchInfo launch;
  std::unique_ptr<parallel::Comm> comm;  // null in a single process
  // The checkpoint writers' own (they run on a thread of their own beside training).
  std::unique_ptr<parallel::Comm> ckpt_comm;
  // The gradient sums' own, which run on a thread of their own as backward hands each layer
  // over (parallel.overlap_comm).
  std::unique_ptr<parallel::Comm> grad_comm;
  // Expert parallelism (parallel.expert_parallel = P > 1): this rank's expert group, the P
  // consecutive ranks [P * (rank / P), P * (rank / P) + P), in which it is rank % P. Null without.
  std::unique_ptr<parallel::Comm> expert_comm;
  // The W / P ranks at this rank's place in their expert groups (rank % P), which hold the same
  // experts' state: rank / P among them. A local Comm when P is the whole world.
  std::unique_ptr<parallel::Comm> expert_holders;
  // The same ranks, for the experts' gradient sums and weight gathers on the communication
  // stream's thread (parallel.overlap_comm).
  std::unique_ptr<parallel::Comm> grad_expert_holders;
  // Context parallelism (parallel.context_parallel = N > 1): this rank's context group, the N
  // consecutive ranks [N * (rank / N), N * (rank / N) + N), in which it is rank % N (its place on
  // the ring, model/context_parallel.h). Null without.
  std::unique_ptr<parallel::Comm> context_comm;
  bool start_agreed = false;  // every rank has said whether it could start (agree_all_ok)
  int rank() const { return launch.rank; }
  int world() const { return launch.world_size; }
  bool several() const { return launch.world_size > 1; }
  bool writes() const { return launch.rank == 0; }  // owns run.dir, metrics and checkpoints
  // Bytes this rank has sent for training (comm and grad_comm; not checkpoint bookkeeping).
  uint64_t bytes_sent() const {
    return (comm ? comm->bytes_sent() : 0) + (grad_comm ? grad_comm->bytes_sent() : 0) +
           (expert_comm ? expert_comm->bytes_sent() : 0) + (expert_holders ? expert_holders->bytes_sent() : 0) +
           (grad_expert_holders ? grad_expert_holders->bytes_sent() : 0) +
           (context_comm ? context_comm->bytes_sent() : 0);
  }
};

// The ranks of this process from its environment, connected when there are several: each
// process sets its log and CHECK prefix to its rank, the device to its local rank, and the
// host-memory default to its share of the node. InvalidArgument when parallel.expert_parallel
// does not divide the world.
Result<Ranks> connect_ranks(TrainConfig& t);

// The rendezvous folder of this launch: parallel.rendezvous (or /tmp/strata-rendezvous) with
// the launcher's job id as a subfolder, so two launches never meet in one.
std::string rendezvous_dir(const TrainConfig& t, const parallel::LaunchInfo& launch);

// Rank 0 sends `status` and, when it is OK, the folders it resolved (run.dir, ckpt.dir,
// memory.nvme.path, --resume) to every rank; the others return rank 0's error as theirs.
Status share_run_dirs(parallel::Comm& comm, const Status& status, TrainConfig& t);

// Whether every rank got this far without an error: each rank gives its own status; a rank whose
// own is fine returns an error when another rank's was not.
Status agree_all_ok(parallel::Comm& comm, const Status& own, const std::string& what);

// Once every rank is done with its Comms: rank 0 removes this launch's rendezvous folder, so
// that a later launch with the same job id does not read its addresses. Best effort (a
// failure is logged).
void retire_rendezvous(Ranks& ranks, const TrainConfig& t);

// True on every rank when any rank asks to stop (a signal reached some of them).
Result<bool> any_rank(parallel::Comm& comm, bool value);

// The smallest of the ranks' values, each in [1, most].
Result<int> fewest_over_ranks(parallel::Comm& comm, int value, int most);

// A sharded checkpoint's exchange (ckpt::ShardedSave::exchange) over `comm`: every rank's
// outcome and files to every rank; rank 0 gets all files, the others none, and every rank an
// error naming the ranks whose share failed.
Result<std::map<std::string, ckpt::FileRecord>> exchange_shard_files(parallel::Comm& comm, const Status& own,
                                                                    const std::map<std::string, ckpt::FileRecord>& files);

}  // namespace strata
