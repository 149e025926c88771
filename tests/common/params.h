// Parameters the training tests (dist_autograd, dist_optim, nn) share between the test process and its workers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace tandem::test {

// A parameter (double, requires grad) made from its name alone, so every process holds the same values and the test
// can rebuild a split model locally to compare gradients. Created on first use, then the same tensor.
at::Tensor param(const std::string& name, int64_t rows, int64_t cols);

}  // namespace tandem::test
