#include "tandem/cluster/cpus.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tandem::cluster {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One cgroup's quota in CPUs from its directory: v2's cpu.max ("max 100000" or "150000 100000"), v1's
// cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us.
std::optional<double> quota_at(const std::string& dir, bool v2) {
  double quota = 0, period = 0;
  if (v2) {
    std::vector<std::string> f = absl::StrSplit(read_file(dir + "/cpu.max"), absl::ByAnyChar(" \n"), absl::SkipEmpty());
    if (f.size() < 2 || f[0] == "max" || !absl::SimpleAtod(f[0], &quota) || !absl::SimpleAtod(f[1], &period)) {
      return std::nullopt;
    }
  } else if (!absl::SimpleAtod(absl::StripAsciiWhitespace(read_file(dir + "/cpu.cfs_quota_us")), &quota) ||
             !absl::SimpleAtod(absl::StripAsciiWhitespace(read_file(dir + "/cpu.cfs_period_us")), &period)) {
    return std::nullopt;
  }
  if (quota <= 0 || period <= 0) return std::nullopt;
  return quota / period;
}

struct Mount {
  std::string root, point;  // the hierarchy's path mounted, and where
};

// A mountinfo field with its octal escapes (\040 for a space) decoded.
std::string unescape(const std::string& field) {
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() &&
        std::all_of(field.begin() + i + 1, field.begin() + i + 4, [](char c) { return c >= '0' && c <= '7'; })) {
      out += static_cast<char>((field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 + (field[i + 3] - '0'));
      i += 3;
    } else {
      out += field[i];
    }
  }
  return out;
}

}  // namespace

std::optional<double> cpu_quota(const std::string& proc_self_cgroup, const std::string& mountinfo,
                                const std::string& root) {
  // This process's cgroup: the v1 line whose controllers include cpu, else the v2 line ("0::path").
  std::optional<std::string> v1_path, v2_path;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) v2_path = f[2];
    for (absl::string_view c : absl::StrSplit(f[1], ',')) {
      if (c == "cpu") v1_path = f[2];
    }
  }
  // Where each hierarchy is mounted: "id parent dev root point options [optional...] - type source super-options"
  // (single spaces; a field may be empty; root and point escape space, tab, newline and backslash as \ooo).
  std::vector<Mount> v1_mounts, v2_mounts;
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    auto dash = std::find(f.begin(), f.end(), "-");
    if (dash - f.begin() < 6 || f.end() - dash < 4) continue;
    const std::string& type = dash[1];
    bool cpu = false;
    for (absl::string_view o : absl::StrSplit(dash[3], ',')) cpu = cpu || o == "cpu";
    if (type == "cgroup2") v2_mounts.push_back(Mount{unescape(f[3]), unescape(f[4])});
    if (type == "cgroup" && cpu) v1_mounts.push_back(Mount{unescape(f[3]), unescape(f[4])});
  }
  const bool v2 = !(v1_path && !v1_mounts.empty());
  const std::optional<std::string>& path = v2 ? v2_path : v1_path;
  if (!path) return std::nullopt;
  // The mount of this process's cgroup: the one whose root (in a container, often the container's own cgroup, which
  // /proc/self/cgroup names in full) is the longest whole-component prefix of the path; the rest is under its point.
  const Mount* mount = nullptr;
  std::string below;
  for (const Mount& m : v2 ? v2_mounts : v1_mounts) {
    const std::string prefix = m.root == "/" ? "" : m.root;
    const bool under =
        absl::StartsWith(*path, prefix) && (path->size() == prefix.size() || (*path)[prefix.size()] == '/');
    if (under && (mount == nullptr || m.root.size() > mount->root.size()))
      mount = &m, below = path->substr(prefix.size());
  }
  if (mount == nullptr) return std::nullopt;
  std::vector<std::string> parts = absl::StrSplit(below, '/', absl::SkipEmpty());
  if (std::find(parts.begin(), parts.end(), "..") != parts.end()) return std::nullopt;  // outside this namespace
  std::optional<double> least;
  for (size_t depth = 0; depth <= parts.size(); ++depth) {  // the mount point, then each cgroup below it
    std::string dir = root + mount->point;
    for (size_t i = 0; i < depth; ++i) dir += "/" + parts[i];
    if (auto q = quota_at(dir, v2); q && (!least || *q < *least)) least = q;
  }
  return least;
}

std::optional<double> cpu_quota() {
  return cpu_quota(read_file("/proc/self/cgroup"), read_file("/proc/self/mountinfo"));
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0
                 ? CPU_COUNT(&set)
                 : static_cast<int>(std::thread::hardware_concurrency());  // more CPUs than a cpu_set_t holds
  if (auto quota = cpu_quota()) cpus = std::min(cpus, static_cast<int>(std::ceil(*quota - 1e-9)));
  return std::max(1, cpus);
}

}  // namespace tandem::cluster
