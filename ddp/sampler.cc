#include "ddp/sampler.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <string>

#include "rpc/errors.h"

namespace tandem::ddp {

DistributedSampler::DistributedSampler(size_t dataset_size, int num_replicas, int rank, SamplerOptions options)
    : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), options_(options) {
  if (num_replicas <= 0 || rank < 0 || rank >= num_replicas) {
    throw_error(absl::InvalidArgumentError("DistributedSampler: rank " + std::to_string(rank) + " is not in [0, " +
                                           std::to_string(num_replicas) + ")"));
  }
  reset();
}

DistributedSampler::DistributedSampler(size_t dataset_size, const comm::ProcessGroup& group, SamplerOptions options)
    : DistributedSampler(dataset_size, group.size(), group.rank(), options) {}

void DistributedSampler::set_epoch(uint64_t epoch) {
  epoch_ = epoch;
  reset();
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size) dataset_size_ = *new_size;
  const size_t n = dataset_size_, w = static_cast<size_t>(num_replicas_);
  // PyTorch: with drop_last and an uneven split, ceil((n - w) / w) = floor(n / w); otherwise ceil(n / w).
  num_samples_ = options_.drop_last && n % w != 0 ? n / w : (n + w - 1) / w;
  const size_t total = num_samples_ * w;
  std::vector<size_t> all(n);
  if (options_.shuffle) {
    auto gen = at::detail::createCPUGenerator(options_.seed + epoch_);
    auto perm = at::randperm(static_cast<int64_t>(n), gen, at::kLong);
    auto p = perm.accessor<int64_t, 1>();
    for (size_t i = 0; i < n; ++i) all[i] = static_cast<size_t>(p[static_cast<int64_t>(i)]);
  } else {
    for (size_t i = 0; i < n; ++i) all[i] = i;
  }
  for (size_t i = 0; all.size() < total && n > 0; ++i) all.push_back(all[i % n]);  // pad with the start
  all.resize(total);
  indices_.clear();
  for (size_t i = static_cast<size_t>(rank_); i < total; i += w) indices_.push_back(all[i]);
  position_ = 0;
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (position_ >= indices_.size()) return c10::nullopt;
  const size_t end = std::min(indices_.size(), position_ + batch_size);
  std::vector<size_t> batch(indices_.begin() + static_cast<std::ptrdiff_t>(position_),
                            indices_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::tensor(static_cast<int64_t>(epoch_)), /*is_buffer=*/true);
  archive.write("position", at::tensor(static_cast<int64_t>(position_)), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch, position;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  set_epoch(static_cast<uint64_t>(epoch.item<int64_t>()));
  position_ = std::min(indices_.size(), static_cast<size_t>(position.item<int64_t>()));
}

}  // namespace tandem::ddp
