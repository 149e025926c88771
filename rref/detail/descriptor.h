// The wire form of a remote reference (proto/tandem_rpc.proto: RRefDescriptor), parsed without side effects.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "proto/tandem_rpc.pb.h"

namespace tandem::rref::detail {

// INVALID_ARGUMENT unless `data` is a descriptor with a known kind, a non-negative owner and ids.
absl::StatusOr<tandem::wire::RRefDescriptor> parse_descriptor(const std::string& data);

}  // namespace tandem::rref::detail
