// Collectives across real processes: rank 0 is the test process; every rank runs the same scenario.
#include <gmock/gmock.h>

#include "tests/common/scenario_fixture.h"

namespace tandem::test {
namespace {

using MultiprocComm = MultiprocScenario;

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

// Without debug mode too, over shared memory: another size, operation or dtype fails every rank at once.
TEST_F(MultiprocComm, SharedMemoryRanksThatCallDifferentCollectivesAllFailNamingTheFirst) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "shm_mismatch"), "");
}

TEST_F(MultiprocComm, ADeadRankIsAnErrorOnTheOthersWithinTheTimeout) { expect_last_rank_killed(3, "dead_rank"); }

TEST_F(MultiprocComm, ADeadRankIsAnErrorOnTheOthersOverGloo) { expect_last_rank_killed(3, "dead_rank_gloo"); }

// The shared-memory path (comm/detail/shm.h): chosen by default here, every rank on one host.
TEST_F(MultiprocComm, EveryCollectiveAndDtypeOverGlooOnThreeRanks) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "basic_gloo"), "");
}

TEST_F(MultiprocComm, EveryCollectiveAndDtypeOverSharedMemoryOnTwoRanks) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "basic_shm"), "");
}

TEST_F(MultiprocComm, SharedMemoryEqualsGlooOnTwoRanks) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "shm_equals_gloo"), "");
}

TEST_F(MultiprocComm, SharedMemoryEqualsGlooOnThreeRanks) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "shm_equals_gloo"), "");
}

TEST_F(MultiprocComm, SharedTensorsAllreduceInPlaceAsGlooDoesOnTwoRanks) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "shared_tensors"), "");
}

TEST_F(MultiprocComm, SharedTensorsAllreduceInPlaceAsGlooDoesOnThreeRanks) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "shared_tensors"), "");
}

TEST_F(MultiprocComm, SharedMemoryRemovesAStaleSegmentAndLeavesNone) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "stale_segment"), "");
}

TEST_F(MultiprocComm, SharedMemoryLateRankIsDeadlineExceededNamingIt) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "shm_late_rank"), "");
}

// Destroying a group with operations queued: they fail at once (CANCELLED), the destructor returns within a fraction
// of what running them takes, and the other rank's operations that need this one fail at once, naming it.
TEST_F(MultiprocComm, DestroyingAGroupCancelsItsQueuedOperationsOverSharedMemory) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "destroy_queued"), "");
}

TEST_F(MultiprocComm, DestroyingAGroupCancelsItsQueuedOperationsOverGloo) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "destroy_queued_gloo"), "");
}

// A rank destroys its group, with nothing queued, while the others already wait for it (over shared memory asleep on
// the segment's futex): the operation before passes everywhere, and each waiter fails soon after, naming that rank.
// On three ranks, each of the two waiters sees the destroyed rank itself.
TEST_F(MultiprocComm, DestroyingAGroupEndsTheOthersWaitsOverSharedMemory) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "destroy_while_waiting"), "");
}

TEST_F(MultiprocComm, DestroyingAGroupEndsTheOthersWaitsOverSharedMemoryOnThreeRanks) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "destroy_while_waiting"), "");
}

// A barrier the destroyed rank reached passes on the others, also on one asleep in it until after the destroy.
TEST_F(MultiprocComm, DestroyingAGroupLetsTheOthersPassABarrierItReached) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "destroy_after_arriving"), "");
}

TEST_F(MultiprocComm, DestroyingAGroupEndsTheOthersWaitsOverGloo) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "destroy_while_waiting_gloo"), "");
}

}  // namespace
}  // namespace tandem::test
