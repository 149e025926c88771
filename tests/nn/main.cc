// nn_tests: GoogleTest main, the module factories every worker registers, and the worker side of the multi-process
// tests (`nn_tests --worker serve`).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/nn/remote_module.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"
#include "tests/nn/modules.h"

namespace tandem::test {

torch::nn::Sequential make_mlp(int64_t in, int64_t hidden, int64_t out, int64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(in, hidden), torch::nn::Tanh(), torch::nn::Linear(hidden, out));
  m->to(torch::kDouble);
  return m;
}

namespace {

void register_modules() {
  nn::register_module("mlp", make_mlp);
  nn::register_module("scaled_mlp", make_mlp,
                      [](torch::nn::Sequential& m, at::Tensor x, double scale) { return m->forward(x) * scale; });
  nn::register_module("broken", [](int64_t in) -> torch::nn::Linear {
    if (in < 0) throw std::invalid_argument("negative width");
    return torch::nn::Linear(in, in);
  });
}

}  // namespace
}  // namespace tandem::test

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_modules();
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
