// Collectives over one shared-memory segment, for a process group whose ranks all run on one host
// (comm/process_group.cc decides when; docs/collectives.md describes the algorithms).
//
// The segment holds a small header, a control line per rank (its arrival count and its process's identity) and a slot
// per rank, each slot split in two halves used alternately: every operation is a series of rounds, each on the next
// half; in a round each rank writes its own slot, all meet at a barrier, then each reads what it needs (and, for a
// large allreduce, reduces its share into its own slot, meets the others once more and copies the shares out). A half
// is written again only two rounds later, after a barrier every rank reaches once it has finished reading it.
//
// Errors are thrown as tandem::Error: DEADLINE_EXCEEDED naming the ranks that did not arrive by the deadline,
// UNAVAILABLE naming a rank whose process is gone (seen in /proc without waiting for the deadline, when the ranks
// share a pid namespace) or that failed an operation the others wait in. After an error the segment is unusable.
// Not thread-safe: one thread (the group's) runs the operations.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/comm/process_group.h"

namespace tandem::rpc {
class Store;
}

namespace tandem::comm::detail {

// This process's host and network namespace ("<boot id>/<netns inode>"): ranks with equal places may share memory.
std::string host_place();

class ShmGroup {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective over the group: rank 0 creates the segment (removing first any segment a dead creator left behind)
  // and publishes its name in `store` under `key`; every other rank maps it and checks it is the same segment.
  // `labels` name the ranks in errors ("rank 1 (worker 'w1')"). An error means this rank cannot use the segment; the
  // caller agrees with the others before using it, and then has rank 0 call unlink().
  static absl::StatusOr<std::unique_ptr<ShmGroup>> attach(rpc::Store& store, const std::string& key, int rank,
                                                          std::vector<std::string> labels,
                                                          std::chrono::milliseconds timeout);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Removes the segment's name (the memory lives on while a rank maps it): nothing is left in /dev/shm however the
  // ranks end. Rank 0 calls it once every rank has mapped the segment.
  void unlink();

  // The operations of comm::ProcessGroup, with its argument checks done by the caller; each must be called by every
  // rank in the same order and ends by `deadline` or throws.
  void allreduce(const at::Tensor& t, ReduceOp op, Clock::time_point deadline);
  void broadcast(const at::Tensor& t, int root, Clock::time_point deadline);
  void allgather(const at::Tensor& output, const at::Tensor& input, Clock::time_point deadline);
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, Clock::time_point deadline);
  void barrier(Clock::time_point deadline);

  struct Layout;  // the segment (shm.cc)

 private:
  ShmGroup(int rank, std::vector<std::string> labels, void* base, size_t bytes, std::string name,
           std::chrono::milliseconds timeout);
  void meet(Clock::time_point deadline);  // the barrier every round ends with
  [[noreturn]] void fail(int culprit, int reason, const std::string& message);
  std::string gone_ranks() const;                               // the ranks whose processes ended, or ""
  at::Tensor half(int r, size_t bytes, c10::ScalarType dtype);  // rank r's half of this round, as a tensor
  // Calls round(at, m) for the rounds over `n` elements, `per_round` at most each ([at, at + m)), each round on the
  // next half.
  template <typename F>
  void each_round(int64_t n, int64_t per_round, F&& round);

  const int rank_, size_;
  const std::vector<std::string> labels_;
  void* const base_;
  const size_t bytes_;
  std::string name_;  // until unlink()
  Layout* layout_;
  std::chrono::milliseconds timeout_{0};  // the group's, for messages
  uint64_t met_ = 0;                      // barriers passed
  uint64_t round_ = 0;                    // rounds started: round_ % 2 is the half in use
};

}  // namespace tandem::comm::detail
