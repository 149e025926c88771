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

namespace tandem::test {

// A free TCP port on 127.0.0.1 (bound, read, released).
int free_port();
std::string self_exe();
// A fresh private directory under TMPDIR, removed by the caller if at all.
std::string make_temp_dir();

class Process {
 public:
  // Starts `argv` with the current environment plus `env`; stdout and stderr go to a temporary file.
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Waits up to `timeout` for the exit. Returns the wait status, or -1 (after SIGKILL) when it did not exit in time.
  int wait(std::chrono::milliseconds timeout);
  void kill(int sig);
  pid_t pid() const { return pid_; }
  std::string output() const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string log_path_;
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
  // Waits for every child; returns their exit codes (index 0 is rank 1).
  std::vector<int> wait_children(std::chrono::milliseconds timeout);
  std::string outputs() const;

 private:
  JobSpec spec_;
  int port_;
  std::string secret_;
  std::vector<std::unique_ptr<Process>> children_;
};

}  // namespace tandem::test
