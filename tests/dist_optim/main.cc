// dist_optim_tests: GoogleTest main, the functions every worker serves, and the worker side of the multi-process
// tests (`dist_optim_tests --worker serve`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

namespace tandem::test {
namespace {

std::atomic<bool> g_owner_lock_held{false}, g_owner_lock_release{false};

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
