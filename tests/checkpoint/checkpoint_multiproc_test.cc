// Checkpoints across real processes: every rank resumes from the same step, the newest that all of them have intact;
// a ZeroRedundancyOptimizer's shards resume bit-exact.
#include <filesystem>

#include "tests/common/multiproc.h"
#include "tests/common/scenario_fixture.h"

namespace tandem::test {
namespace {

using MultiprocCheckpoint = MultiprocScenario;

TEST_F(MultiprocCheckpoint, RanksAgreeOnTheNewestStepEveryRankHasIntact) {
  start({.world_size = 3});
  const TempDir temp;
  const std::string& dir = temp.path();
  EXPECT_EQ(everywhere(3, "agree|" + dir + "|1"), "");
}

TEST_F(MultiprocCheckpoint, AGrownJobFailsNamingTheRanksWithoutFilesInsteadOfStartingAfresh) {
  start({.world_size = 3});
  const TempDir temp;
  const std::string& dir = temp.path();
  EXPECT_EQ(everywhere(3, "grown|" + dir), "");
}

TEST_F(MultiprocCheckpoint, RanksWithoutACommonIntactStepFailInsteadOfStartingAfresh) {
  start({.world_size = 2});
  const TempDir temp;
  const std::string& dir = temp.path();
  EXPECT_EQ(everywhere(2, "no-common|" + dir), "");
}

TEST_F(MultiprocCheckpoint, ZeroShardsResumeBitExact) {
  start({.world_size = 2});
  const TempDir temp;
  const std::string& dir = temp.path();
  EXPECT_EQ(everywhere(2, "zero|" + dir), "");
}

TEST_F(MultiprocCheckpoint, ConsolidatedZeroResumesAtAnotherWorldSize) {
  start({.world_size = 3});
  const TempDir temp;
  const std::string& dir = temp.path();
  EXPECT_EQ(everywhere(3, "zero-consolidated|" + dir), "");
}

}  // namespace
}  // namespace tandem::test
