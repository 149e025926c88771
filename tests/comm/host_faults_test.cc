// Collectives across test hosts when a link is cut in the middle of an allreduce (tests/common/host_faults.h).
#include "tests/common/host_faults.h"

namespace tandem::test {
namespace {

TEST_F(HostFaults, LinkCutMidAllreduceFailsEveryRankWithinTheGroupsTimeout) {
  start_on_hosts(milliseconds(30000));
  EXPECT_EQ(everywhere(3, "cut_link"), "");
}

// Gloo bounds each wait, not a whole operation: one that outlives its future's deadline (a slow link) breaks the group.
TEST_F(HostFaults, AGlooOperationThatEndsAfterItsDeadlineBreaksTheGroup) {
  start_on_hosts(milliseconds(30000));
  EXPECT_EQ(everywhere(3, "late_gloo_op"), "");
}

}  // namespace
}  // namespace tandem::test
