#include "tandem/rpc/detail/ids.h"

#include <atomic>

namespace tandem::rpc::detail {
namespace {

std::atomic<int64_t> g_counter{1};
std::atomic<int> g_self_rank{-1};

}  // namespace

int64_t next_global_id(int rank) {
  constexpr int64_t kCounterMask = (int64_t{1} << kIdCounterBits) - 1;
  return (static_cast<int64_t>(rank) << kIdCounterBits) | (g_counter.fetch_add(1) & kCounterMask);
}

int64_t next_global_id() { return next_global_id(self_rank_or(0)); }

int self_rank_or(int fallback) {
  const int rank = g_self_rank.load(std::memory_order_acquire);
  return rank >= 0 ? rank : fallback;
}

void set_self_rank(int rank) { g_self_rank.store(rank, std::memory_order_release); }

}  // namespace tandem::rpc::detail
