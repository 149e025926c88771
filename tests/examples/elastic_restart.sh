#!/usr/bin/env bash
# tandem-run --max-restarts with the DDP example (issue 14, one node):
#   elastic_restart.sh resume <tandem-run> <ddp_train>
#     Rank 1 is SIGKILLed mid-epoch; the job restarts once (TORCHELASTIC_RESTART_COUNT=1), resumes from its last
#     checkpoint, and ends with parameters bit-identical to an uninterrupted run (the example prints their hash).
#   elastic_restart.sh resume-sharded <tandem-run> <ddp_train>
#     The same with the model fully sharded (--shard full).
#   elastic_restart.sh ps <tandem-run> <parameter_server>
#     The same with the parameter-server example (synchronous mode, a server and 2 trainers): trainer 2 is SIGKILLed;
#     the server resumes from its checkpoint, the trainers from its round, and the parameters end bit-identical.
#   elastic_restart.sh ps-async <tandem-run> <parameter_server>
#     The asynchronous mode: trainer 2 is SIGKILLed; the server resumes its model and each trainer its optimizer
#     state (held on the server) from the last common step, and the job finishes.
#   elastic_restart.sh exhausted <tandem-run>
#     A worker that always fails: after --max-restarts 2 the launcher exits with its code and one line naming all
#     three failures.
set -euo pipefail
mode=$1 run=$2
source "$(dirname "$0")/../common/jobs.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"; [ -n "${launcher:-}" ] && kill "$launcher" 2>/dev/null || true' EXIT
fail() { echo "elastic_restart: $*" >&2; for f in "$dir"/*.log; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done; exit 1; }

if [ "$mode" = exhausted ]; then
  code=0
  "$run" --nproc-per-node 1 --max-restarts 2 bash -c 'echo "restart $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"; exit 3' \
    >"$dir/out.log" 2>"$dir/err.log" || code=$?
  [ "$code" = 3 ] || fail "exit code $code, expected 3"
  for r in 0 1 2; do grep -q "restart $r of 2" "$dir/out.log" || fail "round $r did not run"; done
  [ "$(grep -c 'restarting every worker' "$dir/err.log")" = 2 ] || fail "expected 2 restarts"
  grep -q "gave up after 2 restarts: rank 0 (pid [0-9]*) failed with exit code 3; rank 0 (pid [0-9]*) failed with exit code 3; rank 0 (pid [0-9]*) failed with exit code 3" \
    "$dir/err.log" || fail "no summary line naming the three failures"
  exit 0
fi

# kill_and_resume <nproc> <victim rank> <file to wait for> <program args...>: an uninterrupted run, then one with
# --max-restarts 1 whose rank <victim> is SIGKILLed once <file> (under the checkpoint directory) exists; the restarted
# job must succeed, the launcher must report the restart, and both runs must print the same parameter hash (with
# SAME=0, for runs that are not reproducible, there is no uninterrupted run and no comparison).
# Leaves the second run's log in $dir/killed.log.
kill_and_resume() {
  local nproc=$1 rank=$2 file=$3
  shift 3
  if [ "${SAME:-1}" = 1 ]; then
    "$run" --nproc-per-node "$nproc" "$@" --checkpoint-dir "$dir/plain" >"$dir/plain.log" 2>&1 ||
      fail "the uninterrupted run failed"
    want=$(grep -o "final parameters: [0-9a-f]*" "$dir/plain.log") || fail "no hash from the uninterrupted run"
  fi
  "$run" --nproc-per-node "$nproc" --max-restarts 1 "$@" --checkpoint-dir "$dir/killed" >"$dir/killed.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1200); do [ -e "$dir/killed/$file" ] && break; sleep 0.05; done
  [ -e "$dir/killed/$file" ] || fail "$file was never saved"
  # The launcher keeps one warm standby per worker (tools/tandem_run.cc) a second into the round: wait for them, so
  # that the restart takes the standby path (the workers then get their variables before main).
  for _ in $(seq 200); do [ "$(pgrep -P "$launcher" | wc -l)" -ge $((2 * nproc)) ] && break; sleep 0.05; done
  local victim
  victim=$(worker_of "$launcher" "$rank" | tail -1)
  [ -n "$victim" ] || fail "no rank $rank under the launcher"
  kill -9 "$victim"
  local code=0
  wait "$launcher" || code=$?
  launcher=""
  [ "$code" = 0 ] || fail "the restarted job failed (exit code $code)"
  grep -q "rank $rank (pid $victim) failed with killed by signal 9 (Killed); restarting every worker (restart 1 of 1)" \
    "$dir/killed.log" || fail "the launcher did not report the restart"
  grep -q "tandem-run: $nproc of $nproc workers started from warm standbys" "$dir/killed.log" ||
    fail "the restart did not use the warm standbys"
  local got
  got=$(grep -o "final parameters: [0-9a-f]*" "$dir/killed.log") || fail "no hash from the restarted run"
  [ "${SAME:-1}" = 0 ] || [ "$got" = "$want" ] || fail "parameters differ: uninterrupted '$want', restarted '$got'"
}

if [ "$mode" = ps-async ]; then
  # Asynchronous (Hogwild) mode: each trainer's optimizer state on the server is saved and restored; the run is not
  # reproducible, so the test asks only that it resumes from the common step and finishes.
  SAME=0 kill_and_resume 3 2 step-000000000024/rank-0.ckpt "$3" --mode async --epochs 2 --limit 640 --batch 32 \
    --checkpoint-every 4
  grep -q "parameter server: resumed from round [0-9]*" "$dir/killed.log" || fail "the server did not resume"
  grep -q "trainers resume at round [0-9]* (epoch 2, restart 1)" "$dir/killed.log" || fail "the trainers did not resume"
  grep "resume" "$dir/killed.log"
  exit 0
fi

if [ "$mode" = ps ]; then
  # 20 rounds per epoch; once the server has saved round 24 (epoch 2 of 2), trainer 2 is SIGKILLed.
  kill_and_resume 3 2 step-000000000024/rank-0.ckpt "$3" --epochs 2 --limit 640 --batch 32 --checkpoint-every 4
  grep -q "parameter server: resumed from round [0-9]*" "$dir/killed.log" || fail "the server did not resume"
  grep -q "trainers resume at round [0-9]* (epoch 2, restart 1)" "$dir/killed.log" || fail "the trainers did not resume"
  grep "resume" "$dir/killed.log"
  exit 0
fi

# 20 steps per epoch and rank; once rank 1 has saved step 12 (epoch 1 of 2), it is SIGKILLed. resume-sharded: the
# model fully sharded (--shard full), each rank's shards and Adam state in its checkpoints.
extra=()
[ "$mode" = resume-sharded ] && extra=(--shard full)
kill_and_resume 2 1 step-000000000012/rank-1.ckpt "$3" --epochs 2 --limit 1280 --batch 32 --checkpoint-every 4 \
  "${extra[@]}"
grep -q "ddp: resumed from step [0-9]* (epoch 1, restart 1)" "$dir/killed.log" || fail "the job did not resume mid-epoch"
grep "resumed from" "$dir/killed.log"
