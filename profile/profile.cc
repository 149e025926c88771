#include "tandem/profile/profile.h"

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::profile {
namespace detail {
std::atomic<bool> g_active{false};
}  // namespace detail

namespace {

namespace tp = torch::profiler::impl;
namespace ap = torch::autograd::profiler;

// What other threads install to record into the profile: the starting thread's debug info (which holds the profiler's
// state) and its RecordFunction callbacks. Written by start() before g_active is set, read after seeing it set.
struct Captured {
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
  at::RecordFunctionTLS callbacks;
  std::thread::id owner;
};
Captured g_captured;
std::atomic<int64_t> g_inside{0};  // OnThisThread objects alive that count
// When the running profile started, in steady-clock ticks: set after g_active, and the largest value until then, so
// that a range that began before the start is never taken (an OnThisThread then did not record its operators).
std::atomic<int64_t> g_since{std::numeric_limits<int64_t>::max()};

Mutex g_mu;  // start/stop, and the worker's name
std::string g_worker ABSL_GUARDED_BY(g_mu) = "worker";
int g_rank ABSL_GUARDED_BY(g_mu) = 0;
bool g_started ABSL_GUARDED_BY(g_mu) = false;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

}  // namespace

struct OnThisThread::Saved {
  at::RecordFunctionTLS callbacks;
  std::optional<c10::DebugInfoGuard> debug_info;
};

OnThisThread::OnThisThread() {
  if (!active()) return;
  g_inside.fetch_add(1);  // sequentially consistent with stop(): it sees us inside, or we see it inactive
  if (!active()) {
    g_inside.fetch_sub(1);
    return;
  }
  counted_ = true;
  if (std::this_thread::get_id() == g_captured.owner) return;  // the profiler's own thread records already
  saved_ = std::make_unique<Saved>();
  saved_->callbacks = at::get_record_function_tls_();
  at::set_record_function_tls_(g_captured.callbacks);
  saved_->debug_info.emplace(g_captured.debug_info);
}

OnThisThread::~OnThisThread() {
  if (saved_) {
    saved_->debug_info.reset();
    at::set_record_function_tls_(saved_->callbacks);
  }
  if (counted_) g_inside.fetch_sub(1);
}

void report_steady(const std::string& name, std::chrono::steady_clock::time_point start,
                   std::chrono::steady_clock::time_point end) {
  OnThisThread here;
  if (!here.recording() || start.time_since_epoch().count() < g_since.load()) return;
  const auto offset = std::chrono::system_clock::now().time_since_epoch() -
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          std::chrono::steady_clock::now().time_since_epoch());
  auto epoch_us = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::duration_cast<std::chrono::system_clock::duration>(t.time_since_epoch()) + offset)
        .count();
  };
  ap::reportBackendEventToActiveKinetoProfiler(epoch_us(start), epoch_us(end), -1, at::RecordScope::USER_SCOPE, name,
                                               "tandem");
}

void set_worker(const std::string& name, int rank) {
  MutexLock lock(&g_mu);
  g_worker = name;
  g_rank = rank;
}

void start() {
  MutexLock lock(&g_mu);
  if (g_started) throw RpcError(absl::FailedPreconditionError("profile::start: a profile is running already"));
  const tp::ProfilerConfig config(tp::ProfilerState::KINETO);
  ap::enableProfiler(config, {tp::ActivityType::CPU});
  g_captured.debug_info = c10::ThreadLocalDebugInfo::current();
  g_captured.callbacks = at::get_record_function_tls_();
  g_captured.owner = std::this_thread::get_id();
  g_started = true;
  g_since.store(std::numeric_limits<int64_t>::max());
  detail::g_active.store(true);
  g_since.store(std::chrono::steady_clock::now().time_since_epoch().count());
}

int64_t stop(const std::string& pattern, std::chrono::milliseconds wait) {
  std::string worker;
  int rank = 0;
  {
    MutexLock lock(&g_mu);
    if (!g_started) throw RpcError(absl::FailedPreconditionError("profile::stop: no profile is running"));
    if (std::this_thread::get_id() != g_captured.owner) {
      throw RpcError(absl::FailedPreconditionError("profile::stop: call it on the thread that called start()"));
    }
    worker = g_worker;
    rank = g_rank;
  }
  detail::g_active.store(false);
  const auto until = std::chrono::steady_clock::now() + wait;
  while (g_inside.load() > 0) {
    if (std::chrono::steady_clock::now() > until) {
      const int64_t left = g_inside.load();
      detail::g_active.store(true);
      throw RpcError(absl::DeadlineExceededError(
          absl::StrCat("profile::stop: ", left, " of Tandem's threads still work inside the profile after ",
                       wait.count(), " ms; it goes on (call stop() again)")));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::unique_ptr<ap::ProfilerResult> result = ap::disableProfiler();
  {
    MutexLock lock(&g_mu);
    g_started = false;
    g_captured = Captured{};
  }
  const std::string path = absl::StrReplaceAll(pattern, {{"{worker}", worker}, {"{rank}", std::to_string(rank)}});
  std::ofstream out(path, std::ios::trunc);
  out << "{\"traceEvents\":[\n";
  out << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << rank
      << ",\"tid\":0,\"args\":{\"name\":" << json_string(worker) << "}}";
  int64_t n = 0;
  for (const auto& e : result->events()) {
    const std::string backend = e.backend();
    out << ",\n{\"ph\":\"X\",\"cat\":" << json_string(backend.empty() ? "cpu_op" : backend)
        << ",\"name\":" << json_string(e.name()) << ",\"pid\":" << rank << ",\"tid\":" << e.startThreadId()
        << ",\"ts\":" << e.startUs() << ",\"dur\":" << e.durationUs() << "}";
    ++n;
  }
  out << "\n]}\n";
  if (!out.flush()) throw RpcError(absl::UnavailableError(absl::StrCat("profile::stop: cannot write ", path)));
  return n;
}

}  // namespace tandem::profile
