// The stage workers' mailbox (pipeline/detail/p2p.h), in one process: matching, duplicates, the ends of a step.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <future>
#include <thread>

#include "tandem/pipeline/detail/p2p.h"
#include "tests/common/time_scale.h"
#include "tests/pipeline/fresh_pipe.h"

namespace tandem::pipeline::detail {
namespace {

using std::chrono::milliseconds;

// Each test uses pipeline ids of its own (fresh_pipe()): the mailbox is the process's.
MailKey key(int64_t pipe, int64_t step, int mb, bool grad = false) { return MailKey{pipe, step, 1, mb, grad}; }

Clock::time_point in(milliseconds ms) { return Clock::now() + ms; }

TEST(UnitPipelineMailbox, ADuplicateDeliveryIsDroppedAndTheFirstStands) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  box.put(key(pipe, 0, 0), at::full({1}, 1.0));
  box.put(key(pipe, 0, 0), at::full({1}, 2.0));  // the same message again (a retried send)
  auto got = box.take(key(pipe, 0, 0), in(milliseconds(100)), "m0");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->toTensor().item<double>(), 1.0);
  box.put(key(pipe, 0, 0), at::full({1}, 3.0));  // once more after it was taken: not kept for ever
  auto again = box.take(key(pipe, 0, 0), in(milliseconds(50)), "m0 again");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDeadlineExceeded) << again.status();
  box.finish(pipe, 0);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineMailbox, AReceiveIsWokenByItsOwnMessageAndAnotherKeepsWaiting) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  auto first = std::async(std::launch::async,
                          [&] { return box.take(key(pipe, 0, 0), in(test::scaled(milliseconds(10000))), "m0"); });
  auto second = std::async(
      std::launch::async, [&] { return box.take(key(pipe, 0, 1, true), in(test::scaled(milliseconds(10000))), "g1"); });
  ASSERT_TRUE(await_waiting(box, key(pipe, 0, 0), Mailbox::Waiting::kAlone));
  ASSERT_TRUE(await_waiting(box, key(pipe, 0, 1, true), Mailbox::Waiting::kAlone));
  box.put(key(pipe, 0, 0), at::full({1}, 7.0));
  ASSERT_EQ(first.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  auto a = first.get();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->toTensor().item<double>(), 7.0);
  EXPECT_EQ(second.wait_for(milliseconds(100)), std::future_status::timeout);
  box.put(key(pipe, 0, 1, true), at::full({1}, 8.0));
  ASSERT_EQ(second.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  auto b = second.get();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->toTensor().item<double>(), 8.0);
  box.finish(pipe, 0);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineMailbox, AnAbandonedStepEndsItsWaitsWithTheReasonAndDropsWhatComesLater) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  box.put(key(pipe, 4, 1), at::ones({1}));  // here already: goes with the step
  auto waiting = std::async(std::launch::async, [&] {
    return box.take(key(pipe, 4, 0), in(test::scaled(milliseconds(10000))), "the activation from stage 0");
  });
  ASSERT_TRUE(await_waiting(box, key(pipe, 4, 0), Mailbox::Waiting::kAlone));
  box.abort(pipe, 4, absl::UnavailableError("worker 'w2' is gone"));
  ASSERT_EQ(waiting.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  auto got = waiting.get();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(got.status().message().find("abandoned while waiting for the activation from stage 0: worker 'w2' is gone"),
            std::string::npos)
      << got.status();
  box.put(key(pipe, 4, 2), at::ones({1}));
  EXPECT_EQ(box.held(), 0u);
  EXPECT_TRUE(box.aborted(pipe, 4));
  // The next step is not affected.
  box.put(key(pipe, 5, 0), at::ones({1}));
  EXPECT_TRUE(box.take(key(pipe, 5, 0), in(milliseconds(100)), "m0").ok());
  box.finish(pipe, 5);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineMailbox, WhatArrivesAfterItsStepEndedIsDropped) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  box.put(key(pipe, 0, 0), at::ones({1}));
  ASSERT_TRUE(box.take(key(pipe, 0, 0), in(milliseconds(100)), "m0").ok());
  box.finish(pipe, 0);
  box.put(key(pipe, 0, 1), at::ones({1}));
  EXPECT_EQ(box.held(), 0u);
  auto late = box.take(key(pipe, 0, 1), in(milliseconds(100)), "m1");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
}

TEST(UnitPipelineMailbox, AReleasedPipelineEndsItsWaitsAndKeepsNothing) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  box.put(key(pipe, 0, 1), at::ones({1}));
  auto waiting = std::async(std::launch::async,
                            [&] { return box.take(key(pipe, 0, 0), in(test::scaled(milliseconds(10000))), "m0"); });
  ASSERT_TRUE(await_waiting(box, key(pipe, 0, 0), Mailbox::Waiting::kAlone));
  box.release(pipe);
  ASSERT_EQ(waiting.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  EXPECT_EQ(waiting.get().status().code(), absl::StatusCode::kAborted);
  box.put(key(pipe, 1, 0), at::ones({1}));
  EXPECT_EQ(box.held(), 0u);
}

// A step the driver started without a call whose go was not taken before the step was abandoned here (delivered
// before the abandon or after it) is kept, with the reason, for the executor to answer the driver with.
TEST(UnitPipelineMailbox, AGoNotTakenBeforeItsStepWasAbandonedIsKeptWithTheReason) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  const int64_t other = fresh_pipe();
  box.put(go_key(pipe, 0), c10::IValue(int64_t{1}));
  auto first = box.take_go(pipe);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ((*first)->step, 0);
  EXPECT_TRUE((*first)->dropped.ok()) << (*first)->dropped;
  box.finish(pipe, 0);
  box.put(go_key(pipe, 1), c10::IValue(int64_t{2}));  // here, not taken, when its step is abandoned
  box.abort(pipe, 1, absl::AbortedError("another stage failed"));
  box.abort(pipe, 2, absl::AbortedError("another stage failed"));
  box.put(go_key(pipe, 2), c10::IValue(int64_t{3}));  // comes after its step was abandoned
  for (int64_t step : {1, 2}) {
    auto go = box.take_go(pipe);
    ASSERT_TRUE(go.ok()) << go.status();
    ASSERT_TRUE(go->has_value()) << "step " << step;
    EXPECT_EQ((*go)->step, step);
    EXPECT_EQ((*go)->value.toInt(), step + 1);
    EXPECT_EQ((*go)->dropped.code(), absl::StatusCode::kAborted);
    EXPECT_EQ((*go)->dropped.message(), "another stage failed");
  }
  auto none = box.take_go(pipe);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  EXPECT_EQ(box.held(), 0u);
  // A released pipeline's go is not answered: its driver is gone.
  box.abort(other, 0, absl::AbortedError("another stage failed"));
  box.put(go_key(other, 0), c10::IValue(int64_t{1}));
  EXPECT_EQ(box.held(), 1u);
  box.release(other);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineMailbox, StoppingEndsTheWaitsInProgressOnly) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  auto waiting = std::async(std::launch::async,
                            [&] { return box.take(key(pipe, 0, 0), in(test::scaled(milliseconds(10000))), "m0"); });
  // The stop must come while the receive waits (a receive that begins after it is not ended by it).
  ASSERT_TRUE(await_waiting(box, key(pipe, 0, 0), Mailbox::Waiting::kAlone)) << "the receive never started waiting";
  box.abort_all(absl::CancelledError("RPC is shutting down"));
  ASSERT_EQ(waiting.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  EXPECT_EQ(waiting.get().status().code(), absl::StatusCode::kCancelled);
  box.put(key(pipe, 0, 0), at::ones({1}));  // RPC started again: the same step works
  EXPECT_TRUE(box.take(key(pipe, 0, 0), in(milliseconds(100)), "m0").ok());
  box.finish(pipe, 0);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineMailbox, NothingArrivingEndsAtTheDeadline) {
  Mailbox& box = Mailbox::get();
  const int64_t pipe = fresh_pipe();
  const auto t0 = Clock::now();
  auto got = box.take(key(pipe, 0, 0), in(milliseconds(200)), "the gradient from stage 2");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(Clock::now() - t0, milliseconds(200));
  EXPECT_NE(got.status().message().find("the gradient from stage 2"), std::string::npos);
  EXPECT_EQ(box.held(), 0u);
}

}  // namespace
}  // namespace tandem::pipeline::detail
