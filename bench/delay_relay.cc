// delay_relay: a transparent TCP proxy that holds every byte for a fixed time before passing it on, so that
// `bench/run.sh hosts` can measure Tandem and PyTorch over a link with latency (this kernel has no netem qdisc).
//
//   delay_relay [--port P] [--delay-us N] [--bind ADDR] [--verbose]
//
// It runs in a test host's network namespace (scripts/hosts.sh), where an nftables rule redirects the host's outgoing
// TCP connections to the other host onto the relay:
//
//   table ip tandem_delay { chain out { type nat hook output priority -100; policy accept;
//                                       meta mark != 0x77 ip daddr PEER ip protocol tcp redirect to :P; } }
//
// For each connection it accepts, it reads the destination the program asked for (SO_ORIGINAL_DST, from conntrack),
// connects there itself with SO_MARK 0x77 (so the rule lets the relay's own connection through), and forwards bytes
// both ways, each chunk released --delay-us after it was read, in order. A connection crosses the relay of the host
// that opened it only: its round trip grows by twice the delay. A half-close (FIN) travels like data, after the same
// delay; an error on either socket resets both sockets of that connection and no other.
//
// The first line on stdout is "port P" (the port bound; --port 0, the default, picks a free one). One thread: an epoll
// loop whose only clock is a timerfd armed at the earliest release, so it never spins. SIGTERM or SIGINT: exit 0.
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter_ipv4.h>  // SO_ORIGINAL_DST
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tools/flags.h"

namespace {

// The nftables rule lets packets with this mark pass: those of the relay's own connections.
constexpr uint32_t kRelayMark = 0x77;
constexpr size_t kReadBytes = 256 << 10;  // at most one read
// A read of at least this many bytes keeps the buffer it was read into (no copy; the buffer returns to a pool once
// written); a smaller one is copied into a chunk of its size, so that many small messages in flight stay small.
constexpr size_t kKeepBufferBytes = 64 << 10;
constexpr size_t kMaxSpareBuffers = 16;
// Bytes held per direction before the relay stops reading from the sender (TCP's flow control then slows the sender
// down). To keep a link full it must exceed the delay times the link's rate: 32 MiB covers 1 ms at 32 GB/s.
constexpr size_t kMaxHeldBytes = 32 << 20;
constexpr int kMaxReadsPerEvent = 16;  // then the other sockets get their turn

// epoll keys: the three fixed descriptors, then connection id * 2 + side (0: the client, 1: the destination).
constexpr uint64_t kListenerKey = 0, kTimerKey = 1, kSignalKey = 2, kFirstConnectionId = 2;

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * int64_t{1000000000} + ts.tv_nsec;
}

std::string to_string(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

void set_int_option(int fd, int level, int name, int value) { setsockopt(fd, level, name, &value, sizeof value); }

// One direction of a relayed connection: bytes read from `from`, held until their release time, written to `to`.
struct Direction {
  struct Chunk {
    int64_t due_ns = 0;
    bool fin = false;  // no bytes: the sender's FIN, passed on as shutdown(to, SHUT_WR)
    std::unique_ptr<char[]> bytes;
    size_t size = 0, written = 0;
    bool pooled = false;  // `bytes` is a kReadBytes buffer
  };
  int from = -1, to = -1;
  std::deque<Chunk> held;  // in read order, hence in release order
  size_t held_bytes = 0;
  bool eof_read = false;          // `from` sent its FIN
  bool fin_sent = false;          // ...and it was passed on
  bool waiting_writable = false;  // `to`'s send buffer was full: resume on EPOLLOUT
};

struct Connection {
  uint64_t id = 0;
  std::string name;  // "client -> destination", for --verbose
  int client = -1, server = -1;
  bool connected = false;  // the relay's connection to the destination is established
  bool closed = false;     // both sockets closed; the object goes at the end of the event batch
  Direction up, down;      // client -> destination, destination -> client
  // The interest registered in epoll for each socket; 0: not registered.
  uint32_t client_events = 0, server_events = 0;
};

class Relay {
 public:
  Relay(int listener, int64_t delay_ns, bool verbose) : listener_(listener), delay_ns_(delay_ns), verbose_(verbose) {}

  // Serves until SIGTERM or SIGINT. Returns the exit code.
  int run();

 private:
  void accept_all();
  void open(int client);
  void on_socket(Connection& c, bool server_side, uint32_t events);
  void finish_connect(Connection& c);
  bool can_read(const Connection& c, const Direction& d) const {
    return !d.eof_read && d.held_bytes < kMaxHeldBytes && (&d == &c.up || c.connected);
  }
  void read_from(Connection& c, Direction& d);
  void flush(Connection& c, Direction& d);
  void update_interest(Connection& c);
  void set_interest(int fd, uint64_t key, uint32_t& registered, uint32_t wanted);
  void fail(Connection& c, const char* what, int err);
  void close(Connection& c, bool reset);
  void release_due();
  void arm_timer();

  int listener_, epoll_ = -1, timer_ = -1, signals_ = -1;
  const int64_t delay_ns_;
  const bool verbose_;
  uint64_t next_id_ = kFirstConnectionId;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::vector<uint64_t> closed_;  // ids to erase after the current batch (events of the batch may still name them)
  // (release time, connection id * 2 + direction) of every held chunk, in time order (release = read time + delay,
  // and the clock is monotonic): the timer is armed at the front.
  std::deque<std::pair<int64_t, uint64_t>> due_;
  int64_t armed_ns_ = 0;  // 0: disarmed

  std::unique_ptr<char[]> buffer_ = new_buffer();  // the next read goes here
  std::vector<std::unique_ptr<char[]>> spare_;     // read buffers written out, for reuse

  static std::unique_ptr<char[]> new_buffer() { return std::unique_ptr<char[]>(new char[kReadBytes]); }
};

int Relay::run() {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigprocmask(SIG_BLOCK, &stop, nullptr);
  signals_ = signalfd(-1, &stop, SFD_NONBLOCK | SFD_CLOEXEC);
  timer_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  epoll_ = epoll_create1(EPOLL_CLOEXEC);
  if (signals_ < 0 || timer_ < 0 || epoll_ < 0) {
    std::perror("delay_relay: signalfd/timerfd/epoll");
    return 1;
  }
  const std::pair<int, uint64_t> fixed[] = {{listener_, kListenerKey}, {timer_, kTimerKey}, {signals_, kSignalKey}};
  for (const auto& [fd, key] : fixed) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = key;
    epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
  }
  epoll_event events[256];
  for (;;) {
    const int n = epoll_wait(epoll_, events, 256, -1);
    if (n < 0 && errno != EINTR) {
      std::perror("delay_relay: epoll_wait");
      return 1;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kSignalKey) {
        if (verbose_) std::fprintf(stderr, "delay_relay: stopping (%zu connections)\n", connections_.size());
        return 0;  // the kernel closes every socket
      }
      if (key == kListenerKey) {
        accept_all();
      } else if (key == kTimerKey) {
        uint64_t expirations;
        while (read(timer_, &expirations, sizeof expirations) > 0) {
        }
        armed_ns_ = 0;
        release_due();
      } else if (auto it = connections_.find(key / 2); it != connections_.end() && !it->second->closed) {
        on_socket(*it->second, key % 2 == 1, events[i].events);
      }
    }
    for (uint64_t id : closed_) connections_.erase(id);
    closed_.clear();
    arm_timer();
  }
}

void Relay::accept_all() {
  for (;;) {
    const int fd = accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      open(fd);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) std::perror("delay_relay: accept");
    return;
  }
}

// A redirected connection: connect to where it was going (asynchronously), with the relay's mark.
void Relay::open(int client) {
  sockaddr_in dst{}, local{}, peer{};
  socklen_t len = sizeof dst, local_len = sizeof local, peer_len = sizeof peer;
  getsockname(client, reinterpret_cast<sockaddr*>(&local), &local_len);
  getpeername(client, reinterpret_cast<sockaddr*>(&peer), &peer_len);
  if (getsockopt(client, SOL_IP, SO_ORIGINAL_DST, &dst, &len) != 0 ||
      (dst.sin_addr.s_addr == local.sin_addr.s_addr && dst.sin_port == local.sin_port)) {
    // Not redirected (a direct connection to the relay): relaying it would connect to the relay again.
    std::fprintf(stderr, "delay_relay: refused %s: not a redirected connection\n", to_string(peer).c_str());
    ::close(client);
    return;
  }
  auto c = std::make_unique<Connection>();
  c->id = next_id_++;
  c->name = to_string(peer) + " -> " + to_string(dst);
  c->client = client;
  c->server = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  c->up.from = c->down.to = c->client;
  c->up.to = c->down.from = c->server;
  Connection& conn = *c;
  connections_.emplace(conn.id, std::move(c));
  if (conn.server < 0) return fail(conn, "socket", errno);
  set_int_option(client, IPPROTO_TCP, TCP_NODELAY, 1);
  set_int_option(conn.server, IPPROTO_TCP, TCP_NODELAY, 1);
  if (setsockopt(conn.server, SOL_SOCKET, SO_MARK, &kRelayMark, sizeof kRelayMark) != 0) {
    return fail(conn, "SO_MARK", errno);
  }
  if (verbose_) std::fprintf(stderr, "delay_relay: open %s\n", conn.name.c_str());
  if (connect(conn.server, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0) {
    conn.connected = true;
  } else if (errno != EINPROGRESS) {
    return fail(conn, "connect", errno);
  }
  update_interest(conn);
}

void Relay::on_socket(Connection& c, bool server_side, uint32_t events) {
  if (server_side && !c.connected) return finish_connect(c);
  Direction& in = server_side ? c.down : c.up;   // read from this socket
  Direction& out = server_side ? c.up : c.down;  // written to this socket
  const uint32_t trouble = EPOLLERR | EPOLLHUP;  // the next read or write reports it
  if ((events & (EPOLLOUT | trouble)) && out.waiting_writable) {
    out.waiting_writable = false;
    flush(c, out);
  }
  if (!c.closed && (events & (EPOLLIN | trouble)) && can_read(c, in)) read_from(c, in);
  if (!c.closed) update_interest(c);
}

void Relay::finish_connect(Connection& c) {
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(c.server, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) return fail(c, "connect", err);
  c.connected = true;
  flush(c, c.up);  // what the client sent meanwhile and is due
  if (!c.closed) update_interest(c);
}

void Relay::read_from(Connection& c, Direction& d) {
  const uint64_t due_key = c.id * 2 + (&d == &c.down);
  for (int i = 0; i < kMaxReadsPerEvent && can_read(c, d); ++i) {
    const ssize_t n = recv(d.from, buffer_.get(), kReadBytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0) return fail(c, "read", errno);
    const int64_t due = now_ns() + delay_ns_;
    Direction::Chunk& chunk = d.held.emplace_back();
    chunk.due_ns = due;
    chunk.fin = n == 0;
    d.eof_read = n == 0;
    if (static_cast<size_t>(n) >= kKeepBufferBytes) {
      chunk.bytes = std::move(buffer_);
      chunk.pooled = true;
      if (spare_.empty()) {
        buffer_ = new_buffer();
      } else {
        buffer_ = std::move(spare_.back());
        spare_.pop_back();
      }
    } else if (n > 0) {
      chunk.bytes.reset(new char[n]);
      std::memcpy(chunk.bytes.get(), buffer_.get(), n);
    }
    chunk.size = n;
    d.held_bytes += n;
    due_.emplace_back(due, due_key);
  }
  if (!d.held.empty() && d.held.front().due_ns <= now_ns()) flush(c, d);  // --delay-us 0
}

// Writes every chunk of `d` whose time has come, until the destination's send buffer is full.
void Relay::flush(Connection& c, Direction& d) {
  if (d.waiting_writable || (&d == &c.up && !c.connected)) return;  // EPOLLOUT or the connection resumes it
  const int64_t now = now_ns();
  while (!d.held.empty() && d.held.front().due_ns <= now) {
    Direction::Chunk& chunk = d.held.front();
    if (chunk.fin) {
      shutdown(d.to, SHUT_WR);
      d.fin_sent = true;
      d.held.pop_front();
      continue;
    }
    const ssize_t n = send(d.to, chunk.bytes.get() + chunk.written, chunk.size - chunk.written, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      d.waiting_writable = true;
      return;
    }
    if (n < 0) return fail(c, "write", errno);
    chunk.written += n;
    if (chunk.written == chunk.size) {
      d.held_bytes -= chunk.size;
      if (chunk.pooled && spare_.size() < kMaxSpareBuffers) spare_.push_back(std::move(chunk.bytes));
      d.held.pop_front();
    }
  }
  if (c.up.fin_sent && c.down.fin_sent) close(c, /*reset=*/false);
}

void Relay::update_interest(Connection& c) {
  const auto interest = [&](const Direction& read, const Direction& written) {
    return (can_read(c, read) ? uint32_t{EPOLLIN} : 0) | (written.waiting_writable ? uint32_t{EPOLLOUT} : 0);
  };
  const uint32_t client = interest(c.up, c.down);
  const uint32_t server = c.connected ? interest(c.down, c.up) : uint32_t{EPOLLOUT};  // EPOLLOUT: connected
  set_interest(c.client, c.id * 2, c.client_events, client);
  set_interest(c.server, c.id * 2 + 1, c.server_events, server);
}

// A socket the relay waits for nothing on leaves the epoll set: EPOLLHUP is reported even with no interest, and a
// half-closed socket whose direction still holds delayed bytes would wake the loop again and again.
void Relay::set_interest(int fd, uint64_t key, uint32_t& registered, uint32_t wanted) {
  if (wanted == registered) return;
  epoll_event ev{};
  ev.events = wanted;
  ev.data.u64 = key;
  epoll_ctl(epoll_, wanted == 0 ? EPOLL_CTL_DEL : registered == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, fd, &ev);
  registered = wanted;
}

void Relay::fail(Connection& c, const char* what, int err) {
  if (verbose_) std::fprintf(stderr, "delay_relay: %s: %s: %s\n", c.name.c_str(), what, std::strerror(err));
  close(c, /*reset=*/true);
}

// reset: an error; both ends see a connection reset rather than an orderly end of stream.
void Relay::close(Connection& c, bool reset) {
  if (verbose_ && !reset) std::fprintf(stderr, "delay_relay: closed %s\n", c.name.c_str());
  for (int fd : {c.client, c.server}) {
    if (fd < 0) continue;
    if (reset) {
      const linger abort{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
    }
    ::close(fd);  // also leaves the epoll set
  }
  c.closed = true;
  closed_.push_back(c.id);
}

void Relay::release_due() {
  const int64_t now = now_ns();
  while (!due_.empty() && due_.front().first <= now) {
    const uint64_t key = due_.front().second;
    due_.pop_front();
    auto it = connections_.find(key / 2);
    if (it == connections_.end() || it->second->closed) continue;
    Connection& c = *it->second;
    flush(c, key % 2 ? c.down : c.up);
    if (!c.closed) update_interest(c);
  }
}

void Relay::arm_timer() {
  const int64_t at = due_.empty() ? 0 : due_.front().first;
  if (at == armed_ns_) return;
  itimerspec spec{};
  spec.it_value.tv_sec = at / 1000000000;
  spec.it_value.tv_nsec = at % 1000000000;
  timerfd_settime(timer_, TFD_TIMER_ABSTIME, &spec, nullptr);  // a zero it_value disarms
  armed_ns_ = at;
}

}  // namespace

int main(int argc, char** argv) {
  long port = 0, delay_us = 1000;
  std::string bind_addr = "127.0.0.1";
  bool verbose = false;
  CLI::App app{
      "A transparent TCP proxy (run it behind an nftables redirect; see the top of bench/delay_relay.cc) that "
      "releases each chunk it reads --delay-us microseconds later, in both directions.",
      "delay_relay"};
  app.add_option("--port", port, "port to listen on (0: a free one); the first line on stdout is \"port P\"")
      ->check(CLI::Range(0, 65535));
  app.add_option("--delay-us", delay_us, "one-way delay added to every byte")->check(CLI::Range(0L, 60000000L));
  app.add_option("--bind", bind_addr, "address to listen on (where a redirect from the output hook leads)");
  app.add_flag("--verbose", verbose, "one line on stderr per connection opened, closed or failed");
  tandem::tools::parse_flags(app, argc, argv);
  signal(SIGPIPE, SIG_IGN);
  prctl(PR_SET_TIMERSLACK, 1UL);  // wake at the release time, not up to 50 us later
  if (rlimit files; getrlimit(RLIMIT_NOFILE, &files) == 0) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }

  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  set_int_option(listener, SOL_SOCKET, SO_REUSEADDR, 1);
  if (inet_pton(AF_INET, bind_addr.c_str(), &addr.sin_addr) != 1) {
    std::fprintf(stderr, "delay_relay: --bind %s is not an IPv4 address\n", bind_addr.c_str());
    return 2;
  }
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(listener, 1024) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::fprintf(stderr, "delay_relay: cannot listen on %s:%ld: %s\n", bind_addr.c_str(), port, std::strerror(errno));
    return 1;
  }
  // Without the mark the relay's own connections would be redirected to itself: check it can set one (CAP_NET_ADMIN).
  if (setsockopt(listener, SOL_SOCKET, SO_MARK, &kRelayMark, sizeof kRelayMark) != 0) {
    std::fprintf(stderr, "delay_relay: cannot set SO_MARK (needs CAP_NET_ADMIN): %s\n", std::strerror(errno));
    return 1;
  }
  std::printf("port %d\n", ntohs(addr.sin_port));
  std::fflush(stdout);
  return Relay(listener, delay_us * 1000, verbose).run();
}
