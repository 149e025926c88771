// The one exception type of Tandem's public synchronous API, and the one mapping from exceptions to absl::Status.
//
// Internals return absl::Status; futures carry an absl::Status instead of a value. Where the public API is synchronous
// (rpc_sync, Future::value, init_rpc, shutdown, collectives' argument checks, ...) a failure is thrown as
// tandem::Error, whose message names the worker, the call and the cause, e.g.
//   DEADLINE_EXCEEDED: rpc to worker 'trainer1' (rank 1) calling 'add': no reply within 500 ms
// No other exception type leaves the public API. docs/errors.md has the table of conditions and their codes.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"

namespace tandem {

class Error : public std::runtime_error {
 public:
  // An OK status carries no error: it becomes INTERNAL, so that an Error always has a failing code.
  explicit Error(const absl::Status& status);
  const absl::Status& status() const { return status_; }
  absl::StatusCode code() const { return status_.code(); }

 private:
  absl::Status status_;
};

// The name Tandem used first; kept so that existing code compiles unchanged.
using RpcError = Error;

// Throws Error(status) (INTERNAL for an OK status).
[[noreturn]] void throw_error(absl::Status status);

// Throws Error when `status` is not OK.
inline void throw_if_error(const absl::Status& status) {
  if (!status.ok()) throw_error(status);
}

// The status an exception stands for, the same everywhere an exception becomes an error reply or a failed future:
//   tandem::Error         its own status (a code from a nested call is kept)
//   std::bad_alloc        RESOURCE_EXHAUSTED
//   c10::Error            UNKNOWN, its message without LibTorch's C++ backtrace
//   other std::exception  UNKNOWN, what()
absl::Status status_from_exception(const std::exception& e);
// The same for the exception being handled; call it inside catch (...) only. A non-std exception is UNKNOWN.
absl::Status status_from_current_exception();

}  // namespace tandem
