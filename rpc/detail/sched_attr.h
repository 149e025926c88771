// sched_getattr(2) / sched_setattr(2) for the calling thread: glibc 2.36 has no wrappers. Used by wait_slice.cc and
// its tests. Thread-safety: each call reads or sets the calling thread's own attributes. Errors: false, with errno.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tandem::rpc::detail {

// The argument's first version (SCHED_ATTR_SIZE_VER0).
struct SchedAttr {
  uint32_t size = sizeof(SchedAttr);
  uint32_t sched_policy = 0;  // SCHED_OTHER
  uint64_t sched_flags = 0;
  int32_t sched_nice = 0;
  uint32_t sched_priority = 0;
  uint64_t sched_runtime = 0;  // SCHED_OTHER on Linux >= 6.12: the thread's slice (ns), 0 on set: the default; 0 before
  uint64_t sched_deadline = 0;
  uint64_t sched_period = 0;
};
static_assert(sizeof(SchedAttr) == 48, "SCHED_ATTR_SIZE_VER0");

inline bool get_sched_attr(SchedAttr* a) {
  *a = SchedAttr{};
  return syscall(SYS_sched_getattr, 0, a, sizeof(SchedAttr), 0) == 0;
}

inline bool set_sched_attr(const SchedAttr& a) { return syscall(SYS_sched_setattr, 0, &a, 0) == 0; }

}  // namespace tandem::rpc::detail
