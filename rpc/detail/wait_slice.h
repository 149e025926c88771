// Prompt wake-ups for threads that sleep waiting for a reply.
//
// Linux's scheduler (EEVDF, custom slices since 6.12) lets a thread ask for a shorter time slice than the default
// (sched_setattr's sched_runtime for SCHED_OTHER; 0.1 ms at least). The thread gets no more CPU for it; its deadline
// comes sooner, so when its wait ends it runs at once instead of queueing behind a busy thread for the rest of that
// one's slice (1.5 ms and more). On a parameter server sharing two cores with its trainers, a trainer waited ~400 us
// per step for a CPU after its replies came. A thread that waits for replies does little between them, and its wake-up
// is on the critical path of the job.
//
// The direct channel's rpc_sync (when it stops spinning and sleeps on its reply) and Future's waits (when they block)
// call prefer_prompt_wake() first. The thread keeps the short slice: asked once, no system call afterwards; its work
// between replies (the trainer's loss, say) is on the critical path too. Computing beside other busy threads on the
// same cores, such a thread is switched more often, each still getting its share. Threads it starts later inherit
// the slice (Linux copies it); the threads RPC starts to run functions drop it (drop_inherited_wait_slice).
//
// Thread-safety: any thread. Errors: none; where the kernel has no custom slices, or the thread's policy is not
// SCHED_OTHER, or its own slice is as short already, nothing changes (and the thread is not tried again); a refusal
// (seccomp, a sandbox) is logged once at debug level. The thread keeps the slice after shutdown.
#pragma once

#include <chrono>
#include <cstdint>

namespace tandem::rpc::detail {

// The slice asked for (RpcOptions::wait_slice, set by init_rpc); 0 turns prefer_prompt_wake off (the default until
// init_rpc, and after shutdown).
void set_wait_slice(std::chrono::microseconds slice);

// Gives the calling thread the slice set_wait_slice set as its time slice, the first time it is called on the thread
// with a slice set (see the top); later calls on the thread return at once.
void prefer_prompt_wake();

// For a thread RPC starts to run functions or messages (they compute at length): when it inherited the slice
// prefer_prompt_wake gave (in this or an earlier init_rpc) from the thread that started it (Linux copies a thread's
// slice to the threads it creates), it goes back to the kernel's default slice; and prefer_prompt_wake does nothing on
// it later (a function's nested call that sleeps).
void drop_inherited_wait_slice();

// The threads of this process given the short slice (for tests).
int64_t prompt_wake_threads();

}  // namespace tandem::rpc::detail
