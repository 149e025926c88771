#include "tandem/rpc/future.h"

#include <vector>

#include "absl/base/thread_annotations.h"
#include "tandem/log/log.h"
#include "tandem/rpc/detail/wait_slice.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {

struct Future::State {
  State(absl::Time d, std::string w) : deadline(d), what(std::move(w)) {}
  const absl::Time deadline;
  const std::string what;
  mutable Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  c10::IValue value ABSL_GUARDED_BY(mu);
  absl::Status error ABSL_GUARDED_BY(mu);
  std::vector<std::function<void(const Future&)>> callbacks ABSL_GUARDED_BY(mu);
};

Future::Future(absl::Time deadline, std::string what) : state_(std::make_shared<State>(deadline, std::move(what))) {}

Future Future::ready(c10::IValue value) {
  Future f;
  f.set_value(std::move(value));
  return f;
}

Future Future::failed(absl::Status error) {
  Future f;
  f.set_error(std::move(error));
  return f;
}

absl::Time Future::deadline() const { return state_->deadline; }

bool Future::completed() const {
  MutexLock lock(&state_->mu);
  return state_->done;
}

bool Future::wait_for(std::chrono::milliseconds timeout) const {
  if (completed()) return true;
  detail::prefer_prompt_wake();  // woken at once when it completes (detail/wait_slice.h)
  MutexLock lock(&state_->mu);
  const bool* done = &state_->done;
  return state_->mu.AwaitWithTimeout(Condition(done), absl::FromChrono(timeout));
}

absl::Status Future::status() const {
  {
    MutexLock lock(&state_->mu);
    if (state_->done) return state_->error;  // no clock read for the usual, completed case
  }
  absl::Time until = state_->deadline;
  // A call's future completes by its deadline; the margin covers the completion callback itself (the deadline timer's
  // latency and what runs before the future is set), which no option describes.
  constexpr absl::Duration kCompletionMargin = absl::Seconds(2);
  until = until == absl::InfiniteFuture() ? absl::Now() + absl::FromChrono(kDefaultWait) : until + kCompletionMargin;
  detail::prefer_prompt_wake();  // woken at once when it completes (detail/wait_slice.h)
  MutexLock lock(&state_->mu);
  const bool* done = &state_->done;
  if (!state_->mu.AwaitWithDeadline(Condition(done), until)) {
    return absl::DeadlineExceededError(state_->what.empty() ? "future not completed before its deadline"
                                                            : state_->what + ": not completed by its deadline");
  }
  return state_->error;
}

const c10::IValue& Future::value() const {
  throw_if_error(status());
  MutexLock lock(&state_->mu);
  return state_->value;  // immutable once done
}

bool Future::set_value(c10::IValue value) const { return complete(std::move(value), absl::OkStatus()); }

bool Future::set_error(absl::Status error) const {
  if (error.ok()) error = absl::InternalError("future failed with an OK status");
  return complete(c10::IValue(), std::move(error));
}

bool Future::set_status(const absl::Status& status, c10::IValue value) const {
  return status.ok() ? set_value(std::move(value)) : set_error(status);
}

namespace {
// A callback's exception would end the completing thread (an RPC completion thread: std::terminate) and skip the
// callbacks after it: it is logged instead.
void run_callback(const std::function<void(const Future&)>& callback, const Future& future) noexcept {
  try {
    callback(future);
  } catch (...) {
    TANDEM_LOG(kError, "rpc") << "a future's callback threw (dropped; the other callbacks run): "
                              << status_from_current_exception();
  }
}
}  // namespace

bool Future::complete(c10::IValue value, absl::Status error) const {
  std::vector<std::function<void(const Future&)>> callbacks;
  {
    MutexLock lock(&state_->mu);
    if (state_->done) return false;
    state_->value = std::move(value);
    state_->error = std::move(error);
    state_->done = true;
    callbacks.swap(state_->callbacks);
  }
  for (auto& cb : callbacks) run_callback(cb, *this);
  return true;
}

void Future::add_callback(std::function<void(const Future&)> callback) const {
  {
    MutexLock lock(&state_->mu);
    if (!state_->done) {
      state_->callbacks.push_back(std::move(callback));
      return;
    }
  }
  run_callback(callback, *this);
}

Future Future::then(std::function<c10::IValue(const Future&)> fn) const {
  Future next(state_->deadline, state_->what);  // a wait on it that runs out names the same work
  add_callback([next, fn = std::move(fn)](const Future& self) mutable {
    try {
      next.set_value(fn(self));
    } catch (...) {
      next.set_error(status_from_current_exception());
    }
  });
  return next;
}

void forward(const Future& from, const Future& to) {
  from.add_callback([to](const Future& done) {
    const absl::Status s = done.status();
    to.set_status(s, s.ok() ? done.value() : c10::IValue());
  });
}

}  // namespace tandem::rpc
