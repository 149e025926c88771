// Outgoing calls of the agent (rpc/detail/agent.h): encode, send on the peer's route, decode the reply.
#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "rpc/detail/agent.h"
#include "rpc/detail/wire.h"
#include "rpc/errors.h"
#include "rpc/extension.h"

namespace tandem::rpc::detail {
namespace {

absl::Status error_with(const absl::Status& s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

std::vector<WorkerInfo> Agent::workers() const {
  std::vector<WorkerInfo> out;
  for (const auto& p : peers_) out.push_back(p.info);
  return out;
}

absl::StatusOr<int> Agent::resolve(const To& to) const {
  if (to.rank() >= 0) {
    if (to.rank() >= world_size_) {
      return absl::NotFoundError(absl::StrCat("no worker of rank ", to.rank(), " (world size ", world_size_, ")"));
    }
    return to.rank();
  }
  auto it = rank_of_.find(to.name());
  if (it == rank_of_.end()) return absl::NotFoundError(absl::StrCat("no worker named '", to.name(), "'"));
  return it->second;
}

std::string Agent::describe(int peer, const std::string& function) const {
  return absl::StrCat("rpc to worker '", peers_[peer].info.name, "' (rank ", peer, ") calling '", function, "': ");
}

absl::StatusOr<grpc::ByteBuffer> Agent::encode_request(int peer, const std::string& function,
                                                       const std::vector<c10::IValue>& args, bool by_reference,
                                                       std::vector<at::Tensor>* referenced) {
  tandem::wire::Request request;
  request.set_function(function);
  request.set_caller_name(name_);
  request.set_caller_rank(rank_);
  wire::Encoder encoder(by_reference ? static_cast<uint64_t>(options_.bulk_min_bytes) : 0, peer);
  if (auto s = encoder.encode(args, request.mutable_args()); !s.ok()) {
    return error_with(s, "cannot send the arguments: ");
  }
  if (CallTracer* tracer = call_tracer()) request.set_trace(tracer->request_out(peer, function, encoder.sent()));
  grpc::ByteBuffer frame = encoder.frame(request);
  by_reference_ += static_cast<int64_t>(encoder.referenced().size());
  referenced->swap(encoder.referenced());
  if (frame.Length() > static_cast<uint64_t>(options_.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a request of ", frame.Length(), " bytes exceeds the message limit of ", options_.max_message_bytes));
  }
  return frame;
}

absl::Status Agent::call_error(const absl::Status& s, int peer, const std::string& function,
                               std::chrono::milliseconds timeout) {
  const std::string prefix = describe(peer, function);
  switch (s.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return absl::DeadlineExceededError(prefix + absl::StrCat("no reply within ", timeout.count(), " ms"));
    case absl::StatusCode::kCancelled:
      return absl::CancelledError(prefix + "RPC was shut down on this worker");
    case absl::StatusCode::kUnavailable: {
      MutexLock lock(&mu_);
      if (stopped_) return absl::CancelledError(prefix + "RPC was shut down on this worker");
      return absl::UnavailableError(prefix + "worker unreachable or dead: " + std::string(s.message()));
    }
    default:
      return error_with(s, prefix);
  }
}

void Agent::deliver(const Future& target, absl::StatusOr<c10::IValue> value, std::vector<Future> wait) {
  if (!value.ok()) {
    target.set_error(value.status());
  } else if (wait.empty()) {
    target.set_value(std::move(*value));
  } else {
    when_all(wait).add_callback(
        [target, v = std::move(*value)](const Future& ready) { target.set_status(ready.status(), v); });
  }
}

absl::StatusOr<c10::IValue> Agent::parse_reply(const grpc::ByteBuffer& frame_bytes, int peer, const std::string& prefix,
                                               std::vector<Future>* wait) const {
  tandem::wire::Response response;
  auto frame = wire::Frame::parse(frame_bytes, &response);
  if (!frame.ok()) return error_with(frame.status(), prefix + "bad reply: ");
  if (response.has_error()) {
    const auto code = static_cast<absl::StatusCode>(response.error().code());
    return absl::Status(
        code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
        prefix + (code == absl::StatusCode::kUnknown ? "remote exception: " : "") + response.error().message());
  }
  CallTracer* tracer = response.trace().empty() ? nullptr : call_tracer();
  std::vector<at::Tensor> wire_tensors;
  absl::StatusOr<std::vector<c10::IValue>> values = absl::UnknownError("not decoded");
  try {  // upper layers' codecs and tracer run here: what they throw is this call's error
    values = frame->decode(response.result(), {0, peer, wait, tracer ? &wire_tensors : nullptr});
    if (!values.ok()) return error_with(values.status(), prefix + "bad reply: ");
    if (tracer) {
      if (auto s = tracer->reply_in(peer, response.trace(), wire_tensors); !s.ok()) return error_with(s, prefix);
    }
  } catch (...) {
    return absl::InternalError(
        absl::StrCat(prefix, "decoding the reply failed: ", status_from_current_exception().message()));
  }
  if (values->size() != 1) return absl::InvalidArgumentError(prefix + "bad reply: expected one result");
  return std::move((*values)[0]);
}

void Agent::count_call(int peer) {
  if (peers_[peer].transport == direct_route_ && direct_route_) {
    ++direct_calls_;
  } else {
    ++grpc_calls_;
  }
}

void Agent::call_done() {
  MutexLock lock(&mu_);
  --outstanding_;
}

Future Agent::call(const To& to, const std::string& function, std::vector<c10::IValue> args,
                   std::chrono::milliseconds timeout) {
  auto peer = resolve(to);
  if (!peer.ok()) return Future::failed(error_with(peer.status(), absl::StrCat("rpc calling '", function, "': ")));
  if (timeout.count() <= 0) timeout = options_.rpc_timeout;
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  Transport* route = peers_[*peer].transport;
  auto referenced = std::make_shared<std::vector<at::Tensor>>();  // read by the callee from our memory until the reply
  auto frame = encode_request(*peer, function, args, route->by_reference(*peer), referenced.get());
  if (!frame.ok()) return Future::failed(error_with(frame.status(), describe(*peer, function)));
  args.clear();
  Future future(deadline);
  {
    MutexLock lock(&mu_);
    if (stopped_) {
      return Future::failed(absl::CancelledError(describe(*peer, function) + "RPC has been shut down on this worker"));
    }
    ++outstanding_;
  }
  count_call(*peer);
  const int p = *peer;
  route->call(p, function, std::move(*frame), deadline,
              [this, future, p, function, timeout, referenced](absl::StatusOr<grpc::ByteBuffer> reply) {
                referenced->clear();  // the request's tensors are released before the caller's callbacks run
                std::vector<Future> wait;
                absl::StatusOr<c10::IValue> result =
                    reply.ok() ? parse_reply(*reply, p, describe(p, function), &wait)
                               : absl::StatusOr<c10::IValue>(call_error(reply.status(), p, function, timeout));
                call_done();
                deliver(future, std::move(result), std::move(wait));
              });
  return future;
}

Future Agent::call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args,
                            std::chrono::milliseconds timeout) {
  auto peer = resolve(to);
  if (!peer.ok()) return call(to, function, std::move(args), timeout);  // fails with the same error
  if (timeout.count() <= 0) timeout = options_.rpc_timeout;
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  Transport* route = peers_[*peer].transport;
  std::vector<at::Tensor> referenced;  // alive until the reply: the callee reads them from our memory
  auto frame = encode_request(*peer, function, args, route->by_reference(*peer), &referenced);
  if (!frame.ok()) return Future::failed(error_with(frame.status(), describe(*peer, function)));
  {
    MutexLock lock(&mu_);
    if (stopped_) {
      return Future::failed(absl::CancelledError(describe(*peer, function) + "RPC has been shut down on this worker"));
    }
    ++outstanding_;
  }
  count_call(*peer);
  auto reply = route->call_sync(*peer, function, std::move(*frame), deadline, options_.sync_spin);
  referenced.clear();
  std::vector<Future> wait;
  absl::StatusOr<c10::IValue> result =
      reply.ok() ? parse_reply(*reply, *peer, describe(*peer, function), &wait)
                 : absl::StatusOr<c10::IValue>(call_error(reply.status(), *peer, function, timeout));
  call_done();
  Future done(deadline);
  deliver(done, std::move(result), std::move(wait));
  if (!done.wait_for(absl::ToChronoMilliseconds(deadline - absl::Now()))) {
    return Future::failed(call_error(absl::DeadlineExceededError(""), *peer, function, timeout));
  }
  return done;
}

}  // namespace tandem::rpc::detail
