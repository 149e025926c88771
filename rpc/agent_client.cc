// Outgoing calls of the agent (rpc/detail/agent.h): encode, send on the peer's route, decode the reply.
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"

namespace tandem::rpc::detail {
namespace {

// rpc_sync does not spin for a reply when the last one of the same call (peer and function) took this many spins.
constexpr int kSpinlessAfter = 4;
constexpr uint32_t kSpinProbeEvery = 16;

absl::Status error_with(const absl::Status& s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// The error a Response carries (OK when none), or why the frame is not a Response.
// `prefix` names the worker and the call; it is built only for an error.
absl::Status reply_status(const grpc::ByteBuffer& frame_bytes, absl::FunctionRef<std::string()> prefix,
                          tandem::wire::Response* response, absl::StatusOr<wire::Frame>* frame) {
  *frame = wire::Frame::parse(frame_bytes, response);
  if (!frame->ok()) return error_with(frame->status(), prefix() + "bad reply: ");
  if (!response->has_error()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(response->error().code());
  return absl::Status(
      code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
      prefix() + (code == absl::StatusCode::kUnknown ? "remote exception: " : "") + response->error().message());
}

// Whether a transport's DEADLINE_EXCEEDED says more than that the call's time ran out.
bool says_more_than_a_timeout(absl::string_view message) {
  // gRPC's own, and the transports' plain ones.
  for (absl::string_view plain : {"", "Deadline Exceeded", kNoReplyByDeadline, direct::kDeadlineExceeded}) {
    if (message == plain) return false;
  }
  return true;
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
                                                       Referenced* referenced, bool oneway) {
  tandem::wire::Request request;
  request.set_oneway(oneway);
  request.set_function(function);
  request.set_caller_name(name_);
  request.set_caller_rank(rank_);
  wire::Encoder encoder(by_reference ? static_cast<uint64_t>(options_.bulk_min_bytes) : 0, peer);
  if (auto s = encoder.encode(args, request.mutable_args()); !s.ok()) {
    return error_with(s, "cannot send the arguments: ");
  }
  if (CallTracer* tracer = call_tracer()) request.set_trace(tracer->request_out(peer, function, encoder.sent()));
  if (!encoder.referenced().empty()) {  // the callee reads them only while this lease holds (lease.h)
    referenced->lease = Lease::take();
    request.set_lease_address(referenced->lease.address());
    request.set_lease_id(referenced->lease.id());
  }
  grpc::ByteBuffer frame = encoder.frame(request);
  by_reference_ += static_cast<int64_t>(encoder.referenced().size());
  referenced->tensors.swap(encoder.referenced());
  // Tensors sent by reference count as if the frame carried them (the receiver holds the message to that bound).
  uint64_t bytes = frame.Length();
  for (const at::Tensor& t : referenced->tensors) bytes += t.nbytes();
  if (bytes > static_cast<uint64_t>(options_.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("a request of ", bytes, " bytes (", referenced->tensors.size(),
                                                     " tensor(s) sent by reference among them) exceeds the message "
                                                     "limit of ",
                                                     options_.max_message_bytes));
  }
  return frame;
}

absl::Status Agent::call_error(const absl::Status& s, int peer, const std::string& function,
                               std::chrono::milliseconds timeout) {
  const std::string prefix = describe(peer, function);
  switch (s.code()) {
    case absl::StatusCode::kDeadlineExceeded: {
      // The transport's cause goes along when it says more than that the time ran out (a connection still busy
      // sending another message, another call still connecting).
      std::string m = prefix + absl::StrCat("no reply within ", timeout.count(), " ms");
      if (says_more_than_a_timeout(s.message())) absl::StrAppend(&m, " (", s.message(), ")");
      return absl::DeadlineExceededError(m);
    }
    case absl::StatusCode::kCancelled: {
      // Only this worker's own shutdown is said so; a callee that shut down says which it was.
      MutexLock lock(&mu_);
      if (stopped_ || s.message().empty()) return absl::CancelledError(prefix + "RPC was shut down on this worker");
      return absl::CancelledError(prefix + std::string(s.message()));
    }
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

absl::StatusOr<c10::IValue> Agent::parse_reply(const grpc::ByteBuffer& frame_bytes, int peer,
                                               const std::string& function, std::vector<Future>* wait) const {
  auto prefix = [&] { return describe(peer, function); };  // for errors only: a call that succeeds formats nothing
  tandem::wire::Response response;
  absl::StatusOr<wire::Frame> frame = absl::UnknownError("");  // both placeholders are assigned before they are read
  if (auto s = reply_status(frame_bytes, prefix, &response, &frame); !s.ok()) return s;
  CallTracer* tracer = response.trace().empty() ? nullptr : call_tracer();
  std::vector<at::Tensor> wire_tensors;
  absl::StatusOr<std::vector<c10::IValue>> values = absl::UnknownError("");
  try {  // upper layers' codecs and tracer run here: what they throw is this call's error
    values = frame->decode(response.result(), {0, peer, wait, tracer ? &wire_tensors : nullptr});
    if (!values.ok()) return error_with(values.status(), prefix() + "bad reply: ");
    if (tracer) {
      if (auto s = tracer->reply_in(peer, response.trace(), wire_tensors); !s.ok()) return error_with(s, prefix());
    }
  } catch (...) {
    return absl::InternalError(
        absl::StrCat(prefix(), "decoding the reply failed: ", status_from_current_exception().message()));
  }
  if (values->size() != 1) return absl::InvalidArgumentError(prefix() + "bad reply: expected one result");
  return std::move((*values)[0]);
}

void Agent::call_finished(const CallRecord& r, bool ok, int64_t received_bytes) {
  const auto now = std::chrono::steady_clock::now();
  r.recorder->record(now - r.start, ok, r.sent_bytes, received_bytes);
  if (profile::active()) {
    profile::report_steady(absl::StrCat(r.kind, r.function, "(", name_, " -> ", peers_[r.peer].info.name, ")"), r.start,
                           now);
  }
  MutexLock lock(&mu_);
  --outstanding_;
}

void Agent::count_call(int peer) {
  if (peers_[peer].transport == direct_route_ && direct_route_) {
    ++direct_calls_;
  } else {
    ++grpc_calls_;
  }
}

absl::StatusOr<Agent::Outgoing> Agent::start_call(const To& to, const std::string& function,
                                                  std::vector<c10::IValue>& args, std::chrono::milliseconds timeout,
                                                  bool by_reference_ok, bool oneway, Referenced* referenced,
                                                  const char* kind) {
  auto peer = resolve(to);
  if (!peer.ok()) return error_with(peer.status(), absl::StrCat("rpc calling '", function, "': "));
  Outgoing out;
  out.record.start = std::chrono::steady_clock::now();
  out.record.kind = kind;
  out.record.function = function;
  out.record.peer = *peer;
  out.timeout = timeout.count() <= 0 ? options_.rpc_timeout : timeout;
  out.deadline = absl::Now() + absl::FromChrono(out.timeout);
  out.route = peers_[*peer].transport;
  auto frame =
      encode_request(*peer, function, args, by_reference_ok && out.route->by_reference(*peer), referenced, oneway);
  if (!frame.ok()) return error_with(frame.status(), describe(*peer, function));
  out.frame = std::move(*frame);  // swapped in
  out.record.sent_bytes = static_cast<int64_t>(out.frame.Length());
  if (referenced) {
    for (const auto& t : referenced->tensors) out.record.sent_bytes += static_cast<int64_t>(t.nbytes());
  }
  out.record.recorder = &metrics::call_recorder(peers_[*peer].info.name, function, "out");
  args.clear();
  {
    MutexLock lock(&mu_);
    if (stopped_) return absl::CancelledError(describe(*peer, function) + "RPC has been shut down on this worker");
    ++outstanding_;
  }
  count_call(*peer);
  return out;
}

Future Agent::call(const To& to, const std::string& function, std::vector<c10::IValue> args,
                   std::chrono::milliseconds timeout) {
  auto referenced = std::make_shared<Referenced>();  // read by the callee from our memory until the reply
  auto out = start_call(to, function, args, timeout, /*by_reference_ok=*/true, /*oneway=*/false, referenced.get(),
                        "rpc_async#");
  if (!out.ok()) return Future::failed(out.status());
  Future future(out->deadline);
  const int p = out->record.peer;
  timeout = out->timeout;
  out->route->call(
      p, function, std::move(out->frame), out->deadline,
      [this, future, p, timeout, referenced, record = std::move(out->record)](absl::StatusOr<grpc::ByteBuffer> reply) {
        referenced->clear();  // the request's tensors are released before the caller's callbacks run
        std::vector<Future> wait;
        const std::string& function = record.function;
        absl::StatusOr<c10::IValue> result =
            reply.ok() ? parse_reply(*reply, p, function, &wait)
                       : absl::StatusOr<c10::IValue>(call_error(reply.status(), p, function, timeout));
        call_finished(record, result.ok(), reply.ok() ? static_cast<int64_t>(reply->Length()) : 0);
        deliver(future, std::move(result), std::move(wait));
      });
  return future;
}

Future Agent::send(const To& to, const std::string& function, std::vector<c10::IValue> args,
                   std::chrono::milliseconds timeout) {
  // Tensors large enough for the same-host bulk path go by reference: the callee reads them from our memory, so the
  // request is then a call whose (empty) answer says when they may go.
  auto referenced = std::make_shared<Referenced>();
  auto out =
      start_call(to, function, args, timeout, /*by_reference_ok=*/true, /*oneway=*/true, referenced.get(), "rpc_send#");
  if (!out.ok()) return Future::failed(out.status());
  Future future(out->deadline);
  const int p = out->record.peer;
  timeout = out->timeout;
  DoneFn done = [this, future, p, timeout, referenced,
                 record = std::move(out->record)](absl::StatusOr<grpc::ByteBuffer> sent) {
    referenced->clear();
    const std::string& function = record.function;
    // A transport that waited for the callee's answer (gRPC, or a call carrying tensors by reference) has it here: an
    // error in it is this call's (the callee could not tell it was one-way: a request it could not read).
    absl::Status status = sent.ok() ? absl::OkStatus() : call_error(sent.status(), p, function, timeout);
    if (sent.ok() && sent->Length() > 0) {
      tandem::wire::Response response;
      absl::StatusOr<wire::Frame> frame = absl::UnknownError("");  // assigned before it is read
      status = reply_status(
          *sent, [&] { return describe(p, function); }, &response, &frame);
    }
    call_finished(record, status.ok(), sent.ok() ? static_cast<int64_t>(sent->Length()) : 0);
    deliver(future, status.ok() ? absl::StatusOr<c10::IValue>(c10::IValue()) : absl::StatusOr<c10::IValue>(status), {});
  };
  if (referenced->empty()) {
    out->route->send(p, function, std::move(out->frame), out->deadline, std::move(done));
  } else {
    out->route->call(p, function, std::move(out->frame), out->deadline, std::move(done));
  }
  return future;
}

Future Agent::call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args,
                            std::chrono::milliseconds timeout) {
  Referenced referenced;  // alive until the reply: the callee reads them from our memory
  auto out =
      start_call(to, function, args, timeout, /*by_reference_ok=*/true, /*oneway=*/false, &referenced, "rpc_sync#");
  if (!out.ok()) return Future::failed(out.status());
  const int peer = out->record.peer;
  const absl::Time deadline = out->deadline;
  timeout = out->timeout;
  // A call whose last reply took far longer than the spin (a forward pass on a parameter server: milliseconds) sleeps
  // at once: spinning would only take CPU from the callee, which may need it on the same cores. Every
  // kSpinProbeEvery-th such call of a thread spins anyway: a function that is quick again (or looked slow only while
  // the machine was busy) gets its spin back even when its calls without one stay slower than the bound.
  thread_local uint32_t spinless = 0;
  const bool slow = out->record.recorder->last() > kSpinlessAfter * options_.sync_spin;
  const std::chrono::microseconds spin =
      slow && ++spinless % kSpinProbeEvery != 0 ? std::chrono::microseconds(0) : options_.sync_spin;
  if (spin.count() > 0) sync_calls_spun_.fetch_add(1, std::memory_order_relaxed);
  auto reply = out->route->call_sync(peer, function, std::move(out->frame), deadline, spin);
  referenced.clear();
  std::vector<Future> wait;
  absl::StatusOr<c10::IValue> result =
      reply.ok() ? parse_reply(*reply, peer, function, &wait)
                 : absl::StatusOr<c10::IValue>(call_error(reply.status(), peer, function, timeout));
  call_finished(out->record, result.ok(), reply.ok() ? static_cast<int64_t>(reply->Length()) : 0);
  Future done(deadline);
  deliver(done, std::move(result), std::move(wait));
  if (!done.wait_for(absl::ToChronoMilliseconds(deadline - absl::Now()))) {
    return Future::failed(call_error(absl::DeadlineExceededError(""), peer, function, timeout));
  }
  return done;
}

}  // namespace tandem::rpc::detail
