// Pipeline ids for the tests that use this process's mailbox (pipeline/detail/p2p.h) directly, and a wait for a
// receive to be waiting.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "tandem/pipeline/detail/p2p.h"
#include "tests/common/time_scale.h"

namespace tandem::pipeline::detail {

// A pipeline id no test of this binary used before, so that each test (run again in this process too,
// --gtest_repeat) finds none of the steps that ended or pipelines that were released before it: the mailbox keeps
// those for the process's life.
inline int64_t fresh_pipe() {
  static std::atomic<int64_t> next{int64_t{1} << 62};  // far above the ids the process's own pipelines take
  return next++;
}

// Whether a receive of `key` (on another thread) came to wait as `how` within 5 s (scaled): an event a test means to
// end a wait with must come while the receive waits, or the test would check another path and could pass untested.
inline bool await_waiting(Mailbox& box, const MailKey& key, Mailbox::Waiting how) {
  return test::poll_until(test::scaled(std::chrono::milliseconds(5000)), [&] { return box.waiting(key) == how; });
}

}  // namespace tandem::pipeline::detail
