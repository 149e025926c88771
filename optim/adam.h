// Optimizers whose step needs no temporaries of a parameter's size.
//
//   tandem::optim::ChunkedAdam opt(model.parameters(), torch::optim::AdamOptions(1e-3));  // as torch::optim::Adam
//
// ChunkedAdam is torch::optim::Adam (same options, state, serialization and results) whose step updates each
// parameter in chunks of `chunk_elements` (64 Ki elements by default): LibTorch's Adam allocates temporaries of each
// parameter's size per step (exp_avg_sq.sqrt() and its division; with weight decay also the decayed gradient), which
// for a fully sharded model's flat shards are the largest allocations of a step (docs/fsdp.md, "Memory"); this one
// allocates one or two of a chunk's size per parameter and step. Each chunk runs the same LibTorch kernels on the same
// elements in the same order as Adam does on the whole. With one intra-op thread the chunks (multiples of 64
// elements) meet the kernels' vectorised loops and scalar tails at the same elements, so parameters and moments
// equal Adam's exactly; with more, LibTorch splits a whole tensor between threads where a chunk is not split, and
// the results are equal where its scalar and vectorised kernels agree: float and double here (tests/optim checks one
// and two threads with tensors whose split falls mid-vector, every option; reduced-precision parameters are not
// tested).
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
