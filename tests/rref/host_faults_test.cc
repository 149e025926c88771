// RRefs across test hosts when a link is cut in the middle of a fetch (tests/common/host_faults.h).
#include <ATen/ATen.h>
#include <gmock/gmock.h>

#include <future>
#include <thread>

#include "tandem/rref/rref.h"
#include "tests/common/host_faults.h"

namespace tandem::test {
namespace {

TEST_F(HostFaults, LinkCutMidFetchFailsAtItsDeadlineAndLeavesNoReferenceBehind) {
  start_on_hosts(milliseconds(3000));
  {
    // 64 MiB owned by worker1, whose outgoing link is slowed to 200 Mbit/s: the fetch takes about 3 s, so the cut
    // lands in the middle of the transfer.
    rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{16} << 20);
    host_fault("rate", 1, "200mbit");
    auto fetch = std::async(std::launch::async, [&] { return r.to_here(milliseconds(3000)); });
    std::this_thread::sleep_for(milliseconds(500));
    host_fault("cut", 1);
    const auto t0 = Clock::now();
    try {
      fetch.get();
      FAIL() << "the fetch over a cut link succeeded";
    } catch (const RpcError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
      EXPECT_TRUE(e.code() == absl::StatusCode::kDeadlineExceeded || e.code() == absl::StatusCode::kUnavailable)
          << e.what();
    }
    EXPECT_LT(since(t0), milliseconds(3000) + scaled(milliseconds(2000)));
    EXPECT_EQ(rpc::rpc_sync<std::string>("worker2", "whoami"), "worker2");
  }  // the user reference is dropped while the owner is unreachable
  host_fault("heal", 1);
  host_fault("rate", 1, "off");
  // Once the link is back, the owner learns of the deletion: no rank holds anything.
  const auto deadline = Clock::now() + scaled(milliseconds(30000));
  std::vector<int64_t> counts;
  bool zero = false;
  while (!zero && Clock::now() < deadline) {
    zero = true;
    for (int rank = 0; rank < 3; ++rank) {
      auto s = rpc::rpc_async(rank, "rref_stats", milliseconds(3000));
      if (!s.status().ok()) {
        zero = false;
        continue;
      }
      for (int64_t v : s.value().toIntVector()) zero &= v == 0;
    }
    if (!zero) std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_TRUE(zero) << "RRefs left behind after the partition healed";
}

}  // namespace
}  // namespace tandem::test
