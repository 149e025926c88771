#include "output_relay.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

namespace tandem::tools {
namespace {

struct Relay {
  int from = -1;  // the pipe's read end (its write end is now descriptor 1 or 2)
  int to = -1;    // the original descriptor, duplicated
  size_t cap = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::string waiting;  // read, not written yet
  size_t dropped = 0;   // bytes read while `waiting` was full
  bool eof = false;     // the pipe's write end is closed (at exit)
  bool done = false;    // and everything read is written (or dropped)
};

// Never destroyed: the threads may still use them while the process exits.
Relay* const g_relays = new Relay[2];

// Writes all of `data` to `fd`; gives up on an error other than EINTR (a closed reader: the output goes nowhere).
void write_all(int fd, const std::string& data) {
  size_t at = 0;
  while (at < data.size()) {
    const ssize_t n = ::write(fd, data.data() + at, data.size() - at);
    if (n > 0) {
      at += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return;
    }
  }
}

void read_loop(Relay* r) {
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(r->from, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    std::lock_guard<std::mutex> lock(r->mu);
    if (n <= 0) {
      r->eof = true;
      r->cv.notify_all();
      return;
    }
    if (r->waiting.size() + static_cast<size_t>(n) > r->cap) {
      r->dropped += static_cast<size_t>(n);
    } else {
      r->waiting.append(chunk, static_cast<size_t>(n));
    }
    r->cv.notify_all();
  }
}

void write_loop(Relay* r) {
  for (;;) {
    std::string out;
    size_t dropped = 0;
    {
      std::unique_lock<std::mutex> lock(r->mu);
      r->cv.wait(lock, [r] { return !r->waiting.empty() || r->dropped > 0 || r->eof; });
      if (r->waiting.empty() && r->dropped == 0) {  // eof, and all written
        r->done = true;
        r->cv.notify_all();
        return;
      }
      out.swap(r->waiting);
      dropped = r->dropped;
      r->dropped = 0;
    }
    write_all(r->to, out);
    if (dropped > 0) {
      write_all(r->to, "tandem-run: " + std::to_string(dropped) +
                           " bytes of output dropped here while this output was not read\n");
    }
  }
}

// At exit: the pipes' write ends close (descriptors 1 and 2 point at /dev/null), and what waits is written within 5 s.
void drain_at_exit() {
  std::fflush(stdout);
  std::fflush(stderr);
  std::cout.flush();
  std::cerr.flush();
  const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null < 0) return;
  ::dup2(null, 1);
  ::dup2(null, 2);
  ::close(null);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (int i = 0; i < 2; ++i) {
    Relay& r = g_relays[i];
    std::unique_lock<std::mutex> lock(r.mu);
    r.cv.wait_until(lock, until, [&r] { return r.done; });
  }
}

}  // namespace

bool relay_own_output(size_t cap) {
  int pipes[2][2] = {{-1, -1}, {-1, -1}};
  int saved[2] = {-1, -1};
  for (int i = 0; i < 2; ++i) {
    if (::pipe2(pipes[i], O_CLOEXEC) != 0 || (saved[i] = ::fcntl(1 + i, F_DUPFD_CLOEXEC, 3)) < 0) {
      for (int k = 0; k < 2; ++k) {
        for (int fd : {pipes[k][0], pipes[k][1], saved[k]}) {
          if (fd >= 0) ::close(fd);
        }
      }
      return false;
    }
  }
  std::fflush(stdout);
  std::fflush(stderr);
  // The relay's threads take no signal: the launcher's (SIGINT, SIGTERM) reach its own threads, which look for them.
  sigset_t all, before;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &before);
  for (int i = 0; i < 2; ++i) {
    Relay& r = g_relays[i];
    r.from = pipes[i][0];
    r.to = saved[i];
    r.cap = cap;
    ::dup2(pipes[i][1], 1 + i);  // without O_CLOEXEC: a worker's own streams replace it before exec
    ::close(pipes[i][1]);
    std::thread(read_loop, &r).detach();
    std::thread(write_loop, &r).detach();
  }
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
  std::atexit(drain_at_exit);
  return true;
}

}  // namespace tandem::tools
