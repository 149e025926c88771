#!/usr/bin/env bash
# Elastic jobs of several launchers on this machine (issue 14), each launcher a "node" of one process, meeting at a
# c10d-style rendezvous endpoint on 127.0.0.1 (port chosen at run time):
#   launchers.sh resume <tandem-run> <ddp_train>
#     The DDP example on 2 nodes x 1 process: rank 1 is SIGKILLed mid-epoch; the job restarts
#     (TORCHELASTIC_RESTART_COUNT=1), resumes from its last checkpoint, and ends with parameters bit-identical to an
#     uninterrupted 2-node run.
#   launchers.sh membership <tandem-run> <ddp_train>
#     --nnodes 1:2: one node starts alone; a second joins (the job re-forms with world size 2 and resumes from its
#     checkpoint); then the second node's launcher is SIGKILLed: the first carries on alone, resumes again and
#     finishes. The survivor re-forms within the heartbeat timeout plus one check and the monitor interval.
#   launchers.sh leave <tandem-run> <ddp_train>
#     --nnodes 1:2 with both nodes running; the second launcher is stopped with SIGTERM (a node drained on purpose):
#     it exits 143 after stopping its workers, and the first carries on alone without counting a restart.
#   launchers.sh leave <tandem-run> <ddp_train> slow
#     The same with the first launcher checking the rendezvous every 2 s: its worker fails (its peer is gone) before
#     it sees the round's end, and it still names the leave as the cause (the first end of a round wins).
#   launchers.sh leave-joining <tandem-run>
#     --nnodes 2 with one launcher, stopped with SIGTERM while it waits for the second: it leaves at once (exit 143).
#   launchers.sh exhausted <tandem-run>
#     A worker that always fails on 2 nodes: after --max-restarts 2 both launchers exit non-zero with one line naming
#     the three failures.
#   launchers.sh ports <tandem-run> <elastic_store_worker>
#     100 restarts in a row on one endpoint, each round's workers binding a fresh master port (rank 0 serves the job's
#     store there, as init_rpc does): never "address already in use".
# With RDZV_BACKEND=etcd the launchers meet on a real etcd (Debian's etcd-server) the script starts on 127.0.0.1,
# instead of the store one launcher serves.
set -euo pipefail
mode=$1 run=$2
dir=$(mktemp -d)
pids=()
# At exit, what this script started and bash has not reaped (`jobs -r`): a pid it has reaped (a launcher waited for,
# or one that exited) may name another process by now.
trap 'left=$(jobs -rp); [ -z "$left" ] || kill -9 $left 2>/dev/null || true; rm -rf "$dir"' EXIT
# tests/common/time_scale.h's factor (a sanitizer build sets it), rounded up, at least 1: it scales the slack of the
# waits below, never the rendezvous' own timeouts.
scale="$(awk -v s="${TANDEM_TEST_TIME_SCALE:-1}" 'BEGIN { s += 0; n = int(s); if (n < s) n++; print (n < 1 ? 1 : n) }')"
fail() {
  echo "launchers: $*" >&2
  for f in "$dir"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -60 "$f"; }; done
  exit 1
}
source "$(dirname "$0")/../common/jobs.sh"
port=$(free_port)
backend=${RDZV_BACKEND:-c10d}
if [ "$backend" = etcd ]; then
  peer=$(free_port)
  etcd --name t --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$port" \
    --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" --initial-cluster "t=http://127.0.0.1:$peer" \
    >"$dir/etcd.out" 2>&1 &
  for _ in $(seq 200); do
    python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null && break
    sleep 0.05
  done
fi
export TANDEM_SECRET=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
# Heartbeats every 0.5 s, a node lost after 4 missed (2 s); a round closes 1 s after it has MIN nodes.
conf=keep_alive_interval=0.5,keep_alive_max_attempt=4,last_call_timeout=1,join_timeout=60

# launch <log> <tandem-run flags...> -- <program...>: a launcher in the background; its pid is appended to pids.
launch() {
  local log=$1
  shift
  "$run" --nproc-per-node 1 --rdzv-backend "$backend" --rdzv-endpoint "127.0.0.1:$port" --rdzv-conf "$conf" \
    --monitor-interval 0.1 "$@" >"$log" 2>&1 &
  pids+=($!)
}
wait_for() {  # wait_for <seconds, scaled> <test command...>
  local limit=$1
  shift
  for _ in $(seq $((limit * scale * 20))); do "$@" && return 0; sleep 0.05; done
  return 1
}
# signal_job <signal> <pid>: signals a launcher this script started, if it still runs (bash has not reaped it: a
# reaped pid may name another process by now); a launcher that has exited already fails the test.
signal_job() {
  jobs -rp | grep -x "$2" >/dev/null || fail "launcher $2 had exited before it was sent $1"
  kill "$1" "$2"
}
# kill_worker <pid> <launcher> <rank>: SIGKILLs the worker <pid> through a pidfd, if it is still <launcher>'s child
# with RANK=<rank>: its pid, read from /proc before, may name another process by now (the worker exited and its
# launcher reaped it).
kill_worker() {
  python3 - "$@" <<'EOF'
import os, signal, sys
pid, launcher, rank = sys.argv[1:]
try:
    fd = os.pidfd_open(int(pid))  # this process from now on, whatever becomes of its pid
    # Read after the pidfd is open: if its process has gone since, the signal below fails (ESRCH) and kills nothing.
    with open(f"/proc/{pid}/stat") as f:
        ppid = f.read().rsplit(")", 1)[1].split()[1]
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    if ppid != launcher or f"RANK={rank}".encode() not in env:
        sys.exit(f"pid {pid} is no longer rank {rank} under launcher {launcher}")
    signal.pidfd_send_signal(fd, signal.SIGKILL)
except OSError as e:
    sys.exit(f"rank {rank} (pid {pid}): {e}")
EOF
}

case "$mode" in
resume)
  train=$3
  args=(--epochs 2 --limit 1280 --batch 32 --checkpoint-every 4)  # 20 steps per epoch and rank
  launch "$dir/plain0.log" --nnodes 2 --rdzv-id plain -- "$train" "${args[@]}" --checkpoint-dir "$dir/plain"
  launch "$dir/plain1.log" --nnodes 2 --rdzv-id plain -- "$train" "${args[@]}" --checkpoint-dir "$dir/plain"
  wait "${pids[0]}" || fail "the uninterrupted run failed (first launcher)"
  wait "${pids[1]}" || fail "the uninterrupted run failed (second launcher)"
  want=$(cat "$dir"/plain*.log | grep -o "final parameters: [0-9a-f]*") || fail "no hash from the uninterrupted run"

  pids=()
  launch "$dir/killed0.log" --nnodes 2 --max-restarts 1 --rdzv-id killed -- "$train" "${args[@]}" --checkpoint-dir "$dir/killed"
  launch "$dir/killed1.log" --nnodes 2 --max-restarts 1 --rdzv-id killed -- "$train" "${args[@]}" --checkpoint-dir "$dir/killed"
  # Once rank 1 has saved step 12 (epoch 1 of 2), SIGKILL it.
  wait_for 60 test -e "$dir/killed/step-000000000012/rank-1.ckpt" || fail "rank 1 never saved step 12"
  victim="" parent=""
  for l in "${pids[@]}"; do
    if [ -z "$victim" ]; then victim=$(worker_of "$l" 1) parent=$l; fi
  done
  [ -n "$victim" ] || fail "no rank 1 under the launchers"
  kill_worker "$victim" "$parent" 1 || fail "could not kill rank 1"
  for i in 0 1; do wait "${pids[$i]}" || fail "launcher $i of the restarted job failed"; done
  pids=()
  grep -q "rank 1 on node [01] (127.0.0.1) (pid $victim) failed with killed by signal 9 (Killed)" "$dir"/killed*.log ||
    fail "no launcher named the killed worker"
  for i in 0 1; do
    grep -q "round 1: node [01] of 2, ranks [01]-[01] of 2, restart 1" "$dir/killed$i.log" ||
      fail "launcher $i did not restart into round 1 with restart count 1"
  done
  grep -q "ddp: resumed from step [0-9]* (epoch 1, restart 1)" "$dir"/killed*.log || fail "the job did not resume mid-epoch"
  got=$(cat "$dir"/killed*.log | grep -o "final parameters: [0-9a-f]*") || fail "no hash from the restarted run"
  [ "$got" = "$want" ] || fail "parameters differ: uninterrupted '$want', restarted '$got'"
  grep -h "resumed from\|round 0 ended" "$dir"/killed*.log
  ;;

membership)
  train=$3
  args=(--epochs 2 --limit 12000 --batch 32 --checkpoint-every 8)
  launch "$dir/a.log" --nnodes 1:2 --max-restarts 3 --rdzv-id grow -- "$train" "${args[@]}" --checkpoint-dir "$dir/ckpt"
  a=${pids[0]}
  wait_for 60 grep -q "round 0: node 0 of 1" "$dir/a.log" || fail "the first node did not start alone"
  wait_for 60 test -e "$dir/ckpt/step-000000000016/rank-0.ckpt" || fail "the lone node never saved step 16"
  launch "$dir/b.log" --nnodes 1:2 --max-restarts 3 --rdzv-id grow -- "$train" "${args[@]}" --checkpoint-dir "$dir/ckpt"
  b=${pids[1]}
  wait_for 60 grep -q "round 1: node [01] of 2, ranks [01]-[01] of 2, restart 0" "$dir/a.log" ||
    fail "the job did not re-form with 2 nodes when the second joined"
  grep -q "round 0 ended: node 127.0.0.1 (launcher pid $b) is waiting to join" "$dir/a.log" ||
    fail "the first node did not say why round 0 ended"
  # Both resume from the lone node's checkpoint, each with its share of what was left of the epoch; wait for a
  # checkpoint of the 2-node job (rank 1 writes one), then kill the second node's launcher.
  wait_for 60 bash -c "ls '$dir'/ckpt/step-*/rank-1.ckpt >/dev/null 2>&1" || fail "the 2-node job never saved a checkpoint"
  killed_at=$(date +%s.%N)
  signal_job -9 "$b"
  wait_for 60 grep -q "round 1 ended" "$dir/a.log" || fail "the survivor never noticed"
  noticed_at=$(date +%s.%N)
  wait "$a" || fail "the survivor's job failed"
  pids=()
  grep -q "round 2: node 0 of 1, ranks 0-0 of 1, restart 1" "$dir/a.log" || fail "the survivor did not carry on alone"
  # Rank 0 prints the resume: in round 1 it may be on either node, in round 2 it is the survivor.
  [ "$(cat "$dir"/a.log "$dir"/b.log | grep -c "ddp: resumed from step")" -ge 2 ] || fail "the job did not resume twice"
  grep -q "ddp: resumed from step [0-9]* (epoch [12], restart 1)" "$dir/a.log" || fail "the survivor did not resume"
  grep -q "ddp: 2 ranks" "$dir"/a.log "$dir"/b.log || fail "the job never ran with 2 ranks"
  grep -q "final parameters" "$dir/a.log" || fail "the job did not finish"
  # Heartbeat timeout 2 s + one heartbeat interval between checks 0.5 s + monitor interval 0.1 s = 2.6 s: no process
  # waits longer for a lost node. (When the lost node was node 0, the survivor's worker fails sooner.) 3 s of slack
  # for this machine's scheduling, scaled (the 2.6 s run on the launchers' own timers); a hang would take the join
  # timeout.
  python3 -c "import sys; d = $noticed_at - $killed_at; b = 2.6 + 3 * $scale
print(f'lost node noticed after {d:.2f} s (bound {b:.1f} s)'); sys.exit(d > b)" ||
    fail "the survivor took too long to notice the lost node"
  grep -h "round . ended\|round .:\|resumed from" "$dir/a.log" "$dir/b.log"
  ;;

leave)
  train=$3
  args=(--epochs 2 --limit 12000 --batch 32 --checkpoint-every 8)
  monitor=0.1
  if [ "${4:-}" = slow ]; then
    # Heartbeats every 2 s (a node lost after 8 s), the first launcher's checks as seldom.
    conf=keep_alive_interval=2,keep_alive_max_attempt=4,last_call_timeout=1,join_timeout=60
    monitor=2
  fi
  launch "$dir/a.log" --monitor-interval "$monitor" --nnodes 1:2 --max-restarts 0 --rdzv-id leave -- "$train" "${args[@]}" --checkpoint-dir "$dir/ckpt"
  a=${pids[0]}
  wait_for 60 grep -q "round 0: node 0 of 1" "$dir/a.log" || fail "the first node did not start"
  launch "$dir/b.log" --nnodes 1:2 --max-restarts 0 --rdzv-id leave -- "$train" "${args[@]}" --checkpoint-dir "$dir/ckpt"
  b=${pids[1]}
  wait_for 60 grep -q "round 1: node [01] of 2" "$dir/b.log" || fail "the second node never joined"
  wait_for 60 bash -c "ls '$dir'/ckpt/step-*/rank-1.ckpt >/dev/null 2>&1" || fail "the 2-node job never saved"
  signal_job -TERM "$b"
  c=0
  wait "$b" || c=$?
  [ "$c" = 143 ] || fail "the stopped launcher exited $c, not 143"
  wait "$a" || fail "the remaining node's job failed (--max-restarts 0: a leave must not count as a failure)"
  pids=()
  grep -q "round 1 ended: node [01] (127.0.0.1) was stopped by signal 15" "$dir/a.log" ||
    fail "the remaining node did not say why the round ended"
  grep -q "round 2: node 0 of 1, ranks 0-0 of 1, restart 0" "$dir/a.log" || fail "the remaining node did not carry on alone"
  grep -q "final parameters" "$dir/a.log" || fail "the job did not finish"
  grep -h "round . ended" "$dir/a.log"
  ;;

leave-joining)
  # A launcher waiting for a second node is stopped (a pod drained before its job formed): it leaves at once with 143,
  # saying so, instead of waiting out the join timeout (60 s here) and failing then.
  launch "$dir/a.log" --nnodes 2 --rdzv-id lj -- true
  a=${pids[0]}
  # Once it has arrived in round 0 (it says it waits): a signal before that leaves "before joining", with nothing to
  # undo, and this test would not see a leave from a round.
  wait_for 30 grep -q "waiting in round 0 for the other nodes (1 of 2 to 2 so far" "$dir/a.log" ||
    fail "the launcher did not say it waits in round 0"
  signal_job -TERM "$a"
  c=0
  wait "$a" || c=$?
  pids=()
  [ "$c" = 143 ] || fail "the stopped launcher exited $c, not 143"
  grep -q "interrupted by signal 15 while joining the rendezvous: rendezvous 'lj': node 127.0.0.1 (launcher pid [0-9]*) left while joining round 0" \
    "$dir/a.log" || fail "the launcher did not say it left while joining"
  grep -h "interrupted" "$dir/a.log"
  ;;

exhausted)
  worker='echo "restart $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"; [ "$RANK" = 1 ] && exit 3; sleep 60'
  launch "$dir/n0.log" --nnodes 2 --max-restarts 2 --rdzv-id bad -- bash -c "$worker"
  launch "$dir/n1.log" --nnodes 2 --max-restarts 2 --rdzv-id bad -- bash -c "$worker"
  codes=()
  for i in 0 1; do
    c=0
    wait "${pids[$i]}" || c=$?
    codes+=("$c")
  done
  pids=()
  [ "${codes[0]}" != 0 ] && [ "${codes[1]}" != 0 ] || fail "exit codes ${codes[*]}: both launchers must fail"
  for r in 0 1 2; do grep -q "restart $r of 2" "$dir"/n*.log || fail "round $r did not run"; done
  one='rank 1 on node [01] \(127\.0\.0\.1\) \(pid [0-9]+\) failed with exit code 3'
  for i in 0 1; do
    grep -Eq "gave up after 2 restarts: $one; $one; $one\$" "$dir/n$i.log" ||
      fail "launcher $i has no summary line naming the three failures"
  done
  ;;

ports)
  store_worker=$3
  worker="\"$store_worker\" >/dev/null && [ \"\$TORCHELASTIC_RESTART_COUNT\" -ge 100 ]"
  launch "$dir/p0.log" --nnodes 2 --max-restarts 100 --rdzv-id ports -- bash -c "$worker"
  launch "$dir/p1.log" --nnodes 2 --max-restarts 100 --rdzv-id ports -- bash -c "$worker"
  for i in 0 1; do wait "${pids[$i]}" || fail "launcher $i failed"; done
  pids=()
  grep -q "round 100: node [01] of 2, ranks [01]-[01] of 2, restart 100" "$dir/p0.log" || fail "no 100th restart"
  # Rounds 0-99 fail on purpose whatever the worker does, so a master port that could not be bound shows only here:
  # gRPC's words, or the store's ("cannot serve a store on ...: the port is in use", store_worker.cc's rank 0).
  if grep -qiE "address already in use|port is in use|cannot serve a store" "$dir"/p*.log; then
    fail "a restart could not bind its master port"
  fi
  echo "100 restarts, $(grep -c 'round [0-9]* ended' "$dir/p0.log") rounds ended on the first launcher"
  ;;
*)
  fail "unknown mode $mode"
  ;;
esac
if [ "$backend" = etcd ]; then
  grep -q "rendezvous '.*' at 127.0.0.1:$port (etcd)" "$dir"/*.log || fail "the launchers did not meet on etcd"
fi
