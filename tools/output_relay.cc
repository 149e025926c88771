#include "output_relay.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

namespace tandem::tools {
namespace {

// A line longer than this is written in pieces (the writer otherwise writes whole lines only).
constexpr size_t kLongestLine = size_t{64} << 10;

struct Relay {
  int from = -1;  // the pipe's read end (its write end is now descriptor 1 or 2)
  int to = -1;    // the original descriptor, duplicated
  size_t cap = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::string waiting;    // read, not written yet
  size_t writing = 0;     // bytes the writer took and is writing
  size_t dropped = 0;     // bytes dropped since the output stalled, not told yet
  bool dropping = false;  // from a drop until what waited before it is written and the drop is told
  bool eof = false;       // the pipe's write end is closed (at exit)
  bool done = false;      // and everything read is written (or dropped)
};

// Never destroyed: the threads may still use them while the process exits.
Relay* const g_relays = new Relay[2];
// The original descriptors, for the handlers of a crash (async-signal-safe reads).
volatile sig_atomic_t g_saved[2] = {-1, -1};

// Writes all of `data` to `fd`, waiting (poll) while a non-blocking descriptor is full; gives up on another error (a
// closed reader: the output goes nowhere).
void write_all(int fd, const char* data, size_t size) {
  size_t at = 0;
  while (at < size) {
    const ssize_t n = ::write(fd, data + at, size - at);
    if (n > 0) {
      at += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      (void)::poll(&p, 1, 100);
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
    // Once output is dropped, everything is until what waited before is written: the note of the drop then stands
    // where the output went missing.
    if (r->dropping || r->waiting.size() + r->writing + static_cast<size_t>(n) > r->cap) {
      r->dropping = true;
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
      // Whole lines (stdout and stderr may share a terminal: a line of one is not cut by a line of the other), or a
      // long line in pieces, or the rest at the end, or a drop to tell once what waited before it is written.
      auto ready = [r] {
        return r->waiting.find('\n') != std::string::npos || r->waiting.size() >= kLongestLine || r->dropping || r->eof;
      };
      r->cv.wait(lock, ready);
      if (r->waiting.empty() && r->dropping) {
        dropped = r->dropped;
        r->dropped = 0;
        r->dropping = false;
      } else if (!r->waiting.empty()) {
        // Up to the last line's end; all of it at the end, before telling of a drop, or when a line is that long.
        size_t take = r->waiting.size();
        if (!r->eof && !r->dropping) {
          const size_t nl = r->waiting.rfind('\n');
          if (nl != std::string::npos) take = nl + 1;
        }
        out = r->waiting.substr(0, take);
        r->waiting.erase(0, take);
        r->writing = out.size();
      } else {  // eof, and all written
        r->done = true;
        r->cv.notify_all();
        return;
      }
    }
    if (dropped > 0) {
      const std::string note =
          "tandem-run: " + std::to_string(dropped) + " bytes of output dropped here while this output was not read\n";
      write_all(r->to, note.data(), note.size());
    }
    write_all(r->to, out.data(), out.size());
    std::lock_guard<std::mutex> lock(r->mu);
    r->writing = 0;
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

// A crash (a fatal signal, std::terminate): descriptors 1 and 2 are the original ones again, so that what is written
// from here on (the runtime's message, a sanitizer's report) reaches the reader; what waited in memory is lost.
void restore_descriptors() {
  for (int i = 0; i < 2; ++i) {
    if (g_saved[i] >= 0) ::dup2(g_saved[i], 1 + i);
  }
}

void on_fatal_signal(int sig) {
  restore_descriptors();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Descriptors 0-2 that are closed get /dev/null: a pipe made below must not take one of their numbers.
void fill_standard_descriptors() {
  for (int fd = 0; fd < 3; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    const int null = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (null >= 0 && null != fd) {
      ::dup2(null, fd);
      ::close(null);
    }
  }
}

}  // namespace

bool relay_own_output(size_t cap) {
  fill_standard_descriptors();
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
  for (int i = 0; i < 2; ++i) {
    g_relays[i].from = pipes[i][0];
    g_relays[i].to = saved[i];
    g_relays[i].cap = cap;
  }
  // The relay's threads take no signal: the launcher's (SIGINT, SIGTERM) reach its own threads, which look for them.
  // They start before the descriptors change: if one cannot, closing the pipes ends those that did, and the output
  // stays as it was.
  sigset_t all, before;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &before);
  bool started = true;
  try {
    for (int i = 0; i < 2; ++i) {
      std::thread(read_loop, &g_relays[i]).detach();
      std::thread(write_loop, &g_relays[i]).detach();
    }
  } catch (const std::system_error&) {
    started = false;
  }
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
  for (int i = 0; i < 2; ++i) {
    if (started) ::dup2(pipes[i][1], 1 + i);  // without O_CLOEXEC: a worker's own streams replace it before exec
    ::close(pipes[i][1]);
  }
  if (!started) return false;
  // Crashes write to the original descriptors (restore_descriptors); the previous terminate handler still runs.
  for (int i = 0; i < 2; ++i) g_saved[i] = saved[i];
  static std::terminate_handler previous = std::set_terminate([] {
    restore_descriptors();
    if (previous) previous();
    std::abort();
  });
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) {
    struct sigaction sa {};
    sa.sa_handler = on_fatal_signal;
    sa.sa_flags = SA_RESETHAND | SA_NODEFER;
    sigaction(sig, &sa, nullptr);
  }
  std::atexit(drain_at_exit);
  return true;
}

}  // namespace tandem::tools
