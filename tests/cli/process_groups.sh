#!/usr/bin/env bash
# What a worker starts ends with it, and a worker starts with the default signal dispositions:
#  1. Two workers, each a shell that starts a `sleep` and waits; rank 1 then fails. The sleep rank 1 left behind is
#     killed when rank 1 is reaped, and rank 0's is stopped with rank 0 (its process group, as torchrun's killpg):
#     before, both outlived the launcher (a wrapper script's training process kept the job's ports and files).
#  2. The worker's SIGPIPE is not ignored (the launcher ignores it for itself; an ignored disposition survives exec).
#  3. A launcher started with SIGCHLD ignored (a parent that set it so) still sees its worker exit: before, the kernel
#     reaped the worker itself and the launcher waited for ever.
#   bash tests/cli/process_groups.sh path/to/tandem-run
set -euo pipefail
run="$1"
dir="$(mktemp -d)"
cleanup() {
  for f in "$dir"/child*; do
    [ -e "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
  done
  rm -rf "$dir"
}
trap cleanup EXIT
# tests/common/time_scale.h's factor (a sanitizer build sets it), rounded up, at least 1.
scale="$(awk -v s="${TANDEM_TEST_TIME_SCALE:-1}" 'BEGIN { s += 0; n = int(s); if (n < s) n++; print (n < 1 ? 1 : n) }')"
bound=$((30 * scale))

# 1. The children of a failed worker and of the one stopped for it.
start=$SECONDS
rc=0
timeout -k 5 $((bound + 30)) "$run" --nproc-per-node 2 --grace-seconds 2 -- bash -c \
  'sleep 600 & echo $! >"'"$dir"'/child$RANK"; if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; wait' \
  >"$dir/out" 2>&1 || rc=$?
took=$((SECONDS - start))
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$took" -gt "$bound" ]; then
  echo "FAIL: tandem-run exited $rc after ${took} s (expected a failure within ${bound} s); its output:" >&2
  cat "$dir/out" >&2
  exit 1
fi
for r in 0 1; do
  [ -s "$dir/child$r" ] || { echo "FAIL: rank $r never started its child" >&2; cat "$dir/out" >&2; exit 1; }
  pid="$(cat "$dir/child$r")"
  # Killed: gone, or a zombie until its new parent reaps it (the state after the command name in /proc/PID/stat).
  state="$(sed -n 's/^.*) \(.\).*$/\1/p' "/proc/$pid/stat" 2>/dev/null || true)"
  if [ -n "$state" ] && [ "$state" != Z ]; then
    echo "FAIL: the sleep rank $r started (pid $pid) outlived tandem-run" >&2
    exit 1
  fi
done
echo "ok: the processes both workers started ended with them (tandem-run exited $rc after ${took} s)"

# 2. SIGPIPE (signal 13: bit 0x1000 of SigIgn) is not ignored in the worker.
"$run" --nproc-per-node 1 -- bash -c 'awk "/^SigIgn/ {print \$2}" /proc/self/status' >"$dir/ign"
ign="$(sed -n 's/^\[rank0\]: //p' "$dir/ign")"
if [ -z "$ign" ] || (((16#$ign & 0x1000) != 0)); then
  echo "FAIL: the worker's ignored signals are '$ign' (SIGPIPE must not be among them)" >&2
  exit 1
fi
echo "ok: the worker's SIGPIPE is not ignored (SigIgn $ign)"

# 3. SIGCHLD ignored by the launcher's parent.
start=$SECONDS
rc=0
timeout -k 5 "$bound" python3 -c '
import os, signal, sys
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
os.execv(sys.argv[1], sys.argv[1:])' "$run" --nproc-per-node 1 -- true >"$dir/out" 2>&1 || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "FAIL: with SIGCHLD ignored, tandem-run exited $rc after $((SECONDS - start)) s (124: still running):" >&2
  cat "$dir/out" >&2
  exit 1
fi
echo "ok: with SIGCHLD ignored by its parent, tandem-run saw its worker end"
