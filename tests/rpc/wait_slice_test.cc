// A thread that sleeps waiting for a reply asks the kernel for a short time slice (rpc/detail/wait_slice.h), so that
// it runs at once when its reply comes instead of queueing behind a busy thread. Unit tests of the rule, and the
// two waits that use it: rpc_sync's sleep on its reply and a Future's wait.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <thread>

#include "tandem/rpc/detail/sched_attr.h"
#include "tandem/rpc/detail/thread_pool.h"
#include "tandem/rpc/detail/wait_slice.h"
#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

namespace detail = rpc::detail;
using std::chrono::microseconds;

using Attr = detail::SchedAttr;

// The calling thread's policy, nice value and slice (ns; 0 on a kernel without custom slices).
Attr my_attr() {
  Attr a{};
  EXPECT_TRUE(detail::get_sched_attr(&a));
  return a;
}

// Puts the calling thread back on the kernel's default slice (a new thread inherits its creator's, and the test's
// main thread may have been given the short one).
void use_default_slice() {
  Attr a{};
  a.sched_nice = my_attr().sched_nice;
  ASSERT_TRUE(detail::set_sched_attr(a));
}

// Runs `body` on a new thread on the default slice (as a thread never given the short one) and returns its
// attributes afterwards.
template <typename F>
Attr on_fresh_thread(F body) {
  Attr out{};
  std::thread([&] {
    use_default_slice();
    body();
    out = my_attr();
  }).join();
  return out;
}

// False also where sched_getattr/sched_setattr are not allowed (a sandbox's seccomp filter): the tests skip there.
bool kernel_has_custom_slices() {
  bool has = false;
  std::thread([&] {
    Attr a{};
    if (!detail::get_sched_attr(&a) || a.sched_policy != SCHED_OTHER) return;
    Attr want{};
    want.sched_nice = a.sched_nice;
    has = detail::set_sched_attr(want) && detail::get_sched_attr(&a) && a.sched_runtime > 0;
  }).join();
  return has;
}

constexpr uint64_t kShort = 100'000;  // ns

class UnitWaitSlice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kernel_has_custom_slices()) GTEST_SKIP() << "this kernel has no custom slices (Linux < 6.12)";
    default_ = on_fresh_thread([] {}).sched_runtime;
    ASSERT_GT(default_, kShort) << "the kernel's default slice is as short as the one asked for";
  }
  void TearDown() override { detail::set_wait_slice(microseconds(0)); }
  uint64_t default_ = 0;
};

TEST_F(UnitWaitSlice, AThreadGetsTheSliceOnceAndKeepsItsNiceValue) {
  detail::set_wait_slice(microseconds(100));
  const int64_t before = detail::prompt_wake_threads();
  const Attr a = on_fresh_thread([] {
    ASSERT_EQ(setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 4), 0);
    detail::prefer_prompt_wake();
    detail::prefer_prompt_wake();  // once per thread
  });
  EXPECT_EQ(a.sched_runtime, kShort);
  EXPECT_EQ(a.sched_nice, 4);
  EXPECT_EQ(a.sched_policy, static_cast<uint32_t>(SCHED_OTHER));
  EXPECT_EQ(detail::prompt_wake_threads(), before + 1);
}

TEST_F(UnitWaitSlice, NothingChangesWithoutASliceOrForOtherPolicies) {
  detail::set_wait_slice(microseconds(0));
  EXPECT_EQ(on_fresh_thread([] { detail::prefer_prompt_wake(); }).sched_runtime, default_);
  detail::set_wait_slice(microseconds(100));
  const Attr batch = on_fresh_thread([] {
    sched_param p{};
    ASSERT_EQ(sched_setscheduler(0, SCHED_BATCH, &p), 0);
    detail::prefer_prompt_wake();
  });
  EXPECT_EQ(batch.sched_policy, static_cast<uint32_t>(SCHED_BATCH));
  EXPECT_EQ(batch.sched_runtime, default_);
}

// Threads a short-sliced thread starts inherit its slice; the pool threads that run RPC's functions drop it, and do
// not take it when they wait for a reply either (their functions compute).
TEST_F(UnitWaitSlice, RpcPoolThreadsDropTheSliceTheyInherited) {
  detail::set_wait_slice(microseconds(100));
  Attr inherited{}, pooled{}, after_wait{};
  on_fresh_thread([&] {
    detail::prefer_prompt_wake();
    std::thread([&] { inherited = my_attr(); }).join();
    detail::ThreadPool pool(1);
    Notification ran;
    pool.submit([&] {
      pooled = my_attr();
      detail::prefer_prompt_wake();  // as a nested rpc_sync that sleeps would
      after_wait = my_attr();
      ran.Notify();
    });
    ran.WaitForNotification();
  });
  EXPECT_EQ(inherited.sched_runtime, kShort);
  EXPECT_EQ(pooled.sched_runtime, default_);
  EXPECT_EQ(after_wait.sched_runtime, default_);
}

// The kernel clamps a slice to 0.1 ms at least; a pool thread still knows the slice it inherited as the one given,
// also when RPC was shut down since (the slice set to 0) and started again.
TEST_F(UnitWaitSlice, ASliceBelowTheKernelsMinimumIsClampedAndDroppedByLaterPools) {
  detail::set_wait_slice(microseconds(50));
  Attr given{}, pooled{};
  on_fresh_thread([&] {
    detail::prefer_prompt_wake();
    given = my_attr();
    detail::set_wait_slice(microseconds(0));  // as shutdown does
    detail::ThreadPool pool(1);
    Notification ran;
    pool.submit([&] {
      pooled = my_attr();
      ran.Notify();
    });
    ran.WaitForNotification();
  });
  EXPECT_EQ(given.sched_runtime, kShort);
  EXPECT_EQ(pooled.sched_runtime, default_);
}

TEST_F(UnitWaitSlice, AThreadWithAShorterSliceOfItsOwnKeepsIt) {
  detail::set_wait_slice(microseconds(500));
  const int64_t before = detail::prompt_wake_threads();
  const Attr a = on_fresh_thread([] {
    Attr want{};
    want.sched_runtime = 200'000;
    ASSERT_TRUE(detail::set_sched_attr(want));
    detail::prefer_prompt_wake();
  });
  EXPECT_EQ(a.sched_runtime, 200'000u);
  EXPECT_EQ(detail::prompt_wake_threads(), before);
}

// rpc_sync that sleeps on its reply (the spin is over: the callee takes 50 ms), and a Future's wait.
TEST_F(MultiprocRpc, AThreadThatSleepsOnAReplyIsGivenTheShortSlice) {
  if (!kernel_has_custom_slices()) GTEST_SKIP() << "this kernel has no custom slices (Linux < 6.12)";
  start({.world_size = 2});  // RpcOptions::wait_slice: 100 us by default
  const uint64_t fallback = on_fresh_thread([] {}).sched_runtime;
  ASSERT_GT(fallback, kShort);
  EXPECT_EQ(on_fresh_thread([] { rpc::rpc_sync("worker1", "sleep_ms", int64_t{50}); }).sched_runtime, kShort);
  EXPECT_EQ(on_fresh_thread([] {
              ASSERT_TRUE(rpc::rpc_async("worker1", "sleep_ms", int64_t{50}).status().ok());
            }).sched_runtime,
            kShort);
  // A thread that never waited keeps the kernel's slice.
  EXPECT_EQ(on_fresh_thread([] { rpc::rpc_async("worker1", "sleep_ms", int64_t{1}); }).sched_runtime, fallback);
}

TEST_F(MultiprocRpc, WaitSliceZeroLeavesTheThreadsAlone) {
  if (!kernel_has_custom_slices()) GTEST_SKIP() << "this kernel has no custom slices (Linux < 6.12)";
  rpc::RpcOptions options = options_from_env();
  options.wait_slice = microseconds(0);
  start({.world_size = 2}, options);
  const uint64_t fallback = on_fresh_thread([] {}).sched_runtime;
  EXPECT_EQ(on_fresh_thread([] { rpc::rpc_sync("worker1", "sleep_ms", int64_t{50}); }).sched_runtime, fallback);
  EXPECT_EQ(on_fresh_thread([] {
              ASSERT_TRUE(rpc::rpc_async("worker1", "sleep_ms", int64_t{50}).status().ok());
            }).sched_runtime,
            fallback);
}

}  // namespace
}  // namespace tandem::test
