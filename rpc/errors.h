// The one exception type of Tandem's public synchronous API.
//
// Internals return absl::Status; futures carry an absl::Status instead of a value. Where the public API is synchronous
// (rpc_sync, Future::value, init_rpc, shutdown) a failure is thrown as RpcError, whose message names the worker, the
// call and the cause, e.g.
//   rpc to worker 'trainer1' (rank 1) calling 'add' failed: DEADLINE_EXCEEDED: no reply within 500 ms
#pragma once

#include <stdexcept>
#include <string>

#include "absl/status/status.h"

namespace tandem {

class RpcError : public std::runtime_error {
 public:
  explicit RpcError(const absl::Status& status)
      : std::runtime_error(std::string(absl::StatusCodeToString(status.code())) + ": " + std::string(status.message())),
        status_(status) {}
  const absl::Status& status() const { return status_; }
  absl::StatusCode code() const { return status_.code(); }

 private:
  absl::Status status_;
};

// Throws RpcError when `status` is not OK.
inline void throw_if_error(const absl::Status& status) {
  if (!status.ok()) throw RpcError(status);
}

}  // namespace tandem
