#!/usr/bin/env bash
# The README's Quick start: set up a Debian 12 machine (as root), build, and run the demo or the test suite.
#   bash scripts/run.sh demo    # the main example: parameter-server training on Fashion-MNIST, 3 local workers
#   bash scripts/run.sh test    # the whole test suite (ctest)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
case "$what" in
  demo) exec build/tandem-run --nproc-per-node 3 build/parameter_server ;;
  test) cd build && exec ctest -j"$(nproc)" --output-on-failure ;;
  *) echo "usage: bash scripts/run.sh demo|test" >&2; exit 2 ;;
esac
