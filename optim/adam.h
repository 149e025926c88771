// Optimizers whose step needs no temporaries of a parameter's size.
//
//   tandem::optim::ChunkedAdam opt(model.parameters(), torch::optim::AdamOptions(1e-3));  // as torch::optim::Adam
//
// ChunkedAdam is torch::optim::Adam (same options, state, serialization and results, bit for bit) whose step updates
// each parameter in chunks of `chunk_elements` (at most 64 Ki elements by default): LibTorch's Adam allocates two
// temporaries of each parameter's size per step (the denominator, and the gradient plus the weight decay), which for a
// fully sharded model's flat shards are the largest allocations of a step (docs/fsdp.md, "Memory"); this one allocates
// two of one chunk's size per step. Each chunk runs the same LibTorch kernels on the same elements in the same order
// as Adam does on the whole (chunks are multiples of 64 elements, so the kernels' vectorised loops and tails meet the
// same elements), so the parameters and moments after a step equal Adam's exactly (tests/optim checks it).
//
// Contract: torch::optim::Adam's (a parameter without a gradient is skipped; sparse gradients: c10::Error). A subclass
// of it: code that takes an Adam (serialization, fsdp's full_optimizer_state_dict) takes a ChunkedAdam.
// Not thread-safe (as LibTorch's optimizers).
#pragma once

#include <torch/optim/adam.h>

#include <cstdint>
#include <vector>

namespace tandem::optim {

class ChunkedAdam : public torch::optim::Adam {
 public:
  static constexpr int64_t kDefaultChunkElements = 64 * 1024;

  explicit ChunkedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                       torch::optim::AdamOptions defaults = {}, int64_t chunk_elements = kDefaultChunkElements);
  explicit ChunkedAdam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults = {},
                       int64_t chunk_elements = kDefaultChunkElements);

  at::Tensor step(LossClosure closure = nullptr) override;

 private:
  int64_t chunk_;  // a positive multiple of 64
};

}  // namespace tandem::optim
