#include "tandem/rpc/future.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace tandem::rpc {
namespace {

using std::chrono::milliseconds;

TEST(UnitFuture, CompletesOnceAndRunsCallbacksOnce) {
  Future f;
  std::atomic<int> calls{0};
  f.add_callback([&](const Future&) { ++calls; });
  EXPECT_FALSE(f.completed());
  EXPECT_TRUE(f.set_value(c10::IValue(int64_t{1})));
  EXPECT_FALSE(f.set_value(c10::IValue(int64_t{2})));
  EXPECT_FALSE(f.set_error(absl::InternalError("late")));
  f.add_callback([&](const Future&) { ++calls; });  // already completed: runs inline
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(f.get<int64_t>(), 1);
}

// A callback that throws (value() of a failed call, say) does not end the completing thread, and the callbacks after
// it still run, whether added before the completion or after it.
TEST(UnitFuture, ACallbackThatThrowsLeavesTheOthersRunning) {
  Future f;
  std::atomic<int> ran{0};
  f.add_callback([](const Future& self) { (void)self.value(); });
  f.add_callback([&](const Future&) { ++ran; });
  EXPECT_TRUE(f.set_error(absl::UnavailableError("peer gone")));
  EXPECT_EQ(ran.load(), 1);
  f.add_callback([](const Future&) { throw std::runtime_error("late"); });
  f.add_callback([&](const Future&) { ++ran; });
  EXPECT_EQ(ran.load(), 2);
}

TEST(UnitFuture, ErrorsThrowRpcErrorWithTheStatus) {
  Future f = Future::failed(absl::UnavailableError("peer gone"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable);
  try {
    f.value();
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kUnavailable);
    EXPECT_STREQ(e.what(), "UNAVAILABLE: peer gone");
  }
}

TEST(UnitFuture, ThenChainsValuesAndErrors) {
  Future f;
  Future doubled = f.then([](const Future& x) { return c10::IValue(x.get<int64_t>() * 2); });
  Future failed = doubled.then([](const Future&) -> c10::IValue { throw std::runtime_error("boom"); });
  Future after_fail = failed.then([](const Future& x) { return x.value(); });  // propagates the error
  f.set_value(c10::IValue(int64_t{21}));
  EXPECT_EQ(doubled.get<int64_t>(), 42);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(failed.status().message(), "boom");
  EXPECT_EQ(after_fail.status().message(), "boom");
}

TEST(UnitFuture, WaitsAreBounded) {
  Future f;
  EXPECT_FALSE(f.wait_for(milliseconds(20)));
  Future with_deadline(absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(with_deadline.status().code(), absl::StatusCode::kDeadlineExceeded);  // deadline + 2 s margin, then error
  EXPECT_EQ(with_deadline.status().message(), "future not completed before its deadline");
  // A future that says what it stands for names it when its wait runs out.
  Future named(absl::Now() + absl::Milliseconds(10), "process group 'g' (rank 1 of 2), allreduce of 16 bytes");
  EXPECT_EQ(named.status().message(),
            "process group 'g' (rank 1 of 2), allreduce of 16 bytes: not completed by its "
            "deadline");
  std::thread t([f] { f.set_value(c10::IValue(true)); });
  EXPECT_TRUE(f.wait_for(milliseconds(10000)));
  t.join();
}

}  // namespace
}  // namespace tandem::rpc
