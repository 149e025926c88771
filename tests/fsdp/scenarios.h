// Fully sharded scenarios every rank of an fsdp test runs (tests/common/scenario.h).
#pragma once

namespace tandem::test {

void register_fsdp_scenarios();

}  // namespace tandem::test
