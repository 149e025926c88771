// Fault injection between two named workers, for tests: the N-th message from one worker to another is dropped,
// delayed, duplicated, reordered, corrupted or its connection cut, on whichever transport carries it.
//
//   rpc::RpcOptions options;
//   options.faults = rpc::parse_faults("drop worker0->worker1 request nth=3; delay * ->worker2 reply ms=200");
//
// Every worker of the job may be given the same rules: a worker applies the rules whose `from` is itself, to the
// messages it sends (requests it makes, replies it gives). Messages are counted per rule in the sending process.
//
// What each action does to the message (and what the caller then sees, through the normal error paths):
//   drop       not delivered. A request's caller gets DEADLINE_EXCEEDED at its deadline; so does the caller of a
//              dropped reply (the reply itself is handed to the transport only when the worker stops).
//   delay      sent `ms` later.
//   duplicate  a request sent twice (the callee runs it twice; the first reply completes the call). Requests only.
//   reorder    held until the next message to the same worker has been sent (or `ms`), then sent after it.
//   corrupt    the frame's header length no longer matches its size: the receiver refuses it as malformed
//              (INVALID_ARGUMENT naming the worker and the call).
//   cut        every connection to the worker is closed; on the direct channel the message is first half written
//              (cut mid-message). The call, and any other in flight on those connections, fails with UNAVAILABLE.
// One-way sends (rpc::send) are requests to these rules, and nothing answers them, so reply rules never apply to
// them (nor to the receipt gRPC answers for one). A dropped one-way send completes as written: the sender cannot
// tell a message lost after it left, and the receiver is the one that notices (its own deadline).
//
// Thread-safety: parse_faults is pure; the rules are applied under the transport's own lock.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::rpc {

struct FaultRule {
  enum class Action { kDrop, kDelay, kDuplicate, kReorder, kCorrupt, kCut };
  enum class Kind { kAny, kRequest, kReply };
  Action action = Action::kDrop;
  std::string from = "*";  // the sending worker's name, or "*"
  std::string to = "*";    // the receiving worker's name, or "*"
  Kind kind = Kind::kAny;
  std::string function;                  // only messages of calls to this function (empty: any)
  int nth = 1;                           // the first matching message it applies to (1 = the first)
  int count = 1;                         // how many matching messages from the nth on (0: all of them)
  std::chrono::milliseconds delay{100};  // delay: how long; reorder: the longest a message is held
};

// Parses rules separated by ';', each "<action> <from>-><to> [request|reply] [nth=N] [count=N] [ms=N] [fn=NAME]".
// INVALID_ARGUMENT for anything else, naming the rule.
absl::StatusOr<std::vector<FaultRule>> parse_faults(const std::string& text);

}  // namespace tandem::rpc
