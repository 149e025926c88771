// DistributedDataParallel under distributed autograd (hybrid DDP + model parallelism): the one place that joins ddp/
// and dist_autograd/, so that neither needs the other.
//
//   ddp::DistributedDataParallel<Net> net(model, pg);             // the dense part, replicated on every trainer
//   dist_optim::DistributedOptimizer opt("sgd", params, {...});     // net's parameters (rref::make_local) + remote
//   ones
//   {
//     dist_autograd::ContextGuard ctx;
//     at::Tensor loss = loss_fn(net.forward(remote_embedding.forward(ids)));  // forward under the context
//     dist_autograd::backward(ctx.id(), {loss});                    // buckets are reduced as their gradients appear
//     ddp::reduce_context_gradients(net, ctx.id());                 // the averages, into the context
//     opt.step(ctx.id());
//   }
//
// How: linking this library sets DDP's external-backward probe to "a distributed autograd context is current". A
// DDP forward under a context then puts a tap between each parameter and its accumulator; distributed autograd's
// local pass runs through the taps (it captures the accumulators' inputs), so each gradient lands in its bucket as
// soon as it is computed and each complete bucket's allreduce starts during dist_autograd::backward, as with
// LibTorch's own engine. Windows with no_sync micro-steps (gradients summed in the context) are reduced after
// backward from the context.
//
// Contract: every rank of the DDP group calls reduce_context_gradients once per synchronised iteration, after its
// backward, with the context it used; uneven inputs and join() work as without distributed autograd. Errors:
// RpcError (a missing gradient without find_unused_parameters, naming it; a dead rank, naming group and operation).
// Thread-safety: as DDP (one thread drives forward, backward and this); the gradients a distributed backward brings on
// several RPC threads at once (outputs sent to several workers) reach the reducer one at a time.
#pragma once

#include <cstdint>

#include "tandem/ddp/ddp.h"

namespace tandem::ddp {

// Averages the context's gradients of `ddp`'s parameters across its group and writes the averages back into the
// context (dist_autograd::set_gradient), where DistributedOptimizer finds them.
void reduce_context_gradients(DistributedDataParallelBase& ddp, int64_t context_id);

}  // namespace tandem::ddp
