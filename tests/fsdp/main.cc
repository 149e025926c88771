// fsdp_tests: GoogleTest main, and the worker side of the multi-process tests (`fsdp_tests --worker serve`): every
// rank runs the same scenario (tests/fsdp/scenarios.cc), started through RPC by the test process (rank 0).
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"
#include "tests/fsdp/scenarios.h"

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_fsdp_scenarios();
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
