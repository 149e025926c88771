// Distributed autograd across test hosts when a link is cut between the forward and the backward pass
// (tests/common/host_faults.h).
#include <ATen/ATen.h>
#include <gmock/gmock.h>

#include <thread>

#include "dist_autograd/dist_autograd.h"
#include "tests/common/host_faults.h"

namespace tandem::test {
namespace {

TEST_F(HostFaults, BackwardOverACutLinkFailsNamingTheWorkerAndLeavesNoContext) {
  start_on_hosts(milliseconds(3000));
  at::Tensor x = at::randn({3, 4}, at::kDouble).set_requires_grad(true);
  {
    dist_autograd::ContextGuard ctx;
    // x -> worker2 -> worker1 -> here: the backward pass goes to worker1 first, over the cut link. (Were the cut
    // further down the chain, the error would name the first worker that did not reply in time: each hop has the
    // same timeout, so the caller's own deadline expires first.)
    at::Tensor h = rpc::rpc_sync<at::Tensor>("worker2", "layer", std::string("w2"), x);
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "layer", std::string("w1"), h);
    host_fault("cut", 1);
    const auto t0 = Clock::now();
    try {
      dist_autograd::backward(ctx.id(), {y.sum()});
      FAIL() << "a backward pass over a cut link succeeded";
    } catch (const RpcError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("worker 'worker1' (rank 1)"));
    }
    EXPECT_LT(since(t0), milliseconds(3000) + scaled(milliseconds(3000)));
  }
  host_fault("heal", 1);
  // Every rank's part of the failed context is released once the link is back.
  const auto deadline = Clock::now() + scaled(milliseconds(30000));
  bool none = false;
  while (!none && Clock::now() < deadline) {
    none = true;
    for (int rank = 0; rank < 3; ++rank) {
      auto n = rpc::rpc_async(rank, "contexts", milliseconds(3000));
      none &= n.status().ok() && n.value().toInt() == 0;
    }
    if (!none) std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_TRUE(none) << "distributed autograd contexts left behind after the partition healed";
  // The job still trains: a new context over the healed link works.
  dist_autograd::ContextGuard again;
  at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "layer", std::string("w1"), x);
  dist_autograd::backward(again.id(), {y.sum()});
  EXPECT_TRUE(dist_autograd::get_gradients(again.id())[x].defined());
}

}  // namespace
}  // namespace tandem::test
