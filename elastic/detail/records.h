// The rendezvous's records in the store (proto/tandem_rpc.proto, Elastic*), decoded and checked for the build that
// wrote them: DATA_LOSS for bytes that are no such record, FAILED_PRECONDITION (naming both versions) for another
// wire version. `key` names the record in errors.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "proto/tandem_rpc.pb.h"

namespace tandem::elastic::detail {

// The most nodes a round, and workers a node, may have: counts read from the store beyond it are DATA_LOSS (they would
// size loops and allocations; a world of kMaxCount nodes of kMaxCount workers still fits an int).
inline constexpr int64_t kMaxCount = 1 << 15;

absl::StatusOr<wire::ElasticNode> parse_node(const std::string& bytes, const std::string& key);
absl::StatusOr<wire::ElasticRound> parse_round(const std::string& bytes, const std::string& key);
absl::StatusOr<wire::ElasticEnd> parse_end(const std::string& bytes, const std::string& key);

}  // namespace tandem::elastic::detail
