// The fixture of the RPC multi-process tests: the test process is rank 0, ranks 1.. are children of this binary.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/rpc/rpc.h"
#include "tandem/sync/sync.h"
#include "tests/common/multiproc.h"
#include "tests/common/test_env.h"

namespace tandem::test {

namespace pb = tandem::wire;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

class MultiprocRpc : public ::testing::Test {
 protected:
  // Starts the children of `spec` and joins as rank 0 with `options` (defaults from the same environment they get).
  void start(JobSpec spec, rpc::RpcOptions options = options_from_env()) {
    rpc::init_rpc("worker0", 0, spec.world_size, launch(spec, std::move(options)));
    if (test_hosts().count > 0) expect_across_hosts(spec.world_size);
  }

  // On test hosts, rank r serves at host (r % count)'s address and every peer is reached over the route the
  // environment asks for: gRPC when TANDEM_TRANSPORT is "grpc" or TLS is on, else the direct channel's TCP route. With
  // TLS from the environment (TANDEM_TLS_*), a plain-text client is refused.
  void expect_across_hosts(int world) {
    const char* transport = std::getenv("TANDEM_TRANSPORT");
    const char* tls_cert = std::getenv("TANDEM_TLS_CERT");
    const bool grpc = (transport && std::string(transport) == "grpc") || (tls_cert && *tls_cert);
    const std::string prefix = job_master_addr().substr(0, job_master_addr().rfind('.') + 1);
    for (int r = 0; r < world; ++r) {
      const std::string want = prefix + std::to_string(r % test_hosts().count + 1) + ":";
      EXPECT_EQ(rpc::get_worker_info(r).address.rfind(want, 0), 0u) << rpc::get_worker_info(r).address;
      const bool same_host = r % test_hosts().count == 0;
      if (r != 0) EXPECT_EQ(rpc::transport_to(r), grpc ? "grpc" : same_host ? "direct" : "tcp") << "rank " << r;
    }
    if (const char* tls = std::getenv("TANDEM_TLS_CERT"); tls && *tls && world > 1) {
      pb::Request request;
      request.set_function("whoami");
      grpc::ByteBuffer response;
      EXPECT_FALSE(raw_call(1, make_frame(request, ""), &response, rpc::auth::derive_token(job_->secret())).ok())
          << "TANDEM_TLS_* is set but a plain-text call went through";
    }
  }

  // Starts the children of `spec`; returns `options` pointed at the job (master, secret) for rank 0.
  rpc::RpcOptions launch(const JobSpec& spec, rpc::RpcOptions options) {
    job_ = std::make_unique<Job>(spec);
    options.master_addr = job_master_addr();
    options.master_port = job_->port();
    options.secret = job_->secret();
    return options;
  }

  void TearDown() override {
    if (rpc::is_initialized()) {
      try {
        rpc::shutdown(true);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "shutdown: " << e.what();
      }
    }
    if (job_ && expect_clean_children_) {
      for (int code : job_->wait_children(milliseconds(30000))) EXPECT_EQ(code, 0) << job_->outputs();
    }
  }

  // A raw client to rank `rank`'s server, to send what a well-behaved worker never would.
  grpc::Status raw_call(int rank, const grpc::ByteBuffer& request, grpc::ByteBuffer* response,
                        const std::string& token) {
    auto channel = rpc::net::make_channel(rpc::get_worker_info(rank).address, nullptr, -1);
    grpc::GenericStub stub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + milliseconds(10000));
    if (!token.empty()) rpc::auth::add_credentials(&ctx, token);
    grpc::Status result;
    Notification done;
    stub.UnaryCall(&ctx, "/tandem.wire.Worker/Call", grpc::StubOptions(), &request, response, [&](grpc::Status s) {
      result = s;
      done.Notify();
    });
    done.WaitForNotification();  // bounded by the context deadline
    return result;
  }

  // The error a raw request got back: the gRPC status when not OK, else the Response's error (OK when none).
  absl::Status raw_error(int rank, const grpc::ByteBuffer& request) {
    grpc::ByteBuffer response;
    grpc::Status s = raw_call(rank, request, &response, rpc::auth::derive_token(job_->secret()));
    if (!s.ok()) return rpc::net::from_grpc(s);
    pb::Response r;
    auto frame = rpc::wire::Frame::parse(response, &r);
    if (!frame.ok()) return frame.status();
    if (!r.has_error()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(r.error().code()), r.error().message());
  }

  std::unique_ptr<Job> job_;
  bool expect_clean_children_ = true;
};

}  // namespace tandem::test
