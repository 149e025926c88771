// rl_tests: GoogleTest main, and the worker side of the multi-process tests (`rl_tests --worker serve`): every worker
// registers the RL functions and the Observer class.
#include "examples/rl/agent.h"
#include "tests/common/test_env.h"

#include <unistd.h>

#include <thread>

#include "rpc/registry.h"

int main(int argc, char** argv) {
  tandem::examples::rl::register_rl();
  // Kills this worker `ms` milliseconds from now (exit code 9): an observer that dies mid-round.
  tandem::rpc::register_function("rl_test.die_in", [](int64_t ms) {
    std::thread([ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      _exit(9);
    }).detach();
  });
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
