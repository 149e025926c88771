// dist_optim_tests: GoogleTest main, the functions every worker serves, and the worker side of the multi-process
// tests (`dist_optim_tests --worker serve`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/rref/rref.h"
#include "tests/common/params.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"

namespace tandem::test {
namespace {

void register_functions() {
  rpc::register_function("layer", [](std::string p, at::Tensor x) { return at::tanh(x.mm(param(p, 4, 4))); });
  rpc::register_function("linear", [](std::string p, at::Tensor x) { return x.mm(param(p, 4, 4)); });
  rpc::register_function("param_ref",
                         [](std::string p) { return rref::make_local(c10::IValue(param(p, 4, 4))).to_ivalue(); });
  rpc::register_function("param_value", [](std::string p) { return param(p, 4, 4).detach().clone(); });
  rpc::register_function("optimizer_count", [] { return dist_optim::owned_optimizer_count(); });
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
