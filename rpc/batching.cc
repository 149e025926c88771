// Batched functions: a queue of requests per function, flushed by count or by the oldest request's age.
#include "tandem/rpc/batching.h"

#include <map>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
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

  // The flushing thread holds the batcher: both live until the process ends.
  void start() {
    std::thread([self = shared_from_this()] {
      detail::drop_inherited_wait_slice();  // it runs the batched function (detail/wait_slice.h)
      self->flush_loop();
    }).detach();
  }

  Future enqueue(std::vector<c10::IValue>&& args) {
    Future reply;
    std::vector<Pending> batch;
    int64_t seq;
    {
      MutexLock lock(&mu_);  // unlocking wakes the flushing thread, which starts timing the oldest request
      pending_.push_back(Pending{std::move(args), reply, Clock::now()});
      if (pending_.size() < options_.max_batch) return reply;
      seq = take_batch_locked(&batch);
      ++stats_.full_batches;
    }
    run(seq, std::move(batch));
    return reply;
  }

  void set_max_batch(size_t n) {
    std::vector<Pending> batch;
    int64_t seq;
    {
      MutexLock lock(&mu_);
      options_.max_batch = n;
      if (pending_.empty() || pending_.size() < n) return;
      seq = take_batch_locked(&batch);
      ++stats_.full_batches;
    }
    run(seq, std::move(batch));
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
    auto some = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !pending_.empty(); };
    MutexLock lock(&mu_);
    for (;;) {
      mu_.Await(Condition(&some));
      // The oldest request's age; a full batch sent meanwhile leaves pending_ empty (wait again) or newer.
      const auto oldest = pending_.front().arrived;
      auto gone = [this, oldest]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_.empty() || pending_.front().arrived != oldest;
      };
      if (mu_.AwaitWithTimeout(Condition(&gone), absl::FromChrono(oldest + options_.max_delay - Clock::now()))) {
        continue;
      }
      std::vector<Pending> batch;
      const int64_t seq = take_batch_locked(&batch);
      mu_.Unlock();
      run(seq, std::move(batch));
      mu_.Lock();
    }
  }

  // Moves the waiting requests into `batch` and numbers it: batches run in that order.
  int64_t take_batch_locked(std::vector<Pending>* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    batch->swap(pending_);
    return next_formed_++;
  }

  // Hands batch number `seq` over to run once every batch formed before it has run; batches of this function never
  // overlap. No thread waits for its turn: the thread that finds no batch running runs, in order, every batch that is
  // ready (its own, and those handed over meanwhile); the others return at once. So a batched function that never
  // returns holds one thread, never the RPC threads of the calls that arrive behind it (their callers time out).
  void run(int64_t seq, std::vector<Pending> batch) {
    {
      MutexLock lock(&run_mu_);
      ready_.emplace(seq, std::move(batch));
      if (running_) return;
      running_ = true;
    }
    for (;;) {
      std::vector<Pending> next;
      {
        MutexLock lock(&run_mu_);
        auto it = ready_.find(next_to_run_);
        // The batch formed before it may still be on its way here (its thread has not taken run_mu_ yet): that
        // thread runs it, and the rest, when it comes.
        if (it == ready_.end()) {
          running_ = false;
          return;
        }
        next = std::move(it->second);
        ready_.erase(it);
        ++next_to_run_;
      }
      run_one(std::move(next));
    }
  }

  void run_one(std::vector<Pending> batch) {
    std::vector<std::vector<c10::IValue>> requests;
    requests.reserve(batch.size());
    for (auto& p : batch) requests.push_back(std::move(p.args));
    absl::Status error;
    std::vector<absl::StatusOr<c10::IValue>> results;
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
    {
      MutexLock lock(&mu_);
      ++stats_.batches;
      stats_.requests += static_cast<int64_t>(batch.size());
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
  int64_t next_formed_ ABSL_GUARDED_BY(mu_) = 0;  // the number the next batch formed gets
  Mutex run_mu_;                                  // batches formed and not yet run
  std::map<int64_t, std::vector<Pending>> ready_ ABSL_GUARDED_BY(run_mu_);
  int64_t next_to_run_ ABSL_GUARDED_BY(run_mu_) = 0;
  bool running_ ABSL_GUARDED_BY(run_mu_) = false;  // a thread is running batches
};

Mutex g_mu(absl::kConstInit);
std::map<std::string, std::shared_ptr<Batcher>>& batchers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  static auto* m = new std::map<std::string, std::shared_ptr<Batcher>>;
  return *m;
}

}  // namespace

absl::Status register_batched_handler(const std::string& name, BatchOptions options, BatchHandler handler) {
  if (options.max_batch == 0) return absl::InvalidArgumentError("a batched function needs max_batch of at least 1");
  auto batcher = std::make_shared<Batcher>(name, options, std::move(handler));
  absl::Status s =
      register_handler(name, [batcher](std::vector<c10::IValue>&& args) { return batcher->enqueue(std::move(args)); });
  if (!s.ok()) return s;
  {
    MutexLock lock(&g_mu);
    batchers()[name] = batcher;
  }
  batcher->start();
  return absl::OkStatus();
}

absl::Status set_max_batch(const std::string& name, size_t max_batch) {
  if (max_batch == 0) return absl::InvalidArgumentError("a batched function needs max_batch of at least 1");
  std::shared_ptr<Batcher> batcher;
  {
    MutexLock lock(&g_mu);
    auto it = batchers().find(name);
    if (it == batchers().end()) return absl::NotFoundError("no batched function '" + name + "' is registered here");
    batcher = it->second;
  }
  batcher->set_max_batch(max_batch);
  return absl::OkStatus();
}

BatchStats batch_stats(const std::string& name) {
  MutexLock lock(&g_mu);
  auto it = batchers().find(name);
  return it == batchers().end() ? BatchStats{} : it->second->stats();
}

}  // namespace tandem::rpc
