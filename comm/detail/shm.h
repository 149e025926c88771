// Collectives over one shared-memory segment, for a process group whose ranks all run on one host
// (comm/process_group.cc decides when; docs/collectives.md describes the algorithms).
//
// The segment holds a small header, a control line per rank (its arrival count and its process's identity) and a slot
// per rank, each slot split in two halves used alternately: every operation is a series of rounds, each on the next
// half; in a round each rank writes its own slot, all meet at a barrier, then each reads what it needs (and, for a
// large allreduce, reduces its share into its own slot, meets the others once more and copies the shares out). A half
// is written again only two rounds later, after a barrier every rank reaches once it has finished reading it.
//
// Shared tensors (shared_tensor below): memory each rank maps from every rank, in a segment of its own per tensor.
// An allreduce of one (or of the same slice of it on every rank) copies nothing in or out: all meet, each rank reduces
// its share reading the others' tensors where they are and writes the result into every rank's tensor, all meet again.
// Before the first barrier of every operation each rank posts what it runs: the operation, dtype, reduce op or root and
// element count, or for an allreduce of a shared tensor that tensor's id, offset and size; after it every rank
// compares, so ranks that disagree all fail (FAILED_PRECONDITION naming the first rank that differs from rank 0, and
// what each called) instead of reading each other's data as theirs. An operation on no elements still meets once.
//
// Errors are thrown as tandem::Error: DEADLINE_EXCEEDED naming the ranks that did not arrive by the deadline,
// UNAVAILABLE naming a rank whose process is gone (seen in /proc without waiting for the deadline, when the ranks
// share a pid namespace), whose group broke on another path (abandon()) or was destroyed before the barrier
// (destroyed()); CANCELLED on the rank whose group was destroyed. After an error the segment is unusable. Not
// thread-safe: one thread (the group's) runs the operations; abandon() and destroyed() may come from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
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

  // Marks the segment failed by this rank, whose group broke on another path (a Gloo operation, a send or a recv): the
  // others' waits end at once with UNAVAILABLE naming it, instead of at their deadlines. Nothing when the segment has
  // failed already. Any thread (atomics only).
  void abandon();

  // This rank's group is being destroyed: it arrives at no more barriers (kGoneBit in its arrival count, shm.cc). A
  // wait of this rank's thread ends at once (CANCELLED, unless every rank has arrived by then: it passes); each other
  // rank's wait for an arrival of this rank that will not come ends at once (UNAVAILABLE naming it, seen by that waiter
  // itself: the segment is not marked), while every barrier it did reach still passes on every rank (unlike abandon():
  // a clean end, where the fastest rank goes first while a slower one still sleeps in the last barrier, stays clean).
  // Any thread (atomics only).
  void destroyed();

  // Collective: a flat zeroed tensor of `numel` elements of `dtype` that every rank maps (each rank creates its own
  // segment, maps the others' and removes its name once all have mapped). Undefined, on every rank, when some rank
  // could not create or map its segment (a full /dev/shm): the caller then uses a plain tensor. The storage keeps the
  // mappings (of the others' tensors too) and may outlive this group.
  at::Tensor shared_tensor(int64_t numel, c10::ScalarType dtype, Clock::time_point deadline);

  struct Layout;  // the segment (shm.cc)
  struct Shared;  // one shared tensor's mappings (shm.cc)

 private:
  ShmGroup(int rank, std::vector<std::string> labels, void* base, size_t bytes, std::string name,
           std::chrono::milliseconds timeout);
  // The barrier every round ends with; after it, the check begin() asked for.
  void meet(Clock::time_point deadline);
  void wait_for_all(Clock::time_point deadline);  // meet() without the check
  // Every operation starts so: posts `word` (what it is, on what: shm.cc's signature()) for its first barrier, after
  // which meet() runs check_posted(what).
  void begin(const char* what, uint64_t word);
  void barrier_only(Clock::time_point deadline);  // a round with no data: an operation on nothing still meets once
  // Posts `word` for the next barrier; after it, check_posted(what) fails every rank (FAILED_PRECONDITION naming the
  // first rank whose word differs from rank 0's, and what each called) unless all posted the same.
  void post(uint64_t word);
  void check_posted(const char* what);
  uint64_t posted(int r) const;                            // rank r's word for the barrier just passed
  std::shared_ptr<Shared> shared_of(const at::Tensor& t);  // the shared tensor holding all of t, or null
  void push_allreduce(Shared& s, const at::Tensor& t, ReduceOp op, Clock::time_point deadline);
  // Marks the segment failed by `culprit` for `reason` (unless it failed already) and wakes every waiter.
  void mark_failed(int culprit, int reason);
  [[noreturn]] void fail(int culprit, int reason, const std::string& message);  // mark_failed, then throws
  std::string gone_ranks() const;  // the ranks the current barrier waits for whose processes ended, or ""
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
  std::chrono::milliseconds timeout_{0};    // the group's, for messages
  uint64_t met_ = 0;                        // barriers passed
  const char* check_after_meet_ = nullptr;  // begin()'s operation, until its first barrier
  uint64_t round_ = 0;                      // rounds started: round_ % 2 is the half in use
  uint64_t shared_made_ = 0;                // shared tensors created: the next one's id
  // This rank's shared tensors by address: weak, so a storage's deleter (any thread) touches only its own mappings.
  std::map<uintptr_t, std::weak_ptr<Shared>> shared_;
};

}  // namespace tandem::comm::detail
