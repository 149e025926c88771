// A fork server for test workers. Each test binary's main calls start() first: the server is forked there, when the
// program has loaded LibTorch and run every static initialiser but not yet main's body. A Process of `<this binary>
// --worker <scenario>` is then forked by the server instead of exec'ing the binary again, and the child goes on with
// main from that point (main's registrations, then test_main, which runs the worker). That saves each worker the
// program's start-up: about 0.35 s of CPU here (LibTorch's initialisers), about 1 s under ThreadSanitizer; a
// multi-process test starts 2-4 workers.
//
// A spawned worker gets what an exec'd one would: the test process's environment at spawn time plus the Process's
// variables, its output in the Process's log, SIGKILL when the server (and so the test process) dies, and main's
// return value as its exit code. The threads that exist at the top of main are libraries' pools that make themselves
// safe to fork (OpenBLAS stops its pool in a pthread_atfork handler); Tandem starts none before main.
// TANDEM_TEST_EXEC_WORKERS=1 turns the server off: every worker is exec'd.
#pragma once

#include <sys/types.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::test::spawner {

// Starts the server (unless TANDEM_TEST_EXEC_WORKERS=1). Returns in the test process, and in every spawned worker
// (worker_scenario() then says which); the server itself never returns. Call once, first thing in main.
void start();

// In a spawned worker, its scenario; std::nullopt elsewhere.
const std::optional<std::string>& worker_scenario();

// Whether workers are forked by the server (false in the server's own children). Thread-safe.
bool available();

// What spawn() and poll() throw when the server has died (and its workers with it).
struct ServerGone : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Forks a worker running `scenario` with `env` ("K=V" strings, the whole environment) and its stdout and stderr
// written to `log_path`. Returns its pid; throws ServerGone when the server is gone, std::runtime_error when the fork
// fails. Thread-safe.
pid_t spawn(const std::string& scenario, const std::vector<std::string>& env, const std::string& log_path);

// The wait status of worker `pid` once it has exited (reaped by the server: reported once), std::nullopt while it
// runs. Throws ServerGone when the server is gone, std::runtime_error when it has no such child. Thread-safe.
std::optional<int> poll(pid_t pid);

}  // namespace tandem::test::spawner
