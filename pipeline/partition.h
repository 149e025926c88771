// Cutting a Sequential into pipeline stages: contiguous layer ranges balanced by parameter count or by measured time.
//
// Thread-safety: pure functions (layer_weights runs the model's layers on the calling thread).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace tandem::pipeline {

enum class Partition { kParameters, kTime };
struct PartitionOptions {
  int n_stages = 2;
  // kParameters: balances parameter counts; kTime: balances each layer's measured forward + backward time on
  // `sample` (a batch like the real ones), as DeepSpeed's partition_method does.
  Partition by = Partition::kParameters;
  at::Tensor sample;
};

// Layer ranges [begin, end) of a contiguous cut of `weights` into n_stages parts minimising the largest part's sum.
// Throws tandem::Error (INVALID_ARGUMENT) when there are fewer layers than stages.
std::vector<std::pair<int64_t, int64_t>> balanced_cut(const std::vector<double>& weights, int n_stages);

// Each layer's weight in `sequential` (a torch::nn::SequentialImpl) by `options.by`: its parameter count plus one (a
// layer without parameters still counts a little), or the fastest of three forward + backward times on
// options.sample. Throws tandem::Error (INVALID_ARGUMENT): not a Sequential, kTime without a sample.
std::vector<double> layer_weights(const std::shared_ptr<torch::nn::Module>& sequential,
                                  const PartitionOptions& options);

}  // namespace tandem::pipeline
