#include "tandem/rpc/detail/direct.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/cluster/cpus.h"
#include "tandem/log/log.h"
#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/buffer_pool.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/detail/version.h"
#include "tandem/rpc/detail/wait_slice.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::direct {
namespace {

constexpr uint32_t kMagic = 0x4d444e54;  // "TNDM"
constexpr uint64_t kWakeTag = 1;
constexpr uint64_t kListenTag = 2;
constexpr uint64_t kTcpListenTag = 3;
constexpr size_t kMaxHelloBytes = 512;      // a DirectHello is ~100 bytes (~170 over TCP); a stranger may not send more
constexpr size_t kMaxWelcomeBytes = 1024;   // a DirectWelcome with its refusal's message
constexpr size_t kMaxChallengeBytes = 256;  // a DirectChallenge is ~70 bytes
constexpr char kTcpPrefix[] = "tcp:";
constexpr uint64_t kProbeValue = 0x7461'6e64'656d'2121ULL;
constexpr int kSocketBuffer = 4 << 20;
// The most one sendmsg offers the kernel. A large message goes out in pieces of this size: the kernel copies a piece
// while the receiver drains the one before, where one call of many MiB copies until the send buffer is full and then
// waits for it to empty (64 MiB between two test hosts: 2.1 GB/s sent whole, 5.7 in 256 KiB pieces; tcp_pingpong
// --chunk). 256 and 512 KiB were the best sizes measured; 128 KiB and 1 MiB were slower.
constexpr size_t kMaxSendBytes = 256 << 10;
// A thread's CPU time so far (0 when it cannot be read).
absl::Duration cpu_time(clockid_t clock) {
  timespec ts{};
  return clock_gettime(clock, &ts) == 0 ? absl::DurationFromTimespec(ts) : absl::ZeroDuration();
}

const volatile uint64_t kProbe = kProbeValue;  // the server reads it from our memory to test cross-memory access

struct Header {
  uint32_t magic;
  uint32_t kind;
  uint64_t call_id;
  uint64_t length;
};
static_assert(sizeof(Header) == 24, "header layout");
// The header and the tensors of frames travel in host byte order; over TCP both hosts must agree, and every host Tandem
// targets (x86-64, AArch64) is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the direct channel's wire is little-endian");

absl::Status errno_status(const char* what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Waits until `fd` is ready for `events` or `deadline` passes (a blocking wait: a loop thread lends its place).
absl::Status wait_fd(int fd, short events, absl::Time deadline) {
  BlockingScope blocked;
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms < 0) return absl::DeadlineExceededError(kDeadlineExceeded);
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30)));
    if (n > 0) {
      if (p.revents & (POLLERR | POLLNVAL)) return absl::UnavailableError("direct channel: connection error");
      return absl::OkStatus();
    }
    if (n < 0 && errno != EINTR) return errno_status("poll");
  }
}

// Reads `len` bytes, waiting for them until `deadline`.
absl::Status read_exact(int fd, void* dst, size_t len, absl::Time deadline) {
  auto* p = static_cast<uint8_t*>(dst);
  while (len > 0) {
    const ssize_t n = ::read(fd, p, len);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (n == 0) {
      return absl::UnavailableError("connection closed by the peer");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (auto s = wait_fd(fd, POLLIN, deadline); !s.ok()) return s;
    } else if (errno != EINTR) {
      return errno_status("read");
    }
  }
  return absl::OkStatus();
}

void set_socket_options(int fd) {
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof(kSocketBuffer));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &kSocketBuffer, sizeof(kSocketBuffer));
}

void set_tcp_options(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // a small call leaves at once
  // No SO_SNDBUF/SO_RCVBUF: fixed sizes would switch off the kernel's autotuning (and be capped by rmem_max), which a
  // link with a long round trip needs for bandwidth.
}

// "host:port" or "[v6]:port" into its parts; false when it is neither.
bool split_host_port(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return !host->empty();
}

// Listens on `host` at an ephemeral port; `address` becomes "tcp:host:port".
absl::StatusOr<int> listen_tcp(const std::string& host, std::string* address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (const int e = getaddrinfo(host.c_str(), "0", &hints, &res); e != 0 || !res) {
    return absl::InvalidArgumentError(absl::StrCat("direct channel: cannot resolve '", host, "': ", gai_strerror(e)));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const bool ok = fd >= 0 && bind(fd, res->ai_addr, res->ai_addrlen) == 0 && listen(fd, 256) == 0;
  freeaddrinfo(res);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (!ok || getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    auto s = errno_status(absl::StrCat("direct channel: cannot listen on TCP at ", host).c_str());
    if (fd >= 0) ::close(fd);
    return s;
  }
  const int port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  *address = absl::StrCat(kTcpPrefix, net::join_host_port(host, port));
  return fd;
}

// A connected TCP socket to "host:port", or why not by `deadline`.
absl::StatusOr<int> connect_tcp(const std::string& host_port, absl::Time deadline) {
  std::string host, port;
  if (!split_host_port(host_port, &host, &port)) {
    return absl::InvalidArgumentError(absl::StrCat("direct channel: bad TCP address '", host_port, "'"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (const int e = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); e != 0 || !res) {
    return absl::UnavailableError(absl::StrCat("direct channel: cannot resolve '", host, "': ", gai_strerror(e)));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return errno_status("socket");
  }
  set_tcp_options(fd);
  const int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
  const int connect_errno = errno;
  freeaddrinfo(res);
  absl::Status s;
  if (rc != 0 && connect_errno != EINPROGRESS) {
    errno = connect_errno;
    s = errno_status("connect");
  } else if (rc != 0) {
    // Writable or failed: the socket's pending error, if any, says why (refused, unreachable).
    s = wait_fd(fd, POLLOUT, deadline);
    int err = 0;
    socklen_t len = sizeof(err);
    if (s.code() != absl::StatusCode::kDeadlineExceeded && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
        err != 0) {
      errno = err;
      s = errno_status("connect");
    }
  }
  if (!s.ok()) {
    ::close(fd);
    return absl::Status(s.code(), absl::StrCat("cannot connect to ", host_port, ": ", s.message()));
  }
  return fd;
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);  // sun_path[0] == 0: abstract namespace, nothing on disk
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return addr;
}

struct PooledSlice {
  void* buffer;
  size_t capacity;
};

grpc::ByteBuffer serialize(const google::protobuf::MessageLite& m) {
  grpc::Slice slice(m.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

bool parse_body(const grpc::ByteBuffer& body, google::protobuf::MessageLite* m) {
  grpc::Slice one;
  if (!body.Valid()) return m->ParseFromString("");
  if (!body.DumpToSingleSlice(&one).ok()) return false;
  return m->ParseFromArray(one.begin(), static_cast<int>(one.size()));
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Handshake

absl::StatusOr<tandem::wire::DirectWelcome> parse_welcome(const grpc::ByteBuffer& body) {
  tandem::wire::DirectWelcome welcome;
  if (!parse_body(body, &welcome)) return absl::UnavailableError("handshake: malformed welcome");
  if (welcome.has_refused()) {
    auto code = static_cast<absl::StatusCode>(welcome.refused().code());
    if (code == absl::StatusCode::kOk) code = absl::StatusCode::kUnknown;
    return absl::Status(code, absl::StrCat("the peer refused this worker: ", welcome.refused().message()));
  }
  if (welcome.wire_version() != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("direct channel: the server speaks Tandem wire version ",
                                                      welcome.wire_version(), ", this worker version ", kWireVersion));
  }
  return welcome;
}

bool is_tcp_address(const std::string& address) { return address.rfind(kTcpPrefix, 0) == 0; }

grpc::ByteBuffer encode_challenge(const std::string& nonce) {
  tandem::wire::DirectChallenge challenge;
  challenge.set_wire_version(kWireVersion);
  challenge.set_nonce(nonce);
  return serialize(challenge);
}

absl::StatusOr<std::string> parse_challenge(const grpc::ByteBuffer& body) {
  tandem::wire::DirectChallenge challenge;
  if (body.Length() > kMaxChallengeBytes || !parse_body(body, &challenge) || challenge.nonce().size() < 16) {
    return absl::InvalidArgumentError("direct channel: malformed challenge");
  }
  if (challenge.wire_version() != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("direct channel: the server speaks Tandem wire version ",
                                                      challenge.wire_version(), ", this worker version ",
                                                      kWireVersion));
  }
  return challenge.nonce();
}

grpc::ByteBuffer encode_hello(const std::string& token, int rank, const std::string& challenge,
                              const std::string& client_nonce, uint64_t probe_address, bool one_call_at_a_time) {
  tandem::wire::DirectHello hello;
  hello.set_wire_version(kWireVersion);
  hello.set_rank(rank);
  hello.set_pid(getpid());
  hello.set_probe_address(probe_address);
  hello.set_client_nonce(client_nonce);
  hello.set_proof(auth::tcp_proof(token, "client", challenge, client_nonce, rank));
  hello.set_one_call_at_a_time(one_call_at_a_time);
  return serialize(hello);
}

absl::StatusOr<tandem::wire::DirectHello> parse_hello(const grpc::ByteBuffer& body, const std::string& token,
                                                      const std::string& challenge) {
  tandem::wire::DirectHello hello;
  if (body.Length() > kMaxHelloBytes || !parse_body(body, &hello)) {
    return absl::InvalidArgumentError("direct channel: malformed hello");
  }
  if (hello.rank() < 0 || hello.pid() <= 0 || hello.client_nonce().size() < 16 || hello.client_nonce().size() > 128) {
    return absl::InvalidArgumentError("direct channel: malformed hello");
  }
  if (token.empty() || challenge.empty() ||
      !auth::equal(hello.proof(), auth::tcp_proof(token, "client", challenge, hello.client_nonce(), hello.rank()))) {
    return absl::UnauthenticatedError("direct channel: the client does not prove the job token");
  }
  if (hello.wire_version() != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("direct channel: the client speaks Tandem wire version ",
                                                      hello.wire_version(), ", this worker version ", kWireVersion));
  }
  return hello;
}

// ---------------------------------------------------------------------------------------------------------------------
// Conn

Conn::~Conn() {
  ::close(fd_);
  if (pre_ != nullptr) detail::release_buffer(pre_, pre_capacity_);
}

void Conn::shut() { ::shutdown(fd_, SHUT_RDWR); }

absl::Status Conn::write(Kind kind, uint64_t call_id, const grpc::ByteBuffer& body, absl::Time deadline) {
  // Sized for a frame's usual slices (header, a few tensors and their padding): one allocation up to 8 slices, where
  // Dump's growth and the two iovec vectors took up to six per message.
  std::vector<grpc::Slice> slices;
  slices.reserve(8);
  if (body.Valid() && !body.Dump(&slices).ok()) return absl::InternalError("direct channel: unreadable frame");
  Header h{kMagic, static_cast<uint32_t>(kind), call_id, 0};
  absl::InlinedVector<iovec, 9> iov;
  iov.reserve(slices.size() + 1);
  iov.push_back({&h, sizeof(h)});
  for (const auto& s : slices) {
    h.length += s.size();
    if (s.size() > 0) iov.push_back({const_cast<uint8_t*>(s.begin()), s.size()});
  }
  if (auto s = start_writing(deadline); !s.ok()) return s;
  absl::Cleanup done = [this] { end_writing(); };
  size_t first = 0;
  absl::InlinedVector<iovec, 9> window;  // the part of iov[first..] one sendmsg offers: at most kMaxSendBytes
  window.reserve(std::min<size_t>(iov.size(), static_cast<size_t>(IOV_MAX)));
  while (first < iov.size()) {
    window.clear();
    size_t offered = 0;
    for (size_t i = first; i < iov.size() && window.size() < static_cast<size_t>(IOV_MAX) && offered < kMaxSendBytes;
         ++i) {
      const size_t take = std::min(iov[i].iov_len, kMaxSendBytes - offered);
      window.push_back({iov[i].iov_base, take});
      offered += take;
    }
    msghdr mh{};
    mh.msg_iov = window.data();
    mh.msg_iovlen = window.size();
    const ssize_t n = ::sendmsg(fd_, &mh, MSG_NOSIGNAL);  // a closed peer is an error, never a SIGPIPE
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        broken = true;
        return errno_status("write");
      }
      if (auto s = wait_fd(fd_, POLLOUT, deadline); !s.ok()) {
        broken = true;  // a partial message may be on the wire: the connection cannot be used again
        return s;
      }
      continue;
    }
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

void Conn::write_half_and_shut(Kind kind, uint64_t call_id, const grpc::ByteBuffer& body) {
  std::vector<grpc::Slice> slices;
  if (body.Valid()) (void)body.Dump(&slices);
  std::string bytes;
  for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  Header h{kMagic, static_cast<uint32_t>(kind), call_id, bytes.size()};
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  out.append(bytes, 0, bytes.size() / 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(1);  // best effort: the connection is cut either way
  if (start_writing(deadline).ok()) {
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::send(fd_, out.data() + done, out.size() - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_fd(fd_, POLLOUT, deadline).ok()) {
        continue;
      } else {
        break;
      }
    }
    end_writing();
  }
  broken = true;
  shut();
}

absl::Status Conn::start_writing(absl::Time deadline) {
  MutexLock lock(&write_mu_);
  auto free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) { return !writing_; };
  if (!write_mu_.AwaitWithDeadline(Condition(&free), deadline)) {
    return absl::DeadlineExceededError(
        "direct channel: the connection was still sending another message at this call's deadline (the peer reads "
        "too slowly, or has stopped reading)");
  }
  writing_ = true;
  return absl::OkStatus();
}

void Conn::end_writing() {
  MutexLock lock(&write_mu_);
  writing_ = false;
}

absl::Status Conn::check_header(uint64_t max_body) const {
  Header h;
  std::memcpy(&h, header_, sizeof(h));
  if (h.magic != kMagic || h.kind < 1 || h.kind > 6) {
    return absl::InvalidArgumentError("direct channel: malformed message header");
  }
  if (h.length > max_body) {
    return absl::ResourceExhaustedError(
        absl::StrCat("direct channel: message of ", h.length, " bytes exceeds the limit of ", max_body));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Conn::poll_header(uint64_t max_body) {
  while (header_got_ < sizeof(header_)) {
    const size_t missing = sizeof(header_) - header_got_;
    ssize_t n = 0;
    if (one_call_at_a_time_) {
      // The body's first bytes in the same read: nothing else can follow the header before this message is answered.
      if (pre_ == nullptr) pre_ = detail::acquire_buffer(kPrefetchBytes, &pre_capacity_);
      iovec iov[2] = {{header_ + header_got_, missing}, {pre_, pre_capacity_}};
      n = ::readv(fd_, iov, 2);
    } else {
      n = ::read(fd_, header_ + header_got_, missing);
    }
    if (n > 0) {
      const size_t got = std::min(static_cast<size_t>(n), missing);
      header_got_ += got;
      pre_got_ = static_cast<size_t>(n) - got;  // bytes only once the header is whole
    } else if (n == 0) {
      return absl::UnavailableError("connection closed by the peer");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return false;
    } else if (errno != EINTR) {
      return errno_status("read");
    }
  }
  if (auto s = check_header(max_body); !s.ok()) return s;
  Header h;
  std::memcpy(&h, header_, sizeof(h));
  if (pre_got_ > h.length) {
    return absl::InvalidArgumentError(
        "direct channel: bytes of another message came with one on a one-call-at-a-time connection");
  }
  return true;
}

absl::StatusOr<Message> Conn::read_body(absl::Time deadline) {
  Header h;
  std::memcpy(&h, header_, sizeof(h));
  header_got_ = 0;
  Message m;
  m.kind = static_cast<Kind>(h.kind);
  m.call_id = h.call_id;
  if (h.length == 0) return m;
  auto* owner = new PooledSlice;
  const size_t early = pre_got_;  // of the body, read with the header (poll_header checked it is not more)
  pre_got_ = 0;
  if (pre_ != nullptr && h.length <= pre_capacity_) {
    owner->buffer = pre_;  // the body is where the header's read put its start
    owner->capacity = pre_capacity_;
    pre_ = nullptr;
  } else {
    owner->buffer = detail::acquire_buffer(h.length, &owner->capacity);
    if (early > 0) std::memcpy(owner->buffer, pre_, early);
  }
  grpc::Slice slice(
      owner->buffer, h.length,
      [](void* p) {
        auto* o = static_cast<PooledSlice*>(p);
        detail::release_buffer(o->buffer, o->capacity);
        delete o;
      },
      owner);
  if (auto s = read_exact(fd_, static_cast<uint8_t*>(owner->buffer) + early, h.length - early, deadline); !s.ok()) {
    return s;
  }
  m.body = grpc::ByteBuffer(&slice, 1);  // swapped in (FrameBuffer)
  return m;
}

absl::StatusOr<Message> Conn::read(uint64_t max_body, absl::Time deadline, std::chrono::microseconds spin,
                                   bool prompt_wake) {
  const auto spin_until = std::chrono::steady_clock::now() + spin;
  for (;;) {
    auto header = poll_header(max_body);
    if (!header.ok()) return header.status();
    if (*header) break;
    if (std::chrono::steady_clock::now() < spin_until) {
      sched_yield();  // the callee, when it shares this core, answers first
      continue;
    }
    if (prompt_wake) rpc::detail::prefer_prompt_wake();
    if (auto s = wait_fd(fd_, POLLIN, deadline); !s.ok()) return s;
  }
  return read_body(deadline);  // the caller's deadline bounds the whole message
}

// ---------------------------------------------------------------------------------------------------------------------
// Channel

absl::StatusOr<std::unique_ptr<Channel>> Channel::start(std::string token, int threads, uint64_t max_message_bytes,
                                                        absl::Duration message_timeout, Callbacks callbacks,
                                                        const std::string& tcp_host, int running,
                                                        absl::Duration stuck_after) {
  std::unique_ptr<Channel> t(new Channel);
  t->token_ = std::move(token);
  t->max_message_bytes_ = max_message_bytes;
  t->message_timeout_ = message_timeout;
  t->callbacks_ = std::move(callbacks);
  t->address_ = absl::StrCat("tandem-", getpid(), "-", auth::random_secret().substr(0, 16));

  t->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (t->listen_fd_ < 0) return errno_status("socket");
  socklen_t len = 0;
  sockaddr_un addr = abstract_address(t->address_, &len);
  if (bind(t->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(t->listen_fd_, 256) != 0) {
    return errno_status("direct channel: cannot listen");
  }
  if (!tcp_host.empty()) {
    auto tcp = listen_tcp(tcp_host, &t->tcp_address_);
    if (!tcp.ok()) return tcp.status();
    t->tcp_listen_fd_ = *tcp;
  }
  t->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  t->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (t->epoll_fd_ < 0 || t->wake_fd_ < 0) return errno_status("epoll");
  epoll_event wake{};
  wake.events = EPOLLIN;  // level-triggered: once written, every worker sees it
  wake.data.u64 = kWakeTag;
  // Unwatched, the listeners would take no connection and stop() would wake nobody: the channel does not start.
  if (epoll_ctl(t->epoll_fd_, EPOLL_CTL_ADD, t->wake_fd_, &wake) != 0) return errno_status("epoll_ctl (wake)");
  epoll_event listen_ev{};
  listen_ev.events = EPOLLIN | EPOLLONESHOT;
  listen_ev.data.u64 = kListenTag;
  if (epoll_ctl(t->epoll_fd_, EPOLL_CTL_ADD, t->listen_fd_, &listen_ev) != 0) return errno_status("epoll_ctl (listen)");
  if (t->tcp_listen_fd_ >= 0) {
    listen_ev.data.u64 = kTcpListenTag;
    if (epoll_ctl(t->epoll_fd_, EPOLL_CTL_ADD, t->tcp_listen_fd_, &listen_ev) != 0) {
      return errno_status("epoll_ctl (TCP listen)");
    }
  }

  t->places_ = std::max(1, std::min(std::max(1, threads), running > 0 ? running : cluster::usable_cpus()));
  t->stuck_after_ = stuck_after;
  t->threads_ = std::make_unique<detail::ThreadPool>(std::max(1, threads));
  for (int i = 0; i < std::max(1, threads); ++i) t->threads_->submit([raw = t.get()] { raw->loop(); });
  return t;
}

Channel::~Channel() {
  // Normally already stopped (with the shutdown's grace); here only running callbacks unwind, so a fixed second.
  stop(std::chrono::milliseconds(1000));
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (tcp_listen_fd_ >= 0) ::close(tcp_listen_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

absl::Status Channel::watch(const std::shared_ptr<Conn>& conn, bool add) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = conn.get();
  TANDEM_HAPPENS_BEFORE(conn.get());  // the next loop thread to get it sees what this one did (EPOLLONESHOT)
  if (epoll_ctl(epoll_fd_, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, conn->fd(), &ev) != 0) {
    return absl::UnavailableError(
        absl::StrCat("direct channel: cannot watch a connection (epoll_ctl): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

bool Channel::arm(const std::shared_ptr<Conn>& conn, bool add) {
  const absl::Status watched = watch(conn, add);
  if (watched.ok()) return true;
  // Not armed, the connection would never be read again: its calls would fail only at their deadlines, unexplained.
  TANDEM_LOG(kError, "rpc") << watched.message();
  drop(conn, watched);
  return false;
}

void Channel::drop(const std::shared_ptr<Conn>& conn, const absl::Status& why) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd(), nullptr);
  {
    MutexLock lock(&mu_);
    conns_.erase(conn.get());
  }
  conn->broken = true;
  conn->shut();
  if (!conn->inbound && callbacks_.on_lost) callbacks_.on_lost(conn, why);
  // An inbound connection's callers learn only that it closed: a cause other than the peer's own close or a broken
  // link (a header that lies, a message over this worker's limit, a body that stalled) is said here, naming the peer.
  if (conn->inbound && conn->peer_rank >= 0 && why.code() != absl::StatusCode::kUnavailable && !stopping_) {
    TANDEM_LOG(kWarn, "rpc") << "direct channel: closed the connection from rank " << conn->peer_rank
                             << " (its calls in flight fail with it): " << why.message();
  }
}

class Channel::Place final : public WaitObserver {
 public:
  explicit Place(Channel* channel) : channel_(channel) {
    if (pthread_getcpuclockid(pthread_self(), &cpu_clock) != 0) cpu_clock = CLOCK_THREAD_CPUTIME_ID;
    MutexLock lock(&channel_->places_mu_);
    channel_->all_places_.push_back(this);
  }
  ~Place() {
    MutexLock lock(&channel_->places_mu_);
    auto& all = channel_->all_places_;
    all.erase(std::find(all.begin(), all.end(), this));
  }
  void blocking() override { channel_->lend_place(this); }
  void unblocked() override { channel_->reclaim_place(this, /*message_done=*/false); }

  // The number of the message this thread runs (Channel::started_), 0 between messages. The watcher and this thread
  // read each other's writes of `running` and `presumed` in the opposite order (seq_cst): either the watcher sees the
  // message done, or the thread sees itself presumed blocked and takes its place back.
  std::atomic<uint64_t> running{0};
  std::atomic<bool> presumed{false};  // the watcher took it for blocked out of sight (and lent its place)
  bool lent = false;                  // guarded by places_mu_: the place is lent (blocked, or presumed blocked)
  clockid_t cpu_clock{};              // this thread's CPU time, readable from the watching thread

 private:
  Channel* const channel_;
};

void Channel::loop() {
  if (!take_place()) return;
  Place place(this);
  bool served = false;             // a message, not a new connection: the thread may poll for the next (set_serve_spin)
  std::shared_ptr<Conn> answered;  // handle_ready left it to this thread: it polls it for the next request or arms it
  for (;;) {
    std::shared_ptr<Conn> ready;  // `answered`, when its next request came while this thread polled it
    if (answered) {
      if (served && poll_answered(*answered)) {
        ready = std::move(answered);
      } else {
        arm(answered, /*add=*/false);
        served = false;  // polled already (or another thread polls): the thread sleeps in epoll at once
      }
      answered.reset();
    }
    epoll_event ev{};
    if (!ready) {
      in_epoll_.fetch_add(1);  // a polling thread counts as one in epoll: it takes whatever event comes
      const int n = wait_event(&ev, served);
      const int error = errno;  // before wake_watcher(), whose lock may set errno
      // The last thread to leave epoll wakes a resting watcher: every place may now run a message that gets stuck.
      if (in_epoll_.fetch_sub(1) == 1 && watcher_resting_.load()) wake_watcher();
      if (n < 0 && error == EINTR) continue;
      if (n < 0 && !stopping_) {  // EBADF, EINVAL: the set is gone; the thread cannot serve any more
        TANDEM_LOG(kError, "rpc") << "direct channel: a loop thread stops (epoll_wait: " << std::strerror(error) << ")";
      }
      if (n <= 0 || stopping_ || ev.data.u64 == kWakeTag) return;
    }
    const bool message = ready || (ev.data.u64 != kListenTag && ev.data.u64 != kTcpListenTag);
    const auto began = std::chrono::steady_clock::now();
    place.running.store(started_.fetch_add(1) + 1);
    WaitObserver* before = set_wait_observer(&place);
    answered = ready ? handle_ready(ready) : serve(ev);
    set_wait_observer(before);
    // A message that took far longer than the poll (a forward pass) leaves the thread to sleep at once: its caller is
    // not one whose next call follows at once, and the poll would only take CPU from the work beside it.
    served = message &&
             std::chrono::steady_clock::now() - began <
                 kSpinAfterServingAtMost * std::chrono::microseconds(serve_spin_us_.load(std::memory_order_relaxed));
    place.running.store(0);
    finished_.fetch_add(1, std::memory_order_relaxed);
    if (place.presumed.load()) reclaim_place(&place, /*message_done=*/true);
    if (over_.load(std::memory_order_relaxed)) {
      if (answered) arm(answered, /*add=*/false);  // before the thread may park
      answered.reset();
      if (!step_aside()) return;
    }
  }
}

bool Channel::poll_answered(Conn& conn) {
  if (!start_spin()) return false;
  answered_polls_.fetch_add(1, std::memory_order_relaxed);
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(serve_spin_us_.load(std::memory_order_relaxed));
  bool came = false;
  for (;;) {
    // A header that lies or an EOF counts as come: handle_ready reads the same again and drops the connection.
    auto header = conn.poll_header(max_message_bytes_);
    came = !header.ok() || *header;
    if (came || stopping_ || std::chrono::steady_clock::now() >= until) break;
    sched_yield();  // as in wait_event
  }
  end_spin(came);
  return came;
}

bool Channel::start_spin() {
  const int64_t spin_us = serve_spin_us_.load(std::memory_order_relaxed);
  if (spin_us <= 0 ||
      (spin_misses_.load(std::memory_order_relaxed) >= kSpinMissesBeforeBackoff &&
       spin_probes_.fetch_add(1, std::memory_order_relaxed) % kSpinProbeEvery != 0) ||
      spinning_.exchange(true, std::memory_order_acquire)) {
    return false;
  }
  serve_spins_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Channel::end_spin(bool hit) {
  spinning_.store(false, std::memory_order_release);
  if (hit) {
    serve_spin_hits_.fetch_add(1, std::memory_order_relaxed);
    spin_misses_.store(0, std::memory_order_relaxed);
  } else if (spin_misses_.load(std::memory_order_relaxed) < kSpinMissesBeforeBackoff) {
    spin_misses_.fetch_add(1, std::memory_order_relaxed);
  }
}

int Channel::wait_event(epoll_event* ev, bool served) {
  if (served && start_spin()) {
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::microseconds(serve_spin_us_.load(std::memory_order_relaxed));
    int n = 0;
    for (;;) {
      n = epoll_wait(epoll_fd_, ev, 1, 0);
      if (n != 0 || std::chrono::steady_clock::now() >= until) break;
      sched_yield();  // a thread of this core's that the poll keeps from running (the caller, on one core) goes first
    }
    const int error = errno;
    end_spin(n > 0);
    if (n > 0) return n;
    errno = error;
    if (n < 0) return n;
  }
  return epoll_wait(epoll_fd_, ev, 1, -1);
}

std::shared_ptr<Conn> Channel::serve(const epoll_event& ev) {
  if (ev.data.u64 == kListenTag || ev.data.u64 == kTcpListenTag) {
    accept_one(ev.data.u64 == kListenTag ? listen_fd_ : tcp_listen_fd_, ev.data.u64);
    return nullptr;
  }
  std::shared_ptr<Conn> conn;
  {
    MutexLock lock(&mu_);
    auto it = conns_.find(static_cast<Conn*>(ev.data.ptr));
    if (it == conns_.end()) return nullptr;
    conn = it->second;
  }
  TANDEM_HAPPENS_AFTER(conn.get());
  return handle_ready(conn);
}

bool Channel::take_place() {
  MutexLock lock(&places_mu_);
  return park();
}

bool Channel::step_aside() {
  MutexLock lock(&places_mu_);
  if (held_ <= places_) return true;
  add_held(-1);
  return park();
}

bool Channel::park() {
  for (;;) {
    if (stopping_) return false;
    if (held_ < places_) {
      add_held(1);
      // A place still free goes to a parked thread (a signal of lend_place may have found this one woken already,
      // and been lost), else to the watcher; and a watcher that takes a place leaves none while others stay parked:
      // one of them watches in its stead.
      if (parked_ > 0 && (held_ < places_ || !watching_)) {
        parked_cv_.Signal();
      } else if (held_ < places_ && watching_) {
        watch_cv_.Signal();
      }
      return true;
    }
    if (watching_) {
      ++parked_;
      parked_cv_.Wait(&places_mu_);
      --parked_;
      continue;
    }
    // This thread watches the places while it waits for one. It rests once a place waited in epoll (where no message
    // can be stuck: that thread would take it) at kQuietLooks looks in a row, until the last thread leaves epoll.
    watching_ = true;
    const uint64_t finished = finished_.load(std::memory_order_relaxed);
    bool rest = false;
    if (quiet_looks_ >= kQuietLooks) {
      watcher_resting_.store(true);
      rest = in_epoll_.load() > 0;
      if (!rest) watcher_resting_.store(false);
    }
    const bool timed_out = watch_cv_.WaitWithTimeout(&places_mu_, rest ? absl::InfiniteDuration() : stuck_after_);
    watcher_resting_.store(false);
    watching_ = false;
    ++counts_.looks;
    // Woken from rest (the last thread left epoll), it watches kQuietLooks more looks before it rests again: a worker
    // whose places all run now and then is woken no more than about once per stuck_after_.
    quiet_looks_ = rest || in_epoll_.load() == 0 ? 0 : quiet_looks_ + 1;
    // A place presumed blocked is free: this thread takes it on its next turn.
    if (timed_out && !stopping_ && held_ >= places_ && stuck(finished)) presume_blocked();
  }
}

void Channel::wake_watcher() {
  if (!watcher_resting_.exchange(false)) return;
  MutexLock lock(&places_mu_);
  watch_cv_.Signal();
}

void Channel::add_held(int delta) {
  held_ += delta;
  over_.store(held_ > places_, std::memory_order_relaxed);
}

bool Channel::stuck(uint64_t finished) const {
  if (in_epoll_.load(std::memory_order_relaxed) > 0 || finished_.load(std::memory_order_relaxed) != finished) {
    return false;
  }
  pollfd p{epoll_fd_, POLLIN, 0};
  return poll(&p, 1, 0) > 0;  // an epoll fd is readable while an event waits in its set
}

void Channel::presume_blocked() {
  Place* oldest = nullptr;
  uint64_t message = 0;
  for (Place* p : all_places_) {
    const uint64_t running = p->running.load(std::memory_order_relaxed);
    if (!p->lent && running != 0 && (oldest == nullptr || running < message)) oldest = p, message = running;
  }
  if (oldest == nullptr) return;
  // A message that computes is not blocked: it is presumed so only when its thread used at most half the CPU over a
  // whole stuck_after_ (seen twice), or after kComputeLimit, in case it spins waiting for another message.
  const absl::Time now = absl::Now();
  const absl::Duration cpu = cpu_time(oldest->cpu_clock);
  if (suspect_.place != oldest || suspect_.message != message) {
    suspect_ = {oldest, message, cpu, now, now};
    return;
  }
  if (cpu - suspect_.cpu > (now - suspect_.seen) / 2 && now - suspect_.since < kComputeLimit) {
    suspect_.cpu = cpu;
    suspect_.seen = now;
    return;
  }
  suspect_ = {};
  oldest->presumed.store(true);
  if (oldest->running.load() != message) {  // done meanwhile: it keeps its place
    oldest->presumed.store(false);
    return;
  }
  oldest->lent = true;
  add_held(-1);
  ++counts_.presumed_blocked;
}

void Channel::lend_place(Place* place) {
  MutexLock lock(&places_mu_);
  if (place->lent) return;  // presumed blocked already
  place->lent = true;
  add_held(-1);
  ++counts_.lent;
  if (held_ >= places_) return;
  if (parked_ > 0) {
    parked_cv_.Signal();
  } else if (watching_) {
    watch_cv_.Signal();
  }
}

void Channel::reclaim_place(Place* place, bool message_done) {
  MutexLock lock(&places_mu_);
  // A thread presumed blocked runs on without a place until its message is done.
  if (!place->lent || (place->presumed.load() && !message_done)) return;
  place->lent = false;
  place->presumed.store(false);
  add_held(1);  // at once, even beyond the limit: the thread steps aside when its message is done
}

Channel::PlaceCounts Channel::place_counts() {
  PlaceCounts counts;
  {
    MutexLock lock(&places_mu_);
    counts = counts_;
  }
  counts.serve_spins = serve_spins_.load(std::memory_order_relaxed);
  counts.serve_spin_hits = serve_spin_hits_.load(std::memory_order_relaxed);
  counts.answered_polls = answered_polls_.load(std::memory_order_relaxed);
  return counts;
}

void Channel::accept_one(int listen_fd, uint64_t tag) {
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
    // Out of descriptors or memory: the connection stays pending, so the listener re-armed at once would be ready
    // again and the loop threads would spin on it. Said at most once a second; retried after 10 ms.
    const int e = errno;
    static std::atomic<int64_t> said_at{0};
    const int64_t now = absl::ToUnixSeconds(absl::Now());
    if (said_at.exchange(now) != now) {
      TANDEM_LOG(kError, "rpc") << "direct channel: cannot accept a connection: " << std::strerror(e)
                                << " (retrying every 10 ms)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  epoll_event listen_ev{};
  listen_ev.events = EPOLLIN | EPOLLONESHOT;
  listen_ev.data.u64 = tag;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd, &listen_ev) != 0 && !stopping_) {
    // Not re-armed, the listener takes no connection again: peers that connect later fall back to gRPC, or fail.
    TANDEM_LOG(kError, "rpc") << "direct channel: cannot watch the listener again (epoll_ctl): " << std::strerror(errno)
                              << "; no further connection is accepted on it";
  }
  if (fd < 0) return;
  auto conn = std::make_shared<Conn>(fd);
  conn->inbound = true;
  conn->tcp = tag == kTcpListenTag;
  if (conn->tcp) {
    set_tcp_options(fd);
  } else {
    set_socket_options(fd);
  }
  // The server speaks first: a fresh nonce the client's proof must cover (on a Unix socket too: whoever holds its
  // name, after a worker died, say, must not learn the token from a hello). A new socket's send buffer is empty, so
  // this write does not wait; a client that never reads it only loses its own connection.
  conn->challenge = auth::random_secret();
  if (!conn->write(Kind::kChallenge, 0, encode_challenge(conn->challenge), absl::Now() + absl::Seconds(1)).ok()) {
    return;
  }
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    conns_[conn.get()] = conn;
  }
  arm(conn, /*add=*/true);
}

std::shared_ptr<Conn> Channel::handle_ready(const std::shared_ptr<Conn>& conn) {
  const bool authenticated = !conn->inbound || conn->peer_rank >= 0;
  // The header is read without waiting: a client that sends half of one holds no thread. The body of an
  // authenticated peer's message follows within message_timeout_; a stranger's hello gets one second.
  auto header = conn->poll_header(authenticated ? max_message_bytes_ : kMaxHelloBytes);
  if (!header.ok()) {
    drop(conn, header.status());
    return nullptr;
  }
  if (!*header) {
    arm(conn, /*add=*/false);
    return nullptr;
  }
  auto msg = conn->read_body(absl::Now() + (authenticated ? message_timeout_ : absl::Seconds(1)));
  if (!msg.ok()) {
    drop(conn, msg.status());
    return nullptr;
  }
  if (!authenticated) {
    // The first message of an inbound connection must be a valid hello; anything else closes it.
    auto hello = msg->kind != Kind::kHello ? absl::InvalidArgumentError("the first message is not a hello")
                                           : parse_hello(msg->body, token_, conn->challenge);
    tandem::wire::DirectWelcome welcome;
    welcome.set_wire_version(kWireVersion);
    if (!hello.ok()) {
      // Said explicitly, so the client can tell a refusal from a peer that died mid-handshake.
      welcome.mutable_refused()->set_code(static_cast<int>(hello.status().code()));
      welcome.mutable_refused()->set_message(std::string(hello.status().message()));
      // A stranger gets a second, as for its hello: it must not hold an epoll thread.
      (void)conn->write(Kind::kWelcome, 0, serialize(welcome), absl::Now() + absl::Seconds(1));
      drop(conn, hello.status());
      return nullptr;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    welcome.set_proof(auth::tcp_proof(token_, "server", conn->challenge, hello->client_nonce(), hello->rank()));
    if (!conn->tcp && getsockopt(conn->fd(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid == hello->pid()) {
      uint64_t seen = 0;
      iovec local{&seen, sizeof(seen)};
      iovec far{reinterpret_cast<void*>(hello->probe_address()), sizeof(seen)};
      if (process_vm_readv(cred.pid, &local, 1, &far, 1, 0) == sizeof(seen) && seen == kProbeValue) {
        conn->cma_pid = cred.pid;  // the kernel's word for who is at the other end, not the peer's
        welcome.set_cma_ok(true);
      }
    }
    conn->peer_rank = std::max(0, hello->rank());
    if (hello->one_call_at_a_time()) conn->set_one_call_at_a_time();
    if (!conn->write(Kind::kWelcome, 0, serialize(welcome), absl::Now() + message_timeout_).ok()) {
      drop(conn, absl::UnavailableError("welcome failed"));
      return nullptr;
    }
    arm(conn, /*add=*/false);
    return nullptr;
  }
  // Another worker may read the next message while this one runs. A connection that cannot be watched any more is
  // dropped with the cause (its other calls fail with it): a request read from it is not run (its caller learns that
  // the connection failed), a response or a one-way message is delivered first (its call ran; a one-way message's
  // sender was told it was sent). A one-call-at-a-time connection's request is answered first: nothing can come on it
  // before (the caller of loop() watches it, or polls it for the next request).
  if (conn->inbound && conn->one_call_at_a_time() && msg->kind == Kind::kRequest) {
    callbacks_.on_request(conn, std::move(*msg));
    return conn;
  }
  const absl::Status watched = watch(conn, /*add=*/false);
  if (!watched.ok()) {
    TANDEM_LOG(kError, "rpc") << watched.message();
    if (msg->kind == Kind::kRequest) {
      drop(conn, watched);
      return nullptr;
    }
  }
  bool delivered = false;
  switch (msg->kind) {
    case Kind::kRequest:
    case Kind::kOneway:
      if (conn->inbound) {
        callbacks_.on_request(conn, std::move(*msg));
        delivered = true;
      }
      break;
    case Kind::kResponse:
      if (!conn->inbound) {
        callbacks_.on_response(conn, std::move(*msg));
        delivered = true;
      }
      break;
    default:
      break;
  }
  if (!watched.ok()) {
    drop(conn, watched);
  } else if (!delivered) {
    drop(conn, absl::InvalidArgumentError("direct channel: unexpected message kind"));
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<Conn>> Channel::connect(const std::string& address, int my_rank, bool for_responses,
                                                       absl::Time deadline) {
  if (stopping_) return absl::CancelledError("direct channel stopped");
  const bool tcp = is_tcp_address(address);
  std::shared_ptr<Conn> conn;
  if (tcp) {
    auto connected = connect_tcp(address.substr(sizeof(kTcpPrefix) - 1), deadline);
    if (!connected.ok()) return connected.status();
    conn = std::make_shared<Conn>(*connected);
  } else {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return errno_status("socket");
    conn = std::make_shared<Conn>(fd);
    set_socket_options(fd);
    socklen_t len = 0;
    sockaddr_un addr = abstract_address(address, &len);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      if (errno != EAGAIN && errno != EINPROGRESS) return errno_status("connect");
      if (auto s = wait_fd(fd, POLLOUT, deadline); !s.ok()) return s;
    }
  }
  // rpc_sync's connection: each request waits for its response (and the handshake's messages for theirs).
  if (!for_responses) conn->set_one_call_at_a_time();
  // The server's challenge first; the hello proves the token without sending it, and so must the server's welcome.
  auto first = conn->read(kMaxChallengeBytes, deadline);
  if (!first.ok()) {
    return absl::UnavailableError(absl::StrCat("handshake with ", address, ": ", first.status().message()));
  }
  if (first->kind != Kind::kChallenge) return absl::UnavailableError("handshake: the server sent no challenge");
  auto nonce = parse_challenge(first->body);
  if (!nonce.ok()) return nonce.status();
  const std::string challenge = *nonce, client_nonce = auth::random_secret();
  const grpc::ByteBuffer hello =
      encode_hello(token_, my_rank, challenge, client_nonce, tcp ? 0 : reinterpret_cast<uintptr_t>(&kProbe),
                   /*one_call_at_a_time=*/!for_responses);
  if (auto s = conn->write(Kind::kHello, 0, hello, deadline); !s.ok()) return s;
  auto reply = conn->read(kMaxWelcomeBytes, deadline);
  if (!reply.ok()) return absl::UnavailableError(absl::StrCat("handshake: ", reply.status().message()));
  if (reply->kind != Kind::kWelcome) return absl::UnavailableError("handshake: the server did not answer the hello");
  auto welcome = parse_welcome(reply->body);
  if (!welcome.ok()) return welcome.status();
  if (!auth::equal(welcome->proof(), auth::tcp_proof(token_, "server", challenge, client_nonce, my_rank))) {
    return absl::UnauthenticatedError(
        absl::StrCat("direct channel: the server at ", address, " does not prove the job token"));
  }
  conn->cma_ok = welcome->cma_ok() && !tcp;
  if (for_responses) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return absl::CancelledError("direct channel stopped");
      conns_[conn.get()] = conn;
    }
    // Not watched, its responses would never be read: the caller falls back as for any failed connection.
    if (!arm(conn, /*add=*/true)) {
      return absl::UnavailableError(absl::StrCat("direct channel: cannot watch the connection to ", address));
    }
  }
  return conn;
}

bool Channel::stop(std::chrono::milliseconds grace) {
  if (stopping_.exchange(true)) return threads_ ? threads_->stop(grace) : true;
  {
    MutexLock lock(&places_mu_);  // parked threads see stopping_ and return
    parked_cv_.SignalAll();
    watch_cv_.SignalAll();
  }
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof(one));
  // No new connections; the descriptor itself stays open until the destructor, after the loop threads: closed here,
  // its number could be reused under a thread still in accept_one() (ThreadSanitizer saw that race).
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (tcp_listen_fd_ >= 0) ::shutdown(tcp_listen_fd_, SHUT_RDWR);
  std::map<Conn*, std::shared_ptr<Conn>> conns;
  {
    MutexLock lock(&mu_);
    conns.swap(conns_);
  }
  for (auto& [raw, conn] : conns) {
    conn->broken = true;
    conn->shut();
    if (!conn->inbound && callbacks_.on_lost) callbacks_.on_lost(conn, absl::CancelledError("RPC stopped"));
  }
  return threads_ ? threads_->stop(grace) : true;
}

}  // namespace tandem::rpc::direct
