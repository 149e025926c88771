#!/usr/bin/env bash
# Tandem under a real SLURM (Debian's slurm-wlm + munge) started on this machine by tests/cluster/slurm.sh:
#  1. `srun -n 3 ddp_train`: three tasks, no tandem-run; each finds its rank, the world size and the master (first
#     host of the node list, a port from the job id) from srun's variables (cluster/environment.h);
#  2. `srun -n 1 tandem-run --nproc-per-node 2 ddp_train`: the launcher inside an allocation, one node of one task.
# Each run trains one epoch on a slice of Fashion-MNIST; srun exits 0 only when every task did, and rank 0 prints the
# final parameters line.
#   bash slurm_job.sh BUILD_DIR
# Exits 77 (ctest's skip) with the reason when this machine cannot run SLURM (not root, packages missing).
set -euo pipefail
build="$(cd "$1" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
if ! why="$(bash "$here/slurm.sh" check 2>&1)"; then echo "SKIPPED: $why"; exit 77; fi
dir="$(mktemp -d)"
trap 'bash "$here/slurm.sh" down "$dir"; rm -rf "$dir"' EXIT
bash "$here/slurm.sh" up "$dir/cluster"
eval "$(bash "$here/slurm.sh" env "$dir/cluster")"
# Not inside any other allocation, and no torchrun variables: the tasks must find everything in srun's.
unset SLURM_JOB_ID SLURM_JOBID RANK WORLD_SIZE MASTER_ADDR MASTER_PORT LOCAL_RANK
export TANDEM_SECRET="slurm-test-$$-$RANDOM"
fail=0

expect() {  # NAME COUNT PATTERN OUTPUT: PATTERN appears COUNT times
  local n
  n="$(grep -c -- "$3" <<<"$4" || true)"
  if [ "$n" != "$2" ]; then echo "FAIL $1: '$3' appears $n times, not $2, in:"; echo "$4"; fail=1; else echo "ok   $1"; fi
}

echo "== srun -n 3 ddp_train"
if out="$(timeout 600 srun -n 3 --overcommit --kill-on-bad-exit=1 "$build/ddp_train" --epochs 1 --limit 768 2>&1)"; then
  expect "three srun tasks form one job of 3 ranks" 1 "ddp: 3 ranks" "$out"
  expect "rank 0 finishes (srun: every task exited 0)" 1 "final parameters:" "$out"
else
  echo "FAIL srun -n 3 ddp_train exited non-zero:"; echo "$out"; fail=1
fi

echo "== srun -n 1 tandem-run --nproc-per-node 2 ddp_train"
if out="$(timeout 600 srun -n 1 --overcommit "$build/tandem-run" --nproc-per-node 2 "$build/ddp_train" --epochs 1 \
          --limit 512 2>&1)"; then
  expect "tandem-run takes its node from srun's variables" 1 "from slurm's variables: --nnodes 1 --node-rank 0" "$out"
  expect "its two workers form one job" 1 "ddp: 2 ranks" "$out"
  expect "rank 0 finishes (srun: tandem-run exited 0)" 1 "final parameters:" "$out"
else
  echo "FAIL srun tandem-run exited non-zero:"; echo "$out"; fail=1
fi
exit "$fail"
