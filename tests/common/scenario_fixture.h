// A multi-process fixture whose tests run scenarios on every rank (tests/common/scenario.h).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "tests/common/rpc_fixture.h"
#include "tests/common/scenario.h"
#include "tests/common/time_scale.h"

namespace tandem::test {

class MultiprocScenario : public MultiprocRpc {
 protected:
  // `world` ranks run `scenario`, in which the last rank kills itself (exit code 9): the others must report nothing
  // wrong, within 30 s, and the dead rank's exit code is checked.
  void expect_last_rank_killed(int world, const std::string& scenario) {
    start({.world_size = world});
    expect_clean_children_ = false;
    const auto t0 = Clock::now();
    EXPECT_EQ(everywhere(world, scenario, {world - 1}), "");
    EXPECT_LT(Clock::now() - t0, scaled(milliseconds(30000)));
    rpc::shutdown(false);
    auto codes = job_->wait_children(milliseconds(30000));
    EXPECT_EQ(codes.back(), 9);
  }
};

}  // namespace tandem::test
