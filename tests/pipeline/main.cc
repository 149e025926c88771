// pipeline_tests: GoogleTest main, the modules and test functions every worker registers, and the worker side of the
// multi-process tests (`pipeline_tests --worker serve`).
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"
#include "tests/pipeline/stages.h"

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_pipeline_stages();
  return tandem::test::test_main(argc, argv, [](const std::string&) { return tandem::test::run_worker_job([] {}); });
}
