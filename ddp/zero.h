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
// Collective: every rank of the group constructs it (the parameter lists are compared: FAILED_PRECONDITION naming the
// first rank that holds others) and calls step() and zero_grad() in the same order. Errors: RpcError.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "tandem/comm/process_group.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

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

  // This rank's shard of the optimizer state, with the rank and world size that own it (a sharded checkpoint, see
  // checkpoint/checkpoint.h). Not collective. load() throws tandem::Error FAILED_PRECONDITION when the state was
  // written by another rank or a job of another world size (the shards would not match), INVALID_ARGUMENT when it
  // does not fit the shard's optimizer.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  // The whole optimizer state (a consolidated checkpoint): every rank's shard and the partition they came from, so
  // that a job of any world size resumes from it. save_consolidated is collective (every rank gathers every shard
  // and writes the same archive; checkpoint::Layout::kReplicated then reads rank 0's); load_consolidated is not: it
  // takes the state of this rank's parameters, whichever rank held them, by loading each saved shard into an
  // optimizer the factory makes. Throws tandem::Error INVALID_ARGUMENT when the state is of another model (another
  // number of parameters) or does not fit the factory's optimizer.
  void save_consolidated(torch::serialize::OutputArchive& archive) const;
  void load_consolidated(torch::serialize::InputArchive& archive);

 private:
  std::vector<at::Tensor> parameters_, shard_;
  std::vector<int> owner_;
  std::shared_ptr<comm::ProcessGroup> group_;
  Factory make_;
  std::unique_ptr<torch::optim::Optimizer> local_;  // null when the shard is empty
};

}  // namespace tandem::ddp
