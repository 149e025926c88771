// Job authentication. The workers of one job share a secret; every call carries a token derived from it
// (HMAC-SHA256(secret, "tandem-auth-v1"), hex) in the metadata key kAuthMetadataKey, and every handler checks it in
// constant time before reading the request. The secret itself never crosses the network.
//
// Without TLS the token is visible to anyone who can sniff the job's traffic (and could be replayed by them); enable
// TLS (RpcOptions::tls) on networks you do not trust.
#pragma once

#include <grpcpp/client_context.h>
#include <grpcpp/server_context.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::rpc::auth {

constexpr char kAuthMetadataKey[] = "x-tandem-auth";
constexpr char kWireVersionMetadataKey[] = "x-tandem-wire-version";  // rpc/detail/version.h

std::string derive_token(const std::string& secret);
// The token of a client outside the job (clients/python): HMAC-SHA256(secret, "tandem-client-v1"), hex. A worker
// accepts it in place of the job token for calls as caller rank -1 and for reading the job's store; a process given
// only this token cannot derive the job token from it (HMAC is one-way), so it cannot act as a worker.
std::string derive_client_token(const std::string& secret);
// HMAC-SHA256(key, data), hex.
std::string hmac_hex(const std::string& key, const std::string& data);
// The direct channel's TCP handshake (proto/tandem_rpc.proto, DirectChallenge): what a side of `role` ("client" or
// "server") shows to prove it holds `token` without sending it; bound to both nonces and the client's rank.
std::string tcp_proof(const std::string& token, const std::string& role, const std::string& challenge,
                      const std::string& client_nonce, int rank);
// Constant-time equality of two non-empty strings.
bool equal(absl::string_view a, absl::string_view b);
// Adds the job token and this build's wire version to an outgoing call.
void add_credentials(grpc::ClientContext* ctx, const std::string& token);
// OK when the call's metadata carries `token` and this build's wire version; UNAUTHENTICATED for a missing or wrong
// token, FAILED_PRECONDITION (naming both versions) for another wire version.
absl::Status check(const grpc::CallbackServerContext* ctx, const std::string& token);
// Who a call authenticated as: the job token, or (when `client_token` is not empty) a client's token.
enum class Caller { kWorker, kClient };
absl::StatusOr<Caller> check_caller(const grpc::CallbackServerContext* ctx, const std::string& token,
                                    const std::string& client_token);
// 32 random bytes, hex: a secret for a single-node job.
std::string random_secret();

}  // namespace tandem::rpc::auth
