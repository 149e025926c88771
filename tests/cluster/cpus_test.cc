// The CPU quota of a process's cgroup (cluster/cpus.h), from /proc/self/cgroup and /proc/self/mountinfo texts as the
// kernel writes them and a tree of cgroup files as the kernel lays them out (cgroup v1 and v2, in a container and
// not). tests/cluster/cpu_quota.sh checks the same in real cgroups through tandem-run.
#include "tandem/cluster/cpus.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

namespace {

namespace cluster = tandem::cluster;
namespace fs = std::filesystem;

class UnitCpus : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tandem-cpus-" + std::to_string(getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  // Writes `text` to the file at `path` under the tree's root.
  void put(const std::string& path, const std::string& text) {
    const fs::path p = root_ / fs::path(path).relative_path();
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::optional<double> quota(const std::string& cgroup, const std::string& mountinfo) {
    return cluster::cpu_quota(cgroup, mountinfo, root_.string());
  }
  fs::path root_;
};

constexpr char kV2Mounts[] =
    "24 29 0:22 / /sys rw,nosuid - sysfs sysfs rw\n"
    "31 24 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
constexpr char kV1Mounts[] =
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

TEST_F(UnitCpus, V2CpuMaxIsTheQuota) {
  put("/sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "150000 100000\n");
  EXPECT_DOUBLE_EQ(quota("0::/kubepods/pod1/c1\n", kV2Mounts).value_or(-1), 1.5);
}

TEST_F(UnitCpus, V2MaxMeansNoQuota) {
  put("/sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
  EXPECT_FALSE(quota("0::/user.slice\n", kV2Mounts).has_value());
  EXPECT_FALSE(quota("0::/nowhere\n", kV2Mounts).has_value());  // no files: nothing bounds
}

TEST_F(UnitCpus, TheLeastQuotaAboveTheCgroupWins) {
  put("/sys/fs/cgroup/kubepods/cpu.max", "max 100000\n");
  put("/sys/fs/cgroup/kubepods/pod1/cpu.max", "200000 100000\n");
  put("/sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "300000 100000\n");
  EXPECT_DOUBLE_EQ(quota("0::/kubepods/pod1/c1\n", kV2Mounts).value_or(-1), 2.0);
}

TEST_F(UnitCpus, V1CfsQuotaOverPeriodOfTheCpuController) {
  put("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n");
  put("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  const std::string cgroup = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n";
  EXPECT_DOUBLE_EQ(quota(cgroup, kV1Mounts).value_or(-1), 0.5);
  put("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");
  EXPECT_FALSE(quota(cgroup, kV1Mounts).has_value());
}

// In a container the controller's mount is the container's own cgroup (mountinfo's root field), and
// /proc/self/cgroup names it in full: its files are at the mount point itself.
TEST_F(UnitCpus, AContainersMountedCgroupIsItsOwn) {
  const std::string mounts = "1201 1195 0:29 /docker/abc /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n";
  put("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "250000\n");
  put("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
  EXPECT_DOUBLE_EQ(quota("3:cpu:/docker/abc\n", mounts).value_or(-1), 2.5);
}

// A sibling whose name begins with the mount's root is not under it; of two mounts, the one whose root is the longest
// whole-component prefix of the path holds the cgroup; a mount point's spaces come escaped (\040).
TEST_F(UnitCpus, TheMountIsChosenByWholePathComponents) {
  const std::string mounts =
      "1 0 0:29 / /sys/fs/cgroup/all rw - cgroup cgroup rw,cpu\n"
      "2 0 0:29 /docker/abc /sys/fs/cgroup/my\\040cpu rw - cgroup cgroup rw,cpu\n";
  put("/sys/fs/cgroup/my cpu/cpu.cfs_quota_us", "300000\n");
  put("/sys/fs/cgroup/my cpu/cpu.cfs_period_us", "100000\n");
  put("/sys/fs/cgroup/all/docker/abcdef/cpu.cfs_quota_us", "100000\n");
  put("/sys/fs/cgroup/all/docker/abcdef/cpu.cfs_period_us", "100000\n");
  EXPECT_DOUBLE_EQ(quota("4:cpu:/docker/abc\n", mounts).value_or(-1), 3.0);
  EXPECT_DOUBLE_EQ(quota("4:cpu:/docker/abcdef\n", mounts).value_or(-1), 1.0);  // under "/" only
  // A path outside every mount's root, or above it (a cgroup namespace's ".."), bounds nothing.
  const std::string only_abc = "2 0 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
  EXPECT_FALSE(quota("4:cpu:/docker/abcdef\n", only_abc).has_value());
  EXPECT_FALSE(quota("0::/../x\n", kV2Mounts).has_value());
}

// An empty mount source keeps the fields in place.
TEST_F(UnitCpus, AnEmptyMountSourceIsAField) {
  put("/sys/fs/cgroup/cpu/a/cpu.cfs_quota_us", "50000\n");
  put("/sys/fs/cgroup/cpu/a/cpu.cfs_period_us", "100000\n");
  EXPECT_DOUBLE_EQ(quota("4:cpu:/a\n", "3 0 0:29 / /sys/fs/cgroup/cpu rw - cgroup  rw,cpu\n").value_or(-1), 0.5);
}

TEST_F(UnitCpus, UnreadableOrMalformedTextsBoundNothing) {
  EXPECT_FALSE(quota("", kV2Mounts).has_value());
  EXPECT_FALSE(quota("0::/a\n", "").has_value());
  EXPECT_FALSE(quota("garbage\n", "also garbage - \n").has_value());
  put("/sys/fs/cgroup/a/cpu.max", "lots 100000\n");
  EXPECT_FALSE(quota("0::/a\n", kV2Mounts).has_value());
  put("/sys/fs/cgroup/a/cpu.max", "100000 0\n");
  EXPECT_FALSE(quota("0::/a\n", kV2Mounts).has_value());
}

TEST_F(UnitCpus, UsableCpusIsTheAffinityBoundedByThisProcesssQuota) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  int want = CPU_COUNT(&set);
  if (auto q = cluster::cpu_quota()) want = std::min(want, static_cast<int>(std::ceil(*q - 1e-9)));
  EXPECT_EQ(cluster::usable_cpus(), std::max(1, want));
}

}  // namespace
