// launch_from_env over fake environments: each launcher's variables, the order they are tried
// in, and the bad values a misconfigured launcher can hand over.
#include "parallel/launch.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace strata::parallel {
namespace {

Result<LaunchInfo> launch(const std::map<std::string, std::string>& env) {
  return launch_from_env([&env](const char* name) -> std::optional<std::string> {
    auto it = env.find(name);
    return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  });
}

TEST(Launch, NoLauncherIsAWorldOfOne) {
  Result<LaunchInfo> info = launch({{"HOME", "/root"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 0);
  EXPECT_EQ(info->world_size, 1);
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->local_world_size, 1);
  EXPECT_EQ(info->launcher, "single");
  EXPECT_EQ(info->job_id, "");
}

TEST(Launch, Torchrun) {
  Result<LaunchInfo> info = launch({{"RANK", "5"},
                                    {"WORLD_SIZE", "8"},
                                    {"LOCAL_RANK", "1"},
                                    {"LOCAL_WORLD_SIZE", "4"},
                                    {"TORCHELASTIC_RUN_ID", "job42"},
                                    {"MASTER_ADDR", "node0"},
                                    {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 5);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->launcher, "torchrun");
  EXPECT_EQ(info->job_id, "job42");
}

TEST(Launch, TorchrunWithoutARunIdIsNamedByItsStoreAddress) {
  Result<LaunchInfo> info = launch({{"RANK", "0"},
                                    {"WORLD_SIZE", "2"},
                                    {"TORCHELASTIC_RUN_ID", "none"},
                                    {"MASTER_ADDR", "node0"},
                                    {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->job_id, "node0:29500");
  // No local numbers: one process per node.
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->local_world_size, 1);
}

TEST(Launch, OpenMpi) {
  Result<LaunchInfo> info = launch({{"OMPI_COMM_WORLD_RANK", "3"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                    {"PMIX_NAMESPACE", "prterun-host-1234@1"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 3);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->launcher, "mpirun");
  EXPECT_EQ(info->job_id, "prterun-host-1234@1");

  Result<LaunchInfo> older = launch({{"OMPI_COMM_WORLD_RANK", "0"},
                                     {"OMPI_COMM_WORLD_SIZE", "2"},
                                     {"OMPI_MCA_ess_base_jobid", "3735552001"},
                                     {"PMIX_NAMESPACE", "ignored"}});
  ASSERT_TRUE(older.ok()) << older.status().to_string();
  EXPECT_EQ(older->job_id, "3735552001");
}

TEST(Launch, GenericPmi) {
  Result<LaunchInfo> info = launch({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 2);
  EXPECT_EQ(info->world_size, 3);
  EXPECT_EQ(info->launcher, "pmi");
}

TEST(Launch, Slurm) {
  Result<LaunchInfo> info = launch({{"SLURM_PROCID", "6"},
                                    {"SLURM_NTASKS", "8"},
                                    {"SLURM_LOCALID", "2"},
                                    {"SLURM_NTASKS_PER_NODE", "4"},
                                    {"SLURM_JOB_ID", "991"},
                                    {"SLURM_STEP_ID", "3"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 6);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 2);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->launcher, "srun");
  EXPECT_EQ(info->job_id, "991.3");

  // Without --ntasks-per-node, a uniform SLURM_TASKS_PER_NODE serves.
  Result<LaunchInfo> uniform = launch({{"SLURM_PROCID", "1"},
                                       {"SLURM_NTASKS", "4"},
                                       {"SLURM_LOCALID", "1"},
                                       {"SLURM_TASKS_PER_NODE", "2(x2)"},
                                       {"SLURM_JOB_ID", "7"}});
  ASSERT_TRUE(uniform.ok()) << uniform.status().to_string();
  EXPECT_EQ(uniform->local_world_size, 2);
  EXPECT_EQ(uniform->job_id, "7.0");
}

TEST(Launch, TorchrunWinsOverTheSchedulerThatStartedIt) {
  // torchrun inside a Slurm allocation: the Slurm variables describe torchrun's own task.
  Result<LaunchInfo> info =
      launch({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "5"}});
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->launcher, "torchrun");
  EXPECT_EQ(info->rank, 1);
}

void expect_invalid(const std::map<std::string, std::string>& env, const std::string& needle) {
  Result<LaunchInfo> info = launch(env);
  ASSERT_FALSE(info.ok()) << "accepted an environment that should name " << needle;
  EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(info.status().message().find(needle), std::string::npos) << info.status().to_string();
}

TEST(Launch, BadValuesNameTheVariableAndItsValue) {
  expect_invalid({{"RANK", "one"}, {"WORLD_SIZE", "2"}}, "RANK=\"one\"");
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}, "WORLD_SIZE=\"2x\"");
  expect_invalid({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=\"-1\"");
  expect_invalid({{"RANK", ""}, {"WORLD_SIZE", "2"}}, "RANK=\"\"");
  expect_invalid({{"RANK", "99999999999999"}, {"WORLD_SIZE", "2"}}, "RANK=\"99999999999999\"");
  expect_invalid({{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is not below WORLD_SIZE=2");
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0");
  expect_invalid({{"RANK", "0"}}, "RANK is set but WORLD_SIZE is not");
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
                 "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  expect_invalid({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
                 "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4");
  expect_invalid({{"PMI_RANK", "x"}, {"PMI_SIZE", "2"}}, "PMI_RANK=\"x\"");
  expect_invalid({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"}, {"SLURM_NTASKS_PER_NODE", "2"}},
                 "SLURM_NTASKS_PER_NODE=\"2\"");
}

}  // namespace
}  // namespace strata::parallel
