// Incoming calls of the agent (rpc/detail/agent.h): decode the request, run the registered function, reply once.
#include <chrono>
#include <cstdio>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/log/log.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"

namespace tandem::rpc {
namespace detail {
namespace {

thread_local const CallContext* t_current_call = nullptr;
// A client's name labels its calls in logs and metrics: bounded, as a worker's is (rendezvous.cc's name pattern).
constexpr size_t kMaxClientName = 128;

// Whether `v` holds an extension value (a remote reference: protocol work before it can be used). Protobuf's parse
// depth limit bounds the recursion.
bool has_extension(const tandem::wire::Value& v) {
  auto any = [](const auto& values) {
    for (const auto& x : values) {
      if (has_extension(x)) return true;
    }
    return false;
  };
  switch (v.kind_case()) {
    case tandem::wire::Value::kExt:
      return true;
    case tandem::wire::Value::kList:
      return any(v.list().items());
    case tandem::wire::Value::kTuple:
      return any(v.tuple().items());
    case tandem::wire::Value::kDict:
      return any(v.dict().keys()) || any(v.dict().values());
    default:
      return false;
  }
}

}  // namespace

bool Agent::serve_message(Incoming& in, Parsed* parsed) {
  const tandem::wire::Request& request = parsed->request;
  parsed->frame = wire::Frame::parse(in.request, &parsed->request);
  const absl::StatusOr<wire::Frame>& frame = parsed->frame;
  // What does not parse, or is not a message for this path, is refused or served by the general path (handle()).
  if (!frame.ok() || !request.trace().empty() || !request.oneway()) return false;
  if (request.caller_rank() < 0 || request.caller_rank() >= world_size_) return false;
  std::shared_ptr<const MessageHandler> handler = find_message(request.function());
  if (!handler) return false;
  for (const auto& v : request.args().values()) {
    if (has_extension(v)) return false;
  }
  {
    MutexLock lock(&mu_);
    if (stopped_) return false;
  }
  CallContext context{request.caller_name(), request.caller_rank(), request.function()};
  absl::Status status;
  try {
    std::vector<Future> wait;  // stays empty: no extension values
    auto args = frame->decode(request.args(), {in.cma_pid, request.caller_rank(), &wait, nullptr,
                                               static_cast<uint64_t>(options_.max_message_bytes), false,
                                               request.lease_address(), request.lease_id(), &leases_lapsed_});
    if (!args.ok()) {
      status = args.status();
    } else {
      ++inline_messages_;  // before the function: what it does may be seen as soon as it runs
      t_current_call = &context;
      (*handler)(std::move(*args));
    }
  } catch (...) {
    status = status_from_current_exception();
  }
  t_current_call = nullptr;
  if (!status.ok()) {
    ++oneway_failures_;
    TANDEM_LOG(kError, "rpc") << "one-way call '" << request.function() << "' from worker '" << request.caller_name()
                              << "' failed: " << status.message();
  }
  return true;
}

void Agent::on_incoming(Incoming in) {
  // A message runs here with nothing around it (registry.h's register_message).
  Parsed parsed;
  const bool inline_here = in.on_io_thread && ready_.HasBeenNotified();
  if (inline_here && in.oneway && !in.from_client && serve_message(in, &parsed)) return;
  auto call = std::make_shared<InCall>();
  call->in = std::move(in);
  bool stopped = false;
  {
    MutexLock lock(&mu_);
    stopped = stopped_;
    if (!stopped) in_calls_.emplace(call.get(), call);
  }
  if (stopped) {  // replied without mu_, as every reply is: a transport may complete work inline
    const absl::Status gone = absl::UnavailableError(absl::StrCat("worker '", name_, "' has shut down"));
    if (call->in.oneway) note_oneway_failure(*call, gone);
    call->in.reply(nullptr, gone);
    return;
  }
  if (inline_here) return handle(call, call->in.oneway && !call->in.from_client ? &parsed : nullptr);  // no hand-off
  // A gRPC thread must not block, and a call that arrived before init_rpc returned here waits on the pool (the direct
  // channel's threads are needed for handshakes meanwhile).
  if (!pool_->submit([this, call] { handle(call); })) {
    finish_once(call, absl::UnavailableError(absl::StrCat("worker '", name_, "' is shutting down")));
  }
}

void Agent::handle(std::shared_ptr<InCall> call, Parsed* parsed) {
  // Peers may call as soon as they know our address, before init_rpc returned here; functions run only after it did.
  if (!ready_.WaitForNotificationWithTimeout(absl::FromChrono(options_.init_timeout))) {
    return reply_error(call, absl::UnavailableError(absl::StrCat("worker '", name_, "' did not finish init_rpc")));
  }
  bool stopped = false;
  {
    MutexLock lock(&mu_);
    stopped = stopped_;
  }
  // Replied without mu_: finishing the call takes it (it aborted a worker shutting down, in abseil's deadlock check).
  if (stopped) return reply_error(call, absl::UnavailableError(absl::StrCat("worker '", name_, "' has shut down")));
  Parsed here;
  if (!parsed) {
    here.frame = wire::Frame::parse(call->in.request, &here.request);
    parsed = &here;
  }
  const tandem::wire::Request& request = parsed->request;
  const absl::StatusOr<wire::Frame>& frame = parsed->frame;
  if (!frame.ok()) return reply_error(call, frame.status());
  // A client is whoever authenticated with a client's token (it can call as nothing else), or a caller of the job
  // that chose to call as one.
  const bool client = call->in.from_client || request.caller_rank() == kClientRank;
  if (call->in.from_client && request.caller_rank() != kClientRank) {
    return reply_error(
        call, absl::PermissionDeniedError(absl::StrCat("a client outside the job calls as caller rank ", kClientRank,
                                                       ", not as rank ", request.caller_rank())));
  }
  if (!client && (request.caller_rank() < 0 || request.caller_rank() >= world_size_)) {
    return reply_error(call, absl::InvalidArgumentError(absl::StrCat("malformed message: caller rank ",
                                                                     request.caller_rank(), " is not in the job")));
  }
  // Checked before the call's fields are kept: a refused client's name and function label no metrics series.
  if (client) {  // authenticated, but not a rank: only the job's own functions, with plain values
    if (request.caller_name().empty() || request.caller_name().size() > kMaxClientName) {
      return reply_error(
          call, absl::InvalidArgumentError(absl::StrCat("malformed message: a client's name has 1 to ", kMaxClientName,
                                                        " bytes, not ", request.caller_name().size())));
    }
    if (absl::StartsWith(request.function(), "__tandem.")) {
      return reply_error(call, absl::PermissionDeniedError(absl::StrCat(
                                   "'", request.function(), "' is internal to Tandem: a client outside the job ",
                                   "calls only the functions the job registered")));
    }
    if (!request.trace().empty()) {
      return reply_error(
          call, absl::FailedPreconditionError("a client outside the job cannot take part in distributed autograd"));
    }
  }
  // Looked up once: the handler found here labels the call and is the one run() calls.
  Handler handler = find_function(request.function());
  {
    MutexLock call_lock(&call->mu);  // a stop() on another thread may finish the call meanwhile, reading them
    call->caller = request.caller_rank();
    // The metrics label (record_served): a name nobody registered makes no series of its own, even for a request that
    // fails before run() (a malformed argument): else a caller could make series without bound.
    call->function = handler ? request.function() : "(not registered)";
    call->caller_name = request.caller_name();
    call->oneway = request.oneway();
  }
  call->client.store(client);
  std::vector<Future> wait;
  CallTracer* tracer = request.trace().empty() ? nullptr : call_tracer();
  std::vector<at::Tensor> wire_tensors;
  // Decoding runs upper layers' codecs and tracer; whatever they throw is the caller's error, never this worker's end.
  absl::StatusOr<std::vector<c10::IValue>> args = absl::UnknownError("");  // assigned before it is read
  try {
    args =
        frame->decode(request.args(), {call->in.cma_pid, request.caller_rank(), &wait, tracer ? &wire_tensors : nullptr,
                                       static_cast<uint64_t>(options_.max_message_bytes), client,
                                       request.lease_address(), request.lease_id(), &leases_lapsed_});
    if (args.ok() && tracer) {
      auto state = tracer->request_in(request.caller_rank(), request.trace(), wire_tensors);
      if (!state.ok()) return reply_error(call, state.status());
      call->trace_state = std::move(*state);
      call->traced = true;
    }
  } catch (...) {
    args =
        absl::InternalError(absl::StrCat("decoding the request failed: ", status_from_current_exception().message()));
  }
  if (!args.ok()) return reply_error(call, args.status());
  // A one-way request that a transport must answer (gRPC; tensors read by reference) is answered now: its arguments
  // have been read, and nobody waits for the function. What the function does later is told here only.
  if (call->oneway && !call->in.oneway) finish_oneway(call);
  if (wait.empty()) return run(call, handler, request.function(), std::move(*args), request.caller_name());
  // Some argument needs protocol work first (e.g. a remote reference its owner must confirm): run after it, on the
  // pool.
  auto shared_args = std::make_shared<std::vector<c10::IValue>>(std::move(*args));
  when_all(wait).add_callback([life = lifeline_, call, shared_args, handler = std::move(handler),
                               function = request.function(), caller = request.caller_name()](const Future& ready) {
    Agent* self = life->enter();
    if (!self) return;                                // gone (see Lifeline)
    absl::Cleanup left = [&life] { life->leave(); };  // also when replying throws: else a stop would wait for ever
    if (absl::Status s = ready.status(); !s.ok()) {
      self->reply_error(call, s);
    } else if (!self->pool_->submit([self, call, shared_args, handler, function, caller] {
                 self->run(call, handler, function, std::move(*shared_args), caller);
               })) {
      self->reply_error(call, absl::UnavailableError(absl::StrCat("worker '", self->name_, "' is shutting down")));
    }
  });
}

thread_local const Agent::InCall* Agent::t_current_in_call_ = nullptr;

void Agent::run(const std::shared_ptr<InCall>& call, const Handler& handler, const std::string& function,
                std::vector<c10::IValue> args, const std::string& caller_name) {
  if (!handler) {  // handle() labelled it "(not registered)": a caller's typos make no series of their own
    return reply_error(call, absl::NotFoundError(absl::StrCat("no function named '", function,
                                                              "' is registered on worker '", name_, "'")));
  }
  CallContext context{caller_name, call->caller, function};
  t_current_call = &context;
  t_current_in_call_ = call.get();
  std::shared_ptr<void> trace_scope;
  if (call->traced) {
    if (CallTracer* tracer = call_tracer()) trace_scope = tracer->enter(call->trace_state);
  }
  Future result;
  profile::OnThisThread profiled;  // the function's operators go into a running profile
  try {
    result = handler(std::move(args));
  } catch (...) {
    // Tandem's own failures (arguments that do not convert, a nested call's error) are tandem::Error and keep their
    // code; anything else the function threw is UNKNOWN.
    result = Future::failed(status_from_current_exception());
  }
  trace_scope.reset();
  t_current_call = nullptr;
  t_current_in_call_ = nullptr;
  result.add_callback([life = lifeline_, call](const Future& f) {
    Agent* self = life->enter();
    if (!self) return;                                // gone: its shutdown answered the call CANCELLED
    absl::Cleanup left = [&life] { life->leave(); };  // also when replying throws
    try {
      self->reply(call, f);
    } catch (...) {
      // Encoding the result threw (out of memory making it contiguous, a tracer's error): the caller learns it, where
      // it would have waited for its deadline and seen only "no reply". A call answered already stays so (once).
      const absl::Status why = status_from_current_exception();
      self->reply_error(call, absl::Status(why.code(), absl::StrCat("cannot send the result: ", why.message())));
    }
  });
}

void Agent::reply(const std::shared_ptr<InCall>& call, const Future& result) {
  absl::Status status = result.status();  // completed: does not wait
  if (!status.ok()) return reply_error(call, status);
  if (call->in.oneway || call->oneway) {  // nobody waits for the result
    if (acknowledged_early(*call)) record_served(*call, true, 0);
    return finish_oneway(call);
  }
  tandem::wire::Response response;
  wire::Encoder encoder(0, call->caller);
  if (auto s = encoder.encode({result.value()}, response.mutable_result()); !s.ok()) {
    return reply_error(call, absl::Status(s.code(), absl::StrCat("cannot send the result: ", s.message())));
  }
  if (call->traced) {
    if (CallTracer* tracer = call_tracer()) {
      response.set_trace(tracer->reply_out(call->trace_state, call->caller, encoder.sent()));
    }
  }
  grpc::ByteBuffer frame = encoder.frame(response);
  // A result above this worker's message limit is refused here, with an error the caller can read, instead of a
  // frame the caller's transport would refuse (a dropped connection on the direct channel).
  if (frame.Length() > static_cast<uint64_t>(options_.max_message_bytes)) {
    return reply_error(call, absl::ResourceExhaustedError(
                                 absl::StrCat("the result of ", frame.Length(), " bytes exceeds the message limit of ",
                                              options_.max_message_bytes, " bytes (RpcOptions::max_message_bytes)")));
  }
  finish_once(call, absl::OkStatus(), &frame);
}

void Agent::reply_error(const std::shared_ptr<InCall>& call, const absl::Status& error) {
  {
    MutexLock call_lock(&call->mu);
    call->failed = true;
  }
  if (call->in.oneway || call->oneway) {  // no reply carries the failure: it is counted and told here
    note_oneway_failure(*call, error);
    if (acknowledged_early(*call)) record_served(*call, false, 0);
    return finish_oneway(call);
  }
  tandem::wire::Response response;
  response.mutable_error()->set_code(static_cast<int>(error.code()));
  response.mutable_error()->set_message(std::string(error.message()));
  grpc::ByteBuffer frame = wire::Encoder().frame(response);
  finish_once(call, absl::OkStatus(), &frame);
}

void Agent::note_oneway_failure(const InCall& call, const absl::Status& error) {
  ++oneway_failures_;
  // No caller waits for a one-way call's reply: its failure is logged here, or nowhere.
  TANDEM_LOG(kError, "rpc") << "one-way call '" << (call.function.empty() ? "(not parsed)" : call.function)
                            << "' from worker '" << (call.caller_name.empty() ? "(unknown)" : call.caller_name)
                            << "' failed: " << error.message();
}

void Agent::finish_oneway(const std::shared_ptr<InCall>& call) {
  // An empty Response for a transport that needs an answer (gRPC); the direct channel's one-way frame gets none.
  grpc::ByteBuffer frame = call->in.oneway ? grpc::ByteBuffer() : wire::Encoder().frame(tandem::wire::Response());
  finish_once(call, absl::OkStatus(), call->in.oneway ? nullptr : &frame);
}

bool Agent::acknowledged_early(const InCall& call) { return call.oneway && !call.in.oneway; }

void Agent::record_served(const InCall& call, bool ok, int64_t reply_bytes) const {
  record_served(call.caller_name, call.function, call, ok, reply_bytes);
}

void Agent::record_served(const std::string& caller, const std::string& function, const InCall& call, bool ok,
                          int64_t reply_bytes) const {
  metrics::call_recorder(caller.empty() ? "(unknown)" : caller, function.empty() ? "(not parsed)" : function, "in")
      .record(std::chrono::steady_clock::now() - call.start, ok, reply_bytes,
              static_cast<int64_t>(call.in.request.Length()));
  if (profile::active()) {
    profile::report_steady(absl::StrCat("rpc_serve#", function, "(", caller, " -> ", name_, ")"), call.start,
                           std::chrono::steady_clock::now());
  }
}

void Agent::finish_once(const std::shared_ptr<InCall>& call, const absl::Status& status, grpc::ByteBuffer* reply,
                        bool unless_busy) {
  bool record = false, ok = false;
  int64_t reply_bytes = 0;
  std::string caller, function;  // copied under the lock: a handle() on another thread may still be writing them
  {
    if (unless_busy) {
      // Held for a moment by other work on the call (its handler taking its context), or for as long as a reply
      // takes to write: 100 ms tells the two apart.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      while (!call->mu.TryLock()) {
        if (std::chrono::steady_clock::now() > give_up) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      call->mu.Lock();
    }
    absl::Cleanup unlock = [&call]() ABSL_NO_THREAD_SAFETY_ANALYSIS { call->mu.Unlock(); };
    if (call->finished) return;
    call->finished = true;
    // A one-way frame's reply writes nothing: a failure given here (the worker stopping) is told here.
    if (call->in.oneway && !status.ok()) note_oneway_failure(*call, status);
    // A one-way call acknowledged before its function ran is recorded when the function ends (reply, reply_error).
    record = !acknowledged_early(*call);
    ok = status.ok() && !call->failed;
    reply_bytes = reply ? static_cast<int64_t>(reply->Length()) : 0;
    if (record) {
      caller = call->caller_name;
      function = call->function;
    }
    call->in.reply(reply, status);
  }
  if (record) record_served(caller, function, *call, ok, reply_bytes);
  MutexLock lock(&mu_);
  in_calls_.erase(call.get());
}

}  // namespace detail

const CallContext* current_call() { return detail::t_current_call; }

}  // namespace tandem::rpc
