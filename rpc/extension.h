// Extension points for the layers above rpc (rref, dist_autograd). rpc knows nothing of them: they plug in here.
//
// Thread-safety: registration is meant for start-up (before init_rpc); the hooks run on RPC threads and must not block
// except where stated.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/future.h"

namespace tandem::rpc {

// Values of a kind the wire format does not know (it knows None, bool, int, float, complex, str, Tensor, list, tuple,
// dict). The first codec whose `matches` accepts a value encodes it.
struct ValueCodec {
  std::string kind;  // unique, e.g. "rref"
  std::function<bool(const c10::IValue&)> matches;
  // Encodes `value` for a message to worker `to`, on the sending thread, when the message is built.
  std::function<absl::StatusOr<std::string>(const c10::IValue& value, int to)> encode;
  // Decodes a value from a message sent by worker `from`. It may append futures to `wait`: the call's function does
  // not run (for a request) or its caller does not see the result (for a reply) before they complete; an error among
  // them fails the call.
  std::function<absl::StatusOr<c10::IValue>(const std::string& data, int from, std::vector<Future>* wait)> decode;
};
void register_value_codec(ValueCodec codec);

// Runs at a graceful shutdown before this worker waits for its outgoing calls and meets the others at the barrier;
// hooks run in registration order, each until `deadline` at most. An error fails the shutdown (which still happens).
void add_shutdown_hook(std::function<absl::Status(absl::Time deadline)> hook);

// Runs after this worker stopped serving (graceful or not), in registration order. Must not block for long.
void add_stop_hook(std::function<void()> hook);

// A future completed when all of `futures` are: with None, or with the first error among them.
Future when_all(const std::vector<Future>& futures);

namespace detail {
// For rpc's own use.
const ValueCodec* find_codec(const c10::IValue& value);
const ValueCodec* find_codec(const std::string& kind);
std::vector<std::function<absl::Status(absl::Time)>> shutdown_hooks();
std::vector<std::function<void()>> stop_hooks();
}  // namespace detail

}  // namespace tandem::rpc
