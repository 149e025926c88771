// Fashion-MNIST from Debian's dataset-fashion-mnist package: the gzipped IDX files, read directly.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace tandem::examples {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  at::Tensor images;  // float [N, 1, 28, 28], normalised with the training set's mean and deviation
  at::Tensor labels;  // int64 [N], 0..9
};

// `split` is "train" (60,000 images) or "t10k" (10,000). Throws std::runtime_error naming the file on any problem
// (missing, truncated, wrong magic number, counts that disagree).
Dataset load_fashion_mnist(const std::string& split, const std::string& dir = kFashionMnistDir);

}  // namespace tandem::examples
