// Small helpers around gRPC channels, servers and addresses shared by the agent and the store.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::rpc {
struct TlsOptions;
}

namespace tandem::rpc::net {

// Channel and server settings common to every connection of a job: message size limit, keepalive (so a silent peer is
// noticed), TLS when configured.
std::shared_ptr<grpc::Channel> make_channel(const std::string& address, const TlsOptions* tls,
                                            int64_t max_message_bytes);
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsOptions* tls);
void configure_server(grpc::ServerBuilder& builder, int64_t max_message_bytes);

absl::Status from_grpc(const grpc::Status& s);
grpc::Status to_grpc(const absl::Status& s);

// The local IP address the kernel would use to reach `host` (no packet is sent); "127.0.0.1" for loopback hosts.
absl::StatusOr<std::string> local_address_towards(const std::string& host);
bool is_loopback(const std::string& host);
// "host:port", bracketing IPv6 literals.
std::string join_host_port(const std::string& host, int port);

// A TCP port for a listener that other processes are told about before it listens (a job's master port). Chosen at
// random below the kernel's ephemeral range (ip_local_port_range), so no socket another process binds to port 0 or
// connects from can take it in between; and checked by binding the wildcard address, so no socket on any local
// address (a listener, a connection in TIME_WAIT) holds it. UNAVAILABLE when no port is found after 1,000 tries.
absl::StatusOr<int> pick_listen_port();

}  // namespace tandem::rpc::net
