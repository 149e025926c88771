#include "tandem/rpc/detail/note_batcher.h"

#include <iterator>

#include "tandem/log/log.h"
#include "tandem/rpc/convert.h"
#include "tandem/rpc/rpc.h"

namespace tandem::rpc::detail {
namespace {

// How long the kEveryDelay thread sleeps at most while nothing is queued (it is woken when something is).
constexpr absl::Duration kIdleCheck = absl::Seconds(1);

// The call never reached the function, or its reply never came back: the batch may be sent again.
bool lost(const absl::Status& s) {
  return s.code() == absl::StatusCode::kDeadlineExceeded || s.code() == absl::StatusCode::kUnavailable;
}

}  // namespace

NoteBatcher::NoteBatcher(Options options) : options_(std::move(options)) {}

NoteBatcher::~NoteBatcher() { stop(); }

void NoteBatcher::add(int to, const std::string& function, std::initializer_list<int64_t> values) {
  queue(to, function, values, nullptr);
}

Future NoteBatcher::add_tracked(int to, const std::string& function, std::initializer_list<int64_t> values) {
  Future done(absl::Now() + wait_bound());
  queue(to, function, values, &done);
  return done;
}

Future NoteBatcher::send_now(int to, const std::string& function, std::vector<int64_t> values) {
  Future done(absl::Now() + batch_bound());
  const auto notes = static_cast<int64_t>(values.size());
  Batch batch{Key(to, function), std::move(values), {done}, notes};
  batch.queued = false;
  send(std::move(batch), options_.attempts);
  return done;
}

absl::Duration NoteBatcher::batch_bound() const { return options_.attempts * absl::FromChrono(rpc::default_timeout()); }

absl::Duration NoteBatcher::wait_bound() const {
  const absl::Duration batch = batch_bound();
  return options_.policy == Policy::kOneInFlight ? 2 * batch : options_.flush_delay + batch;
}

void NoteBatcher::queue(int to, const std::string& function, std::initializer_list<int64_t> values,
                        const Future* waiter) {
  Key key(to, function);
  Batch batch;
  {
    MutexLock lock(&mu_);
    Pending& p = pending_[key];
    p.values.insert(p.values.end(), values);
    ++p.notes;
    if (waiter) p.waiters.push_back(*waiter);
    if (options_.policy == Policy::kEveryDelay) {
      if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { loop(); });
      // The first note queued starts the thread's flush delay; a full batch ends it.
      if ((pending_.size() == 1 && p.notes == 1) ||
          (options_.max_values > 0 && p.values.size() >= options_.max_values)) {
        cv_.Signal();
      }
      return;
    }
    if (p.in_flight) return;  // goes when the batch ahead completes
    p.in_flight = true;
    batch = take(key, p);
  }
  send(std::move(batch), options_.attempts);
}

bool NoteBatcher::full_locked() const {
  if (options_.max_values == 0) return false;
  for (const auto& [key, p] : pending_) {
    if (p.values.size() >= options_.max_values) return true;
  }
  return false;
}

NoteBatcher::Batch NoteBatcher::take(const Key& key, Pending& pending) {
  return Batch{key, std::exchange(pending.values, {}), std::exchange(pending.waiters, {}),
               std::exchange(pending.notes, 0)};
}

std::vector<NoteBatcher::Batch> NoteBatcher::take_all_locked() {
  std::vector<Batch> batches;
  for (auto& [key, p] : pending_) batches.push_back(take(key, p));
  pending_.clear();
  return batches;
}

void NoteBatcher::send(Batch batch, int attempts) {
  Future sent = rpc::call(batch.key.first, batch.key.second, {rpc::to_ivalue(batch.values)});
  calls_made_.fetch_add(1, std::memory_order_release);
  sent.add_callback([this, batch = std::move(batch), attempts](const Future& reply) mutable {
    const absl::Status s = reply.status();
    if (!s.ok() && lost(s) && attempts > 1) return send(std::move(batch), attempts - 1);
    if (!s.ok() && options_.on_failure) options_.on_failure(batch.key.first, batch.key.second, s, batch.notes);
    for (const Future& w : batch.waiters) w.set_status(s);
    if (options_.policy == Policy::kOneInFlight && batch.queued) send_next(batch.key);
  });
}

void NoteBatcher::send_next(const Key& key) {
  Batch next;
  {
    MutexLock lock(&mu_);
    auto it = pending_.find(key);
    if (it == pending_.end()) return;
    Pending& p = it->second;
    if (p.values.empty()) {
      pending_.erase(it);  // nothing in flight for this pair any more
      return;
    }
    next = take(key, p);
  }
  send(std::move(next), options_.attempts);
}

void NoteBatcher::flush() {
  std::vector<Batch> batches;
  {
    MutexLock lock(&mu_);
    if (options_.policy != Policy::kEveryDelay) return;
    batches = take_all_locked();
  }
  for (auto& b : batches) send(std::move(b), options_.attempts);
}

void NoteBatcher::stop() {
  std::thread thread;
  std::vector<Future> dropped;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto it = pending_.begin(); it != pending_.end();) {
      Batch gone = take(it->first, it->second);
      dropped.insert(dropped.end(), gone.waiters.begin(), gone.waiters.end());
      // A pair with a batch in flight keeps its entry: the batch's completion ends it (send_next).
      it = it->second.in_flight ? std::next(it) : pending_.erase(it);
    }
    thread = std::move(thread_);
  }
  cv_.SignalAll();
  if (thread.joinable()) thread.join();
  for (const Future& w : dropped) w.set_error(absl::CancelledError("RPC stopped before the note was sent"));
  MutexLock lock(&mu_);
  stopping_ = false;
}

void NoteBatcher::loop() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    // Asleep while nothing is queued (an idle worker is not woken every flush_delay); once a note is, its batch goes
    // a flush_delay later, or at once when a pair's batch is full.
    if (pending_.empty()) {
      cv_.WaitWithTimeout(&mu_, kIdleCheck);  // woken by the first note or stop(); bounded all the same
      continue;
    }
    if (!full_locked()) cv_.WaitWithTimeout(&mu_, options_.flush_delay);
    if (pending_.empty()) continue;
    std::vector<Batch> batches = take_all_locked();
    mu_.Unlock();
    for (auto& b : batches) send(std::move(b), options_.attempts);
    mu_.Lock();
  }
}

constexpr int kReleaseAttempts = 3;

NoteBatcher::Options release_options(
    std::function<void(int to, const std::string& function, const absl::Status& error, int64_t notes)> on_failure) {
  NoteBatcher::Options o;
  o.policy = NoteBatcher::Policy::kOneInFlight;
  o.attempts = kReleaseAttempts;
  o.on_failure = std::move(on_failure);
  return o;
}

NoteBatcher& releases() {
  static auto* batcher = new NoteBatcher(  // never destroyed: calls in flight refer to it
      release_options([](int to, const std::string& function, const absl::Status& error, int64_t notes) {
        if (error.code() == absl::StatusCode::kCancelled) return;  // RPC stops here: nothing more can be sent
        TANDEM_LOG(kWarn, "rpc") << "releasing " << notes << " object(s) with '" << function << "' on worker " << to
                                 << " failed (sent " << kReleaseAttempts
                                 << " times; they stay until that worker stops): " << error;
      }));
  return *batcher;
}

}  // namespace tandem::rpc::detail
