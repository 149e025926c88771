// A fixed pool of threads running registered functions, so that gRPC's own threads never run user code.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::rpc::detail {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
  }
  ~ThreadPool() { stop(); }

  // Returns false once stopped (the task is not run).
  bool submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return false;
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
    return true;
  }

  // Runs what is queued, then joins. Returns false, leaving the threads running detached-in-spirit (not joined), when
  // they do not finish by `timeout` — a registered function that never returns must not hang shutdown. A negative
  // timeout (the default, for pools whose tasks always return) waits for them; the agent always passes its grace.
  bool stop(std::chrono::milliseconds timeout = std::chrono::milliseconds(-1)) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
      if (timeout.count() >= 0 && !idle_cv_.wait_for(lock, timeout, [this] { return queue_.empty() && busy_ == 0; })) {
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
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      auto task = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
      lock.unlock();
      task();
      lock.lock();
      --busy_;
      if (queue_.empty() && busy_ == 0) idle_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  int busy_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem::rpc::detail
