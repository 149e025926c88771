#include "tests/common/spawner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace tandem::test::spawner {
namespace {

// Requests: a header {kind, payload bytes} then the payload. Replies: two int64 values.
enum Kind : uint32_t { kSpawn = 1, kPoll = 2 };
struct Header {
  uint32_t kind;
  uint32_t size;
};
struct Reply {
  int64_t a;  // spawn: the pid (or -errno); poll: 1 exited, 0 running, -1 unknown pid
  int64_t b;  // poll: the wait status
};

int g_fd = -1;  // the test process's end of the socket; -1 when there is no server
std::atomic<bool> g_available{false};
std::mutex g_mu;  // one request at a time on the socket

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);  // a peer that is gone is an error here, not a SIGPIPE
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::optional<std::string> g_scenario;  // set in a spawned worker

// In a forked child of the server: sets up the worker's output and environment; the caller returns from start().
void become_worker(int server_fd, pid_t server, const std::vector<std::string>& fields) {
  ::close(server_fd);
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // the server ends when the test process does; its workers with it
  if (getppid() != server) _exit(1);
  const int fd = ::open(fields[1].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) _exit(126);
  dup2(fd, STDOUT_FILENO);
  dup2(fd, STDERR_FILENO);
  ::close(fd);
  clearenv();
  for (size_t i = 2; i < fields.size(); ++i) putenv(strdup(fields[i].c_str()));  // putenv keeps the pointer
  g_scenario = fields[0];
}

// The server: one thread, serving until the test process closes its end (then it exits). Returns only in a spawned
// worker.
void serve(int fd) {
  const pid_t self = getpid();
  for (;;) {
    Header h;
    if (!read_all(fd, &h, sizeof(h))) _exit(0);
    std::string payload(h.size, '\0');
    if (h.size > 0 && !read_all(fd, payload.data(), h.size)) _exit(0);
    Reply reply{0, 0};
    if (h.kind == kSpawn) {
      std::vector<std::string> fields;  // scenario, log path, then the environment, each ended by '\0'
      size_t start = 0;
      for (size_t i = 0; i < payload.size(); ++i) {
        if (payload[i] == '\0') {
          fields.emplace_back(payload, start, i - start);
          start = i + 1;
        }
      }
      if (fields.size() < 2) _exit(2);
      const pid_t child = fork();
      if (child == 0) {
        become_worker(fd, self, fields);
        return;
      }
      reply.a = child > 0 ? child : -errno;
    } else if (h.kind == kPoll && h.size == sizeof(pid_t)) {
      pid_t pid;
      std::memcpy(&pid, payload.data(), sizeof(pid));
      // Reported once: a Process stops polling when it has the status, and the pid may be reused after.
      int status = 0;
      const pid_t r = waitpid(pid, &status, WNOHANG);
      reply = r == pid ? Reply{1, status} : Reply{r == 0 ? 0 : -1, 0};
    } else {
      _exit(2);
    }
    if (!write_all(fd, &reply, sizeof(reply))) _exit(0);
  }
}

Reply request(Kind kind, const std::string& payload) {
  std::lock_guard<std::mutex> lock(g_mu);
  const Header h{kind, static_cast<uint32_t>(payload.size())};
  Reply reply;
  if (g_fd < 0 || !write_all(g_fd, &h, sizeof(h)) || !write_all(g_fd, payload.data(), payload.size()) ||
      !read_all(g_fd, &reply, sizeof(reply))) {
    throw ServerGone("the test's worker fork server is gone");
  }
  return reply;
}

}  // namespace

void start() {
  // Test processes and every worker they start keep abseil's lock-order checking, which init_rpc otherwise turns off
  // (rpc/rpc.h): set before the fork server is forked, so that its children inherit it.
  setenv("TANDEM_LOCK_ORDER_CHECK", "1", /*overwrite=*/0);
  if (const char* v = std::getenv("TANDEM_TEST_EXEC_WORKERS"); v && std::string(v) == "1") return;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return;
  std::fflush(nullptr);  // nothing buffered may be written twice
  const pid_t parent = getpid();
  const pid_t server = fork();
  if (server < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return;
  }
  if (server == 0) {
    ::close(fds[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    serve(fds[1]);  // returns only in a spawned worker, which goes on with main
    return;
  }
  ::close(fds[1]);
  g_fd = fds[0];
  g_available = true;
}

const std::optional<std::string>& worker_scenario() { return g_scenario; }

bool available() { return g_available; }

pid_t spawn(const std::string& scenario, const std::vector<std::string>& env, const std::string& log_path) {
  std::string payload = scenario + '\0' + log_path + '\0';
  for (const auto& kv : env) payload += kv + '\0';
  const Reply r = request(kSpawn, payload);
  if (r.a <= 0) {
    throw std::runtime_error("fork failed in the test's worker fork server: " + std::string(strerror(-r.a)));
  }
  return static_cast<pid_t>(r.a);
}

std::optional<int> poll(pid_t pid) {
  const Reply r = request(kPoll, std::string(reinterpret_cast<const char*>(&pid), sizeof(pid)));
  if (r.a < 0) throw std::runtime_error("the test's worker fork server has no worker " + std::to_string(pid));
  if (r.a == 0) return std::nullopt;
  return static_cast<int>(r.b);
}

}  // namespace tandem::test::spawner
