// The agent and its observers across processes: the test process is the agent (rank 0), ranks 1.. hold observers.
#include <gmock/gmock.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "examples/rl/agent.h"
#include "tandem/rpc/errors.h"
#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

namespace rl = examples::rl;
using MultiprocRl = MultiprocRpc;

std::vector<rref::RRef> observers(int n, uint64_t seed) {
  std::vector<rref::RRef> out;
  for (int i = 0; i < n; ++i) out.push_back(rl::make_observer(i + 1, i, seed));
  return out;
}

// The same seeds give the same states and draws: batched and unbatched agents must choose the same actions.
TEST_F(MultiprocRl, BatchedAndUnbatchedRoundsTakeTheSameActions) {
  start({.world_size = 4});
  std::vector<std::vector<int64_t>> actions[2];
  for (int batched = 0; batched < 2; ++batched) {
    rl::set_agent(std::make_shared<rl::Agent>(3, 11));
    rl::Round r = rl::run_round(observers(3, 5), {.batched = batched == 1, .steps = 80});
    ASSERT_EQ(r.trajectories.size(), 3u);
    for (const auto& t : r.trajectories) actions[batched].push_back(t.actions);
  }
  EXPECT_EQ(actions[0], actions[1]);
  EXPECT_EQ(actions[0][0].size(), 80u);
  EXPECT_NE(actions[0][0], actions[0][1]);  // different observers, different episodes
}

// A killed observer: the round fails within the timeout with an error naming it; nothing hangs.
TEST_F(MultiprocRl, AKilledObserverFailsTheRoundNamingIt) {
  start({.world_size = 3});
  expect_clean_children_ = false;
  rl::set_agent(std::make_shared<rl::Agent>(2, 1));
  auto obs = observers(2, 1);
  rpc::rpc_sync("worker2", "test.die_in", int64_t{300});
  const auto t0 = Clock::now();
  try {
    rl::run_round(obs, {.batched = true, .steps = 1000000, .timeout = milliseconds(20000)});
    ADD_FAILURE() << "a round with a dead observer succeeded";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("observer 1 (worker 'worker2')"));
  }
  EXPECT_LT(Clock::now() - t0, std::min(scaled(milliseconds(15000)), milliseconds(19000)));  // below the 20 s timeout
  rpc::shutdown(false);
  EXPECT_EQ(job_->wait_children(milliseconds(30000))[1], 9);
}

// With skip_failed, the agent carries on with the observers that are left.
TEST_F(MultiprocRl, WithSkipFailedTheRoundCarriesOnWithoutAKilledObserver) {
  start({.world_size = 3});
  expect_clean_children_ = false;
  rl::set_agent(std::make_shared<rl::Agent>(2, 1));
  auto obs = observers(2, 1);
  rpc::rpc_sync("worker2", "test.die_in", int64_t{300});
  rl::Round r =
      rl::run_round(obs, {.batched = true, .steps = 20000, .timeout = milliseconds(60000), .skip_failed = true});
  ASSERT_EQ(r.failed.size(), 1u);
  EXPECT_THAT(r.failed[0], ::testing::HasSubstr("observer 1 (worker 'worker2')"));
  ASSERT_EQ(r.observers, std::vector<int>{0});
  EXPECT_EQ(r.trajectories[0].rewards.size(), 20000u);
  rpc::shutdown(false);
  EXPECT_EQ(job_->wait_children(milliseconds(30000))[1], 9);
}

// A round that gives up while an observer still plays it (its 5th action request is held back past the round's
// timeout), then the next round at once: the observer stops its old run (the agent refuses that request, of a round
// that gave up) and plays the new one, which completes with each observer's own steps and nothing of the old round's
// (finish_round checks each observer's steps against its trajectory). Before rounds were numbered, the next round
// failed at once (the observer refused a run while its old one played), and had it waited, the old round's steps and
// the late request would have been counted in the new one.
TEST_F(MultiprocRl, TheRoundAfterOneThatGaveUpOnADelayedObserverCompletesUnmixed) {
  const milliseconds first_timeout = scaled(milliseconds(1000));
  const milliseconds held = first_timeout + scaled(milliseconds(2000));
  start({.world_size = 3,
         .extra_env = {{"TANDEM_TEST_FAULTS", "delay worker2->worker0 request fn=rl.select_action_batch nth=5 ms=" +
                                                  std::to_string(held.count())}}});
  auto agent = std::make_shared<rl::Agent>(2, 7);
  rl::set_agent(agent);
  auto obs = observers(2, 7);
  try {
    rl::run_round(obs, {.batched = true, .steps = 10, .timeout = first_timeout});
    ADD_FAILURE() << "a round whose observer was held back past its timeout succeeded";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kDeadlineExceeded) << e.what();
    EXPECT_THAT(e.what(), ::testing::HasSubstr("observer 1 (worker 'worker2')"));
  }
  for (int next = 0; next < 2; ++next) {  // the round after, while the old run still plays; and one more
    SCOPED_TRACE(next == 0 ? "the round after the one that gave up" : "the round after that");
    rl::Round r = rl::run_round(obs, {.batched = true, .steps = 10, .timeout = held + scaled(milliseconds(20000))});
    ASSERT_EQ(r.observers, (std::vector<int>{0, 1}));
    for (const auto& t : r.trajectories) {
      EXPECT_EQ(t.rewards.size(), 10u);
      EXPECT_EQ(t.actions.size(), 10u);
    }
    EXPECT_NO_THROW(agent->finish_round(r.observers, r.trajectories));
  }
}

// SIGTERM to the launcher stops the agent and every observer of the example.
TEST(MultiprocRlExample, SigtermStopsEveryProcess) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl(TANDEM_RUN_PATH, TANDEM_RUN_PATH, "--nproc-per-node", "3", RL_TRAIN_PATH, "--max-episodes", "1000000",
          "--target", "100000", "--seed", "424242", static_cast<char*>(nullptr));
    _exit(127);
  }
  const std::string pattern = "'rl_trai[n] --max-episodes 1000000 --target 100000 --seed 424242'";
  const std::string running = "pgrep -f " + pattern + " > /dev/null";
  // The launcher's own command line matches the pattern too: its workers are its children that match it.
  const std::string workers = "pgrep -c -P " + std::to_string(pid) + " -f " + pattern;
  auto count = [](const std::string& command) {
    FILE* out = popen(command.c_str(), "r");
    int n = -1;
    if (out != nullptr) {
      if (fscanf(out, "%d", &n) != 1) n = -1;
      pclose(out);
    }
    return n;
  };
  std::this_thread::sleep_for(std::chrono::seconds(4));  // training is under way
  EXPECT_EQ(count(workers), 3) << "the example's three workers are not running";
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 300 && done == 0; ++i) {
    done = waitpid(pid, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (done == 0) kill(pid, SIGKILL), waitpid(pid, &status, 0);
  ASSERT_EQ(done, pid) << "tandem-run did not stop within 30 s of SIGTERM";
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  EXPECT_NE(system(running.c_str()), 0) << "a worker outlived the launcher";
}

}  // namespace
}  // namespace tandem::test
