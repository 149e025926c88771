#!/usr/bin/env bash
# Test hosts on one machine: N network namespaces joined by a bridge, so that the workers of one job run on "hosts"
# with their own addresses and every call between them crosses a real TCP/IP path (never the same-host direct
# channel). Used by tests/hosts and `bench/run.sh hosts`. Run as root.
#
#   hosts.sh up NAME N          makes NAME-sw (the bridge br0) and NAME-h0 .. NAME-h<N-1>; host i has eth0 with
#                               10.77.0.<i+1>/24 and lo. The root namespace is not touched. The links' MTU is
#                               HOSTS_MTU (default 1500, Ethernet's; up to 65535, as on loopback).
#   hosts.sh down NAME          kills every process in them and removes them all (idempotent)
#   hosts.sh addr NAME I        prints host I's address
#   hosts.sh exec NAME I CMD..  runs CMD in host I (ip netns exec: CMD replaces this process)
#   hosts.sh cut NAME I         takes host I's link down (in-flight packets are lost; the peers see no reset)
#   hosts.sh heal NAME I        brings it back up, and lifts a black hole
#   hosts.sh blackhole NAME I   drops every packet host I sends or receives (nftables rules in its namespace)
#   hosts.sh kill NAME I        SIGKILLs every process in host I (the kernel resets their connections)
#   hosts.sh rate NAME I RATE   limits host I's outgoing rate (tc tbf, e.g. 1gbit); RATE "off" removes the limit
#   hosts.sh delay NAME I US RELAY [J]
#                               adds US microseconds each way to every TCP connection host I opens from now on to host
#                               J (default: to every other host): RELAY (build/delay_relay) runs in host I, and an
#                               nftables rule there redirects those connections through it. Connections already open
#                               keep their path. US "off" removes the rule and stops the relay, which resets the
#                               connections that crossed it.
#   hosts.sh tls DIR            writes DIR/ca.crt, DIR/node.crt and DIR/node.key: one CA, and one certificate valid
#                               for every host's address (and 127.0.0.1) that each worker presents and checks its peers
#                               against (TANDEM_TLS_CERT, TANDEM_TLS_KEY, TANDEM_TLS_CA)
#   hosts.sh check              exits 0 when this machine can make hosts, else prints why
#
# NAME must be short and unique per concurrent user (tests use their pid). Delay is added in user space (`delay`): this
# kernel has no netem qdisc.
set -euo pipefail

die() { echo "hosts.sh: $*" >&2; exit 1; }
ns() { echo "$1-h$2"; }

cmd="${1:-}"; shift || true
case "$cmd" in
  check)
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
    probe="tdmchk$$"
    ip netns add "$probe" 2>/dev/null || die "cannot create a network namespace (ip netns add failed)"
    ok=1
    ip -n "$probe" link add br0 type bridge 2>/dev/null || ok=0
    ip netns del "$probe"
    [ "$ok" = 1 ] || die "cannot create a bridge inside a network namespace"
    command -v nft >/dev/null || die "nft (Debian's nftables) is not installed"
    ;;
  up)
    name="$1"; n="$2"
    [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "host count must be 1..200"
    trap 'bash "$0" down "$name"' ERR
    mtu="${HOSTS_MTU:-1500}"
    ip netns add "$name-sw"
    ip -n "$name-sw" link add br0 type bridge
    ip -n "$name-sw" link set br0 mtu "$mtu" up
    for ((i = 0; i < n; i++)); do
      h="$(ns "$name" "$i")"
      ip netns add "$h"
      ip -n "$name-sw" link add "p$i" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$h"
      ip -n "$name-sw" link set "p$i" master br0 up
      ip -n "$h" addr add "10.77.0.$((i + 1))/24" dev eth0
      ip -n "$h" link set lo up
      ip -n "$h" link set eth0 up
    done
    ;;
  down)
    name="$1"
    for h in $(ip netns list | awk '{print $1}' | grep -E "^$name-(sw|h[0-9]+)$" || true); do
      pids="$(ip netns pids "$h" 2>/dev/null || true)"
      [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
      ip netns del "$h" 2>/dev/null || true
    done
    ;;
  addr) echo "10.77.0.$(($2 + 1))" ;;
  exec) name="$1"; i="$2"; shift 2; exec ip netns exec "$(ns "$name" "$i")" "$@" ;;
  cut) ip -n "$(ns "$1" "$2")" link set eth0 down ;;
  heal)
    h="$(ns "$1" "$2")"
    ip netns exec "$h" nft delete table inet tandem_hosts 2>/dev/null || true
    ip -n "$h" link set eth0 up
    ;;
  blackhole)
    ip netns exec "$(ns "$1" "$2")" nft -f - <<'EOF'
table inet tandem_hosts {
  chain in { type filter hook input priority 0; policy accept; iifname "eth0" drop; }
  chain out { type filter hook output priority 0; policy accept; oifname "eth0" drop; }
}
EOF
    ;;
  kill)
    pids="$(ip netns pids "$(ns "$1" "$2")")"
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ;;
  rate)
    h="$(ns "$1" "$2")"
    if [ "$3" = off ]; then
      ip netns exec "$h" tc qdisc del dev eth0 root 2>/dev/null || true
    else
      ip netns exec "$h" tc qdisc replace dev eth0 root tbf rate "$3" burst 256kb latency 100ms
    fi
    ;;
  delay)
    name="$1"; i="$2"; us="${3:?usage: hosts.sh delay NAME I US RELAY [J] | hosts.sh delay NAME I off}"
    h="$(ns "$1" "$2")"
    relay_pids() {
      local p
      for p in $(ip netns pids "$h" 2>/dev/null); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" != delay_relay ] || echo "$p"
      done
    }
    # Stops the host's relay, and returns once it is gone (its connections reset).
    stop_relay() {
      local pids k
      pids="$(relay_pids)"
      [ -n "$pids" ] || return 0
      kill $pids 2>/dev/null || true
      for ((k = 0; k < 20; k++)); do
        [ -n "$(relay_pids)" ] || return 0
        sleep 0.1
      done
      kill -9 $(relay_pids) 2>/dev/null || true
    }
    if [ "$us" = off ]; then
      ip netns exec "$h" nft delete table ip tandem_delay 2>/dev/null || true
      stop_relay
      exit 0
    fi
    relay="${4:?usage: hosts.sh delay NAME I US RELAY [J]}"
    to="ip daddr 10.77.0.0/24 ip daddr != 10.77.0.$((i + 1))"
    [ -z "${5:-}" ] || to="ip daddr 10.77.0.$(($5 + 1))"
    [ -z "$(relay_pids)" ] || die "host $i already has a delay (hosts.sh delay $name $i off first)"
    out="$(mktemp)" err="$(mktemp)"
    # Detached (its own session, no inherited output), so that the caller of this script does not wait for it; `down`
    # and `delay ... off` stop it. Neither ip netns exec nor setsid forks: $! is the relay.
    ip netns exec "$h" setsid "$relay" --delay-us "$us" </dev/null >"$out" 2>"$err" &
    relay_pid=$! port=""
    for ((k = 0; k < 100; k++)); do
      port="$(sed -n 's/^port \([0-9]*\)$/\1/p' "$out")"
      [ -z "$port" ] && kill -0 "$relay_pid" 2>/dev/null || break
      sleep 0.1
    done
    why="$(cat "$err")"
    rm -f "$out" "$err"
    if [ -z "$port" ]; then
      kill -9 "$relay_pid" 2>/dev/null || true
      die "delay_relay in host $i reported no port${why:+: $why}"
    fi
    # The relay's own connections carry mark 0x77 and pass.
    if ! ip netns exec "$h" nft -f - <<EOF
table ip tandem_delay {
  chain out {
    type nat hook output priority -100; policy accept;
    meta mark != 0x77 $to ip protocol tcp redirect to :$port
  }
}
EOF
    then
      stop_relay
      die "could not add the delay's nftables rule in host $i"
    fi
    ;;
  tls)
    dir="$1" sans="IP:127.0.0.1"
    for i in $(seq 1 200); do sans+=",IP:10.77.0.$i"; done  # every address `up` gives
    (cd "$dir" &&
      openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=tandem-hosts-ca -keyout ca.key -out ca.crt &&
      openssl req -newkey rsa:2048 -nodes -subj /CN=tandem-host -keyout node.key -out node.csr &&
      printf 'subjectAltName=%s\n' "$sans" >ext.cnf &&
      openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile ext.cnf -out node.crt
    ) >"$dir/openssl.log" 2>&1 || { cat "$dir/openssl.log" >&2; die "could not make the certificates in $dir"; }
    ;;
  *) die "usage: hosts.sh up|down|addr|exec|cut|heal|blackhole|kill|rate|delay|tls|check ... (see the header)" ;;
esac
