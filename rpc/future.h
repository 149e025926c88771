// Future: the result of an asynchronous call, or of a registered function that completes later ("async execution").
//
// A Future is a cheap, copyable handle to shared state; copies see the same result. It completes exactly once, with a
// value (c10::IValue) or an error (absl::Status); later completions are ignored and reported by the return value.
//
// Waiting is always bounded. A future returned by rpc_async carries the call's deadline and is guaranteed to complete
// by then (with DEADLINE_EXCEEDED if nothing else happened); every other future Tandem returns (collectives, RRefs,
// when_all, ...) carries the deadline of the work behind it, derived from the timeouts the user set. value()/status()
// wait until the future's deadline, or kDefaultWait for a future created by user code without one.
//
// Errors: a failed future holds an absl::Status; value() throws it as tandem::Error (rpc/errors.h). docs/errors.md
// lists the codes.
//
// Callbacks always fire exactly once: inline in add_callback() when already completed, otherwise on the thread that
// completes the future (for RPC replies, a gRPC completion thread: keep callbacks short and non-blocking).
// A callback that throws has its exception logged (kError, "rpc") and dropped; the other callbacks run.
//
// Thread-safety: all methods may be called concurrently from any thread.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tandem/rpc/convert.h"
#include "tandem/rpc/errors.h"

namespace tandem::rpc {

class Future {
 public:
  // How long value()/status() wait on a future without a deadline. Only futures made by user code (Future()) have
  // none, and no option describes them: a fixed bound keeps a forgotten set_value() from blocking a thread for ever.
  static constexpr std::chrono::milliseconds kDefaultWait{std::chrono::minutes(5)};

  // A new pending future. `deadline` bounds value()/status() (absl::InfiniteFuture() means kDefaultWait from the call).
  // `what` names the work it stands for in the error of a wait that runs out ("process group 'g' (rank 1 of 2),
  // allreduce of 4096 bytes: not completed by its deadline"); without it the error names nothing.
  explicit Future(absl::Time deadline = absl::InfiniteFuture(), std::string what = "");

  // A future that is already completed.
  static Future ready(c10::IValue value);
  static Future failed(absl::Status error);

  bool completed() const;
  // Waits up to `timeout`; returns whether the future is completed.
  bool wait_for(std::chrono::milliseconds timeout) const;

  // Waits (bounded, see above). OK when the future holds a value; DEADLINE_EXCEEDED when the wait ran out.
  absl::Status status() const;
  // Waits (bounded) and returns the value; throws tandem::Error when the future failed or the wait ran out.
  const c10::IValue& value() const;
  template <typename T>
  T get() const {
    return from_ivalue<T>(value());
  }

  // Completes the future. Returns false (and changes nothing) when it was already completed.
  bool set_value(c10::IValue value) const;
  bool set_error(absl::Status error) const;
  // set_value(value) when `status` is OK, else set_error(status): for passing on the outcome of other work.
  bool set_status(const absl::Status& status, c10::IValue value = c10::IValue()) const;

  void add_callback(std::function<void(const Future&)> callback) const;
  // A future completed with fn(*this) once this one completes, with this one's deadline. An exception thrown by fn
  // fails the returned future with status_from_exception (rpc/errors.h): a tandem::Error (e.g. from value() on a failed
  // future) keeps its code, any other exception is UNKNOWN.
  Future then(std::function<c10::IValue(const Future&)> fn) const;

  absl::Time deadline() const;

 private:
  struct State;
  explicit Future(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool complete(c10::IValue value, absl::Status error) const;
  std::shared_ptr<State> state_;
};

// Completes `to` with `from`'s value or error once `from` completes (at once when it has; on the completing thread
// otherwise). `to` keeps its own deadline.
void forward(const Future& from, const Future& to);

}  // namespace tandem::rpc
