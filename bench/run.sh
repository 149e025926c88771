#!/usr/bin/env bash
# bench/run.sh NAME [flags...] — builds what NAME needs, runs Tandem's benchmark, then the same workload on the peer
# (PyTorch 1.13 torch.distributed, Debian's python3-torch) in its default configuration and with TCP forced. Prints one
# JSON object per line on stdout: {"bench":NAME,"impl":"tandem"|"torch"|"torch_tcp","metric":..,"value":..,"unit":..}.
# Flags are passed to both sides (e.g. --small 1000 --bulk 5 --async 10000). ROUNDS=N repeats both sides N times,
# interleaved (this VM's speed drifts between runs); `bench/summarize.py` gives medians and ratios of the lines.
# Benchmarks: rpc, rref, autograd, ps (peer: torch.distributed.rpc, default and TCP; ps also the tutorial's locked
# design, "torch_tutorial"); collectives, ddp (peer: the Gloo
# process group, in its only configuration); fsdp (Tandem's DDP, ZeRO-2 and fully sharded; peer: DDP, and DDP with
# ZeroRedundancyOptimizer); pipeline, rl, hybrid (peers: PyTorch's RPC pipeline, RL and DDP+RPC
# tutorials' designs, TensorPipe defaults; hybrid also with TCP forced); elastic (peer: torchrun, the same DDP job
# restarted after a worker's SIGKILL; bench/elastic_driver.py); hosts (rpc and collectives between two test hosts,
# then small round trips with 1 ms added each way, against raw TCP: see hosts_bench below; exits 77 when this machine
# cannot make test hosts); bulk-threshold (Tandem alone: one tensor per call through the socket and by the same-host
# bulk path, by size).
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
# The cores, asked first: coreutils' nproc honours OMP_NUM_THREADS, and the builds below would run on one.
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1  # one intra-op thread per process, BLAS included
# Both sides keep the memory they free (docs/deploy.md, "Memory"): with glibc's defaults every large tensor PyTorch
# receives or allocates is faulted in afresh, at ~10 us a page on these VMs, which cut its 64 MiB RPC transfer from
# 5.2 to 0.17 GB/s in one run here (ps keeps an arena per thread: see there). BENCH_GLIBC_DEFAULTS=1 measures with
# the defaults instead.
if [ "${BENCH_GLIBC_DEFAULTS:-0}" != 1 ]; then
  export MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824
fi
# bench TARGET NPROC PEER_SCRIPT [flags]: Tandem's program on NPROC workers (rank 0's JSON lines), then the peer in
# PyTorch's default configuration and (unless PEER_MODES says otherwise) with TCP forced. BIND_CORES=1: every rank of
# both sides bound to its share of the CPUs (tandem-run --bind-cores 1; the peer's launch in bench/peer_common.py).
bench() {
  local target="$1" nproc="$2" peer="$3"
  shift 3
  cmake --build build -j"$cores" --target "$target" tandem-run >&2
  for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
    build/tandem-run $([ "${BIND_CORES:-}" = 1 ] && echo --bind-cores 1) --nproc-per-node "$nproc" "build/$target" "$@" | sed -n 's/^\[rank0\]: {/{/p'
    for mode in ${PEER_MODES:-default tcp}; do
      # MODE+DESIGN: the peer in MODE with --design DESIGN (bench/peer_ps.py's tutorial design)
      if [[ $mode == *+* ]]; then
        "$PY" "bench/$peer" "${mode%+*}" --design "${mode#*+}" "$@"
      else
        "$PY" "bench/$peer" "$mode" "$@"
      fi
    done
  done
}

# `bench/run.sh hosts` (issue 19). Two test hosts (scripts/hosts.sh: network namespaces on a bridge, so every byte
# between the ranks crosses a TCP/IP path); rank 0 in host 0, rank 1 in host 1, each process started on its own host.
# Lines carry "bench":"hosts" and metric names prefixed hosts_ (hosts_delay_ under the delay); impl is
#   raw_tcp          tcp_pingpong: blocking 1-byte round trips, the floor under a small call on this path, and one
#                    connection's transfer of the bulk size for a 1-byte answer in 256 KiB sends (the best size
#                    measured here: one send of 64 MiB moves 2 GB/s, 256 KiB ones 5.5), the floor under the bulk figure
#   tandem           rpc_bench and collectives_bench on Tandem's default transport (between hosts: the direct channel's
#                    TCP route), one tandem-run per host (--nnodes 2 --node-rank R)
#   tandem_grpc      rpc_bench with TANDEM_TRANSPORT=grpc (collectives use Gloo's connections whatever the transport)
#   tandem_tls       rpc_bench with TLS between the hosts (scripts/hosts.sh tls: a job with TLS sends every call
#                    through gRPC with TLS)
#   torch, torch_tcp peer_rpc.py in its default configuration and with TCP forced; peer_collectives.py (Gloo). Each
#                    peer process gets its own pid namespace, as on two machines: else TensorPipe's CMA channel (same
#                    kernel, same pid namespace) moves tensors between the "hosts" by memory copy, off the link, and
#                    does so even with TCP forced.
# Then DELAY_US (default 1000) is added each way: in each host a delay_relay behind an nftables redirect of the TCP
# connections it opens to the other host. Measured: raw_tcp, tandem, tandem_grpc and torch_tcp small round trips
# (rpc flags plus --bulk 0 --async 0), and hosts_delay_rtt_ratio = tandem's p50 / raw_tcp's p50.
# Flags go to rpc_bench and peer_rpc.py (--small also sets tcp_pingpong's --iters); COLL_ITERS (default 20) is the
# collectives' --iters; STEP_TIMEOUT (default 900) bounds each step in seconds.
hosts_bench() {
  local why
  if ! why="$(bash scripts/hosts.sh check 2>&1)"; then
    echo "bench: hosts: skipped: $why" >&2
    exit 77
  fi
  cmake --build build -j"$cores" --target rpc_bench collectives_bench tandem-run delay_relay tcp_pingpong >&2
  step_timeout="${STEP_TIMEOUT:-900}" delay_us="${DELAY_US:-1000}" hn="bh$$"
  tmp="$(mktemp -d)"
  trap 'delay_off; bash scripts/hosts.sh down "$hn"; rm -rf "$tmp"' EXIT
  trap 'exit 130' INT TERM
  bash scripts/hosts.sh up "$hn" 2
  h0="$(bash scripts/hosts.sh addr "$hn" 0)" h1="$(bash scripts/hosts.sh addr "$hn" 1)"
  # Tandem: a job on several nodes needs one secret on each. PyTorch: the store on host 0, TensorPipe and Gloo on eth0.
  TANDEM_SECRET="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
  export TANDEM_SECRET TANDEM_BENCH_MASTER_ADDR="$h0" TP_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0
  local small=5000 bulk=20 bulk_mib=64 coll=(--iters "${COLL_ITERS:-20}") a prev=""
  for a in "$@"; do
    [ "$prev" != --small ] || small="$a"
    [ "$prev" != --bulk ] || bulk="$a"
    [ "$prev" != --bulk-mib ] || bulk_mib="$a"
    prev="$a"
  done
  bash scripts/hosts.sh tls "$tmp"
  for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
    note "round $round: raw TCP, Tandem (default, gRPC and TLS) and PyTorch (default and TCP) rpc, collectives"
    raw_tcp hosts_ --iters "$small" --size 1
    ((bulk == 0)) ||
      raw_tcp hosts_ --iters "$bulk" --warmup 2 --size $((bulk_mib << 20)) --reply 1 --chunk $((256 << 10))
    tandem_pair hosts_ tandem rpc_bench "$@"
    TANDEM_TRANSPORT=grpc tandem_pair hosts_ tandem_grpc rpc_bench "$@"
    TANDEM_TLS_CERT="$tmp/node.crt" TANDEM_TLS_KEY="$tmp/node.key" TANDEM_TLS_CA="$tmp/ca.crt" \
      tandem_pair hosts_ tandem_tls rpc_bench "$@"
    for mode in default tcp; do peer_pair hosts_ peer_rpc.py "$mode" "$@"; done
    tandem_pair hosts_ tandem collectives_bench "${coll[@]}"
    peer_pair hosts_ peer_collectives.py default "${coll[@]}"

    note "round $round: small round trips with ${delay_us} us added each way"
    delay_on
    {
      raw_tcp hosts_delay_ --iters "$small" --size 1
      tandem_pair hosts_delay_ tandem rpc_bench "$@" --bulk 0 --async 0
      TANDEM_TRANSPORT=grpc tandem_pair hosts_delay_ tandem_grpc rpc_bench "$@" --bulk 0 --async 0
      peer_pair hosts_delay_ peer_rpc.py tcp "$@" --bulk 0 --async 0
    } | tee "$tmp/delay.jsonl"
    delay_off
    "$PY" - "$tmp/delay.jsonl" "$delay_us" <<'EOF'
import json, sys
v = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    v[d["impl"], d["metric"]] = d["value"]
tandem, raw = v["tandem", "hosts_delay_small_rtt_p50_us"], v["raw_tcp", "hosts_delay_raw_tcp_rtt_p50_us"]
print(json.dumps({"bench": "hosts", "impl": "tandem", "metric": "hosts_delay_rtt_ratio",
                  "value": round(tandem / raw, 3), "unit": "x", "tandem_small_rtt_p50_us": tandem,
                  "raw_tcp_rtt_p50_us": raw, "delay_us_each_way": int(sys.argv[2])}), flush=True)
EOF
  done
}
note() { echo "bench: hosts: $*" >&2; }
# in_host H CMD...: CMD in test host H, stopped after STEP_TIMEOUT (then killed 10 s later: unshare ignores SIGTERM).
in_host() {
  local h="$1"
  shift
  timeout -k 10 "$step_timeout" bash scripts/hosts.sh exec "$hn" "$h" "$@"
}
# A port nobody listens on in host 0, for a job's store.
free_port() { in_host 0 "$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
# relabel PREFIX [IMPL]: JSON lines with "bench":"hosts", PREFIX before each metric name (in place of a leading
# hosts_) and, when IMPL is given, "impl":"tandem" renamed IMPL.
relabel() {
  local script='s/"bench": *"[A-Za-z_]*"/"bench":"hosts"/; s/"metric": *"\(hosts_\)\{0,1\}/"metric":"'"$1"'/'
  [ -z "${2:-}" ] || script+='; s/"impl": *"tandem"/"impl":"'"$2"'"/'
  sed -u -e "$script"
}
# serve H CMD...: starts CMD, a server whose first line on stdout is "port P", in test host H in the background;
# sets served_pid (for halt) and served_port.
serve() {
  local h="$1" out i
  shift
  out="$(mktemp -p "$tmp")"
  timeout -k 10 "$((4 * step_timeout))" bash scripts/hosts.sh exec "$hn" "$h" "$@" >"$out" &
  served_pid=$!
  for ((i = 0; i < 100; i++)); do
    served_port="$(sed -n 's/^port \([0-9]*\)$/\1/p' "$out")"
    [ -z "$served_port" ] || return 0
    sleep 0.1
  done
  note "'$*' in host $h reported no port within 10 s"
  return 1
}
halt() {
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
# raw_tcp PREFIX [client flags]: tcp_pingpong's client in host 0, its server in host 1.
raw_tcp() {
  local prefix="$1" server
  shift
  serve 1 build/tcp_pingpong server
  server="$served_pid"
  in_host 0 build/tcp_pingpong client --host "$h1" --port "$served_port" "$@" | relabel "$prefix"
  halt "$server"
}
# tandem_pair PREFIX IMPL TARGET [flags]: build/TARGET as rank 0 in host 0 and rank 1 in host 1; rank 0's JSON lines.
tandem_pair() {
  local prefix="$1" impl="$2" target="$3" port other
  shift 3
  port="$(free_port)"
  local launch=(build/tandem-run --nnodes 2 --nproc-per-node 1 --master-addr "$h0" --master-port "$port")
  in_host 1 "${launch[@]}" --node-rank 1 "build/$target" "$@" >&2 &
  other=$!
  # The programs' own floors are of one host (rpc_bench: Unix socket, cross-memory reads): not measured here, where
  # raw_tcp is the floor.
  in_host 0 env TANDEM_BENCH_FLOORS=0 "${launch[@]}" --node-rank 0 "build/$target" "$@" |
    sed -n 's/^\[rank0\]: {/{/p' | relabel "$prefix" "$impl"
  wait "$other"
}
# peer_pair PREFIX SCRIPT MODE [flags]: the PyTorch peer's rank 0 in host 0 and rank 1 in host 1; rank 0's lines.
peer_pair() {
  local prefix="$1" script="$2" mode="$3" port other
  shift 3
  port="$(free_port)"
  # Each rank gets a pid namespace of its own, as on two machines: else TensorPipe's default configuration reads the
  # tensors from the other "host"'s memory with its CMA channel (process_vm_readv works across network namespaces),
  # off the link. TCP forced (the basic channel) cannot use CMA; it gets the same namespaces, as two machines would.
  local run=(unshare --pid --fork --kill-child "$PY" "bench/$script" "$mode" "$@" --port "$port" --rank)
  # Rank 0 first, and rank 1 once rank 0's store listens: under the added delay rank 1's connection crosses the
  # delay_relay, which can only turn a refused connection into a reset, and PyTorch's store client retries a refusal
  # but fails on a reset.
  in_host 0 "${run[@]}" 0 >"$tmp/rank0.jsonl" &
  other=$!
  wait_listening 0 "$port" "$other"
  in_host 1 "${run[@]}" 1 >&2
  wait "$other"
  relabel "$prefix" <"$tmp/rank0.jsonl"
}
# wait_listening H PORT PID: returns once something in test host H listens on TCP PORT; fails (the run stops) when
# process PID, which should listen there, exits first, or after 60 s.
wait_listening() {
  local i
  for ((i = 0; i < 600; i++)); do
    [ -z "$(bash scripts/hosts.sh exec "$hn" "$1" ss -Hltn "sport = :$2")" ] || return 0
    kill -0 "$3" 2>/dev/null || { note "the process that should listen on port $2 in host $1 exited"; return 1; }
    sleep 0.1
  done
  note "nothing listens on port $2 in host $1 after 60 s"
  return 1
}
# delay_on: DELAY_US added each way to every TCP connection between the hosts (scripts/hosts.sh delay: in each host a
# delay_relay and an nftables redirect of the connections it opens to the other host).
delay_on() {
  local h
  for h in 0 1; do bash scripts/hosts.sh delay "$hn" "$h" "$delay_us" build/delay_relay; done
}
delay_off() {
  local h
  [ -n "${hn:-}" ] || return 0
  for h in 0 1; do bash scripts/hosts.sh delay "$hn" "$h" off; done
}
case "$name" in
  rpc) bench rpc_bench 2 peer_rpc.py "$@" ;;
  rref) bench rref_bench 3 peer_rref.py "$@" ;;
  autograd) bench autograd_bench 2 peer_autograd.py "$@" ;;
  # The peer in PyTorch's best configuration for Tandem's synchronous rounds (bench/peer_ps.py), over both transports,
  # and the tutorial's design with its lock ("torch_tutorial").
  # Each thread its own malloc arena, on both sides and in the limit: the server computes for its trainers on two threads
  # at once, and on one arena they queue on its lock (the limit alone made ~2,900 futex calls a second on it). Each
  # thread's live memory (tensors of at most 1.6 MB) fits in one 64 MiB heap of its arena, whose freed memory the trim
  # threshold above keeps (docs/deploy.md, "Memory").
  ps) (
    [ "${BENCH_GLIBC_DEFAULTS:-0}" = 1 ] || unset MALLOC_ARENA_MAX
    PEER_MODES="default tcp default+tutorial" bench ps_bench 3 peer_ps.py "$@"
  ) ;;
  collectives) PEER_MODES=default bench collectives_bench 2 peer_collectives.py "$@" ;;
  ddp) PEER_MODES=default bench ddp_bench 2 peer_ddp.py "$@" ;;
  # Both sides' ranks bound to the CPUs as tandem-run --bind-cores 1 binds them (bench/peer_common.py does the same):
  # each stage worker keeps its core's caches (the large model's step, 4 interleaved pairs: 0.745 against 0.785 of one
  # worker's step unbound).
  pipeline) PEER_MODES=default BIND_CORES=1 bench pipeline_bench 5 peer_pipeline.py "$@" ;;
  fsdp)
    # One configuration per run, so that each one's peak memory is its own (bench/fsdp_bench.cc, bench/peer_fsdp.py).
    cmake --build build -j"$cores" --target fsdp_bench tandem-run >&2
    for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
      for mode in ddp zero2 full lean; do
        build/tandem-run --nproc-per-node 2 build/fsdp_bench --mode "$mode" "$@" | sed -n 's/^\[rank0\]: {/{/p'
      done
      # The peer also with malloc_trim(0) after each step, as Tandem's lean mode (it may lower a peak).
      for mode in ddp zero1; do
        for trim in 0 1; do "$PY" bench/peer_fsdp.py default --config "$mode" --trim "$trim" "$@"; done
      done
    done ;;
  rl) PEER_MODES=default bench rl_bench 11 peer_rl.py "$@" ;;
  hybrid) bench hybrid_bench 4 peer_hybrid.py "$@" ;;
  bulk-threshold)
    # Where the same-host bulk path (the callee reads the tensor from the caller's memory) starts to beat the socket:
    # one tensor of K KiB per call, through the socket (bulk_min_bytes 0, impl tandem_socket) and by reference
    # (bulk_min_bytes 1, impl tandem_bulk), median of BULK_ITERS (default 300) calls each. RpcOptions::bulk_min_bytes
    # is chosen from these lines.
    cmake --build build -j"$cores" --target rpc_bench tandem-run >&2
    for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
      for kib in ${BULK_KIB:-64 128 256 512 1024 2048 4096}; do
        for path in socket:0 bulk:1; do
          build/tandem-run --nproc-per-node 2 env TANDEM_BENCH_FLOORS=0 build/rpc_bench --small 0 --async 0 \
            --bulk "${BULK_ITERS:-300}" --bulk-kib "$kib" --bulk-min-bytes "${path#*:}" |
            sed -n 's/^\[rank0\]: {/{/p' | sed 's/"impl": *"tandem"/"impl":"tandem_'"${path%:*}"'"/'
        done
      done
    done
    ;;
  elastic)
    # Not under tandem-run: the driver starts each launcher itself, kills a worker and times the restart.
    cmake --build build -j"$cores" --target elastic_bench tandem-run >&2
    for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
      "$PY" bench/elastic_driver.py tandem --tandem-run build/tandem-run --worker build/elastic_bench "$@"
      "$PY" bench/elastic_driver.py torch --peer bench/peer_elastic.py "$@"
    done
    ;;
  hosts) hosts_bench "$@" ;;
  *)
    echo "bench: unknown benchmark '$name' (known: rpc, rref, autograd, ps, collectives, ddp, fsdp, pipeline, rl, hybrid," \
      "elastic, hosts, bulk-threshold)" >&2
    exit 2
    ;;
esac
