// A process's place in a job from torchrun's, SLURM's and Kubeflow's variables (cluster/environment.h).
#include "tandem/cluster/environment.h"

#include <gtest/gtest.h>

namespace tandem::cluster {
namespace {

TEST(UnitCluster, FirstHostOfASlurmNodeList) {
  EXPECT_EQ(*first_host("vm"), "vm");
  EXPECT_EQ(*first_host("node[07-09,12],gpu1"), "node07");
  EXPECT_EQ(*first_host("a1,b2"), "a1");
  EXPECT_EQ(*first_host("rack[2-3]-node[010-011]"), "rack2-node010");
  EXPECT_EQ(*first_host("node[5]"), "node5");
  for (const char* bad : {"", "node[", "node[x]", "node[1-2", "[1-2]]", ",node"}) {
    auto h = first_host(bad);
    EXPECT_FALSE(h.ok()) << bad << " -> " << *h;
    if (!h.ok()) EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(UnitCluster, TorchrunVariablesComeFirst) {
  auto p = worker_place({{"RANK", "3"},
                         {"WORLD_SIZE", "4"},
                         {"LOCAL_RANK", "1"},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "10.0.0.1"},
                         {"MASTER_PORT", "29500"},
                         {"SLURM_PROCID", "0"}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->source, "torchrun");
  EXPECT_EQ(p->rank, 3);
  EXPECT_EQ(p->world_size, 4);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->local_world_size, 2);
  EXPECT_EQ(p->master_addr, "10.0.0.1");
  EXPECT_EQ(p->master_port, 29500);
  EXPECT_FALSE(worker_place({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).ok());
  auto bad = worker_place({{"RANK", "0"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("WORLD_SIZE"), std::string::npos) << bad.status();
}

TEST(UnitCluster, AMalformedLocalVariableIsAnErrorNamingIt) {
  const Env base = {{"RANK", "1"}, {"WORLD_SIZE", "4"}};
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{{"LOCAL_RANK", "x"},
                                                                                    {"LOCAL_RANK", "4"},
                                                                                    {"LOCAL_RANK", "-1"},
                                                                                    {"LOCAL_WORLD_SIZE", "0"},
                                                                                    {"LOCAL_WORLD_SIZE", "two"},
                                                                                    {"LOCAL_WORLD_SIZE", "5"}}) {
    Env env = base;
    env[name] = value;
    auto p = worker_place(env);
    ASSERT_FALSE(p.ok()) << name << "=" << value << " gave local rank " << p->local_rank << " of "
                         << p->local_world_size;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(name), std::string::npos) << p.status();
  }
  // Unset: one node holds every rank.
  auto p = worker_place(base);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->local_world_size, 4);
  // SLURM_NNODES, when there is no tasks-per-node count, is read the same way.
  auto slurm = worker_place({{"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "4"},
                             {"SLURM_LOCALID", "0"},
                             {"SLURM_NNODES", "zero"},
                             {"MASTER_ADDR", "h"},
                             {"MASTER_PORT", "1234"}});
  ASSERT_FALSE(slurm.ok());
  EXPECT_NE(slurm.status().message().find("SLURM_NNODES"), std::string::npos) << slurm.status();
}

TEST(UnitCluster, SrunTasksFindRankWorldAndMaster) {
  const Env slurm = {{"SLURM_PROCID", "4"},
                     {"SLURM_NTASKS", "6"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NNODES", "2"},
                     {"SLURM_NTASKS_PER_NODE", "3(x2)"},
                     {"SLURM_JOB_NODELIST", "gpu[12-13]"},
                     {"SLURM_JOB_ID", "4711234"}};
  auto p = worker_place(slurm);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->source, "slurm");
  EXPECT_EQ(p->rank, 4);
  EXPECT_EQ(p->world_size, 6);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->local_world_size, 3);
  EXPECT_EQ(p->master_addr, "gpu12");
  EXPECT_EQ(p->master_port, 15000 + 1234);  // PyTorch Lightning's rule: the job id's last four digits
  Env overridden = slurm;
  overridden["MASTER_ADDR"] = "login1";
  overridden["MASTER_PORT"] = "23456";
  overridden["SLURM_STEP_NODELIST"] = "gpu13";
  p = worker_place(overridden);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->master_addr, "login1");
  EXPECT_EQ(p->master_port, 23456);
  Env step = slurm;
  step["SLURM_STEP_NODELIST"] = "gpu13";  // a step on part of the allocation: its own first node
  EXPECT_EQ(worker_place(step)->master_addr, "gpu13");
  Env federated = slurm;
  federated["SLURM_JOB_ID"] = "4026531841";  // a federation's job id: above 2^31 (it was refused as no job id)
  auto f = worker_place(federated);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->master_port, 15000 + 1841);
  Env broken = slurm;
  broken["SLURM_JOB_ID"] = "-3";
  EXPECT_FALSE(worker_place(broken).ok());
  broken.erase("SLURM_JOB_ID");
  auto b = worker_place(broken);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("SLURM_JOB_ID"), std::string::npos) << b.status();
  auto none = worker_place(Env{});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("SLURM_PROCID"), std::string::npos) << none.status();
}

TEST(UnitCluster, LauncherUnderSrunIsOneNodeOfTheTasks) {
  auto n = node_place(
      {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[3-4]"}, {"SLURM_JOB_ID", "77"}});
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->source, "slurm");
  EXPECT_EQ(*n->nnodes, "2");
  EXPECT_EQ(*n->node_rank, 1);
  EXPECT_EQ(*n->master_addr, "n3");
  EXPECT_EQ(*n->master_port, 15077);
}

TEST(UnitCluster, LauncherInAPyTorchJobPod) {
  auto n = node_place({{"KUBERNETES_SERVICE_HOST", "10.96.0.1"},
                       {"WORLD_SIZE", "3"},
                       {"RANK", "2"},
                       {"MASTER_ADDR", "job-master-0"},
                       {"MASTER_PORT", "23456"}});
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->source, "kubernetes");
  EXPECT_EQ(*n->nnodes, "3");
  EXPECT_EQ(*n->node_rank, 2);
  EXPECT_EQ(*n->master_addr, "job-master-0");
  EXPECT_EQ(*n->master_port, 23456);
  // The same variables outside a pod are a worker's (torchrun's), not a node's: they say nothing to a launcher.
  auto outside = node_place({{"WORLD_SIZE", "3"}, {"RANK", "2"}});
  ASSERT_TRUE(outside.ok());
  EXPECT_EQ(outside->source, "");
  EXPECT_FALSE(outside->nnodes.has_value());
}

TEST(UnitCluster, PetVariablesAreTorchrunsFlagDefaults) {
  const Env env = {{"PET_NNODES", "1:4"}, {"PET_RDZV_ENDPOINT", "job-worker-0:23456"}, {"PET_MAX_RESTARTS", ""}};
  EXPECT_EQ(*pet_default("--nnodes", env), "1:4");
  EXPECT_EQ(*pet_default("--rdzv-endpoint", env), "job-worker-0:23456");
  EXPECT_FALSE(pet_default("--max-restarts", env).has_value());  // empty is unset
  EXPECT_FALSE(pet_default("--node-rank", env).has_value());
}

}  // namespace
}  // namespace tandem::cluster
