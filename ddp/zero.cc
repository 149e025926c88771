#include "ddp/zero.h"

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "rpc/errors.h"

namespace tandem::ddp {

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> parameters,
                                                 std::shared_ptr<comm::ProcessGroup> group, Factory make)
    : parameters_(std::move(parameters)), owner_(parameters_.size(), 0), group_(std::move(group)) {
  if (!group_ || !make)
    throw RpcError(absl::InvalidArgumentError("ZeroRedundancyOptimizer: a group and a factory are required"));
  std::vector<size_t> by_size(parameters_.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return parameters_[a].numel() > parameters_[b].numel(); });
  std::vector<int64_t> load(group_->size(), 0);
  for (size_t i : by_size) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = r;
    load[r] += parameters_[i].numel();
  }
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (owner_[i] == group_->rank()) shard_.push_back(parameters_[i]);
  }
  if (!shard_.empty()) local_ = make(shard_);
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() {
  if (local_) local_->step();
  at::NoGradGuard no_grad;
  std::vector<rpc::Future> works;
  for (size_t i = 0; i < parameters_.size(); ++i) works.push_back(group_->broadcast(parameters_[i], owner_[i]));
  for (const auto& w : works) comm::wait(w);
}

void ZeroRedundancyOptimizer::zero_grad() {
  for (auto& p : parameters_) {
    if (p.grad().defined()) {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

}  // namespace tandem::ddp
