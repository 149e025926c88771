#!/usr/bin/env bash
# tandem-run goes on when nobody reads its output (a paused pager, a stalled log collector): its stdout is a FIFO that
# a process reads 4 KiB of and then holds open without reading; its one worker prints 100 MB and exits 0. The launcher
# must relay what it can (the 4 KiB read are the worker's lines), drop the rest, and exit 0 within its 5 s drain bound
# (before, it blocked writing to its stdout, so it stopped reading its worker, which blocked too: the job never ended).
#   bash tests/cli/stalled_output.sh path/to/tandem-run
set -euo pipefail
run="$1"
dir="$(mktemp -d)"
holder=""
cleanup() {
  [ -z "$holder" ] || kill "$holder" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
mkfifo "$dir/out"
# Opens the FIFO for reading once the launcher opens it for writing; reads 4 KiB, then never again.
(head -c 4096 >"$dir/got"; exec sleep 300) <"$dir/out" &
holder=$!
start=$SECONDS
rc=0
timeout -k 5 60 "$run" --nproc-per-node 1 -- bash -c 'head -c 100000000 /dev/zero | tr "\0" x | fold -w 999' \
  >"$dir/out" 2>"$dir/err" || rc=$?
took=$((SECONDS - start))
if [ "$rc" -ne 0 ]; then
  echo "FAIL: tandem-run exited $rc after ${took} s (124: still running at the 60 s timeout); its stderr:" >&2
  cat "$dir/err" >&2
  exit 1
fi
if [ "$took" -gt 40 ]; then
  echo "FAIL: tandem-run took ${took} s" >&2
  exit 1
fi
if ! grep -q '^\[rank0\]: xxxxxxxxxx' "$dir/got"; then
  echo "FAIL: the 4 KiB read from tandem-run's stdout hold no line of its worker:" >&2
  head -c 300 "$dir/got" >&2
  exit 1
fi
echo "ok: tandem-run exited 0 after ${took} s with its stdout read for 4 KiB, then never again"
