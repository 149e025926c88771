#!/usr/bin/env bash
# The README's API tour must be examples/rpc_hello.cc exactly (the build compiles the file, not the README).
set -euo pipefail
root="$1"
tour=$(sed -n '/<!-- example:rpc_hello begin -->/,/<!-- example:rpc_hello end -->/p' "$root/README.md" | sed '1,2d;$d' | sed '$d')
if [ "$tour" != "$(cat "$root/examples/rpc_hello.cc")" ]; then
  echo "README.md's tour differs from examples/rpc_hello.cc:" >&2
  diff <(echo "$tour") "$root/examples/rpc_hello.cc" >&2 || true
  exit 1
fi
echo "README tour matches examples/rpc_hello.cc"
