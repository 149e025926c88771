#include "tests/common/scenario.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"

namespace tandem::test {
namespace {
std::function<std::string(const std::string&)>& runner() {
  static std::function<std::string(const std::string&)> run;
  return run;
}
}  // namespace

void register_scenario_runner(std::function<std::string(const std::string&)> run) {
  runner() = std::move(run);
  rpc::register_function("scenario", [](std::string name) { return run_scenario(name); });
}

std::string run_scenario(const std::string& name) {
  try {
    return runner()(name);
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what();
  }
}

std::string everywhere(int world, const std::string& scenario, const std::vector<int>& skip_ranks) {
  std::vector<std::pair<int, rpc::Future>> others;
  for (int r = 1; r < world; ++r) others.emplace_back(r, rpc::rpc_async(r, "scenario", scenario));
  std::string report;
  if (auto mine = run_scenario(scenario); !mine.empty()) report += "rank 0: " + mine + "\n";
  for (auto& [r, f] : others) {
    if (std::find(skip_ranks.begin(), skip_ranks.end(), r) != skip_ranks.end()) continue;
    auto s = f.status();
    if (!s.ok()) {
      report += "rank " + std::to_string(r) + ": " + std::string(s.message()) + "\n";
    } else if (auto e = f.get<std::string>(); !e.empty()) {
      report += "rank " + std::to_string(r) + ": " + e + "\n";
    }
  }
  return report;
}

}  // namespace tandem::test
