#!/usr/bin/env bash
# The README's Quick start: set up a Debian 12 machine (as root), build, and run the demo or the test suite.
#   bash scripts/run.sh demo    # the main example: parameter-server training on Fashion-MNIST, 3 local workers
#   bash scripts/run.sh test    # the whole test suite (ctest's tests, a suite's in one process)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
case "$what" in
  demo) exec build/tandem-run --nproc-per-node 3 build/parameter_server ;;
  # Every test ctest has, the `slow` ones (the examples trained to the README's accuracy, the 100,000-RRef test)
  # included and started first, each GoogleTest suite's tests in one process (scripts/ctest_by_suite.py: one start of
  # a test binary costs about 0.9 s of CPU here, LibTorch's initialisers, and there are 500 of them), each test within
  # its ctest timeout.
  test) exec python3 scripts/ctest_by_suite.py build -j "$(nproc)" ;;
  *) echo "usage: bash scripts/run.sh demo|test" >&2; exit 2 ;;
esac
