#!/usr/bin/env bash
# The parameter-server example's synchronous round when a trainer hangs (issue 15's leftover: the round had no
# deadline):
#   ps_round_gives_up.sh <tandem-run> <parameter_server>
# Trainer 2 is stopped (SIGSTOP) mid-epoch. Trainer 1's backward waits in the round; the round gives up before
# trainer 1's call would time out (--rpc-timeout 10) and fails it with an error naming trainer 2, trainer 1 exits 1 with
# that error (and tells the server, which ends too), and the launcher ends the job.
set -euo pipefail
run=$1 ps=$2
source "$(dirname "$0")/../common/jobs.sh"
dir=$(mktemp -d)
victim=""
cleanup() {
  if [ -n "${launcher:-}" ]; then kill "$launcher" 2>/dev/null || true; fi
  if [ -n "$victim" ]; then kill -CONT "$victim" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "ps_round_gives_up: $*" >&2; cat "$dir/job.log" >&2; exit 1; }

"$run" --nproc-per-node 3 "$ps" --epochs 1 --limit 6400 --batch 32 --rpc-timeout 10 --checkpoint-dir "$dir/ckpt" \
  --checkpoint-every 4 >"$dir/job.log" 2>&1 &
launcher=$!
# Once the server has saved two checkpoints (rounds 4 and 8, or later: it keeps the last two), the trainers are in
# the middle of the epoch (200 rounds).
saved() { [ "$(ls -d "$dir"/ckpt/step-* 2>/dev/null | wc -l)" -ge 2 ]; }
for _ in $(seq 1200); do
  saved && break
  kill -0 "$launcher" 2>/dev/null || fail "the job ended before round 8"
  sleep 0.05
done
saved || fail "round 8 was never saved"
victim=$(worker_of "$launcher" 2 | tail -1)
[ -n "$victim" ] || fail "no rank 2 under the launcher"
kill -STOP "$victim"
code=0
wait "$launcher" || code=$?
launcher="" victim=""
[ "$code" != 0 ] || fail "the job succeeded with a trainer stopped"
# Trainer 1's own error (the server reports it too, and may exit first: report_failure()).
grep -q "^\[rank1\]: parameter_server: .*parameter server: round [0-9]* waited .* for 1 of its 2 trainers (trainer2 (rank 2)), and gives up before the calls of those that came (trainer1 (rank 1)) time out" \
  "$dir/job.log" || fail "trainer 1's error does not name trainer 2"
grep -m2 "gives up" "$dir/job.log"
