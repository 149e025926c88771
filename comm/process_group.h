// Collectives: a process group over the workers of a job (all of them, or a subset), on Gloo for CPU tensors, and
// over shared memory for the common collectives when every rank is on one host (SharedMemory below).
//
//   rpc::init_rpc(...);                                          // the group meets through the job's store
//   auto pg = comm::ProcessGroup::create("default");             // every rank calls it, with the same name
//   pg->allreduce(grad, comm::ReduceOp::kAvg).get...;            // asynchronous: a future per operation
//   comm::wait(pg->allreduce(grad));                             // or synchronous (throws tandem::Error on failure)
//
// Operations run in the order they are issued, on the group's own thread; a future completes (None, or the error)
// when the operation is done. Tensors are reduced in place and must be contiguous CPU tensors of the same shape and
// dtype on every rank (float, double, half, bfloat16, int8, uint8, int32, int64; kAvg needs a floating dtype; half and
// bfloat16 are summed in float and rounded once per step, as on the wire).
// send/recv are point-to-point and do not queue behind collectives: they start at once and complete independently.
//
// Errors (docs/errors.md): a bad argument is refused by the call itself, before anything is queued, with tandem::Error:
// INVALID_ARGUMENT (a tensor that is not a defined, contiguous CPU tensor, wrong sizes, a rank outside the group, kAvg
// on an integer tensor), UNIMPLEMENTED (a dtype collectives do not support); the group is unaffected. Every operation
// has the group's timeout; a rank that dies or never arrives makes the others' futures fail, naming the group and the
// operation — never a hang: DEADLINE_EXCEEDED when every member still answers but one did not take part within the
// timeout, UNAVAILABLE naming the members that do not answer, or that destroyed the group, otherwise. After such a
// failure the group is unusable (its connections are in an unknown state; later operations fail with
// FAILED_PRECONDITION): create a new one. create() sets SIGPIPE to be ignored (unless the program installed a handler):
// Gloo's writes to a dead peer would otherwise kill the process.
//
// NCCL (CUDA tensors) is not written: neither CUDA nor NCCL exists on these machines (docs/collectives.md). This
// interface takes any at::Tensor and returns futures, so an NCCL group can implement it behind TANDEM_WITH_NCCL;
// ProcessGroupOptions::backend = kNccl fails with UNIMPLEMENTED until then.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/future.h"

namespace tandem::comm {

enum class ReduceOp { kSum, kAvg, kMin, kMax, kProduct };

enum class Backend { kGloo, kNccl };

// Whether a group on CPU tensors runs allreduce, broadcast, allgather, reduce_scatter and barrier over shared memory
// (comm/detail/shm.h) instead of Gloo's TCP algorithms. The other operations always use Gloo.
enum class SharedMemory {
  kAuto,  // when every rank is on one host and network namespace (boot ids and namespaces compared at create())
          // and they can map one segment; Gloo otherwise. TANDEM_SHARED_MEMORY=0 or 1 turns it into kNever or kAlways.
  kAlways,  // create() fails (FAILED_PRECONDITION or UNAVAILABLE, with the reason) when the ranks cannot share one
  kNever,
};

struct ProcessGroupOptions {
  // Per operation, and for set-up. Non-positive (the default): RpcOptions::rpc_timeout, resolved by create().
  std::chrono::milliseconds timeout{0};
  // Debug mode: before each operation the ranks compare what they are about to call (operation, root or reduce op,
  // dtype and shape) and every rank fails with FAILED_PRECONDITION naming the first rank that differs from rank 0
  // (PyTorch users otherwise get a hang, then a watchdog kill). Costs one small allgather per operation. The
  // environment variable TANDEM_DEBUG_COLLECTIVES=1 turns it on for every group.
  bool debug = false;
  Backend backend = Backend::kGloo;
  SharedMemory shared_memory = SharedMemory::kAuto;
};

class ProcessGroup {
 public:
  // Collective over `ranks` (job ranks, every one when empty): each of them calls it with the same `name`; returns
  // when all are connected. A worker not in `ranks` must not call it. Throws tandem::Error.
  static std::shared_ptr<ProcessGroup> create(const std::string& name, std::vector<int> ranks = {},
                                              ProcessGroupOptions options = {});
  // Destroying a group fails its queued operations at once (CANCELLED: "... allreduce #7: the group was destroyed on
  // this rank before the operation started"); the one running ends at its next barrier over shared memory
  // (CANCELLED, unless every rank has arrived there), within the timeout over Gloo. The other ranks' operations that
  // need this rank fail, UNAVAILABLE naming it ("rank 1 (worker 'w1') destroyed its process group"): at once over
  // shared memory, once the operation running here has ended over Gloo (its connections close then). Over shared
  // memory, every barrier this rank reached still passes on the others.
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;  // within the group
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;
  // How the shared-memory operations above travel: "shared_memory" or "gloo" (decided by create(), for good).
  virtual const char* transport() const = 0;

  virtual rpc::Future allreduce(at::Tensor tensor, ReduceOp op = ReduceOp::kSum) = 0;
  // `tensor` holds the root's data on return, on every rank (`root` is a group rank).
  virtual rpc::Future broadcast(at::Tensor tensor, int root) = 0;
  // `output` (size() times input's elements, same dtype) receives every rank's input, in group rank order.
  virtual rpc::Future allgather(at::Tensor output, at::Tensor input) = 0;
  // The reduction of every rank's `tensor` lands in root's `tensor`; other ranks' tensors are left unchanged.
  virtual rpc::Future reduce(at::Tensor tensor, int root, ReduceOp op = ReduceOp::kSum) = 0;
  // Root's `output` (size() times input's elements) receives every rank's input in rank order; `output` is ignored
  // (may be undefined) elsewhere.
  virtual rpc::Future gather(at::Tensor output, at::Tensor input, int root) = 0;
  // Rank i's `output` receives the i-th of size() equal chunks of root's `input` (ignored, may be undefined,
  // elsewhere).
  virtual rpc::Future scatter(at::Tensor output, at::Tensor input, int root) = 0;
  // Chunk i of every rank's `input` (size() equal chunks) goes to rank i; `output` receives them in rank order.
  virtual rpc::Future all_to_all(at::Tensor output, at::Tensor input) = 0;
  // `output` receives chunk rank() of the reduction of every rank's `input` (size() equal chunks, same dtype); it may
  // be that chunk of `input` itself (in place). Over shared memory each rank reduces its own chunk; Gloo has no
  // reduce-scatter, so across hosts this is an allreduce of a copy of `input` (twice a dedicated algorithm's traffic).
  virtual rpc::Future reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op = ReduceOp::kSum) = 0;
  virtual rpc::Future barrier() = 0;

  // A flat tensor of `numel` zeros of `dtype` that every rank of the group maps, when the group runs over shared
  // memory: allreduce() of it, or of the same slice of it on every rank, copies nothing in or out (each rank reduces
  // its share reading the others' tensors in place and writes the result into all of them: about half the memory
  // traffic of a plain tensor's). Collective, in order with the group's operations: every rank calls it with the same
  // numel and dtype; returns when all have mapped it. An undefined tensor on every rank when the group runs over Gloo,
  // or when some rank could not map it (a full /dev/shm): use a plain tensor then. Nothing is left in /dev/shm (a rank
  // killed while the tensor is made leaves its segment's name until the next group is created in its pid namespace);
  // the tensor's storage holds the mappings and may outlive the group. An allreduce where some ranks pass a shared
  // tensor and others a plain one, or other parts of it, fails on every rank (FAILED_PRECONDITION, the group broken).
  // Throws tandem::Error (INVALID_ARGUMENT, UNIMPLEMENTED for the dtype, or the group's failure).
  virtual at::Tensor shared_tensor(int64_t numel, at::ScalarType dtype) = 0;

  // Point-to-point: `tensor` goes to group rank `dst`, which posts a recv with the same `tag` and the same number of
  // bytes; messages between two ranks with the same tag arrive in the order they were sent. Each has the group's
  // timeout; a failed or timed-out send/recv breaks the group like a failed collective (Gloo closes the connection).
  virtual rpc::Future send(at::Tensor tensor, int dst, uint32_t tag = 0) = 0;
  virtual rpc::Future recv(at::Tensor tensor, int src, uint32_t tag = 0) = 0;
};

// Waits for an operation (bounded by its future's deadline); throws tandem::Error when it failed.
void wait(const rpc::Future& work);

}  // namespace tandem::comm
