// Collectives across real processes: rank 0 is the test process; every rank runs the same scenario.
#include <gmock/gmock.h>

#include "tests/comm/scenarios.h"
#include "tests/rpc/rpc_fixture.h"

namespace tandem::test {
namespace {

class MultiprocComm : public MultiprocRpc {
 protected:
  // Starts `scenario` on every other rank, runs it here, and returns each rank's report ("rank r: ..." for failures).
  static std::string everywhere(int world, const std::string& scenario, const std::vector<int>& skip_ranks = {}) {
    std::vector<std::pair<int, rpc::Future>> others;
    for (int r = 1; r < world; ++r) others.emplace_back(r, rpc::rpc_async(r, "scenario", scenario));
    std::string report;
    if (auto mine = run_scenario(scenario); !mine.empty()) report += "rank 0: " + mine + "\n";
    for (auto& [r, f] : others) {
      if (std::find(skip_ranks.begin(), skip_ranks.end(), r) != skip_ranks.end()) continue;
      auto s = f.status();
      if (!s.ok()) {
        report += "rank " + std::to_string(r) + ": " + std::string(s.message()) + "\n";
      } else if (auto e = f.get<std::string>(); !e.empty()) {
        report += "rank " + std::to_string(r) + ": " + e + "\n";
      }
    }
    return report;
  }
};

TEST_F(MultiprocComm, EveryCollectiveAndDtypeOnTwoRanks) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "basic"), "");
}

TEST_F(MultiprocComm, EveryCollectiveAndDtypeOnThreeRanks) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "basic"), "");
}

TEST_F(MultiprocComm, SubgroupOfTwoOutOfThree) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "subgroup"), "");
}

TEST_F(MultiprocComm, ARecvWithoutASendFailsWithinTheTimeoutNamingThePeer) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "p2p_timeout"), "");
}

TEST_F(MultiprocComm, DebugModeReportsTheFirstMismatchingRankOnEveryRank) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "mismatch"), "");
}

TEST_F(MultiprocComm, ADeadRankIsAnErrorOnTheOthersWithinTheTimeout) {
  start({.world_size = 3});
  expect_clean_children_ = false;
  const auto t0 = Clock::now();
  EXPECT_EQ(everywhere(3, "dead_rank", {2}), "");
  EXPECT_LT(Clock::now() - t0, milliseconds(30000));
  rpc::shutdown(false);
  auto codes = job_->wait_children(milliseconds(30000));
  EXPECT_EQ(codes.back(), 9);
}

}  // namespace
}  // namespace tandem::test
