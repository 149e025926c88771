// The DDP benchmark's model, shared by bench/ddp_bench.cc and bench/fsdp_bench.cc: MLP 1024-2048-2048-1024 with ReLU
// (8.4 M parameters), the same initial parameters in every process.
#pragma once

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace tandem::bench {

// ddp_mlp()'s parameter count: its three layers' weights and biases.
constexpr int64_t kDdpMlpParams = 1024 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 1024 + 1024;  // 8,393,728

inline torch::nn::Sequential ddp_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(1024, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                               torch::nn::ReLU(), torch::nn::Linear(2048, 1024));
}

}  // namespace tandem::bench
