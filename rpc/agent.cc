// The RPC runtime behind rpc/rpc.h: one Agent per process while RPC is initialized.
//
// Two transports carry calls (docs/rpc.md): gRPC, to every peer, and the direct channel (rpc/detail/direct.h) to peers
// on the same host unless RpcOptions::transport or TLS says otherwise. The choice is made per peer at init_rpc.
//
// Threads:
//   - gRPC's callback threads accept gRPC calls (Agent::accept) and complete outgoing gRPC calls (Agent::on_reply).
//     They never run user code beyond Future callbacks.
//   - pool_ runs registered functions called over gRPC. A function returning a pending Future releases its thread;
//     the reply is sent by whichever thread completes that Future.
//   - direct_'s worker threads read the direct channel and run requests (and complete async replies) on the spot.
//   - timer_ fails direct async calls at their deadline.
//
// Every incoming call is an InCall that is answered exactly once (finish_once), with the reply or, at shutdown, with
// CANCELLED. Every outgoing call is tracked (out_calls_, direct_calls_, sync_calls_) until it completes, which it does
// by its deadline at the latest.
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
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "proto/tandem_rpc.grpc.pb.h"
#include "rpc/detail/auth.h"
#include "rpc/detail/direct.h"
#include "rpc/detail/net.h"
#include "rpc/detail/thread_pool.h"
#include "rpc/detail/wire.h"
#include "rpc/extension.h"
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
  Future call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout);
  absl::Status shutdown(bool graceful);

  const WorkerInfo& self() const { return peers_[rank_]->info; }
  Store& store() { return *store_; }
  const WorkerInfo& info(int rank) const { return peers_[rank]->info; }
  std::vector<WorkerInfo> workers() const {
    std::vector<WorkerInfo> out;
    for (const auto& p : peers_) out.push_back(p->info);
    return out;
  }
  absl::StatusOr<int> resolve(const To& to) const;
  bool uses_direct(int peer) const { return peers_[peer]->direct; }
  TransportStats stats() const { return {grpc_calls_.load(), direct_calls_count_.load(), by_reference_.load()}; }

  grpc::ServerUnaryReactor* accept(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response);
  // True when everything outstanding was released (safe to delete).
  bool stopped_cleanly() const { return stopped_cleanly_; }
  // Called once init_rpc has published this agent: calls that arrived during rendezvous run from now on.
  void set_ready() {
    if (!ready_.HasBeenNotified()) ready_.Notify();
  }

 private:
  // An incoming call, whichever transport brought it.
  struct InCall {
    const grpc::ByteBuffer* request = nullptr;  // gRPC's buffer, or `owned`
    grpc::ByteBuffer owned;
    pid_t cma_pid = 0;                  // the caller's process, when tensors may be read from its memory
    int caller = -1;                    // the caller's rank, once the request is parsed (for value codecs of the reply)
    bool traced = false;                // the request carried a call tracer's attachment
    std::shared_ptr<void> trace_state;  // what the tracer keeps for this call
    // Sends the reply (or, with a non-OK status, the transport-level error). Called once, under mu.
    std::function<void(grpc::ByteBuffer* reply, const grpc::Status& status)> send;
    std::mutex mu;          // makes "send the reply" one step against a concurrent stop()
    bool finished = false;  // guarded by mu
  };
  // An outgoing gRPC call.
  struct OutCall {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request, response;
    Future future;
    int peer = -1;
    std::string function;
    milliseconds timeout{0};
  };
  // An outgoing direct async call, answered on peer->async_conn.
  struct DirectCall {
    Future future;
    int peer = -1;
    std::string function;
    milliseconds timeout{0};
    std::vector<at::Tensor> referenced;  // read by the callee from our memory: alive until the reply
    const direct::Conn* conn = nullptr;
  };
  struct Peer {
    WorkerInfo info;
    std::unique_ptr<grpc::GenericStub> stub;
    bool direct = false;
    std::string direct_address;
    std::mutex mu;
    std::shared_ptr<direct::Conn> async_conn;              // guarded by mu
    std::vector<std::shared_ptr<direct::Conn>> idle_sync;  // guarded by mu: connections of finished rpc_sync calls
  };

  Agent(std::string name, int rank, int world_size, RpcOptions options)
      : name_(std::move(name)), rank_(rank), world_size_(world_size), options_(std::move(options)) {}

  absl::Status rendezvous(const std::string& master, const std::string& advertised);
  void connect_direct_peers();
  void handle(std::shared_ptr<InCall> in);
  void run(const std::shared_ptr<InCall>& in, const std::string& function, std::vector<c10::IValue> args,
           const std::string& caller_name);
  void reply(const std::shared_ptr<InCall>& in, const Future& result);
  void reply_error(const std::shared_ptr<InCall>& in, const absl::Status& error);
  // Answers the call unless it already was, first moving `reply` (if any) into it.
  void finish_once(const std::shared_ptr<InCall>& in, grpc::Status status, grpc::ByteBuffer* reply = nullptr);
  void on_reply(OutCall* call, const grpc::Status& status);
  // The value of a reply frame from `peer`; `wait` receives the futures value codecs need completed before it is used.
  absl::StatusOr<c10::IValue> parse_reply(const grpc::ByteBuffer& frame, int peer, const std::string& prefix,
                                          std::vector<Future>* wait) const;
  // Completes `target` with `value` once `wait` has completed (at once when empty), or with the first error.
  static void deliver(const Future& target, absl::StatusOr<c10::IValue> value, std::vector<Future> wait);
  absl::Status transport_error(const absl::Status& s, int peer, const std::string& function, milliseconds timeout);
  std::string describe(int peer, const std::string& function) const;

  // Direct channel.
  void on_direct_request(const std::shared_ptr<direct::Conn>& conn, direct::Message msg);
  void on_direct_response(direct::Message msg);
  void on_direct_lost(const direct::Conn* conn, const absl::Status& why);
  void complete_direct(uint64_t call_id, absl::StatusOr<c10::IValue> result, std::vector<Future> wait = {});
  absl::StatusOr<std::shared_ptr<direct::Conn>> async_conn(int peer, absl::Time deadline);
  Future call_direct(int peer, const std::string& function, std::vector<c10::IValue>& args, milliseconds timeout);
  Future call_direct_sync(int peer, const std::string& function, std::vector<c10::IValue>& args, milliseconds timeout);
  absl::StatusOr<grpc::ByteBuffer> encode_request(int peer, const std::string& function,
                                                  const std::vector<c10::IValue>& args, uint64_t by_reference_min_bytes,
                                                  std::vector<at::Tensor>* referenced);
  void run_timer();

  absl::Status drain_outgoing(absl::Time deadline);
  // Stops serving and fails whatever is outstanding; bounded by `grace`.
  void stop(milliseconds grace);

  const std::string name_;
  const int rank_;
  const int world_size_;
  const RpcOptions options_;
  std::string token_;
  bool allow_direct_ = false;

  std::unique_ptr<grpc::Service> store_service_;  // rank 0 only; outlives server_
  std::unique_ptr<WorkerService> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<detail::ThreadPool> pool_;
  std::unique_ptr<direct::Transport> direct_;
  std::thread timer_;

  std::vector<std::unique_ptr<Peer>> peers_;
  std::map<std::string, int> rank_of_;

  absl::Mutex mu_;
  std::map<OutCall*, bool> out_calls_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<DirectCall>> direct_calls_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, uint64_t> direct_deadlines_ ABSL_GUARDED_BY(mu_);
  std::set<std::shared_ptr<direct::Conn>> sync_calls_ ABSL_GUARDED_BY(mu_);  // connections of rpc_sync calls running
  std::map<InCall*, std::shared_ptr<InCall>> in_calls_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> next_call_id_{1};
  std::atomic<int64_t> grpc_calls_{0}, direct_calls_count_{0}, by_reference_{0};
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
      return absl::FailedPreconditionError(
          absl::StrCat("cannot read the job secret from TANDEM_SECRET_FILE='", path, "'"));
    }
    return secret;
  }
  if (world_size == 1) return auth::random_secret();
  return absl::FailedPreconditionError(
      "no job secret: set RpcOptions::secret, TANDEM_SECRET or TANDEM_SECRET_FILE (tandem-run sets it for you)");
}

absl::StatusOr<std::string> resolve_transport(const RpcOptions& options) {
  std::string t = options.transport.empty() ? getenv_or("TANDEM_TRANSPORT", "auto") : options.transport;
  if (t != "auto" && t != "grpc") {
    return absl::InvalidArgumentError(absl::StrCat("unknown transport '", t, "' (auto or grpc)"));
  }
  return t;
}

// Identifies the running kernel: processes with the same boot id share a host (and may share memory).
std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
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
  auto transport = resolve_transport(options);
  if (!transport.ok()) return transport.status();
  agent->allow_direct_ = *transport == "auto" && !options.tls;

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
    return absl::InvalidArgumentError(
        "no master address: set RpcOptions::master_addr/master_port or MASTER_ADDR/MASTER_PORT");
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
  const int threads = std::max(1, options.num_worker_threads);
  agent->pool_ = std::make_unique<detail::ThreadPool>(threads);
  if (agent->allow_direct_) {
    Agent* raw = agent.get();
    auto direct = direct::Transport::start(
        agent->token_, threads, static_cast<uint64_t>(options.max_message_bytes),
        {[raw](const std::shared_ptr<direct::Conn>& c, direct::Message m) { raw->on_direct_request(c, std::move(m)); },
         [raw](const std::shared_ptr<direct::Conn>&, direct::Message m) { raw->on_direct_response(std::move(m)); },
         [raw](const std::shared_ptr<direct::Conn>& c, const absl::Status& why) {
           raw->on_direct_lost(c.get(), why);
         }});
    if (direct.ok()) {
      agent->direct_ = std::move(*direct);
      agent->timer_ = std::thread([raw] { raw->run_timer(); });
    } else {
      agent->allow_direct_ = false;  // gRPC carries everything
    }
  }
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
  const std::string my_boot = boot_id();
  const std::string record = absl::StrJoin({name_, advertised, std::to_string(world_size_), my_boot,
                                            direct_ ? direct_->address() : std::string(), std::to_string(getpid())},
                                           "\n");
  if (auto s = init_store->set(my_key, record); !s.ok()) return s;

  std::vector<int> all(world_size_);
  for (int r = 0; r < world_size_; ++r) all[r] = r;
  if (auto s = wait_for_ranks(*init_store, "worker/", all, left(), "join"); !s.ok()) return s;
  for (int r = 0; r < world_size_; ++r) {
    auto rec = init_store->get(absl::StrCat("worker/", r), left());
    if (!rec.ok()) return rec.status();
    if (!rec->empty() && (*rec)[0] == '!') {
      return absl::AbortedError(absl::StrCat("rank ", r, " failed to join: ", rec->substr(1)));
    }
    std::vector<std::string> parts = absl::StrSplit(*rec, '\n');
    int their_world = 0;
    if (parts.size() != 6 || !absl::SimpleAtoi(parts[2], &their_world)) {
      return absl::InternalError(absl::StrCat("rank ", r, " published a malformed record"));
    }
    if (their_world != world_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r, " ('", parts[0], "') has world size ", their_world, ", this worker ", world_size_));
    }
    auto peer = std::make_unique<Peer>();
    peer->info = WorkerInfo{parts[0], r, parts[1]};
    peer->stub = std::make_unique<grpc::GenericStub>(net::make_channel(parts[1], tls, options_.max_message_bytes));
    peer->direct = direct_ && !parts[4].empty() && parts[3] == my_boot;
    peer->direct_address = parts[4];
    rank_of_[parts[0]] = r;
    peers_.push_back(std::move(peer));
  }
  connect_direct_peers();
  return absl::OkStatus();
}

// The direct channel is chosen per peer here, at connection time: a same-host peer whose socket cannot be reached (a
// different network namespace, say) is served by gRPC instead.
void Agent::connect_direct_peers() {
  for (auto& peer : peers_) {
    if (!peer->direct) continue;
    auto conn = async_conn(peer->info.id, absl::Now() + absl::Seconds(5));
    if (!conn.ok()) peer->direct = false;
  }
}

absl::StatusOr<int> Agent::resolve(const To& to) const {
  if (to.rank() >= 0) {
    if (to.rank() >= world_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("no worker of rank ", to.rank(), " (world size ", world_size_, ")"));
    }
    return to.rank();
  }
  auto it = rank_of_.find(to.name());
  if (it == rank_of_.end()) return absl::InvalidArgumentError(absl::StrCat("no worker named '", to.name(), "'"));
  return it->second;
}

std::string Agent::describe(int peer, const std::string& function) const {
  return absl::StrCat("rpc to worker '", peers_[peer]->info.name, "' (rank ", peer, ") calling '", function, "': ");
}

// ---------------------------------------------------------------------------------------------------------------------
// Server side

grpc::ServerUnaryReactor* Agent::accept(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) {
  auto* reactor = ctx->DefaultReactor();
  if (auto s = auth::check(ctx, token_); !s.ok()) {
    reactor->Finish(net::to_grpc(s));
    return reactor;
  }
  auto in = std::make_shared<InCall>();
  in->request = request;
  in->send = [reactor, response](grpc::ByteBuffer* reply, const grpc::Status& status) {
    if (reply) response->Swap(reply);
    reactor->Finish(status);
  };
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("worker '", name_, "' has shut down")));
      return reactor;
    }
    in_calls_.emplace(in.get(), in);
  }
  if (!pool_->submit([this, in] { handle(in); })) {
    finish_once(in, grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("worker '", name_, "' is shutting down")));
  }
  return reactor;
}

void Agent::on_direct_request(const std::shared_ptr<direct::Conn>& conn, direct::Message msg) {
  auto in = std::make_shared<InCall>();
  in->owned = std::move(msg.body);
  in->request = &in->owned;
  in->cma_pid = conn->cma_pid;
  const uint64_t call_id = msg.call_id;
  const uint64_t max_bytes = static_cast<uint64_t>(options_.max_message_bytes);
  in->send = [conn, call_id, max_bytes](grpc::ByteBuffer* reply, const grpc::Status& status) {
    grpc::ByteBuffer body;
    if (status.ok() && reply && reply->Length() <= max_bytes) {
      body = *reply;
    } else {
      pb::Response response;
      const absl::Status error =
          !status.ok() ? net::from_grpc(status)
                       : absl::ResourceExhaustedError(absl::StrCat("the reply of ", reply ? reply->Length() : 0,
                                                                   " bytes exceeds the message limit of ", max_bytes));
      response.mutable_error()->set_code(static_cast<int>(error.code()));
      response.mutable_error()->set_message(std::string(error.message()));
      body = wire::Encoder().frame(response);
    }
    (void)conn->write(direct::Kind::kResponse, call_id, body, absl::Now() + absl::Seconds(30));
  };
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;  // the connection is being shut: the caller sees it closed
    in_calls_.emplace(in.get(), in);
  }
  if (!ready_.HasBeenNotified()) {
    // Arrived before init_rpc returned here: wait on the pool, not on an epoll thread (handshakes need those).
    if (!pool_->submit([this, in] { handle(in); })) {
      finish_once(in,
                  grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("worker '", name_, "' is shutting down")));
    }
    return;
  }
  handle(in);  // on this worker thread: no hand-off
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
  in->caller = request.caller_rank();
  std::vector<Future> wait;
  CallTracer* tracer = request.trace().empty() ? nullptr : detail::call_tracer();
  std::vector<at::Tensor> wire_tensors;
  auto args =
      frame->decode(request.args(), {in->cma_pid, request.caller_rank(), &wait, tracer ? &wire_tensors : nullptr});
  if (!args.ok()) return reply_error(in, args.status());
  if (tracer) {
    auto state = tracer->request_in(request.caller_rank(), request.trace(), wire_tensors);
    if (!state.ok()) return reply_error(in, state.status());
    in->trace_state = std::move(*state);
    in->traced = true;
  }
  if (wait.empty()) return run(in, request.function(), std::move(*args), request.caller_name());
  // Some argument needs protocol work first (e.g. a remote reference its owner must confirm): run after it, on the
  // pool.
  auto shared_args = std::make_shared<std::vector<c10::IValue>>(std::move(*args));
  when_all(wait).add_callback(
      [this, in, shared_args, function = request.function(), caller = request.caller_name()](const Future& ready) {
        if (absl::Status s = ready.status(); !s.ok()) return reply_error(in, s);
        if (!pool_->submit(
                [this, in, shared_args, function, caller] { run(in, function, std::move(*shared_args), caller); })) {
          reply_error(in, absl::UnavailableError(absl::StrCat("worker '", name_, "' is shutting down")));
        }
      });
}

void Agent::run(const std::shared_ptr<InCall>& in, const std::string& function, std::vector<c10::IValue> args,
                const std::string& caller_name) {
  Handler handler = find_function(function);
  if (!handler) {
    return reply_error(in, absl::NotFoundError(absl::StrCat("no function named '", function,
                                                            "' is registered on worker '", name_, "'")));
  }
  CallContext context{caller_name, in->caller, function};
  t_current_call = &context;
  std::shared_ptr<void> trace_scope;
  if (in->traced) {
    if (CallTracer* tracer = detail::call_tracer()) trace_scope = tracer->enter(in->trace_state);
  }
  Future result;
  try {
    result = handler(std::move(args));
  } catch (const std::invalid_argument& e) {
    result = Future::failed(absl::InvalidArgumentError(exception_message(e)));
  } catch (const RpcError& e) {
    result = Future::failed(e.status());
  } catch (const std::exception& e) {
    result = Future::failed(absl::UnknownError(exception_message(e)));
  } catch (...) {
    result = Future::failed(absl::UnknownError("unknown exception"));
  }
  trace_scope.reset();
  t_current_call = nullptr;
  result.add_callback([this, in](const Future& f) { reply(in, f); });
}

void Agent::reply(const std::shared_ptr<InCall>& in, const Future& result) {
  absl::Status status = result.status();  // completed: does not wait
  if (!status.ok()) return reply_error(in, status);
  pb::Response response;
  wire::Encoder encoder(0, in->caller);
  if (auto s = encoder.encode({result.value()}, response.mutable_result()); !s.ok()) {
    return reply_error(in, error_with(s, "cannot send the result: "));
  }
  if (in->traced) {
    if (CallTracer* tracer = detail::call_tracer()) {
      response.set_trace(tracer->reply_out(in->trace_state, in->caller, encoder.sent()));
    }
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
    in->send(reply, status);
  }
  absl::MutexLock lock(&mu_);
  in_calls_.erase(in.get());
}

// ---------------------------------------------------------------------------------------------------------------------
// Client side

absl::StatusOr<grpc::ByteBuffer> Agent::encode_request(int peer, const std::string& function,
                                                       const std::vector<c10::IValue>& args,
                                                       uint64_t by_reference_min_bytes,
                                                       std::vector<at::Tensor>* referenced) {
  pb::Request request;
  request.set_function(function);
  request.set_caller_name(name_);
  request.set_caller_rank(rank_);
  wire::Encoder encoder(by_reference_min_bytes, peer);
  if (auto s = encoder.encode(args, request.mutable_args()); !s.ok()) {
    return error_with(s, "cannot send the arguments: ");
  }
  if (CallTracer* tracer = detail::call_tracer())
    request.set_trace(tracer->request_out(peer, function, encoder.sent()));
  grpc::ByteBuffer frame = encoder.frame(request);
  by_reference_ += static_cast<int64_t>(encoder.referenced().size());
  if (referenced) referenced->swap(encoder.referenced());
  if (frame.Length() > static_cast<uint64_t>(options_.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a request of ", frame.Length(), " bytes exceeds the message limit of ", options_.max_message_bytes));
  }
  return frame;
}

absl::Status Agent::transport_error(const absl::Status& s, int peer, const std::string& function,
                                    milliseconds timeout) {
  const std::string prefix = describe(peer, function);
  switch (s.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return absl::DeadlineExceededError(prefix + absl::StrCat("no reply within ", timeout.count(), " ms"));
    case absl::StatusCode::kUnavailable: {
      absl::MutexLock lock(&mu_);
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
    when_all(wait).add_callback([target, v = std::move(*value)](const Future& ready) {
      if (absl::Status s = ready.status(); !s.ok()) {
        target.set_error(s);
      } else {
        target.set_value(v);
      }
    });
  }
}

absl::StatusOr<c10::IValue> Agent::parse_reply(const grpc::ByteBuffer& frame_bytes, int peer, const std::string& prefix,
                                               std::vector<Future>* wait) const {
  pb::Response response;
  auto frame = wire::Frame::parse(frame_bytes, &response);
  if (!frame.ok()) return error_with(frame.status(), prefix + "bad reply: ");
  if (response.has_error()) {
    const auto code = static_cast<absl::StatusCode>(response.error().code());
    return absl::Status(
        code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
        prefix + (code == absl::StatusCode::kUnknown ? "remote exception: " : "") + response.error().message());
  }
  CallTracer* tracer = response.trace().empty() ? nullptr : detail::call_tracer();
  std::vector<at::Tensor> wire_tensors;
  auto values = frame->decode(response.result(), {0, peer, wait, tracer ? &wire_tensors : nullptr});
  if (!values.ok()) return error_with(values.status(), prefix + "bad reply: ");
  if (tracer) {
    if (auto s = tracer->reply_in(peer, response.trace(), wire_tensors); !s.ok()) return error_with(s, prefix);
  }
  if (values->size() != 1) return absl::InternalError(prefix + "bad reply: expected one result");
  return std::move((*values)[0]);
}

Future Agent::call(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout) {
  auto peer = resolve(to);
  if (!peer.ok()) return Future::failed(error_with(peer.status(), absl::StrCat("rpc calling '", function, "': ")));
  if (timeout.count() <= 0) timeout = options_.rpc_timeout;
  if (peers_[*peer]->direct) return call_direct(*peer, function, args, timeout);
  const auto deadline = std::chrono::system_clock::now() + timeout;

  auto frame = encode_request(*peer, function, args, 0, nullptr);
  if (!frame.ok()) return Future::failed(error_with(frame.status(), describe(*peer, function)));
  auto* call = new OutCall;
  call->future = Future(absl::FromChrono(deadline));
  call->peer = *peer;
  call->function = function;
  call->timeout = timeout;
  call->request = std::move(*frame);
  call->ctx.set_deadline(deadline);
  call->ctx.AddMetadata(auth::kAuthMetadataKey, token_);
  Future future = call->future;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      delete call;
      return Future::failed(
          absl::UnavailableError(describe(*peer, function) + "RPC has been shut down on this worker"));
    }
    out_calls_.emplace(call, true);
  }
  ++grpc_calls_;
  peers_[*peer]->stub->UnaryCall(&call->ctx, kCallMethod, grpc::StubOptions(), &call->request, &call->response,
                                 [this, call](grpc::Status s) { on_reply(call, s); });
  return future;
}

Future Agent::call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args,
                            milliseconds timeout) {
  auto peer = resolve(to);
  if (peer.ok() && peers_[*peer]->direct) {
    return call_direct_sync(*peer, function, args, timeout.count() > 0 ? timeout : options_.rpc_timeout);
  }
  Future f = call(to, function, std::move(args), timeout);
  (void)f.status();  // bounded by the call's deadline
  return f;
}

void Agent::on_reply(OutCall* call, const grpc::Status& status) {
  std::unique_ptr<OutCall> owned(call);
  std::vector<Future> wait;
  absl::StatusOr<c10::IValue> result =
      status.ok() ? parse_reply(call->response, call->peer, describe(call->peer, call->function), &wait)
                  : absl::StatusOr<c10::IValue>(
                        transport_error(net::from_grpc(status), call->peer, call->function, call->timeout));
  Future future = call->future;
  {
    absl::MutexLock lock(&mu_);
    out_calls_.erase(call);
  }
  owned.reset();  // the request's tensors are released before user callbacks run
  deliver(future, std::move(result), std::move(wait));
}

// ---------------------------------------------------------------------------------------------------------------------
// Direct channel, client side

absl::StatusOr<std::shared_ptr<direct::Conn>> Agent::async_conn(int peer, absl::Time deadline) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.async_conn && !p.async_conn->broken) return p.async_conn;
  auto conn = direct_->connect(p.direct_address, rank_, /*for_responses=*/true, deadline);
  if (!conn.ok()) return conn.status();
  p.async_conn = *conn;
  return p.async_conn;
}

Future Agent::call_direct(int peer, const std::string& function, std::vector<c10::IValue>& args, milliseconds timeout) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  auto conn = async_conn(peer, deadline);
  if (!conn.ok()) return Future::failed(transport_error(conn.status(), peer, function, timeout));
  auto call = std::make_shared<DirectCall>();
  auto frame = encode_request(peer, function, args, (*conn)->cma_ok ? options_.bulk_min_bytes : 0, &call->referenced);
  if (!frame.ok()) return Future::failed(error_with(frame.status(), describe(peer, function)));
  call->future = Future(deadline);
  call->peer = peer;
  call->function = function;
  call->timeout = timeout;
  call->conn = conn->get();
  const uint64_t id = next_call_id_.fetch_add(1);
  Future future = call->future;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_)
      return Future::failed(absl::UnavailableError(describe(peer, function) + "RPC has been shut down on this worker"));
    direct_calls_.emplace(id, call);
    direct_deadlines_.emplace(deadline, id);  // run_timer waits on mu_ for the earliest of these
  }
  ++direct_calls_count_;
  if (auto s = (*conn)->write(direct::Kind::kRequest, id, *frame, deadline); !s.ok()) {
    if ((*conn)->broken) (*conn)->shut();  // a half-written message: the channel is done; its calls fail
    complete_direct(id, transport_error(s, peer, function, timeout));
  }
  return future;
}

void Agent::on_direct_response(direct::Message msg) {
  std::shared_ptr<DirectCall> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = direct_calls_.find(msg.call_id);
    if (it == direct_calls_.end()) return;  // it timed out or was cancelled; the late reply is dropped
    call = it->second;
  }
  std::vector<Future> wait;
  auto result = parse_reply(msg.body, call->peer, describe(call->peer, call->function), &wait);
  complete_direct(msg.call_id, std::move(result), std::move(wait));
}

void Agent::complete_direct(uint64_t call_id, absl::StatusOr<c10::IValue> result, std::vector<Future> wait) {
  std::shared_ptr<DirectCall> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = direct_calls_.find(call_id);
    if (it == direct_calls_.end()) return;
    call = std::move(it->second);
    direct_calls_.erase(it);
  }
  call->referenced.clear();
  deliver(call->future, std::move(result), std::move(wait));
}

void Agent::on_direct_lost(const direct::Conn* conn, const absl::Status& why) {
  std::vector<std::pair<uint64_t, std::shared_ptr<DirectCall>>> lost;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, call] : direct_calls_) {
      if (call->conn == conn) lost.emplace_back(id, call);
    }
  }
  const absl::Status cause = why.code() == absl::StatusCode::kCancelled ? why : absl::UnavailableError(why.message());
  for (auto& [id, call] : lost) complete_direct(id, transport_error(cause, call->peer, call->function, call->timeout));
}

void Agent::run_timer() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (stopped_ && direct_calls_.empty()) return;
    const absl::Time next = direct_deadlines_.empty() ? absl::InfiniteFuture() : direct_deadlines_.begin()->first;
    // Wakes at the earliest deadline, or when a call with an earlier one arrives, or at stop.
    auto wake = [this, next]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || (!direct_deadlines_.empty() && direct_deadlines_.begin()->first < next);
    };
    mu_.AwaitWithDeadline(absl::Condition(&wake), next);
    std::vector<uint64_t> expired;
    const bool stopping = stopped_;
    const absl::Time now = absl::Now();
    while (!direct_deadlines_.empty() && direct_deadlines_.begin()->first <= now) {
      expired.push_back(direct_deadlines_.begin()->second);
      direct_deadlines_.erase(direct_deadlines_.begin());
    }
    if (stopping) {
      for (const auto& [id, call] : direct_calls_) expired.push_back(id);
    }
    if (expired.empty()) continue;
    mu_.Unlock();
    for (uint64_t id : expired) {
      std::shared_ptr<DirectCall> call;
      {
        absl::MutexLock inner(&mu_);
        auto it = direct_calls_.find(id);
        if (it != direct_calls_.end()) call = it->second;
      }
      if (!call) continue;
      const absl::Status s =
          stopping ? absl::CancelledError("RPC was shut down on this worker") : absl::DeadlineExceededError("");
      complete_direct(id, transport_error(s, call->peer, call->function, call->timeout));
    }
    mu_.Lock();
  }
}

Future Agent::call_direct_sync(int peer, const std::string& function, std::vector<c10::IValue>& args,
                               milliseconds timeout) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  Peer& p = *peers_[peer];
  std::shared_ptr<direct::Conn> conn;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (!p.idle_sync.empty()) {
      conn = std::move(p.idle_sync.back());
      p.idle_sync.pop_back();
    }
  }
  if (!conn) {
    auto fresh = direct_->connect(p.direct_address, rank_, /*for_responses=*/false, deadline);
    if (!fresh.ok()) return Future::failed(transport_error(fresh.status(), peer, function, timeout));
    conn = *fresh;
  }
  std::vector<at::Tensor> referenced;  // alive until the reply: the callee reads them from our memory
  auto frame = encode_request(peer, function, args, conn->cma_ok ? options_.bulk_min_bytes : 0, &referenced);
  if (!frame.ok()) return Future::failed(error_with(frame.status(), describe(peer, function)));
  {
    absl::MutexLock lock(&mu_);
    if (stopped_)
      return Future::failed(absl::UnavailableError(describe(peer, function) + "RPC has been shut down on this worker"));
    sync_calls_.insert(conn);
  }
  const uint64_t id = next_call_id_.fetch_add(1);
  ++direct_calls_count_;
  absl::StatusOr<direct::Message> msg = absl::UnknownError("not sent");
  if (auto sent = conn->write(direct::Kind::kRequest, id, *frame, deadline); !sent.ok()) {
    msg = sent;
  } else {
    msg = conn->read(static_cast<uint64_t>(options_.max_message_bytes), deadline, options_.sync_spin);
  }
  {
    absl::MutexLock lock(&mu_);
    sync_calls_.erase(conn);
  }
  if (!msg.ok() || msg->kind != direct::Kind::kResponse || msg->call_id != id) {
    // The connection's state is unknown (a reply may still come): it is not reused.
    const absl::Status s = msg.ok() ? absl::InternalError("direct channel: unexpected message") : msg.status();
    return Future::failed(transport_error(s, peer, function, timeout));
  }
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.idle_sync.push_back(conn);
  }
  std::vector<Future> wait;
  auto result = parse_reply(msg->body, peer, describe(peer, function), &wait);
  Future done(deadline);
  deliver(done, std::move(result), std::move(wait));
  if (!done.wait_for(absl::ToChronoMilliseconds(deadline - absl::Now()))) {
    return Future::failed(transport_error(absl::DeadlineExceededError(""), peer, function, timeout));
  }
  return done;
}

// ---------------------------------------------------------------------------------------------------------------------
// Shutdown

absl::Status Agent::drain_outgoing(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto empty = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return out_calls_.empty() && direct_calls_.empty() && sync_calls_.empty();
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&empty), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat(out_calls_.size() + direct_calls_.size() + sync_calls_.size(), " outgoing calls still pending"));
  }
  return absl::OkStatus();
}

absl::Status Agent::shutdown(bool graceful) {
  absl::Status result;
  if (graceful) {
    const absl::Time deadline = absl::Now() + absl::FromChrono(options_.shutdown_timeout);
    auto left = [&] { return std::max(milliseconds(1), absl::ToChronoMilliseconds(deadline - absl::Now())); };
    for (const auto& hook : detail::shutdown_hooks()) {
      if (absl::Status s = hook(deadline); !s.ok() && result.ok()) result = s;
    }
    if (absl::Status s = drain_outgoing(deadline); !s.ok() && result.ok()) result = s;
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
    for (auto& conn : sync_calls_) conn->shut();               // their callers see the channel closed
    for (auto& [_, in] : in_calls_) in_calls.push_back(in);
  }
  set_ready();  // releases calls parked before init completed; they see stopped_
  // Calls still running here (a function that never returns) are answered now, so the server can shut down.
  for (auto& in : in_calls) {
    finish_once(in, grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat("worker '", name_, "' shut down")));
  }
  bool direct_done = true;
  if (direct_) direct_done = direct_->stop(grace);  // fails direct async calls with CANCELLED (on_direct_lost)
  if (timer_.joinable()) timer_.join();             // fails what is left of them
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
  const bool pool_done = pool_ ? pool_->stop(grace) : true;
  const bool out_done = drain_outgoing(absl::Now() + absl::FromChrono(grace)).ok();
  stopped_cleanly_ = pool_done && out_done && direct_done;
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
    for (const auto& hook : detail::stop_hooks()) hook();
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
      throw RpcError(
          absl::InvalidArgumentError(absl::StrCat("init_rpc: environment variable ", var, " is not set to a number")));
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
  for (const auto& hook : detail::stop_hooks()) hook();
  throw_if_error(s);
}

bool is_initialized() { return current_agent() != nullptr; }

WorkerInfo get_worker_info() { return require_agent()->self(); }

Store& job_store() { return require_agent()->store(); }

namespace {
WorkerInfo worker_info(const To& to) {
  auto agent = require_agent();
  auto r = agent->resolve(to);
  throw_if_error(r.status());
  return agent->info(*r);
}
}  // namespace

WorkerInfo get_worker_info(const std::string& name) { return worker_info(To(name)); }

WorkerInfo get_worker_info(int id) { return worker_info(To(id)); }

std::vector<WorkerInfo> get_all_worker_infos() { return require_agent()->workers(); }

Future call(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout) {
  auto agent = current_agent();
  if (!agent) return Future::failed(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent->call(to, function, std::move(args), timeout);
}

Future call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args, milliseconds timeout) {
  auto agent = current_agent();
  if (!agent) return Future::failed(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent->call_and_wait(to, function, std::move(args), timeout);
}

TransportStats transport_stats() { return require_agent()->stats(); }

std::string transport_to(const To& to) {
  auto agent = require_agent();
  auto r = agent->resolve(to);
  throw_if_error(r.status());
  return agent->uses_direct(*r) ? "direct" : "grpc";
}

}  // namespace tandem::rpc
