#!/usr/bin/env bash
# Command lines (issue 18): every program given here answers --help with its flags and their defaults (exit 0), and
# refuses an unknown flag and a malformed value with a message naming it (exit not 0), before doing anything else.
#   bash tests/cli/flags.sh PROGRAM:FLAG:DEFAULT...    (FLAG one of the program's flags taking a number, DEFAULT its
#   default; tests/cli/CMakeLists.txt makes a test per program)
set -uo pipefail
fail=0
for spec in "$@"; do
  IFS=: read -r program flag default <<<"$spec"
  name="$(basename "$program")"
  # --help after the flag given twice: accepted (CLI11's default would refuse a repeated flag; bench/run.sh appends
  # flags to the user's; which value counts, the last by tools/flags.h, is not seen from here), and the help lists the
  # flag with its default. One start for both:
  # each start of a program on LibTorch costs about a second of CPU on a slow machine.
  help="$(timeout 20 "$program" "$flag" "$default" "$flag" "$default" --help 2>&1)"; rc=$?
  if [ "$rc" != 0 ] || ! grep -- "$flag" <<<"$help" | grep -qE -- "=$default( |\$)"; then
    echo "$name $flag $default $flag $default --help: exit $rc, expected the repeated flag accepted and $flag with"
    echo "its default (=$default) in the help:"; echo "$help"; fail=1
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
  [ "$fail" = 0 ] && echo "$name: --help, an unknown flag, a malformed value and a repeated flag as expected"
done
exit "$fail"
