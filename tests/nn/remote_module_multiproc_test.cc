// RemoteModule across real processes: modules built on workers 1 and 2, the trainer is rank 0; forward, distributed
// gradients and optimizer steps must equal the same modules used in one process.
#include <gmock/gmock.h>
#include <torch/torch.h>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/nn/remote_module.h"
#include "tests/common/rpc_fixture.h"
#include "tests/nn/modules.h"

namespace tandem::test {
namespace {

at::Tensor input() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  return at::randn({5, 6}, gen, at::kDouble);
}

bool close(const at::Tensor& a, const at::Tensor& b) { return at::allclose(a, b, 1e-6, 1e-6); }

using MultiprocRemoteModule = MultiprocRpc;

TEST_F(MultiprocRemoteModule, ForwardGradientsAndStepsMatchLocalModules) {
  start({.world_size = 3});
  // A pipeline over two workers: mlp(6->8->4) on worker1, mlp(4->8->2) on worker2, the loss here.
  auto first = nn::RemoteModule::create("worker1", "mlp", int64_t{6}, int64_t{8}, int64_t{4}, int64_t{11});
  auto second = nn::RemoteModule::create("worker2", "mlp", int64_t{4}, int64_t{8}, int64_t{2}, int64_t{12});
  EXPECT_EQ(first.owner_name(), "worker1");
  std::vector<rref::RRef> params = first.remote_parameters();
  for (auto& p : second.remote_parameters()) params.push_back(p);
  ASSERT_EQ(params.size(), 8u);
  dist_optim::DistributedOptimizer opt("sgd", params, {{"lr", 0.05}, {"momentum", 0.9}});

  auto local1 = make_mlp(6, 8, 4, 11), local2 = make_mlp(4, 8, 2, 12);
  std::vector<at::Tensor> local_params = local1->parameters();
  for (auto& p : local2->parameters()) local_params.push_back(p);
  torch::optim::SGD local_opt(local_params, torch::optim::SGDOptions(0.05).momentum(0.9));

  const at::Tensor x = input();
  for (int step = 0; step < 3; ++step) {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = second.forward(first.forward(x));
    at::Tensor loss = y.pow(2).sum();
    local_opt.zero_grad();
    at::Tensor local_y = local2->forward(local1->forward(x));
    EXPECT_TRUE(close(y, local_y)) << "forward, step " << step;
    local_y.pow(2).sum().backward();
    dist_autograd::backward(ctx.id(), {loss});
    opt.step(ctx.id());
    local_opt.step();
  }
  // The parameters on the workers after three steps equal the local ones.
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(close(params[i].to_here<at::Tensor>(), local_params[i])) << "parameter " << i;
  }
}

TEST_F(MultiprocRemoteModule, CustomForwardAndAsyncForward) {
  start({.world_size = 2});
  auto m = nn::RemoteModule::create(1, "scaled_mlp", int64_t{6}, int64_t{3}, int64_t{2}, int64_t{5});
  auto local = make_mlp(6, 3, 2, 5);
  const at::Tensor x = input();
  EXPECT_TRUE(close(m.forward(x, 2.0), local->forward(x) * 2.0));
  EXPECT_TRUE(close(m.forward_async(x, -1.0).get<at::Tensor>(), -local->forward(x)));
}

TEST_F(MultiprocRemoteModule, ErrorsNameTheWorkerAndTheCause) {
  start({.world_size = 2});
  auto unknown = nn::RemoteModule::create("worker1", "nope", int64_t{1});
  try {
    unknown.forward(input());
    FAIL() << "forward on an unknown factory succeeded";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("no module factory named 'nope'"));
    EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
  }
  auto broken = nn::RemoteModule::create("worker1", "broken", int64_t{-1});
  EXPECT_THROW(broken.forward(input()), RpcError);
  auto wrong_args = nn::RemoteModule::create("worker1", "mlp", std::string("six"));
  try {
    wrong_args.remote_parameters();
    FAIL() << "bad factory arguments accepted";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("argument"));
  }
  auto fine = nn::RemoteModule::create("worker1", "mlp", int64_t{6}, int64_t{2}, int64_t{2}, int64_t{1});
  try {
    fine.forward(at::ones({2, 5}, at::kDouble));  // wrong width: the module's own error, the worker stays up
    FAIL() << "shape mismatch accepted";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
  }
  EXPECT_EQ(fine.forward(input()).sizes(), (std::vector<int64_t>{5, 2}));
}

}  // namespace
}  // namespace tandem::test
