// DistributedDataParallel: data-parallel training over a process group, as PyTorch's DDP does it.
//
//   auto pg = comm::ProcessGroup::create("ddp");                       // every rank, after rpc::init_rpc
//   auto model = std::make_shared<Net>();                              // same architecture everywhere
//   ddp::DistributedDataParallel ddp(model, pg);                       // rank 0's parameters and buffers everywhere
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   for (auto& batch : *loader) {                                      // each rank its own shard (DistributedSampler)
//     opt.zero_grad();
//     auto loss = torch::nll_loss(ddp.forward(batch.data), batch.target);
//     loss.backward();                                                 // gradients averaged over the ranks, in .grad
//     opt.step();
//   }
//
// How (PyTorch's Reducer, VLDB'20): parameters are grouped into buckets in reverse order of registration (the first
// bucket capped at first_bucket_bytes, the others at bucket_cap_bytes, one dtype per bucket; in shared memory when the
// group runs over it, see shared_buckets). An autograd hook on each
// parameter's gradient accumulator copies the gradient into its bucket; when a bucket is complete its asynchronous
// allreduce starts (buckets start in index order, the same on every rank) and overlaps with the rest of backward. At
// the end of backward the averaged gradients are written to .grad (or already are, with gradient_as_bucket_view). After
// the first iteration the buckets are rebuilt in the order gradients actually became ready (rank 0's order, broadcast).
//
// Contract:
// - Every rank runs forward and backward the same number of times (use uneven_inputs + join() otherwise), with
//   backward after each forward that is not under no_sync(). The gradient hooks fire only under loss.backward() /
//   torch::autograd::backward (not torch::autograd::grad); with distributed autograd, see ddp_dist_autograd/.
// - Without find_unused_parameters, every parameter must get a gradient in every synchronised backward; otherwise
//   backward throws, naming the parameters. With it, forward's outputs are traversed to find the parameters the graph
//   does not reach; a parameter that any rank used in any micro-step since the last synchronised backward (no_sync
//   ones included) is averaged on every rank; parameters no rank used keep their .grad unchanged, as in PyTorch.
// - gradient_as_bucket_view changes memory and speed only: both settings give bit-identical gradients.
// - Errors of the process group (a dead rank, a timeout) come out of backward() as RpcError naming group and operation,
//   once every reduction it launched has ended. After a backward that threw before its end (a backward function
//   failed), the next forward first waits for the reductions it launched (each within the group's timeout).
// - Not thread-safe: one thread drives forward and backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/rpc/future.h"

namespace torch::nn {
class Module;
}

namespace tandem::ddp {

namespace detail {
class Reducer;
}  // namespace detail

// Reduces one bucket across the group: `bucket` holds this rank's gradients of the bucket, flat; the returned future
// completes once `bucket` holds the gradients averaged over the group's size (the initial world size under join()).
using CommHook = std::function<rpc::Future(comm::ProcessGroup& group, at::Tensor bucket)>;

// Without a registered hook, DDP divides each gradient by the group's size as it lands in its bucket (spread over
// backward, as PyTorch's Reducer does) and sums the buckets; a shared bucket (shared_buckets below) is averaged by
// its allreduce instead (the sum divided once: with a group size that is not a power of two the last bits may differ
// from a plain bucket's). allreduce_hook() averages the whole bucket, when it is complete.
CommHook allreduce_hook();
CommHook fp16_compress_hook();  // sent as float16 (half the bytes), averaged, written back in the bucket's dtype
CommHook bf16_compress_hook();  // likewise as bfloat16

struct DdpOptions {
  size_t bucket_cap_bytes = 25u << 20;   // PyTorch's kDefaultBucketBytesCap
  size_t first_bucket_bytes = 1u << 20;  // PyTorch's kDefaultFirstBucketBytes: the first allreduce starts early
  bool broadcast_buffers = true;         // rank 0's buffers (e.g. batch-norm statistics) before every forward
  bool find_unused_parameters = false;
  // .grad share the buckets' memory: no copy into the bucket and back, half the gradient memory. Unlike PyTorch (where
  // it is False), Tandem's default: it saved 5-10% of a DDP iteration in bench/run.sh ddp. The gradients are not
  // autograd views, so LibTorch's Optimizer::zero_grad (which detaches them) works; a .grad replaced by the user is
  // copied into the bucket and shared again at the next backward.
  bool gradient_as_bucket_view = true;
  // float and double buckets in memory every rank maps, when the group runs over shared memory
  // (ProcessGroup::shared_tensor): the allreduce then reads the other ranks' buckets where they are and writes the
  // averages into them, dividing as it reduces (no copies into and out of the group's segment, and no pass of its own
  // over each gradient); about twice the allreduce's speed. Off, for other dtypes, when the group runs over Gloo or
  // when /dev/shm has no room: plain buckets, each gradient divided as it lands.
  bool shared_buckets = true;
  bool rebuild_buckets = true;  // after the first iteration, in the order gradients became ready
  bool uneven_inputs = false;   // ranks may run out of data at different times: see join()
};

struct DdpStats {
  std::vector<size_t> bucket_bytes;  // current buckets, in launch order
  int64_t iterations = 0;            // synchronised backwards
  int64_t buckets_launched = 0;      // buckets of the synchronised backward under way whose reduction has started
  bool rebuilt = false;
};

class DistributedDataParallelBase {
 public:
  // Collective: checks that all ranks hold the same parameter shapes and dtypes (else RpcError naming the first rank
  // that differs), then broadcasts rank 0's parameters and buffers.
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<comm::ProcessGroup> group,
                              DdpOptions options = {});
  ~DistributedDataParallelBase();
  DistributedDataParallelBase(const DistributedDataParallelBase&) = delete;
  DistributedDataParallelBase& operator=(const DistributedDataParallelBase&) = delete;

  // Gradient accumulation: forwards and backwards while the guard lives only accumulate .grad locally; the next
  // synchronised backward reduces the accumulated sums (of every parameter any rank used in the window). Under
  // distributed autograd, run the window's backward passes in one context and reduce it once (ddp_dist_autograd/).
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallelBase& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallelBase& ddp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Before the first backward. The hook sees the flat bucket and must average it over the group.
  void register_comm_hook(CommHook hook);

  // Uneven inputs (needs uneven_inputs): a rank out of data calls join(), which takes part in the others' collectives
  // with zero gradients until every rank has joined, then gives every rank the parameters and buffers of the last
  // rank that trained. Gradients are always averaged over the group's size. Throws RpcError on a group failure.
  void join();

  // The steps around the module's forward (forward() below does both): pre_forward broadcasts buffers, agrees on who
  // still has data (uneven_inputs) and rebuilds buckets; post_forward readies the reducer for the next backward.
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  void post_forward(const at::Tensor& output) { post_forward(std::vector<at::Tensor>{output}); }

  // A backward on another engine (distributed autograd: see ddp_dist_autograd/, which calls this). If this
  // iteration's forward ran while the external-backward probe said so, a tap between each parameter and its
  // accumulator landed its gradient in its bucket as that backward computed it, and complete buckets were launched
  // then (overlap); otherwise every bucket is filled from grad_of(param) now (undefined: no gradient here). Waits for
  // the reductions, gives set_average(param, average) for every parameter some rank used, and ends the iteration.
  // Without find_unused_parameters a parameter without gradient is an error naming it, in `what`. Throws RpcError.
  using GradientOf = std::function<at::Tensor(const at::Tensor& param)>;
  using SetAverage = std::function<void(const at::Tensor& param, at::Tensor average)>;
  void reduce_external(const GradientOf& grad_of, const SetAverage& set_average, const std::string& what);

  comm::ProcessGroup& group() const;
  DdpStats stats() const;

 private:
  std::shared_ptr<detail::Reducer> impl_;  // shared with the gradient hooks, which hold it weakly
};

// The module-typed wrapper: forward(args...) is the module's forward between pre_forward and post_forward. Its output
// must be a tensor or a vector of tensors (call pre_forward/post_forward yourself for other outputs).
template <typename M>
class DistributedDataParallel : public DistributedDataParallelBase {
 public:
  DistributedDataParallel(std::shared_ptr<M> module, std::shared_ptr<comm::ProcessGroup> group, DdpOptions options = {})
      : DistributedDataParallelBase(module, std::move(group), options), module_(std::move(module)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    pre_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    post_forward(out);
    return out;
  }
  M& module() const { return *module_; }

 private:
  std::shared_ptr<M> module_;
};

// For a layer that runs backward passes on another engine (ddp_dist_autograd/ sets it): the id of the backward that
// will follow the forward running on this thread (the distributed autograd context current on it), or -1 when a local
// backward follows. Gradients of a graph forward built under another id never land in this iteration's buckets.
// Process-wide.
void set_external_backward_probe(std::function<int64_t()> probe);

}  // namespace tandem::ddp
