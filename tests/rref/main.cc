// rref_tests: GoogleTest main, and the worker side of the RRef multi-process tests (`rref_tests --worker serve`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <mutex>

#include "tandem/rref/rref.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"
#include "tests/rref/rref_test_functions.h"

namespace tandem::test {
namespace {

int run_worker(const std::string&) {
  return run_worker_job([] {});  // serves until every worker shuts down
}

}  // namespace
}  // namespace tandem::test

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_rref_test_functions();
  return tandem::test::test_main(argc, argv, tandem::test::run_worker);
}
