// tandem-run: the torchrun environment, output prefixes, and failure propagation, with real processes.
#include <gtest/gtest.h>

#include "tests/common/multiproc.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;

TEST(MultiprocLauncher, SetsTorchrunEnvironmentAndPrefixesOutput) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "env_dump"}, {});
  ASSERT_EQ(exit_code(p.wait(milliseconds(30000))), 0) << p.output();
  const std::string out = p.output();
  for (const char* line : {"[rank0]: RANK=0", "[rank1]: RANK=1", "[rank1]: LOCAL_RANK=1", "[rank0]: WORLD_SIZE=2",
                           "[rank1]: LOCAL_WORLD_SIZE=2", "[rank0]: MASTER_ADDR=127.0.0.1", "[rank1]: SECRET_SET=1"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << " missing in:\n" << out;
  }
}

TEST(MultiprocLauncher, MultiNodeNeedsASharedSecret) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--master-port", "1",
             self_exe(), "--worker", "env_dump"},
            {{"TANDEM_SECRET", ""}});
  EXPECT_EQ(exit_code(p.wait(milliseconds(30000))), 2);
  EXPECT_NE(p.output().find("needs the same secret"), std::string::npos) << p.output();
}

TEST(MultiprocLauncher, OneFailingRankStopsTheJob) {
  const auto t0 = std::chrono::steady_clock::now();
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "3", self_exe(), "--worker", "fail_if_rank1"}, {});
  EXPECT_EQ(exit_code(p.wait(milliseconds(40000))), 3) << p.output();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));  // the other ranks sleep for 60 s
  const std::string out = p.output();
  EXPECT_NE(out.find("[rank1]: rank 1 gives up"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem-run: rank 1 (pid"), std::string::npos) << out;
  EXPECT_NE(out.find("failed with exit code 3"), std::string::npos) << out;
}

TEST(MultiprocLauncher, RunsAnRpcJob) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "3", self_exe(), "--worker", "hello"}, {});
  ASSERT_EQ(exit_code(p.wait(milliseconds(60000))), 0) << p.output();
  const std::string out = p.output();
  EXPECT_NE(out.find("[rank0]: worker1 answered worker0"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank2]: worker0 answered worker2"), std::string::npos) << out;
}

}  // namespace
}  // namespace tandem::test
