// sync/sync.h: the mutex, lock, condition variable and notification do what absl's do, and in a ThreadSanitizer build
// TSan sees the orderings they create: a counter guarded by MutexLock and a value handed over by a Notification or a
// CondVar are not reported, while the same counter unguarded is (each case runs in a child process, so a report, which
// ends the process under halt_on_error, is the child's exit status and its output).
#include "tandem/sync/sync.h"
#include "tandem/sync/threads.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

namespace tandem {
namespace {

constexpr int kIterations = 20000;

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif

int GuardedCounter() {
  Mutex mu;
  int count = 0;
  auto work = [&] {
    for (int i = 0; i < kIterations; ++i) {
      MutexLock lock(&mu);
      ++count;
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  return count;
}

// Deliberately racy: the case TSan must report.
int UnguardedCounter() {
  volatile int count = 0;
  auto work = [&] {
    for (int i = 0; i < kIterations; ++i) count = count + 1;
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  return count;
}

std::string NotificationHandOver() {
  std::string value;  // written before Notify, read after the wait: ordered by the notification only
  Notification ready;
  std::thread writer([&] {
    value = "handed over";
    ready.Notify();
  });
  ready.WaitForNotification();
  std::string seen = value;
  writer.join();
  return seen;
}

std::string CondVarHandOver() {
  Mutex mu;
  CondVar cv;
  bool set = false;
  std::string value;
  std::thread writer([&] {
    MutexLock lock(&mu);
    value = "handed over";
    set = true;
    cv.Signal();
  });
  std::string seen;
  {
    MutexLock lock(&mu);
    while (!set) cv.Wait(&mu);
    seen = value;
  }
  writer.join();
  return seen;
}

std::string AwaitHandOver() {
  Mutex mu;
  bool set = false;
  std::string value;
  std::thread writer([&] {
    MutexLock lock(&mu);
    value = "handed over";
    set = true;
  });
  std::string seen;
  {
    MutexLock lock(&mu);
    mu.Await(Condition(&set));
    seen = value;
  }
  writer.join();
  return seen;
}

// Runs `body` in a forked child; returns its exit status and what it wrote to stderr (TSan's report goes there).
struct ChildResult {
  int exit_code = -1;
  std::string output;
};
ChildResult RunInChild(const std::function<int()>& body) {
  char path[] = "/tmp/tandem-sync-test-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fd, STDERR_FILENO);
    std::_Exit(body());
  }
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(path);
  std::stringstream all;
  all << in.rdbuf();
  unlink(path);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), all.str()};
}

TEST(UnitSync, GuardedCounterCountsEveryIncrement) { EXPECT_EQ(GuardedCounter(), 2 * kIterations); }

TEST(UnitSync, HandOversDeliverTheValue) {
  EXPECT_EQ(NotificationHandOver(), "handed over");
  EXPECT_EQ(CondVarHandOver(), "handed over");
  EXPECT_EQ(AwaitHandOver(), "handed over");
}

TEST(UnitSync, TimedWaitsSayWhetherTheyTimedOut) {
  Mutex mu;
  CondVar cv;
  bool never = false;
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(cv.WaitWithTimeout(&mu, absl::Milliseconds(5)));
    EXPECT_FALSE(mu.AwaitWithTimeout(Condition(&never), absl::Milliseconds(5)));
  }
  Notification n;
  EXPECT_FALSE(n.WaitForNotificationWithTimeout(absl::Milliseconds(5)));
  EXPECT_FALSE(n.HasBeenNotified());
  n.Notify();
  EXPECT_TRUE(n.WaitForNotificationWithTimeout(absl::Milliseconds(5)));
  EXPECT_TRUE(n.HasBeenNotified());
  EXPECT_TRUE(mu.TryLock());
  mu.Unlock();
}

// Under TSan: the orderings made through these types are seen (no report), and a real race still is reported. The
// child's exit code is 0 when clean; TSan's halt_on_error (set by .ci/tsan) makes a report exit with 66.
TEST(UnitSync, ThreadSanitizerSeesTheirOrderingsAndStillReportsARace) {
  if (!kTsan) GTEST_SKIP() << "needs a ThreadSanitizer build (bash .ci/tsan)";
  for (const auto& [name, body] : std::initializer_list<std::pair<const char*, std::function<int()>>>{
           {"guarded counter", [] { return GuardedCounter() == 2 * kIterations ? 0 : 1; }},
           {"notification", [] { return NotificationHandOver() == "handed over" ? 0 : 1; }},
           {"condition variable", [] { return CondVarHandOver() == "handed over" ? 0 : 1; }},
           {"await", [] { return AwaitHandOver() == "handed over" ? 0 : 1; }}}) {
    const ChildResult r = RunInChild(body);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    EXPECT_EQ(r.output.find("ThreadSanitizer: data race"), std::string::npos) << name << ":\n" << r.output;
  }
  const ChildResult racy = RunInChild([] {
    UnguardedCounter();
    return 0;
  });
  EXPECT_NE(racy.output.find("ThreadSanitizer: data race"), std::string::npos)
      << "an unguarded counter was not reported; exit " << racy.exit_code << ":\n"
      << racy.output;
}

// Work that starts more work while the set is destroyed: the destructor joins that thread too (it joined once, and the
// second thread's std::thread was destroyed unjoined: std::terminate).
TEST(UnitSync, ReapedThreadsJoinWorkStartedWhileTheyAreDestroyed) {
  std::atomic<bool> second_ran{false};
  std::atomic<bool> leaving{false};
  {
    ReapedThreads threads;
    threads.start([&] {
      while (!leaving.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the destructor is joining this thread by now
      threads.start([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        second_ran = true;
      });
    });
    leaving = true;  // the scope ends next: the destructor runs
  }
  EXPECT_TRUE(second_ran.load());
}

}  // namespace
}  // namespace tandem
