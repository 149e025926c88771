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
  # tandem-run's bad command lines exit 2 (before starting anything); the others with CLI11's code.
  if [ "$rc" = 0 ] || { [ "$name" = tandem-run ] && [ "$rc" != 2 ]; } || ! grep -q -- "--no-such-flag" <<<"$out"; then
    echo "$name --no-such-flag: exit $rc, expected an error naming it, got:"; echo "$out"; fail=1
  fi
  out="$(timeout 20 "$program" "$flag" not-a-number 2>&1)"; rc=$?
  if [ "$rc" = 0 ] || ! grep -q -- "not-a-number" <<<"$out"; then
    echo "$name $flag not-a-number: exit $rc, expected an error naming the value, got:"; echo "$out"; fail=1
  fi
  # A flag given twice is accepted, the last value counting (CLI11's default would refuse it; bench/run.sh appends
  # flags to the user's).
  out="$(timeout 20 "$program" "$flag" "$default" "$flag" "$default" --help 2>&1)"; rc=$?
  if [ "$rc" != 0 ]; then echo "$name $flag twice: exit $rc, expected it accepted:"; echo "$out"; fail=1; fi
  [ "$fail" = 0 ] && echo "$name: --help, an unknown flag, a malformed value and a repeated flag as expected"
done
exit "$fail"
