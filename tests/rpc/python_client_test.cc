// The Python client (clients/python) against a live job: the test process is rank 0, rank 1 a child, and the Python
// tests (tests/rpc/python/test_client.py, run by Debian's python3) call both, as a program outside the job would.
#include <gtest/gtest.h>

#include <csignal>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

class MultiprocPythonClient : public MultiprocRpc {
 protected:
  // Runs the unittest cases `tests` of test_client.py against this job (its master and secret in the environment).
  void run_python(const std::vector<std::string>& tests, std::map<std::string, std::string> env = {}) {
    std::unique_ptr<Process> python = start_python(tests, std::move(env));
    const int status = python->wait(milliseconds(90000));
    EXPECT_EQ(exit_code(status), 0) << python->output();
  }

  // The same, running: the caller waits for it.
  std::unique_ptr<Process> start_python(const std::vector<std::string>& tests,
                                        std::map<std::string, std::string> env = {}) {
    env["PYTHONPATH"] = TANDEM_PYTHON_DIR;
    env["TANDEM_CLIENT_MASTER"] = job_master_addr() + ":" + std::to_string(job_->port());
    env["TANDEM_SECRET"] = job_->secret();
    // Debian's python3 with Debian's grpc: not the libraries a sanitizer build puts first (.ci/tsan points
    // LD_LIBRARY_PATH at its ThreadSanitizer-instrumented abseil, which would pull libtsan into Python's grpc module:
    // "cannot allocate memory in static TLS block").
    env["LD_LIBRARY_PATH"] = "";
    std::vector<std::string> argv = {TANDEM_PYTHON, TANDEM_CLIENT_TESTS, "-v"};
    argv.insert(argv.end(), tests.begin(), tests.end());
    return std::make_unique<Process>(argv, env);
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
  const TempDir temp;
  const std::string& dir = temp.path();
  if (!make_test_certificates(dir)) GTEST_SKIP() << "openssl cannot make test certificates here";
  rpc::RpcOptions options = options_from_env();
  options.tls = tls_options(dir);
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_TLS_DIR", dir}}}, options);
  run_python({"Tls"}, {{"TANDEM_TEST_TLS_DIR", dir}});
}

// A client's call of a function that gets its worker shut down while it runs (an agent's "stop": the worker's main
// thread waits for it, then calls rpc::shutdown) is answered with the function's result: the graceful shutdown lets
// the calls still running finish first (for at most its grace), where it answered them with CANCELLED.
TEST_F(MultiprocPythonClient, AFunctionRunningWhenItsWorkerShutsDownIsAnswered) {
  start({.world_size = 1});
  const int before = g_stop_soon_calls.load();
  std::unique_ptr<Process> python = start_python({"StopsItsWorker"});
  for (auto until = Clock::now() + std::chrono::seconds(60); g_stop_soon_calls.load() == before;) {
    ASSERT_LT(Clock::now(), until) << "the client never called stop_soon: " << python->output();
    std::this_thread::sleep_for(milliseconds(1));
  }
  rpc::shutdown(true);
  EXPECT_EQ(exit_code(python->wait(milliseconds(90000))), 0) << python->output();
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
