// Pipeline ids for the tests that use this process's mailbox (pipeline/detail/p2p.h) directly.
#pragma once

#include <atomic>
#include <cstdint>

namespace tandem::pipeline::detail {

// A pipeline id no test of this binary used before, so that each test (run again in this process too,
// --gtest_repeat) finds none of the steps that ended or pipelines that were released before it: the mailbox keeps
// those for the process's life.
inline int64_t fresh_pipe() {
  static std::atomic<int64_t> next{int64_t{1} << 62};  // far above the ids the process's own pipelines take
  return next++;
}

}  // namespace tandem::pipeline::detail
