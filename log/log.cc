#include "tandem/log/log.h"

#include <glog/logging.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>

namespace tandem::log {
namespace detail {

std::atomic<int> g_level{-1};

namespace {

constexpr Level kDefault = Level::kWarn;

// The worker's name: set rarely (once per init_rpc), read on every line; a name once published is never freed, so a
// line may print the one it loaded while another is set.
std::atomic<const std::string*> g_worker{nullptr};

std::once_flag g_glog_once;

// glog writes to files under /tmp unless told otherwise, and warns once when used before InitGoogleLogging: when the
// program has not set glog up, Tandem does, to stderr.
void ensure_glog() {
  std::call_once(g_glog_once, [] {
    if (google::IsGoogleLoggingInitialized()) return;
    static std::string program = [] {
      std::ifstream comm("/proc/self/comm");
      std::string name;
      std::getline(comm, name);
      return name.empty() ? std::string("tandem") : name;
    }();
    FLAGS_logtostderr = true;
    google::InitGoogleLogging(program.c_str());
  });
}

}  // namespace

int load_level() {
  const char* env = std::getenv("TANDEM_LOG_LEVEL");
  Level chosen = kDefault;
  bool bad = false;
  if (env && *env) {
    if (auto parsed = parse_level(env)) {
      chosen = *parsed;
    } else {
      bad = true;
    }
  }
  g_level.store(static_cast<int>(chosen), std::memory_order_relaxed);
  if (bad) {
    TANDEM_LOG(kWarn, "log") << "TANDEM_LOG_LEVEL='" << env << "' is not one of error, warn, info, debug; using "
                             << level_name(chosen);
  }
  return static_cast<int>(chosen);
}

Line::Line(const char* file, int line, Level level, const char* subsystem)
    : file_(file), line_(line), level_(level), subsystem_(subsystem) {}

Line::~Line() {
  ensure_glog();
  const char* slash = std::strrchr(file_, '/');
  const char* base = slash ? slash + 1 : file_;
  const google::LogSeverity severity = level_ == Level::kError  ? google::GLOG_ERROR
                                       : level_ == Level::kWarn ? google::GLOG_WARNING
                                                                : google::GLOG_INFO;
  const std::string* worker = g_worker.load(std::memory_order_acquire);
  google::LogMessage message(base, line_, severity);
  message.stream() << "[tandem " << (worker && !worker->empty() ? *worker : std::string("-")) << " " << subsystem_
                   << (level_ == Level::kDebug ? " debug" : "") << "] " << text_.str();
}

}  // namespace detail

std::optional<Level> parse_level(const std::string& text) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "error") return Level::kError;
  if (t == "warn" || t == "warning") return Level::kWarn;
  if (t == "info") return Level::kInfo;
  if (t == "debug") return Level::kDebug;
  return std::nullopt;
}

const char* level_name(Level level) {
  switch (level) {
    case Level::kError:
      return "error";
    case Level::kWarn:
      return "warn";
    case Level::kInfo:
      return "info";
    case Level::kDebug:
      return "debug";
  }
  return "?";
}

Level level() {
  int current = detail::g_level.load(std::memory_order_relaxed);
  return static_cast<Level>(current < 0 ? detail::load_level() : current);
}

void set_level(Level level) { detail::g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void reload_from_env() { detail::load_level(); }

void set_worker(const std::string& name) {
  // Every name published stays reachable here and is never freed (see g_worker); a name set again is not copied again.
  static std::mutex mu;
  static auto* names = new std::set<std::string>;
  std::lock_guard<std::mutex> lock(mu);
  detail::g_worker.store(&*names->insert(name).first, std::memory_order_release);
}

}  // namespace tandem::log
