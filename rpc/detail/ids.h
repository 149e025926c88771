// Ids unique within a job, and this worker's rank without a lock.
//
// An id is the rank of the worker that made it in the top 16 bits and a process-wide counter in the low 48
// (docs/dist_autograd.md): unique as long as every worker uses its own rank, and never 0 (the counter starts at 1;
// some protocols use 0 for "none", e.g. an RRef's fork id). The counter is shared by every user (RRefs, distributed
// autograd, pipelines), so one worker's ids are unique across all of them.
//
// Thread-safety: all functions may be called from any thread.
#pragma once

#include <cstdint>

namespace tandem::rpc::detail {

inline constexpr int kIdCounterBits = 48;

// `rank` << 48 | the next value of the process-wide counter (masked to 48 bits).
int64_t next_global_id(int rank);
// The same with this worker's rank, or 0 before init_rpc.
int64_t next_global_id();

// This worker's rank from init_rpc until shutdown (or the exit handler) stops RPC, else `fallback`. One atomic read:
// unlike get_worker_info(), it takes no lock and copies nothing, so hot paths may call it.
int self_rank_or(int fallback);

// For rpc.cc only: publishes this worker's rank when init_rpc succeeds, -1 when RPC stops.
void set_self_rank(int rank);

}  // namespace tandem::rpc::detail
