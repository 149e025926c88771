// The Python client (clients/python) against a live job: the test process is rank 0, rank 1 a child, and the Python
// tests (tests/rpc/python/test_client.py, run by Debian's python3) call both, as a program outside the job would.
#include <gtest/gtest.h>

#include <csignal>
#include <map>
#include <string>
#include <vector>

#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

class MultiprocPythonClient : public MultiprocRpc {
 protected:
  // Runs the unittest cases `tests` of test_client.py against this job (its master and secret in the environment).
  void run_python(const std::vector<std::string>& tests, std::map<std::string, std::string> env = {}) {
    env["PYTHONPATH"] = TANDEM_PYTHON_DIR;
    env["TANDEM_CLIENT_MASTER"] = job_master_addr() + ":" + std::to_string(job_->port());
    env["TANDEM_SECRET"] = job_->secret();
    // Debian's python3 with Debian's grpc: not the libraries a sanitizer build puts first (.ci/tsan points
    // LD_LIBRARY_PATH at its ThreadSanitizer-instrumented abseil, which would pull libtsan into Python's grpc module:
    // "cannot allocate memory in static TLS block").
    env["LD_LIBRARY_PATH"] = "";
    std::vector<std::string> argv = {TANDEM_PYTHON, TANDEM_CLIENT_TESTS, "-v"};
    argv.insert(argv.end(), tests.begin(), tests.end());
    Process python(argv, env);
    const int status = python.wait(milliseconds(90000));
    EXPECT_EQ(exit_code(status), 0) << python.output();
  }
};

TEST_F(MultiprocPythonClient, ListsWorkersAndRoundTripsValuesAndTensorsBitExact) {
  start({.world_size = 2});
  run_python({"Workers", "Values", "Tensors", "Concurrency"});
}

TEST_F(MultiprocPythonClient, ErrorsNameWorkerFunctionAndCause) {
  start({.world_size = 2});
  run_python({"Errors"});
}

TEST_F(MultiprocPythonClient, JoinsATlsJobWithItsCertificates) {
  const std::string dir = make_temp_dir();
  if (!make_test_certificates(dir)) GTEST_SKIP() << "openssl cannot make test certificates here";
  rpc::RpcOptions options = options_from_env();
  options.tls = tls_options(dir);
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_TLS_DIR", dir}}}, options);
  run_python({"Tls"}, {{"TANDEM_TEST_TLS_DIR", dir}});
}

TEST_F(MultiprocPythonClient, DeadWorkerOrJobIsAnErrorWithinTheDeadline) {
  rpc::RpcOptions options = options_from_env();
  options.shutdown_timeout = milliseconds(3000);
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_SHUTDOWN_MS", "3000"}}}, options);
  expect_clean_children_ = false;
  job_->child(1).kill(SIGKILL);
  EXPECT_NE(job_->child(1).wait(milliseconds(10000)), -1);
  run_python({"Dead"});
  rpc::shutdown(false);
}

}  // namespace
}  // namespace tandem::test
