// cluster: where a process learns its place in a job from the environment its launcher gave it: torchrun's variables
// (tandem-run sets them), SLURM's (srun), and Kubeflow PyTorchJob's (a pod of a Kubernetes job).
//
//   auto place = tandem::cluster::worker_place();      // in a worker: rank, world size, master
//   auto node = tandem::cluster::node_place();         // in tandem-run: node count and rank, master, PET_* flags
//
// No LibTorch, no gRPC: tandem-run links it. Every function is thread-safe (reads only; the environment passed in,
// or a snapshot of this process's).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::cluster {

using Env = std::map<std::string, std::string>;
// A snapshot of this process's environment.
Env process_env();

// A worker's place in the job.
struct WorkerPlace {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // empty: not given (a job of one worker needs none)
  int master_port = -1;     // -1: not given
  std::string source;       // "torchrun" or "slurm"
};

// torchrun's variables when RANK is set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
// Else, when srun started this process (SLURM_PROCID is set): rank SLURM_PROCID, world SLURM_NTASKS, local rank
// SLURM_LOCALID, local world SLURM_NTASKS_PER_NODE's first entry (else SLURM_NTASKS / SLURM_NNODES); master the first
// host of SLURM_JOB_NODELIST (SLURM_STEP_NODELIST when set), port MASTER_PORT or 15000 + the last 4 digits of
// SLURM_JOB_ID (as PyTorch Lightning derives it); MASTER_ADDR, when set, wins. Errors (InvalidArgument) name the
// variable that is missing or malformed.
absl::StatusOr<WorkerPlace> worker_place(const Env& env = process_env());

// A launcher's place: one tandem-run per node.
struct NodePlace {
  std::optional<std::string> nnodes;  // "N" or "MIN:MAX"
  std::optional<int> node_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  std::string source;  // "slurm", "kubernetes", or "" when the environment gave nothing
};

// What the environment says about this node, for the flags the command line left out:
// - srun started this tandem-run as one of its tasks (SLURM_PROCID set): node count SLURM_NTASKS, node rank
//   SLURM_PROCID, master and port as for worker_place (run one task per node: `srun -N K --ntasks-per-node 1`);
// - else in a Kubernetes pod (KUBERNETES_SERVICE_HOST set) with a PyTorchJob's variables: node count WORLD_SIZE, node
//   rank RANK, MASTER_ADDR, MASTER_PORT. (Kubeflow's training operator from v1.7 sets WORLD_SIZE to pods x
//   nprocPerNode when nprocPerNode is a number; it also sets PET_NNODES, which tandem-run reads first.)
// torchrun's PET_<FLAG> variables are not read here: see pet_default.
absl::StatusOr<NodePlace> node_place(const Env& env = process_env());

// torchrun's rule for its flags: PET_<FLAG> (upper case, '-' as '_') is the default of --<flag>. Kubeflow sets
// PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT, PET_RDZV_BACKEND,
// PET_RDZV_ENDPOINT, PET_RDZV_ID, PET_RDZV_CONF, PET_MAX_RESTARTS. nullopt when unset or empty.
std::optional<std::string> pet_default(const std::string& flag, const Env& env = process_env());

// The first host of a SLURM node list: "node[07-09,12],gpu1" -> "node07" (zero padding kept). InvalidArgument when
// the list is empty or malformed.
absl::StatusOr<std::string> first_host(const std::string& nodelist);

}  // namespace tandem::cluster
