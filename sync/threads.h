// Threads started for work that may block (a callback, a wait on a transfer), so that the starting thread goes on;
// each is joined once it has finished, by a later start() or by join_all().
//
// Thread-safety: any thread may call start() and join_all(). Errors: std::system_error from start() when no thread can
// be created. The work itself must not throw (as any thread's).
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <thread>
#include <utility>

#include "tandem/sync/sync.h"

namespace tandem {

class ReapedThreads {
 public:
  ReapedThreads() = default;
  ReapedThreads(const ReapedThreads&) = delete;
  ReapedThreads& operator=(const ReapedThreads&) = delete;
  ~ReapedThreads() { join_all(); }

  // Runs `work` on a thread of its own; first joins the threads whose work has ended.
  void start(std::function<void()> work) {
    auto finished = std::make_shared<std::atomic<bool>>(false);
    std::thread thread([work = std::move(work), finished] {
      work();
      finished->store(true);
    });
    MutexLock lock(&mu_);
    for (auto it = threads_.begin(); it != threads_.end();) {
      if (it->second->load()) {
        it->first.join();
        it = threads_.erase(it);
      } else {
        ++it;
      }
    }
    threads_.emplace_back(std::move(thread), std::move(finished));
  }

  // Joins every thread started so far, waiting for as long as its work takes; called without the lock held, so work
  // may start() more (joined by a later call).
  void join_all() {
    std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> threads;
    {
      MutexLock lock(&mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.first.join();
  }

 private:
  Mutex mu_;
  std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem
