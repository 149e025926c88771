// tandem-run: starts the worker processes of a Tandem job on this node, torchrun-style.
//
//   tandem-run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] [--secret-file F]
//              [--grace-seconds S] [--max-restarts K] [--rdzv-id ID] [--] program args...
//   tandem-run --nproc-per-node N --nnodes MIN:MAX --rdzv-backend c10d|etcd --rdzv-endpoint HOST:PORT --rdzv-id ID
//              [--max-restarts K] [--monitor-interval S] [--rdzv-conf k=v,...] [--local-addr A] [--] program args...
//
// Each worker gets RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's
// variables) and TANDEM_SECRET, the job secret: generated when the job is on one node (unless TANDEM_SECRET is set),
// taken from TANDEM_SECRET or --secret-file when it spans nodes. On one node without --master-port a free port is
// chosen. Every output line of a worker is prefixed with "[rankN]: ". A reader that stops reading the launcher's own
// output never stops the launcher (tools/output_relay.h: up to 64 MiB per stream wait; beyond, output is dropped and
// counted).
//
// When a worker fails (non-zero exit or a signal), the others get SIGTERM, then SIGKILL after the grace period, and
// tandem-run exits non-zero with one summary line naming who failed and why. Workers die with tandem-run (PDEATHSIG).
// A worker that has still not exited a grace period (at least 5 s) after SIGKILL (stuck in the kernel, or held by a
// tracer) is named and left behind: tandem-run does not wait for it.
//
// Restarts (torchrun's --max-restarts, one node): after a failure, once every worker has stopped, all of them are
// started again with TORCHELASTIC_RESTART_COUNT one higher and a fresh master port (so a restart never meets "address
// already in use"); the program resumes from its own checkpoint (checkpoint/checkpoint.h). When the restarts are
// used up, tandem-run exits non-zero with one line listing every failure. Workers also get torchrun's
// TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID (--rdzv-id), ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE and
// GROUP_WORLD_SIZE.
//
// Elastic jobs (--rdzv-backend c10d): the launchers of the nodes meet at --rdzv-endpoint in rounds
// (elastic/rendezvous.h); the one on the endpoint's machine serves the rendezvous store there (the first to bind the
// port). A round closes at MAX nodes, or MIN and --rdzv-conf last_call_timeout later (default 30 s), once the last
// round's nodes that come back are in or have taken as long as a lost node would (elastic/rendezvous.h); it assigns
// node ranks in order of arrival, world size and node 0's fresh master port. Any worker failure, a node that misses its
// heartbeats (keep_alive_interval x keep_alive_max_attempt, default 5 s x 3), a node waiting to join a job with room,
// or a launcher stopped by a signal ends the round: every node stops its workers and joins the next one (a launcher
// signalled while it waits to join leaves at once, ending the round it was to be in). Failures
// (not membership changes) count against --max-restarts, over the whole job. The job succeeds when every node's
// workers exited 0. --rdzv-conf also takes join_timeout (default 600 s). --rdzv-backend etcd keeps the rendezvous in
// an etcd cluster at --rdzv-endpoint instead (no launcher is a single point of failure).
//
// Warm standbys (--standby 1, the default, when restarts are possible): for a Tandem program (its executable carries
// rpc/detail/standby.h's marker), a second into each round the launcher starts one spare process per local worker,
// which loads (LibTorch's third of a second) and waits before main; a restart hands each new worker's variables to a
// spare instead of starting the program again. Other programs are always started afresh.
//
// Threads: when OMP_NUM_THREADS is unset, every worker gets OMP_NUM_THREADS = its share of the CPUs this launcher may
// use (cluster/cpus.h: its affinity, bounded by its container's CPU quota) over --nproc-per-node, at least 1, and
// with more than one worker tandem-run says so once. LibTorch's intra-op pool and OpenBLAS otherwise take every core
// of the machine in each worker (a container's quota unseen): N workers would run N times as many threads as cores.
// torchrun sets 1 in the same case; the share is the same on a machine with as many cores as workers.
//
// CPU binding (--bind-cores 1; DeepSpeed's --bind_cores_to_rank): each local worker runs on its own share of the CPUs
// the launcher may use (its affinity mask): local rank i of N on the i-th of N consecutive blocks (sizes differing by
// at most one) when there are at least N CPUs, else on CPU i mod their count. Set before the program starts (a warm
// standby's threads when it takes over). A process then stays on its core's caches: two stage workers of a pipeline
// on 2 cores computed 5% faster so.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpc/support/log.h>

#include <CLI/CLI.hpp>

#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "tandem/cluster/cpus.h"
#include "tandem/cluster/environment.h"
#include "tandem/elastic/detail/records.h"
#include "tandem/elastic/rendezvous.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/store.h"
#include "tools/output_relay.h"

namespace {

struct Options {
  int nproc = 1, nnodes = 1, node_rank = 0;
  int min_nodes = 1, max_nodes = 1;  // --nnodes MIN:MAX
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;
  std::string rdzv_conf;
  std::string local_addr;
  double monitor_interval = 0.1;  // seconds
  bool standby = true;            // warm standbys for restarts (Tandem programs only)
  bool bind_cores = false;        // each local worker on its own share of the CPUs
  std::string master_addr = "127.0.0.1";
  int master_port = -1;
  std::string secret_file;
  int grace_seconds = 5;
  int max_restarts = 0;
  std::string run_id = "none";  // torchrun's default --rdzv-id
  std::vector<std::string> command;
};

struct Stream {
  int fd = -1;
  std::string partial;
  FILE* out = nullptr;
  bool cut = false;  // the last piece written was cut at the longest line's length
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream streams[2];
};

volatile sig_atomic_t g_signal = 0;

[[noreturn]] void usage(const std::string& error) {
  std::cerr
      << "tandem-run: " << error << "\n"
      << "usage: tandem-run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]\n"
      << "                  [--secret-file F] [--grace-seconds S] [--max-restarts K] [--rdzv-id ID]\n"
      << "                  [--] program args...\n"
      << "       tandem-run --nproc-per-node N --nnodes MIN:MAX --rdzv-backend c10d|etcd --rdzv-endpoint HOST:PORT\n"
      << "                  --rdzv-id ID [--max-restarts K] [--monitor-interval S] [--rdzv-conf k=v,...]\n"
      << "                  [--local-addr A] [--secret-file F] [--grace-seconds S] [--standby 0|1]\n"
      << "       (either form) [--bind-cores 0|1]\n"
      << "                  [--] program args...\n";
  std::exit(2);
}

int parse_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    int n = std::stoi(v, &used);
    if (used == v.size()) return n;
  } catch (...) {
  }
  usage("bad value for " + flag + ": '" + v + "'");
}

// Every flag tandem-run takes (torchrun's spelling, with '-'; '_' is accepted too), with what --help says of it.
struct Flag {
  const char* name;
  const char* help;
  const char* fallback;  // what applies when neither the command line nor the environment gives it
};
const Flag kFlagHelp[] = {
    {"--nproc-per-node", "workers on this node: a number, or auto/cpu (one per CPU it may use)", "1"},
    {"--nnodes", "nodes: N, or MIN:MAX for an elastic job (needs --rdzv-backend)", "1"},
    {"--rdzv-backend", "static, or an elastic rendezvous: c10d (a store one launcher serves) or etcd", "static"},
    {"--rdzv-endpoint", "HOST:PORT of the rendezvous store", ""},
    {"--rdzv-conf", "k=v,... (join_timeout, last_call_timeout, keep_alive_interval, keep_alive_max_attempt)", ""},
    {"--local-addr", "this node's address as other nodes reach it", "(found)"},
    {"--standby", "1: keep a warm standby process per worker for restarts (Tandem programs only)", "1"},
    {"--monitor-interval",
     "seconds between checks of the workers and the rendezvous (the rendezvous at least every keep_alive_interval)",
     "0.1"},
    {"--bind-cores",
     "1: bind each local worker to its own share of this launcher's CPUs (N equal blocks, or CPU "
     "local rank mod their count when fewer than N)",
     "0"},
    {"--node-rank", "this node's rank (static jobs)", "0"},
    {"--master-addr", "rank 0's node (static jobs)", "127.0.0.1"},
    {"--master-port", "the job's store port on the master (static jobs of several nodes)", "(free port)"},
    {"--secret-file", "a file holding the job's shared secret (or TANDEM_SECRET; one node: generated)", ""},
    {"--grace-seconds", "seconds between SIGTERM and SIGKILL when stopping workers", "5"},
    {"--max-restarts", "restarts of the worker group after a failure (elastic jobs)", "0"},
    {"--rdzv-id", "the job's id, the same on every node", "none"},
};

// Fills the flags the command line left out from the environment: torchrun's PET_<FLAG> variables first (Kubeflow
// sets them), then the cluster's own (SLURM when srun started us, a PyTorchJob's in a Kubernetes pod:
// cluster/environment.h). Says on stderr what it took, so a job's log shows where its shape came from.
void defaults_from_environment(std::map<std::string, std::string>* flags) {
  std::string taken;
  for (const Flag& f : kFlagHelp) {
    const char* flag = f.name;
    if (flags->count(flag)) continue;
    if (auto v = tandem::cluster::pet_default(flag)) {
      (*flags)[flag] = *v;
      taken += std::string(" ") + flag + " " + *v;
    }
  }
  if (!taken.empty()) std::cerr << "tandem-run: from PET_* variables:" << taken << "\n";
  auto node = tandem::cluster::node_place();
  if (!node.ok()) usage(std::string(node.status().message()));
  taken.clear();
  auto take = [&](const char* flag, const std::optional<std::string>& v) {
    if (!v || flags->count(flag)) return;
    (*flags)[flag] = *v;
    taken += std::string(" ") + flag + " " + *v;
  };
  take("--nnodes", node->nnodes);
  take("--node-rank", node->node_rank ? std::optional<std::string>(std::to_string(*node->node_rank)) : std::nullopt);
  take("--master-addr", node->master_addr);
  take("--master-port",
       node->master_port ? std::optional<std::string>(std::to_string(*node->master_port)) : std::nullopt);
  if (!taken.empty()) std::cerr << "tandem-run: from " << node->source << "'s variables:" << taken << "\n";
}

// --nproc-per-node's value: a number, or torchrun's "auto"/"cpu": one per CPU this launcher may use (its affinity,
// bounded by its container's CPU quota: cluster/cpus.h; no GPUs in this build).
int parse_nproc(const std::string& value) {
  if (value == "auto" || value == "cpu") return tandem::cluster::usable_cpus();
  if (value == "gpu") usage("--nproc-per-node gpu: this build has no GPU support");
  return parse_int("--nproc-per-node", value);
}

Options parse(int argc, char** argv) {
  Options o;
  // The flags as given (CLI11), before the program and its arguments: the first argument that is not a flag, or
  // whatever follows "--", and everything after it belongs to the program.
  CLI::App app{
      "Starts the workers of a Tandem job on this node, torchrun-style; flags not given come from torchrun's "
      "PET_* variables, then SLURM's or a PyTorchJob's (docs/deploy.md)",
      "tandem-run"};
  app.prefix_command();
  app.footer(
      "Static:  tandem-run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] [--] program "
      "args...\nElastic: tandem-run --nproc-per-node N --nnodes MIN:MAX --rdzv-backend c10d|etcd --rdzv-endpoint "
      "HOST:PORT --rdzv-id ID [--] program args...");
  std::map<std::string, std::string> given;
  std::vector<CLI::Option*> options;
  for (const Flag& f : kFlagHelp) {
    std::string names = f.name;
    std::string underscored = names.substr(2);  // torchrun spells them with '_' too
    std::replace(underscored.begin(), underscored.end(), '-', '_');
    if ("--" + underscored != names) names += ",--" + underscored;
    options.push_back(app.add_option(names, given[f.name], f.help)
                          ->default_str(f.fallback)
                          ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast));  // the last one wins
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  std::map<std::string, std::string> flags;
  for (size_t k = 0; k < options.size(); ++k) {
    if (options[k]->count() > 0) flags[kFlagHelp[k].name] = given[kFlagHelp[k].name];
  }
  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") {
    o.command.erase(o.command.begin());
  } else if (!o.command.empty() && o.command.front().rfind("-", 0) == 0) {
    // prefix_command() leaves an unknown flag in front of the program: it is a mistake, not the program's name.
    usage("unknown option " + o.command.front());
  }
  defaults_from_environment(&flags);
  for (const auto& [a, value] : flags) {
    if (a == "--nproc-per-node") o.nproc = parse_nproc(value);
    else if (a == "--nnodes") {
      if (auto colon = value.find(':'); colon != std::string::npos) {
        o.min_nodes = parse_int(a, value.substr(0, colon));
        o.max_nodes = parse_int(a, value.substr(colon + 1));
        o.nnodes = o.max_nodes;
      } else {
        o.nnodes = o.min_nodes = o.max_nodes = parse_int(a, value);
      }
    } else if (a == "--rdzv-backend") o.rdzv_backend = value;
    else if (a == "--rdzv-endpoint") o.rdzv_endpoint = value;
    else if (a == "--rdzv-conf") o.rdzv_conf = value;
    else if (a == "--local-addr") o.local_addr = value;
    else if (a == "--standby") o.standby = parse_int(a, value) != 0;
    else if (a == "--bind-cores") o.bind_cores = parse_int(a, value) != 0;
    else if (a == "--monitor-interval") {
      try {
        o.monitor_interval = std::stod(value);
      } catch (...) {
        usage("bad value for --monitor-interval: '" + value + "'");
      }
    } else if (a == "--node-rank") o.node_rank = parse_int(a, value);
    else if (a == "--master-addr") o.master_addr = value;
    else if (a == "--master-port") o.master_port = parse_int(a, value);
    else if (a == "--secret-file") o.secret_file = value;
    else if (a == "--grace-seconds") o.grace_seconds = parse_int(a, value);
    else if (a == "--max-restarts") o.max_restarts = parse_int(a, value);
    else if (a == "--rdzv-id") o.run_id = value;
  }
  if (o.command.empty()) usage("no program to run");
  if (o.nproc < 1 || o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) usage("bad node/process counts");
  // Ranks and world sizes are ints, and a rendezvous record holds at most tandem::elastic::detail::kMaxCount workers.
  if (o.nproc > tandem::elastic::detail::kMaxCount || int64_t{std::max(o.nnodes, o.max_nodes)} * o.nproc > INT32_MAX) {
    usage("too many processes: --nproc-per-node at most " + std::to_string(tandem::elastic::detail::kMaxCount) +
          ", and nodes x processes below 2^31");
  }
  if (o.grace_seconds < 0) usage("bad value for --grace-seconds");
  if (o.master_port > 65535) usage("bad master port");
  if (o.max_restarts < 0) usage("bad value for --max-restarts");
  if (o.rdzv_backend != "static" && o.rdzv_backend != "c10d" && o.rdzv_backend != "etcd") {
    usage("unknown --rdzv-backend '" + o.rdzv_backend + "' (static, c10d or etcd)");
  }
  if (o.rdzv_backend == "static") {
    if (o.min_nodes != o.max_nodes) usage("--nnodes MIN:MAX needs an elastic rendezvous: --rdzv-backend c10d");
    if (o.max_restarts > 0 && o.nnodes > 1) {
      usage("restarting a job on several nodes needs the launchers' rendezvous: --rdzv-backend c10d --rdzv-endpoint");
    }
  } else {
    if (o.rdzv_endpoint.empty()) usage("--rdzv-backend " + o.rdzv_backend + " needs --rdzv-endpoint HOST:PORT");
    if (o.min_nodes < 1 || o.max_nodes < o.min_nodes) usage("bad --nnodes MIN:MAX");
  }
  // From 1 ms to a day (a NaN passes a "<= 0" test; the value becomes a count of microseconds).
  if (!(o.monitor_interval >= 1e-3 && o.monitor_interval <= 86400)) usage("bad value for --monitor-interval");
  return o;
}

// The master port of a round (rpc/detail/net.h: below the ephemeral range, free on every local address).
int free_port() {
  auto port = tandem::rpc::net::pick_listen_port();
  if (!port.ok()) {
    std::fprintf(stderr, "tandem-run: cannot find a free port: %s\n", port.status().ToString().c_str());
    std::exit(1);
  }
  return *port;
}

std::string random_secret() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!in.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    std::cerr << "tandem-run: cannot read /dev/urandom for the job secret\n";
    std::exit(1);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

std::string job_secret(const Options& o) {
  if (const char* env = std::getenv("TANDEM_SECRET"); env && *env) return env;
  if (!o.secret_file.empty()) {
    std::ifstream in(o.secret_file);
    std::string s;
    if (!in || !std::getline(in, s) || s.empty()) {
      std::cerr << "tandem-run: cannot read the job secret from " << o.secret_file << "\n";
      std::exit(2);
    }
    return s;
  }
  if (o.nnodes > 1) usage("a job on several nodes needs the same secret on each: set TANDEM_SECRET or --secret-file");
  return random_secret();
}

// Where this node's workers stand in the job, for one round.
struct Placement {
  int node_rank = 0, nnodes = 1;
  int rank_offset = 0, world = 1;  // the global rank of the first worker; all workers of the job
  std::string master_addr;
  int master_port = 0;
  int restart = 0;  // TORCHELASTIC_RESTART_COUNT
};

// The variables of one worker of one round (torchrun's names).
std::vector<std::pair<std::string, std::string>> round_env(int rank, int local, const Options& o, const Placement& p) {
  return {{"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(local)},
          {"GROUP_RANK", std::to_string(p.node_rank)},
          {"WORLD_SIZE", std::to_string(p.world)},
          {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
          {"MASTER_ADDR", p.master_addr},
          {"MASTER_PORT", std::to_string(p.master_port)},
          {"GROUP_WORLD_SIZE", std::to_string(p.nnodes)},
          {"ROLE_RANK", std::to_string(rank)},
          {"ROLE_WORLD_SIZE", std::to_string(p.world)},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(p.restart)}};
}

// The CPUs this launcher may use (its affinity mask, read once: call first in the launcher, before any fork). Empty,
// and said once, when the mask cannot be read (a machine of more than CPU_SETSIZE CPUs): workers then run unbound.
const std::vector<int>& launcher_cpus() {
  static const std::vector<int> allowed = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<int> cpus;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &set)) cpus.push_back(c);
      }
    } else {
      std::fprintf(stderr, "tandem-run: --bind-cores: cannot read this process's CPUs (%s); workers run unbound\n",
                   std::strerror(errno));
    }
    return cpus;
  }();
  return allowed;
}

// The CPUs of local worker `local` of `nproc` under --bind-cores: its block of the launcher's CPUs (consecutive
// blocks in order, their sizes differing by at most one, when there are at least nproc), else CPU local mod their
// count. Allocates nothing (it runs in a forked child).
cpu_set_t worker_cpus(int local, int nproc) {
  const std::vector<int>& allowed = launcher_cpus();
  cpu_set_t set;
  CPU_ZERO(&set);
  const int n = static_cast<int>(allowed.size());
  if (n == 0) return set;
  if (n < nproc) {
    CPU_SET(allowed[local % n], &set);
    return set;
  }
  for (int i = local * n / nproc; i < (local + 1) * n / nproc; ++i) CPU_SET(allowed[i], &set);
  return set;
}

// Binds process `pid` (0: this one, a forked child before exec: nothing allocated) or, for a standby, each of its
// threads to worker `local`'s CPUs. Best effort: a worker that cannot be bound runs unbound, and says so.
void bind_worker(pid_t pid, int local, const Options& o) {
  if (!o.bind_cores) return;
  const cpu_set_t set = worker_cpus(local, o.nproc);
  if (CPU_COUNT(&set) == 0) return;
  auto bind = [&](pid_t t) {
    if (sched_setaffinity(t, sizeof set, &set) != 0) {
      std::fprintf(stderr, "tandem-run: cannot bind local worker %d to its CPUs: %s\n", local, std::strerror(errno));
    }
  };
  if (pid == 0) {
    bind(0);
    return;
  }
  // A standby's threads, started before it took over.
  if (DIR* d = opendir(("/proc/" + std::to_string(pid) + "/task").c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') bind(static_cast<pid_t>(std::atoi(e->d_name)));
    }
    closedir(d);
  }
}

using EnvVars = std::vector<std::pair<std::string, std::string>>;

// This process's environment with `vars` set (added, or replacing the same name's value), as NAME=value strings.
std::vector<std::string> environment_with(const EnvVars& vars) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    const bool replaced = std::any_of(vars.begin(), vars.end(), [&](const auto& v) { return v.first == name; });
    if (!replaced) env.push_back(entry);
  }
  for (size_t i = 0; i < vars.size(); ++i) {  // a name set twice: the later value, as setenv would leave it
    const bool later = std::any_of(vars.begin() + static_cast<std::ptrdiff_t>(i) + 1, vars.end(),
                                   [&](const auto& v) { return v.first == vars[i].first; });
    if (!later) env.push_back(vars[i].first + "=" + vars[i].second);
  }
  return env;
}

// The variables every process of the job gets.
EnvVars job_env(const Options& o, const std::string& secret) {
  return {{"TANDEM_SECRET", secret},
          {"ROLE_NAME", "default"},
          {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
          {"TORCHELASTIC_RUN_ID", o.run_id}};
}

// Forks a process of the program with its output on two new pipes and `vars` added to this process's environment.
// Everything the child needs is made here, before fork: between fork and exec it allocates nothing (other threads of
// the launcher may hold the allocator's locks) and runs only `in_child` (which must not allocate either) after
// PDEATHSIG: it never outlives the launcher. Returns the pid and the read ends. When no pipe or process can be made
// (out of descriptors or processes): with `error`, -1 and the cause there; without, the launcher exits.
pid_t fork_program(const Options& o, int out[2], const EnvVars& vars, const std::function<void()>& in_child,
                   std::string* error = nullptr) {
  const std::vector<std::string> env = environment_with(vars);
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::string cannot = "cannot execute " + o.command[0] + ": ";
  int pipes[2][2] = {{-1, -1}, {-1, -1}};
  auto fail = [&](const char* what) -> pid_t {
    const std::string why = std::string(what) + ": " + std::strerror(errno);
    for (auto& p : pipes) {
      for (int fd : p) {
        if (fd >= 0) close(fd);
      }
    }
    if (!error) {
      std::fprintf(stderr, "tandem-run: %s\n", why.c_str());
      std::exit(1);
    }
    *error = why;
    return -1;
  };
  if (pipe2(pipes[0], O_CLOEXEC) != 0 || pipe2(pipes[1], O_CLOEXEC) != 0) return fail("pipe");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return fail("fork");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != parent) _exit(1);
    // A session (and process group) of its own, as torchrun's workers: a stop reaches what the program starts too
    // (signal_group), and a terminal's signals reach the launcher alone, which passes them on.
    setsid();
    // The launcher's own dispositions are not the program's: SIGPIPE ignored (install_signal_handlers) would stay so
    // across exec, and a blocked signal stays blocked.
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(pipes[0][1], STDOUT_FILENO);
    dup2(pipes[1][1], STDERR_FILENO);
    if (in_child) in_child();
    execvpe(argv[0], argv.data(), envp.data());
    const char* why = strerrordesc_np(errno);  // a static string: no allocation, unlike strerror's unknown codes
    (void)!write(STDERR_FILENO, cannot.data(), cannot.size());
    (void)!write(STDERR_FILENO, why ? why : "?", why ? std::strlen(why) : 1);
    (void)!write(STDERR_FILENO, "\n", 1);
    _exit(127);
  }
  close(pipes[0][1]);
  close(pipes[1][1]);
  out[0] = pipes[0][0];
  out[1] = pipes[1][0];
  return pid;
}

// False (and `error` says why) when no process or pipe could be made for it.
bool spawn(Worker& w, int local, const Options& o, const Placement& p, const std::string& secret, std::string* error) {
  int out[2];
  EnvVars vars = job_env(o, secret);
  for (auto& kv : round_env(w.rank, local, o, p)) vars.push_back(std::move(kv));
  w.pid = fork_program(
      o, out, vars, [&] { bind_worker(0, local, o); }, error);
  if (w.pid < 0) return false;
  w.running = true;
  w.streams[0] = {out[0], "", stdout};
  w.streams[1] = {out[1], "", stderr};
  return true;
}

// A warm standby (rpc/detail/standby.h): the program started ahead of a restart, loaded, waiting before main for the
// variables of the worker it becomes. Only for programs whose executable carries the standby marker.
struct Standby {
  pid_t pid = -1;
  int sock = -1;  // the launcher's end: the activation block goes here
  int out[2] = {-1, -1};
};

// Its placeholders are as wide as any value a restart gives them, so the values land in the process's initial
// environment (/proc/<pid>/environ) too. None when it cannot be made (`error` says why): a standby is only ahead of
// time, the round goes on without it.
std::optional<Standby> spawn_standby(const Options& o, const std::string& secret, std::string* error) {
  Standby sb;
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    *error = std::string("socketpair: ") + std::strerror(errno);
    return std::nullopt;
  }
  EnvVars vars = job_env(o, secret);
  Placement none;
  for (const auto& [k, v] : round_env(0, 0, o, none)) {
    vars.emplace_back(k, std::string(k == "MASTER_ADDR" ? 255 : 20, '_'));
  }
  vars.emplace_back("TANDEM_STANDBY_FD", std::to_string(pair[1]));
  sb.pid = fork_program(
      o, sb.out, vars, [&] { fcntl(pair[1], F_SETFD, 0); },  // the child's end survives exec
      error);
  close(pair[1]);
  if (sb.pid < 0) {
    close(pair[0]);
    return std::nullopt;
  }
  sb.sock = pair[0];
  return sb;
}

// Sends `sig` to the process group of the program started as `pid` (fork_program: its own session), which holds
// what it started (unless they left it); to `pid` alone before the child has made its session. `pid` must not be
// reaped yet (then its id, and the group's, cannot be another process's).
void signal_group(pid_t pid, int sig) {
  if (kill(-pid, sig) != 0 && errno == ESRCH) kill(pid, sig);
}

// Reaps `pid` if it has exited (its exit status into `status`): true then. Before reaping, what it started and left
// in its process group is SIGKILLed: a program's processes end with it (a wrapper script's training process would
// otherwise hold the job's ports and files into the next round, and outlive the launcher). A child that cannot be
// waited for (not ours) counts as exited, with exit code 255.
bool reap_if_exited(pid_t pid, int* status) {
  siginfo_t info{};
  if (waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
    if (errno == EINTR) return false;
    std::fprintf(stderr, "tandem-run: cannot wait for pid %d (%s): taken as exited\n", static_cast<int>(pid),
                 std::strerror(errno));
    *status = W_EXITCODE(255, 0);
    return true;
  }
  if (info.si_pid != pid) return false;  // still running
  kill(-pid, SIGKILL);                   // its group's leftovers (none: ESRCH)
  while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
  }
  return true;
}

// SIGKILLs a standby and reaps it, waiting 5 s at most: one stuck in the kernel (or held by a tracer) is left behind.
void kill_and_reap(pid_t pid) {
  signal_group(pid, SIGKILL);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    const pid_t r = waitpid(pid, nullptr, WNOHANG);
    if (r != 0 && !(r < 0 && errno == EINTR)) return;  // reaped (or not a child of ours)
    if (std::chrono::steady_clock::now() > give_up) {
      std::fprintf(stderr, "tandem-run: standby pid %d has not exited 5 s after SIGKILL: left behind\n",
                   static_cast<int>(pid));
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Makes `sb` worker `w`; false when the standby has died (the caller starts the worker afresh).
bool activate(Standby& sb, Worker& w, int local, const Options& o, const Placement& p) {
  int status = 0;
  if (waitpid(sb.pid, &status, WNOHANG) == sb.pid) {
    close(sb.sock);
    close(sb.out[0]);
    close(sb.out[1]);
    return false;
  }
  bind_worker(sb.pid, local, o);  // while it waits for the block: no thread starts meanwhile
  std::string block;
  for (const auto& [k, v] : round_env(w.rank, local, o, p)) {
    block += k + "=" + v;
    block += '\0';
  }
  block += '\0';
  const bool sent = write(sb.sock, block.data(), block.size()) == static_cast<ssize_t>(block.size());
  close(sb.sock);
  if (!sent) {  // it died just now: reaped by the caller's fresh start failing over, or here
    kill_and_reap(sb.pid);
    close(sb.out[0]);
    close(sb.out[1]);
    return false;
  }
  w.pid = sb.pid;
  w.running = true;
  w.streams[0] = {sb.out[0], "", stdout};
  w.streams[1] = {sb.out[1], "", stderr};
  return true;
}

void discard(std::vector<Standby>& pool) {
  for (auto& sb : pool) {
    close(sb.sock);  // it exits by itself once it reads the end; SIGKILL in case it is still loading
    kill_and_reap(sb.pid);
    close(sb.out[0]);
    close(sb.out[1]);
  }
  pool.clear();
}

// Whether the program (the command's first word, looked up on PATH) is a Tandem program that can wait as a standby.
bool supports_standby(const std::string& program) {
  std::string path = program;
  if (program.find('/') == std::string::npos) {
    const char* env = std::getenv("PATH");
    path.clear();
    for (const auto& dir : absl::StrSplit(env ? env : "", ':', absl::SkipEmpty())) {
      const std::string candidate = std::string(dir) + "/" + program;
      if (access(candidate.c_str(), X_OK) == 0) {
        path = candidate;
        break;
      }
    }
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  static constexpr char kMarker[] = "tandem-standby-protocol-1";  // rpc/detail/standby.h
  const size_t m = sizeof(kMarker) - 1;
  std::string window;
  char buf[1 << 16];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
    window.append(buf, static_cast<size_t>(in.gcount()));
    if (window.find(kMarker) != std::string::npos) return true;
    window.erase(0, window.size() > m ? window.size() - m : 0);  // keep a marker cut between two reads
  }
  return false;
}

// Writes the worker's complete lines, each prefixed with its rank. A line longer than kLongestLine (progress bars
// redrawn with '\r', binary output) is written in pieces of that size, so that the launcher's memory and its search for
// the end of a line stay bounded whatever a worker prints.
void emit(const Worker& w, Stream& s, const char* data, size_t n, bool eof) {
  constexpr size_t kLongestLine = 64 << 10;
  auto line = [&](const char* p, size_t len) {
    std::fprintf(s.out, "[rank%d]: ", w.rank);
    std::fwrite(p, 1, len, s.out);  // not %s: a worker's bytes may hold a NUL
    std::fputc('\n', s.out);
  };
  size_t searched = s.partial.size();  // what was kept holds no newline
  s.partial.append(data, n);
  size_t start = 0;
  for (;;) {
    const size_t nl = s.partial.find('\n', std::max(start, searched));
    // A line longer than a piece is cut there, however the reads brought its bytes.
    if ((nl == std::string::npos ? s.partial.size() : nl) - start > kLongestLine) {
      line(s.partial.data() + start, kLongestLine);
      start += kLongestLine;
      s.cut = true;
      continue;
    }
    if (nl == std::string::npos) break;
    if (!(s.cut && nl == start)) line(s.partial.data() + start, nl - start);  // (the end of a line just cut)
    s.cut = false;
    start = nl + 1;
  }
  s.partial.erase(0, start);
  if (eof && !s.partial.empty()) {
    line(s.partial.data(), s.partial.size());
    s.partial.clear();
  }
  std::fflush(s.out);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// One run of every worker of this node, until all have exited (or the launcher was interrupted, or the round ended).
struct Round {
  int failed = -1;  // the first worker that failed, or -1
  int status = 0;   // its wait status
  pid_t pid = -1;
  int rank = -1;
  std::string others;                // how the other workers ended
  std::optional<std::string> ended;  // why the round ended, as the rendezvous recorded it (the first end wins)
  std::string error;                 // the rendezvous failed (its store is gone)
};

// `node`: how this node is named in messages ("node 1 (10.0.0.3)"), empty for a static job.
std::string failure_text(const Round& r, const std::string& node) {
  return "rank " + std::to_string(r.rank) + (node.empty() ? "" : " on " + node) + " (pid " + std::to_string(r.pid) +
         ") failed with " + describe_status(r.status);
}

// Why a round ends when this node's launcher is stopped by `sig` (no failure: the node leaves on purpose).
std::string leave_reason(const std::string& node, int sig) {
  return node + " was stopped by signal " + std::to_string(sig);
}

// Ends the round as this node's leave (no failure). A store that cannot be reached is said, not fatal: the other
// nodes then see this one's heartbeats stop (counted as a failure).
void end_round_as_leave(tandem::elastic::Rendezvous& rdzv, const std::string& node, int sig) {
  auto end = rdzv.end_round(leave_reason(node, sig), /*failure=*/false);
  if (!end.ok()) {
    std::fprintf(stderr,
                 "tandem-run: could not record this node's leave in the rendezvous (the other nodes will count its "
                 "missed heartbeats as a failure): %s\n",
                 end.status().ToString().c_str());
  }
}

// How often a launcher checks the rendezvous (and beats): every --monitor-interval, but at least every
// keep_alive_interval, or the other nodes would take a slow monitor for a lost node.
std::chrono::microseconds rendezvous_interval(const Options& o, tandem::elastic::Rendezvous& rdzv) {
  const auto monitor = std::chrono::microseconds(static_cast<int64_t>(o.monitor_interval * 1e6));
  return std::min(monitor, absl::ToChronoMicroseconds(rdzv.options().keep_alive_interval));
}

// `rdzv`: the elastic rendezvous, or nullptr for a static job. `node`: as for failure_text.
// `pool`: warm standbys (nullptr: none); the round's workers come from it when it has them, and it is filled again a
// second into the round, for the next restart.
Round run_round(const Options& o, const Placement& p, const std::string& secret, tandem::elastic::Rendezvous* rdzv,
                const std::string& node, std::vector<Standby>* pool) {
  std::vector<Worker> workers(o.nproc);
  int warm = 0;
  int cannot_start = -1;  // a worker no process could be made for: the round fails as if it had exited at once
  for (int i = 0; i < o.nproc; ++i) workers[i].rank = p.rank_offset + i;
  for (int i = 0; i < o.nproc && cannot_start < 0; ++i) {
    bool started = false;
    while (pool && !pool->empty() && !started) {
      Standby sb = pool->front();
      pool->erase(pool->begin());
      started = activate(sb, workers[i], i, o, p);
    }
    std::string why;
    if (!started && !spawn(workers[i], i, o, p, secret, &why)) {
      std::fprintf(stderr, "tandem-run: cannot start rank %d: %s\n", workers[i].rank, why.c_str());
      cannot_start = i;
    }
    warm += started;
  }
  if (warm > 0) {
    std::fprintf(stderr, "tandem-run: %d of %d workers started from warm standbys\n", warm, o.nproc);
  }
  const auto refill_at = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  bool refill_failed = false;

  Round r;
  int first_failed = -1;  // index into workers
  int first_status = 0;
  if (cannot_start >= 0) {  // as a program that cannot be executed ends (127): the others are stopped below
    first_failed = cannot_start;
    first_status = W_EXITCODE(127, 0);
  }
  bool stopping = false;
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  // After SIGKILL: a worker not reaped by then is left behind (uninterruptible sleep, a tracer that holds it).
  auto abandon_deadline = std::chrono::steady_clock::time_point::max();
  auto stop_others = [&](int sig) {
    for (auto& w : workers) {
      if (w.running) signal_group(w.pid, sig);
    }
  };
  const int poll_ms = std::clamp(static_cast<int>(o.monitor_interval * 1000), 1, 100);
  std::optional<std::chrono::steady_clock::time_point> drain_deadline;  // once every worker has exited
  auto next_monitor = std::chrono::steady_clock::now();

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> owners;  // (worker, stream)
    for (int i = 0; i < o.nproc; ++i) {
      for (int s = 0; s < 2; ++s) {
        if (workers[i].streams[s].fd >= 0) {
          fds.push_back({workers[i].streams[s].fd, POLLIN, 0});
          owners.emplace_back(i, s);
        }
      }
    }
    bool any_running = false;
    for (auto& w : workers) any_running |= w.running;
    if (fds.empty() && !any_running) break;
    if (!any_running && !drain_deadline) {
      drain_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }
    if (drain_deadline && std::chrono::steady_clock::now() > *drain_deadline) {
      // Every worker has exited, but something they started still holds their output open: stop reading it.
      for (auto& w : workers) {
        for (auto& st : w.streams) {
          if (st.fd >= 0) {
            emit(w, st, "", 0, true);
            close(st.fd);
            st.fd = -1;
          }
        }
      }
      break;
    }

    poll(fds.data(), fds.size(), poll_ms);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [i, s] = owners[k];
      char buf[65536];
      ssize_t n = read(fds[k].fd, buf, sizeof(buf));
      if (n > 0) {
        emit(workers[i], workers[i].streams[s], buf, n, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit(workers[i], workers[i].streams[s], "", 0, true);
        close(workers[i].streams[s].fd);
        workers[i].streams[s].fd = -1;
      }
    }

    for (int i = 0; i < o.nproc; ++i) {
      Worker& w = workers[i];
      if (!w.running) continue;
      int status = 0;
      if (reap_if_exited(w.pid, &status)) {
        w.running = false;
        w.status = status;
        if (failed(status) && first_failed < 0 && !stopping) {
          first_failed = i;
          first_status = status;
        }
      }
    }

    bool round_over = false;
    // The signal is read once per pass: a stop for it (below) always follows its leave vote. Read twice, a signal that
    // came between the reads (while monitor() talked to the store) stopped the workers before the vote, and another
    // node's failure, which followed from that, could win the round's end (a leave counted as a failure).
    const int sig = g_signal;
    if (rdzv && !stopping && sig) {
      // This node leaves on purpose: the round ends as no failure before its workers stop, so the other nodes'
      // workers, which fail when these go, are not counted against --max-restarts either.
      end_round_as_leave(*rdzv, node, sig);
    }
    if (rdzv && !stopping) {
      if (first_failed >= 0) {
        // The other nodes stop theirs as soon as they see the round end, not after this node's grace period.
        r.rank = workers[first_failed].rank;
        r.pid = workers[first_failed].pid;
        r.status = first_status;
        // Another node may have ended the round first (it left, or its worker failed), and this one's failure
        // followed from that: the round's cause is the end that won.
        auto end = rdzv->end_round(failure_text(r, node), /*failure=*/true);
        if (end.ok()) {
          r.ended = end->reason;
        } else {
          r.error = end.status().ToString();
        }
      } else if (std::chrono::steady_clock::now() >= next_monitor && any_running) {
        next_monitor = std::chrono::steady_clock::now() + rendezvous_interval(o, *rdzv);
        auto end = rdzv->monitor();
        if (!end.ok()) {
          r.error = end.status().ToString();
          round_over = true;
        } else if (end->has_value()) {
          r.ended = (*end)->reason;
          round_over = true;
        }
      }
    }
    if (pool && !stopping && !refill_failed && static_cast<int>(pool->size()) < o.nproc &&
        std::chrono::steady_clock::now() >= refill_at) {
      while (static_cast<int>(pool->size()) < o.nproc) {
        std::string why;
        std::optional<Standby> sb = spawn_standby(o, secret, &why);
        if (!sb) {
          // The workers run on; a restart starts its workers cold instead.
          std::fprintf(stderr, "tandem-run: cannot start a warm standby (%s): not refilling them this round\n",
                       why.c_str());
          refill_failed = true;
          break;
        }
        pool->push_back(*sb);
      }
    }
    if (!stopping && (first_failed >= 0 || sig || round_over)) {
      stopping = true;
      stop_others(sig ? sig : SIGTERM);
      kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.grace_seconds);
    }
    if (stopping && std::chrono::steady_clock::now() > kill_deadline) {
      stop_others(SIGKILL);
      kill_deadline = std::chrono::steady_clock::time_point::max();
      abandon_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(std::max(o.grace_seconds, 5));
    }
    if (std::chrono::steady_clock::now() > abandon_deadline) {
      for (auto& w : workers) {
        if (!w.running) continue;
        std::fprintf(stderr,
                     "tandem-run: rank %d (pid %d) has not exited %d s after SIGKILL (stuck in the kernel, or held by "
                     "a tracer): left behind\n",
                     w.rank, static_cast<int>(w.pid), std::max(o.grace_seconds, 5));
        w.running = false;
        w.status = SIGKILL;  // as waitpid would report it: killed by SIGKILL
      }
      abandon_deadline = std::chrono::steady_clock::time_point::max();
    }
  }

  if (first_failed < 0) return r;
  r.failed = first_failed;
  r.status = first_status;
  r.pid = workers[first_failed].pid;
  r.rank = workers[first_failed].rank;
  for (int i = 0; i < o.nproc; ++i) {
    if (i == first_failed) continue;
    if (!r.others.empty()) r.others += ", ";
    r.others += std::to_string(workers[i].rank) + " (" +
                (workers[i].pid < 0 ? std::string("not started") : describe_status(workers[i].status)) + ")";
  }
  return r;
}

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = [](int sig) { g_signal = sig; };
  // As torchrun: the workers run in sessions of their own, so a terminal's hang-up or Ctrl-\ reaches the launcher
  // alone, which stops them with it (else it would die, and they with it by PDEATHSIG, without their grace period).
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Inherited as ignored (a parent that set it so), SIGCHLD would make the kernel reap the workers itself: their
  // exits would never be seen, and their pids could be signalled after reuse.
  signal(SIGCHLD, SIG_DFL);
}

// A job with a fixed set of nodes (--node-rank, --master-addr/port): restarts only on one node.
int run_static(Options& o, std::vector<Standby>* pool) {
  const bool port_given = o.master_port >= 0;
  if (!port_given) {
    if (o.nnodes > 1) usage("a job on several nodes needs --master-port");
    o.master_port = free_port();
  }
  const std::string secret = job_secret(o);
  Placement p;
  p.node_rank = o.node_rank;
  p.nnodes = o.nnodes;
  p.rank_offset = o.node_rank * o.nproc;
  p.world = o.nnodes * o.nproc;
  p.master_addr = o.master_addr;

  std::string failures;  // every round's failure, for the last line
  for (int restart = 0;; ++restart) {
    p.master_port = o.master_port;
    p.restart = restart;
    const Round r = run_round(o, p, secret, nullptr, "", pool);
    if (r.failed < 0) {
      if (!g_signal) return 0;
      std::fprintf(stderr, "tandem-run: interrupted by signal %d; stopped all ranks\n", static_cast<int>(g_signal));
      return 128 + g_signal;
    }
    const std::string what = failure_text(r, "");
    if (restart < o.max_restarts && !g_signal) {  // an interrupted launcher does not restart
      std::fprintf(stderr, "tandem-run: %s; restarting every worker (restart %d of %d)\n", what.c_str(), restart + 1,
                   o.max_restarts);
      failures += (failures.empty() ? "" : "; ") + what;
      if (!port_given) o.master_port = free_port();  // never the last round's port
      continue;
    }
    if (o.max_restarts == 0) {
      std::fprintf(stderr, "tandem-run: %s%s%s\n", what.c_str(),
                   r.others.empty() ? "" : "; other ranks: ", r.others.c_str());
    } else {
      failures += (failures.empty() ? "" : "; ") + what;
      std::fprintf(stderr, "tandem-run: gave up after %d restarts: %s\n", o.max_restarts, failures.c_str());
    }
    return exit_code(r.status);
  }
}

double conf_seconds(const std::map<std::string, std::string>& conf, const std::string& key, double fallback) {
  auto it = conf.find(key);
  if (it == conf.end()) return fallback;
  try {
    size_t used = 0;
    const double v = std::stod(it->second, &used);
    // Positive and finite, at most about 11 days (the store's deadlines add it to the clock); the attempts a whole
    // number of at least 2 (a node beats, and checks the others, once an interval: with one attempt, a check that
    // comes a little before the other's beat would count a healthy node lost).
    // Durations from 1 ms (the store's deadlines are whole milliseconds: less would be none at all).
    const bool in_range = used == it->second.size() && v >= (key == "keep_alive_max_attempt" ? 2 : 1e-3) && v <= 1e6;
    if (in_range && (key != "keep_alive_max_attempt" || v == std::floor(v))) return v;
  } catch (...) {
  }
  usage("bad value in --rdzv-conf: " + key + "=" + it->second);
}

// An elastic job: rounds of the launchers' rendezvous at --rdzv-endpoint (elastic/rendezvous.h).
int run_elastic(Options& o, std::vector<Standby>* pool) {
  namespace elastic = tandem::elastic;
  std::map<std::string, std::string> conf;
  for (const auto& item : absl::StrSplit(o.rdzv_conf, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.second.empty()) usage("bad --rdzv-conf entry '" + std::string(item) + "' (key=value)");
    conf[kv.first] = kv.second;
  }
  for (const auto& [k, v] : conf) {
    if (k != "join_timeout" && k != "last_call_timeout" && k != "keep_alive_interval" &&
        k != "keep_alive_max_attempt") {
      usage("unknown --rdzv-conf key '" + k +
            "' (join_timeout, last_call_timeout, keep_alive_interval, keep_alive_max_attempt)");
    }
  }
  std::string endpoint_host = o.rdzv_endpoint;
  int endpoint_port = o.rdzv_backend == "etcd" ? 2379 : 29400;  // etcd's client port; torchrun's c10d default
  if (auto colon = o.rdzv_endpoint.rfind(':'); colon != std::string::npos && o.rdzv_endpoint.back() != ']') {
    endpoint_host = o.rdzv_endpoint.substr(0, colon);
    endpoint_port = parse_int("--rdzv-endpoint", o.rdzv_endpoint.substr(colon + 1));
  }
  // An IPv6 address in brackets ([::1]:29400): the host is the address.
  if (endpoint_host.size() > 2 && endpoint_host.front() == '[' && endpoint_host.back() == ']') {
    endpoint_host = endpoint_host.substr(1, endpoint_host.size() - 2);
  }
  if (endpoint_port < 1 || endpoint_port > 65535) usage("bad port in --rdzv-endpoint '" + o.rdzv_endpoint + "'");
  if (o.max_nodes > 1 && !std::getenv("TANDEM_SECRET") && o.secret_file.empty()) {
    usage("a job on several nodes needs the same secret on each: set TANDEM_SECRET or --secret-file");
  }
  const std::string secret = job_secret(o);

  elastic::RendezvousOptions ro;
  ro.run_id = o.run_id;
  ro.min_nodes = o.min_nodes;
  ro.max_nodes = o.max_nodes;
  ro.nproc = o.nproc;
  ro.max_restarts = o.max_restarts;
  ro.join_timeout = absl::Seconds(conf_seconds(conf, "join_timeout", 600));
  ro.last_call_timeout = absl::Seconds(conf_seconds(conf, "last_call_timeout", 30));
  ro.keep_alive_interval = absl::Seconds(conf_seconds(conf, "keep_alive_interval", 5));
  ro.keep_alive_max_attempt = static_cast<int>(conf_seconds(conf, "keep_alive_max_attempt", 3));
  const absl::Duration lost_after = ro.keep_alive_interval * ro.keep_alive_max_attempt;
  if (lost_after > absl::Seconds(1e6)) {  // the store's deadlines add it to the clock
    usage("bad value in --rdzv-conf: keep_alive_interval x keep_alive_max_attempt is above 1e6 s");
  }
  ro.interrupted = [] { return g_signal != 0; };  // SIGTERM while waiting to join: leave at once
  ro.waiting = [&o, timeout = ro.join_timeout](int64_t round, int64_t joined) {
    std::fprintf(stderr,
                 "tandem-run: waiting in round %lld for the other nodes (%lld of %d to %d so far; join timeout %s)\n",
                 static_cast<long long>(round), static_cast<long long>(joined), o.min_nodes, o.max_nodes,
                 absl::FormatDuration(timeout).c_str());
  };
  if (!o.local_addr.empty()) {
    ro.host = o.local_addr;
  } else if (auto a = elastic::address_towards(endpoint_host); a.ok()) {
    ro.host = *a;
  } else {
    std::fprintf(stderr, "tandem-run: %s\n", a.status().ToString().c_str());
    return 1;
  }

  // The launcher on the endpoint's machine that binds its port first serves the store; the others use it.
  const std::string endpoint = tandem::rpc::net::join_host_port(endpoint_host, endpoint_port);
  std::unique_ptr<tandem::rpc::StoreServer> server;
  if (o.rdzv_backend == "c10d" && elastic::is_this_machine(endpoint_host)) {
    // Losing the race for the port is expected when several launchers start on the endpoint's machine: gRPC's log
    // of the failed bind is dropped; anything else it logs is printed.
    gpr_set_log_function([](gpr_log_func_args* args) {
      if (std::strstr(args->message, "No address added") != nullptr) return;
      std::fprintf(stderr, "tandem-run: grpc: %s (%s:%d)\n", args->message, args->file, args->line);
    });
    if (auto s = tandem::rpc::serve_store(endpoint, secret); s.ok()) {
      server = std::move(*s);
    } else if (s.status().code() != absl::StatusCode::kUnavailable) {  // in use: another launcher serves it
      std::fprintf(stderr, "tandem-run: %s\n", s.status().ToString().c_str());
      return 1;
    }
  }
  auto store = o.rdzv_backend == "etcd"
                   ? elastic::connect_etcd_store(endpoint, absl::ToChronoMilliseconds(lost_after))
                   : tandem::rpc::connect_store(endpoint, secret, absl::ToChronoMilliseconds(lost_after));
  elastic::Rendezvous rdzv(*store, ro);
  std::fprintf(stderr, "tandem-run: rendezvous '%s' at %s (%s), %d to %d nodes\n", o.run_id.c_str(), endpoint.c_str(),
               o.rdzv_backend == "etcd" ? "etcd"
               : server                 ? "served by this launcher"
                                        : "served by another launcher",
               o.min_nodes, o.max_nodes);

  // Ends this launcher: says it is done with the store; the one serving it waits for the others first.
  auto finish = [&](int code) {
    if (auto s = rdzv.leave(); !s.ok()) {
      std::fprintf(stderr, "tandem-run: could not record this node's leave in the rendezvous: %s\n",
                   s.ToString().c_str());
    }
    if (server) (void)rdzv.wait_all_left(lost_after);  // bounded; what it says on time-out changes nothing here
    return code;
  };
  // Ends this launcher on a signal: the round it is a member of (`node`; empty: none) ends as its leave.
  auto leave_on_signal = [&](const std::string& node, const std::string& why) {
    const int sig = g_signal;
    if (!node.empty()) end_round_as_leave(rdzv, node, sig);
    std::fprintf(stderr, "tandem-run: interrupted by signal %d%s\n", sig, why.c_str());
    return finish(128 + sig);
  };

  for (;;) {
    rdzv.options().master_port = free_port();  // a fresh port each round: never "address already in use"
    auto round = rdzv.join();
    if (!round.ok() && round.status().code() == absl::StatusCode::kCancelled && g_signal) {  // `interrupted`: left
      return leave_on_signal("", " while joining the rendezvous: " + std::string(round.status().message()));
    }
    if (!round.ok()) {
      std::fprintf(stderr, "tandem-run: rendezvous failed: %s\n", round.status().ToString().c_str());
      return 1;
    }
    Placement p;
    p.node_rank = round->node_rank;
    p.nnodes = round->nnodes;
    p.rank_offset = round->rank_offset;
    p.world = round->world_size;
    p.master_addr = round->master_addr;
    p.master_port = round->master_port;
    p.restart = round->restarts;
    std::fprintf(stderr, "tandem-run: round %lld: node %d of %d, ranks %d-%d of %d, restart %d\n",
                 static_cast<long long>(round->round), p.node_rank, p.nnodes, p.rank_offset,
                 p.rank_offset + o.nproc - 1, p.world, p.restart);
    const std::string node = "node " + std::to_string(p.node_rank) + " (" + ro.host + ")";
    Round r = run_round(o, p, secret, &rdzv, node, pool);

    if (g_signal) {
      // Ended already if the signal came while the workers ran (run_round); a later one ends it here.
      return leave_on_signal(node, "; stopped all ranks");
    }
    if (!r.error.empty()) {
      std::fprintf(stderr, "tandem-run: lost the rendezvous store at %s (%s): %s\n", endpoint.c_str(),
                   o.rdzv_backend == "etcd" ? "etcd"
                   : server                 ? "this launcher's"
                                            : "the launcher serving it may be gone",
                   r.error.c_str());
      return 1;
    }
    if (r.failed < 0 && !r.ended) {
      // Every worker here exited 0: the job is done when every node's did; until then this node keeps beating.
      if (auto s = rdzv.report_success(); !s.ok()) {
        std::fprintf(stderr, "tandem-run: rendezvous: %s\n", s.ToString().c_str());
        return 1;
      }
      for (;;) {
        auto all = rdzv.all_succeeded();
        if (all.ok() && *all) return finish(0);
        auto end = rdzv.monitor();
        if (!all.ok() || !end.ok()) {
          std::fprintf(stderr, "tandem-run: rendezvous: %s\n",
                       (!all.ok() ? all.status() : end.status()).ToString().c_str());
          return 1;
        }
        if (end->has_value()) {
          r.ended = (*end)->reason;
          break;
        }
        if (g_signal) {  // it leaves: the others re-form without it, not after its heartbeats stop (a failure)
          return leave_on_signal(node, "; this node's workers had finished");
        }
        std::this_thread::sleep_for(rendezvous_interval(o, rdzv));
      }
    }
    auto failures = rdzv.failures();
    if (!failures.ok()) {
      std::fprintf(stderr, "tandem-run: rendezvous: %s\n", failures.status().ToString().c_str());
      return 1;
    }
    const std::string mine = r.failed >= 0 ? failure_text(r, node) : "";
    std::string why = r.ended ? *r.ended : mine;
    if (!mine.empty() && why != mine) why += "; then " + mine;
    if (static_cast<int>(failures->size()) > o.max_restarts) {
      std::string all;
      for (const auto& f : *failures) all += (all.empty() ? "" : "; ") + f;
      if (o.max_restarts == 0) {
        std::fprintf(stderr, "tandem-run: %s\n", all.c_str());
      } else {
        std::fprintf(stderr, "tandem-run: gave up after %d restarts: %s\n", o.max_restarts, all.c_str());
      }
      return finish(r.failed >= 0 ? exit_code(r.status) : 1);
    }
    std::fprintf(stderr, "tandem-run: round %lld ended: %s; joining the next (%zu of %d restarts used)\n",
                 static_cast<long long>(round->round), why.c_str(), failures->size(), o.max_restarts);
  }
}

}  // namespace

// OMP_NUM_THREADS for the workers (and warm standbys), set in this process before any is forked (see the top).
void share_threads(const Options& o) {
  const char* set = std::getenv("OMP_NUM_THREADS");
  if (set != nullptr && *set != '\0') return;
  const int cpus = tandem::cluster::usable_cpus();
  const int share = std::max(1, cpus / std::max(1, o.nproc));
  setenv("OMP_NUM_THREADS", std::to_string(share).c_str(), 1);
  if (o.nproc > 1) {
    std::fprintf(stderr,
                 "tandem-run: OMP_NUM_THREADS=%d for each of the %d workers (%d CPUs usable here); set it to "
                 "choose\n",
                 share, o.nproc, cpus);
  }
}

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  // From here a reader that stops reading this launcher's output no longer stops it (tools/output_relay.h).
  if (!tandem::tools::relay_own_output())
    std::fprintf(
        stderr,
        "tandem-run: cannot relay its own output (no pipe or thread): a reader that stops reading it will stop the "
        "launcher\n");
  if (o.bind_cores) (void)launcher_cpus();  // read here, before any worker is forked
  share_threads(o);
  install_signal_handlers();
  // Warm standbys only when a restart can use them, and only for Tandem programs (which wait for their variables).
  const bool restarts = o.max_restarts > 0 || o.min_nodes != o.max_nodes;
  std::vector<Standby> standbys;
  std::vector<Standby>* pool = o.standby && restarts && supports_standby(o.command[0]) ? &standbys : nullptr;
  const int code = o.rdzv_backend == "static" ? run_static(o, pool) : run_elastic(o, pool);
  discard(standbys);
  return code;
}
