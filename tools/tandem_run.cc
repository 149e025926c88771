// tandem-run: starts the worker processes of a Tandem job on this node, torchrun-style.
//
//   tandem-run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] [--secret-file F]
//              [--grace-seconds S] [--] program args...
//
// Each worker gets RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's
// variables) and TANDEM_SECRET, the job secret: generated when the job is on one node (unless TANDEM_SECRET is set),
// taken from TANDEM_SECRET or --secret-file when it spans nodes. On one node without --master-port a free port is
// chosen. Every output line of a worker is prefixed with "[rankN]: ".
//
// When a worker fails (non-zero exit or a signal), the others get SIGTERM, then SIGKILL after the grace period, and
// tandem-run exits non-zero with one summary line naming who failed and why. Workers die with tandem-run (PDEATHSIG).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Options {
  int nproc = 1, nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;
  std::string secret_file;
  int grace_seconds = 5;
  std::vector<std::string> command;
};

struct Stream {
  int fd = -1;
  std::string partial;
  FILE* out = nullptr;
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream streams[2];
};

volatile sig_atomic_t g_signal = 0;

[[noreturn]] void usage(const std::string& error) {
  std::cerr << "tandem-run: " << error << "\n"
            << "usage: tandem-run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]\n"
            << "                  [--secret-file F] [--grace-seconds S] [--] program args...\n";
  std::exit(2);
}

int parse_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    int n = std::stoi(v, &used);
    if (used == v.size()) return n;
  } catch (...) {
  }
  usage("bad value for " + flag + ": '" + v + "'");
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;
    std::string value;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= argc) usage("missing value for " + a);
      value = argv[++i];
    }
    for (auto& c : a) c = c == '_' ? '-' : c;  // torchrun spells them with underscores
    if (a == "--nproc-per-node") o.nproc = parse_int(a, value);
    else if (a == "--nnodes") o.nnodes = parse_int(a, value);
    else if (a == "--node-rank") o.node_rank = parse_int(a, value);
    else if (a == "--master-addr") o.master_addr = value;
    else if (a == "--master-port") o.master_port = parse_int(a, value);
    else if (a == "--secret-file") o.secret_file = value;
    else if (a == "--grace-seconds") o.grace_seconds = parse_int(a, value);
    else usage("unknown option " + a);
  }
  for (; i < argc; ++i) o.command.push_back(argv[i]);
  if (o.command.empty()) usage("no program to run");
  if (o.nproc < 1 || o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) usage("bad node/process counts");
  if (o.master_port > 65535) usage("bad master port");
  return o;
}

int free_port(const std::string& host) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("tandem-run: cannot find a free port");
    std::exit(1);
  }
  close(fd);
  return ntohs(addr.sin_port);
}

std::string random_secret() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!in.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    std::cerr << "tandem-run: cannot read /dev/urandom for the job secret\n";
    std::exit(1);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

std::string job_secret(const Options& o) {
  if (const char* env = std::getenv("TANDEM_SECRET"); env && *env) return env;
  if (!o.secret_file.empty()) {
    std::ifstream in(o.secret_file);
    std::string s;
    if (!in || !std::getline(in, s) || s.empty()) {
      std::cerr << "tandem-run: cannot read the job secret from " << o.secret_file << "\n";
      std::exit(2);
    }
    return s;
  }
  if (o.nnodes > 1) usage("a job on several nodes needs the same secret on each: set TANDEM_SECRET or --secret-file");
  return random_secret();
}

void spawn(Worker& w, const Options& o, int world, const std::string& secret) {
  int pipes[2][2];
  if (pipe2(pipes[0], O_CLOEXEC) != 0 || pipe2(pipes[1], O_CLOEXEC) != 0) {
    std::perror("tandem-run: pipe");
    std::exit(1);
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("tandem-run: fork");
    std::exit(1);
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != parent) _exit(1);
    dup2(pipes[0][1], STDOUT_FILENO);
    dup2(pipes[1][1], STDERR_FILENO);
    const int local = w.rank - o.node_rank * o.nproc;
    setenv("RANK", std::to_string(w.rank).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
    setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
    setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
    setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
    setenv("TANDEM_SECRET", secret.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "cannot execute %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  close(pipes[0][1]);
  close(pipes[1][1]);
  w.pid = pid;
  w.running = true;
  w.streams[0] = {pipes[0][0], "", stdout};
  w.streams[1] = {pipes[1][0], "", stderr};
}

void emit(const Worker& w, Stream& s, const char* data, size_t n, bool eof) {
  s.partial.append(data, n);
  size_t start = 0;
  for (;;) {
    size_t nl = s.partial.find('\n', start);
    if (nl == std::string::npos) break;
    std::fprintf(s.out, "[rank%d]: %.*s\n", w.rank, static_cast<int>(nl - start), s.partial.data() + start);
    start = nl + 1;
  }
  s.partial.erase(0, start);
  if (eof && !s.partial.empty()) {
    std::fprintf(s.out, "[rank%d]: %s\n", w.rank, s.partial.c_str());
    s.partial.clear();
  }
  std::fflush(s.out);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  if (o.master_port < 0) {
    if (o.nnodes > 1) usage("a job on several nodes needs --master-port");
    o.master_port = free_port(o.master_addr);
  }
  const int world = o.nnodes * o.nproc;
  const std::string secret = job_secret(o);

  struct sigaction sa {};
  sa.sa_handler = [](int sig) { g_signal = sig; };
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<Worker> workers(o.nproc);
  for (int i = 0; i < o.nproc; ++i) {
    workers[i].rank = o.node_rank * o.nproc + i;
    spawn(workers[i], o, world, secret);
  }

  int first_failed = -1;  // index into workers
  int first_status = 0;
  bool stopping = false;
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  auto stop_others = [&](int sig) {
    for (auto& w : workers) {
      if (w.running) kill(w.pid, sig);
    }
  };

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> owners;  // (worker, stream)
    for (int i = 0; i < o.nproc; ++i) {
      for (int s = 0; s < 2; ++s) {
        if (workers[i].streams[s].fd >= 0) {
          fds.push_back({workers[i].streams[s].fd, POLLIN, 0});
          owners.emplace_back(i, s);
        }
      }
    }
    bool any_running = false;
    for (auto& w : workers) any_running |= w.running;
    if (fds.empty() && !any_running) break;

    poll(fds.data(), fds.size(), 100);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [i, s] = owners[k];
      char buf[65536];
      ssize_t n = read(fds[k].fd, buf, sizeof(buf));
      if (n > 0) {
        emit(workers[i], workers[i].streams[s], buf, n, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit(workers[i], workers[i].streams[s], "", 0, true);
        close(workers[i].streams[s].fd);
        workers[i].streams[s].fd = -1;
      }
    }

    for (int i = 0; i < o.nproc; ++i) {
      Worker& w = workers[i];
      if (!w.running) continue;
      int status = 0;
      if (waitpid(w.pid, &status, WNOHANG) == w.pid) {
        w.running = false;
        w.status = status;
        if (failed(status) && first_failed < 0 && !stopping) {
          first_failed = i;
          first_status = status;
        }
      }
    }

    if (!stopping && (first_failed >= 0 || g_signal)) {
      stopping = true;
      stop_others(g_signal ? g_signal : SIGTERM);
      kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.grace_seconds);
    }
    if (stopping && std::chrono::steady_clock::now() > kill_deadline) {
      stop_others(SIGKILL);
      kill_deadline = std::chrono::steady_clock::time_point::max();
    }
  }

  if (first_failed < 0 && !g_signal) return 0;
  if (first_failed < 0) {
    std::fprintf(stderr, "tandem-run: interrupted by signal %d; stopped all ranks\n", static_cast<int>(g_signal));
    return 128 + g_signal;
  }
  std::string stopped;
  for (int i = 0; i < o.nproc; ++i) {
    if (i == first_failed) continue;
    if (!stopped.empty()) stopped += ", ";
    stopped += std::to_string(workers[i].rank) + " (" + describe_status(workers[i].status) + ")";
  }
  std::fprintf(stderr, "tandem-run: rank %d (pid %d) failed with %s%s%s\n", workers[first_failed].rank,
               static_cast<int>(workers[first_failed].pid), describe_status(first_status).c_str(),
               stopped.empty() ? "" : "; other ranks: ", stopped.c_str());
  if (WIFEXITED(first_status)) return WEXITSTATUS(first_status);
  return 128 + WTERMSIG(first_status);
}
