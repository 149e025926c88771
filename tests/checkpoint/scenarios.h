// Checkpoint scenarios: what the writer child of the crash test does, and what every rank of a multi-process
// checkpoint test runs (tests/common/scenario.h).
#pragma once

#include <string>

namespace tandem::test {

void register_scenarios();
// The child of MultiprocCheckpointKill.KilledWhileWritingLeavesTheLastCompleteOne: saves steps n, n + 1, ... of a
// large tensor filled with the step number into $TANDEM_TEST_DIR until it is killed, n after the newest step there.
int write_forever();

}  // namespace tandem::test
