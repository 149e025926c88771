#!/usr/bin/env bash
# Command lines (issue 18): every program given here answers --help with its flags and their defaults (exit 0), and
# refuses an unknown flag and a malformed value with a message naming it (exit not 0), before doing anything else.
#   bash tests/cli/flags.sh PROGRAM:FLAG:DEFAULT...    (FLAG one of the program's flags taking a number, DEFAULT its default)
set -uo pipefail
fail=0
for spec in "$@"; do
  IFS=: read -r program flag default <<<"$spec"
  name="$(basename "$program")"
  help="$(timeout 20 "$program" --help 2>&1)"; rc=$?
  if [ "$rc" != 0 ] || ! grep -- "$flag" <<<"$help" | grep -qE -- "=$default( |\$)"; then
    echo "$name --help: exit $rc, expected $flag with its default (=$default) in:"; echo "$help"; fail=1
  fi
  out="$(timeout 20 "$program" --no-such-flag 1 2>&1)"; rc=$?
  if [ "$rc" = 0 ] || ! grep -q -- "--no-such-flag" <<<"$out"; then
    echo "$name --no-such-flag: exit $rc, expected an error naming it, got:"; echo "$out"; fail=1
  fi
  out="$(timeout 20 "$program" "$flag" not-a-number 2>&1)"; rc=$?
  if [ "$rc" = 0 ] || ! grep -q -- "not-a-number" <<<"$out"; then
    echo "$name $flag not-a-number: exit $rc, expected an error naming the value, got:"; echo "$out"; fail=1
  fi
  [ "$fail" = 0 ] && echo "$name: --help, an unknown flag and a malformed value as expected"
done
exit "$fail"
