// comm_tests: GoogleTest main, and the worker side of the multi-process tests (`comm_tests --worker serve`). The
// test process (rank 0) and every worker run the same scenario (tests/comm/scenarios.h), started through RPC.
#include "tests/comm/scenarios.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_scenarios();
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
