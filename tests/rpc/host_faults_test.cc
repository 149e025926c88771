// RPC across test hosts when the network fails (tests/common/host_faults.h): a link cut in the middle of a call, a
// black-holed host, a host whose processes are all killed, partitions that heal, and a link with added delay.
#include <gmock/gmock.h>

#include <thread>

#include "tests/common/host_faults.h"

namespace tandem::test {
namespace {

using testing::HasSubstr;

TEST_F(HostFaults, LinkCutMidCallFailsAtItsDeadlineAndTheHealedLinkServesAgain) {
  start_on_hosts(milliseconds(2500));
  rpc::Future pending = rpc::rpc_async("worker1", "sleep_ms", int64_t{1000});
  std::this_thread::sleep_for(milliseconds(200));
  host_fault("cut", 1);  // the reply can no longer come back; no reset reaches us either
  const auto t0 = Clock::now();
  const absl::Status s = pending.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("worker1"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("sleep_ms"));
  EXPECT_LT(since(t0), milliseconds(2500) + scaled(milliseconds(2000)));
  // New calls over the cut link fail at their deadline too; the other host is unaffected.
  EXPECT_EQ(rpc::rpc_async("worker1", "whoami", milliseconds(500)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker2", "whoami"), "worker2");
  // The partition heals: calls go through again (TCP retransmits on the same connection), and the job ends cleanly.
  host_fault("heal", 1);
  const auto deadline = Clock::now() + scaled(milliseconds(20000));
  absl::Status again;
  do {
    again = rpc::rpc_async("worker1", "whoami", milliseconds(2000)).status();
  } while (!again.ok() && Clock::now() < deadline);
  EXPECT_TRUE(again.ok()) << again;
}

TEST_F(HostFaults, BlackHoledHostFailsCallsAtTheirDeadlineNamingIt) {
  start_on_hosts(milliseconds(1500));
  ASSERT_EQ(rpc::rpc_sync<std::string>("worker2", "whoami"), "worker2");  // the connection is up
  host_fault("blackhole", 2);  // every packet to and from host 2 dropped: no reset, no error, silence
  const auto t0 = Clock::now();
  const absl::Status s = rpc::rpc_async("worker2", "whoami").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'worker2' (rank 2) calling 'whoami'"));
  EXPECT_LT(since(t0), milliseconds(1500) + scaled(milliseconds(2000)));
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  host_fault("heal", 2);
  const auto deadline = Clock::now() + scaled(milliseconds(20000));
  absl::Status again;
  do {
    again = rpc::rpc_async("worker2", "whoami", milliseconds(2000)).status();
  } while (!again.ok() && Clock::now() < deadline);
  EXPECT_TRUE(again.ok()) << again;
}

TEST_F(HostFaults, HostWhoseProcessesAreKilledFailsPendingCallsLongBeforeTheirDeadline) {
  start_on_hosts(milliseconds(30000));
  expect_clean_children_ = false;
  rpc::Future pending = rpc::rpc_async("worker2", "sleep_ms", int64_t{20000});
  std::this_thread::sleep_for(milliseconds(300));
  const auto t0 = Clock::now();
  host_fault("kill", 2);  // the kernel of host 2 resets its connections
  const absl::Status s = pending.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'worker2' (rank 2)"));
  EXPECT_LT(since(t0), scaled(milliseconds(10000)));
  EXPECT_EQ(rpc::rpc_async("worker2", "whoami", milliseconds(20000)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  rpc::shutdown(false);
}

// 20 ms added each way between hosts 0 and 1 (scripts/hosts.sh delay: each host's relay holds every byte of the
// connections it opens to the other, so every connection between them crosses one relay), set before the job starts so
// that all its connections cross it: calls to worker1 take at least the added 40 ms and succeed, a deadline shorter
// than the delay fails at that deadline naming the worker and the call, the link serves again after it (the late
// reply is dropped), and host 2 still answers.
TEST_F(HostFaults, ADelayedLinkSlowsCallsAndADeadlineShorterThanTheDelayFailsNamingTheCall) {
  const std::string relay = test_hosts().delay_relay;
  ASSERT_FALSE(relay.empty()) << "TANDEM_TEST_DELAY_RELAY is not set (tests/hosts/run.sh sets it)";
  host_fault("delay", 0, "20000 " + relay + " 1");
  host_fault("delay", 1, "20000 " + relay + " 0");
  start_on_hosts(milliseconds(5000));
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
    EXPECT_GE(since(t0), milliseconds(40));
  }
  const auto t0 = Clock::now();
  const absl::Status s = rpc::rpc_async("worker1", "whoami", milliseconds(25)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'worker1' (rank 1) calling 'whoami'"));
  EXPECT_LT(since(t0), milliseconds(25) + scaled(milliseconds(2000)));
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker2", "whoami"), "worker2");
}

}  // namespace
}  // namespace tandem::test
