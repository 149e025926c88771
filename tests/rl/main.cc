// rl_tests: GoogleTest main, and the worker side of the multi-process tests (`rl_tests --worker serve`): every worker
// registers the RL functions and the Observer class.
#include "examples/rl/agent.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"

#include <unistd.h>

#include <thread>

#include "tandem/rpc/registry.h"

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::examples::rl::register_rl();
  tandem::test::register_die_in();  // an observer that dies mid-round
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
