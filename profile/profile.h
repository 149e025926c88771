// Profiling a training step: LibTorch's profiler, with Tandem's communication in the same trace.
//
//   profile::start();                                   // on the thread that runs the step
//   ... forward, rpc calls, backward, collectives, DDP ...
//   profile::stop("/tmp/step-{worker}.json");            // one Chrome trace (chrome://tracing, Perfetto) per worker
//
// The trace holds LibTorch's operator events (aten::*, RECORD_FUNCTION ranges) of the thread that started the profile
// and of Tandem's threads while they work for this worker (a registered function serving a call, a batched function's
// batch on whichever thread runs it: their operators too), and Tandem's ranges, as PyTorch names its own where it has
// one:
//   rpc_sync#f(worker0 -> worker1), rpc_async#..., rpc_send#...   a call, from its start to its reply (caller's side)
//   rpc_serve#f(worker0 -> worker1)                               serving it, request read to reply written (callee)
//   rpc_batch#f(3 requests)                                       a batched function running one batch (rpc/batching.h;
//                                                                 each request is also an rpc_serve# range)
//   comm:allreduce(group g, 64 bytes, shared_memory)              a collective on the group's thread
//   dist_autograd:backward#ctx, dist_autograd:remote_backward#ctx(from worker1)   backward passes of a context
//   ddp:bucket#i(N bytes)                                         a DDP bucket's allreduce, launch to completion
// Times are microseconds since the epoch, so the traces of several workers line up. They go through LibTorch's own
// profiler (enableProfiler / disableProfiler, CPU activities); Debian's LibTorch has no Kineto, whose trace writer
// (ProfilerResult::save) it would need, so the trace is written here from the profiler's events.
//
// Errors: tandem::Error. start() while a profile runs, or stop() from another thread than start()'s (the profiler
// lives in that thread's state) or without start(), is FAILED_PRECONDITION; stop() waits up to `wait` for Tandem's
// work in progress on other threads to leave the profile (DEADLINE_EXCEEDED otherwise; the profile goes on and stop()
// may be called again); a file that cannot be written is UNAVAILABLE, after the profile has stopped.
//
// Thread-safety: start() and stop() from one thread; everything else from any thread. When no profile runs, each of
// Tandem's ranges costs one atomic load.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace tandem::profile {

void start();
// Writes the trace to `path` ("{worker}" and "{rank}" replaced); returns the number of events written.
int64_t stop(const std::string& path, std::chrono::milliseconds wait = std::chrono::seconds(10));

namespace detail {
extern std::atomic<bool> g_active;
}
inline bool active() { return detail::g_active.load(std::memory_order_acquire); }

// ---- for Tandem's layers

// The worker named in file names and in the trace's process name (rpc sets it at init_rpc).
void set_worker(const std::string& name, int rank);

// While alive, this thread records into the running profile (LibTorch's operators and ranges), if one runs. stop()
// waits for every OnThisThread to end.
class OnThisThread {
 public:
  OnThisThread();
  ~OnThisThread();
  OnThisThread(const OnThisThread&) = delete;
  OnThisThread& operator=(const OnThisThread&) = delete;
  bool recording() const { return counted_; }

 private:
  bool counted_ = false;
  struct Saved;
  std::unique_ptr<Saved> saved_;  // the thread's own profiler state, restored at the end
};

// A finished range [start, end) named `name`, with steady-clock times (written at the epoch's times), when a profile
// runs (call it only then: build names after active()). A range that began before the running profile started is
// left out, as its operators are: the profile holds what happened inside it, whole.
void report_steady(const std::string& name, std::chrono::steady_clock::time_point start,
                   std::chrono::steady_clock::time_point end);

}  // namespace tandem::profile
