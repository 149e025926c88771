#!/usr/bin/env bash
# A real one-machine SLURM cluster for a test (Debian's slurm-wlm + munge): a private munged, a slurmctld and a slurmd,
# with key, sockets, config, state, spool, logs and pid files all under a folder the caller owns and ports chosen at run
# time, so it neither needs nor touches a system-wide munge/slurm, and several can run at once in different folders.
#   slurm.sh check      exit 0 if this machine can run it, else print one line saying why and exit 1
#   slurm.sh up DIR     start a cluster in DIR (empty or missing); returns once its node is idle, else (after 30 s of
#                       waiting for that) prints the daemons' log tails, stops what it started and exits 1
#   slurm.sh env DIR    print what srun/sinfo/squeue/... need to use it (`export SLURM_CONF=...`, for eval)
#   slurm.sh down DIR   cancel its jobs and stop its daemons; idempotent, silent when already down; leaves DIR in place
# Example:
#   d=$(mktemp -d); bash slurm.sh up "$d"; eval "$(bash slurm.sh env "$d")"
#   srun -n 3 --overcommit hostname; bash slurm.sh down "$d"; rm -rf "$d"
# One node (`hostname -s` at 127.0.0.1) with TANDEM_SLURM_CPUS (default 2) CPUs in one default partition "main";
# more tasks than CPUs need `srun --overcommit`. Run srun outside any real SLURM allocation (or unset SLURM_JOB_ID):
# srun takes an inherited SLURM_JOB_ID as the job to run its step in.
set -euo pipefail

me=slurm.sh
die() { echo "$me: $*" >&2; exit 1; }

# Why this machine cannot run a cluster, or nothing.
why_not() {
  # slurmd must be root to run each job as its submitter; munged and slurmctld here run as root too.
  [ "$(id -u)" = 0 ] || { echo "not root"; return; }
  local b
  for b in munged munge slurmctld slurmd srun sinfo squeue scancel python3 timeout ps; do
    command -v "$b" >/dev/null ||
      { echo "no $b (apt-get install -y --no-install-recommends slurm-wlm munge)"; return; }
  done
}

# Two distinct free ports below the kernel's ephemeral range (ip_local_port_range): ports other tests and srun itself
# take with bind(0) come from that range, so none of them can take these between now and the daemons binding them.
free_ports() {
  python3 -c '
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
found = []
while len(found) < 2:
    p = random.randrange(10000, low)
    if p in found:
        continue
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            continue
    found.append(p)
print(*found)'
}

# Pids of this cluster's processes: the daemons name DIR on their command line; slurmctld's slurmscriptd and slurmd's
# slurmstepds do not, but work in DIR/log (the daemons chdir to their log folder), which is how a step left behind is
# found. Zombies are left out: they are gone already, only not reaped yet.
ours() {
  local dir=$1 p comm cmd cwd state
  for p in /proc/[0-9]*; do
    { read -r comm <"$p/comm"; } 2>/dev/null || continue
    case $comm in munged|slurmctld|slurmd|slurmstepd|slurmscriptd) ;; *) continue ;; esac
    { cmd=$(tr '\0' ' ' <"$p/cmdline"); } 2>/dev/null || continue
    cwd=$(readlink "$p/cwd" 2>/dev/null) || cwd=
    if [[ "$cmd" == *"$dir/"* || "$cwd/" == "$dir/"* ]]; then
      { state=$(cut -d' ' -f3 <"$p/stat"); } 2>/dev/null || continue
      [ "$state" = Z ] || echo "${p#/proc/}"
    fi
  done
}

# The processes of $@ and all their descendants (a step's tasks are the slurmstepd's children).
with_descendants() {
  local table pid ppid out=" $* " grew=1
  table=$(ps -eo pid=,ppid=)
  while [ $grew = 1 ]; do
    grew=0
    while read -r pid ppid; do
      if [[ "$out" == *" $ppid "* && "$out" != *" $pid "* ]]; then out+="$pid "; grew=1; fi
    done <<<"$table"
  done
  echo $out
}

alive() {
  local p state
  for p; do
    { state=$(cut -d' ' -f3 <"/proc/$p/stat"); } 2>/dev/null || continue
    [ "$state" = Z ] || return 0
  done
  return 1
}

# wait_gone SECONDS PID...: whether they all exit in time.
wait_gone() {
  local end=$((SECONDS + $1)); shift
  while alive "$@"; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.1
  done
}

down() {
  local dir=$1
  [ -d "$dir" ] || return 0
  dir=$(cd "$dir" && pwd -P)
  local conf=$dir/slurm.conf ctld p
  ctld=$(cat "$dir/slurmctld.pid" 2>/dev/null) || ctld=
  # Stopping slurmd does not stop the steps it started; cancelled through slurmctld, their slurmstepds kill the tasks
  # (KillWait=2) and exit.
  if [ -f "$conf" ] && [ -n "$ctld" ] && alive "$ctld"; then
    local jobs
    jobs=$(SLURM_CONF=$conf timeout 5 squeue -h -o %i 2>/dev/null) || jobs=
    if [ -n "$jobs" ]; then
      SLURM_CONF=$conf timeout 5 scancel $jobs >/dev/null 2>&1 || true
      local end=$((SECONDS + 10)) steps
      while [ $SECONDS -lt $end ]; do
        steps=$(ours "$dir")
        steps=$(for p in $steps; do [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmstepd ] && echo "$p"; done || true)
        [ -n "$steps" ] || break
        sleep 0.2
      done
    fi
  fi
  # The daemons are found in /proc rather than by their pid files: that also finds what a half-finished `up` or a stuck
  # step (and its tasks) left behind, and cannot hit an unrelated process that reused a stale pid.
  local pids
  # shellcheck disable=SC2046,SC2207  # word splitting of pid lists is meant
  pids=($(with_descendants $(ours "$dir")))
  [ ${#pids[@]} -gt 0 ] || return 0
  # A slurmstepd ignores SIGTERM (that would only cost the 10 s wait below); its tasks get SIGTERM like the rest.
  for p in "${pids[@]}"; do
    if [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmstepd ]; then kill -KILL "$p"; else kill -TERM "$p"; fi 2>/dev/null || true
  done
  # A stopped process (a test's SIGSTOP, a debugger) only acts on SIGTERM once continued.
  kill -CONT "${pids[@]}" 2>/dev/null || true
  wait_gone 10 "${pids[@]}" && return 0
  kill -KILL "${pids[@]}" 2>/dev/null || true
  wait_gone 5 "${pids[@]}" || die "down: still running after SIGKILL: $(alive_list "${pids[@]}" | xargs)"
}

alive_list() { local p; for p; do alive "$p" && echo "$p"; done; return 0; }

fail_up() {
  local dir=$1 f
  echo "$me: up: $2" >&2
  for f in "$dir"/log/*; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -n 25 "$f" >&2; }
  done
  down "$dir" || true
  exit 1
}

up() {
  local dir=$1 reason host ctld_port slurmd_port cpus=${TANDEM_SLURM_CPUS:-2}
  reason=$(why_not)
  [ -z "$reason" ] || die "$reason"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd -P)
  [ -z "$(ls -A "$dir")" ] || die "$dir is not empty"
  # slurm.conf values cannot hold blanks.
  [[ "$dir" != *[[:space:]]* ]] || die "$dir has blanks in its path"
  host=$(hostname -s)
  # Unix socket paths hold 107 bytes; the longest here is a step's socket in the spool folder.
  local longest=$dir/spool/${host}_4294967294.4294967294
  [ ${#longest} -le 107 ] || die "$dir is too long a path for the sockets under it"
  mkdir "$dir/state" "$dir/spool" "$dir/log"

  head -c 1024 /dev/urandom >"$dir/munge.key"
  chmod 400 "$dir/munge.key"
  # --force: munged refuses a socket in a folder not searchable by everyone (mktemp -d makes mode 700); every client
  # of this one is root. A root-owned key is fine as munged runs as root.
  munged --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed" >"$dir/log/munged.out" 2>&1 ||
    fail_up "$dir" "munged did not start"
  timeout 5 munge -n -S "$dir/munge.sock" >/dev/null 2>&1 || fail_up "$dir" "munged does not answer"

  read -r ctld_port slurmd_port < <(free_ports)
  # AuthInfo points slurmctld, slurmd and the clients (which read this file through SLURM_CONF) at the private munged,
  # for both authentication and job credentials. PlugStackConfig keeps /etc/slurm/plugstack.conf (SPANK plugins) out.
  # config_overrides: trust CPUs= even on a machine with fewer cores instead of draining the node. KillWait=2: cancelled
  # tasks get SIGKILL 2 s after SIGTERM rather than 30 s, so `down` is quick.
  cat >"$dir/slurm.conf" <<EOF
ClusterName=tandem
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
PlugStackConfig=$dir/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
EOF
  : >"$dir/plugstack.conf"

  slurmctld -c -f "$dir/slurm.conf" >"$dir/log/slurmctld.out" 2>&1 || fail_up "$dir" "slurmctld did not start"
  slurmd -f "$dir/slurm.conf" >"$dir/log/slurmd.out" 2>&1 || fail_up "$dir" "slurmd did not start"

  local start=$SECONDS state d p
  while :; do
    state=$(SLURM_CONF=$dir/slurm.conf timeout 3 sinfo -h -N -o %T 2>/dev/null) || state=
    [ "$state" != idle ] || return 0
    [ $((SECONDS - start)) -lt 30 ] || fail_up "$dir" "node not idle after 30 s (sinfo: ${state:-no answer})"
    # A daemon removes its pid file when it exits; past a grace period for writing it, no pid file (or no such
    # process) means the daemon died, and there is no point waiting the full 30 s.
    if [ $((SECONDS - start)) -ge 3 ]; then
      for d in slurmctld slurmd; do
        p=$(cat "$dir/$d.pid" 2>/dev/null) || p=
        [ -n "$p" ] && alive "$p" || fail_up "$dir" "$d exited"
      done
    fi
    sleep 0.2
  done
}

env_of() {
  local dir
  dir=$(cd "$1" 2>/dev/null && pwd -P) && [ -f "$dir/slurm.conf" ] || die "env: no cluster in $1"
  printf 'export SLURM_CONF=%q\n' "$dir/slurm.conf"
}

case ${1:-} in
  check)
    reason=$(why_not)
    [ -z "$reason" ] || { echo "slurm cluster unavailable: $reason"; exit 1; } ;;
  up) [ $# = 2 ] || die "usage: $me up DIR"; up "$2" ;;
  env) [ $# = 2 ] || die "usage: $me env DIR"; env_of "$2" ;;
  down) [ $# = 2 ] || die "usage: $me down DIR"; down "$2" ;;
  *) die "usage: $me check | up DIR | env DIR | down DIR" ;;
esac
