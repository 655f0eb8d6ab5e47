#include "parallel/launch.h"

#include <fmt/format.h>

#include <cstdlib>

namespace strata::parallel {
namespace {

// The names one launcher uses for the four numbers.
struct Names {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;  // may be null: the launcher does not say
  const char* local_size;
};

Result<int> parse_int(const char* name, const std::string& value) {
  // Whole string an integer, no sign games, no overflow.
  if (value.empty() || value.size() > 9) {
    return Status::InvalidArgument(
        fmt::format("{}=\"{}\" is not a rank or size (a non-negative integer)", name, value));
  }
  int v = 0;
  for (char c : value) {
    if (c < '0' || c > '9') {
      return Status::InvalidArgument(fmt::format(
          "{}=\"{}\" is not a rank or size (a non-negative integer); check the launcher's command line", name, value));
    }
    v = v * 10 + (c - '0');
  }
  return v;
}

Result<std::optional<int>> read_int(const GetEnv& getenv, const char* name) {
  if (name == nullptr) return std::optional<int>();
  std::optional<std::string> value = getenv(name);
  if (!value) return std::optional<int>();
  ASSIGN_OR_RETURN(int v, parse_int(name, *value));
  return std::optional<int>(v);
}

std::string get_or(const GetEnv& getenv, const char* name, std::string fallback = "") {
  std::optional<std::string> v = getenv(name);
  return v && !v->empty() ? *v : fallback;
}

// The launcher's numbers when its rank and size variables are both set; nullopt when not.
Result<std::optional<LaunchInfo>> read_launcher(const GetEnv& getenv, const Names& n) {
  ASSIGN_OR_RETURN(std::optional<int> rank, read_int(getenv, n.rank));
  ASSIGN_OR_RETURN(std::optional<int> size, read_int(getenv, n.size));
  if (!rank && !size) return std::optional<LaunchInfo>();
  if (!rank || !size) {
    return Status::InvalidArgument(
        fmt::format("{} is set but {} is not; a launcher sets both", rank ? n.rank : n.size, rank ? n.size : n.rank));
  }
  if (*size < 1) return Status::InvalidArgument(fmt::format("{}={} must be at least 1", n.size, *size));
  if (*rank >= *size) {
    return Status::InvalidArgument(
        fmt::format("{}={} is not below {}={} (ranks count from 0)", n.rank, *rank, n.size, *size));
  }
  ASSIGN_OR_RETURN(std::optional<int> local_rank, read_int(getenv, n.local_rank));
  ASSIGN_OR_RETURN(std::optional<int> local_size, read_int(getenv, n.local_size));
  LaunchInfo info;
  info.launcher = n.launcher;
  info.rank = *rank;
  info.world_size = *size;
  // Without the local numbers, assume one process per node.
  info.local_rank = local_rank.value_or(0);
  info.local_world_size = local_size.value_or(local_rank ? *local_rank + 1 : 1);
  if (local_size && *local_size < 1) {
    return Status::InvalidArgument(fmt::format("{}={} must be at least 1", n.local_size, *local_size));
  }
  if (info.local_rank >= info.local_world_size) {
    return Status::InvalidArgument(fmt::format("{}={} is not below {}={} (local ranks count from 0)", n.local_rank,
                                               info.local_rank, n.local_size, info.local_world_size));
  }
  if (info.local_world_size > info.world_size) {
    return Status::InvalidArgument(
        fmt::format("{}={} exceeds {}={}", n.local_size, info.local_world_size, n.size, info.world_size));
  }
  return std::optional<LaunchInfo>(std::move(info));
}

}  // namespace

Result<LaunchInfo> launch_from_env(const GetEnv& getenv) {
  ASSIGN_OR_RETURN(std::optional<LaunchInfo> torchrun,
                   read_launcher(getenv, {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}));
  if (torchrun) {
    std::string run_id = get_or(getenv, "TORCHELASTIC_RUN_ID");
    // torchrun's run id defaults to "none"; then the store's address names the job.
    torchrun->job_id = !run_id.empty() && run_id != "none"
                           ? run_id
                           : get_or(getenv, "MASTER_ADDR", "localhost") + ":" + get_or(getenv, "MASTER_PORT", "0");
    return *torchrun;
  }
  ASSIGN_OR_RETURN(std::optional<LaunchInfo> ompi,
                   read_launcher(getenv, {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}));
  if (ompi) {
    ompi->job_id = get_or(getenv, "OMPI_MCA_ess_base_jobid", get_or(getenv, "PMIX_NAMESPACE"));
    return *ompi;
  }
  ASSIGN_OR_RETURN(std::optional<LaunchInfo> pmi,
                   read_launcher(getenv, {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}));
  if (pmi) {
    pmi->job_id = get_or(getenv, "PMI_JOBID", get_or(getenv, "PMIX_NAMESPACE"));
    return *pmi;
  }
  ASSIGN_OR_RETURN(std::optional<LaunchInfo> slurm,
                   read_launcher(getenv, {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr}));
  if (slurm) {
    // SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; it may read "4" or "4(x2)".
    // Without it, SLURM_TASKS_PER_NODE ("4(x2)") serves when every node runs as many.
    const char* per_node_name = "SLURM_NTASKS_PER_NODE";
    std::string per_node = get_or(getenv, per_node_name);
    if (per_node.empty() && get_or(getenv, "SLURM_TASKS_PER_NODE").find(',') == std::string::npos) {
      per_node_name = "SLURM_TASKS_PER_NODE";
      per_node = get_or(getenv, per_node_name);
    }
    if (!per_node.empty()) {
      std::string head = per_node.substr(0, per_node.find_first_of("(,"));
      ASSIGN_OR_RETURN(int n, parse_int(per_node_name, head));
      if (n < 1 || slurm->local_rank >= n || n > slurm->world_size) {
        return Status::InvalidArgument(
            fmt::format("{}=\"{}\" does not fit SLURM_LOCALID={} and "
                        "SLURM_NTASKS={}",
                        per_node_name, per_node, slurm->local_rank, slurm->world_size));
      }
      slurm->local_world_size = n;
    }
    slurm->job_id = get_or(getenv, "SLURM_JOB_ID") + "." + get_or(getenv, "SLURM_STEP_ID", "0");
    return *slurm;
  }
  return LaunchInfo{};
}

Result<LaunchInfo> launch_from_env() {
  return launch_from_env([](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  });
}

}  // namespace strata::parallel
