#include "tandem/rpc/store.h"

#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/tandem_rpc.grpc.pb.h"
#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {
namespace {

namespace pb = tandem::wire;

// ---------------------------------------------------------------------------------------------------------------------
// Server

class StoreService final : public pb::Store::CallbackService {
 public:
  StoreService(std::string token, std::string client_token)
      : token_(std::move(token)), client_token_(std::move(client_token)) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const pb::StoreSetRequest* req,
                                pb::StoreEmpty*) override {
    if (auto* rejected = reject_unauthenticated(ctx, /*write=*/true)) return rejected;
    auto* r = ctx->DefaultReactor();
    std::vector<Waiter*> ready;
    {
      MutexLock lock(&mu_);
      data_[req->key()] = req->value();
      ready = take_ready_locked();
    }
    finish_all(ready);
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx, const pb::StoreAddRequest* req,
                                pb::StoreCount* resp) override {
    if (auto* rejected = reject_unauthenticated(ctx, /*write=*/true)) return rejected;
    auto* r = ctx->DefaultReactor();
    std::vector<Waiter*> ready;
    grpc::Status status = grpc::Status::OK;
    {
      MutexLock lock(&mu_);
      int64_t value = 0;
      auto it = data_.find(req->key());
      if (it != data_.end() && !absl::SimpleAtoi(it->second, &value)) {
        status =
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("key '", req->key(), "' is not a counter"));
      } else if (__builtin_add_overflow(value, req->delta(), &value)) {
        status =
            grpc::Status(grpc::StatusCode::OUT_OF_RANGE, absl::StrCat("counter '", req->key(), "' would overflow"));
      } else {
        data_[req->key()] = absl::StrCat(value);
        resp->set_value(value);
        ready = take_ready_locked();
      }
    }
    finish_all(ready);
    r->Finish(status);
    return r;
  }

  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const pb::StoreKey* req,
                                pb::StoreValue* resp) override {
    return park(ctx, {req->key()}, [resp, key = req->key()](const std::map<std::string, std::string>& data) {
      resp->set_value(data.at(key));
    });
  }

  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* ctx, const pb::StoreWaitRequest* req,
                                 pb::StoreEmpty*) override {
    return park(ctx, {req->keys().begin(), req->keys().end()}, nullptr);
  }

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const pb::StoreWaitRequest* req,
                                  pb::StoreCheckReply* resp) override {
    if (auto* rejected = reject_unauthenticated(ctx)) return rejected;
    auto* r = ctx->DefaultReactor();
    {
      MutexLock lock(&mu_);
      for (const auto& k : req->keys()) resp->add_present(data_.count(k) > 0);
    }
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx, const pb::StoreKey* req,
                                   pb::StoreEmpty*) override {
    if (auto* rejected = reject_unauthenticated(ctx, /*write=*/true)) return rejected;
    auto* r = ctx->DefaultReactor();
    {
      MutexLock lock(&mu_);
      data_.erase(req->key());
    }
    r->Finish(grpc::Status::OK);
    return r;
  }

 private:
  using Fill = std::function<void(const std::map<std::string, std::string>&)>;

  // A finished reactor when the caller lacks the job token (a client's token reads only), else nullptr.
  grpc::ServerUnaryReactor* reject_unauthenticated(grpc::CallbackServerContext* ctx, bool write = false) {
    auto caller = auth::check_caller(ctx, token_, client_token_);
    absl::Status s = caller.status();
    if (s.ok() && write && *caller == auth::Caller::kClient) {
      s = absl::PermissionDeniedError("a client outside the job reads the job's store but does not write it");
    }
    if (s.ok()) return nullptr;
    auto* r = ctx->DefaultReactor();
    r->Finish(net::to_grpc(s));
    return r;
  }

  // A get/wait parked until its keys exist. It finishes exactly once: when the keys appear (take_ready_locked) or when
  // the call is cancelled (the caller's deadline passed, or the server shuts down). `finished` decides which, under
  // mu_.
  struct Waiter : grpc::ServerUnaryReactor {
    Waiter(StoreService* s, std::vector<std::string> k, Fill f) : service(s), keys(std::move(k)), fill(std::move(f)) {}
    void OnCancel() override {
      {
        MutexLock lock(&service->mu_);
        if (finished) return;
        finished = true;
        service->waiters_.remove(this);
      }
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "store wait cancelled"));
    }
    void OnDone() override { delete this; }
    StoreService* service;
    std::vector<std::string> keys;
    Fill fill;
    bool finished = false;  // guarded by service->mu_
  };

  grpc::ServerUnaryReactor* park(grpc::CallbackServerContext* ctx, std::vector<std::string> keys, Fill fill) {
    if (auto* rejected = reject_unauthenticated(ctx)) return rejected;
    auto* w = new Waiter(this, std::move(keys), std::move(fill));
    bool ready = false;
    {
      MutexLock lock(&mu_);
      if (all_present_locked(w->keys)) {
        if (w->fill) w->fill(data_);
        w->finished = true;
        ready = true;
      } else {
        waiters_.push_back(w);
      }
    }
    if (ready) w->Finish(grpc::Status::OK);
    return w;
  }

  bool all_present_locked(const std::vector<std::string>& keys) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& k : keys) {
      if (!data_.count(k)) return false;
    }
    return true;
  }

  std::vector<Waiter*> take_ready_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Waiter*> ready;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      Waiter* w = *it;
      if (all_present_locked(w->keys)) {
        if (w->fill) w->fill(data_);
        w->finished = true;
        ready.push_back(w);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
    return ready;
  }

  static void finish_all(const std::vector<Waiter*>& ready) {
    for (Waiter* w : ready) w->Finish(grpc::Status::OK);
  }

  const std::string token_;
  const std::string client_token_;  // empty: no client may read
  Mutex mu_;
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
  std::list<Waiter*> waiters_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------------------------------------------------
// Client

class StoreClient final : public Store {
 public:
  StoreClient(std::shared_ptr<grpc::Channel> channel, std::string token, bool wait_for_ready,
              std::chrono::milliseconds op_timeout)
      : stub_(pb::Store::NewStub(std::move(channel))),
        token_(std::move(token)),
        wait_for_ready_(wait_for_ready),
        op_timeout_(op_timeout) {}

  absl::Status set(const std::string& key, const std::string& value) override {
    pb::StoreSetRequest req;
    req.set_key(key);
    req.set_value(value);
    pb::StoreEmpty resp;
    auto ctx = context(op_timeout_);
    return annotate(stub_->Set(ctx.get(), req, &resp), "set", key);
  }

  absl::StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    pb::StoreKey req;
    req.set_key(key);
    pb::StoreValue resp;
    auto ctx = context(timeout);
    if (auto s = annotate(stub_->Get(ctx.get(), req, &resp), "get", key); !s.ok()) return s;
    return std::move(*resp.mutable_value());
  }

  absl::StatusOr<int64_t> add(const std::string& key, int64_t delta) override {
    pb::StoreAddRequest req;
    req.set_key(key);
    req.set_delta(delta);
    pb::StoreCount resp;
    auto ctx = context(op_timeout_);
    if (auto s = annotate(stub_->Add(ctx.get(), req, &resp), "add", key); !s.ok()) return s;
    return resp.value();
  }

  absl::Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    pb::StoreWaitRequest req;
    for (const auto& k : keys) req.add_keys(k);
    pb::StoreEmpty resp;
    auto ctx = context(timeout);
    return annotate(stub_->Wait(ctx.get(), req, &resp), "wait", absl::StrJoin(keys, ","));
  }

  absl::StatusOr<std::vector<bool>> check(const std::vector<std::string>& keys) override {
    pb::StoreWaitRequest req;
    for (const auto& k : keys) req.add_keys(k);
    pb::StoreCheckReply resp;
    auto ctx = context(op_timeout_);
    if (auto s = annotate(stub_->Check(ctx.get(), req, &resp), "check", ""); !s.ok()) return s;
    if (resp.present_size() != static_cast<int>(keys.size())) return absl::InternalError("store check: bad reply");
    return std::vector<bool>(resp.present().begin(), resp.present().end());
  }

  absl::Status remove(const std::string& key) override {
    pb::StoreKey req;
    req.set_key(key);
    pb::StoreEmpty resp;
    auto ctx = context(op_timeout_);
    return annotate(stub_->Delete(ctx.get(), req, &resp), "delete", key);
  }

 private:
  std::unique_ptr<grpc::ClientContext> context(std::chrono::milliseconds timeout) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + timeout);
    auth::add_credentials(ctx.get(), token_);
    ctx->set_wait_for_ready(wait_for_ready_);
    return ctx;
  }

  static absl::Status annotate(const grpc::Status& s, const char* op, const std::string& key) {
    if (s.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("store ", op, "('", key, "'): ", s.error_message()));
  }

  std::unique_ptr<pb::Store::Stub> stub_;
  const std::string token_;
  const bool wait_for_ready_;
  const std::chrono::milliseconds op_timeout_;
};

}  // namespace

std::unique_ptr<Store> connect_store(std::shared_ptr<grpc::Channel> channel, std::string token, bool wait_for_ready,
                                     std::chrono::milliseconds op_timeout) {
  return std::make_unique<StoreClient>(std::move(channel), std::move(token), wait_for_ready, op_timeout);
}

std::unique_ptr<grpc::Service> make_store_service(std::string token, std::string client_token) {
  return std::make_unique<StoreService>(std::move(token), std::move(client_token));
}

namespace {

class StandaloneStoreServer final : public StoreServer {
 public:
  int port() const override { return port_; }
  ~StandaloneStoreServer() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());  // waiting calls end now, cancelled
  }

  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Rendezvous values are small: a megabyte bounds what a peer can make the server hold per message.
constexpr int64_t kStandaloneMaxMessageBytes = int64_t{1} << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<StoreServer>> serve_store(const std::string& address, const std::string& secret) {
  // Tried with a plain socket first, so that a port in use is a quiet answer rather than gRPC's error log.
  if (auto colon = address.rfind(':'); colon != std::string::npos) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    std::string host = address.substr(0, colon);
    if (host.size() > 1 && host.front() == '[') host = host.substr(1, host.size() - 2);
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), address.substr(colon + 1).c_str(), &hints, &found) == 0) {
      // Every address is tried: a port in use on any of them is another launcher's store (gRPC would serve on the
      // others and make a second one).
      bool bound = false, in_use = false, listening = false;
      int error = 0;
      std::vector<const addrinfo*> refused;  // bind refused for lack of privilege (a port below 1024)
      for (addrinfo* a = found; a; a = a->ai_next) {
        const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
          error = errno;
          continue;
        }
        const int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC binds
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
          bound = true;
        } else {
          error = errno;
          in_use = in_use || errno == EADDRINUSE;
          if (errno == EACCES || errno == EPERM) refused.push_back(a);
        }
        close(fd);
      }
      // A port this process may not bind: a launcher allowed to may serve it, which a connection it accepts tells (a
      // local address: accepted or refused at once; bounded all the same).
      for (size_t k = 0; k < refused.size() && !bound && !in_use && !listening; ++k) {
        const int fd = socket(refused[k]->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        if (::connect(fd, refused[k]->ai_addr, refused[k]->ai_addrlen) == 0) {
          listening = true;
        } else if (errno == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          int so_error = 0;
          socklen_t len = sizeof(so_error);
          listening =
              poll(&p, 1, 500) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 && so_error == 0;
        }
        close(fd);
      }
      freeaddrinfo(found);
      if (in_use || listening)
        return absl::UnavailableError(absl::StrCat("cannot serve a store on ", address, ": the port is in use"));
      // Not this machine's address, a port it may not bind, no sockets left, and nobody serves it either.
      if (!bound) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot serve a store on ", address, ": ", std::strerror(error)));
      }
    }
  }
  auto s = std::make_unique<StandaloneStoreServer>();
  s->service_ = make_store_service(auth::derive_token(secret));
  grpc::ServerBuilder builder;
  net::configure_server(builder, kStandaloneMaxMessageBytes);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve a store on ", address, ": the port is in use or the ",
                                               "address is not this machine's"));
  }
  return std::unique_ptr<StoreServer>(std::move(s));
}

std::unique_ptr<Store> connect_store(const std::string& address, const std::string& secret,
                                     std::chrono::milliseconds op_timeout) {
  return connect_store(net::make_channel(address, nullptr, kStandaloneMaxMessageBytes), auth::derive_token(secret),
                       /*wait_for_ready=*/true, op_timeout);
}

absl::Status wait_for_ranks(Store& store, const std::string& prefix, const std::vector<int>& ranks,
                            std::chrono::milliseconds timeout, const std::string& what) {
  std::vector<std::string> keys;
  for (int r : ranks) keys.push_back(prefix + std::to_string(r));
  absl::Status s = store.wait(keys, timeout);
  if (s.code() != absl::StatusCode::kDeadlineExceeded) return s;
  std::vector<int> missing;
  if (auto present = store.check(keys); present.ok()) {
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (!(*present)[i]) missing.push_back(ranks[i]);
    }
  }
  if (missing.empty()) return s;
  return absl::DeadlineExceededError(absl::StrCat("rank", missing.size() == 1 ? " " : "s ",
                                                  absl::StrJoin(missing, ", "), " did not ", what, " within ",
                                                  timeout.count(), " ms"));
}

absl::Status barrier(Store& store, const std::string& name, int rank, int world_size,
                     std::chrono::milliseconds timeout) {
  const std::string prefix = "barrier/" + name + "/";
  if (auto s = store.set(prefix + std::to_string(rank), ""); !s.ok()) return s;
  std::vector<int> all(world_size);
  for (int r = 0; r < world_size; ++r) all[r] = r;
  absl::Status s = wait_for_ranks(store, prefix, all, timeout, "arrive");
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("barrier '", name, "': ", s.message()));
  return s;
}

}  // namespace tandem::rpc
