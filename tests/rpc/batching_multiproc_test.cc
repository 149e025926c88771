// Batched functions (rpc/batching.h) across processes: "batched_sum" on worker1 runs once per batch of up to 3
// requests or after 200 ms (tests/rpc/main.cc).
#include <gmock/gmock.h>

#include <thread>

#include "rpc/batching.h"
#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

using Reply = std::tuple<int64_t, int64_t>;  // the batch's sum, its size

std::vector<int64_t> stats(const std::string& on) {
  return rpc::rpc_sync<std::vector<int64_t>>(on, "batch_stats", std::string("batched_sum"));
}

TEST_F(MultiprocRpc, BatchedFunctionAnswersAFullBatchFromOneCall) {
  start({.world_size = 2});
  std::vector<rpc::Future> calls;
  for (int64_t x : {1, 2, 3}) calls.push_back(rpc::rpc_async("worker1", "batched_sum", x));
  for (auto& f : calls) EXPECT_EQ(f.get<Reply>(), (Reply{6, 3}));
  EXPECT_EQ(stats("worker1"), (std::vector<int64_t>{1, 3, 1}));  // one batch, three requests, run because it was full
}

TEST_F(MultiprocRpc, BatchedFunctionDoesNotWaitForALateCallerBeyondItsDelay) {
  start({.world_size = 2});
  const auto t0 = Clock::now();
  auto a = rpc::rpc_async("worker1", "batched_sum", int64_t{1});
  auto b = rpc::rpc_async("worker1", "batched_sum", int64_t{2});
  EXPECT_EQ(a.get<Reply>(), (Reply{3, 2}));  // the third caller never came: the batch ran after 200 ms
  EXPECT_EQ(b.get<Reply>(), (Reply{3, 2}));
  EXPECT_GE(Clock::now() - t0, milliseconds(190));
  EXPECT_EQ(rpc::rpc_sync<Reply>("worker1", "batched_sum", int64_t{5}), (Reply{5, 1}));  // the late one, alone
  EXPECT_EQ(stats("worker1"), (std::vector<int64_t>{2, 3, 0}));
}

TEST_F(MultiprocRpc, BatchedFunctionThatThrowsFailsEveryRequestOfItsBatch) {
  start({.world_size = 2});
  std::vector<rpc::Future> calls;
  for (int64_t x : {1, -2, 3}) calls.push_back(rpc::rpc_async("worker1", "batched_sum", x));
  for (auto& f : calls) {
    absl::Status s = f.status();
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()),
                ::testing::HasSubstr("batched function 'batched_sum' threw: negative request"));
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("worker1"));
  }
  EXPECT_EQ(rpc::rpc_sync<Reply>("worker1", "batched_sum", int64_t{4}), (Reply{4, 1}));  // and keeps serving
}

TEST_F(MultiprocRpc, BatchedFunctionServesTheOthersWhenACallerDies) {
  start({.world_size = 3});
  expect_clean_children_ = false;
  rpc::rpc_sync("worker2", "batched_call_and_die", int64_t{1});  // worker2's request waits on worker1; worker2 dies
  std::this_thread::sleep_for(milliseconds(100));
  auto a = rpc::rpc_async("worker1", "batched_sum", int64_t{1});
  auto b = rpc::rpc_async("worker1", "batched_sum", int64_t{2});
  // Either the dead caller's request joined this batch (answered into the void), or it ran alone at its delay.
  EXPECT_THAT(a.get<Reply>(), ::testing::AnyOf(Reply{103, 3}, Reply{3, 2}));
  EXPECT_EQ(a.get<Reply>(), b.get<Reply>());
  EXPECT_EQ(rpc::rpc_sync<Reply>("worker1", "batched_sum", int64_t{7}), (Reply{7, 1}));
  rpc::shutdown(false);
  EXPECT_EQ(job_->wait_children(milliseconds(30000))[1], 9);
}

TEST(UnitRpcBatching, BadOptionsAndNamesAreRefused) {
  EXPECT_EQ(rpc::register_batched_handler("unit_batched", {.max_batch = 0}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rpc::set_max_batch("no_such_batched", 2).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(rpc::register_batched_handler("batched_sum", {}, nullptr).code(), absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace tandem::test
