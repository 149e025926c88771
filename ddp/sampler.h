// DistributedSampler: each rank's share of a dataset's indices, PyTorch's algorithm, for LibTorch's data loaders.
//
//   ddp::DistributedSampler sampler(dataset.size().value(), *pg);       // rank and replicas from the group
//   auto loader = torch::data::make_data_loader(dataset.map(Stack<>()), sampler, batch_size);
//   for (int epoch = 0; ...; ++epoch) { sampler.set_epoch(epoch); for (auto& batch : *loader) ...; }
//
// Indices: a permutation of [0, size) seeded with seed + epoch (the same on every rank; identity without shuffle),
// padded by repeating its start so that it splits evenly (or cut, with drop_last), then every num_replicas-th index
// from `rank`. Every rank gets size() = ceil(n / replicas) indices (floor with drop_last): ranks step equally often.
#pragma once

#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem::ddp {

struct SamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  // Throws tandem::Error (INVALID_ARGUMENT) unless 0 <= rank < num_replicas.
  DistributedSampler(size_t dataset_size, int num_replicas, int rank, SamplerOptions options = {});
  DistributedSampler(size_t dataset_size, const comm::ProcessGroup& group, SamplerOptions options = {});

  void set_epoch(uint64_t epoch);  // call before each epoch for a new shuffle
  size_t size() const { return num_samples_; }
  const std::vector<size_t>& indices() const { return indices_; }  // this rank's, this epoch

  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  // Saves the epoch, the position and the world size. Loaded by a job of the same world size, the sampler carries on
  // exactly where it was; by another one (an elastic job re-formed), each rank takes its share of what the saved job
  // had not consumed of the epoch yet (the rest of the permutation, padded and split as above).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  size_t dataset_size_;
  int num_replicas_, rank_;
  // This epoch's indices, from the `start`-th of its permutation on (0 but after a resume at another world size).
  void build(size_t start);

  SamplerOptions options_;
  uint64_t epoch_ = 0;
  size_t start_ = 0;  // where this epoch's share began in the permutation: a resume by another world size moves it
  size_t num_samples_ = 0, position_ = 0;
  std::vector<size_t> indices_;
};

}  // namespace tandem::ddp
