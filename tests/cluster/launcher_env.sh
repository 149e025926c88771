#!/usr/bin/env bash
# tandem-run takes the job's shape from the cluster's variables when its flags are left out (cluster/environment.h):
# Kubeflow's PET_* (torchrun's flag defaults), a PyTorchJob pod's WORLD_SIZE/RANK/MASTER_*, and srun's SLURM_*. Each
# case runs tandem-run with `env` as the program and checks the variables its workers got.
#   bash launcher_env.sh TANDEM_RUN
set -euo pipefail
run="$1"
fail=0
# check NAME "WANT ..." ENV_ASSIGNMENTS... -- TANDEM_RUN_FLAGS...: every WANT ("#" for a space) is in the output
# (a WANT starting "]:#" is a variable at the start of a worker's line: PET_MASTER_ADDR=... does not match it).
check() {
  local name="$1" want="$2"; shift 2
  local envs=() flags=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  flags=("$@")
  local out
  if ! out="$(env -i PATH="$PATH" TANDEM_SECRET=s "${envs[@]}" "$run" "${flags[@]}" /usr/bin/env 2>&1)"; then
    echo "FAIL $name: tandem-run failed: $out"; fail=1; return
  fi
  local w
  for w in $want; do
    if ! grep -qF -- "${w//#/ }" <<<"$out"; then echo "FAIL $name: no '$w' in:"; echo "$out"; fail=1; return; fi
  done
  echo "ok   $name"
}
check "PET_* as flag defaults (Kubeflow, plain job)" \
  "[rank2]:#RANK=2 [rank3]:#RANK=3 ]:#WORLD_SIZE=4 ]:#GROUP_RANK=1 ]:#MASTER_ADDR=127.0.0.1 ]:#MASTER_PORT=29999 from#PET_" \
  PET_NNODES=2 PET_NODE_RANK=1 PET_NPROC_PER_NODE=2 PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT=29999 -- 
check "a flag wins over its PET_ variable" \
  "[rank1]:#RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1" \
  PET_NNODES=2 PET_NODE_RANK=1 PET_NPROC_PER_NODE=3 PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT=29999 -- --nproc-per-node 1
check "a PyTorchJob pod's WORLD_SIZE and RANK are the node count and rank" \
  "[rank2]:#RANK=2 WORLD_SIZE=4 GROUP_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=23456 from#kubernetes" \
  KUBERNETES_SERVICE_HOST=10.96.0.1 WORLD_SIZE=2 RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=23456 -- --nproc-per-node 2
check "srun's task is one node: SLURM_PROCID of SLURM_NTASKS, master from the node list and job id" \
  "[rank1]:#RANK=1 WORLD_SIZE=2 GROUP_RANK=1 MASTER_ADDR=localhost MASTER_PORT=15077 from#slurm" \
  SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_JOB_NODELIST=localhost,other SLURM_JOB_ID=90077 -- --nproc-per-node 1
# A malformed variable is an error naming it, before anything starts.
if out="$(env -i PATH="$PATH" TANDEM_SECRET=s SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_JOB_NODELIST='n[' SLURM_JOB_ID=1 \
          "$run" --nproc-per-node 1 /usr/bin/env 2>&1)"; then
  echo "FAIL a malformed node list was accepted: $out"; fail=1
elif ! grep -q "malformed SLURM node list 'n\['" <<<"$out"; then
  echo "FAIL the error does not name the node list: $out"; fail=1
else
  echo "ok   a malformed SLURM_JOB_NODELIST is an error naming it"
fi
exit "$fail"
