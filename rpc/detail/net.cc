#include "tandem/rpc/detail/net.h"

#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/support/channel_arguments.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tandem/rpc/tls.h"

namespace tandem::rpc::net {
namespace {

absl::StatusOr<std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Keepalive: a peer that stops answering (cut link, frozen host) is noticed within ~20 s even without a call deadline.
constexpr int kKeepaliveTimeMs = 10000;
constexpr int kKeepaliveTimeoutMs = 10000;

int clamp_size(int64_t bytes) { return bytes <= 0 || bytes > INT_MAX ? INT_MAX : static_cast<int>(bytes); }

}  // namespace

std::shared_ptr<grpc::Channel> make_channel(const std::string& address, const TlsOptions* tls,
                                            int64_t max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(clamp_size(max_message_bytes));
  args.SetMaxSendMessageSize(clamp_size(max_message_bytes));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Each peer gets its own connection (no sharing of subchannels between channels to the same address).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A dead peer is reported promptly instead of after gRPC's default reconnect backoff of up to 2 minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // gRPC also takes this as the least time a connection attempt (TCP and HTTP/2 handshakes) may take: at 100 ms a
  // busy or slowed-down peer (ThreadSanitizer, a loaded machine) failed its first connection with "tcp handshaker
  // shutdown" and the call UNAVAILABLE. A refused connection (a dead peer) still fails at once.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2000);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (tls) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = read_file(tls->root_certs_path).value_or("");
    o.pem_private_key = read_file(tls->private_key_path).value_or("");
    o.pem_cert_chain = read_file(tls->cert_chain_path).value_or("");
    creds = grpc::SslCredentials(o);
    if (!tls->target_name_override.empty()) args.SetSslTargetNameOverride(tls->target_name_override);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  return grpc::CreateCustomChannel(address, creds, args);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials(const TlsOptions* tls) {
  if (!tls) return grpc::InsecureServerCredentials();
  auto key = read_file(tls->private_key_path);
  if (!key.ok()) return key.status();
  auto cert = read_file(tls->cert_chain_path);
  if (!cert.ok()) return cert.status();
  auto roots = read_file(tls->root_certs_path);
  if (!roots.ok()) return roots.status();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = *roots;
  o.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(o);
}

void configure_server(grpc::ServerBuilder& builder, int64_t max_message_bytes) {
  builder.SetMaxReceiveMessageSize(clamp_size(max_message_bytes));
  builder.SetMaxSendMessageSize(clamp_size(max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveTimeMs / 2);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port taken by another process is an error, not shared
}

absl::Status from_grpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

grpc::Status to_grpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

bool is_loopback(const std::string& host) { return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0; }

std::string join_host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::string> local_address_towards(const std::string& host) {
  if (is_loopback(host)) return std::string("127.0.0.1");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve master address '", host, "'"));
  }
  std::string out;
  int fd = socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {  // UDP connect: routes, sends nothing
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char buf[INET6_ADDRSTRLEN] = {0};
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* addr = local.ss_family == AF_INET
                             ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                             : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, addr, buf, sizeof(buf))) out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  if (out.empty()) return absl::UnavailableError(absl::StrCat("no route to master address '", host, "'"));
  return out;
}

absl::StatusOr<int> pick_listen_port() {
  int ephemeral_low = 32768;  // the kernel's default when the file cannot be read
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> ephemeral_low;
  const int low = 10000, high = std::max(low + 1000, ephemeral_low - 1);
  static std::mt19937 rng(std::random_device{}());
  static std::mutex mu;  // guards rng
  for (int attempt = 0; attempt < 1000; ++attempt) {
    int port;
    {
      std::lock_guard<std::mutex> lock(mu);
      port = std::uniform_int_distribution<int>(low, high)(rng);
    }
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot pick a port: socket: ", std::strerror(errno)));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (free) return port;
  }
  return absl::UnavailableError(absl::StrCat("no free port in ", low, "..", high, " after 1000 tries"));
}

}  // namespace tandem::rpc::net
