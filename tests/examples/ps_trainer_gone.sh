#!/usr/bin/env bash
# The parameter-server example's server when a trainer dies where no launcher ends the job: the server and trainer 1
# under one tandem-run (node 0), trainers 2 and 3 under another (node 1), as on two machines:
#   ps_trainer_gone.sh <tandem-run> <parameter_server>
# Once training runs, trainer 2's process is killed (SIGKILL). Its launcher ends (and stops trainer 3); node 0's
# does not know. The server (asynchronous mode: trainer 1 does not wait for trainer 2) must fail within seconds naming
# trainer 2, not wait for it (it waited 2 h).
set -euo pipefail
run=$1 ps=$2
source "$(dirname "$0")/../common/jobs.sh"
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "ps_trainer_gone: $*" >&2
  for f in "$dir"/*.log; do echo "--- $f" >&2; tail -40 "$f" >&2; done
  exit 1
}
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/secret"
port=$(free_port)
# Many epochs: trainer 2 is killed long before it could finish (and call done()).
flags=(--mode async --epochs 1000 --limit 640 --batch 32 --rpc-timeout 60)
job=(--nnodes 2 --master-addr 127.0.0.1 --master-port "$port" --secret-file "$dir/secret")
"$run" "${job[@]}" --node-rank 0 --nproc-per-node 2 "$ps" "${flags[@]}" >"$dir/node0.log" 2>&1 &
node0=$!
pids+=("$node0")
"$run" "${job[@]}" --node-rank 1 --nproc-per-node 2 "$ps" "${flags[@]}" >"$dir/node1.log" 2>&1 &
node1=$!
pids+=("$node1")
# Training runs once trainer 1 has finished an epoch (it prints one line per epoch).
for _ in $(seq 1200); do
  grep -q "epoch 1/" "$dir/node0.log" && break
  kill -0 "$node0" 2>/dev/null || fail "node 0 ended before the first epoch"
  sleep 0.1
done
grep -q "epoch 1/" "$dir/node0.log" || fail "no epoch in 120 s"
victim=$(worker_of "$node1" 2 | tail -1)
[ -n "$victim" ] || fail "no rank 2 under node 1's launcher"
kill -KILL "$victim"
start=$SECONDS
# Bounded, so that a server that keeps waiting fails here with both logs, not at ctest's timeout without them.
while kill -0 "$node0" 2>/dev/null && [ $((SECONDS - start)) -lt 60 ]; do sleep 0.2; done
kill -0 "$node0" 2>/dev/null && fail "node 0 still runs 60 s after trainer 2 was killed"
code=0
wait "$node0" || code=$?
took=$((SECONDS - start))
[ "$code" != 0 ] || fail "node 0 succeeded with a trainer gone"
grep -q "^\[rank0\]: parameter_server: UNAVAILABLE: parameter server: trainer2 (rank 2) has not finished and does not answer: " \
  "$dir/node0.log" || fail "the server's error does not name trainer 2"
# A dead peer's connection is refused at once; the probe's timeout (--rpc-timeout 60) bounds the rest.
[ "$took" -le 30 ] || fail "the server took ${took} s to notice"
grep -m1 "does not answer" "$dir/node0.log"
echo "ps_trainer_gone: the server ended ${took} s after trainer 2 was killed"
