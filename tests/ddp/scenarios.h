// DistributedDataParallel scenarios every rank of a ddp test runs (tests/common/scenario.h).
#pragma once

namespace tandem::test {

void register_scenarios();

}  // namespace tandem::test
