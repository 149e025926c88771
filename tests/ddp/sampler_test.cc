// DistributedSampler: PyTorch's partition of a dataset's indices.
#include "tandem/ddp/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <sstream>

#include <torch/serialize.h>

#include "tandem/rpc/errors.h"

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

// What a sampler saved, loaded into a fresh one of `replicas` ranks at `rank`.
DistributedSampler reloaded(const DistributedSampler& saved, size_t n, int replicas, int rank) {
  torch::serialize::OutputArchive out;
  saved.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  DistributedSampler s(n, replicas, rank, {.shuffle = true, .seed = 3});
  s.load(in);
  return s;
}

TEST(UnitDistributedSampler, ReloadedAtTheSameWorldSizeItCarriesOnExactly) {
  DistributedSampler s(50, 2, 1, {.shuffle = true, .seed = 3});
  s.set_epoch(4);
  (void)s.next(7);
  DistributedSampler copy = reloaded(s, 50, 2, 1);
  EXPECT_EQ(all_batches(copy, 5), all_batches(s, 5));
}

TEST(UnitDistributedSampler, ReloadedByAnotherWorldSizeTheRanksShareWhatWasLeftOfTheEpoch) {
  // Two ranks consume 4 batches of 3 each (24 of 60), then the job re-forms with three, then with two again.
  std::multiset<size_t> seen;
  std::vector<DistributedSampler> two;
  for (int r = 0; r < 2; ++r) {
    two.emplace_back(60, 2, r, ddp::SamplerOptions{.shuffle = true, .seed = 3});
    two.back().set_epoch(2);
    for (int b = 0; b < 4; ++b) {
      auto got = two.back().next(3);
      seen.insert(got->begin(), got->end());
    }
  }
  std::vector<DistributedSampler> three;
  for (int r = 0; r < 3; ++r) {
    three.push_back(reloaded(two[0], 60, 3, r));  // rank 0's state: the same on every rank of a DDP job
    EXPECT_EQ(three.back().size(), 12u);          // (60 - 24) / 3
    auto got = three.back().next(5);              // 5 of each rank's 12
    seen.insert(got->begin(), got->end());
  }
  for (int r = 0; r < 2; ++r) {
    DistributedSampler again = reloaded(three[0], 60, 2, r);
    auto rest = all_batches(again, 4);
    EXPECT_EQ(rest.size(), 11u);  // 60 - 24 - 15 = 21 left: 11 per rank, with one index repeated as padding
    seen.insert(rest.begin(), rest.end());
  }
  // Every index of the epoch once, and the one padding repeat of the last split.
  std::set<size_t> distinct(seen.begin(), seen.end());
  EXPECT_EQ(distinct.size(), 60u);
  EXPECT_EQ(seen.size(), 61u);
}

}  // namespace
}  // namespace tandem::test
