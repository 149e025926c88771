#!/usr/bin/env bash
# The parameter-server example refuses flags it cannot train with at its command line, before any work (so no
# launcher is needed here), exiting not 0 with a message naming the flags and their values:
#   ps_bad_flags.sh <parameter_server>
#   --limit 10 --batch 64: no trainer has a full batch (it was a division by zero, SIGFPE, at the first epoch);
#   --checkpoint-every 0: no interval between checkpoints (ServerOptions refuses it too; the help says "rounds between
#   checkpoints", not "0: never").
set -uo pipefail
ps=$1
fail=0
# refused <pattern> <flags...>: the program exits not 0 and its output matches <pattern> (an extended regex).
refused() {
  local pattern=$1 out rc
  shift
  out="$(timeout 20 "$ps" "$@" 2>&1)"
  rc=$?
  if [ "$rc" = 0 ] || ! grep -qE -- "$pattern" <<<"$out"; then
    echo "parameter_server $*: exit $rc, expected an error matching '$pattern', got:"
    echo "$out"
    fail=1
  else
    echo "parameter_server $*: refused (exit $rc): $(grep -m1 -E -- "$pattern" <<<"$out")"
  fi
}
refused "--limit 10 is less than --batch 64" --limit 10 --batch 64
refused "--checkpoint-every: Value 0 not in range" --checkpoint-every 0
exit "$fail"
