#include "tandem/rpc/detail/wait_slice.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "tandem/log/log.h"
#include "tandem/rpc/detail/sched_attr.h"

namespace tandem::rpc::detail {
namespace {

std::atomic<int64_t> g_slice_us{0};
std::atomic<int64_t> g_threads{0};
// The slice threads were given (as the kernel reports it after its clamp to 0.1-100 ms), 0 before any: kept across
// shutdown, so that a pool thread of a later init_rpc still knows an inherited one.
std::atomic<uint64_t> g_given_ns{0};
std::atomic<bool> g_refusal_logged{false};
thread_local bool t_tried = false;  // this thread was given the slice, or cannot be, or must not be

constexpr uint64_t kSchedFlagResetOnFork = 0x01;                      // SCHED_FLAG_RESET_ON_FORK
constexpr uint64_t kMinSliceNs = 100'000, kMaxSliceNs = 100'000'000;  // the kernel's clamp

// Sets the calling thread's slice (0: the kernel's default), keeping its nice value (sched_setattr sets it too) and
// its reset-on-fork flag (which an unprivileged thread may not clear).
bool set_slice(const SchedAttr& now, uint64_t runtime_ns) {
  SchedAttr want;
  want.sched_policy = SCHED_OTHER;
  want.sched_flags = now.sched_flags & kSchedFlagResetOnFork;
  want.sched_nice = now.sched_nice;
  want.sched_runtime = runtime_ns;
  return set_sched_attr(want);
}

}  // namespace

void set_wait_slice(std::chrono::microseconds slice) {
  g_slice_us.store(slice.count() > 0 ? slice.count() : 0, std::memory_order_relaxed);
}

void prefer_prompt_wake() {
  if (t_tried) return;
  const int64_t slice_us = g_slice_us.load(std::memory_order_relaxed);
  if (slice_us == 0) return;
  t_tried = true;
  SchedAttr now;
  // runtime 0: a kernel without custom slices (it reports the slice of SCHED_OTHER threads since 6.12).
  if (!get_sched_attr(&now) || now.sched_policy != SCHED_OTHER || now.sched_runtime == 0) return;
  const uint64_t slice_ns = std::clamp(static_cast<uint64_t>(slice_us) * 1000, kMinSliceNs, kMaxSliceNs);
  if (now.sched_runtime <= slice_ns) return;  // as short already (the thread's own choice)
  if (!set_slice(now, slice_ns)) {
    const int err = errno;
    if (!g_refusal_logged.exchange(true)) {
      TANDEM_LOG(kDebug, "rpc") << "the kernel refused a short time slice for a thread waiting for a reply ("
                                << std::strerror(err) << "): replies wake this worker's threads as before";
    }
    return;
  }
  g_threads.fetch_add(1, std::memory_order_relaxed);
  SchedAttr given;
  if (get_sched_attr(&given)) g_given_ns.store(given.sched_runtime, std::memory_order_relaxed);
}

void drop_inherited_wait_slice() {
  t_tried = true;  // nor does it take the slice later, when it waits for a reply: its functions compute
  const uint64_t given = g_given_ns.load(std::memory_order_relaxed);
  if (given == 0) return;
  SchedAttr now;
  if (get_sched_attr(&now) && now.sched_policy == SCHED_OTHER && now.sched_runtime == given) {
    set_slice(now, 0);  // the kernel's default slice
  }
}

int64_t prompt_wake_threads() { return g_threads.load(std::memory_order_relaxed); }

}  // namespace tandem::rpc::detail
