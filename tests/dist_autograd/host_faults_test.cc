// Distributed autograd across test hosts when a link is cut between the forward and the backward pass, and in the
// middle of the backward pass (tests/common/host_faults.h).
#include <ATen/ATen.h>
#include <gmock/gmock.h>

#include <future>
#include <thread>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tests/common/host_faults.h"

namespace tandem::test {
namespace {

// x -> worker2 -> worker1 -> here, then the backward pass, which goes to worker1 first: the link to worker1's host is
// cut before it starts (`mid` false) or while worker1 computes its part (`mid`: worker1's backward takes 1.5 s and
// the cut comes 0.5 s into the backward). (Were the cut further down the chain, the error would name the first worker
// that did not reply in time: each hop has the same timeout, so the caller's own deadline expires first.)
void backward_over_a_cut_link(HostFaults& t, bool mid) {
  t.start_on_hosts(milliseconds(3000));
  at::Tensor x = at::randn({3, 4}, at::kDouble).set_requires_grad(true);
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor h = rpc::rpc_sync<at::Tensor>("worker2", "layer", std::string("w2"), x);
    at::Tensor y =
        rpc::rpc_sync<at::Tensor>("worker1", "slow_backward_layer", std::string("w1"), int64_t{mid ? 1500 : 0}, h);
    if (!mid) host_fault("cut", 1);
    const auto t0 = Clock::now();
    // A future, not a thread: whatever the backward throws, it is waited for (and a failed cut reported), never a
    // joinable thread destroyed.
    std::future<void> cutter;
    if (mid) {
      cutter = std::async(std::launch::async, [] {
        std::this_thread::sleep_for(milliseconds(500));
        host_fault("cut", 1);
      });
    }
    try {
      dist_autograd::backward(ctx.id(), {y.sum()});
      ADD_FAILURE() << "a backward pass over a cut link succeeded";
    } catch (const RpcError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("worker 'worker1' (rank 1)"));
    }
    if (cutter.valid()) cutter.get();
    EXPECT_LT(HostFaults::since(t0), milliseconds(3000) + scaled(milliseconds(3000)));
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
  // The job still trains: a new context over the healed link works, once every connection that failed during the cut
  // is made again. (Over gRPC a channel whose connection attempt failed, as worker1's to rank 0 in the middle of the
  // backward, tries again after its reconnect backoff of at most 1 s, rpc/detail/net.cc, and fails calls at once with
  // UNAVAILABLE until then.)
  const auto healed_by = Clock::now() + scaled(milliseconds(20000));
  for (;;) {
    try {
      dist_autograd::ContextGuard again;
      at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "layer", std::string("w1"), x);
      dist_autograd::backward(again.id(), {y.sum()});
      EXPECT_TRUE(dist_autograd::get_gradients(again.id())[x].defined());
      break;
    } catch (const RpcError& e) {
      if (e.code() != absl::StatusCode::kUnavailable || Clock::now() > healed_by) {
        ADD_FAILURE() << "a backward over the healed link failed: " << e.what();
        break;
      }
    }
    std::this_thread::sleep_for(milliseconds(100));
  }
}

TEST_F(HostFaults, BackwardOverACutLinkFailsNamingTheWorkerAndLeavesNoContext) {
  backward_over_a_cut_link(*this, /*mid=*/false);
}

TEST_F(HostFaults, ALinkCutMidBackwardFailsNamingTheWorkerAndLeavesNoContext) {
  backward_over_a_cut_link(*this, /*mid=*/true);
}

}  // namespace
}  // namespace tandem::test
