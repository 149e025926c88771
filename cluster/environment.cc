#include "tandem/cluster/environment.h"

#include <unistd.h>

#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

extern char** environ;

namespace tandem::cluster {
namespace {

std::optional<std::string> get(const Env& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

absl::StatusOr<int> get_int(const Env& env, const std::string& name, int min, int max) {
  auto v = get(env, name);
  int n = 0;
  if (!v) return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, " is not set"));
  if (!absl::SimpleAtoi(*v, &n) || n < min || n > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", *v, "' is not a number in [", min, ", ", max, "]"));
  }
  return n;
}

// SLURM's master: MASTER_ADDR, else the first host of the step's (else the job's) node list; MASTER_PORT, else
// Lightning's 15000 + the job id's last four digits, so every task of the job derives the same port by itself.
absl::Status slurm_master(const Env& env, std::string* addr, int* port) {
  if (auto a = get(env, "MASTER_ADDR")) {
    *addr = *a;
  } else {
    auto list = get(env, "SLURM_STEP_NODELIST");
    if (!list) list = get(env, "SLURM_JOB_NODELIST");
    if (!list) return absl::InvalidArgumentError("SLURM_JOB_NODELIST is not set (and MASTER_ADDR is not either)");
    auto first = first_host(*list);
    if (!first.ok()) return first.status();
    *addr = *first;
  }
  if (get(env, "MASTER_PORT")) {
    auto p = get_int(env, "MASTER_PORT", 1, 65535);
    if (!p.ok()) return p.status();
    *port = *p;
  } else {
    // Slurm's job ids are 32-bit unsigned: a federation's carry the cluster's id in their top bits (above 2^31).
    auto id = get(env, "SLURM_JOB_ID");
    uint64_t n = 0;
    if (!id || !absl::SimpleAtoi(*id, &n) || n > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("SLURM_JOB_ID='", id.value_or(""), "' is not a job id (and MASTER_PORT is not set)"));
    }
    *port = 15000 + n % 10000;
  }
  return absl::OkStatus();
}

}  // namespace

Env process_env() {
  Env env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

absl::StatusOr<std::string> first_host(const std::string& nodelist) {
  std::string host;
  int depth = 0;
  for (size_t i = 0; i < nodelist.size(); ++i) {
    const char c = nodelist[i];
    if (c == ',' && depth == 0) break;  // the end of the first entry
    if (c == '[') {
      if (depth++ != 0) break;
      // The first number of the first range: "07" of "[07-09,12]".
      size_t j = i + 1;
      while (j < nodelist.size() && absl::ascii_isdigit(static_cast<unsigned char>(nodelist[j]))) ++j;
      if (j == i + 1) return absl::InvalidArgumentError(absl::StrCat("malformed SLURM node list '", nodelist, "'"));
      host += nodelist.substr(i + 1, j - i - 1);
      continue;
    }
    if (c == ']') {
      if (--depth != 0) break;
      continue;
    }
    if (depth == 0) host += c;
  }
  if (depth != 0 || host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("malformed SLURM node list '", nodelist, "'"));
  }
  return host;
}

absl::StatusOr<WorkerPlace> worker_place(const Env& env) {
  WorkerPlace p;
  if (get(env, "RANK")) {
    p.source = "torchrun";
    auto world = get_int(env, "WORLD_SIZE", 1, 1 << 20);
    if (!world.ok()) return world.status();
    p.world_size = *world;
    auto rank = get_int(env, "RANK", 0, p.world_size - 1);
    if (!rank.ok()) return rank.status();
    p.rank = *rank;
    // Unset: one node holds them all. Set but malformed: an error, never a silent 0 or 1.
    p.local_rank = p.rank;
    p.local_world_size = p.world_size;
    if (get(env, "LOCAL_RANK")) {
      auto local = get_int(env, "LOCAL_RANK", 0, p.world_size - 1);
      if (!local.ok()) return local.status();
      p.local_rank = *local;
    }
    if (get(env, "LOCAL_WORLD_SIZE")) {
      auto local_world = get_int(env, "LOCAL_WORLD_SIZE", 1, p.world_size);
      if (!local_world.ok()) return local_world.status();
      p.local_world_size = *local_world;
    }
    if (auto a = get(env, "MASTER_ADDR")) p.master_addr = *a;
    if (get(env, "MASTER_PORT")) {
      auto port = get_int(env, "MASTER_PORT", 0, 65535);
      if (!port.ok()) return port.status();
      p.master_port = *port;
    }
    return p;
  }
  if (get(env, "SLURM_PROCID")) {
    p.source = "slurm";
    auto world = get_int(env, "SLURM_NTASKS", 1, 1 << 20);
    if (!world.ok()) return world.status();
    p.world_size = *world;
    auto rank = get_int(env, "SLURM_PROCID", 0, p.world_size - 1);
    if (!rank.ok()) return rank.status();
    p.rank = *rank;
    auto local = get_int(env, "SLURM_LOCALID", 0, p.world_size - 1);
    if (!local.ok()) return local.status();
    p.local_rank = *local;
    // "2(x3),1": the first node's count; else the even split.
    int per_node = 0;
    auto tpn = get(env, "SLURM_NTASKS_PER_NODE");
    if (!tpn) tpn = get(env, "SLURM_STEP_TASKS_PER_NODE");
    if (tpn && absl::SimpleAtoi(tpn->substr(0, tpn->find_first_of("(,")), &per_node) && per_node > 0) {
      p.local_world_size = per_node;
    } else {
      int nodes = 1;
      if (get(env, "SLURM_NNODES")) {
        auto n = get_int(env, "SLURM_NNODES", 1, 1 << 20);
        if (!n.ok()) return n.status();
        nodes = *n;
      }
      p.local_world_size = (p.world_size + nodes - 1) / nodes;
    }
    if (auto s = slurm_master(env, &p.master_addr, &p.master_port); !s.ok()) return s;
    return p;
  }
  return absl::InvalidArgumentError(
      "no launcher's variables: neither RANK (torchrun, tandem-run) nor SLURM_PROCID (srun) is set");
}

absl::StatusOr<NodePlace> node_place(const Env& env) {
  NodePlace n;
  if (get(env, "SLURM_PROCID")) {
    n.source = "slurm";
    auto tasks = get_int(env, "SLURM_NTASKS", 1, 1 << 20);
    if (!tasks.ok()) return tasks.status();
    auto rank = get_int(env, "SLURM_PROCID", 0, *tasks - 1);
    if (!rank.ok()) return rank.status();
    n.nnodes = std::to_string(*tasks);
    n.node_rank = *rank;
    std::string addr;
    int port = -1;
    if (auto s = slurm_master(env, &addr, &port); !s.ok()) return s;
    n.master_addr = addr;
    n.master_port = port;
    return n;
  }
  if (get(env, "KUBERNETES_SERVICE_HOST") && get(env, "WORLD_SIZE")) {
    n.source = "kubernetes";
    auto world = get_int(env, "WORLD_SIZE", 1, 1 << 20);
    if (!world.ok()) return world.status();
    n.nnodes = std::to_string(*world);
    if (get(env, "RANK")) {
      auto rank = get_int(env, "RANK", 0, *world - 1);
      if (!rank.ok()) return rank.status();
      n.node_rank = *rank;
    }
    if (auto a = get(env, "MASTER_ADDR")) n.master_addr = *a;
    if (get(env, "MASTER_PORT")) {
      auto port = get_int(env, "MASTER_PORT", 1, 65535);
      if (!port.ok()) return port.status();
      n.master_port = *port;
    }
  }
  return n;
}

std::optional<std::string> pet_default(const std::string& flag, const Env& env) {
  std::string name = absl::AsciiStrToUpper(absl::StrReplaceAll(flag, {{"-", "_"}}));
  if (name.rfind("__", 0) == 0) name = name.substr(2);
  return get(env, "PET_" + name);
}

}  // namespace tandem::cluster
