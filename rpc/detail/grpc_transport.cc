#include "tandem/rpc/detail/grpc_transport.h"

#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.grpc.pb.h"
#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/net.h"

namespace tandem::rpc::detail {
namespace {
constexpr char kCallMethod[] = "/tandem.wire.Worker/Call";
}  // namespace

class GrpcTransport::Service final
    : public tandem::wire::Worker::WithRawCallbackMethod_Call<tandem::wire::Worker::CallbackService> {
 public:
  explicit Service(GrpcTransport* t) : t_(t) {}
  grpc::ServerUnaryReactor* Call(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override {
    return t_->accept(ctx, request, response);
  }

 private:
  GrpcTransport* t_;
};

absl::StatusOr<std::unique_ptr<GrpcTransport>> GrpcTransport::start(Options options, IncomingFn on_request) {
  std::unique_ptr<GrpcTransport> t(new GrpcTransport);
  t->options_ = std::move(options);
  t->on_request_ = std::move(on_request);
  auto creds = net::server_credentials(t->options_.tls);
  if (!creds.ok()) return absl::Status(creds.status().code(), absl::StrCat("TLS set-up: ", creds.status().message()));
  grpc::ServerBuilder builder;
  net::configure_server(builder, t->options_.max_message_bytes);
  builder.AddListeningPort(t->options_.listen, *creds, &t->port_);
  t->service_ = std::make_unique<Service>(t.get());
  builder.RegisterService(t->service_.get());
  if (t->options_.store) builder.RegisterService(t->options_.store);
  t->server_ = builder.BuildAndStart();
  if (!t->server_ || t->port_ == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", t->options_.listen));
  return t;
}

// Normally already stopped (with the shutdown's grace); here only running callbacks unwind, so a fixed second.
GrpcTransport::~GrpcTransport() { stop(std::chrono::milliseconds(1000)); }

grpc::ServerUnaryReactor* GrpcTransport::accept(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) {
  auto* reactor = ctx->DefaultReactor();
  auto caller = auth::check_caller(ctx, options_.token, options_.client_token);
  if (!caller.ok()) {
    reactor->Finish(net::to_grpc(caller.status()));
    return reactor;
  }
  Incoming in;
  in.from_client = *caller == auth::Caller::kClient;
  in.request = *request;  // shares gRPC's slices (reference-counted), no copy of bytes
  in.reply = [reactor, response](grpc::ByteBuffer* reply, const absl::Status& status) {
    if (reply) response->Swap(reply);
    reactor->Finish(net::to_grpc(status));
  };
  in.cut = [reactor](const grpc::ByteBuffer*) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the connection was cut"));
  };
  on_request_(std::move(in));
  return reactor;
}

absl::Status GrpcTransport::add_peer(const PeerAddress& peer, absl::Time) {
  auto stub = std::make_shared<grpc::GenericStub>(
      net::make_channel(peer.grpc_address, options_.tls, options_.max_message_bytes));
  MutexLock lock(&mu_);
  stubs_[peer.rank] = std::move(stub);
  addresses_[peer.rank] = peer.grpc_address;
  return absl::OkStatus();
}

void GrpcTransport::call(int peer, const std::string&, grpc::ByteBuffer request, absl::Time deadline, DoneFn done) {
  auto* call = new OutCall;
  call->request = std::move(request);
  call->done = std::move(done);
  call->peer = peer;
  call->ctx.set_deadline(absl::ToChronoTime(deadline));
  auth::add_credentials(&call->ctx, options_.token);
  std::shared_ptr<grpc::GenericStub> stub;
  absl::Status refused;
  {
    MutexLock lock(&mu_);
    auto it = stubs_.find(peer);
    if (stopped_) {
      refused = absl::CancelledError("RPC was shut down on this worker");
    } else if (it == stubs_.end()) {
      refused = absl::UnavailableError("no gRPC channel to this worker");
    } else {
      stub = it->second;
      out_calls_.emplace(call, true);
    }
  }
  if (!refused.ok()) {
    DoneFn d = std::move(call->done);
    delete call;
    return d(refused);
  }
  stub->UnaryCall(&call->ctx, kCallMethod, grpc::StubOptions(), &call->request, &call->response,
                  [this, call](grpc::Status s) { on_reply(call, s); });
}

void GrpcTransport::on_reply(OutCall* call, const grpc::Status& status) {
  std::unique_ptr<OutCall> owned(call);
  absl::StatusOr<grpc::ByteBuffer> result = std::move(call->response);
  bool stopped = false;
  {
    MutexLock lock(&mu_);
    out_calls_.erase(call);
    stopped = stopped_;
  }
  if (!status.ok()) {
    if (call->cut) {
      result = absl::UnavailableError("the connection was cut");
    } else if (stopped && status.error_code() == grpc::StatusCode::CANCELLED) {
      result = absl::CancelledError("RPC was shut down on this worker");
    } else {
      result = net::from_grpc(status);
    }
  }
  DoneFn done = std::move(call->done);
  owned.reset();  // the request's tensors are released before the caller's callbacks run
  done(std::move(result));
}

void GrpcTransport::cut(int peer, const grpc::ByteBuffer*) {
  // gRPC owns its connections: a fresh channel replaces the peer's, and the calls in flight on the old one fail.
  MutexLock lock(&mu_);
  auto it = addresses_.find(peer);
  if (it == addresses_.end()) return;
  stubs_[peer] =
      std::make_shared<grpc::GenericStub>(net::make_channel(it->second, options_.tls, options_.max_message_bytes));
  for (auto& [call, _] : out_calls_) {
    if (call->peer == peer) {
      call->cut = true;
      call->ctx.TryCancel();
    }
  }
}

bool GrpcTransport::stop(std::chrono::milliseconds grace) {
  {
    MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      for (auto& [call, _] : out_calls_) call->ctx.TryCancel();  // their callbacks fire promptly with CANCELLED
    }
  }
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
  MutexLock lock(&mu_);
  auto empty = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_calls_.empty(); };
  return mu_.AwaitWithTimeout(Condition(&empty), absl::FromChrono(grace));
}

}  // namespace tandem::rpc::detail
