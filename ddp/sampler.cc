#include "tandem/ddp/sampler.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <string>

#include "tandem/rpc/errors.h"

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
  build(0);
}

void DistributedSampler::build(size_t start) {
  const size_t n = dataset_size_, w = static_cast<size_t>(num_replicas_);
  start_ = std::min(start, n);
  std::vector<size_t> all(n);
  if (options_.shuffle) {
    auto gen = at::detail::createCPUGenerator(options_.seed + epoch_);
    auto perm = at::randperm(static_cast<int64_t>(n), gen, at::kLong);
    auto p = perm.accessor<int64_t, 1>();
    for (size_t i = 0; i < n; ++i) all[i] = static_cast<size_t>(p[static_cast<int64_t>(i)]);
  } else {
    for (size_t i = 0; i < n; ++i) all[i] = i;
  }
  all.erase(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(start_));
  const size_t m = all.size();
  // PyTorch: with drop_last and an uneven split, ceil((m - w) / w) = floor(m / w); otherwise ceil(m / w).
  num_samples_ = options_.drop_last && m % w != 0 ? m / w : (m + w - 1) / w;
  const size_t total = num_samples_ * w;
  for (size_t i = 0; all.size() < total && m > 0; ++i) all.push_back(all[i % m]);  // pad with the start
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
  archive.write("replicas", at::tensor(static_cast<int64_t>(num_replicas_)), /*is_buffer=*/true);
  archive.write("start", at::tensor(static_cast<int64_t>(start_)), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch, position;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  at::Tensor replicas = at::tensor(static_cast<int64_t>(num_replicas_)), start = at::tensor(int64_t{0});
  (void)archive.try_read("replicas", replicas, /*is_buffer=*/true);  // absent in checkpoints of earlier builds
  (void)archive.try_read("start", start, /*is_buffer=*/true);
  epoch_ = static_cast<uint64_t>(epoch.item<int64_t>());
  const auto saved_start = static_cast<size_t>(std::max<int64_t>(0, start.item<int64_t>()));
  const auto saved_position = static_cast<size_t>(std::max<int64_t>(0, position.item<int64_t>()));
  const auto saved_replicas = static_cast<size_t>(std::max<int64_t>(1, replicas.item<int64_t>()));
  if (saved_replicas == static_cast<size_t>(num_replicas_)) {
    build(saved_start);
    position_ = std::min(indices_.size(), saved_position);
  } else {
    build(saved_start + saved_position * saved_replicas);  // what every rank of the saved job had consumed
  }
}

}  // namespace tandem::ddp
