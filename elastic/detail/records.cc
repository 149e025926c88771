#include "tandem/elastic/detail/records.h"

#include "absl/strings/str_cat.h"
#include "tandem/rpc/detail/version.h"

namespace tandem::elastic::detail {
namespace {

template <class M>
absl::StatusOr<M> parse(const std::string& bytes, const std::string& key) {
  M m;
  if (!m.ParseFromString(bytes)) return absl::DataLossError(absl::StrCat("rendezvous: malformed record at ", key));
  if (m.wire_version() != rpc::kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("rendezvous: the record at ", key,
                                                      " was written by a launcher of another Tandem build (wire "
                                                      "version ",
                                                      m.wire_version(), "; this one speaks ", rpc::kWireVersion, ")"));
  }
  return m;
}

}  // namespace

absl::StatusOr<wire::ElasticNode> parse_node(const std::string& bytes, const std::string& key) {
  auto node = parse<wire::ElasticNode>(bytes, key);
  if (node.ok() &&
      (node->nproc() < 1 || node->nproc() > kMaxCount || node->master_port() < 0 || node->master_port() > 65535)) {
    return absl::DataLossError(absl::StrCat("rendezvous: the record at ", key, " has ", node->nproc(),
                                            " workers and master port ", node->master_port()));
  }
  return node;
}

absl::StatusOr<wire::ElasticRound> parse_round(const std::string& bytes, const std::string& key) {
  auto round = parse<wire::ElasticRound>(bytes, key);
  if (round.ok() && (round->nodes() < 1 || round->nodes() > kMaxCount || round->restarts() < 0)) {
    return absl::DataLossError(absl::StrCat("rendezvous: the record at ", key, " has ", round->nodes(), " nodes and ",
                                            round->restarts(), " restarts"));
  }
  return round;
}

absl::StatusOr<wire::ElasticEnd> parse_end(const std::string& bytes, const std::string& key) {
  return parse<wire::ElasticEnd>(bytes, key);
}

}  // namespace tandem::elastic::detail
