// Micro-batches: a batch split along its first dimension for the schedule, and the outputs merged back.
//
// Thread-safety: pure functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace tandem::pipeline::detail {

// `batch` in `m` parts along dimension 0, as torch.tensor_split: sizes differ by at most one row, the first ones the
// larger. Views, not copies. The caller checks that there are at least m rows.
std::vector<at::Tensor> split_batch(const at::Tensor& batch, int64_t m);
// Each part's number of rows.
std::vector<int64_t> sizes_of(const std::vector<at::Tensor>& parts);
// The parts concatenated along dimension 0 (the batch's order).
at::Tensor merge_batch(const std::vector<at::Tensor>& parts);

}  // namespace tandem::pipeline::detail
