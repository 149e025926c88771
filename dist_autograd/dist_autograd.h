// Distributed autograd: a model split across workers trains as if it were local.
//
//   {
//     dist_autograd::ContextGuard ctx;                          // a new context, current on this thread
//     at::Tensor h = rpc::rpc_sync<at::Tensor>("ps", "forward", x);   // recorded: a send here, a recv there
//     at::Tensor loss = head(h).sum();
//     dist_autograd::backward(ctx.id(), {loss});                // gradients cross every worker the forward touched
//     dist_autograd::Gradients g = dist_autograd::get_gradients(ctx.id());   // this worker's leaves only
//     optimizer.step(ctx.id());                                 // dist_optim: each owner applies its own
//   }                                                           // released here and on every worker it touched
//
// Recording: while a context is current on a thread (the guard's thread, and on a callee the thread running a
// function called from it), every RPC, `remote` and `to_here` records a send function on the sender for the tensors
// of the message that require grad, and a recv function on the receiver, whose tensors then require grad. Replies are
// recorded the same way. Nested calls (A -> B -> C) carry the context along.
//
// backward() runs the FAST-mode algorithm (docs/dist_autograd.md): the local pass from the roots captures the
// gradients of this worker's leaves and of its recv functions; each recv's gradients go to its send on the sender,
// whose worker runs its local pass from there at once, and so on. backward() returns when every worker reached has
// finished, with the first error anywhere. Rules: gradients accumulate per context (get_gradients), never into
// `.grad`; the graph stays alive until the context is released (several sends may reach one part of it).
//
// Errors: tandem::Error naming the worker and the cause. A context or send function a worker does not know is
// NOT_FOUND; what a backward function throws is UNKNOWN (a tandem::Error keeps its code). A worker that dies
// mid-backward fails the backward (no hang: every step has the RPC deadline).
//
// Thread-safety: contexts may be used from several threads; concurrent backward passes in one context accumulate.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "tandem/rpc/future.h"

namespace tandem::dist_autograd {

// Creates a context, current on this thread until the guard dies; then the context is released here and on every
// worker it touched (asynchronously: release_context's future is not waited for). Guards nest.
class ContextGuard {
 public:
  ContextGuard();
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
  int64_t id() const { return id_; }

 private:
  int64_t id_;
  int64_t previous_;
};

// The context current on this thread, or -1.
int64_t current_context();

// Backward pass from `roots` (each must require grad; its gradient is ones) in context `context_id`, across every
// worker the context's forward touched. `retain_graph` is accepted for PyTorch parity: the graph is kept until the
// context is released in any case. `timeout` bounds the whole pass and each hop of it, on every worker (a gradient
// message carries it on); non-positive: RpcOptions::rpc_timeout. Throws tandem::Error.
void backward(int64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph = false,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

// The gradients a context accumulated on this worker, by leaf tensor.
class Gradients {
 public:
  using Map = std::unordered_map<const void*, std::pair<at::Tensor, at::Tensor>>;  // TensorImpl -> (leaf, grad)
  explicit Gradients(Map map = {}) : map_(std::move(map)) {}
  // The gradient of `leaf`, or an undefined tensor if none reached it.
  at::Tensor operator[](const at::Tensor& leaf) const;
  bool contains(const at::Tensor& leaf) const { return map_.count(leaf.unsafeGetTensorImpl()) > 0; }
  size_t size() const { return map_.size(); }
  Map::const_iterator begin() const { return map_.begin(); }
  Map::const_iterator end() const { return map_.end(); }

 private:
  Map map_;
};
// Throws tandem::Error (NOT_FOUND) for a context this worker does not know.
Gradients get_gradients(int64_t context_id);

// Replaces the gradient the context holds for `leaf` on this worker (DistributedDataParallel writes averaged gradients
// back this way). Throws tandem::Error (NOT_FOUND) for a context this worker does not know.
void set_gradient(int64_t context_id, const at::Tensor& leaf, at::Tensor grad);

// Adds `grad` to the gradient the context holds for `leaf` on this worker: for layers that compute gradients with
// LibTorch's own engine and leave them where DistributedOptimizer finds them (a pipeline stage). A context this worker
// does not know yet is created only while this thread serves a call made in that context (so that the caller's
// release reaches this worker); otherwise, and for a released context, it throws tandem::Error (NOT_FOUND).
// Thread-safe.
void add_gradient(int64_t context_id, const at::Tensor& leaf, const at::Tensor& grad);

// Makes the context of the call this thread serves (current_context()) known on this worker, as add_gradient does when
// it must, and returns its id: a thread that serves no call (a pipeline stage's own thread) may then add gradients to
// it, until its caller releases it, whose release reaches this worker. Throws tandem::Error: FAILED_PRECONDITION when
// this thread serves no call made in a context; NOT_FOUND when the context's release reached this worker already (a
// late call). Thread-safe.
int64_t adopt_current_context();

// For work sent to another worker without a call (a pipeline step through shared memory): on the sender,
// share_context records that `worker` holds a part of the context, so that its release reaches it; on that worker,
// adopt_context makes the context known here as a call made in it from `origin` would (its gradients may then be
// added). The sender shares before it sends. Throws tandem::Error (NOT_FOUND): share_context when the sender does
// not know the context; adopt_context when the context's release reached this worker already (the work came after
// it: the context is not brought back, nobody would release it). Thread-safe.
void share_context(int64_t context_id, int worker);
void adopt_context(int64_t context_id, int origin);

// What a backward-part hook (below) is told: the context, the worker whose gradient message the part served, and
// when that worker's call times out (the pass's timeout as the sender resolved it, counted from the message's arrival
// here): a hook that holds the reply (a round waiting for other trainers) can fail it before then, naming what it
// waited for, instead of leaving the caller a bare timeout.
struct BackwardPart {
  int64_t context_id = 0;
  int from = -1;  // the rank of the worker that sent the gradient message (-1: not known)
  absl::Time deadline = absl::InfiniteFuture();
};

// Runs on this worker each time a gradient message's part of a backward pass is done here (its local pass, and the
// passes it sent gradients on to): context `part.context_id` then holds this part's gradients on this worker. Once per
// message, not per pass: a pass that reaches this worker by several messages runs it for each. The reply to
// the message, and so the backward() that sent it, waits for the future `hook` returns, and fails with its error (or
// with what `hook` throws, naming this worker). For a worker that owns parameters and applies gradients as they come:
// a parameter server's round, without a message of its own from each trainer (PyTorch applies optimizers inside the
// local backward likewise, _apply_optimizer_in_backward). One hook per worker: setting replaces the last, an empty
// function removes it. Thread-safe; `hook` runs on the thread that finished the part (an RPC thread; a transport's
// completion thread when the part sent gradients on and their replies came last) and must not block (it returns a
// pending future instead).
void set_backward_part_hook(std::function<rpc::Future(const BackwardPart& part)> hook);

// Releases a context here and, asynchronously, on every worker it touched; the future completes when all did.
rpc::Future release_context(int64_t context_id);

// Introspection: contexts alive on this worker, release messages that could not be delivered, and release messages
// this worker sent (its own releases and those it passed on; each attempt; since the process started).
struct Stats {
  int64_t contexts = 0;
  int64_t failed_releases = 0;
  int64_t release_messages_sent = 0;
};
Stats stats();

}  // namespace tandem::dist_autograd
