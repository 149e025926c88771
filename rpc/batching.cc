// Batched functions: a queue of requests per function, flushed by count or by the oldest request's age.
#include "tandem/rpc/batching.h"

#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/detail/wait_slice.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {
namespace {

using Clock = std::chrono::steady_clock;

class Batcher : public std::enable_shared_from_this<Batcher> {
 public:
  Batcher(std::string name, BatchOptions options, BatchHandler handler)
      : name_(std::move(name)), options_(options), handler_(std::move(handler)) {}

  // The flushing thread holds the batcher: both live until the function is unregistered (retire()).
  void start() {
    std::thread([self = shared_from_this()] {
      detail::drop_inherited_wait_slice();  // it runs the batched function (detail/wait_slice.h)
      self->flush_loop();
    }).detach();
  }

  Future enqueue(std::vector<c10::IValue>&& args) {
    Future reply;
    size_t batches;
    {
      MutexLock lock(&mu_);  // unlocking wakes the flushing thread, which starts timing the oldest request
      if (waiting_ >= options_.max_waiting) {
        ++stats_.refused;
        const std::string running =
            running_since_ == Clock::time_point()
                ? std::string()
                : absl::StrCat(
                      "; the batch running has run for ",
                      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - running_since_).count(),
                      " ms");
        return Future::failed(absl::ResourceExhaustedError(
            absl::StrCat("batched function '", name_, "' has ", waiting_, " requests waiting (max_waiting ",
                         options_.max_waiting, "): its batches run slower than its calls come", running)));
      }
      pending_.push_back(Pending{std::move(args), reply, Clock::now()});
      ++waiting_;
      if (pending_.size() < options_.max_batch) return reply;
      ++stats_.full_batches;
      if (!form_locked(&batches)) return reply;
    }
    drain(batches);
    return reply;
  }

  absl::Status set_max_batch(size_t n) {
    size_t batches;
    {
      MutexLock lock(&mu_);
      if (n > options_.max_waiting) {
        return absl::InvalidArgumentError(absl::StrCat("batched function '", name_, "': max_batch ", n,
                                                       " exceeds its max_waiting ", options_.max_waiting));
      }
      options_.max_batch = n;
      if (pending_.empty() || pending_.size() < n) return absl::OkStatus();
      ++stats_.full_batches;
      if (!form_locked(&batches)) return absl::OkStatus();
    }
    drain(batches);
    return absl::OkStatus();
  }

  // The function was unregistered and no call is under way (its registration, which every call holds, is gone): the
  // requests still waiting run at once, then the flushing thread ends.
  void retire() {
    MutexLock lock(&mu_);
    retired_ = true;
  }

  BatchStats stats() {
    MutexLock lock(&mu_);
    BatchStats s = stats_;
    s.max_batch = static_cast<int64_t>(options_.max_batch);
    return s;
  }

 private:
  struct Pending {
    std::vector<c10::IValue> args;
    Future reply;
    Clock::time_point arrived;
  };

  void flush_loop() {
    auto some = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !pending_.empty() || handoff_ || retired_; };
    MutexLock lock(&mu_);
    for (;;) {
      mu_.Await(Condition(&some));
      if (handoff_) {  // a caller's thread ran its own batch; the ones formed meanwhile are this thread's to run
        handoff_ = false;
        mu_.Unlock();
        drain(std::numeric_limits<size_t>::max());
        mu_.Lock();
        continue;
      }
      if (retired_) {    // no call can come any more: what waits runs now, then this thread ends
        if (running_) {  // a thread still runs batches (none should: calls are over): it finishes or hands them over
          auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !running_ || handoff_; };
          mu_.Await(Condition(&idle));
          continue;
        }
        if (pending_.empty() && ready_.empty()) return;
        size_t batches;
        if (!pending_.empty()) (void)form_locked(&batches);
        running_ = true;  // also for batches a thread left in ready_ when it threw (drain): nobody else runs them
        mu_.Unlock();
        drain(std::numeric_limits<size_t>::max());
        mu_.Lock();
        continue;
      }
      // The oldest request's age; a full batch sent meanwhile leaves pending_ empty (wait again) or newer.
      const auto oldest = pending_.front().arrived;
      auto gone = [this, oldest]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_.empty() || pending_.front().arrived != oldest || handoff_ || retired_;
      };
      if (mu_.AwaitWithTimeout(Condition(&gone), absl::FromChrono(oldest + options_.max_delay - Clock::now()))) {
        continue;
      }
      size_t batches;
      if (!form_locked(&batches)) continue;
      mu_.Unlock();
      drain(std::numeric_limits<size_t>::max());
      mu_.Lock();
    }
  }

  // Moves the waiting requests into a batch at the end of ready_: batches run in the order they were formed. Returns
  // whether the calling thread is to run them (no thread runs batches now): then *batches is how many are ready,
  // its own the last of them.
  bool form_locked(size_t* batches) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ready_.emplace_back();
    ready_.back().swap(pending_);
    if (running_) return false;
    running_ = true;
    *batches = ready_.size();
    return true;
  }

  // Runs the ready batches in order, `limit` of them at most: a caller's thread runs up to its own batch and hands
  // the ones formed meanwhile to the flushing thread, so that its caller's reply is not held back by others' batches
  // (nor a transport's thread kept from its other connections). No thread waits for a batch's turn: a batched
  // function that never returns holds one thread, never the RPC threads of the calls that arrive behind it.
  void drain(size_t limit) {
    for (size_t done = 0;; ++done) {
      std::vector<Pending> next;
      {
        MutexLock lock(&mu_);
        if (ready_.empty()) {
          running_ = false;
          return;
        }
        if (done == limit) {
          handoff_ = true;  // running_ stays set: the flushing thread runs the rest, and no one else meanwhile
          return;
        }
        next = std::move(ready_.front());
        ready_.pop_front();
        waiting_ -= next.size();
        running_since_ = Clock::now();
      }
      try {
        run_one(std::move(next));
      } catch (...) {  // not the user's function (run_one catches that): the next batch formed runs the rest
        MutexLock lock(&mu_);
        running_ = false;
        throw;
      }
    }
  }

  void run_one(std::vector<Pending> batch) {
    std::vector<std::vector<c10::IValue>> requests;
    requests.reserve(batch.size());
    for (auto& p : batch) requests.push_back(std::move(p.args));
    absl::Status error;
    std::vector<absl::StatusOr<c10::IValue>> results;
    {
      // As a served call's function (agent_server.cc's run()), the batch's operators go into a running profile,
      // whichever thread runs it (a caller's or the batcher's own), within one range naming the function and the
      // batch's size (profile.h). Each request's own range (rpc_serve#) is the agent's, as for any call.
      profile::OnThisThread profiled;
      const Clock::time_point started = Clock::now();
      try {
        results = handler_(requests);
        if (results.size() != batch.size()) {  // the user's function is wrong, not Tandem: as if it had thrown
          error = absl::UnknownError(absl::StrCat("batched function '", name_, "' returned ", results.size(),
                                                  " results for ", batch.size(), " requests"));
        }
      } catch (...) {
        const absl::Status thrown = status_from_current_exception();
        error = absl::Status(thrown.code(), absl::StrCat("batched function '", name_, "' threw: ", thrown.message()));
      }
      if (profile::active()) {
        profile::report_steady(absl::StrCat("rpc_batch#", name_, "(", batch.size(),
                                            batch.size() == 1 ? " request)" : " requests)"),
                               started, Clock::now());
      }
    }
    {
      MutexLock lock(&mu_);
      ++stats_.batches;
      stats_.requests += static_cast<int64_t>(batch.size());
      running_since_ = Clock::time_point();
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!error.ok()) {
        batch[i].reply.set_error(error);
      } else if (!results[i].ok()) {
        batch[i].reply.set_error(results[i].status());
      } else {
        batch[i].reply.set_value(*std::move(results[i]));
      }
    }
  }

  const std::string name_;
  Mutex mu_;
  BatchOptions options_ ABSL_GUARDED_BY(mu_);  // max_delay never changes; max_batch does
  const BatchHandler handler_;
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  BatchStats stats_ ABSL_GUARDED_BY(mu_);
  std::deque<std::vector<Pending>> ready_ ABSL_GUARDED_BY(mu_);  // batches formed and not run yet, oldest first
  bool running_ ABSL_GUARDED_BY(mu_) = false;                    // a thread runs ready_'s batches (drain)
  bool handoff_ ABSL_GUARDED_BY(mu_) = false;                    // ...and the flushing thread is to take over from it
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;                      // requests in pending_ and ready_
  Clock::time_point running_since_ ABSL_GUARDED_BY(mu_);         // when the batch running started (none: epoch)
  bool retired_ ABSL_GUARDED_BY(mu_) = false;                    // unregistered: the flushing thread ends
};

// A batched function's registration, held by its registered handler (and so by every copy of it: calls being
// delivered, callers of find_function): when the function is unregistered and the last copy is gone, the batcher
// retires.
struct Registration {
  explicit Registration(std::shared_ptr<Batcher> b) : batcher(std::move(b)) {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration() { batcher->retire(); }
  const std::shared_ptr<Batcher> batcher;
};

Mutex g_mu(absl::kConstInit);
// The registered batched functions (an entry expires when its function is unregistered).
std::map<std::string, std::weak_ptr<Registration>>& batchers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  static auto* m = new std::map<std::string, std::weak_ptr<Registration>>;
  return *m;
}

// The batched function registered as `name` now, or null.
std::shared_ptr<Registration> find_batched(const std::string& name) {
  MutexLock lock(&g_mu);
  auto it = batchers().find(name);
  if (it == batchers().end()) return nullptr;
  std::shared_ptr<Registration> r = it->second.lock();
  if (!r) batchers().erase(it);
  return r;
}

}  // namespace

absl::Status register_batched_handler(const std::string& name, BatchOptions options, BatchHandler handler) {
  if (options.max_batch == 0) return absl::InvalidArgumentError("a batched function needs max_batch of at least 1");
  if (options.max_waiting < options.max_batch) {
    return absl::InvalidArgumentError("a batched function's max_waiting must be at least its max_batch");
  }
  auto batcher = std::make_shared<Batcher>(name, options, std::move(handler));
  auto registration = std::make_shared<Registration>(batcher);
  {
    // Registered and published under one lock: another thread's unregister and register of the same name cannot
    // publish its registration between the two and then be overwritten by this one's (then expired) entry. Lock
    // order: g_mu, then the registry's (unregister_function destroys a handler, and so may end a Registration,
    // after it lets go of the registry's lock, and ~Registration takes neither).
    MutexLock lock(&g_mu);
    absl::Status s = register_handler(name, [registration](std::vector<c10::IValue>&& args) {
      return registration->batcher->enqueue(std::move(args));
    });
    if (!s.ok()) return s;
    auto& published = batchers();
    for (auto it = published.begin(); it != published.end();) {  // functions unregistered since: their entries go
      it = it->second.expired() ? published.erase(it) : std::next(it);
    }
    published[name] = registration;
  }
  batcher->start();
  return absl::OkStatus();
}

absl::Status set_max_batch(const std::string& name, size_t max_batch) {
  if (max_batch == 0) return absl::InvalidArgumentError("a batched function needs max_batch of at least 1");
  const std::shared_ptr<Registration> r = find_batched(name);
  if (!r) return absl::NotFoundError("no batched function '" + name + "' is registered here");
  return r->batcher->set_max_batch(max_batch);
}

BatchStats batch_stats(const std::string& name) {
  const std::shared_ptr<Registration> r = find_batched(name);
  return r ? r->batcher->stats() : BatchStats{};
}

}  // namespace tandem::rpc
