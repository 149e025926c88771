// The distributed optimizer: applies a distributed autograd context's gradients to parameters wherever they live.
//
//   std::vector<rref::RRef> params = remote_model.remote_parameters();     // RRefs owned by the workers holding them
//   dist_optim::DistributedOptimizer opt("sgd", params, {{"lr", 0.05}, {"momentum", 0.9}});
//   {
//     dist_autograd::ContextGuard ctx;
//     ... forward through RPC ..., dist_autograd::backward(ctx.id(), {loss});
//     opt.step(ctx.id());   // every owner steps its own parameters with that context's gradients, concurrently
//   }
//
// Construction creates one local LibTorch optimizer per owner, over that owner's parameters (PyTorch's
// DistributedOptimizer does the same). Kinds and hyper-parameters (PyTorch's names; unset ones take PyTorch's
// defaults; an unknown name is an error):
//   sgd      lr, momentum, dampening, weight_decay, nesterov (0/1)
//   adam     lr, beta1, beta2, eps, weight_decay, amsgrad (0/1)
//   adamw    lr, beta1, beta2, eps, weight_decay (default 0.01), amsgrad (0/1)
//   adagrad  lr, lr_decay, weight_decay, initial_accumulator_value, eps
//   rmsprop  lr, alpha, eps, weight_decay, momentum, centered (0/1)
//
// Concurrency: several trainers (each with its own DistributedOptimizer) may step the same parameters at once. By
// default steps on one owner take that owner's lock, so each update is applied whole, and an update bumps the
// parameters' version counters as an in-place change does (a backward that saved an older version then fails loudly,
// as in PyTorch). With `hogwild`, steps from different optimizers run without the owner lock and the updates are
// invisible to version counters (lock-free Hogwild!: a concurrent backward may see a newer parameter).
//
// Errors: tandem::Error naming the owner. A parameter no gradient reached in the context is left unchanged.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tandem/rpc/future.h"
#include "tandem/rref/rref.h"

namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace tandem::dist_optim {

struct DistributedOptimizerOptions {
  bool hogwild = false;
  std::chrono::milliseconds timeout{0};  // per RPC; non-positive: the RPC default
};

class DistributedOptimizer {
 public:
  // Throws tandem::Error naming every owner that cannot create its optimizer, with the first one's code
  // (INVALID_ARGUMENT for an unknown kind or hyper-parameter, or a parameter that is not a tensor; DEADLINE_EXCEEDED
  // when an owner did not reply within the timeout, e.g. while its parameters' values were still being made). On
  // failure no optimizer stays on any owner: every owner asked is told to release it, and an owner still waiting for
  // its parameters refuses to register one past the timeout.
  DistributedOptimizer(const std::string& kind, const std::vector<rref::RRef>& parameters,
                       const std::map<std::string, double>& hyper = {}, DistributedOptimizerOptions options = {});
  // Releases the remote optimizers (asynchronously: a lost release is sent again, 3 times in all; one that still fails
  // is logged as a warning naming the owner, whose optimizer then lives until its RPC stops).
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Applies context `context_id`'s gradients on every owner, concurrently; returns when all have. Throws
  // tandem::Error (NOT_FOUND when an owner no longer has its optimizer; UNKNOWN when a step threw).
  void step(int64_t context_id);
  rpc::Future step_async(int64_t context_id);

  // Checkpoints (checkpoint::State::add with these two): save() fetches every owner's optimizer state (LibTorch's own
  // serialization, sent back as a byte tensor) into `archive`; load() sends each owner its part. The optimizer must
  // have the same kind, owners and parameters as the one saved: FAILED_PRECONDITION otherwise. Not concurrent with
  // step(). Throws tandem::Error naming the owner that failed.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  void release();
  std::vector<std::pair<int, int64_t>> remote_;  // (owner rank, optimizer id there)
  DistributedOptimizerOptions options_;
};

// The optimizers this worker holds for DistributedOptimizers anywhere (its own and other workers'): for leak checks.
// Thread-safe.
int64_t owned_optimizer_count();

namespace detail {
// Runs `f` holding the lock every step of a non-hogwild optimizer on this worker takes (hogwild steps do not): for
// tests that show which steps wait for it. Thread-safe.
void with_owner_lock(const std::function<void()>& f);
// Runs `probe` in every step on this worker that applies gradients, just before it applies them (holding the owner
// lock when the step takes it, and always its own optimizer's lock: steps of one optimizer never overlap); an empty
// function removes it. For tests that show which steps overlap. Thread-safe; a step that began before the call may
// still run the probe it replaced.
void set_step_probe(std::function<void()> probe);
}  // namespace detail

}  // namespace tandem::dist_optim
