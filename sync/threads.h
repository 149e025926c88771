// Threads started for work that may block (a callback, a wait on a transfer), so that the starting thread goes on;
// each is joined once it has finished, by a later start and by join_all().
//
// Thread-safety: any thread may call start(), try_start() and join_all(). Errors: std::system_error from start() when
// no thread can be created. The work itself must not throw (as any thread's).
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <system_error>
#include <thread>
#include <utility>

#include "tandem/sync/sync.h"

namespace tandem {

class ReapedThreads {
 public:
  // At most `max_running` threads run work at once (try_start).
  explicit ReapedThreads(size_t max_running = std::numeric_limits<size_t>::max()) : max_running_(max_running) {}
  ReapedThreads(const ReapedThreads&) = delete;
  ReapedThreads& operator=(const ReapedThreads&) = delete;
  // Joins until none is left: work still running may start more while the others are joined (one join_all() left
  // those in the list, and a std::thread destroyed unjoined ends the process).
  ~ReapedThreads() {
    for (;;) {
      join_all();
      MutexLock lock(&mu_);
      if (threads_.empty()) return;
    }
  }

  // Runs `work` on a thread of its own; first joins the threads whose work has ended. Throws std::system_error when no
  // thread can be made.
  void start(std::function<void()> work) {
    if (!launch(std::move(work), /*capped=*/false))
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
  }
  // The same, unless max_running threads still run their work or no thread can be made: then returns false, `work`
  // not started (the caller runs it itself).
  bool try_start(std::function<void()> work) { return launch(std::move(work), /*capped=*/true); }

  // Joins every thread started so far, waiting for as long as its work takes (bounded by the work's own deadlines);
  // called without the lock held, so work may start more (joined by a later call). A thread of this set that calls it
  // is detached instead of joined (it is still running its work).
  void join_all() {
    std::list<Entry> threads;
    {
      MutexLock lock(&mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) {
      if (t.thread.get_id() == std::this_thread::get_id()) {
        t.thread.detach();
      } else {
        t.thread.join();
      }
    }
  }

 private:
  struct Entry {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };

  bool launch(std::function<void()> work, bool capped) {
    std::list<Entry> done;  // joined below, without the lock
    bool started = false;
    {
      MutexLock lock(&mu_);
      for (auto it = threads_.begin(); it != threads_.end();) {
        auto next = std::next(it);
        if (it->finished->load()) done.splice(done.end(), threads_, it);
        it = next;
      }
      if (!capped || threads_.size() < max_running_) {
        auto finished = std::make_shared<std::atomic<bool>>(false);
        try {
          std::thread thread([work = std::move(work), finished] {
            work();
            finished->store(true);
          });
          threads_.push_back(Entry{std::move(thread), std::move(finished)});
          started = true;
        } catch (const std::system_error&) {
          started = false;
        }
      }
    }
    for (auto& t : done) t.thread.join();
    return started;
  }

  const size_t max_running_;
  Mutex mu_;
  std::list<Entry> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem
