// Fixtures of the fault tests that run only on test hosts (tests/hosts/run.sh): the test process in host 0, rank r in
// host r, every call over a TCP/IP link that scripts/hosts.sh cuts, black-holes, kills and heals. Their suites are
// named HostFaults*, which the normal runs (Unit*, Multiproc*) do not select; run alone, each test skips.
#pragma once

#include "tests/common/scenario_fixture.h"

namespace tandem::test {

class HostFaults : public MultiprocScenario {
 protected:
  void SetUp() override {
    if (test_hosts().count < 3) GTEST_SKIP() << "runs on 3 test hosts only: bash tests/hosts/run.sh";
  }
  // Whatever a test did to the links (a failed assertion returns early, before its own heal), every link is up and
  // unlimited again before the job shuts down, and undelayed after it (stopping a relay resets the connections through
  // it), for the next test and the next suites of the same run.
  void TearDown() override {
    undo_faults({"heal", "rate"});
    release_workers();
    MultiprocScenario::TearDown();
    undo_faults({"delay"});
  }
  // Lets the held workers go to their graceful shutdown, unless this process has left the job already (a test that
  // shut RPC down itself: its held workers end with the job's processes). The links are healed: a release that fails
  // is a failure. Over gRPC a channel whose connection failed during a cut fails calls at once until its reconnect
  // backoff (at most 1 s, rpc/detail/net.cc) has passed, and a connection that crossed a black hole delivers at its
  // next retransmission: a release (idempotent) is tried again for 10 s, scaled.
  static void release_workers() {
    if (!rpc::is_initialized()) return;
    const auto until = Clock::now() + scaled(std::chrono::milliseconds(10000));  // for all of them
    for (int r = 1; r < kRanks; ++r) {
      absl::Status s;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (!poll_until(left, [&] {
            s = rpc::rpc_async(r, "test.release", std::chrono::milliseconds(5000)).status();
            return s.ok();
          })) {
        ADD_FAILURE() << "releasing rank " << r << " after the test: " << s;
      }
    }
  }
  static void undo_faults(std::initializer_list<const char*> ops) {
    for (int h = 0; h < test_hosts().count; ++h) {
      for (const char* op : ops) {
        try {
          host_fault(op, h, std::string(op) == "heal" ? "" : "off");
        } catch (const std::exception& e) {
          ADD_FAILURE() << e.what();
        }
      }
    }
  }

 public:  // for a test file's helpers that several of its tests share
  static constexpr int kRanks = 3;
  // A job of 3 ranks, one per host, whose calls default to `rpc_timeout` and whose graceful shutdown waits 10 s. The
  // workers are held out of their shutdown while the test's body runs (tests/common/test_env.cc, TANDEM_TEST_HOLD_MS):
  // 120 s, scaled, about twice a body's longest passing run (a backward failing after its deadline, 30 s for a healed
  // link to release contexts, 20 s more to serve again); TearDown releases them.
  void start_on_hosts(std::chrono::milliseconds rpc_timeout) {
    rpc::RpcOptions options = options_from_env();
    options.rpc_timeout = rpc_timeout;
    options.shutdown_timeout = std::chrono::milliseconds(10000);
    start({.world_size = kRanks,
           .extra_env = {{"TANDEM_TEST_RPC_MS", std::to_string(rpc_timeout.count())},
                         {"TANDEM_TEST_SHUTDOWN_MS", "10000"},
                         {"TANDEM_TEST_HOLD_MS", std::to_string(scaled(std::chrono::milliseconds(120000)).count())}}},
          options);
  }
  // Elapsed since `t0`.
  static std::chrono::milliseconds since(Clock::time_point t0) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  }
};

}  // namespace tandem::test
