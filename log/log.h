// Tandem's log: lines naming the worker and the subsystem, at a level from the environment, written through glog
// (the logging library LibTorch itself uses on Debian).
//
//   TANDEM_LOG_LEVEL=error|warn|info|debug   (default warn: quiet unless something is wrong)
//   TANDEM_LOG(kDebug, "rref") << "fork of " << id << " confirmed by " << owner;
//     -> I20261125 19:20:01.123456 4242 rref.cc:210] [tandem worker1 rref debug] fork of 17 confirmed by worker0
//
// error: a failure Tandem cannot report to a caller (a one-way call's error, a background thread's). warn: something
// is wrong and may explain a slow or failing job (a peer gone, a retry, a late rank). info: a worker's life (joined,
// shut down), once each. debug: connections, rendezvous steps, RRef protocol steps, context lifetimes, collective
// calls. glog writes the lines to stderr (Tandem initialises it so when the program has not: a program that sets up
// glog itself does so before init_rpc, at the start of main). A disabled level costs one relaxed atomic load.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <atomic>
#include <optional>
#include <sstream>
#include <string>

namespace tandem::log {

enum class Level : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// "error", "warn", "info" or "debug" (also "warning"; any case); nullopt for anything else.
std::optional<Level> parse_level(const std::string& text);
const char* level_name(Level level);

// The level in force. Read from TANDEM_LOG_LEVEL at the first line and again by reload_from_env(); a value that is not
// a level leaves the default (warn) and says so in one warn line.
Level level();
void set_level(Level level);
// Re-reads TANDEM_LOG_LEVEL (rpc::init_rpc calls it when the variable is set, so a level given to a worker's
// environment holds there; set_level() before init_rpc holds otherwise).
void reload_from_env();

// The worker named on every line ("" before rpc::init_rpc; rpc sets it when the worker joins a job).
void set_worker(const std::string& name);

namespace detail {
extern std::atomic<int> g_level;  // -1 until first read from the environment
int load_level();
// One line: collects the text, writes it through glog when destroyed.
class Line {
 public:
  Line(const char* file, int line, Level level, const char* subsystem);
  ~Line();
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  std::ostream& stream() { return text_; }

 private:
  const char* file_;
  int line_;
  Level level_;
  const char* subsystem_;
  std::ostringstream text_;
};
}  // namespace detail

inline bool enabled(Level level) {
  int current = detail::g_level.load(std::memory_order_relaxed);
  if (current < 0) current = detail::load_level();
  return static_cast<int>(level) <= current;
}

}  // namespace tandem::log

// TANDEM_LOG(kError|kWarn|kInfo|kDebug, "subsystem") << ...; the stream is not evaluated when the level is off.
#define TANDEM_LOG(level, subsystem)                          \
  if (!::tandem::log::enabled(::tandem::log::Level::level)) { \
  } else ::tandem::log::detail::Line(__FILE__, __LINE__, ::tandem::log::Level::level, subsystem).stream()
