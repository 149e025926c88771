// Extension points for the layers above rpc (rref, dist_autograd). rpc knows nothing of them: they plug in here.
//
// Thread-safety: registration is meant for start-up (before init_rpc); the hooks run on RPC threads and must not block
// except where stated.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/rpc/future.h"

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

// Follows calls across workers (distributed autograd uses it to record where tensors that require grad go). It sees
// every request and reply with the tensors in them (indexed as on the wire: a tensor sent twice appears once) and may
// attach bytes to the message. A traced message's tensors arrive without requires_grad: the tracer decides.
class CallTracer {
 public:
  virtual ~CallTracer() = default;
  // Caller, on the calling thread, when a request for `function` on worker `to` is encoded. Returns what to attach
  // (empty: the request is not traced).
  virtual std::string request_out(int to, const std::string& function, const std::vector<at::Tensor>& tensors) = 0;
  // Callee, when a traced request from worker `from` is decoded. Returns the call's state, handed to enter and
  // reply_out (may be null); an error fails the call.
  virtual absl::StatusOr<std::shared_ptr<void>> request_in(int from, const std::string& attached,
                                                           const std::vector<at::Tensor>& tensors) = 0;
  // Callee, around the synchronous part of the function: what it returns lives while the function runs.
  virtual std::shared_ptr<void> enter(const std::shared_ptr<void>& state) = 0;
  // Callee, when the reply of a traced request to `to` is encoded. Returns what to attach.
  virtual std::string reply_out(const std::shared_ptr<void>& state, int to, const std::vector<at::Tensor>& tensors) = 0;
  // Caller, when a reply with something attached arrives from worker `from`. An error fails the call.
  virtual absl::Status reply_in(int from, const std::string& attached, const std::vector<at::Tensor>& tensors) = 0;
  // The state of the scope current on this thread (null: none), for enter() on another thread.
  virtual std::shared_ptr<void> capture() = 0;
};
// Installs the process's tracer (one at most; it must live until exit).
void set_call_tracer(CallTracer* tracer);
// `fn`, made to run inside the tracer scope current on this thread now, on whatever thread calls it later (for work a
// registered function continues in a callback).
std::function<void()> bind_call_scope(std::function<void()> fn);

// Runs at a graceful shutdown before this worker waits for its outgoing calls and meets the others at the barrier;
// hooks run in registration order, each until `deadline` at most. An error fails the shutdown (which still happens).
void add_shutdown_hook(std::function<absl::Status(absl::Time deadline)> hook);

// Runs after this worker stopped serving (graceful or not), in registration order. Must not block for long.
void add_stop_hook(std::function<void()> hook);

// A future completed when all of `futures` are: with None, or with the first error among them. Its deadline is the
// latest of theirs.
Future when_all(const std::vector<Future>& futures);

namespace detail {
// For rpc's own use.
const ValueCodec* find_codec(const c10::IValue& value);
const ValueCodec* find_codec(const std::string& kind);
std::vector<std::function<absl::Status(absl::Time)>> shutdown_hooks();
std::vector<std::function<void()>> stop_hooks();
CallTracer* call_tracer();
}  // namespace detail

}  // namespace tandem::rpc
