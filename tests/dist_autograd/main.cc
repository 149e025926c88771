// dist_autograd_tests: GoogleTest main, the functions every worker serves, and the worker side of the multi-process
// tests (`dist_autograd_tests --worker serve`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/rref/rref.h"
#include "tandem/sync/sync.h"
#include "tests/common/params.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"

namespace tandem::test {

namespace {

// A backward function that fails (or kills its process) when the gradient reaches it.
struct FailingBackward : torch::autograd::Node {
  explicit FailingBackward(bool die) : die_(die) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    if (die_) _exit(7);
    throw std::runtime_error("boom in a remote backward");
  }
  bool die_;
};

// y = x, with `node` as y's backward function.
at::Tensor with_backward(const at::Tensor& x, std::shared_ptr<torch::autograd::Node> node) {
  at::Tensor y = x.detach().clone();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(y, std::move(node));
  return y;
}

at::Tensor through(const at::Tensor& x, bool die) { return with_backward(x, std::make_shared<FailingBackward>(die)); }

// A backward function that takes `ms` before it passes the gradient on: a fault can strike while it runs.
struct SlowBackward : torch::autograd::Node {
  explicit SlowBackward(int64_t ms) : ms_(ms) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    return std::move(grads);
  }
  int64_t ms_;
};

at::Tensor slowly(const at::Tensor& x, int64_t ms) { return with_backward(x, std::make_shared<SlowBackward>(ms)); }

// The backward-part hook of this worker in the tests: "hold" records each context (negated when parameter "k1" had no
// gradient in it yet) and holds the reply until "release_hook"; "throw" throws; "none" removes the hook.
Mutex g_hook_mu;
std::vector<int64_t> g_hooked ABSL_GUARDED_BY(g_hook_mu);
std::vector<rpc::Future> g_held ABSL_GUARDED_BY(g_hook_mu);

void set_test_hook(const std::string& mode) {
  if (mode == "none") return dist_autograd::set_backward_part_hook(nullptr);
  if (mode == "throw") {
    return dist_autograd::set_backward_part_hook(
        [](const dist_autograd::BackwardPart&) -> rpc::Future { throw std::runtime_error("hook refused"); });
  }
  dist_autograd::set_backward_part_hook([](const dist_autograd::BackwardPart& part) {
    const int64_t ctx = part.context_id;
    // The sender is a worker of the job, and its call times out later than now (the pass's timeout, not 0).
    if (part.from < 0 || part.from >= static_cast<int>(rpc::get_all_worker_infos().size()) ||
        part.deadline <= absl::Now() || part.deadline == absl::InfiniteFuture()) {
      throw std::runtime_error("hook told a wrong sender or deadline");
    }
    const bool has = dist_autograd::get_gradients(ctx)[param("k1", 4, 4)].defined();
    rpc::Future held;
    MutexLock lock(&g_hook_mu);
    g_hooked.push_back(has ? ctx : -ctx);
    g_held.push_back(held);
    return held;
  });
}

void register_functions() {
  rpc::register_function("set_hook", set_test_hook);
  rpc::register_function("hooked", [] {
    MutexLock lock(&g_hook_mu);
    return g_hooked;
  });
  rpc::register_function("release_hook", [](bool ok) {
    std::vector<rpc::Future> held;
    {
      MutexLock lock(&g_hook_mu);
      held.swap(g_held);
    }
    for (auto& f : held) ok ? f.set_value(c10::IValue()) : f.set_error(absl::AbortedError("the round was refused"));
  });
  rpc::register_function("layer", [](std::string p, at::Tensor x) { return at::tanh(x.mm(param(p, 4, 4))); });
  // A -> B -> C: this worker's layer, then `next`'s, then a local scale.
  rpc::register_function("nested", [](std::string next, std::string p, std::string q, at::Tensor x) {
    at::Tensor h = at::tanh(x.mm(param(p, 4, 4)));
    return rpc::rpc_sync<at::Tensor>(next, "layer", q, h) * 2;
  });
  // "nested", the next worker's layer with a backward that spends `ms` there.
  rpc::register_function("nested_slow", [](std::string next, std::string p, std::string q, int64_t ms, at::Tensor x) {
    at::Tensor h = at::tanh(x.mm(param(p, 4, 4)));
    return rpc::rpc_sync<at::Tensor>(next, "slow_backward_layer", q, ms, h) * 2;
  });
  // A parameter sent by the caller, used here with a local one.
  rpc::register_function(
      "mix", [](std::string p, at::Tensor x, at::Tensor w) { return at::sigmoid(x.mm(w) + x.mm(param(p, 4, 4))); });
  rpc::register_function("grad_of", [](int64_t ctx, std::string p) {
    at::Tensor g = dist_autograd::get_gradients(ctx)[param(p, 4, 4)];
    return std::make_tuple(g.defined(), g.defined() ? g : at::zeros({4, 4}, at::kDouble));
  });
  rpc::register_function("fails_in_backward", [](at::Tensor x) { return through(x.mm(param("pf", 4, 4)), false); });
  rpc::register_function("dies_in_backward", [](at::Tensor x) { return through(x.mm(param("pd", 4, 4)), true); });
  // "layer" whose backward spends `ms` on this worker.
  rpc::register_function("slow_backward_layer", [](std::string p, int64_t ms, at::Tensor x) {
    return slowly(at::tanh(x.mm(param(p, 4, 4))), ms);
  });
  rpc::register_function("contexts", [] { return dist_autograd::stats().contexts; });
  rpc::register_function("release_messages_sent", [] { return dist_autograd::stats().release_messages_sent; });
  // Makes a context here that reaches `via` and, from it, `then` ("nested"), releases it and returns how long the
  // release took in ms (until every worker it reached released it).
  rpc::register_function("nested_then_release", [](std::string via, std::string then) {
    dist_autograd::ContextGuard ctx;
    rpc::rpc_sync<at::Tensor>(via, "nested", then, std::string("n1"), std::string("n2"), at::ones({3, 4}, at::kDouble));
    const auto start = std::chrono::steady_clock::now();
    rpc::Future released = dist_autograd::release_context(ctx.id());
    if (!released.wait_for(std::chrono::seconds(60))) throw std::runtime_error("the release took more than 60 s");
    if (!released.status().ok()) throw RpcError(released.status());
    return static_cast<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count());
  });
  // "layer", once every context on this worker has been released (the caller's guard ended while this call ran).
  // Throws if the call's context was not here when it started (the test would prove nothing) or is never released.
  // "after_release_started": how many such calls found their context here and now wait for its release (the caller
  // ends its guard only then: a release that came before the call ran would leave nothing to test).
  static std::atomic<int64_t> after_release_started{0};
  rpc::register_function("after_release_started", [] { return after_release_started.load(); });
  rpc::register_function("layer_after_release", [](std::string p, at::Tensor x) {
    if (dist_autograd::stats().contexts == 0) throw std::runtime_error("the call's context is not on this worker");
    ++after_release_started;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (dist_autograd::stats().contexts != 0) {
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("the context was not released");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return at::tanh(x.mm(param(p, 4, 4)));
  });
  // Adopts the call's context, then adds ones to parameter `p`'s gradient in it from a thread that serves no call (as
  // a pipeline stage's thread does); that thread's own adopt_current_context fails. Returns the error code it got.
  rpc::register_function("adopt_and_add", [](std::string p) {
    const int64_t ctx = dist_autograd::adopt_current_context();
    int64_t code = 0;
    std::thread([&] {
      dist_autograd::add_gradient(ctx, param(p, 4, 4), at::ones({4, 4}, at::kDouble));
      try {
        dist_autograd::adopt_current_context();
      } catch (const RpcError& e) {
        code = static_cast<int64_t>(e.status().code());
      }
    }).join();
    return code;
  });
}

}  // namespace
}  // namespace tandem::test

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_functions();
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
