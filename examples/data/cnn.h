// The examples' Fashion-MNIST model, their accuracy check, and the hash of parameters they print.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace tandem::examples {

// 2 conv (32, 64 channels, 3x3) + 2x2 max pooling + FC 3136-128-10, for [N, 1, 28, 28] images.
torch::nn::Sequential fashion_mnist_cnn();

// 0, or 1 after telling stderr that `accuracy` is below `min_accuracy`: an example's exit code for --min-accuracy.
int accuracy_exit_code(double accuracy, double min_accuracy);

// FNV-1a over the bytes of every parameter: equal for two runs exactly when their parameters are equal to the bit.
uint64_t parameters_hash(torch::nn::Module& model);
// The same over tensors, in order.
uint64_t tensors_hash(const std::vector<at::Tensor>& tensors);

}  // namespace tandem::examples
