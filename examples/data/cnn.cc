#include "examples/data/cnn.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include <cstdio>

namespace tandem::examples {

torch::nn::Sequential fashion_mnist_cnn() {
  namespace tn = torch::nn;
  return tn::Sequential(tn::Conv2d(tn::Conv2dOptions(1, 32, 3).padding(1)), tn::ReLU(), tn::MaxPool2d(2),
                        tn::Conv2d(tn::Conv2dOptions(32, 64, 3).padding(1)), tn::ReLU(), tn::MaxPool2d(2),
                        tn::Flatten(), tn::Linear(64 * 7 * 7, 128), tn::ReLU(), tn::Linear(128, 10));
}

int accuracy_exit_code(double accuracy, double min_accuracy) {
  if (accuracy >= min_accuracy) return 0;
  std::fprintf(stderr, "test accuracy %.4f is below --min-accuracy %.4f\n", accuracy, min_accuracy);
  return 1;
}

uint64_t parameters_hash(torch::nn::Module& model) { return tensors_hash(model.parameters()); }

uint64_t tensors_hash(const std::vector<at::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : tensors) {
    const at::Tensor c = p.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

}  // namespace tandem::examples
