// Collective scenarios every rank of a comm test runs; each returns "" or what went wrong on that rank.
#pragma once

#include <string>

namespace tandem::test {

// Registers the collective scenarios (tests/common/scenario.h).
void register_scenarios();

}  // namespace tandem::test
