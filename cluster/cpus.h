// cluster/cpus.h: the CPUs a process of a job may use — its affinity mask (taskset, tandem-run --bind-cores, SLURM's
// --cpu-bind), bounded by the CPU quota of its container (Kubernetes' `resources.limits.cpu`, Docker's --cpus, a
// systemd unit's CPUQuota: the cgroup's cpu.max in cgroup v2, cpu.cfs_quota_us / cpu.cfs_period_us in v1).
// The direct channel holds this many places (rpc/detail/direct.h), tandem-run's `--nproc-per-node cpu` starts this
// many workers, the parameter-server benchmark gives its server this many threads.
//
// Thread-safe (reads files only). No error is returned: what cannot be read does not bound the count.
#pragma once

#include <optional>
#include <string>

namespace tandem::cluster {

// The number of CPUs in this process's affinity mask, bounded by cpu_quota() rounded up (a quota of 1.5 CPUs is 2
// CPUs' worth of threads, each throttled), at least 1.
int usable_cpus();

// The CPU quota of this process's cgroup: the least over its cgroup and every cgroup above it (quota / period, in
// CPUs), read from the cgroup file systems mounted at the places /proc/self/mountinfo names; nullopt when none has a
// quota or none can be read.
std::optional<double> cpu_quota();

// The same from the given texts, with every mount point read under `root` (tests build such a tree):
// `proc_self_cgroup` as /proc/self/cgroup reads ("0::/a/b" in v2, "4:cpu,cpuacct:/a/b" in v1) and `mountinfo` as
// /proc/self/mountinfo. A v1 cpu controller, when mounted, is read; else the v2 hierarchy.
std::optional<double> cpu_quota(const std::string& proc_self_cgroup, const std::string& mountinfo,
                                const std::string& root = "");

}  // namespace tandem::cluster
