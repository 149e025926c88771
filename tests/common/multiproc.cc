#include "tests/common/multiproc.h"

#include "tandem/rpc/detail/net.h"
#include "tests/common/spawner.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace tandem::test {

int free_port() {
  auto port = rpc::net::pick_listen_port();
  if (!port.ok()) throw std::runtime_error(port.status().ToString());
  return *port;
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  return std::string(buf, n);
}

std::string make_temp_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/tandem-test-XXXXXX";
  if (!mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;  // a test's leftovers are not its failure
  std::filesystem::remove_all(path_, ignored);
}

Process::Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  // This binary in worker mode: forked by the fork server when there is one (spawner.h), with the same environment
  // an exec'd child would get.
  if (argv.size() == 3 && argv[1] == "--worker" && spawner::available() && argv[0] == self_exe()) {
    std::map<std::string, std::string> all;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      const auto eq = kv.find('=');
      if (eq != std::string::npos) all[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : env) all[k] = v;
    std::vector<std::string> flat;
    for (const auto& [k, v] : all) flat.push_back(k + "=" + v);
    pid_ = spawner::spawn(argv[2], flat, log_path_);
    spawned_ = true;
    return;
  }
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a crashed test never leaves workers behind
    if (getppid() != parent) _exit(1);
    int fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
}

Process::~Process() {
  if (!reaped_) {
    ::kill(pid_, SIGKILL);
    (void)reap(true);
  }
}

bool Process::reap(bool block) {
  if (!spawned_) {
    if (waitpid(pid_, &status_, block ? 0 : WNOHANG) != pid_) return false;
    reaped_ = true;
    return true;
  }
  for (;;) {
    try {
      if (auto status = spawner::poll(pid_)) {
        status_ = *status;
        reaped_ = true;
        return true;
      }
    } catch (const spawner::ServerGone&) {  // and its workers with it
      status_ = -1;
      reaped_ = true;
      return true;
    } catch (const std::exception&) {  // the server has no such child: make sure it is not running
      ::kill(pid_, SIGKILL);
      status_ = -1;
      reaped_ = true;
      return true;
    }
    if (!block) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int Process::wait(std::chrono::milliseconds timeout) {
  return wait_until(std::chrono::steady_clock::now() + scaled(timeout));
}

int Process::wait_until(std::chrono::steady_clock::time_point deadline) {
  while (!reaped_) {
    if (reap(false)) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      (void)reap(true);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return status_;
}

void Process::kill(int sig) {
  if (!reaped_) ::kill(pid_, sig);
}

std::string Process::output() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int exit_code(int status) {
  if (status == -1) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

const TestHosts& test_hosts() {
  static const TestHosts hosts = [] {
    TestHosts h;
    const char* spec = std::getenv("TANDEM_TEST_HOSTS");
    if (!spec || !*spec) return h;
    const std::string s = spec;
    const auto colon = s.find(':');
    if (colon == std::string::npos) throw std::runtime_error("TANDEM_TEST_HOSTS is not NAME:COUNT: " + s);
    h.name = s.substr(0, colon);
    h.count = std::stoi(s.substr(colon + 1));
    const auto need = [](const char* var) {
      const char* v = std::getenv(var);
      if (!v || !*v) throw std::runtime_error(std::string("TANDEM_TEST_HOSTS is set but ") + var + " is not");
      return std::string(v);
    };
    h.launcher = need("TANDEM_TEST_LAUNCHER");
    h.master_addr = need("TANDEM_TEST_MASTER_ADDR");
    if (const char* v = std::getenv("TANDEM_TEST_HOSTS_SCRIPT")) h.script = v;
    if (const char* v = std::getenv("TANDEM_TEST_DELAY_RELAY")) h.delay_relay = v;
    return h;
  }();
  return hosts;
}

void host_fault(const std::string& op, int host, const std::string& arg) {
  const TestHosts& h = test_hosts();
  if (h.count == 0 || h.script.empty()) throw std::runtime_error("host_fault: not on test hosts");
  // `arg`'s words (separated by spaces; none holds a quote) each single-quoted, as the script's path is.
  std::string quoted;
  for (size_t from = 0; from < arg.size();) {
    const size_t to = std::min(arg.find(' ', from), arg.size());
    if (to > from) quoted += " '" + arg.substr(from, to - from) + "'";
    from = to + 1;
  }
  const std::string cmd = "bash '" + h.script + "' " + op + " " + h.name + " " + std::to_string(host) + quoted;
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("host_fault failed: " + cmd);
}

Job::Job(const JobSpec& spec) : spec_(spec), port_(free_port()), secret_("test-secret-" + std::to_string(getpid())) {
  const TestHosts& hosts = test_hosts();
  for (int r = 1; r < spec.world_size; ++r) {
    auto env = env_for(r);
    for (const auto& [k, v] : spec.extra_env) env[k] = v;
    std::vector<std::string> argv{self_exe(), "--worker", spec.scenario};
    if (hosts.count > 0) {
      argv.insert(argv.begin(), {"/usr/sbin/ip", "netns", "exec", hosts.name + "-h" + std::to_string(r % hosts.count),
                                 hosts.launcher, "--nproc-per-node", "1", "--nnodes", std::to_string(spec.world_size),
                                 "--node-rank", std::to_string(r), "--master-addr", hosts.master_addr, "--master-port",
                                 std::to_string(port_), "--grace-seconds", "2", "--"});
    }
    children_.push_back(std::make_unique<Process>(argv, env));
  }
}

std::map<std::string, std::string> Job::env_for(int rank) const {
  return {{"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(spec_.world_size)},
          {"LOCAL_WORLD_SIZE", std::to_string(spec_.world_size)},
          {"MASTER_ADDR", job_master_addr()},
          {"MASTER_PORT", std::to_string(port_)},
          {"TANDEM_SECRET", secret_}};
}

std::vector<int> Job::wait_children(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + scaled(timeout);
  std::vector<int> codes;
  for (auto& c : children_) codes.push_back(exit_code(c->wait_until(deadline)));
  return codes;
}

std::string Job::outputs() const {
  std::string all;
  for (size_t i = 0; i < children_.size(); ++i) {
    all += "--- rank " + std::to_string(i + 1) + " output:\n" + children_[i]->output();
  }
  return all;
}

}  // namespace tandem::test
