// Shared by Tandem's benchmark programs: timing and the JSON line format of bench/run.sh.
#pragma once

#include <dirent.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace tandem::bench {

inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

inline double median(std::vector<double> v) { return percentile(std::move(v), 0.5); }

// Reads or writes all `n` bytes of `p` on `fd`; false on EOF or an error.
inline bool full_io(int fd, void* p, size_t n, bool writing) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = writing ? write(fd, c, n) : read(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// In a floor's forked child: when this process is bound to one CPU (tandem-run --bind-cores 1), the child moves to the
// next online CPU, as the peer it stands for (another stage worker) runs on a core of its own.
inline void away_from_parent() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  if (online < 2 || sched_getaffinity(0, sizeof set, &set) != 0 || CPU_COUNT(&set) != 1) return;
  int cpu = 0;
  while (!CPU_ISSET(cpu, &set)) ++cpu;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>((cpu + 1) % online), &set);
  (void)sched_setaffinity(0, sizeof set, &set);
}

// Round trips of a blocking ping-pong of `bytes` each way over a Unix stream socket between this process and a child
// forked for it (call before any thread starts), after 500 warm-up ones: the floor of a message between two processes
// of one host that sleep while they wait. Empty when the machine refuses the socket or the fork.
inline std::vector<double> unix_pingpong_rtts_us(int iters, size_t bytes = 128) {
  std::vector<double> rtt;
  int sv[2];
  if (iters <= 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return rtt;
  std::vector<char> msg(bytes, 'p');
  const pid_t child = fork();
  if (child == 0) {
    away_from_parent();
    close(sv[0]);
    while (full_io(sv[1], msg.data(), bytes, false) && msg[0] != 'q') full_io(sv[1], msg.data(), bytes, true);
    _exit(0);
  }
  close(sv[1]);
  bool ok = child > 0;
  for (int i = 0; i < iters + 500 && ok; ++i) {
    const double t0 = now_us();
    ok = full_io(sv[0], msg.data(), bytes, true) && full_io(sv[0], msg.data(), bytes, false);
    if (ok && i >= 500) rtt.push_back(now_us() - t0);
  }
  msg[0] = 'q';
  if (child > 0) {
    full_io(sv[0], msg.data(), bytes, true);
    waitpid(child, nullptr, 0);
  }
  close(sv[0]);
  if (!ok) rtt.clear();
  return rtt;
}

// One-way latencies of `bytes` over a Unix stream socket to a child process (forked for it: call before any thread
// starts) asleep in read, while this process keeps its core busy for `busy_us` after each send, as a pipeline stage
// computes on after sending an activation: the child must be woken on the other core. Each message carries its send
// time (steady_clock is the machine's, the same in both processes); the child answers with the latency, read after the
// busy time. After 100 warm-up messages. Empty when the machine refuses the socket or the fork.
inline std::vector<double> unix_wake_latencies_us(int iters, double busy_us, size_t bytes = 128) {
  std::vector<double> lat;
  int sv[2];
  if (iters <= 0 || bytes < 2 * sizeof(double) || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return lat;
  std::vector<char> msg(bytes, 'w');
  const pid_t child = fork();
  if (child == 0) {
    away_from_parent();
    close(sv[0]);
    double header[2];
    while (full_io(sv[1], msg.data(), bytes, false)) {
      std::copy(msg.data(), msg.data() + sizeof header, reinterpret_cast<char*>(header));
      if (header[1] < 0) break;  // the end
      const double us = now_us() - header[0];
      if (!full_io(sv[1], const_cast<double*>(&us), sizeof us, true)) break;
    }
    _exit(0);
  }
  close(sv[1]);
  bool ok = child > 0;
  for (int i = 0; i < iters + 100 && ok; ++i) {
    const double header[2] = {now_us(), 1};
    std::copy(reinterpret_cast<const char*>(header), reinterpret_cast<const char*>(header) + sizeof header, msg.data());
    ok = full_io(sv[0], msg.data(), bytes, true);
    volatile double sink = 0;
    for (const double t0 = now_us(); now_us() - t0 < busy_us;) sink = sink + 1;  // computing meanwhile
    double us = 0;
    ok = ok && full_io(sv[0], &us, sizeof us, false);
    if (ok && i >= 100) lat.push_back(us);
  }
  if (child > 0) {
    const double end[2] = {0, -1};
    std::copy(reinterpret_cast<const char*>(end), reinterpret_cast<const char*>(end) + sizeof end, msg.data());
    full_io(sv[0], msg.data(), bytes, true);
    waitpid(child, nullptr, 0);
  }
  close(sv[0]);
  if (!ok) lat.clear();
  return lat;
}

// Where this process's threads spent their time so far (ms, from /proc/.../schedstat): the calling thread running and
// runnable but waiting for a CPU, and all the others (the runtime's: a process group's thread, RPC's) running.
struct ThreadTimes {
  double self_run_ms = 0, self_wait_ms = 0, others_run_ms = 0;
};
inline ThreadTimes thread_times() {
  ThreadTimes out;
  const std::string self = std::to_string(gettid());
  DIR* dir = opendir("/proc/self/task");
  if (!dir) return out;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/schedstat");
    double run_ns = 0, wait_ns = 0;
    if (!(in >> run_ns >> wait_ns)) continue;  // the thread ended meanwhile
    if (self == e->d_name) {
      out.self_run_ms += run_ns / 1e6;
      out.self_wait_ms += wait_ns / 1e6;
    } else {
      out.others_run_ms += run_ns / 1e6;
    }
  }
  closedir(dir);
  return out;
}

// One result line: {"bench":..,"impl":"tandem","metric":..,"value":..,"unit":..,<extra>}; `extra` is ready JSON
// members without braces ("\"iters\":1000"), or empty.
inline void emit_as(const std::string& impl, const std::string& bench, const std::string& metric, double value,
                    const std::string& unit, const std::string& extra = "") {
  std::printf("{\"bench\":\"%s\",\"impl\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\"%s%s}\n",
              bench.c_str(), impl.c_str(), metric.c_str(), value, unit.c_str(), extra.empty() ? "" : ",",
              extra.c_str());
  std::fflush(stdout);
}
inline void emit(const std::string& bench, const std::string& metric, double value, const std::string& unit,
                 const std::string& extra = "") {
  emit_as("tandem", bench, metric, value, unit, extra);
}
// The same with "impl":"floor": the limit a figure is compared with, measured in the same run.
inline void emit_floor(const std::string& bench, const std::string& metric, double value, const std::string& unit,
                       const std::string& extra = "") {
  emit_as("floor", bench, metric, value, unit, extra);
}

}  // namespace tandem::bench
