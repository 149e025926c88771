#!/usr/bin/env bash
# Installs what Tandem needs on a Debian 12 machine (run as root). Safe to re-run: installs only what is missing.
#   bash scripts/setup.sh [extra packages...]     (.ci/fuzz and .ci/tsan add clang's)
set -euo pipefail
pkgs=(
  cmake g++ make pkg-config
  libtorch-dev libgloo-dev                       # LibTorch 1.13 (CPU); c10d headers include gloo
  libgrpc++-dev protobuf-compiler-grpc           # gRPC 1.51
  libprotobuf-dev protobuf-compiler libabsl-dev  # protobuf 3.21, abseil
  libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev openssl ca-certificates             # TLS tests make their own certificates
  iproute2 util-linux nftables                   # tests put workers in network and pid namespaces they create,
                                                 # and black-hole hosts with nftables rules
  libopenblas0-pthread                           # LibTorch otherwise falls back to reference BLAS (~20x slower)
  dataset-fashion-mnist zlib1g-dev               # the examples read its gzipped IDX files
  etcd-server                                    # the elastic rendezvous's etcd backend (tests start their own)
  slurm-wlm munge                                # tests/cluster runs jobs under a real one-node SLURM it starts
  libcli11-dev                                   # command lines: the launcher, the examples, the benchmarks
  python3-grpcio python3-protobuf python3-numpy  # the Python client (clients/python) and its tests
)
pkgs+=("$@")
missing=()
for p in "${pkgs[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  if [ "$(id -u)" != 0 ]; then echo "setup: run as root to install packages" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
