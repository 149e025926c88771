// The CPU quota of a process's cgroup (cluster/cpus.h), from /proc/self/cgroup and /proc/self/mountinfo texts as the
// kernel writes them and a tree of cgroup files as the kernel lays them out (cgroup v1 and v2, in a container and
// not); and this process's own numbers against what the test knows without the code under test: the cgroup files
// read here at their usual places, an affinity mask set here. tests/cluster/cpu_quota.sh checks the same in real
// cgroups through tandem-run.
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
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "tests/common/files.h"

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

std::string read_text(const fs::path& path) { return tandem::test::read_file(path.string()); }

// One cgroup directory's quota in CPUs: v2's cpu.max ("max 100000" or "150000 100000"), v1's cpu.cfs_quota_us (-1:
// none) over cpu.cfs_period_us; nullopt for none or no files.
std::optional<double> quota_in(const fs::path& dir, bool v2) {
  std::istringstream text(v2 ? read_text(dir / "cpu.max")
                             : read_text(dir / "cpu.cfs_quota_us") + " " + read_text(dir / "cpu.cfs_period_us"));
  std::string first;
  double quota = 0, period = 0;
  if (!(text >> first >> period) || first == "max" || !(std::istringstream(first) >> quota) || quota <= 0 ||
      period <= 0) {
    return std::nullopt;
  }
  return quota / period;
}

// This process's CPU quota as the kernel's files give it, read where systemd, Docker and Kubernetes mount the
// hierarchies rather than where /proc/self/mountinfo says (as cluster/cpus.cc finds them), so that the tests of this
// process's numbers below do not take their expectation from the code they test.
struct FilesQuota {
  bool known = false;          // whether the hierarchy of this process's cpu controller is at its usual place
  std::optional<double> cpus;  // the least quota over this process's cgroup and those above it; nullopt: none
};

FilesQuota quota_from_the_files() {
  // This process's cgroup: the v1 line whose controllers include cpu ("4:cpu,cpuacct:/a/b"), else v2's ("0::/a/b").
  std::optional<std::string> v1_path, v2_path;
  std::istringstream lines(read_text("/proc/self/cgroup"));
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    if (("," + line.substr(a + 1, b - a - 1) + ",").find(",cpu,") != std::string::npos) v1_path = line.substr(b + 1);
    if (line.compare(0, b + 1, "0::") == 0) v2_path = line.substr(b + 1);
  }
  fs::path base;
  bool v2 = false;
  std::error_code ec;
  if (v1_path) {
    for (const char* d : {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpuacct,cpu"}) {
      if (fs::exists(fs::path(d) / "cpu.cfs_period_us", ec)) {
        base = d;
        break;
      }
    }
  } else if (v2_path && fs::exists("/sys/fs/cgroup/cgroup.controllers", ec)) {
    base = "/sys/fs/cgroup";
    v2 = true;
  }
  const std::string path = v2 ? v2_path.value_or("") : v1_path.value_or("");
  // A path above this cgroup namespace's root ("/../x") names no directory here to read.
  if (base.empty() || path.find("/..") != std::string::npos) return {};
  FilesQuota files;
  files.known = true;
  auto take = [&](const fs::path& dir) {
    if (auto q = quota_in(dir, v2); q && (!files.cpus || *q < *files.cpus)) files.cpus = q;
  };
  // The hierarchy's root, then each cgroup down this process's path while there is one: in a container without a
  // cgroup namespace of its own the root mounted is the container's cgroup, and the path, named from the host's root,
  // is not below it.
  fs::path dir = base;
  take(dir);
  std::istringstream parts(path);
  for (std::string part; std::getline(parts, part, '/');) {
    if (part.empty()) continue;
    dir /= part;
    if (!fs::is_directory(dir, ec)) break;
    take(dir);
  }
  return files;
}

TEST(UnitCpusOfThisProcess, CpuQuotaIsWhatTheCgroupFilesSay) {
  const FilesQuota files = quota_from_the_files();
  if (!files.known) GTEST_SKIP() << "this process's cpu controller is not mounted under /sys/fs/cgroup";
  const std::optional<double> got = cluster::cpu_quota();
  ASSERT_EQ(got.has_value(), files.cpus.has_value())
      << "cpu_quota() " << got.value_or(-1) << ", the files " << files.cpus.value_or(-1);
  if (got) {
    EXPECT_DOUBLE_EQ(*got, *files.cpus);
  }
}

// usable_cpus() follows the affinity mask it is called under (sched_getaffinity(0) is the calling thread's): a thread
// bound to 1 CPU gets 1, whatever the quota; bound to 2 and to all of this process's CPUs, that many bounded by the
// quota the files give, rounded up (or, where they cannot be read here, at least 1 and at most that many).
TEST(UnitCpusOfThisProcess, UsableCpusFollowsTheAffinityMaskBoundedByTheQuota) {
  cpu_set_t all;
  CPU_ZERO(&all);
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &all)) cpus.push_back(c);
  }
  ASSERT_FALSE(cpus.empty());
  const FilesQuota files = quota_from_the_files();
  // A thread of its own: the mask set is that thread's, and the test's other threads keep theirs.
  std::thread([&] {
    for (const size_t n : {size_t{1}, size_t{2}, cpus.size()}) {
      if (n > cpus.size()) continue;
      cpu_set_t set;
      CPU_ZERO(&set);
      for (size_t i = 0; i < n; ++i) CPU_SET(cpus[i], &set);
      ASSERT_EQ(sched_setaffinity(0, sizeof set, &set), 0) << "binding a thread to " << n << " CPUs";
      const int got = cluster::usable_cpus();
      int want = static_cast<int>(n);
      if (files.cpus) want = std::max(1, std::min(want, static_cast<int>(std::ceil(*files.cpus))));
      if (n == 1 || files.known) {
        EXPECT_EQ(got, want) << "bound to " << n << " of " << cpus.size() << " CPUs";
      } else {
        EXPECT_GE(got, 1);
        EXPECT_LE(got, want) << "bound to " << n << " of " << cpus.size() << " CPUs";
      }
    }
  }).join();
}

}  // namespace
