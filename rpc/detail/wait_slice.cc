#include "tandem/rpc/detail/wait_slice.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace tandem::rpc::detail {
namespace {

// sched_setattr(2)'s argument, its first version (SCHED_ATTR_SIZE_VER0); glibc 2.36 has no wrapper.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;  // SCHED_OTHER on Linux >= 6.12: the thread's slice (ns); 0 before
  uint64_t sched_deadline;
  uint64_t sched_period;
};
static_assert(sizeof(SchedAttr) == 48, "SCHED_ATTR_SIZE_VER0");

std::atomic<int64_t> g_slice_us{0};
std::atomic<int64_t> g_threads{0};
thread_local bool t_tried = false;  // this thread was given the slice, or cannot be

}  // namespace

void set_wait_slice(std::chrono::microseconds slice) {
  g_slice_us.store(slice.count() > 0 ? slice.count() : 0, std::memory_order_relaxed);
}

std::chrono::microseconds wait_slice() { return std::chrono::microseconds(g_slice_us.load(std::memory_order_relaxed)); }

void prefer_prompt_wake() {
  if (t_tried) return;
  const int64_t slice_us = g_slice_us.load(std::memory_order_relaxed);
  if (slice_us == 0) return;
  t_tried = true;
  SchedAttr now{};
  // runtime 0: a kernel without custom slices (it reports the slice of SCHED_OTHER threads since 6.12).
  if (syscall(SYS_sched_getattr, 0, &now, sizeof now, 0) != 0 || now.sched_policy != SCHED_OTHER ||
      now.sched_runtime == 0) {
    return;
  }
  const auto slice_ns = static_cast<uint64_t>(slice_us) * 1000;
  if (now.sched_runtime <= slice_ns) return;  // as short already (the thread's own choice)
  SchedAttr want{};
  want.size = sizeof want;
  want.sched_policy = SCHED_OTHER;
  want.sched_nice = now.sched_nice;  // sched_setattr sets the nice value too: the thread's own is kept
  want.sched_runtime = slice_ns;
  if (syscall(SYS_sched_setattr, 0, &want, 0) == 0) g_threads.fetch_add(1, std::memory_order_relaxed);
}

void drop_inherited_wait_slice() {
  t_tried = true;  // nor does it take the slice later, when it waits for a reply: its functions compute
  const int64_t slice_us = g_slice_us.load(std::memory_order_relaxed);
  if (slice_us == 0) return;
  SchedAttr now{};
  if (syscall(SYS_sched_getattr, 0, &now, sizeof now, 0) != 0 || now.sched_policy != SCHED_OTHER ||
      now.sched_runtime != static_cast<uint64_t>(slice_us) * 1000) {
    return;
  }
  SchedAttr want{};
  want.size = sizeof want;
  want.sched_policy = SCHED_OTHER;
  want.sched_nice = now.sched_nice;
  want.sched_runtime = 0;  // the kernel's default slice
  syscall(SYS_sched_setattr, 0, &want, 0);
}

int64_t prompt_wake_threads() { return g_threads.load(std::memory_order_relaxed); }

}  // namespace tandem::rpc::detail
