// NoteBatcher: small one-way notes to other workers, sent in batches per destination.
//
// A note is a few int64 values for a registered function on another worker (an RRef's delete, a distributed autograd
// context's release). The notes for one (worker, function) pair travel together, as one call whose only argument is
// the flat list of their values, so a protocol that sends many short notes costs a message per batch, not per note.
// The receiving function must accept such a list.
//
// When a batch goes is the Policy (the users need different ones, see the enum). A batch lost on the way
// (DEADLINE_EXCEEDED) or whose connection broke (UNAVAILABLE) is sent again, Options::attempts times in all; a batch
// that failed for good is reported to Options::on_failure.
//
// Lifetime: calls in flight refer to the batcher, so it must outlive them; its users are process-lifetime singletons.
// Thread-safety: all methods may be called from any thread. on_failure and the completion of add_tracked's futures run
// on the thread that completes the batch's call.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tandem/rpc/future.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::detail {

class NoteBatcher {
 public:
  enum class Policy {
    // A pair's notes go at once when none of its batches is in flight, else together when that batch completes
    // (after its attempts): one message per round trip, however fast notes come.
    kOneInFlight,
    // A thread of the batcher's own sends every queued note Options::flush_delay after the first of them was queued,
    // or at once when a pair holds Options::max_values values; it sleeps while nothing is queued. Batches of one pair
    // may overlap.
    kEveryDelay,
  };

  struct Options {
    Policy policy = Policy::kOneInFlight;
    absl::Duration flush_delay = absl::Milliseconds(1);  // kEveryDelay only
    size_t max_values = 0;                               // kEveryDelay only; 0: no limit
    // Calls per batch. More than 1 only for functions that may safely receive the same notes twice.
    int attempts = 1;
    // Called once for each batch that failed for good: its destination and function, the last attempt's error, and
    // the number of notes it carried. Optional.
    std::function<void(int to, const std::string& function, const absl::Status& error, int64_t notes)> on_failure;
  };

  explicit NoteBatcher(Options options);
  // Drops what is queued and ends the thread (see stop()).
  ~NoteBatcher();
  NoteBatcher(const NoteBatcher&) = delete;
  NoteBatcher& operator=(const NoteBatcher&) = delete;

  // Queues a note: `values` are appended to the next batch of `function` on worker `to`.
  void add(int to, const std::string& function, std::initializer_list<int64_t> values);
  // The same, and a future that completes with the outcome of the batch carrying the note. Its deadline covers the
  // batch ahead of it (kOneInFlight) or the flush delay (kEveryDelay), and every attempt's RPC timeout.
  Future add_tracked(int to, const std::string& function, std::initializer_list<int64_t> values);
  // Sends `values` (a note each) to `function` on worker `to` at once, as a batch of their own, outside the queue:
  // never behind a batch in flight, nor holding one back (for notes whose sender waits for their reply while replying
  // itself, where waiting behind a batch could close a ring of waits). Attempts and on_failure as for any batch; the
  // future completes with its outcome.
  Future send_now(int to, const std::string& function, std::vector<int64_t> values);
  // Sends what is queued now (a graceful shutdown's drain). Under kOneInFlight notes only ever wait behind a batch in
  // flight, which sends them when it completes: nothing to do.
  void flush();
  // RPC stopped: drops the queued notes (their futures fail with CANCELLED) and ends the thread. Batches in flight
  // complete as their calls do. The batcher may be used again afterwards.
  void stop();
  // Calls made so far (each batch's attempts, failed ones included), counted once rpc::call returned; for tests.
  int64_t calls_made() const { return calls_made_.load(std::memory_order_acquire); }

 private:
  using Key = std::pair<int, std::string>;  // destination, function
  struct Pending {
    bool in_flight = false;  // kOneInFlight only
    std::vector<int64_t> values;
    std::vector<Future> waiters;
    int64_t notes = 0;
  };
  struct Batch {
    Key key;
    std::vector<int64_t> values;
    std::vector<Future> waiters;
    int64_t notes = 0;
    bool queued = true;  // false: send_now's, outside the pair's queue (its completion sends nothing next)
  };

  void queue(int to, const std::string& function, std::initializer_list<int64_t> values, const Future* waiter);
  static Batch take(const Key& key, Pending& pending);
  std::vector<Batch> take_all_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kEveryDelay: some pair's batch holds max_values values.
  bool full_locked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void send(Batch batch, int attempts);
  void send_next(const Key& key);
  void loop();
  absl::Duration batch_bound() const;  // a batch's attempts, each within the RPC timeout
  absl::Duration wait_bound() const;   // a tracked note's: the batch ahead of it, or the flush delay, and its own

  const Options options_;
  std::atomic<int64_t> calls_made_{0};
  Mutex mu_;
  CondVar cv_;  // kEveryDelay: wakes the thread (the first note queued, a full batch, stop())
  std::map<Key, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // kEveryDelay: started by the first note
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// The options of a batcher of releases (of remote objects, of autograd contexts): kOneInFlight, so that a loop that
// releases one a step sends a message per round trip, and each batch sent up to 3 times (a lost message must not leave
// what it released on the callee for good), so the receiving functions take a list of ids and must accept an id twice
// (or one already gone). `on_failure` as Options'.
NoteBatcher::Options release_options(
    std::function<void(int to, const std::string& function, const absl::Status& error, int64_t notes)> on_failure);

// Releases of remote objects that nobody waits for (a pipeline's stages, a distributed optimizer's shards): one
// process-wide batcher with release_options(). A batch that still fails is logged as a warning naming the worker, the
// function and the cause (not when RPC is stopping here: CANCELLED): the objects then live until that worker's RPC
// stops.
NoteBatcher& releases();

}  // namespace tandem::rpc::detail
