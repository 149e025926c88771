# Sourced by the tests' scripts that start jobs under tandem-run.

# free_port: a free port below the kernel's ephemeral range (ip_local_port_range): the ports every other test and
# launcher picks with bind(0) come from that range, so none of them can take this one between now and its use.
free_port() {
  python3 -c '
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(1000):
    p = random.randrange(10000, low)
    with socket.socket() as s:
        try:
            s.bind(("", p))  # every local address, as rpc::net::pick_listen_port checks
        except OSError:
            continue
    print(p)
    break'
}

# worker_of <launcher pid> <rank>: the pid of the worker with RANK=<rank> under that launcher (empty when none).
worker_of() {
  for p in $(pgrep -P "$1"); do
    if grep -qx "RANK=$2" <<<"$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null)"; then echo "$p"; fi
  done
}
