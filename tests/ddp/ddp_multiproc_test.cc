// DistributedDataParallel across real processes: rank 0 is the test process; every rank runs the same scenario.
#include <gmock/gmock.h>

#include "tests/common/scenario_fixture.h"

namespace tandem::test {
namespace {

using MultiprocDdp = MultiprocScenario;

// DDP on W ranks with batch b follows one process with batch W·b step for step (parameters within 1e-5; the
// compression hooks within their precision), for every variant and W = 2 and 3.
class MultiprocDdpEquivalence : public MultiprocScenario,
                                public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

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

// Gradient accumulation with find_unused_parameters (issue 11, pytorch#69031): random windows of no_sync and
// synchronised micro-steps, branches used by random ranks (only under no_sync, only on one rank, never); four seeds per
// test. Both gradient modes bit-identical; gradients and parameters equal one process's within 1e-5 after every
// window, locally, under distributed autograd (hybrid) and with uneven inputs and join().
class MultiprocDdpAccumulation : public MultiprocScenario,
                                 public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(MultiprocDdpAccumulation, RandomNoSyncWindowsFollowOneProcessInBothGradientModes) {
  const auto& [mode, world] = GetParam();
  start({.world_size = world});
  EXPECT_EQ(everywhere(world, "accumulation/" + mode + "/1,2,3,4"), "");
}

INSTANTIATE_TEST_SUITE_P(MultiprocDdp, MultiprocDdpAccumulation,
                         ::testing::Combine(::testing::Values("local", "hybrid", "uneven", "hybrid_uneven"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_on_" + std::to_string(std::get<1>(info.param));
                         });

// The reported case: rank 0 uses a branch in a no_sync micro-step, no rank in the synchronised one that follows. Every
// rank must end with that branch's averaged gradient (g/2), defined, in both gradient modes.
TEST_F(MultiprocDdp, ABranchUsedOnlyUnderNoSyncOnOneRankIsAveragedOnEveryRank) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "accumulation/issue11"), "");
}

TEST_F(MultiprocDdp, BucketsFollowReverseOrderWithASmallFirstBucketAndAreRebuilt) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "buckets"), "");
}

// Hybrid DDP + RPC under distributed autograd: every bucket's reduction starts during dist_autograd::backward (the
// reducer's counter, not timing), and training follows one process; default and small buckets.
TEST_F(MultiprocDdp, HybridWithDistributedAutogradOverlapsAndFollowsOneProcess) {
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "hybrid/default"), "");
  EXPECT_EQ(everywhere(3, "hybrid/small"), "");
}

// A distributed backward of an abandoned iteration that runs after the next forward: its graph's taps do not land
// gradients in the new iteration's buckets, which reduces and steps as one process would.
TEST_F(MultiprocDdp, HybridBackwardOfAnAbandonedIterationDoesNotLandInTheNextOne) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "stale_tap"), "");
}

// Two forwards under one context before its backward: an error naming a parameter, not an average of one graph's
// gradients.
TEST_F(MultiprocDdp, HybridTwoForwardsUnderOneContextAreAnError) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "two_forwards_one_context"), "");
}

// A DDP model's two heads sent to two workers (ranks 2 and 3): each trainer's distributed backward brings the context's
// gradients in two messages that its RPC threads run at once. The test holds them so that one message's taps run while
// the other's launch of bucket 0 (its comm hook) is inside the reducer; the taps must wait for it (Reducer::tap_mu:
// before e3a0849 they went through, racing on the buckets' counts and the launch order), and the averaged gradients
// equal one process's over three steps.
TEST_F(MultiprocDdp, HybridOutputsSentToTwoWorkersReachTheReducerOneMessageAtATime) {
  start({.world_size = 4});
  EXPECT_EQ(everywhere(4, "hybrid_two_workers"), "");
}

// The tutorial's layout: an embedding table on a parameter server (rank 2), DDP trainers (ranks 0 and 1) under
// distributed autograd; dense and embedding parameters follow one process with the whole batch after every step, with
// default and small buckets, and with uneven inputs and join().
TEST_F(MultiprocDdp, HybridEmbeddingAndDenseFollowOneProcess) {
  start({.world_size = 3});
  for (const char* spec : {"default/even", "small/even", "small/uneven", "default/uneven"}) {
    EXPECT_EQ(everywhere(3, std::string("hybrid_embedding/") + spec), "") << spec;
  }
}

// A killed parameter server or trainer: the surviving trainer's next step fails within the timeout, naming it.
TEST_F(MultiprocDdp, HybridKilledParameterServerIsAnErrorNamingIt) { expect_last_rank_killed(3, "hybrid_killed/ps"); }

TEST_F(MultiprocDdp, HybridKilledTrainerIsAnErrorNamingIt) {
  start({.world_size = 3});
  expect_clean_children_ = false;
  const auto t0 = Clock::now();
  EXPECT_EQ(everywhere(3, "hybrid_killed/trainer", {1}), "");
  EXPECT_LT(Clock::now() - t0, scaled(milliseconds(30000)));
  rpc::shutdown(false);
  EXPECT_EQ(job_->wait_children(milliseconds(30000))[0], 9);
}

TEST_F(MultiprocDdp, AParameterWithoutGradientIsAnErrorNamingIt) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "missing_gradient"), "");
}

TEST_F(MultiprocDdp, AThrowingCommHookFailsTheBackwardNamingTheBucketAndGroup) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "hook_throws"), "");
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
