// The distributed autograd attachment of a message (proto/tandem_rpc.proto: AutogradTrace), parsed without side
// effects.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "proto/tandem_rpc.pb.h"

namespace tandem::dist_autograd {

// INVALID_ARGUMENT unless `bytes` is a trace with a non-negative context id and, when it names a send, a non-negative
// send id and distinct indices below `num_tensors` (the message's tensor count).
absl::StatusOr<tandem::wire::AutogradTrace> parse_trace(const std::string& bytes, size_t num_tensors);

}  // namespace tandem::dist_autograd
