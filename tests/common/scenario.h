// Scenarios for multi-process tests: every rank runs the same named scenario, started through RPC from rank 0 (the
// test process); each returns "" or what went wrong on that rank.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace tandem::test {

// Registers the RPC function "scenario"(name) -> report, which calls `run` (an exception becomes its report).
void register_scenario_runner(std::function<std::string(const std::string&)> run);
// Runs `name` here, as the RPC function would.
std::string run_scenario(const std::string& name);
// Starts `scenario` on ranks 1..world-1, runs it here, and returns every rank's report ("rank r: ..." per failure);
// ranks in `skip_ranks` are not waited for.
std::string everywhere(int world, const std::string& scenario, const std::vector<int>& skip_ranks = {});

}  // namespace tandem::test
