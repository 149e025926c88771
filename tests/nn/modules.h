// Modules the RemoteModule tests build on workers and, for comparison, locally.
#pragma once

#include <torch/nn/modules/container/sequential.h>

namespace tandem::test {

// Linear(in, hidden) - tanh - Linear(hidden, out) in double, initialised from `seed`.
torch::nn::Sequential make_mlp(int64_t in, int64_t hidden, int64_t out, int64_t seed);

}  // namespace tandem::test
