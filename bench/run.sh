#!/usr/bin/env bash
# bench/run.sh NAME [flags...] — builds what NAME needs, runs Tandem's benchmark, then the same workload on the peer
# (PyTorch 1.13 torch.distributed, Debian's python3-torch) in its default configuration and with TCP forced. Prints one
# JSON object per line on stdout: {"bench":NAME,"impl":"tandem"|"torch"|"torch_tcp","metric":..,"value":..,"unit":..}.
# Flags are passed to both sides (e.g. --small 1000 --bulk 5 --async 10000). ROUNDS=N repeats both sides N times,
# interleaved (this VM's speed drifts between runs); `bench/summarize.py` gives medians and ratios of the lines.
# Benchmarks: rpc, rref, autograd, ps (peer: torch.distributed.rpc, default and TCP); collectives, ddp (peer: the Gloo
# process group, in its only configuration); pipeline, rl, hybrid (peers: PyTorch's RPC pipeline, RL and DDP+RPC tutorials'
# designs, TensorPipe defaults; hybrid also with TCP forced).
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
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1  # one intra-op thread per process, BLAS included
# bench TARGET NPROC PEER_SCRIPT [flags]: Tandem's program on NPROC workers (rank 0's JSON lines), then the peer in
# PyTorch's default configuration and (unless PEER_MODES says otherwise) with TCP forced.
bench() {
  local target="$1" nproc="$2" peer="$3"
  shift 3
  cmake --build build -j"$(nproc)" --target "$target" tandem-run >&2
  for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
    build/tandem-run --nproc-per-node "$nproc" "build/$target" "$@" | sed -n 's/^\[rank0\]: {/{/p'
    for mode in ${PEER_MODES:-default tcp}; do "$PY" "bench/$peer" "$mode" "$@"; done
  done
}
case "$name" in
  rpc) bench rpc_bench 2 peer_rpc.py "$@" ;;
  rref) bench rref_bench 3 peer_rref.py "$@" ;;
  autograd) bench autograd_bench 2 peer_autograd.py "$@" ;;
  ps) bench ps_bench 3 peer_ps.py "$@" ;;
  collectives) PEER_MODES=default bench collectives_bench 2 peer_collectives.py "$@" ;;
  ddp) PEER_MODES=default bench ddp_bench 2 peer_ddp.py "$@" ;;
  pipeline) PEER_MODES=default bench pipeline_bench 5 peer_pipeline.py "$@" ;;
  rl) PEER_MODES=default bench rl_bench 11 peer_rl.py "$@" ;;
  hybrid) bench hybrid_bench 4 peer_hybrid.py "$@" ;;
  *) echo "bench: unknown benchmark '$name' (known: rpc, rref, autograd, ps, collectives, ddp, pipeline, rl, hybrid)" >&2; exit 2 ;;
esac
