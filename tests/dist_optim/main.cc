// dist_optim_tests: GoogleTest main, the functions every worker serves, and the worker side of the multi-process
// tests (`dist_optim_tests --worker serve`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/rref/rref.h"
#include "tandem/sync/sync.h"
#include "tests/common/params.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

std::atomic<bool> g_owner_lock_held{false}, g_owner_lock_release{false};

// The steps on this worker that applied gradients: how many did at once, at most (watch_steps).
struct StepWatch {
  Mutex mu;
  int inside ABSL_GUARDED_BY(mu) = 0;
  int most ABSL_GUARDED_BY(mu) = 0;
  bool met ABSL_GUARDED_BY(mu) = true;  // false: the next step waits for a second one to start (watch_steps)
};
StepWatch& step_watch() {
  static auto* w = new StepWatch;  // never destroyed: a step may run until exit
  return *w;
}

// Each step that applies gradients here is counted while it does and takes 2 ms. The first one waits up to `meet_ms`
// for a second one to start: steps that can overlap (no lock between them) then surely do, and steps that cannot
// cost that wait once.
void watch_steps(int64_t meet_ms) {
  StepWatch& w = step_watch();
  {
    MutexLock lock(&w.mu);
    w.inside = 0;
    w.most = 0;
    w.met = false;
  }
  dist_optim::detail::set_step_probe([&w, meet_ms] {
    {
      MutexLock lock(&w.mu);
      ++w.inside;
      w.most = std::max(w.most, w.inside);
      if (!w.met) {  // (the wait lends this RPC thread's place to the step it waits for: sync/sync.h)
        auto two = [&w]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(w.mu) { return w.inside >= 2; };
        w.mu.AwaitWithTimeout(Condition(&two), absl::Milliseconds(meet_ms));
        w.met = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    MutexLock lock(&w.mu);
    --w.inside;
  });
}

void register_functions() {
  rpc::register_function("layer", [](std::string p, at::Tensor x) { return at::tanh(x.mm(param(p, 4, 4))); });
  rpc::register_function("linear", [](std::string p, at::Tensor x) { return x.mm(param(p, 4, 4)); });
  rpc::register_function("param_ref",
                         [](std::string p) { return rref::make_local(c10::IValue(param(p, 4, 4))).to_ivalue(); });
  rpc::register_function("param_value", [](std::string p) { return param(p, 4, 4).detach().clone(); });
  rpc::register_function("optimizer_count", [] { return dist_optim::owned_optimizer_count(); });
  // Holds the lock locked steps take on this worker until release_owner_lock() (at most `ms` milliseconds);
  // owner_lock_held() says when it is held.
  rpc::register_function("hold_owner_lock", [](int64_t ms) {
    dist_optim::detail::with_owner_lock([ms] {
      g_owner_lock_release = false;
      g_owner_lock_held = true;
      BlockingScope waiting;  // a wait: its RPC thread's place goes to other requests meanwhile
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
      while (!g_owner_lock_release && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      g_owner_lock_held = false;
    });
  });
  rpc::register_function("release_owner_lock", [] { g_owner_lock_release = true; });
  rpc::register_function("watch_steps", watch_steps);
  rpc::register_function("most_steps_at_once", [] {
    StepWatch& w = step_watch();
    MutexLock lock(&w.mu);
    return static_cast<int64_t>(w.most);
  });
  rpc::register_function("owner_lock_held", [] { return g_owner_lock_held.load(); });
  rpc::register_function("slow_param", [](std::string p, int64_t ms) {  // a parameter whose RRef is made slowly
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return param(p, 4, 4);
  });
}

}  // namespace
}  // namespace tandem::test

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_functions();
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
