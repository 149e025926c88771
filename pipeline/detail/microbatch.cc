#include "pipeline/detail/microbatch.h"

#include <ATen/ATen.h>

namespace tandem::pipeline::detail {

std::vector<at::Tensor> split_batch(const at::Tensor& batch, int64_t m) { return at::tensor_split(batch, m); }

std::vector<int64_t> sizes_of(const std::vector<at::Tensor>& parts) {
  std::vector<int64_t> sizes;
  sizes.reserve(parts.size());
  for (const auto& p : parts) sizes.push_back(p.size(0));
  return sizes;
}

at::Tensor merge_batch(const std::vector<at::Tensor>& parts) { return at::cat(parts); }

}  // namespace tandem::pipeline::detail
