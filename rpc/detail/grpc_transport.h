// gRPC as a Transport: this worker's server (also the job's store on rank 0) and one generic stub per peer.
//
// Threads: gRPC's callback threads accept requests (handed on to `on_request`, which must not block) and complete
// outgoing calls (their DoneFn runs there). Deadlines are gRPC's own (ClientContext::set_deadline).
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "tandem/rpc/transport.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {
struct TlsOptions;
}

namespace tandem::rpc::detail {

class GrpcTransport final : public Transport {
 public:
  struct Options {
    std::string token;         // the job's authentication token (rpc/detail/auth.h)
    std::string client_token;  // also accepted, for calls from clients outside the job (empty: none)
    std::string listen;        // host:port to bind (port 0: any)
    const TlsOptions* tls = nullptr;
    int64_t max_message_bytes = 0;
    grpc::Service* store = nullptr;  // also served (rank 0: the job's store); must outlive the transport
  };
  // Starts the server. UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<GrpcTransport>> start(Options options, IncomingFn on_request);
  ~GrpcTransport() override;

  int port() const { return port_; }

  const char* kind() const override { return "grpc"; }
  absl::Status add_peer(const PeerAddress& peer, absl::Time deadline) override;
  void call(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline, DoneFn done) override;
  void cut(int peer, const grpc::ByteBuffer* partial) override;
  bool stop(std::chrono::milliseconds grace) override;

 private:
  class Service;
  struct OutCall {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request, response;
    DoneFn done;
    int peer = -1;
    bool cut = false;  // cancelled by cut(): reported as UNAVAILABLE
  };

  GrpcTransport() = default;
  grpc::ServerUnaryReactor* accept(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response);
  void on_reply(OutCall* call, const grpc::Status& status);

  Options options_;
  IncomingFn on_request_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;

  Mutex mu_;
  std::map<int, std::shared_ptr<grpc::GenericStub>> stubs_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> addresses_ ABSL_GUARDED_BY(mu_);
  std::map<OutCall*, bool> out_calls_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tandem::rpc::detail
