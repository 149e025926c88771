#!/usr/bin/env bash
# The README's Quick start: set up a Debian 12 machine (as root), build, and run the demo or the test suite.
#   bash scripts/run.sh demo    # the main example: parameter-server training on Fashion-MNIST, 3 local workers
#   bash scripts/run.sh test    # the whole test suite (ctest): the main suite, then the `slow` tests
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
case "$what" in
  demo) exec build/tandem-run --nproc-per-node 3 build/parameter_server ;;
  # The main suite (under 30 minutes on 2 cores), then the tests labelled `slow` (the examples trained to the README's
  # accuracy, the 100,000-RRef test: about 10 minutes); both always run, and either failing fails the command.
  test)
    cd build
    rc=0
    ctest -j"$(nproc)" --output-on-failure -LE slow || rc=1
    ctest -j"$(nproc)" --output-on-failure -L slow || rc=1
    exit "$rc" ;;
  *) echo "usage: bash scripts/run.sh demo|test" >&2; exit 2 ;;
esac
