// checkpoint_tests: GoogleTest main; `--worker write-forever` is the writer the crash test kills, `--worker serve` a
// rank of the multi-process tests (their scenarios: tests/checkpoint/scenarios.cc).
#include <string>

#include "tests/checkpoint/scenarios.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_scenarios();
  return tandem::test::test_main(argc, argv, [](const std::string& scenario) {
    if (scenario == "write-forever") return tandem::test::write_forever();
    return tandem::test::run_worker_job([] {});
  });
}
