#!/usr/bin/env bash
# tandem-run --nproc-per-node cpu counts the CPUs this process may use: its affinity, bounded by its cgroup's CPU
# quota (cluster/cpus.h), as Kubernetes' CPU limits and Docker's --cpus set it. Each case makes a real cgroup (v1's cpu
# controller, or v2's with +cpu), sets its quota, runs tandem-run inside it, counts the workers it started, and
# removes the cgroup. Exit 77 (skipped) when no cgroup can be made here (not root, or no writable cpu controller).
#   bash cpu_quota.sh TANDEM_RUN
set -euo pipefail
run="$1"
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the affinity mask's CPUs
# The cpu controller's hierarchy: v1's mount (super options include cpu), else v2's with cpu enabled below its root.
base="" v2=0
while read -r _ _ _ _ point _ rest; do
  super=$(sed 's/.* - //' <<<" $rest"); type=$(cut -d' ' -f1 <<<"$super"); opts=$(cut -d' ' -f3 <<<"$super")
  if [ "$type" = cgroup ] && tr , '\n' <<<"$opts" | grep -qx cpu; then base="$point"; v2=0; break; fi
  if [ "$type" = cgroup2 ] && [ -z "$base" ] && grep -qw cpu "$point/cgroup.controllers" 2>/dev/null; then
    base="$point"; v2=1
  fi
done < /proc/self/mountinfo
if [ -z "$base" ]; then echo "skipped: no cgroup hierarchy with the cpu controller"; exit 77; fi
# The hierarchy's own quota would bound the case without one (a container's cgroup mounted as the root).
if [ "$v2" = 0 ] && [ "$(cat "$base/cpu.cfs_quota_us" 2>/dev/null || echo -1)" != -1 ]; then
  echo "skipped: $base has a CPU quota of its own"; exit 77
fi
enabled=0  # v2: whether this test enabled the cpu controller below the root (undone at the end)
if [ "$v2" = 1 ] && ! grep -qw cpu "$base/cgroup.subtree_control"; then
  if ! echo +cpu > "$base/cgroup.subtree_control" 2>/dev/null; then
    echo "skipped: cannot enable the cpu controller under $base"; exit 77
  fi
  enabled=1
fi
top="$base/tandem-cpu-quota-$$"
if ! mkdir "$top" 2>/dev/null; then echo "skipped: cannot make a cgroup under $base"; exit 77; fi
# The cgroups go when their processes have (tandem-run's workers may take a moment to be reaped).
cleanup() {
  local d left=0
  for d in "$top/inner" "$top"; do
    for _ in $(seq 50); do [ -d "$d" ] || break; rmdir "$d" 2>/dev/null && break; sleep 0.1; done
    if [ -d "$d" ]; then echo "FAIL: cannot remove $d: $(cat "$d/cgroup.procs" 2>/dev/null | tr '\n' ' ')"; left=1; fi
  done
  if [ "$enabled" = 1 ]; then echo -cpu > "$base/cgroup.subtree_control" 2>/dev/null || true; fi
  if [ "$left" = 1 ]; then exit 1; fi
}
trap cleanup EXIT
[ "$v2" = 1 ] && echo +cpu > "$top/cgroup.subtree_control"
mkdir "$top/inner"
# quota DIR QUOTA_US (or "max"): at a period of 100 ms.
quota() {
  if [ "$v2" = 1 ]; then echo "$2 100000" > "$1/cpu.max"
  else echo 100000 > "$1/cpu.cfs_period_us"; echo "$([ "$2" = max ] && echo -1 || echo "$2")" > "$1/cpu.cfs_quota_us"; fi
}
fail=0
# workers_in DIR: how many workers tandem-run --nproc-per-node cpu starts in cgroup DIR.
workers_in() {
  sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec env TANDEM_SECRET=s "$@"' _ "$1" \
    "$run" --nproc-per-node cpu /bin/echo started | grep -c 'started$'
}
check() {  # NAME DIR WANT
  local got; got=$(workers_in "$2") || true  # grep -c prints 0 and fails when none started
  if [ "$got" = "$3" ]; then echo "ok   $1: $got"; else echo "FAIL $1: $got workers, want $3"; fail=1; fi
}
min() { echo $(( $1 < $2 ? $1 : $2 )); }
quota "$top" max; quota "$top/inner" max
check "no quota: the affinity's $cpus CPUs" "$top/inner" "$cpus"
quota "$top/inner" 50000
check "half a CPU: 1" "$top/inner" 1
quota "$top/inner" 150000
check "1.5 CPUs round up to 2 (of $cpus)" "$top/inner" "$(min 2 "$cpus")"
quota "$top/inner" max; quota "$top" 100000
check "a parent's quota of 1 CPU bounds its child's" "$top/inner" 1
quota "$top" max
exit $fail
