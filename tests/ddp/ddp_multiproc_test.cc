// DistributedDataParallel across real processes: rank 0 is the test process; every rank runs the same scenario.
#include <gmock/gmock.h>

#include "tests/common/scenario_fixture.h"

namespace tandem::test {
namespace {

using MultiprocDdp = MultiprocScenario;

// DDP on W ranks with batch b follows one process with batch W·b step for step (parameters within 1e-5; the
// compression hooks within their precision), for every variant and W = 2 and 3.
class MultiprocDdpEquivalence : public MultiprocScenario, public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(MultiprocDdpEquivalence, FollowsOneProcessWithTheWholeBatch) {
  const auto& [variant, world] = GetParam();
  start({.world_size = world});
  EXPECT_EQ(everywhere(world, "equivalence/" + variant), "");
}

INSTANTIATE_TEST_SUITE_P(MultiprocDdp, MultiprocDdpEquivalence,
                         ::testing::Combine(::testing::Values("plain", "copy", "default_buckets", "no_sync", "unused",
                                                              "fp16", "bf16", "uneven", "zero"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_on_" + std::to_string(std::get<1>(info.param));
                         });

TEST_F(MultiprocDdp, BucketsFollowReverseOrderWithASmallFirstBucketAndAreRebuilt) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "buckets"), "");
}

TEST_F(MultiprocDdp, HybridWithDistributedAutogradFollowsOneProcess) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "hybrid"), "");
}

TEST_F(MultiprocDdp, AParameterWithoutGradientIsAnErrorNamingIt) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "missing_gradient"), "");
}

TEST_F(MultiprocDdp, DifferentModelsAreRefusedNamingTheRank) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "shape_mismatch"), "");
}

TEST_F(MultiprocDdp, BuffersAreRankZerosBeforeEachForward) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "buffers"), "");
}

TEST_F(MultiprocDdp, AKilledRankFailsTheNextIterationOnTheOthersWithinTheTimeout) {
  expect_last_rank_killed(3, "dead_rank");
}

}  // namespace
}  // namespace tandem::test
