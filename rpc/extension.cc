#include "tandem/rpc/extension.h"

#include <algorithm>
#include <atomic>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {
namespace {

struct Extensions {
  Mutex mu;
  std::deque<ValueCodec> codecs ABSL_GUARDED_BY(mu);  // push_back keeps references to earlier codecs valid
  std::vector<std::function<absl::Status(absl::Time)>> shutdown_hooks ABSL_GUARDED_BY(mu);
  std::vector<std::function<void()>> stop_hooks ABSL_GUARDED_BY(mu);
};

std::atomic<CallTracer*> g_tracer{nullptr};

Extensions& extensions() {
  static auto* e = new Extensions;
  return *e;
}

}  // namespace

void register_value_codec(ValueCodec codec) {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  e.codecs.push_back(std::move(codec));
}

void set_call_tracer(CallTracer* tracer) { g_tracer.store(tracer, std::memory_order_release); }

std::function<void()> bind_call_scope(std::function<void()> fn) {
  CallTracer* tracer = g_tracer.load(std::memory_order_acquire);
  std::shared_ptr<void> state = tracer ? tracer->capture() : nullptr;
  if (!state) return fn;
  return [tracer, state = std::move(state), fn = std::move(fn)] {
    std::shared_ptr<void> scope = tracer->enter(state);
    fn();
  };
}

void add_shutdown_hook(std::function<absl::Status(absl::Time)> hook) {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  e.shutdown_hooks.push_back(std::move(hook));
}

void add_stop_hook(std::function<void()> hook) {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  e.stop_hooks.push_back(std::move(hook));
}

Future when_all(const std::vector<Future>& futures) {
  if (futures.empty()) return Future::ready(c10::IValue());
  // Completes when the last input does: by the latest of their deadlines (none when one of them has none).
  absl::Time latest = absl::InfinitePast();
  for (const auto& f : futures) latest = std::max(latest, f.deadline());
  Future all(latest);
  auto left = std::make_shared<std::atomic<size_t>>(futures.size());
  for (const auto& f : futures) {
    f.add_callback([all, left](const Future& done) {
      if (absl::Status s = done.status(); !s.ok()) {
        all.set_error(s);  // the first error wins; later completions are ignored
      } else if (left->fetch_sub(1) == 1) {
        all.set_value(c10::IValue());
      }
    });
  }
  return all;
}

namespace detail {

const ValueCodec* find_codec(const c10::IValue& value) {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  for (const auto& c : e.codecs) {
    if (c.matches(value)) return &c;  // codecs are never removed: the pointer stays valid
  }
  return nullptr;
}

const ValueCodec* find_codec(const std::string& kind) {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  for (const auto& c : e.codecs) {
    if (c.kind == kind) return &c;
  }
  return nullptr;
}

std::vector<std::function<absl::Status(absl::Time)>> shutdown_hooks() {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  return e.shutdown_hooks;
}

CallTracer* call_tracer() { return g_tracer.load(std::memory_order_acquire); }

std::vector<std::function<void()>> stop_hooks() {
  auto& e = extensions();
  MutexLock lock(&e.mu);
  return e.stop_hooks;
}

}  // namespace detail
}  // namespace tandem::rpc
