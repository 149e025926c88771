// tcp_pingpong: the floors under an RPC over one plain TCP connection, for `bench/run.sh hosts`, which compares
// Tandem's calls with them over the same path: blocking round trips of B bytes (the small call), and B bytes sent for
// an R-byte answer (the bulk transfer, --reply R).
//
//   tcp_pingpong server [--port P] [--bind ADDR]
//   tcp_pingpong client --host H --port P [--iters N] [--size B] [--reply R] [--warmup W] [--chunk C]
//
// The server prints "port P" first (the port bound; --port 0, the default, picks a free one) and serves each
// connection in its own process until SIGTERM. The client sends B and R (8 bytes each, big-endian) once, then per
// round trip B bytes; the server reads all B, then returns R bytes (R defaults to B). Blocking sockets, TCP_NODELAY
// on both ends. After W untimed round trips (default 200) the client times N (default 5000) and prints one JSON line:
//   {"bench":"hosts","impl":"raw_tcp","metric":"hosts_raw_tcp_rtt_p50_us","value":..,"unit":"us","iters":N,..}
// or, with --reply smaller than B, the median of B / round trip:
//   {"bench":"hosts","impl":"raw_tcp","metric":"hosts_raw_tcp_bulk_GBps","value":..,"unit":"GB/s","bytes":B,..}
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tools/flags.h"

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "tcp_pingpong: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

// false: the peer closed the connection before the first byte; a close mid-message is an error.
bool read_full(int fd, char* p, size_t n) {
  for (size_t got = 0; got < n;) {
    const ssize_t r = read(fd, p + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) die("read");
    if (r == 0 && got == 0) return false;
    if (r == 0) {
      errno = ECONNRESET;
      die("read (connection closed mid-message)");
    }
    got += r;
  }
  return true;
}

// Sends n bytes, at most `chunk` per send (0: all that is left at once).
void write_full(int fd, const char* p, size_t n, size_t chunk = 0) {
  for (size_t put = 0; put < n;) {
    const size_t want = chunk ? std::min(chunk, n - put) : n - put;
    const ssize_t w = send(fd, p + put, want, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) die("write");
    put += w;
  }
}

void no_delay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void serve_connection(int fd) {
  no_delay(fd);
  uint64_t sizes_be[2];
  if (!read_full(fd, reinterpret_cast<char*>(sizes_be), sizeof sizes_be)) return;
  const uint64_t size = be64toh(sizes_be[0]), reply = be64toh(sizes_be[1]);
  if (size < 1 || reply < 1 || size > (uint64_t{1} << 32) || reply > (uint64_t{1} << 32)) return;
  std::vector<char> message(std::max(size, reply));
  while (read_full(fd, message.data(), size)) write_full(fd, message.data(), reply);
}

int server(int port, const std::string& bind_addr) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, bind_addr.c_str(), &addr.sin_addr) != 1) {
    errno = EINVAL;
    die("bad --bind address '" + bind_addr + "'");
  }
  socklen_t len = sizeof addr;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(listener, 64) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    die("listen on " + bind_addr + ":" + std::to_string(port));
  }
  std::printf("port %d\n", ntohs(addr.sin_port));
  std::fflush(stdout);
  signal(SIGCHLD, SIG_IGN);  // no zombies
  for (;;) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      die("accept");
    }
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // a connection's process ends with the server
      close(listener);
      serve_connection(fd);
      _exit(0);
    }
    if (pid < 0) std::perror("tcp_pingpong: fork");
    close(fd);
  }
}

// Connects to host:port, retrying a refused connection for up to 10 s (a server just started).
int connect_to(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (const int e = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); e != 0) {
    std::fprintf(stderr, "tcp_pingpong: %s: %s\n", host.c_str(), gai_strerror(e));
    std::exit(1);
  }
  const sockaddr_in to = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  for (int attempt = 0;; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0) return fd;
    if (errno != ECONNREFUSED || attempt == 200) die("connect to " + host + ":" + std::to_string(port));
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

int client(const std::string& host, int port, long iters, long size, long reply, long warmup, long chunk) {
  const int fd = connect_to(host, port);
  no_delay(fd);
  const uint64_t sizes_be[2] = {htobe64(static_cast<uint64_t>(size)), htobe64(static_cast<uint64_t>(reply))};
  write_full(fd, reinterpret_cast<const char*>(sizes_be), sizeof sizes_be);
  std::vector<char> message(std::max(size, reply), 'x');
  std::vector<double> rtt_us;
  rtt_us.reserve(iters);
  for (long i = 0; i < warmup + iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    write_full(fd, message.data(), size, static_cast<size_t>(chunk));
    if (!read_full(fd, message.data(), reply)) {
      errno = ECONNRESET;
      die("read (the server closed the connection)");
    }
    if (i >= warmup) {
      rtt_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  close(fd);
  if (reply < size) {
    std::vector<double> gbps;
    for (double us : rtt_us) gbps.push_back(static_cast<double>(size) / (us * 1e3));
    std::printf(
        "{\"bench\":\"hosts\",\"impl\":\"raw_tcp\",\"metric\":\"hosts_raw_tcp_bulk_GBps\","
        "\"value\":%.6g,\"unit\":\"GB/s\",\"iters\":%ld,\"bytes\":%ld,\"reply_bytes\":%ld,\"send_bytes\":%ld,"
        "\"processes\":2}\n",
        percentile(gbps, 0.5), iters, size, reply, chunk ? std::min(chunk, size) : size);
    std::fflush(stdout);
    return 0;
  }
  std::printf(
      "{\"bench\":\"hosts\",\"impl\":\"raw_tcp\",\"metric\":\"hosts_raw_tcp_rtt_p50_us\","
      "\"value\":%.6g,\"unit\":\"us\",\"iters\":%ld,\"bytes\":%ld,\"p99_us\":%.6g,\"processes\":2}\n",
      percentile(rtt_us, 0.5), iters, size, percentile(rtt_us, 0.99));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Raw TCP ping-pong, the floor beside the hosts benchmarks' figures", "tcp_pingpong"};
  app.require_subcommand(1);
  long server_port = 0, port = 0, iters = 5000, size = 1, reply = 0, warmup = 200, chunk = 0;
  std::string host, bind_addr = "0.0.0.0";
  CLI::App* serve =
      app.add_subcommand("server", "answers each message with the size the client asks; prints \"port P\"");
  serve->add_option("--port", server_port, "port to listen on (0: a free one)")->check(CLI::Range(0, 65535));
  serve->add_option("--bind", bind_addr, "address to listen on");
  CLI::App* ask = app.add_subcommand(
      "client",
      "W untimed, then N timed round trips of B bytes answered with R; prints one JSON line: the median round trip "
      "(hosts_raw_tcp_rtt_p50_us) and p99, or with R < B the median B / round trip (hosts_raw_tcp_bulk_GBps)");
  ask->add_option("--host", host, "the server's address")->required();
  ask->add_option("--port", port, "the server's port")->required()->check(CLI::Range(1, 65535));
  ask->add_option("--iters", iters, "timed round trips (N)")->check(CLI::PositiveNumber);
  ask->add_option("--size", size, "bytes per message (B)")->check(CLI::Range(1L, 1L << 32));
  ask->add_option("--reply", reply, "bytes per answer (R; 0: B)")->check(CLI::Range(0L, 1L << 32));
  ask->add_option("--warmup", warmup, "untimed round trips first (W)")->check(CLI::NonNegativeNumber);
  ask->add_option("--chunk", chunk, "at most this many bytes per send (0: the whole message)")
      ->check(CLI::NonNegativeNumber);
  tandem::tools::parse_flags(app, argc, argv);
  if (serve->parsed()) return server(static_cast<int>(server_port), bind_addr);
  if (reply == 0) reply = size;
  return client(host, static_cast<int>(port), iters, size, reply, warmup, chunk);
}
