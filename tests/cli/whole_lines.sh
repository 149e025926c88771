#!/usr/bin/env bash
# tandem-run's output and error sent to one file (2>&1) hold whole lines only: its relay (tools/output_relay.h) writes
# each stream's lines whole, so a line of one never cuts a line of the other. Its worker prints 20000 lines of 3000
# bytes on each of its stdout and stderr at once (the launcher's stdio cuts its writes at 4 KiB, mid-line).
#   bash tests/cli/whole_lines.sh path/to/tandem-run
set -euo pipefail
run="$1"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
rc=0
timeout -k 5 120 "$run" --nproc-per-node 1 -- bash -c '
  o=$(head -c 3000 /dev/zero | tr "\0" o)
  e=$(head -c 3000 /dev/zero | tr "\0" e)
  for i in $(seq 20000); do echo "$o"; done &
  for i in $(seq 20000); do echo "$e" >&2; done
  wait' >"$out" 2>&1 || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "FAIL: tandem-run exited $rc; the end of its output:" >&2
  tail -c 2000 "$out" >&2
  exit 1
fi
# The launcher's own lines ("tandem-run: ...") may come too; every other line is one whole line of the worker.
o="$(head -c 3000 /dev/zero | tr '\0' o)"
e="$(head -c 3000 /dev/zero | tr '\0' e)"
if ! awk -v o="[rank0]: $o" -v e="[rank0]: $e" '
       /^tandem-run: / { next }
       $0 == o { ++no; next }
       $0 == e { ++ne; next }
       { if (++bad <= 3) print "cut or mixed: " substr($0, 1, 120) "... (" length($0) " bytes)" > "/dev/stderr" }
       END {
         if (bad > 0 || no != 20000 || ne != 20000) {
           printf "FAIL: %d lines cut or mixed; %d whole lines of o, %d of e (20000 each expected)\n", bad, no, ne > "/dev/stderr"
           exit 1
         }
       }' "$out"; then
  exit 1
fi
echo "ok: 40000 whole lines from two streams in one file"
