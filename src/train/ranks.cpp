#include "train/ranks.h"

#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/log.h"
#include "train/planning.h"
#if STRATA_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace strata {

namespace fs = std::filesystem;

std::string rendezvous_dir(const TrainConfig& t, const parallel::LaunchInfo& launch) {
  const std::string base = t.parallel_rendezvous.empty() ? "/tmp/strata-rendezvous" : t.parallel_rendezvous;
  // A job id names a folder: anything but letters, digits, '.', '-' and '_' becomes '_'.
  std::string id = launch.job_id.empty() ? "default" : launch.job_id;
  for (char& c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
  return (fs::path(base) / id).string();
}

Result<Ranks> connect_ranks(TrainConfig& t) {
  Ranks ranks;
  ASSIGN_OR_RETURN(ranks.launch, parallel::launch_from_env());
  if (ranks.launch.world_size % t.parallel_expert != 0)
    return Status::InvalidArgument(fmt::format(
        "parallel.expert_parallel={} must divide the number of ranks, {}{}: launch a multiple of it, or lower it",
        t.parallel_expert, ranks.launch.world_size, ranks.several() ? "" : " (this process was started alone)"));
  if (ranks.launch.world_size % t.parallel_context != 0)
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={} must divide the number of ranks, {}{}: launch a multiple of it, or lower it",
        t.parallel_context, ranks.launch.world_size, ranks.several() ? "" : " (this process was started alone)"));
  if (!ranks.several()) {
    if (t.plan_world_size > 1)
      LOG_WARN("parallel.world_size={} is what strata plan plans for; strata train runs as the processes a launcher "
               "starts (torchrun, mpirun, srun): this one is alone",
               t.plan_world_size);
    return ranks;
  }
  const parallel::LaunchInfo& l = ranks.launch;
  ProcessIdentity id = process_identity();
  id.rank = l.rank;
  id.world_size = l.world_size;
  set_process_identity(id);
  // From here on lines carry the rank, and only rank 0 logs below warnings.
  LogOptions lo;
  if (!parse_log_level(t.log_level, &lo.level)) lo.level = LogLevel::kInfo;
  init_logging(lo);
  // One GPU per process, by local rank; a node's host memory shared by its ranks.
  t.cuda_device = l.local_rank;
  t.dp_rank = l.rank;
  t.dp_world = l.world_size;
  if (t.memory_host == 0 && l.local_world_size > 1) t.memory_host = default_host_budget() / l.local_world_size;
  // The node's cores shared by its ranks: OpenMP threads that outnumber them spin while a
  // collective waits and starve the other ranks (steps 50 times slower on two cores).
  if (std::getenv("OMP_NUM_THREADS") == nullptr && l.local_world_size > 1) {
    const int threads = std::max(1, omp_get_num_procs() / l.local_world_size);
    omp_set_num_threads(threads);
    LOG_INFO("parallel: {} CPU threads per rank ({} cores, {} ranks on this node; OMP_NUM_THREADS overrides)", threads,
             omp_get_num_procs(), l.local_world_size);
  }
  // auto: NCCL where the steps may run on a GPU (run.device=cuda, or auto with one visible; a
  // CPU engine's host buffers then go through NCCL's Gloo bootstrap), Gloo otherwise.
  bool gpu = false;
#if STRATA_HAVE_CUDA
  gpu = t.device != "cpu" && cuda_device_count() > 0;
#endif
  parallel::CommOptions co;
  co.backend = t.parallel_backend == "auto" ? (gpu ? "nccl" : "gloo") : t.parallel_backend;
  co.rendezvous_dir = rendezvous_dir(t, l);
  co.name = "train";
  co.timeout = std::chrono::milliseconds(static_cast<int64_t>(t.parallel_timeout_s * 1000));
#if STRATA_HAVE_CUDA
  // NCCL's communicator works on the calling thread's current GPU: this rank's.
  if (co.backend == "nccl") RETURN_IF_ERROR(cuda_use_device(l.local_rank));
#endif
  std::error_code ec;
  fs::create_directories(co.rendezvous_dir, ec);
  if (ec)
    return Status::IOError(fmt::format("cannot create the rendezvous folder '{}' (parallel.rendezvous): {}",
                                       co.rendezvous_dir, ec.message()));
  LOG_INFO("parallel: rank {} of {} ({}; local rank {} of {}), {} through {}", l.rank, l.world_size, l.launcher,
           l.local_rank, l.local_world_size, co.backend, co.rendezvous_dir);
  Result<std::unique_ptr<parallel::Comm>> comm = parallel::connect(l, co);
  if (!comm.ok())
    return comm.status().with_context(fmt::format("rank {} of {} could not reach the others through '{}' "
                                                  "(parallel.rendezvous; every rank must see the same folder)",
                                                  l.rank, l.world_size, co.rendezvous_dir));
  ranks.comm = std::move(*comm);
  co.name = "ckpt";
  Result<std::unique_ptr<parallel::Comm>> ckpt = parallel::connect(l, co);
  if (!ckpt.ok()) return ckpt.status().with_context("connecting the checkpoint writers of the ranks");
  ranks.ckpt_comm = std::move(*ckpt);
  if (t.parallel_overlap_comm) {
    co.name = "grad";
    Result<std::unique_ptr<parallel::Comm>> grad = parallel::connect(l, co);
    if (!grad.ok()) return grad.status().with_context("connecting the ranks' gradient sums (parallel.overlap_comm)");
    ranks.grad_comm = std::move(*grad);
  }
  // A Comm over some of the ranks (`members`, world ranks in its rank order): this rank's place
  // among them, and how many of them share its node (launchers number the ranks node by node),
  // which decides whether it listens on the loopback or on an address other nodes reach.
  auto sub_launch = [&l](const std::vector<int>& members) {
    parallel::LaunchInfo sub = l;
    sub.world_size = static_cast<int>(members.size());
    sub.local_world_size = 0;
    sub.local_rank = 0;
    const int node = l.rank / std::max(l.local_world_size, 1);
    for (size_t k = 0; k < members.size(); ++k) {
      if (members[k] == l.rank) sub.rank = static_cast<int>(k);
      if (members[k] / std::max(l.local_world_size, 1) != node) continue;
      if (members[k] < l.rank) ++sub.local_rank;
      ++sub.local_world_size;
    }
    return sub;
  };
  if (t.parallel_context > 1) {
    // The context group: consecutive ranks, so that the ring's neighbours share a node where
    // they can.
    const int N = static_cast<int>(t.parallel_context);
    std::vector<int> group;
    for (int q = l.rank / N * N; q < l.rank / N * N + N; ++q) group.push_back(q);
    co.name = fmt::format("context-{}", l.rank / N);
    Result<std::unique_ptr<parallel::Comm>> context = parallel::connect(sub_launch(group), co);
    if (!context.ok())
      return context.status().with_context(
          fmt::format("connecting context group {} (ranks {} to {}, parallel.context_parallel={})", l.rank / N,
                      l.rank / N * N, l.rank / N * N + N - 1, N));
    ranks.context_comm = std::move(*context);
  }
  if (t.parallel_expert > 1) {
    const int P = static_cast<int>(t.parallel_expert);
    // The expert group: consecutive ranks, as one node's GPUs are, so that the all-to-all of
    // routed tokens stays within a node where it can.
    std::vector<int> group, holders;
    for (int q = l.rank / P * P; q < l.rank / P * P + P; ++q) group.push_back(q);
    for (int q = l.rank % P; q < l.world_size; q += P) holders.push_back(q);
    co.name = fmt::format("experts-{}", l.rank / P);
    Result<std::unique_ptr<parallel::Comm>> experts = parallel::connect(sub_launch(group), co);
    if (!experts.ok())
      return experts.status().with_context(
          fmt::format("connecting expert group {} (ranks {} to {}, parallel.expert_parallel={})", l.rank / P,
                      l.rank / P * P, l.rank / P * P + P - 1, P));
    ranks.expert_comm = std::move(*experts);
    // The ranks at this rank's place in their groups, which hold the same experts.
    auto connect_holders = [&](const std::string& name) -> Result<std::unique_ptr<parallel::Comm>> {
      if (holders.size() == 1) return parallel::make_local_comm();
      co.name = fmt::format("{}-{}", name, l.rank % P);
      Result<std::unique_ptr<parallel::Comm>> held = parallel::connect(sub_launch(holders), co);
      if (!held.ok())
        return held.status().with_context(fmt::format("connecting the ranks that hold expert group place {}'s experts",
                                                      l.rank % P));
      return held;
    };
    ASSIGN_OR_RETURN(ranks.expert_holders, connect_holders("expert-holders"));
    if (t.parallel_overlap_comm) {
      ASSIGN_OR_RETURN(ranks.grad_expert_holders, connect_holders("grad-expert-holders"));
    }
  }
  return ranks;
}

namespace {

// Rank 0's text on every rank.
Status broadcast_text(parallel::Comm& comm, std::string* text) {
  uint64_t size = text->size();
  RETURN_IF_ERROR(comm.broadcast(&size, sizeof(size), 0));
  text->resize(size);
  if (size > 0) RETURN_IF_ERROR(comm.broadcast(text->data(), size, 0));
  return Status::OK();
}

}  // namespace

Status share_run_dirs(parallel::Comm& comm, const Status& status, TrainConfig& t) {
  std::string text;
  if (comm.rank() == 0) {
    nlohmann::json j = {{"ok", status.ok()},
                        {"message", status.ok() ? "" : status.message()},
                        {"run_dir", t.run_dir},
                        {"ckpt_dir", t.ckpt_dir},
                        {"nvme_path", t.nvme_path},
                        {"resume", t.resume}};
    text = j.dump();
  }
  RETURN_IF_ERROR(broadcast_text(comm, &text).with_context("sharing rank 0's run folders"));
  if (comm.rank() == 0) return status;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  CHECK_MSG(!j.is_discarded() && j.is_object(), "rank 0 sent no run folders");
  if (!j["ok"].get<bool>())
    return Status::InvalidArgument("rank 0 could not start the run: " + j["message"].get<std::string>());
  t.run_dir = j["run_dir"].get<std::string>();
  t.ckpt_dir = j["ckpt_dir"].get<std::string>();
  t.nvme_path = j["nvme_path"].get<std::string>();
  t.resume = j["resume"].get<std::string>();
  return Status::OK();
}

Status agree_all_ok(parallel::Comm& comm, const Status& own, const std::string& what) {
  std::vector<double> failed(static_cast<size_t>(comm.world_size()), 0.0);
  failed[static_cast<size_t>(comm.rank())] = own.ok() ? 0.0 : 1.0;
  RETURN_IF_ERROR(parallel::sum_over_ranks(comm, std::span<double>(failed)));
  if (!own.ok()) return own;
  std::string which;
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
  if (which.empty()) return Status::OK();
  return Status::IOError(fmt::format("rank {} failed {} (its log says why); this rank stops too", which, what));
}

void retire_rendezvous(Ranks& ranks, const TrainConfig& t) {
  if (Status all_done = ranks.comm->barrier(); !all_done.ok()) {
    LOG_WARN("parallel: {}", all_done.message());
    return;
  }
  if (!ranks.writes()) return;
  std::error_code ec;
  const std::string dir = rendezvous_dir(t, ranks.launch);
  fs::remove_all(dir, ec);
  if (ec) LOG_WARN("parallel: cannot remove the rendezvous folder {}: {}", dir, ec.message());
}

Result<bool> any_rank(parallel::Comm& comm, bool value) {
  ASSIGN_OR_RETURN(double sum, parallel::sum_over_ranks(comm, value ? 1.0 : 0.0));
  return sum > 0;
}

Result<int> fewest_over_ranks(parallel::Comm& comm, int value, int most) {
  CHECK(value >= 1 && value <= most);
  // How many ranks have each value: the smallest with any.
  std::vector<double> votes(static_cast<size_t>(most), 0.0);
  votes[static_cast<size_t>(value - 1)] = 1.0;
  RETURN_IF_ERROR(parallel::sum_over_ranks(comm, std::span<double>(votes)));
  for (size_t v = 0; v < votes.size(); ++v)
    if (votes[v] > 0) return static_cast<int>(v) + 1;
  return value;
}

Result<std::map<std::string, ckpt::FileRecord>> exchange_shard_files(parallel::Comm& comm, const Status& own,
                                                                    const std::map<std::string, ckpt::FileRecord>& files) {
  nlohmann::json mine = {{"ok", own.ok()}, {"message", own.ok() ? "" : own.message()}, {"files", nlohmann::json::object()}};
  for (const auto& [name, rec] : files) mine["files"][name] = {{"size", rec.size}, {"xxh3", rec.xxh3}};
  const std::string text = mine.dump();
  // Every rank's text, padded to the longest.
  const size_t world = static_cast<size_t>(comm.world_size());
  uint64_t size = text.size();
  std::vector<uint64_t> sizes(world);
  RETURN_IF_ERROR(comm.all_gather(&size, sizes.data(), sizeof(size)));
  const uint64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::string padded = text;
  padded.resize(longest, ' ');
  std::string all(longest * world, ' ');
  RETURN_IF_ERROR(comm.all_gather(padded.data(), all.data(), longest));
  std::map<std::string, ckpt::FileRecord> merged;
  std::string failed;
  for (size_t r = 0; r < world; ++r) {
    const nlohmann::json j = nlohmann::json::parse(all.substr(r * longest, sizes[r]), nullptr, false);
    CHECK_MSG(!j.is_discarded(), "rank " + std::to_string(r) + " sent no checkpoint outcome");
    if (!j["ok"].get<bool>()) {
      failed += fmt::format("{}rank {}: {}", failed.empty() ? "" : "; ", r, j["message"].get<std::string>());
      continue;
    }
    for (auto it = j["files"].begin(); it != j["files"].end(); ++it)
      merged[it.key()] = ckpt::FileRecord{(*it)["size"].get<uint64_t>(), (*it)["xxh3"].get<uint64_t>()};
  }
  if (!failed.empty()) return Status::IOError("the checkpoint was not committed: " + failed);
  if (comm.rank() != 0) merged.clear();
  return merged;
}

}  // namespace strata
