// Helpers for multi-process tests: worker processes are this same test binary started in worker mode
// (`<binary> --worker <scenario>`), on 127.0.0.1, with ports chosen at run time. Every wait is bounded; a child still
// running when its Process is destroyed is killed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/common/time_scale.h"

namespace tandem::test {

// A port for a job's master to listen on (rpc::net::pick_listen_port: below the ephemeral range, free on every local
// address). Throws when none is found.
int free_port();

// Test hosts (scripts/hosts.sh, tests/hosts/): when the test process runs in host 0 of a set of network namespaces,
// TANDEM_TEST_HOSTS is "NAME:COUNT", and a Job starts its child of rank r in host r % COUNT, through one tandem-run
// per child (TANDEM_TEST_LAUNCHER; --nnodes WORLD --node-rank r --master-addr MASTER), so every call between ranks
// crosses a TCP/IP link. TANDEM_TEST_MASTER_ADDR is host 0's address. Without them: everything on 127.0.0.1.
struct TestHosts {
  std::string name;
  int count = 0;  // 0: not on test hosts
  std::string launcher;
  std::string master_addr = "127.0.0.1";
  std::string script;       // scripts/hosts.sh (TANDEM_TEST_HOSTS_SCRIPT), for faults
  std::string delay_relay;  // build/delay_relay (TANDEM_TEST_DELAY_RELAY), for added delay
};
const TestHosts& test_hosts();
// Applies a fault to test host `host`: `scripts/hosts.sh OP NAME HOST [ARG]` with OP cut, heal, blackhole, kill,
// rate (ARG: a tc rate such as 200mbit, or off) or delay (ARG: "US RELAY [J]", or off); ARG's words are separated by
// spaces. Throws std::runtime_error when not on test hosts or when it fails.
void host_fault(const std::string& op, int host, const std::string& arg = "");
// The address rank 0 serves the job's store on: 127.0.0.1, or host 0's address on test hosts.
inline const std::string& job_master_addr() { return test_hosts().master_addr; }
std::string self_exe();
// A fresh private directory under TMPDIR, removed by the caller if at all.
std::string make_temp_dir();
// A fresh private directory under TMPDIR (make_temp_dir()), removed with all it holds when this goes, also when an
// assertion ends the test early.
class TempDir {
 public:
  TempDir() : path_(make_temp_dir()) {}
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class Process {
 public:
  // Starts `argv` with the current environment plus `env`; stdout and stderr go to a temporary file, removed (with
  // its directory) by the destructor, after it killed and reaped the process if it had not exited. `argv` of this
  // binary in worker mode ({self_exe(), "--worker", scenario}) is forked by the fork server when there is one
  // (spawner.h): the same process, without the program's start-up.
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Waits up to scaled(`timeout`) (time_scale.h) for the exit. Returns the wait status, or -1 (after SIGKILL) when it
  // did not exit in time.
  int wait(std::chrono::milliseconds timeout);
  // The same with a deadline (not scaled).
  int wait_until(std::chrono::steady_clock::time_point deadline);
  void kill(int sig);
  pid_t pid() const { return pid_; }
  std::string output() const;

 private:
  // Reaps the child if it has exited (waits for that when `block`); true once reaped.
  bool reap(bool block);

  pid_t pid_ = -1;
  bool spawned_ = false;  // by the fork server, which reaps it
  bool reaped_ = false;
  int status_ = 0;
  TempDir log_dir_;  // removed, with the log, after the destructor killed and reaped the process
  std::string log_path_ = log_dir_.path() + "/output.log";
};

// Exit code of a wait status, or 128+signal, or -1 for "did not exit".
int exit_code(int status);

// A job of `world_size` ranks for one test: rank 0 is the test process itself, ranks 1.. are children running
// `scenario` (default "serve": init_rpc from the torchrun environment, serve, graceful shutdown).
struct JobSpec {
  int world_size = 2;
  std::string scenario = "serve";
  std::map<std::string, std::string> extra_env;  // for every child
};

class Job {
 public:
  explicit Job(const JobSpec& spec);
  // Env of rank r (torchrun variables and the secret).
  std::map<std::string, std::string> env_for(int rank) const;
  int port() const { return port_; }
  const std::string& secret() const { return secret_; }
  Process& child(int rank) { return *children_.at(rank - 1); }
  // Waits up to scaled(`timeout`) in all for every child; returns their exit codes (index 0 is rank 1).
  std::vector<int> wait_children(std::chrono::milliseconds timeout);
  std::string outputs() const;

 private:
  JobSpec spec_;
  int port_;
  std::string secret_;
  std::vector<std::unique_ptr<Process>> children_;
};

}  // namespace tandem::test
