// The distributed optimizer across real processes: parameters on workers 1 and 2, the trainer is rank 0. Each step
// must equal the same LibTorch optimizer's step on the same model in one process.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <torch/optim.h>

#include <sstream>
#include <thread>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tests/common/params.h"
#include "tests/common/rpc_fixture.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;

at::Tensor input() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return at::randn({3, 4}, gen, at::kDouble);
}

rref::RRef param_ref(int rank, const std::string& name) {
  return rref::RRef::from_ivalue(rpc::rpc_sync(rank, "param_ref", name));
}

struct Case {
  std::string kind;
  std::map<std::string, double> hyper;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> local;
};

std::vector<Case> cases() {
  using namespace torch::optim;
  return {
      {"sgd",
       {{"lr", 0.1}, {"momentum", 0.9}, {"weight_decay", 0.01}},
       [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.1).momentum(0.9).weight_decay(0.01)); }},
      {"adam",
       {{"lr", 0.01}, {"beta1", 0.8}},
       [](auto p) {
         return std::make_unique<Adam>(p, AdamOptions(0.01).betas({0.8, 0.999}));
       }},
      {"adamw",
       {{"lr", 0.01}, {"weight_decay", 0.05}},
       [](auto p) { return std::make_unique<AdamW>(p, AdamWOptions(0.01).weight_decay(0.05)); }},
      {"adagrad",
       {{"lr", 0.1}, {"lr_decay", 0.01}},
       [](auto p) { return std::make_unique<Adagrad>(p, AdagradOptions(0.1).lr_decay(0.01)); }},
      {"rmsprop",
       {{"lr", 0.01}, {"momentum", 0.5}, {"centered", 1}},
       [](auto p) { return std::make_unique<RMSprop>(p, RMSpropOptions(0.01).momentum(0.5).centered(true)); }},
  };
}

// One step of the model x -> tanh(x p1) -> tanh(. p2) -> squared sum, both through `opt` (p1 on worker1, p2 on
// worker2) and through `local` over the local copies l1, l2.
void step_both(dist_optim::DistributedOptimizer& opt, torch::optim::Optimizer& local, const at::Tensor& x,
               const std::string& p1, const std::string& p2, const at::Tensor& l1, const at::Tensor& l2) {
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor h = rpc::rpc_sync<at::Tensor>("worker1", "layer", p1, x);
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker2", "layer", p2, h);
    dist_autograd::backward(ctx.id(), {y.pow(2).sum()});
    opt.step(ctx.id());
  }
  local.zero_grad();
  at::tanh(at::tanh(x.mm(l1)).mm(l2)).pow(2).sum().backward();
  local.step();
}

using MultiprocDistOptim = MultiprocRpc;

TEST_F(MultiprocDistOptim, EveryKindStepsLikeTheLocalOptimizer) {
  start({.world_size = 3});
  const at::Tensor x = input();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.kind);
    const std::string p1 = "p1_" + c.kind, p2 = "p2_" + c.kind;
    // Two owners: worker1 holds p1, worker2 holds p2; the model is x -> tanh(x p1) -> tanh(. p2) -> squared sum.
    dist_optim::DistributedOptimizer opt(c.kind, {param_ref(1, p1), param_ref(2, p2)}, c.hyper);
    at::Tensor l1 = param(p1, 4, 4).detach().clone().set_requires_grad(true);
    at::Tensor l2 = param(p2, 4, 4).detach().clone().set_requires_grad(true);
    auto local = c.local({l1, l2});
    for (int step = 0; step < 3; ++step) {
      step_both(opt, *local, x, p1, p2, l1, l2);
      at::Tensor r1 = rpc::rpc_sync<at::Tensor>("worker1", "param_value", p1);
      at::Tensor r2 = rpc::rpc_sync<at::Tensor>("worker2", "param_value", p2);
      EXPECT_TRUE(at::allclose(r1, l1, 1e-6, 1e-6)) << "step " << step << "\n" << r1 << "\n" << l1;
      EXPECT_TRUE(at::allclose(r2, l2, 1e-6, 1e-6)) << "step " << step << "\n" << r2 << "\n" << l2;
    }
  }
}

// A checkpoint of the owners' state: an optimizer saved after 2 steps, and a new one over the same parameters that
// loads it, takes the third step as the local optimizer does (without the state, Adam's third step differs).
TEST_F(MultiprocDistOptim, SavedStateResumesOnTheOwners) {
  start({.world_size = 3});
  const at::Tensor x = input();
  const Case c = cases()[1];  // adam
  const std::string p1 = "p1_saved", p2 = "p2_saved";
  at::Tensor l1 = param(p1, 4, 4).detach().clone().set_requires_grad(true);
  at::Tensor l2 = param(p2, 4, 4).detach().clone().set_requires_grad(true);
  auto local = c.local({l1, l2});
  auto step = [&](dist_optim::DistributedOptimizer& opt) { step_both(opt, *local, x, p1, p2, l1, l2); };
  torch::serialize::OutputArchive saved;
  {
    dist_optim::DistributedOptimizer opt(c.kind, {param_ref(1, p1), param_ref(2, p2)}, c.hyper);
    step(opt);
    step(opt);
    opt.save(saved);
  }  // released on the owners
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto count = [](const char* w) { return rpc::rpc_sync<int64_t>(w, "optimizer_count"); };
  while ((count("worker1") != 0 || count("worker2") != 0) && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(count("worker1"), 0) << "the destroyed optimizer's part on worker1 was not released";
  EXPECT_EQ(count("worker2"), 0);
  std::ostringstream bytes;
  saved.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  dist_optim::DistributedOptimizer resumed(c.kind, {param_ref(1, p1), param_ref(2, p2)}, c.hyper);
  resumed.load(in);
  step(resumed);
  EXPECT_TRUE(at::allclose(rpc::rpc_sync<at::Tensor>("worker1", "param_value", p1), l1, 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(rpc::rpc_sync<at::Tensor>("worker2", "param_value", p2), l2, 1e-6, 1e-6));

  // Another set of owners is refused, naming both.
  dist_optim::DistributedOptimizer other(c.kind, {param_ref(1, p1)}, c.hyper);
  torch::serialize::InputArchive again;
  std::istringstream reread(bytes.str());
  again.load_from(reread);
  try {
    other.load(again);
    ADD_FAILURE() << "a state of other owners was loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kFailedPrecondition) << e.what();
  }
}

// Linear loss: the gradient does not depend on the parameter, so concurrent steps must add up exactly.
void concurrent_trainers(bool hogwild, const std::string& name, int trainers, int steps) {
  const at::Tensor x = input();
  const at::Tensor before = rpc::rpc_sync<at::Tensor>("worker1", "param_value", name);
  // The first step waits for a second one: hogwild steps meet (at most 10 s), locked ones cannot (0.3 s, once).
  rpc::rpc_sync("worker1", "watch_steps", scaled(milliseconds(hogwild ? 10000 : 300)).count());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < trainers; ++t) {
    threads.emplace_back([&] {
      try {
        dist_optim::DistributedOptimizer opt("sgd", {param_ref(1, name)}, {{"lr", 0.01}}, {.hogwild = hogwild});
        for (int s = 0; s < steps; ++s) {
          dist_autograd::ContextGuard ctx;
          at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "linear", name, x);
          dist_autograd::backward(ctx.id(), {y.sum()});
          opt.step(ctx.id());
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures, 0);
  const at::Tensor after = rpc::rpc_sync<at::Tensor>("worker1", "param_value", name);
  const at::Tensor grad = x.t().mm(at::ones({3, 4}, at::kDouble));
  const at::Tensor want = before - 0.01 * trainers * steps * grad;
  // Without the owner lock, a second trainer's step starts while the first waits (SGD's in-place updates are too short
  // to lose one reliably: the count, not the sum, shows a missing lock).
  const auto most = rpc::rpc_sync<int64_t>("worker1", "most_steps_at_once");
  if (hogwild) {
    EXPECT_FALSE(at::allclose(after, before)) << "hogwild steps changed nothing";
    EXPECT_GE(most, 2) << "hogwild steps never ran at once";
  } else {
    EXPECT_TRUE(at::allclose(after, want, 1e-9, 1e-9)) << "locked steps were lost\n" << after << "\n" << want;
    EXPECT_EQ(most, 1) << "locked steps ran at once";
  }
}

TEST_F(MultiprocDistOptim, ConcurrentTrainersWithTheOwnerLockLoseNoUpdate) {
  start({.world_size = 2});
  concurrent_trainers(false, "locked", 4, 25);
}

TEST_F(MultiprocDistOptim, HogwildTrainersRunWithoutTheLock) {
  start({.world_size = 2});
  concurrent_trainers(true, "hogwild", 4, 25);
}

// A context whose backward gave `name` (on worker1) a gradient.
std::unique_ptr<dist_autograd::ContextGuard> context_with_gradient(const std::string& name) {
  auto ctx = std::make_unique<dist_autograd::ContextGuard>();
  at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "linear", name, input());
  dist_autograd::backward(ctx->id(), {y.sum()});
  return ctx;
}

// While the owner lock is held on worker1, a hogwild step there completes and a locked one waits for the lock.
TEST_F(MultiprocDistOptim, HogwildStepsDoNotWaitForTheOwnerLockThatLockedStepsTake) {
  start({.world_size = 2});
  dist_optim::DistributedOptimizer hogwild("sgd", {param_ref(1, "h_free")}, {{"lr", 0.01}}, {.hogwild = true});
  dist_optim::DistributedOptimizer locked("sgd", {param_ref(1, "h_locked")}, {{"lr", 0.01}});
  const at::Tensor free_before = rpc::rpc_sync<at::Tensor>("worker1", "param_value", "h_free");
  const at::Tensor locked_before = rpc::rpc_sync<at::Tensor>("worker1", "param_value", "h_locked");
  auto free_ctx = context_with_gradient("h_free");
  auto locked_ctx = context_with_gradient("h_locked");
  // Held until released below (a bound for the test, not the point).
  const milliseconds most = scaled(milliseconds(30000));
  rpc::Future hold = rpc::rpc_async("worker1", "hold_owner_lock", most.count(), most + scaled(milliseconds(10000)));
  ASSERT_TRUE(poll_until(scaled(milliseconds(5000)), [] { return rpc::rpc_sync<bool>("worker1", "owner_lock_held"); }));
  rpc::Future locked_step = locked.step_async(locked_ctx->id());
  EXPECT_TRUE(hogwild.step_async(free_ctx->id()).status().ok());
  EXPECT_TRUE(rpc::rpc_sync<bool>("worker1", "owner_lock_held")) << "the hogwild step waited for the lock";
  EXPECT_FALSE(locked_step.completed()) << "the locked step did not wait for the lock";
  EXPECT_FALSE(rpc::rpc_sync<at::Tensor>("worker1", "param_value", "h_free").equal(free_before));
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "param_value", "h_locked").equal(locked_before));
  rpc::rpc_sync("worker1", "release_owner_lock");
  EXPECT_TRUE(locked_step.status().ok()) << locked_step.status();
  EXPECT_FALSE(rpc::rpc_sync<bool>("worker1", "owner_lock_held"));
  EXPECT_FALSE(rpc::rpc_sync<at::Tensor>("worker1", "param_value", "h_locked").equal(locked_before));
  EXPECT_TRUE(hold.status().ok()) << hold.status();
}

TEST_F(MultiprocDistOptim, AContextWithoutGradientsHereChangesNothing) {
  start({.world_size = 3});
  dist_optim::DistributedOptimizer opt("sgd", {param_ref(1, "n1"), param_ref(2, "n2")}, {{"lr", 1.0}});
  const at::Tensor before1 = rpc::rpc_sync<at::Tensor>("worker1", "param_value", "n1");
  const at::Tensor before2 = rpc::rpc_sync<at::Tensor>("worker2", "param_value", "n2");
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "layer", "n1", input());  // worker2 is not involved
    dist_autograd::backward(ctx.id(), {y.sum()});
    opt.step(ctx.id());
  }
  EXPECT_FALSE(rpc::rpc_sync<at::Tensor>("worker1", "param_value", "n1").equal(before1));
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker2", "param_value", "n2").equal(before2));
}

TEST_F(MultiprocDistOptim, BadKindsAndHyperParametersNameTheOwner) {
  start({.world_size = 2});
  try {
    dist_optim::DistributedOptimizer opt("lbfgs", {param_ref(1, "b1")});
    FAIL() << "created";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("unknown optimizer 'lbfgs'"));
    EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
  }
  try {
    dist_optim::DistributedOptimizer opt("sgd", {param_ref(1, "b1")}, {{"betas", 0.9}});
    FAIL() << "created";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("has no hyper-parameter betas"));
  }
}

// A creation that times out on the caller while an owner still waits for its parameter's value (an RRef being made)
// leaves no optimizer there: the owner refuses to register it past the caller's timeout, and the caller releases the
// id on every owner it asked. Before, the owner registered it once the value came, for nobody, until RPC stopped.
TEST_F(MultiprocDistOptim, ACreationThatTimesOutLeavesNoOptimizerOnAnyOwner) {
  start({.world_size = 3});
  rref::RRef slow =
      rref::remote(1, "slow_param", std::string("t1"), static_cast<int64_t>(scaled(milliseconds(1500)).count()));
  rref::RRef quick = param_ref(2, "t2");
  dist_optim::DistributedOptimizerOptions options;
  options.timeout = milliseconds(300);
  try {
    dist_optim::DistributedOptimizer opt("sgd", {slow, quick}, {{"lr", 0.1}}, options);
    FAIL() << "created";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kDeadlineExceeded) << e.what();
    EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
  }
  (void)slow.to_here();  // the value is made: worker1's creation goes on from its wait now, to its refusal
  // worker2 created its optimizer at once and is told to release it; worker1 refuses its own (checked again below:
  // a new optimizer there makes 1, not 2).
  EXPECT_TRUE(poll_until(scaled(milliseconds(5000)), [] {
    return rpc::rpc_sync<int64_t>("worker1", "optimizer_count") == 0 &&
           rpc::rpc_sync<int64_t>("worker2", "optimizer_count") == 0;
  }));
  std::this_thread::sleep_for(milliseconds(200));
  // The refusal does not stay: a new optimizer over the same parameter is made and steps.
  dist_optim::DistributedOptimizer opt("sgd", {slow, quick}, {{"lr", 0.1}});
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "optimizer_count"), 1);
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker2", "optimizer_count"), 1);
}

}  // namespace
}  // namespace tandem::test
