// Hybrid DDP + model parallelism, PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework"
// layout: a parameter server holds an embedding table (a RemoteModule around torch::nn::EmbeddingBag), trainers run
// a dense part under DistributedDataParallel, and each iteration's distributed autograd context carries the
// gradients of both to DistributedOptimizer.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/nn/remote_module.h"

namespace tandem::examples::hybrid {

constexpr const char* kEmbeddingBag = "hybrid.embedding_bag";  // (num_embeddings, dim): sum of each bag's embeddings

// Registers the embedding-bag module factory (forward(ids, offsets)); every worker, before init_rpc.
void register_modules();

// The trainers' dense part: Linear(dim, 128), ReLU, Linear(128, 10).
torch::nn::Sequential dense(int64_t dim);

// One trainer's model: the remote embedding table and the local dense part under DDP over `group`.
class Trainer {
 public:
  Trainer(nn::RemoteModule embedding, std::shared_ptr<comm::ProcessGroup> group, int64_t dim, double lr,
          ddp::DdpOptions options = {});
  // One iteration on a batch of bags (ids: all bags' token ids; offsets: where each bag starts): forward (embedding
  // on the parameter server, dense here), distributed backward (DDP's buckets reduced during it), DistributedOptimizer
  // step over both. Returns the loss.
  double step(const at::Tensor& ids, const at::Tensor& offsets, const at::Tensor& target);
  // Logits without gradients.
  at::Tensor predict(const at::Tensor& ids, const at::Tensor& offsets);
  ddp::DistributedDataParallelBase& ddp() { return *ddp_; }

 private:
  nn::RemoteModule embedding_;
  torch::nn::Sequential dense_;
  std::unique_ptr<ddp::DistributedDataParallel<torch::nn::SequentialImpl>> ddp_;
  std::unique_ptr<dist_optim::DistributedOptimizer> opt_;
};

}  // namespace tandem::examples::hybrid
