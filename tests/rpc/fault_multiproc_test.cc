// The fault-injecting transport between real worker processes (rpc/fault_injection.h): each fault ends in the
// documented error naming the worker and the call, or is recovered, and the next call works. The suite runs over the
// direct channel and again with gRPC forced (tests/rpc/CMakeLists.txt). Where elapsed time is checked it is the point
// of the test (a dropped message fails at the call's deadline, not before, and not at some fixed timeout), with
// margins.
#include <ATen/ATen.h>

#include <thread>

#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

class MultiprocRpcFaults : public MultiprocRpc {
 protected:
  // Rank 0 (this process) applies `mine`; the children apply `theirs`.
  void start_with(const std::string& mine, const std::string& theirs = "") {
    rpc::RpcOptions options = options_from_env();
    if (!mine.empty()) options.faults = rpc::parse_faults(mine).value();
    JobSpec spec{.world_size = 2};
    if (!theirs.empty()) spec.extra_env["TANDEM_TEST_FAULTS"] = theirs;
    start(spec, options);
  }
  static int64_t bump() { return rpc::rpc_sync<int64_t>("worker1", "bump"); }
};

TEST(UnitRpcFaults, RulesParseAndBadRulesAreNamed) {
  auto rules = rpc::parse_faults("drop worker0->worker1 request nth=3 count=2; delay *->worker2 reply ms=250 fn=add");
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 2u);
  EXPECT_EQ((*rules)[0].action, rpc::FaultRule::Action::kDrop);
  EXPECT_EQ((*rules)[0].to, "worker1");
  EXPECT_EQ((*rules)[0].nth, 3);
  EXPECT_EQ((*rules)[0].count, 2);
  EXPECT_EQ((*rules)[1].kind, rpc::FaultRule::Kind::kReply);
  EXPECT_EQ((*rules)[1].delay, milliseconds(250));
  EXPECT_EQ((*rules)[1].function, "add");
  for (const char* bad : {"explode a->b", "drop worker0", "drop a->b nth=0", "duplicate a->b reply", "drop a->b x=1"}) {
    auto r = rpc::parse_faults(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("fault rule"), std::string::npos) << r.status();
  }
}

TEST_F(MultiprocRpcFaults, DroppedRequestFailsAtTheCallsDeadlineAndTheNextCallWorks) {
  start_with("drop worker0->worker1 request fn=add nth=2 count=2");
  const at::Tensor one = at::ones({2});
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "add", one, one).equal(at::full({2}, 2.0)));
  const auto t0 = Clock::now();
  expect_error([&] { rpc::rpc_sync("worker1", "add", one, one, milliseconds(400)); },
               absl::StatusCode::kDeadlineExceeded, {"worker1", "'add'", "400 ms"});
  EXPECT_GE(Clock::now() - t0, milliseconds(390));  // at the deadline, not before
  rpc::Future f = rpc::rpc_async("worker1", "add", one, one, milliseconds(400));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded) << f.status();
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "add", one, one).equal(at::full({2}, 2.0)));
}

TEST_F(MultiprocRpcFaults, DroppedReplyFailsAtTheCallersDeadline) {
  start_with("", "drop worker1->worker0 reply fn=whoami nth=1");
  expect_error([] { rpc::rpc_sync("worker1", "whoami", milliseconds(500)); }, absl::StatusCode::kDeadlineExceeded,
               {"worker1", "'whoami'"});
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpcFaults, DelayedMessagesArriveLateAndComplete) {
  start_with("delay worker0->worker1 request fn=whoami ms=300 count=2",
             "delay worker1->worker0 reply fn=whoami ms=300 count=2");
  const auto t0 = Clock::now();
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  EXPECT_GE(Clock::now() - t0, milliseconds(590));  // both delays were applied
  // A delay longer than the call's timeout is a timeout.
  expect_error([] { rpc::rpc_sync("worker1", "whoami", milliseconds(450)); }, absl::StatusCode::kDeadlineExceeded,
               {"worker1"});
}

TEST_F(MultiprocRpcFaults, DuplicatedRequestRunsTwiceAndCompletesOnce) {
  start_with("duplicate worker0->worker1 request fn=bump nth=1");
  rpc::Future f = rpc::rpc_async("worker1", "bump");
  const int64_t first = f.get<int64_t>();
  EXPECT_TRUE(first == 1 || first == 2) << first;
  // The copy may still be queued on the callee when the original's reply arrives: wait (bounded) until it ran.
  const auto deadline = Clock::now() + scaled(milliseconds(10000));
  while (rpc::rpc_sync<int64_t>("worker1", "bumps") < 2 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(bump(), 3);  // the callee ran the duplicate too
}

TEST_F(MultiprocRpcFaults, ReorderedRequestGoesAfterTheNextOne) {
  start_with(
      "reorder worker0->worker1 request fn=bump nth=1 ms=5000; reorder worker0->worker1 request fn=whoami ms=300");
  rpc::Future held = rpc::rpc_async("worker1", "bump");
  EXPECT_EQ(bump(), 1);  // sent (and answered) while the first request was held
  EXPECT_EQ(held.get<int64_t>(), 2);
  // Held with nothing after it: it goes at `ms`, within the call's timeout.
  const auto t0 = Clock::now();
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  EXPECT_GE(Clock::now() - t0, milliseconds(290));
}

// One-way sends get the request rules and none of the reply rules: a dropped send completes as written and never
// runs, a duplicated one runs twice, and a rule dropping every reply of the function changes nothing (gRPC's receipt
// of a one-way call is not a reply: were it dropped, the send would fail at its deadline).
TEST_F(MultiprocRpcFaults, OneWaySendsGetTheRequestRulesAndNoReplyRules) {
  start_with("drop worker0->worker1 request fn=bump nth=1; duplicate worker0->worker1 request fn=bump_tensor nth=1",
             "drop worker1->worker0 reply fn=bump count=0; drop worker1->worker0 reply fn=bump_tensor count=0");
  const int64_t before = rpc::rpc_sync<int64_t>("worker1", "bumps");
  const auto t0 = Clock::now();
  rpc::Future dropped = rpc::rpc_oneway("worker1", "bump", milliseconds(3000));
  EXPECT_TRUE(dropped.status().ok()) << dropped.status();
  EXPECT_LT(Clock::now() - t0, milliseconds(2000));  // at once, not at the deadline
  rpc::Future twice = rpc::rpc_oneway("worker1", "bump_tensor", at::ones({10}), milliseconds(3000));
  rpc::Future once = rpc::rpc_oneway("worker1", "bump", milliseconds(3000));
  EXPECT_TRUE(twice.status().ok()) << twice.status();
  EXPECT_TRUE(once.status().ok()) << once.status();
  const auto deadline = Clock::now() + scaled(milliseconds(10000));
  while (rpc::rpc_sync<int64_t>("worker1", "bumps") < before + 3 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  std::this_thread::sleep_for(milliseconds(200));  // were the dropped one delivered, it would have run by now
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "bumps"), before + 3);
}

TEST_F(MultiprocRpcFaults, CorruptedRequestIsRefusedAsMalformedAndTheWorkerServesOn) {
  start_with("corrupt worker0->worker1 request fn=add nth=1");
  const at::Tensor one = at::ones({1000});
  expect_error([&] { rpc::rpc_sync("worker1", "add", one, one); }, absl::StatusCode::kInvalidArgument,
               {"worker1", "'add'", "malformed"});
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "add", one, one).equal(at::full({1000}, 2.0)));
}

TEST_F(MultiprocRpcFaults, CorruptedReplyIsABadReply) {
  start_with("", "corrupt worker1->worker0 reply fn=whoami nth=1");
  expect_error([] { rpc::rpc_sync("worker1", "whoami"); }, absl::StatusCode::kInvalidArgument,
               {"worker1", "'whoami'", "bad reply"});
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpcFaults, ConnectionCutMidTensorFailsTheCallsOnItAndTheNextCallReconnects) {
  start_with("cut worker0->worker1 request fn=echo nth=1");
  // A call in flight on the same link when it is cut.
  rpc::Future pending = rpc::rpc_async("worker1", "later", int64_t{3000}, int64_t{7}, milliseconds(20000));
  std::this_thread::sleep_for(milliseconds(200));  // it has reached worker1
  const at::Tensor big = at::rand({1 << 18});      // 1 MiB: the cut falls in the tensor's bytes
  expect_error([&] { (void)rpc::rpc_async("worker1", "echo", big).value(); }, absl::StatusCode::kUnavailable,
               {"worker1", "'echo'", "cut"});
  EXPECT_EQ(pending.status().code(), absl::StatusCode::kUnavailable) << pending.status();
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "echo", big).equal(big));  // reconnected; worker1 serves on
}

TEST_F(MultiprocRpcFaults, ReplyConnectionCutIsUnavailable) {
  start_with("", "cut worker1->worker0 reply fn=whoami nth=1");
  expect_error([] { (void)rpc::rpc_async("worker1", "whoami").value(); }, absl::StatusCode::kUnavailable,
               {"worker1", "'whoami'"});
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

}  // namespace
}  // namespace tandem::test
