// Collective scenarios every rank of a comm test runs; each returns "" or what went wrong on that rank.
#pragma once

#include <string>

namespace tandem::test {

// Registers "scenario"(name) -> error string, run by every rank of a test.
void register_scenarios();
std::string run_scenario(const std::string& name);

}  // namespace tandem::test
