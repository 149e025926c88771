#!/usr/bin/env bash
# bench/run.sh NAME [flags...] — builds what NAME needs, runs Tandem's benchmark, then the same workload on the peer
# (PyTorch 1.13 torch.distributed, Debian's python3-torch) in its default configuration and with TCP forced. Prints one
# JSON object per line on stdout: {"bench":NAME,"impl":"tandem"|"torch"|"torch_tcp","metric":..,"value":..,"unit":..}.
# Flags are passed to both sides (e.g. --small 1000 --bulk 5 --async 10000).
# Benchmarks: rpc, rref.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: bench/run.sh NAME [flags]}"
shift
bash scripts/setup.sh >&2
PY=/usr/bin/python3  # Debian's interpreter: python3-torch installs there, whatever python3 is first on PATH
if ! "$PY" -c "import torch.distributed.rpc" 2>/dev/null; then
  echo "bench: installing python3-torch for the PyTorch peer" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-torch >/dev/null
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_BENCH=ON >/dev/null
export OMP_NUM_THREADS=1
case "$name" in
  rpc)
    cmake --build build -j"$(nproc)" --target rpc_bench tandem-run >&2
    build/tandem-run --nproc-per-node 2 build/rpc_bench "$@" | sed -n 's/^\[rank0\]: {/{/p'
    "$PY" bench/peer_rpc.py default "$@"
    "$PY" bench/peer_rpc.py tcp "$@"
    ;;
  rref)
    cmake --build build -j"$(nproc)" --target rref_bench tandem-run >&2
    build/tandem-run --nproc-per-node 3 build/rref_bench "$@" | sed -n 's/^\[rank0\]: {/{/p'
    "$PY" bench/peer_rref.py default "$@"
    "$PY" bench/peer_rref.py tcp "$@"
    ;;
  *) echo "bench: unknown benchmark '$name' (known: rpc, rref)" >&2; exit 2 ;;
esac
