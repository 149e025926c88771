#include "tandem/pipeline/partition.h"

#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/rpc/errors.h"

namespace tandem::pipeline {

std::vector<std::pair<int64_t, int64_t>> balanced_cut(const std::vector<double>& weights, int n_stages) {
  const int L = static_cast<int>(weights.size());
  if (n_stages < 1 || L < n_stages) {
    throw_error(
        absl::InvalidArgumentError(absl::StrCat("cannot cut ", L, " layers into ", n_stages, " non-empty stages")));
  }
  std::vector<double> prefix(L + 1, 0);
  for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + weights[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest largest part cutting layers [0, i) into k parts; from[k][i]: where the last part begins.
  std::vector<std::vector<double>> best(n_stages + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> from(n_stages + 1, std::vector<int>(L + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= n_stages; ++k) {
    for (int i = k; i <= L; ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) best[k][i] = v, from[k][i] = j;
      }
    }
  }
  std::vector<std::pair<int64_t, int64_t>> cut(n_stages);
  for (int k = n_stages, i = L; k > 0; --k) {
    cut[k - 1] = {from[k][i], i};
    i = from[k][i];
  }
  return cut;
}

std::vector<double> layer_weights(const std::shared_ptr<torch::nn::Module>& sequential,
                                  const PartitionOptions& options) {
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(sequential);
  if (!seq) detail::fail(absl::StatusCode::kInvalidArgument, "the model to partition is not a torch::nn::Sequential");
  std::vector<double> weights;
  if (options.by == Partition::kParameters) {
    for (const auto& layer : seq->children()) weights.push_back(detail::parameter_weight(*layer));
    return weights;
  }
  if (!options.sample.defined()) {
    detail::fail(absl::StatusCode::kInvalidArgument, "Partition::kTime needs a sample batch");
  }
  at::Tensor x = options.sample;
  for (size_t i = 0; i < seq->size(); ++i) {
    auto& layer = *(seq->begin() + i);
    weights.push_back(detail::fastest_pass([&](const at::Tensor& in) { return layer.forward(in); }, x, &x));
  }
  return weights;
}

}  // namespace tandem::pipeline
