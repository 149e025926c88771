// Fully sharded data parallelism across real processes: rank 0 is the test process; every rank runs the same scenario.
#include <gtest/gtest.h>

#include <filesystem>

#include "tandem/fsdp/fsdp.h"
#include "tandem/rpc/errors.h"
#include "tests/common/multiproc.h"
#include "tests/common/scenario_fixture.h"

namespace tandem::test {
namespace {

using MultiprocFsdp = MultiprocScenario;

// W ranks, each on its rows, follow one process that sums the ranks' losses over W (float64, Adam or SGD, 3 steps):
// every loss and parameter within 1e-10. The model has units of uneven sizes (117, 310, 373, 42 parameters), a
// nested Sequential unit, a unit with a parameter used on rank 0 only and one used nowhere, and parameterless layers.
class MultiprocFsdpEquivalence : public MultiprocScenario,
                                 public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(MultiprocFsdpEquivalence, FollowsOneProcess) {
  const auto& [variant, world] = GetParam();
  start({.world_size = world});
  EXPECT_EQ(everywhere(world, "equivalence/" + variant), "");
}

INSTANTIATE_TEST_SUITE_P(MultiprocFsdp, MultiprocFsdpEquivalence,
                         ::testing::Combine(::testing::Values("reshard", "keep", "no_prefetch", "lean", "no_sync",
                                                              "sync_off_late", "sgd", "zero2"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_on_" + std::to_string(std::get<1>(info.param));
                         });

// Units the user names (fsdp::Unit) in a model of its own type, one nested in another, one taking two tensors, the
// root's own parameters outside every Unit: W ranks follow one process running the same architecture without Units
// (1e-10, 3 steps of Adam or SGD; two forwards before a backward; a backward inside the forward); Unit(Linear)s write
// their gradients into their buffers; misuse is refused, naming why, and leaves the model usable.
class MultiprocFsdpNamedUnits : public MultiprocScenario,
                                public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(MultiprocFsdpNamedUnits, FollowOneProcess) {
  const auto& [variant, world] = GetParam();
  start({.world_size = world});
  EXPECT_EQ(everywhere(world, "units/" + variant), "");
}

INSTANTIATE_TEST_SUITE_P(MultiprocFsdp, MultiprocFsdpNamedUnits,
                         ::testing::Combine(::testing::Values("reshard", "keep", "lean", "no_sync", "zero2", "sgd",
                                                              "twice", "grad_inside", "eval_between"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_on_" + std::to_string(std::get<1>(info.param));
                         });

// Mixed precision over float32 shards (bfloat16 gathers, computation and reductions; float16 reductions) on 2 ranks:
// within what the low precision explains of the float64 reference, and not within float32 rounding of it.
TEST_F(MultiprocFsdp, MixedPrecisionComputesAndReducesInTheLowDtype) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "mixed/bf16"), "");
  EXPECT_EQ(everywhere(2, "mixed/reduce_fp16"), "");
  EXPECT_EQ(everywhere(2, "mixed/fp32"), "");  // the control: float32 throughout stays within its rounding
}

// A model whose unsharded state does not fit a per-process cap trains fully sharded on 3 ranks within it (a real
// memory cgroup per rank; each rank prints its peak).
TEST_F(MultiprocFsdp, AModelWhoseStateExceedsTheCapTrainsShardedWithinIt) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's shadow memory and quarantine are charged to the cap";
#endif
  start({.world_size = 3});
  EXPECT_EQ(everywhere(3, "memory"), "");
}

// Checkpoints, sharded and full: a pair of ranks resumes bit-exact from its sharded one; 3 ranks resume from its full
// one; the shards consolidated in one process and a plain Sequential loading the full one equal the pair's model.
TEST_F(MultiprocFsdp, CheckpointsResumeShardedAndFullAndLoadIntoAPlainModule) {
  start({.world_size = 3});
  const TempDir temp;
  const std::string& dir = temp.path();
  EXPECT_EQ(everywhere(3, "checkpoints|" + dir), "");
}

// A rank that dies makes the others' next step fail within the group's timeout, naming the group and the operation:
// between steps (their forward's gather fails) and after its forward (their backward's collectives fail).
TEST_F(MultiprocFsdp, AKilledRankBetweenStepsFailsTheOthersNextForward) {
  expect_last_rank_killed(3, "killed/between");
}
TEST_F(MultiprocFsdp, AKilledRankBeforeItsBackwardFailsTheOthersBackward) {
  expect_last_rank_killed(3, "killed/backward");
}

// A unit whose collective failed keeps its buffer (UnitState::written_late): a failed operation may still write into
// it, so it is never released by resizing; it goes with its storage. Rank 1 leaves after the forward and rank 0's
// backward fails: when the model is destroyed ("overlap": a prefetched gather and an in-place reduction failed) and
// when the next forward drops the failed backward's reduction ("lean"), the units' buffers hold their bytes. Before
// 4b9ed1c both released them. Rank 0's backward fails at once: rank 1 destroyed its group (comm/process_group.h);
// until then it waited for the group's whole timeout, so each variant has a test of its own.
TEST_F(MultiprocFsdp, AUnitWhoseOverlappedCollectiveFailedKeepsItsBuffer) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "failed_collective/overlap"), "");
}
TEST_F(MultiprocFsdp, AUnitWhoseCollectiveFailedKeepsItsBufferInALeanModel) {
  start({.world_size = 2});
  EXPECT_EQ(everywhere(2, "failed_collective/lean"), "");
}

// consolidate() refuses dicts that do not make one whole parameter, with the message naming what is wrong, before
// allocating anything: pieces of another parameter, overlapping pieces, pieces that leave a gap.
std::string consolidate_error(const std::vector<fsdp::FullyShardedDataParallel::ShardedStateDict>& ranks) {
  try {
    fsdp::FullyShardedDataParallel::consolidate(ranks);
    return "";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument) << e.what();
    return e.what();
  }
}

TEST(UnitFsdpConsolidate, RefusesPiecesThatDoNotMakeTheWhole) {
  using Dict = fsdp::FullyShardedDataParallel::ShardedStateDict;
  auto piece = [](std::string name, int64_t offset, int64_t n) {
    return fsdp::FullyShardedDataParallel::Piece{
        std::move(name), {2, 3}, offset, at::arange(offset, offset + n, at::kFloat)};
  };
  const Dict a{2, 0, {piece("w", 0, 3)}, {}};
  const Dict b{2, 1, {piece("w", 3, 3)}, {}};
  const auto whole = fsdp::FullyShardedDataParallel::consolidate({b, a});
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_TRUE(whole[0].second.equal(at::arange(6, at::kFloat).view({2, 3})));
  // A rank may hold an empty piece (a parameter smaller than the ranks), at any offset: it overlaps nothing.
  const Dict all{3, 0, {piece("w", 0, 6)}, {}};
  const auto again = fsdp::FullyShardedDataParallel::consolidate(
      {all, Dict{3, 1, {piece("w", 4, 0)}, {}}, Dict{3, 2, {piece("w", 6, 0)}, {}}});
  EXPECT_TRUE(again[0].second.equal(at::arange(6, at::kFloat).view({2, 3})));

  EXPECT_NE(consolidate_error({a, Dict{2, 1, {piece("v", 3, 3)}, {}}}).find("rank 1's piece 0 ('v') does not fit"),
            std::string::npos);
  // A piece of another model, even one that would also leave the sizes wrong, is named as not fitting.
  EXPECT_NE(consolidate_error({a, Dict{2, 1, {piece("v", 3, 2)}, {}}}).find("('v') does not fit"), std::string::npos);
  EXPECT_NE(consolidate_error({a, Dict{2, 1, {piece("w", 2, 3)}, {}}}).find("overlaps another rank's"),
            std::string::npos);
  EXPECT_NE(consolidate_error({a, Dict{2, 1, {piece("w", 4, 2)}, {}}}).find("hold 5 elements; its shape"),
            std::string::npos);
  EXPECT_NE(consolidate_error({a, Dict{2, 0, {piece("w", 3, 3)}, {}}}).find("given twice"), std::string::npos);
}

}  // namespace
}  // namespace tandem::test
