// tandem-run: the torchrun environment, output prefixes, and failure propagation, with real processes. And the test
// harness's own way of starting workers (the fork server, tests/common/spawner.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "tandem/cluster/cpus.h"
#include "tests/common/multiproc.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;
using testing::HasSubstr;

// A worker forked by the fork server gets what an exec'd one would: the test process's environment as it is when the
// worker starts (a variable set, and one unset, after the server was forked), the Process's variables, its stdout and
// stderr in the log, and main's return value as its exit code. It is forked, not exec'd, unless
// TANDEM_TEST_EXEC_WORKERS=1.
TEST(MultiprocHarness, AForkedWorkerGetsWhatAnExecdOneWould) {
  const char* home = std::getenv("HOME");
  const std::string saved_home = home ? home : "";
  setenv("TANDEM_PROBE_FROM_TEST", "set-after-start", 1);
  unsetenv("HOME");
  Process p({self_exe(), "--worker", "harness_probe"}, {{"TANDEM_PROBE_EXTRA", "given"}});
  unsetenv("TANDEM_PROBE_FROM_TEST");
  if (home) setenv("HOME", saved_home.c_str(), 1);
  EXPECT_EQ(exit_code(p.wait(milliseconds(30000))), 7) << p.output();
  const std::string out = p.output();
  EXPECT_THAT(out, HasSubstr("TANDEM_PROBE_FROM_TEST=set-after-start\n"));
  EXPECT_THAT(out, HasSubstr("TANDEM_PROBE_EXTRA=given\n"));
  EXPECT_THAT(out, HasSubstr("HOME=\n"));
  EXPECT_THAT(out, HasSubstr("probe-stderr\n"));
  const char* exec = std::getenv("TANDEM_TEST_EXEC_WORKERS");
  EXPECT_THAT(out, HasSubstr(exec && std::string(exec) == "1" ? "forked=0" : "forked=1"));
}

// A worker that runs past its wait is killed at the wait's end and reaped; the wait says so (-1), the process is gone,
// and the next worker starts as usual.
TEST(MultiprocHarness, AWorkerPastItsWaitIsKilled) {
  Process stuck({self_exe(), "--worker", "fail_if_rank1"}, {{"RANK", "0"}});  // sleeps 60 s
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(stuck.wait(milliseconds(200)), -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, scaled(milliseconds(200 + 5000)));  // not the 60 s sleep
  EXPECT_NE(::kill(stuck.pid(), 0), 0);                                                // reaped: no such process
  Process next({self_exe(), "--worker", "harness_probe"}, {});
  EXPECT_EQ(exit_code(next.wait(milliseconds(30000))), 7) << next.output();
}

TEST(MultiprocLauncher, SetsTorchrunEnvironmentAndPrefixesOutput) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "env_dump"}, {});
  ASSERT_EQ(exit_code(p.wait(milliseconds(30000))), 0) << p.output();
  const std::string out = p.output();
  for (const char* line : {"[rank0]: RANK=0", "[rank1]: RANK=1", "[rank1]: LOCAL_RANK=1", "[rank0]: WORLD_SIZE=2",
                           "[rank1]: LOCAL_WORLD_SIZE=2", "[rank0]: MASTER_ADDR=127.0.0.1", "[rank1]: SECRET_SET=1"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << " missing in:\n" << out;
  }
}

// --bind-cores 1: each local worker on its own share of the launcher's CPUs (here: this test's), equal blocks in order
// when there are enough, else one CPU each, local rank mod their count; without it, every CPU.
TEST(MultiprocLauncher, BindCoresGivesEachWorkerItsShareOfTheCpus) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(sched_getaffinity(0, sizeof mine, &mine), 0);
  std::vector<int> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine)) allowed.push_back(c);
  }
  const int n = static_cast<int>(allowed.size());
  auto list = [](const std::vector<int>& cpus) {
    std::string s;
    for (int c : cpus) s += (s.empty() ? "" : ",") + std::to_string(c);
    return s;
  };
  for (int nproc : {2, n + 1}) {
    Process p({TANDEM_RUN_PATH, "--nproc-per-node", std::to_string(nproc), "--bind-cores", "1", self_exe(), "--worker",
               "env_dump"},
              {});
    ASSERT_EQ(exit_code(p.wait(milliseconds(30000))), 0) << p.output();
    for (int r = 0; r < nproc; ++r) {
      std::vector<int> want;
      if (n < nproc) {
        want.push_back(allowed[r % n]);
      } else {
        for (int i = r * n / nproc; i < (r + 1) * n / nproc; ++i) want.push_back(allowed[i]);
      }
      const std::string line = "[rank" + std::to_string(r) + "]: CPUS=" + list(want) + "\n";
      EXPECT_THAT(p.output(), HasSubstr(line)) << "nproc " << nproc;
    }
  }
  Process unbound({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "env_dump"}, {});
  ASSERT_EQ(exit_code(unbound.wait(milliseconds(30000))), 0) << unbound.output();
  EXPECT_THAT(unbound.output(), HasSubstr("[rank1]: CPUS=" + list(allowed) + "\n"));
}

// Unset, OMP_NUM_THREADS becomes each worker's share of the CPUs the launcher may use (at least 1), said once; set, it
// is the user's.
TEST(MultiprocLauncher, EachWorkerGetsItsShareOfTheCpusAsOmpNumThreads) {
  const int cpus = cluster::usable_cpus();
  for (int nproc : {1, 2, 3}) {
    Process p({TANDEM_RUN_PATH, "--nproc-per-node", std::to_string(nproc), self_exe(), "--worker", "env_dump"},
              {{"OMP_NUM_THREADS", ""}});
    ASSERT_EQ(exit_code(p.wait(milliseconds(30000))), 0) << p.output();
    const int share = std::max(1, cpus / nproc);
    EXPECT_THAT(p.output(), HasSubstr("[rank0]: OMP_NUM_THREADS=" + std::to_string(share) + "\n")) << nproc;
    EXPECT_THAT(p.output(),
                HasSubstr("[rank" + std::to_string(nproc - 1) + "]: OMP_NUM_THREADS=" + std::to_string(share) + "\n"));
    const std::string notice = "tandem-run: OMP_NUM_THREADS=" + std::to_string(share) + " for each of the";
    if (nproc > 1) {
      EXPECT_THAT(p.output(), HasSubstr(notice)) << p.output();
    } else {
      EXPECT_THAT(p.output(), ::testing::Not(HasSubstr("tandem-run: OMP_NUM_THREADS"))) << p.output();
    }
  }
  Process mine({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "env_dump"},
               {{"OMP_NUM_THREADS", "7"}});
  ASSERT_EQ(exit_code(mine.wait(milliseconds(30000))), 0) << mine.output();
  EXPECT_THAT(mine.output(), HasSubstr("[rank1]: OMP_NUM_THREADS=7\n"));
  EXPECT_THAT(mine.output(), ::testing::Not(HasSubstr("tandem-run: OMP_NUM_THREADS")));
}

TEST(MultiprocLauncher, MultiNodeNeedsASharedSecret) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--master-port", "1",
             self_exe(), "--worker", "env_dump"},
            {{"TANDEM_SECRET", ""}});
  EXPECT_EQ(exit_code(p.wait(milliseconds(30000))), 2);
  EXPECT_NE(p.output().find("needs the same secret"), std::string::npos) << p.output();
}

// A worker's line longer than 64 KiB is passed on in pieces of 64 KiB, each with the rank's prefix, every byte kept (a
// NUL too): the launcher holds at most that much of a line whatever a worker prints ('\r' progress, binary output).
TEST(MultiprocLauncher, AVeryLongLineIsPassedOnInPiecesWithEveryByte) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "1", self_exe(), "--worker", "long_line"}, {});
  ASSERT_EQ(exit_code(p.wait(milliseconds(30000))), 0) << p.output().substr(0, 2000);
  const std::string out = p.output();
  std::vector<std::string> pieces;
  for (size_t at = 0; (at = out.find("[rank0]: ", at)) != std::string::npos;) {
    at += 9;
    const size_t nl = out.find('\n', at);
    pieces.push_back(out.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
  }
  ASSERT_EQ(pieces.size(), 5u) << out.size();
  EXPECT_EQ(pieces[0].size(), size_t{65536});
  EXPECT_EQ(pieces[1].size(), size_t{65536});
  std::string line = pieces[0] + pieces[1] + pieces[2];
  std::string want(150000, 'x');
  want[70000] = '\0';
  EXPECT_TRUE(line == want) << line.size();
  EXPECT_EQ(pieces[3], "short");
  EXPECT_EQ(pieces[4], "last-without-newline");
}

// A worker that no process can be made for (here: out of descriptors for its pipes) fails the job as a program that
// cannot be executed does (127), naming the cause, and the workers already started are stopped; the launcher does not
// exit from under them.
TEST(MultiprocLauncher, AWorkerThatCannotBeStartedFailsTheJobAndStopsTheOthers) {
  // 8 workers need 32 descriptors for their pipes: with 20 at most, one of them cannot be started (which one depends
  // on what the launcher holds open besides).
  const auto t0 = std::chrono::steady_clock::now();
  Process p({"/usr/bin/prlimit", "--nofile=20:20", TANDEM_RUN_PATH, "--nproc-per-node", "8", "/bin/sleep", "60"}, {});
  EXPECT_EQ(exit_code(p.wait(milliseconds(30000))), 127) << p.output();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(30000));  // the sleeping workers were stopped
  const std::string out = p.output();
  EXPECT_THAT(out, HasSubstr("tandem-run: cannot start rank ")) << out;
  EXPECT_THAT(out, HasSubstr("Too many open files")) << out;
  EXPECT_THAT(out, HasSubstr("failed with exit code 127")) << out;
  EXPECT_THAT(out, HasSubstr("(not started)")) << out;  // the ranks after it
}

// Flags whose values would make a duration nonsense (not a number, not finite, out of range) are refused.
TEST(MultiprocLauncher, NonsenseDurationsAreRefused) {
  for (std::vector<std::string> flags : {std::vector<std::string>{"--monitor-interval", "nan"},
                                         {"--monitor-interval", "inf"},
                                         {"--monitor-interval", "-1"},
                                         {"--monitor-interval", "1e-9"},
                                         {"--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                                          "--rdzv-conf", "keep_alive_interval=0.0001"},
                                         {"--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                                          "--rdzv-conf", "keep_alive_interval=1e6,keep_alive_max_attempt=5"},
                                         {"--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                                          "--rdzv-conf", "keep_alive_max_attempt=0.5"},
                                         {"--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                                          "--rdzv-conf", "keep_alive_interval=1e10"}}) {
    std::vector<std::string> argv = {TANDEM_RUN_PATH};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {"--nproc-per-node", "1", self_exe(), "--worker", "env_dump"});
    Process p(argv, {{"TANDEM_SECRET", "launcher-test-secret"}});  // a job on several nodes needs one
    EXPECT_NE(exit_code(p.wait(milliseconds(30000))), 0) << flags[1];
    EXPECT_THAT(p.output(), HasSubstr("bad value")) << flags[1];
  }
}

TEST(MultiprocLauncher, OneFailingRankStopsTheJob) {
  const auto t0 = std::chrono::steady_clock::now();
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "3", self_exe(), "--worker", "fail_if_rank1"}, {});
  EXPECT_EQ(exit_code(p.wait(milliseconds(40000))), 3) << p.output();
  // The other ranks sleep for 60 s: the scaled bound stays below that.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::min(scaled(milliseconds(30000)), milliseconds(55000)));
  const std::string out = p.output();
  EXPECT_NE(out.find("[rank1]: rank 1 gives up"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem-run: rank 1 (pid"), std::string::npos) << out;
  EXPECT_NE(out.find("failed with exit code 3"), std::string::npos) << out;
}

// A worker that does not go after SIGKILL (here: held by a tracer, as a process stuck in the kernel would be) is named
// and left behind a grace period (at least 5 s) after the SIGKILL: the launcher still exits with the job's failure
// (before: it waited as long as the worker stayed, forever for one stuck in the kernel).
TEST(MultiprocLauncher, AWorkerThatOutlivesSigkillIsLeftBehind) {
  const std::string mark = testing::TempDir() + "/held_by_tracer." + std::to_string(getpid());
  std::remove(mark.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  Process p(
      {TANDEM_RUN_PATH, "--nproc-per-node", "2", "--grace-seconds", "1", self_exe(), "--worker", "held_by_tracer"},
      {{"TANDEM_TEST_MARK", mark}});
  const int code = exit_code(p.wait(milliseconds(40000)));
  if (p.output().find("could not be traced") != std::string::npos) GTEST_SKIP() << "ptrace is not allowed here";
  EXPECT_EQ(code, 3) << p.output();
  // The tracer lets go 30 s after rank 0 started: the launcher must be gone well before.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(20000)) << p.output();
  const std::string out = p.output();
  EXPECT_THAT(out, HasSubstr("rank 0 is held by a tracer"));
  EXPECT_THAT(out, HasSubstr("tandem-run: rank 0 (pid"));
  EXPECT_THAT(out, HasSubstr("has not exited 5 s after SIGKILL"));
  EXPECT_THAT(out, HasSubstr("failed with exit code 3"));
  std::remove(mark.c_str());
}

TEST(MultiprocLauncher, RunsAnRpcJob) {
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "3", self_exe(), "--worker", "hello"}, {});
  ASSERT_EQ(exit_code(p.wait(milliseconds(60000))), 0) << p.output();
  const std::string out = p.output();
  EXPECT_NE(out.find("[rank0]: worker1 answered worker0"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank2]: worker0 answered worker2"), std::string::npos) << out;
}

}  // namespace
}  // namespace tandem::test
