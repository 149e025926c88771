// Start-up of the agent (rpc/detail/agent.h): options, transports, the job's store, the rendezvous record, and the
// route to each peer.
#include <grpcpp/impl/codegen/service_type.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/log/log.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/direct_transport.h"
#include "tandem/rpc/detail/fault_transport.h"
#include "tandem/rpc/detail/grpc_transport.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/detail/version.h"

namespace tandem::rpc::detail {
namespace {

std::string getenv_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

absl::Status error_with(absl::Status s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

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

// TLS from the environment when the program set none: TANDEM_TLS_CERT, TANDEM_TLS_KEY and TANDEM_TLS_CA together (and
// TANDEM_TLS_SERVER_NAME, optional), so a launcher or a cluster's manifest turns TLS on for any Tandem program.
absl::StatusOr<std::optional<TlsOptions>> resolve_tls(const RpcOptions& options) {
  if (options.tls) return options.tls;
  const char* names[] = {"TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"};
  std::string values[3], missing;
  int set = 0;
  for (int i = 0; i < 3; ++i) {
    values[i] = getenv_or(names[i]);
    if (values[i].empty()) {
      absl::StrAppend(&missing, missing.empty() ? "" : ", ", names[i]);
    } else {
      ++set;
      if (!std::ifstream(values[i])) {
        return absl::FailedPreconditionError(absl::StrCat("cannot read ", names[i], "='", values[i], "'"));
      }
    }
  }
  if (set == 0) return std::optional<TlsOptions>();
  if (set < 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS from the environment needs TANDEM_TLS_CERT, TANDEM_TLS_KEY and TANDEM_TLS_CA; missing: ", missing));
  }
  TlsOptions t;
  t.cert_chain_path = values[0];
  t.private_key_path = values[1];
  t.root_certs_path = values[2];
  t.target_name_override = getenv_or("TANDEM_TLS_SERVER_NAME");
  return std::optional<TlsOptions>(t);
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

const std::regex& name_pattern() {
  static const std::regex kName("[A-Za-z0-9_.:-]{1,128}");
  return kName;
}

std::string worker_record(const tandem::wire::WorkerRecord& worker) {
  tandem::wire::RendezvousRecord rec;
  rec.set_wire_version(kWireVersion);
  *rec.mutable_worker() = worker;
  return rec.SerializeAsString();
}

std::string failed_record(const absl::Status& why) {
  tandem::wire::RendezvousRecord rec;
  rec.set_wire_version(kWireVersion);
  rec.mutable_failed()->set_code(static_cast<int>(why.code()));
  rec.mutable_failed()->set_message(std::string(why.message()));
  return rec.SerializeAsString();
}

}  // namespace

absl::StatusOr<tandem::wire::WorkerRecord> parse_record(const std::string& bytes, int rank, int world_size) {
  tandem::wire::RendezvousRecord rec;
  if (!rec.ParseFromString(bytes) || rec.wire_version() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank,
                     " published a rendezvous record this build cannot read (a Tandem build from before wire "
                     "versioning?); every worker of a job must run the same Tandem release"));
  }
  if (rec.wire_version() != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " speaks Tandem wire version ", rec.wire_version(),
                                                      ", this worker version ", kWireVersion,
                                                      ": every worker of a job must run the same Tandem release"));
  }
  if (rec.has_failed()) {
    return absl::AbortedError(absl::StrCat("rank ", rank, " failed to join: ", rec.failed().message()));
  }
  const tandem::wire::WorkerRecord& w = rec.worker();
  if (!rec.has_worker() || w.rank() != rank || !std::regex_match(w.name(), name_pattern()) ||
      w.grpc_address().empty() || w.pid() <= 0 || w.direct_address().size() > 100 || w.tcp_address().size() > 300 ||
      (!w.tcp_address().empty() && !direct::is_tcp_address(w.tcp_address()))) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " published a malformed rendezvous record"));
  }
  if (w.world_size() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " ('", w.name(), "') has world size ", w.world_size(),
                                                   ", this worker ", world_size));
  }
  return w;
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::start(const std::string& name, int rank, int world_size,
                                                    const RpcOptions& options) {
  if (!std::regex_match(name, name_pattern())) {
    return absl::InvalidArgumentError(absl::StrCat("invalid worker name '", name, "' (1-128 of A-Z a-z 0-9 _ . : -)"));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("invalid rank ", rank, " for world size ", world_size));
  }
  auto tls = resolve_tls(options);
  if (!tls.ok()) return error_with(tls.status(), absl::StrCat("worker '", name, "': "));
  RpcOptions resolved = options;
  resolved.tls = *tls;
  if (std::getenv("TANDEM_LOG_LEVEL")) tandem::log::reload_from_env();  // else a level set in code stays
  tandem::log::set_worker(name);
  std::unique_ptr<Agent> agent(new Agent(name, rank, world_size, resolved));
  auto secret = resolve_secret(options, world_size);
  if (!secret.ok()) return secret.status();
  agent->token_ = auth::derive_token(*secret);
  agent->client_token_ = auth::derive_client_token(*secret);

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
  const std::string bind_host = rank == 0 ? (net::is_loopback(master_addr) ? master_addr : "0.0.0.0") : host;
  const std::string listen = net::join_host_port(bind_host, rank == 0 ? master_port : 0);
  int port = 0;
  // The direct channel's TCP listener serves peers on other hosts; a job on loopback has none.
  const std::string tcp_host = net::is_loopback(host) ? "" : host;
  if (auto s = agent->start_transports(listen, tcp_host, &port); !s.ok()) {
    return error_with(
        s, absl::StrCat(
               "worker '", name, "': ",
               rank == 0 && s.code() == absl::StatusCode::kUnavailable ? "(is the master port already in use?) " : ""));
  }
  const std::string master = net::join_host_port(master_addr, rank == 0 ? port : master_port);
  TANDEM_LOG(kDebug, "rendezvous") << "rank " << rank << " of " << world_size << ": serving on " << listen << " (port "
                                   << port << "), master " << master << (resolved.tls ? ", TLS" : "");
  if (auto s = agent->rendezvous(master, net::join_host_port(host, port)); !s.ok()) {
    agent->stop(std::chrono::milliseconds(1000));  // nothing ran yet: only the transports' threads unwind
    s = error_with(s, absl::StrCat("init_rpc of worker '", name, "' (rank ", rank, "): "));
    TANDEM_LOG(kWarn, "rendezvous") << s.message();
    return s;
  }
  TANDEM_LOG(kInfo, "rpc") << "joined the job as rank " << rank << " of " << world_size << " (master " << master << ")";
  return agent;
}

absl::Status Agent::start_transports(const std::string& listen, const std::string& tcp_host, int* port) {
  auto transport = resolve_transport(options_);
  if (!transport.ok()) return transport.status();
  const bool allow_direct = *transport == "auto" && !options_.tls;
  const int threads = std::max(1, options_.num_worker_threads);
  pool_ = std::make_unique<ThreadPool>(threads);
  IncomingFn handler = [this](Incoming in) { on_incoming(std::move(in)); };
  if (!options_.faults.empty()) {
    faults_ = std::make_unique<FaultInjector>(options_.faults, name_);
    handler = faults_->wrap_incoming(std::move(handler));
  }
  if (rank_ == 0) store_service_ = make_store_service(token_, client_token_);
  GrpcTransport::Options grpc_options;
  grpc_options.token = token_;
  grpc_options.client_token = client_token_;
  grpc_options.listen = listen;
  grpc_options.tls = options_.tls ? &*options_.tls : nullptr;
  grpc_options.max_message_bytes = options_.max_message_bytes;
  grpc_options.store = store_service_.get();
  auto grpc = GrpcTransport::start(std::move(grpc_options), handler);
  if (!grpc.ok()) return grpc.status();
  grpc_ = std::move(*grpc);
  *port = grpc_->port();
  if (allow_direct) {
    auto direct = DirectTransport::start(token_, rank_, threads, static_cast<uint64_t>(options_.max_message_bytes),
                                         options_.rpc_timeout, handler, tcp_host);
    if (direct.ok()) {
      direct_ = std::move(*direct);
      direct_->set_serve_spin(options_.serve_spin);
    } else {  // gRPC carries everything
      TANDEM_LOG(kWarn, "rpc") << "the direct channel did not start (" << direct.status().message()
                               << "); every call goes over gRPC";
    }
  }
  grpc_route_ = grpc_.get();
  direct_route_ = direct_.get();
  if (faults_) {
    wrapped_.push_back(faults_->wrap(grpc_.get()));
    grpc_route_ = wrapped_.back().get();
    if (direct_) {
      wrapped_.push_back(faults_->wrap(direct_.get()));
      direct_route_ = wrapped_.back().get();
    }
  }
  return absl::OkStatus();
}

absl::Status Agent::rendezvous(const std::string& master, const std::string& advertised) {
  const TlsOptions* tls = options_.tls ? &*options_.tls : nullptr;
  auto master_channel = net::make_channel(master, tls, options_.max_message_bytes);
  const absl::Time deadline = absl::Now() + absl::FromChrono(options_.init_timeout);
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1), absl::ToChronoMilliseconds(deadline - absl::Now()));
  };
  // Only the first contact waits for the master to come up; after it, a master that goes away fails the rendezvous at
  // once instead of at the init deadline.
  auto first_contact = connect_store(master_channel, token_, /*wait_for_ready=*/true, options_.init_timeout);
  store_ = connect_store(master_channel, token_, /*wait_for_ready=*/false, options_.rpc_timeout);
  Store* init_store = store_.get();

  const std::string my_key = absl::StrCat("worker/", rank_);
  TANDEM_LOG(kDebug, "rendezvous") << "contacting the master's store at " << master;
  auto taken = first_contact->add("name/" + name_, 1);
  if (!taken.ok()) return error_with(taken.status(), absl::StrCat("cannot reach the master at ", master, ": "));
  if (*taken != 1) {
    const std::string err = absl::StrCat("worker name '", name_, "' is used by another rank");
    // Lets the other ranks fail at once instead of at the timeout.
    (void)init_store->set(my_key, failed_record(absl::AlreadyExistsError(err)));
    return absl::AlreadyExistsError(err);
  }
  tandem::wire::WorkerRecord me;
  me.set_name(name_);
  me.set_rank(rank_);
  me.set_world_size(world_size_);
  me.set_grpc_address(advertised);
  me.set_boot_id(boot_id());
  if (direct_) me.set_direct_address(direct_->address());
  if (direct_) me.set_tcp_address(direct_->tcp_address());
  me.set_pid(getpid());
  if (auto s = init_store->set(my_key, worker_record(me)); !s.ok()) return s;
  TANDEM_LOG(kDebug, "rendezvous") << "published " << my_key << " (gRPC " << advertised
                                   << (direct_ ? ", direct " + direct_->address() : std::string()) << "); waiting for "
                                   << world_size_ << " workers";

  std::vector<int> all(world_size_);
  for (int r = 0; r < world_size_; ++r) all[r] = r;
  if (auto s = wait_for_ranks(*init_store, "worker/", all, left(), "join"); !s.ok()) return s;
  std::vector<PeerAddress> addresses;
  for (int r = 0; r < world_size_; ++r) {
    auto bytes = init_store->get(absl::StrCat("worker/", r), left());
    if (!bytes.ok()) return bytes.status();
    auto rec = parse_record(*bytes, r, world_size_);
    if (!rec.ok()) return rec.status();
    if (rank_of_.count(rec->name())) {
      return absl::AlreadyExistsError(
          absl::StrCat("ranks ", rank_of_[rec->name()], " and ", r, " are both named '", rec->name(), "'"));
    }
    rank_of_[rec->name()] = r;
    PeerAddress a;
    a.rank = r;
    a.name = rec->name();
    a.grpc_address = rec->grpc_address();
    a.direct_address = rec->direct_address();
    a.tcp_address = rec->tcp_address();
    a.same_host = !rec->boot_id().empty() && rec->boot_id() == me.boot_id();
    addresses.push_back(std::move(a));
  }
  peers_.resize(world_size_);
  std::vector<std::string> names;
  for (const auto& a : addresses) {
    peers_[a.rank].info = WorkerInfo{a.name, a.rank, a.grpc_address};
    names.push_back(a.name);
  }
  if (faults_) faults_->set_peers(names);
  // The route is chosen per peer here: the direct channel when it reaches the peer (over its Unix socket on this host,
  // else over TCP), gRPC otherwise. Connecting shares the rendezvous deadline.
  for (const auto& a : addresses) {
    if (auto s = grpc_route_->add_peer(a, deadline); !s.ok()) return s;
    peers_[a.rank].transport = grpc_route_;
    if (direct_route_) {
      const absl::Status direct = direct_route_->add_peer(a, deadline);
      if (direct.ok()) {
        peers_[a.rank].transport = direct_route_;
      } else if (direct.code() == absl::StatusCode::kUnauthenticated ||
                 direct.code() == absl::StatusCode::kFailedPrecondition) {
        return direct;  // a peer that refuses this job's token or speaks another version: not a route to fall back on
      }
    }
    TANDEM_LOG(kDebug, "rpc") << "route to " << a.name << " (rank " << a.rank
                              << "): " << (peers_[a.rank].transport == direct_route_ ? "direct channel" : "gRPC")
                              << " (" << (a.same_host ? "same host" : "other host") << ", gRPC " << a.grpc_address
                              << ")";
  }
  return absl::OkStatus();
}

}  // namespace tandem::rpc::detail
