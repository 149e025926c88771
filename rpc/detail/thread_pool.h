// A fixed pool of threads running registered functions, so that gRPC's own threads never run user code.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "tandem/rpc/detail/wait_slice.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::detail {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this] {
        drop_inherited_wait_slice();  // its tasks compute at length (wait_slice.h)
        run();
      });
    }
  }
  ~ThreadPool() { stop(); }

  // Returns false once stopped (the task is not run).
  bool submit(std::function<void()> task) {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    return true;
  }

  // Runs what is queued, then joins. Returns false, leaving the threads running detached-in-spirit (not joined), when
  // they do not finish by `timeout` — a registered function that never returns must not hang shutdown. A negative
  // timeout (the default, for pools whose tasks always return) waits for them; the agent always passes its grace.
  bool stop(std::chrono::milliseconds timeout = std::chrono::milliseconds(-1)) {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && busy_ == 0; };
      if (timeout.count() >= 0 && !mu_.AwaitWithTimeout(Condition(&idle), absl::FromChrono(timeout))) {
        return false;
      }
    }
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    return true;
  }

 private:
  void run() {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
    MutexLock lock(&mu_);
    for (;;) {
      mu_.Await(Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      auto task = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
      mu_.Unlock();
      task();
      task = nullptr;  // the task's captures die outside the lock too
      mu_.Lock();
      --busy_;
    }
  }

  Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // set in the constructor, then only joined
};

}  // namespace tandem::rpc::detail
