// A futex word's wait and wake, for waits across processes on shared memory (comm's shared-memory collectives,
// pipeline's same-host deliveries), where a Mutex cannot be.
//
// Thread-safety: any thread, any process mapping the word. Errors: none (a wait may also end early, spuriously or on a
// signal: callers look at the word again).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

#include "tandem/sync/sync.h"

namespace tandem {

// Sleeps while *word == expected, for at most `for_at_most` (returns at once when it is not positive). A blocking
// wait, as sync.h's: the thread's WaitObserver hears of it.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds for_at_most) {
  const auto ns = for_at_most.count();
  if (ns <= 0) return;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  BlockingScope blocked(word->load() == expected);  // a direct-channel loop thread lends its place meanwhile (sync.h)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// Wakes every waiter of `word`.
inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace tandem
