#include "tandem/rpc/detail/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "absl/strings/str_cat.h"
#include "tandem/rpc/detail/version.h"
#include "tandem/rpc/errors.h"

namespace tandem::rpc::auth {
namespace {

std::string hex(const unsigned char* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[data[i] >> 4];
    out[2 * i + 1] = digits[data[i] & 15];
  }
  return out;
}

}  // namespace

std::string hmac_hex(const std::string& key, const std::string& data) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
            data.size(), mac, &len)) {
    throw_error(absl::InternalError("HMAC-SHA256 failed"));  // OpenSSL itself is broken: nothing the caller can fix
  }
  return hex(mac, len);
}

std::string derive_token(const std::string& secret) { return hmac_hex(secret, "tandem-auth-v1"); }

std::string derive_client_token(const std::string& secret) { return hmac_hex(secret, "tandem-client-v1"); }

std::string tcp_proof(const std::string& token, const std::string& role, const std::string& challenge,
                      const std::string& client_nonce, int rank) {
  return hmac_hex(token, absl::StrCat("tandem-tcp-v1|", role, "|", challenge, "|", client_nonce, "|", rank));
}

bool equal(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && !a.empty() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void add_credentials(grpc::ClientContext* ctx, const std::string& token) {
  ctx->AddMetadata(kAuthMetadataKey, token);
  ctx->AddMetadata(kWireVersionMetadataKey, std::to_string(kWireVersion));
}

absl::Status check(const grpc::CallbackServerContext* ctx, const std::string& token) {
  return check_caller(ctx, token, "").status();
}

absl::StatusOr<Caller> check_caller(const grpc::CallbackServerContext* ctx, const std::string& token,
                                    const std::string& client_token) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(kAuthMetadataKey);
  if (it == md.end()) return absl::UnauthenticatedError("no job token: the caller is not part of this job");
  const absl::string_view got(it->second.data(), it->second.size());  // gRPC's bytes, not copied
  Caller caller = Caller::kWorker;
  if (!equal(got, token)) {
    if (client_token.empty() || !equal(got, client_token)) {
      return absl::UnauthenticatedError("wrong job token: the caller does not share this job's secret");
    }
    caller = Caller::kClient;
  }
  auto version = md.find(kWireVersionMetadataKey);
  const std::string theirs = version == md.end() ? "" : std::string(version->second.data(), version->second.size());
  if (theirs != std::to_string(kWireVersion)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the caller speaks Tandem wire version ", theirs.empty() ? "1 (a build from before wire versioning)" : theirs,
        ", this worker version ", kWireVersion, ": every worker of a job must run the same Tandem release"));
  }
  return caller;
}

std::string random_secret() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) throw_error(absl::InternalError("no randomness for a job secret"));
  return hex(bytes, sizeof(bytes));
}

}  // namespace tandem::rpc::auth
