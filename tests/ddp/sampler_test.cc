// DistributedSampler: PyTorch's partition of a dataset's indices.
#include "ddp/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "rpc/errors.h"

namespace tandem::test {
namespace {

using ddp::DistributedSampler;

std::vector<size_t> all_batches(DistributedSampler& s, size_t batch) {
  std::vector<size_t> got;
  while (auto b = s.next(batch)) got.insert(got.end(), b->begin(), b->end());
  return got;
}

TEST(UnitDistributedSampler, RanksSplitAnEvenDatasetWithoutOverlap) {
  std::multiset<size_t> seen;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s(20, 4, r, {.shuffle = true, .seed = 7});
    auto got = all_batches(s, 3);
    EXPECT_EQ(got.size(), 5u);
    EXPECT_EQ(s.size(), 5u);
    seen.insert(got.begin(), got.end());
  }
  std::multiset<size_t> expected;
  for (size_t i = 0; i < 20; ++i) expected.insert(i);
  EXPECT_EQ(seen, expected);
}

TEST(UnitDistributedSampler, PadsWithTheStartOrDropsTheTail) {
  // 10 samples on 3 ranks, no shuffle: padded to 12 with indices 0 and 1; rank r takes r, r+3, ...
  DistributedSampler padded(10, 3, 1, {.shuffle = false});
  EXPECT_EQ(padded.indices(), (std::vector<size_t>{1, 4, 7, 0}));
  DistributedSampler last(10, 3, 2, {.shuffle = false});
  EXPECT_EQ(last.indices(), (std::vector<size_t>{2, 5, 8, 1}));
  DistributedSampler dropped(10, 3, 1, {.shuffle = false, .drop_last = true});
  EXPECT_EQ(dropped.indices(), (std::vector<size_t>{1, 4, 7}));
  // Fewer samples than ranks: padding repeats the dataset.
  DistributedSampler tiny(2, 5, 4, {.shuffle = false});
  EXPECT_EQ(tiny.indices(), (std::vector<size_t>{0}));
}

TEST(UnitDistributedSampler, ShuffleIsTheSameOnEveryRankAndNewEachEpoch) {
  DistributedSampler a(100, 2, 0, {.seed = 3}), b(100, 2, 1, {.seed = 3});
  std::set<size_t> both(a.indices().begin(), a.indices().end());
  both.insert(b.indices().begin(), b.indices().end());
  EXPECT_EQ(both.size(), 100u);  // one permutation, split
  const auto epoch0 = a.indices();
  a.set_epoch(1);
  EXPECT_NE(a.indices(), epoch0);
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), epoch0);
  EXPECT_FALSE(std::is_sorted(epoch0.begin(), epoch0.end()));
}

TEST(UnitDistributedSampler, RejectsARankOutsideTheReplicas) {
  try {
    DistributedSampler(10, 2, 2);
    FAIL() << "rank 2 of 2 replicas accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument) << e.what();
  }
}

}  // namespace
}  // namespace tandem::test
