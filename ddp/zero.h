// ZeroRedundancyOptimizer (ZeRO stage 1): each rank keeps optimizer state for its own shard of the parameters only.
//
//   ddp::ZeroRedundancyOptimizer opt(model->parameters(), pg, [](std::vector<at::Tensor> shard) {
//     return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
//   });
//   ... DDP forward/backward (gradients averaged on every rank) ...; opt.step();
//
// Partition (PyTorch's): parameters sorted by size, largest first, each to the rank whose shard is smallest so far.
// step(): the local optimizer updates this rank's shard, then every parameter is broadcast from the rank that owns it,
// so all ranks end the step with the same parameters. Optimizer memory per rank is about 1/world of a plain optimizer.
// Collective: every rank of the group calls step() and zero_grad() in the same order. Errors: RpcError.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "comm/process_group.h"

namespace torch::optim {
class Optimizer;
}

namespace tandem::ddp {

class ZeroRedundancyOptimizer {
 public:
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shard)>;

  ZeroRedundancyOptimizer(std::vector<at::Tensor> parameters, std::shared_ptr<comm::ProcessGroup> group, Factory make);
  ~ZeroRedundancyOptimizer();

  void step();
  void zero_grad();  // every parameter's .grad, as LibTorch's zero_grad does
  const std::vector<at::Tensor>& shard() const { return shard_; }  // this rank's parameters
  int owner(size_t parameter_index) const { return owner_[parameter_index]; }

 private:
  std::vector<at::Tensor> parameters_, shard_;
  std::vector<int> owner_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::unique_ptr<torch::optim::Optimizer> local_;  // null when the shard is empty
};

}  // namespace tandem::ddp
