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

namespace tandem::rpc::auth {

constexpr char kAuthMetadataKey[] = "x-tandem-auth";
constexpr char kWireVersionMetadataKey[] = "x-tandem-wire-version";  // rpc/detail/version.h

std::string derive_token(const std::string& secret);
// HMAC-SHA256(key, data), hex.
std::string hmac_hex(const std::string& key, const std::string& data);
// The direct channel's TCP handshake (proto/tandem_rpc.proto, DirectChallenge): what a side of `role` ("client" or
// "server") shows to prove it holds `token` without sending it; bound to both nonces and the client's rank.
std::string tcp_proof(const std::string& token, const std::string& role, const std::string& challenge,
                      const std::string& client_nonce, int rank);
// Constant-time equality of two non-empty strings.
bool equal(const std::string& a, const std::string& b);
// Adds the job token and this build's wire version to an outgoing call.
void add_credentials(grpc::ClientContext* ctx, const std::string& token);
// OK when the call's metadata carries `token` and this build's wire version; UNAUTHENTICATED for a missing or wrong
// token, FAILED_PRECONDITION (naming both versions) for another wire version.
absl::Status check(const grpc::CallbackServerContext* ctx, const std::string& token);
// 32 random bytes, hex: a secret for a single-node job.
std::string random_secret();

}  // namespace tandem::rpc::auth
