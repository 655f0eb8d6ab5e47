// Where this process stands in a multi-process job: its rank, the world's size and its place
// on its node, read from the variables a launcher sets (torchrun, Open MPI's mpirun, Slurm's
// srun or another PMI launcher). A process started by hand is a world of one.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/status.h"

namespace strata::parallel {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;               // rank among the processes on this node; picks the GPU
  int local_world_size = 1;         // processes on this node
  std::string launcher = "single";  // "single", "torchrun", "mpirun", "pmi" or "srun"
  // Names this job for the rendezvous, the same on every rank (empty for "single").
  std::string job_id;
};

using GetEnv = std::function<std::optional<std::string>(const char*)>;

// Reads the launcher's variables through `getenv`, trying torchrun's, then Open MPI's, then
// generic PMI's, then Slurm's; none of them means a world of one. A value that is not an
// integer in range (rank >= world, negative, local rank >= local size) returns
// InvalidArgument naming the variable and its value.
Result<LaunchInfo> launch_from_env(const GetEnv& getenv);
// The same over this process's environment.
Result<LaunchInfo> launch_from_env();

}  // namespace strata::parallel
