// observe_tests: GoogleTest main, and the job the multi-process log and metrics tests start under tandem-run
// (`observe_tests --worker log_traffic`): each of its two workers does a little of everything the debug level shows.
#include <torch/torch.h>

#include <chrono>
#include <stdexcept>
#include <thread>

#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rref/rref.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"

namespace tandem::test {
namespace {

// Calls, an RRef, a distributed backward, a collective and a DDP step between the two workers; then rank 0 sends
// rank 1 a one-way call that fails (logged there as an error: nobody waits for its reply), and rank 1 waits until it
// came. With TANDEM_TEST_PROFILE=<dir>, each worker profiles it all into <dir>/<worker>.json.
void traffic() {
  const char* profile_dir = std::getenv("TANDEM_TEST_PROFILE");
  if (profile_dir) {
    profile::start();
    // Both profiles run before the first call: each trace then holds both ends of every call (a call served before
    // this worker's start is left out of its trace, range and operators).
    comm::wait(comm::ProcessGroup::create("profile_start")->barrier());
  }
  const int me = rpc::get_worker_info().id;
  const int peer = 1 - me;
  (void)rpc::rpc_sync<at::Tensor>(peer, "log_test.scale", at::ones({4}), 2.0);
  (void)rref::remote_as<at::Tensor>(peer, "log_test.make", int64_t{3}).to_here();
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor x = at::ones({4}).requires_grad_();
    at::Tensor y = rpc::rpc_sync<at::Tensor>(peer, "log_test.scale", x, 3.0);
    dist_autograd::backward(ctx.id(), {y.sum()});
  }
  auto group = comm::ProcessGroup::create("log_test");
  comm::wait(group->allreduce(at::ones({16})));
  {
    torch::manual_seed(0);
    auto model = std::make_shared<torch::nn::LinearImpl>(8, 4);
    ddp::DistributedDataParallel ddp(model, comm::ProcessGroup::create("log_test_ddp"));
    ddp.forward(torch::ones({2, 8}) * (me + 1)).sum().backward();
  }
  if (me == 0) {
    rpc::send(peer, "log_test.fail", {});
  } else {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (rpc::transport_stats().oneway_failures == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  comm::wait(group->barrier());
  if (profile_dir) profile::stop(std::string(profile_dir) + "/{worker}.json");
}

int worker(const std::string& scenario) {
  if (scenario != "log_traffic") return 2;
  rpc::register_function("log_test.scale", [](at::Tensor x, double by) { return x * by; });
  rpc::register_function("log_test.make", [](int64_t n) { return at::arange(n); });
  rpc::register_function("log_test.fail", []() -> int64_t { throw std::runtime_error("log_test.fail fails"); });
  return run_worker_job(traffic);
}

}  // namespace
}  // namespace tandem::test

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  return tandem::test::test_main(argc, argv, tandem::test::worker);
}
