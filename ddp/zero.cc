#include "tandem/ddp/zero.h"

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tandem/ddp/detail/reducer.h"
#include "tandem/rpc/errors.h"

namespace tandem::ddp {

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> parameters,
                                                 std::shared_ptr<comm::ProcessGroup> group, Factory make)
    : parameters_(std::move(parameters)), owner_(parameters_.size(), 0), group_(std::move(group)) {
  if (!group_ || !make)
    throw RpcError(absl::InvalidArgumentError("ZeroRedundancyOptimizer: a group and a factory are required"));
  // Each parameter's owner follows from the list: ranks holding other lists would broadcast from other roots or sizes.
  if (absl::Status s = detail::same_on_every_rank(*group_, parameters_, "every rank must pass the same parameters");
      !s.ok()) {
    throw RpcError(absl::Status(s.code(), "ZeroRedundancyOptimizer: " + std::string(s.message())));
  }
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
  make_ = std::move(make);
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

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("world_size", at::tensor(static_cast<int64_t>(group_->size())), /*is_buffer=*/true);
  archive.write("rank", at::tensor(static_cast<int64_t>(group_->rank())), /*is_buffer=*/true);
  if (local_) {
    torch::serialize::OutputArchive shard;
    local_->save(shard);
    archive.write("shard", shard);
  }
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  at::Tensor world, rank;
  archive.read("world_size", world, /*is_buffer=*/true);
  archive.read("rank", rank, /*is_buffer=*/true);
  if (world.item<int64_t>() != group_->size() || rank.item<int64_t>() != group_->rank()) {
    throw_error(absl::FailedPreconditionError(
        absl::StrCat("ZeroRedundancyOptimizer: the sharded state was written by rank ", rank.item<int64_t>(), " of ",
                     world.item<int64_t>(), "; this is rank ", group_->rank(), " of ", group_->size(),
                     " (a sharded optimizer state resumes with the same ranks)")));
  }
  if (!local_) return;
  torch::serialize::InputArchive shard;
  archive.read("shard", shard);
  local_->load(shard);
}

namespace {

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

}  // namespace

void ZeroRedundancyOptimizer::save_consolidated(torch::serialize::OutputArchive& archive) const {
  std::ostringstream mine;
  if (local_) {
    torch::serialize::OutputArchive shard;
    local_->save(shard);
    shard.save_to(mine);
  }
  const std::string bytes = mine.str();
  const int world = group_->size();
  at::Tensor sizes = at::empty({world}, at::kLong);
  comm::wait(group_->allgather(sizes, at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong)));
  archive.write("consolidated_world_size", at::tensor(static_cast<int64_t>(world)), /*is_buffer=*/true);
  archive.write("owners", at::tensor(std::vector<int64_t>(owner_.begin(), owner_.end()), at::kLong), true);
  for (int r = 0; r < world; ++r) {
    at::Tensor shard = at::empty({sizes[r].item<int64_t>()}, at::kByte);
    if (r == group_->rank() && !bytes.empty()) std::memcpy(shard.data_ptr(), bytes.data(), bytes.size());
    if (shard.numel() > 0) comm::wait(group_->broadcast(shard, r));
    archive.write("shard_" + std::to_string(r), shard, /*is_buffer=*/true);
  }
}

void ZeroRedundancyOptimizer::load_consolidated(torch::serialize::InputArchive& archive) {
  at::Tensor world, owners;
  archive.read("consolidated_world_size", world, /*is_buffer=*/true);
  archive.read("owners", owners, /*is_buffer=*/true);
  if (owners.numel() != static_cast<int64_t>(parameters_.size())) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("ZeroRedundancyOptimizer: the consolidated state is of ",
                                                        owners.numel(), " parameters; this optimizer has ",
                                                        parameters_.size())));
  }
  if (!local_) return;
  const auto owner = owners.accessor<int64_t, 1>();
  for (int64_t r = 0; r < world.item<int64_t>(); ++r) {
    at::Tensor bytes;
    archive.read("shard_" + std::to_string(r), bytes, /*is_buffer=*/true);
    if (bytes.numel() == 0) continue;
    // The saved shard r, loaded into an optimizer of the factory's over stand-ins of its parameters.
    std::vector<size_t> held;
    std::vector<at::Tensor> stand_ins;
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (owner[static_cast<int64_t>(i)] != r) continue;
      held.push_back(i);
      stand_ins.push_back(at::empty_like(parameters_[i]).requires_grad_(parameters_[i].requires_grad()));
    }
    std::unique_ptr<torch::optim::Optimizer> saved = make_(stand_ins);
    try {
      torch::serialize::InputArchive in;
      in.load_from(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
      saved->load(in);
    } catch (const c10::Error& e) {
      throw_error(
          absl::InvalidArgumentError(absl::StrCat("ZeroRedundancyOptimizer: the consolidated state of rank ", r,
                                                  " does not fit this optimizer: ", e.what_without_backtrace())));
    }
    for (size_t j = 0; j < held.size(); ++j) {
      if (owner_[held[j]] != group_->rank()) continue;
      auto it = saved->state().find(state_key(stand_ins[j]));
      if (it == saved->state().end()) continue;  // no state yet (never stepped)
      local_->state()[state_key(parameters_[held[j]])] = it->second->clone();
    }
  }
}

}  // namespace tandem::ddp
