// The RPC runtime behind rpc/rpc.h: one Agent per process while RPC is initialized.
//
// Threads:
//   - gRPC's callback threads accept calls (Agent::accept) and complete outgoing calls (Agent::on_reply). They never
//     run user code beyond Future callbacks.
//   - pool_ runs registered functions and decodes requests. A function returning a pending Future releases its pool
//     thread; the reply is sent by whichever thread completes that Future.
//
// Every incoming call is an InCall whose reactor is finished exactly once (finish_once), either with the reply or, at
// shutdown, with CANCELLED; every outgoing call is an OutCall tracked in out_calls_ until gRPC reports its end, which
// it does by the call's deadline at the latest.
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "proto/tandem_rpc.grpc.pb.h"
#include "rpc/detail/auth.h"
#include "rpc/detail/net.h"
#include "rpc/detail/thread_pool.h"
#include "rpc/detail/wire.h"
#include "rpc/rpc.h"
#include "rpc/store.h"

namespace tandem::rpc {
namespace {

namespace pb = tandem::wire;
using std::chrono::milliseconds;

constexpr char kCallMethod[] = "/tandem.wire.Worker/Call";

thread_local const CallContext* t_current_call = nullptr;

std::string getenv_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

absl::Status error_with(absl::Status s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// Messages of user exceptions: c10::Error's what() carries a C++ backtrace the caller has no use for.
std::string exception_message(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

class Agent;

class WorkerService final : public pb::Worker::WithRawCallbackMethod_Call<pb::Worker::CallbackService> {
 public:
  explicit WorkerService(Agent* agent) : agent_(agent) {}
  grpc::ServerUnaryReactor* Call(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;

 private:
  Agent* agent_;
};

class Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> start(const std::string& name, int rank, int world_size,
                                                      const RpcOptions& options);
  ~Agent() { stop(milliseconds(2000)); }

  Future call(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout);
  absl::Status shutdown(bool graceful);

  const WorkerInfo& self() const { return workers_[rank_]; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  absl::StatusOr<int> resolve(const To& to) const;

  grpc::ServerUnaryReactor* accept(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response);
  // True when everything outstanding was released (safe to delete).
  bool stopped_cleanly() const { return stopped_cleanly_; }
  // Called once init_rpc has published this agent: calls that arrived during rendezvous run from now on.
  void set_ready() {
    if (!ready_.HasBeenNotified()) ready_.Notify();
  }

 private:
  struct InCall {
    grpc::ServerUnaryReactor* reactor;
    const grpc::ByteBuffer* request;
    grpc::ByteBuffer* response;
    std::mutex mu;          // makes "write the response, then Finish" one step against a concurrent stop()
    bool finished = false;  // guarded by mu
  };
  struct OutCall {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request, response;
    Future future;
    int peer = -1;
    std::string function;
    milliseconds timeout{0};
  };

  Agent(std::string name, int rank, int world_size, RpcOptions options)
      : name_(std::move(name)), rank_(rank), world_size_(world_size), options_(std::move(options)) {}

  absl::Status rendezvous(const std::string& master, const std::string& advertised);
  void handle(std::shared_ptr<InCall> in);
  void reply(const std::shared_ptr<InCall>& in, const Future& result);
  void reply_error(const std::shared_ptr<InCall>& in, const absl::Status& error);
  // Finishes the call unless it already was, first moving `reply` (if any) into its response.
  void finish_once(const std::shared_ptr<InCall>& in, grpc::Status status, grpc::ByteBuffer* reply = nullptr);
  void on_reply(OutCall* call, const grpc::Status& status);
  std::string describe(int peer, const std::string& function) const;
  absl::Status drain_outgoing(absl::Time deadline);
  // Stops serving and fails whatever is outstanding; bounded by `grace`.
  void stop(milliseconds grace);

  const std::string name_;
  const int rank_;
  const int world_size_;
  const RpcOptions options_;
  std::string token_;

  std::unique_ptr<grpc::Service> store_service_;  // rank 0 only; outlives server_
  std::unique_ptr<WorkerService> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<detail::ThreadPool> pool_;

  std::vector<WorkerInfo> workers_;
  std::map<std::string, int> rank_of_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;

  absl::Mutex mu_;
  std::map<OutCall*, bool> out_calls_ ABSL_GUARDED_BY(mu_);
  std::map<InCall*, std::shared_ptr<InCall>> in_calls_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_cleanly_ = false;
  absl::Notification ready_;
};

grpc::ServerUnaryReactor* WorkerService::Call(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  return agent_->accept(ctx, request, response);
}

// ---------------------------------------------------------------------------------------------------------------------
// Start-up and rendezvous

absl::StatusOr<std::string> resolve_secret(const RpcOptions& options, int world_size) {
  if (!options.secret.empty()) return options.secret;
  if (auto env = getenv_or("TANDEM_SECRET"); !env.empty()) return env;
  if (auto path = getenv_or("TANDEM_SECRET_FILE"); !path.empty()) {
    std::ifstream in(path);
    std::string secret;
    if (!in || !std::getline(in, secret) || secret.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot read the job secret from TANDEM_SECRET_FILE='", path, "'"));
    }
    return secret;
  }
  if (world_size == 1) return auth::random_secret();
  return absl::FailedPreconditionError(
      "no job secret: set RpcOptions::secret, TANDEM_SECRET or TANDEM_SECRET_FILE (tandem-run sets it for you)");
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::start(const std::string& name, int rank, int world_size,
                                                    const RpcOptions& options) {
  static const std::regex kName("[A-Za-z0-9_.:-]{1,128}");
  if (!std::regex_match(name, kName)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid worker name '", name, "' (1-128 of A-Z a-z 0-9 _ . : -)"));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("invalid rank ", rank, " for world size ", world_size));
  }
  std::unique_ptr<Agent> agent(new Agent(name, rank, world_size, options));
  auto secret = resolve_secret(options, world_size);
  if (!secret.ok()) return secret.status();
  agent->token_ = auth::derive_token(*secret);

  std::string master_addr = options.master_addr.empty() ? getenv_or("MASTER_ADDR") : options.master_addr;
  int master_port = options.master_port;
  if (master_port < 0) {
    if (auto env = getenv_or("MASTER_PORT"); !env.empty() && !absl::SimpleAtoi(env, &master_port)) {
      return absl::InvalidArgumentError(absl::StrCat("MASTER_PORT='", env, "' is not a port"));
    }
  }
  if (world_size == 1) {
    if (master_addr.empty()) master_addr = "127.0.0.1";
    if (master_port < 0) master_port = 0;
  }
  if (master_addr.empty() || master_port < 0 || master_port > 65535) {
    return absl::InvalidArgumentError("no master address: set RpcOptions::master_addr/master_port or MASTER_ADDR/MASTER_PORT");
  }
  if (master_port == 0 && world_size > 1) {
    return absl::InvalidArgumentError("master port 0 works only for a job of one worker");
  }

  std::string host = options.listen_host;
  if (host.empty()) {
    auto local = net::local_address_towards(master_addr);
    if (!local.ok()) return local.status();
    host = *local;
  }
  auto creds = net::server_credentials(options.tls ? &*options.tls : nullptr);
  if (!creds.ok()) return error_with(creds.status(), "TLS set-up: ");

  grpc::ServerBuilder builder;
  net::configure_server(builder, options.max_message_bytes);
  int port = 0;
  const std::string bind_host = rank == 0 ? (net::is_loopback(master_addr) ? master_addr : "0.0.0.0") : host;
  const std::string listen = net::join_host_port(bind_host, rank == 0 ? master_port : 0);
  builder.AddListeningPort(listen, *creds, &port);
  agent->worker_service_ = std::make_unique<WorkerService>(agent.get());
  builder.RegisterService(agent->worker_service_.get());
  if (rank == 0) {
    agent->store_service_ = make_store_service(agent->token_);
    builder.RegisterService(agent->store_service_.get());
  }
  agent->pool_ = std::make_unique<detail::ThreadPool>(std::max(1, options.num_worker_threads));
  agent->server_ = builder.BuildAndStart();
  if (!agent->server_ || port == 0) {
    return absl::UnavailableError(absl::StrCat("worker '", name, "' cannot listen on ", listen,
                                               rank == 0 ? " (is the master port already in use?)" : ""));
  }
  const std::string master = net::join_host_port(master_addr, rank == 0 ? port : master_port);
  if (auto s = agent->rendezvous(master, net::join_host_port(host, port)); !s.ok()) {
    agent->stop(milliseconds(1000));
    return error_with(s, absl::StrCat("init_rpc of worker '", name, "' (rank ", rank, "): "));
  }
  return agent;
}

absl::Status Agent::rendezvous(const std::string& master, const std::string& advertised) {
  const TlsOptions* tls = options_.tls ? &*options_.tls : nullptr;
  auto master_channel = net::make_channel(master, tls, options_.max_message_bytes);
  const absl::Time deadline = absl::Now() + absl::FromChrono(options_.init_timeout);
  auto left = [&] { return std::max(milliseconds(1), absl::ToChronoMilliseconds(deadline - absl::Now())); };
  // Only the first contact waits for the master to come up; after it, a master that goes away fails the rendezvous at
  // once instead of at the init deadline.
  auto first_contact = connect_store(master_channel, token_, /*wait_for_ready=*/true, options_.init_timeout);
  store_ = connect_store(master_channel, token_, /*wait_for_ready=*/false);
  Store* init_store = store_.get();

  const std::string my_key = absl::StrCat("worker/", rank_);
  auto taken = first_contact->add("name/" + name_, 1);
  if (!taken.ok()) return error_with(taken.status(), absl::StrCat("cannot reach the master at ", master, ": "));
  if (*taken != 1) {
    const std::string err = absl::StrCat("worker name '", name_, "' is used by another rank");
    (void)init_store->set(my_key, "!" + err);  // lets the other ranks fail at once instead of at the timeout
    return absl::AlreadyExistsError(err);
  }
  if (auto s = init_store->set(my_key, absl::StrCat(name_, "\n", advertised, "\n", world_size_)); !s.ok()) return s;

  std::vector<int> all(world_size_);
  for (int r = 0; r < world_size_; ++r) all[r] = r;
  if (auto s = wait_for_ranks(*init_store, "worker/", all, left(), "join"); !s.ok()) return s;
  workers_.resize(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    auto record = init_store->get(absl::StrCat("worker/", r), left());
    if (!record.ok()) return record.status();
    if (!record->empty() && (*record)[0] == '!') {
      return absl::AbortedError(absl::StrCat("rank ", r, " failed to join: ", record->substr(1)));
    }
    std::vector<std::string> parts = absl::StrSplit(*record, '\n');
    int their_world = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[2], &their_world)) {
      return absl::InternalError(absl::StrCat("rank ", r, " published a malformed record"));
    }
    if (their_world != world_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r, " ('", parts[0], "') has world size ", their_world, ", this worker ", world_size_));
    }
    workers_[r] = WorkerInfo{parts[0], r, parts[1]};
    rank_of_[parts[0]] = r;
  }
  for (const auto& w : workers_) {
    stubs_.push_back(std::make_unique<grpc::GenericStub>(net::make_channel(w.address, tls, options_.max_message_bytes)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Agent::resolve(const To& to) const {
  if (to.rank() >= 0) {
    if (to.rank() >= world_size_) {
      return absl::InvalidArgumentError(absl::StrCat("no worker of rank ", to.rank(), " (world size ", world_size_, ")"));
    }
    return to.rank();
  }
  auto it = rank_of_.find(to.name());
  if (it == rank_of_.end()) return absl::InvalidArgumentError(absl::StrCat("no worker named '", to.name(), "'"));
  return it->second;
}

std::string Agent::describe(int peer, const std::string& function) const {
  return absl::StrCat("rpc to worker '", workers_[peer].name, "' (rank ", peer, ") calling '", function, "': ");
}

// ---------------------------------------------------------------------------------------------------------------------
// Server side

grpc::ServerUnaryReactor* Agent::accept(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) {
  auto in = std::make_shared<InCall>();
  in->reactor = ctx->DefaultReactor();
  in->request = request;
  in->response = response;
  if (auto s = auth::check(ctx, token_); !s.ok()) {
    in->reactor->Finish(net::to_grpc(s));
    return in->reactor;
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      in->reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("worker '", name_, "' has shut down")));
      return in->reactor;
    }
    in_calls_.emplace(in.get(), in);
  }
  if (!pool_->submit([this, in] { handle(in); })) {
    finish_once(in, grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("worker '", name_, "' is shutting down")));
  }
  return in->reactor;
}

void Agent::handle(std::shared_ptr<InCall> in) {
  // Peers may call as soon as they know our address, before init_rpc returned here; functions run only after it did.
  if (!ready_.WaitForNotificationWithTimeout(absl::FromChrono(options_.init_timeout))) {
    return reply_error(in, absl::UnavailableError(absl::StrCat("worker '", name_, "' did not finish init_rpc")));
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return reply_error(in, absl::UnavailableError(absl::StrCat("worker '", name_, "' has shut down")));
  }
  pb::Request request;
  auto frame = wire::Frame::parse(*in->request, &request);
  if (!frame.ok()) return reply_error(in, frame.status());
  auto args = frame->decode(request.args());
  if (!args.ok()) return reply_error(in, args.status());
  Handler handler = find_function(request.function());
  if (!handler) {
    return reply_error(in, absl::NotFoundError(absl::StrCat("no function named '", request.function(),
                                                            "' is registered on worker '", name_, "'")));
  }
  CallContext context{request.caller_name(), request.caller_rank(), request.function()};
  t_current_call = &context;
  Future result;
  try {
    result = handler(std::move(*args));
  } catch (const std::invalid_argument& e) {
    result = Future::failed(absl::InvalidArgumentError(exception_message(e)));
  } catch (const RpcError& e) {
    result = Future::failed(e.status());
  } catch (const std::exception& e) {
    result = Future::failed(absl::UnknownError(exception_message(e)));
  } catch (...) {
    result = Future::failed(absl::UnknownError("unknown exception"));
  }
  t_current_call = nullptr;
  result.add_callback([this, in](const Future& f) { reply(in, f); });
}

void Agent::reply(const std::shared_ptr<InCall>& in, const Future& result) {
  absl::Status status = result.status();  // completed: does not wait
  if (!status.ok()) return reply_error(in, status);
  pb::Response response;
  wire::Encoder encoder;
  if (auto s = encoder.encode({result.value()}, response.mutable_result()); !s.ok()) {
    return reply_error(in, error_with(s, "cannot send the result: "));
  }
  grpc::ByteBuffer frame = encoder.frame(response);
  finish_once(in, grpc::Status::OK, &frame);
}

void Agent::reply_error(const std::shared_ptr<InCall>& in, const absl::Status& error) {
  pb::Response response;
  response.mutable_error()->set_code(static_cast<int>(error.code()));
  response.mutable_error()->set_message(std::string(error.message()));
  wire::Encoder encoder;
  grpc::ByteBuffer frame = encoder.frame(response);
  finish_once(in, grpc::Status::OK, &frame);
}

void Agent::finish_once(const std::shared_ptr<InCall>& in, grpc::Status status, grpc::ByteBuffer* reply) {
  {
    std::lock_guard<std::mutex> lock(in->mu);
    if (in->finished) return;
    in->finished = true;
    if (reply) in->response->Swap(reply);
    in->reactor->Finish(std::move(status));
  }
  absl::MutexLock lock(&mu_);
  in_calls_.erase(in.get());
}

// ---------------------------------------------------------------------------------------------------------------------
// Client side

Future Agent::call(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout) {
  auto peer = resolve(to);
  if (!peer.ok()) return Future::failed(error_with(peer.status(), absl::StrCat("rpc calling '", function, "': ")));
  if (timeout.count() <= 0) timeout = options_.rpc_timeout;
  const auto deadline = std::chrono::system_clock::now() + timeout;

  auto* call = new OutCall;
  call->future = Future(absl::FromChrono(deadline));
  call->peer = *peer;
  call->function = function;
  call->timeout = timeout;
  Future future = call->future;

  pb::Request request;
  request.set_function(function);
  request.set_caller_name(name_);
  request.set_caller_rank(rank_);
  wire::Encoder encoder;
  if (auto s = encoder.encode(args, request.mutable_args()); !s.ok()) {
    delete call;
    return Future::failed(error_with(s, describe(*peer, function) + "cannot send the arguments: "));
  }
  call->request = encoder.frame(request);
  call->ctx.set_deadline(deadline);
  call->ctx.AddMetadata(auth::kAuthMetadataKey, token_);
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      delete call;
      return Future::failed(absl::UnavailableError(describe(*peer, function) + "RPC has been shut down on this worker"));
    }
    out_calls_.emplace(call, true);
  }
  stubs_[*peer]->UnaryCall(&call->ctx, kCallMethod, grpc::StubOptions(), &call->request, &call->response,
                           [this, call](grpc::Status s) { on_reply(call, s); });
  return future;
}

void Agent::on_reply(OutCall* call, const grpc::Status& status) {
  std::unique_ptr<OutCall> owned(call);
  const std::string prefix = describe(call->peer, call->function);
  absl::Status error;
  c10::IValue value;
  if (!status.ok()) {
    switch (status.error_code()) {
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        error = absl::DeadlineExceededError(prefix + absl::StrCat("no reply within ", call->timeout.count(), " ms"));
        break;
      case grpc::StatusCode::UNAVAILABLE:
        error = absl::UnavailableError(prefix + "worker unreachable or dead: " + status.error_message());
        break;
      default:
        error = error_with(net::from_grpc(status), prefix);
    }
  } else {
    pb::Response response;
    auto frame = wire::Frame::parse(call->response, &response);
    if (!frame.ok()) {
      error = error_with(frame.status(), prefix + "bad reply: ");
    } else if (response.has_error()) {
      const auto code = static_cast<absl::StatusCode>(response.error().code());
      error = absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
                           prefix + (code == absl::StatusCode::kUnknown ? "remote exception: " : "") +
                               response.error().message());
    } else {
      auto values = frame->decode(response.result());
      if (!values.ok()) {
        error = error_with(values.status(), prefix + "bad reply: ");
      } else if (values->size() != 1) {
        error = absl::InternalError(prefix + "bad reply: expected one result");
      } else {
        value = std::move((*values)[0]);
      }
    }
  }
  Future future = call->future;
  {
    absl::MutexLock lock(&mu_);
    out_calls_.erase(call);
  }
  owned.reset();  // the request's tensors are released before user callbacks run
  if (error.ok()) {
    future.set_value(std::move(value));
  } else {
    future.set_error(std::move(error));
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Shutdown

absl::Status Agent::drain_outgoing(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto empty = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_calls_.empty(); };
  if (!mu_.AwaitWithDeadline(absl::Condition(&empty), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(out_calls_.size(), " outgoing calls still pending"));
  }
  return absl::OkStatus();
}

absl::Status Agent::shutdown(bool graceful) {
  absl::Status result;
  if (graceful) {
    const absl::Time deadline = absl::Now() + absl::FromChrono(options_.shutdown_timeout);
    auto left = [&] { return std::max(milliseconds(1), absl::ToChronoMilliseconds(deadline - absl::Now())); };
    result = drain_outgoing(deadline);
    if (result.ok()) result = barrier(*store_, "shutdown", rank_, world_size_, left());
    if (result.ok()) {
      // Rank 0 serves the store: it leaves last, once every other rank has read the barrier.
      if (rank_ != 0) {
        result = store_->set(absl::StrCat("left/", rank_), "");
      } else {
        std::vector<int> others;
        for (int r = 1; r < world_size_; ++r) others.push_back(r);
        result = wait_for_ranks(*store_, "left/", others, left(), "leave after the barrier");
      }
    }
    if (!result.ok()) result = error_with(result, absl::StrCat("graceful shutdown of worker '", name_, "': "));
  }
  stop(graceful ? milliseconds(2000) : milliseconds(500));
  return result;
}

void Agent::stop(milliseconds grace) {
  std::vector<std::shared_ptr<InCall>> in_calls;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    for (auto& [call, _] : out_calls_) call->ctx.TryCancel();  // their callbacks fire promptly with CANCELLED
    for (auto& [_, in] : in_calls_) in_calls.push_back(in);
  }
  set_ready();  // releases calls parked before init completed; they see stopped_
  // Calls still running here (a function that never returns) are answered now, so the server can shut down.
  for (auto& in : in_calls) {
    finish_once(in, grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat("worker '", name_, "' shut down")));
  }
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
  const bool pool_done = pool_ ? pool_->stop(grace) : true;
  const bool out_done = drain_outgoing(absl::Now() + absl::FromChrono(grace)).ok();
  stopped_cleanly_ = pool_done && out_done;
}

// ---------------------------------------------------------------------------------------------------------------------
// The process-wide agent

absl::Mutex g_mu;
std::shared_ptr<Agent> g_agent ABSL_GUARDED_BY(g_mu);

std::shared_ptr<Agent> current_agent() {
  absl::MutexLock lock(&g_mu);
  return g_agent;
}

std::shared_ptr<Agent> require_agent() {
  auto agent = current_agent();
  if (!agent) throw RpcError(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent;
}

// A stopped agent whose threads did not finish is leaked on purpose: deleting it under them would be worse.
void dispose(std::shared_ptr<Agent>& agent) {
  if (!agent) return;
  if (!agent->stopped_cleanly()) {
    new std::shared_ptr<Agent>(std::move(agent));
    return;
  }
  agent.reset();
}

void at_exit_shutdown() {
  std::shared_ptr<Agent> agent;
  {
    absl::MutexLock lock(&g_mu);
    agent = std::move(g_agent);
  }
  if (agent) {
    (void)agent->shutdown(/*graceful=*/false);
    dispose(agent);
  }
}

}  // namespace

const CallContext* current_call() { return t_current_call; }

void init_rpc(const std::string& name, int rank, int world_size, RpcOptions options) {
  absl::MutexLock lock(&g_mu);
  if (g_agent) throw RpcError(absl::FailedPreconditionError("init_rpc: RPC is already initialized"));
  auto agent = Agent::start(name, rank, world_size, options);
  throw_if_error(agent.status());
  g_agent = std::shared_ptr<Agent>(std::move(*agent));
  g_agent->set_ready();
  static bool registered = (std::atexit(at_exit_shutdown), true);
  (void)registered;
}

void init_rpc(RpcOptions options) {
  auto need_int = [](const char* var) {
    int v = 0;
    const std::string s = getenv_or(var);
    if (s.empty() || !absl::SimpleAtoi(s, &v)) {
      throw RpcError(absl::InvalidArgumentError(absl::StrCat("init_rpc: environment variable ", var, " is not set to a number")));
    }
    return v;
  };
  const int rank = need_int("RANK");
  const int world_size = need_int("WORLD_SIZE");
  init_rpc(absl::StrCat("worker", rank), rank, world_size, std::move(options));
}

void shutdown(bool graceful) {
  // The agent stays published while it drains and waits at the barrier: it keeps serving peers' calls until then, and
  // their functions may use this API.
  std::shared_ptr<Agent> agent = current_agent();
  if (!agent) return;
  absl::Status s = agent->shutdown(graceful);
  {
    absl::MutexLock lock(&g_mu);
    if (g_agent == agent) g_agent.reset();
  }
  dispose(agent);
  throw_if_error(s);
}

bool is_initialized() { return current_agent() != nullptr; }

WorkerInfo get_worker_info() { return require_agent()->self(); }

WorkerInfo get_worker_info(const std::string& name) {
  auto agent = require_agent();
  auto r = agent->resolve(To(name));
  throw_if_error(r.status());
  return agent->workers()[*r];
}

WorkerInfo get_worker_info(int id) {
  auto agent = require_agent();
  auto r = agent->resolve(To(id));
  throw_if_error(r.status());
  return agent->workers()[*r];
}

std::vector<WorkerInfo> get_all_worker_infos() { return require_agent()->workers(); }

Future call(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout) {
  auto agent = current_agent();
  if (!agent) return Future::failed(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent->call(to, function, std::move(args), timeout);
}

}  // namespace tandem::rpc
