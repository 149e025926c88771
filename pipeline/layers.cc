#include "tandem/pipeline/layers.h"

#include <malloc.h>

#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/sync/sync.h"

namespace tandem::pipeline {
namespace {

struct Registry {
  Mutex mu;
  std::map<std::string, LayerFactory> by_name ABSL_GUARDED_BY(mu);
};
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

// Layer i alone, built while no other build of this process runs (detail::build_mutex).
torch::nn::Sequential build_alone(const std::string& name, int64_t i) {
  MutexLock lock(&detail::build_mutex());
  return build_layers(name, i, i + 1);
}

// What weighing layer i freed goes back to the system before the next is built. glibc keeps freed blocks resident
// (and fragmented by other threads' allocations meanwhile, not always reused for the next layer): the driver's peak
// then grew by up to four layers of eight in one run of StagesBuildOnlyTheirLayers, where one at a time was meant.
void return_freed_memory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}
}  // namespace

void register_layers(const std::string& name, LayerFactory factory) {
  if (factory.n_layers < 1 || !factory.build) {
    detail::fail(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("layers '", name, "': a factory needs n_layers >= 1 (", factory.n_layers,
                              ") and a build function"));
  }
  Registry& r = registry();
  MutexLock lock(&r.mu);
  if (!r.by_name.emplace(name, std::move(factory)).second) {
    detail::fail(absl::StatusCode::kAlreadyExists, absl::StrCat("layers '", name, "' are already registered"));
  }
}

LayerFactory find_layers(const std::string& name) {
  Registry& r = registry();
  MutexLock lock(&r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) {
    std::vector<std::string> names;
    for (const auto& [n, f] : r.by_name) names.push_back(n);
    detail::fail(absl::StatusCode::kNotFound, absl::StrCat("no layers registered as '", name, "' on this worker",
                                                           names.empty() ? "" : " (registered: ",
                                                           absl::StrJoin(names, ", "), names.empty() ? "" : ")"));
  }
  return it->second;
}

torch::nn::Sequential build_layers(const std::string& name, int64_t begin, int64_t end) {
  const LayerFactory f = find_layers(name);
  if (begin < 0 || end <= begin || end > f.n_layers) {
    detail::fail(absl::StatusCode::kInvalidArgument, absl::StrCat("layers [", begin, ", ", end, ") are not within the ",
                                                                  f.n_layers, " layers of '", name, "'"));
  }
  torch::nn::Sequential part = f.build(begin, end);
  if (!part || static_cast<int64_t>(part->size()) != end - begin) {
    detail::fail(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("layers '", name, "': build(", begin, ", ", end, ") returned ",
                              part ? static_cast<int64_t>(part->size()) : 0, " layers, not ", end - begin));
  }
  return part;
}

std::vector<double> layer_weights(const std::string& name, const PartitionOptions& options) {
  const LayerFactory f = find_layers(name);
  std::vector<double> weights;
  if (options.by == Partition::kParameters) {
    for (int64_t i = 0; i < f.n_layers; ++i) {
      if (f.weight) {
        weights.push_back(f.weight(i));
        continue;
      }
      weights.push_back(detail::parameter_weight(*build_alone(name, i)));
      return_freed_memory();
    }
    return weights;
  }
  if (!options.sample.defined()) {
    detail::fail(absl::StatusCode::kInvalidArgument, "Partition::kTime needs a sample batch");
  }
  at::Tensor x = options.sample;
  for (int64_t i = 0; i < f.n_layers; ++i) {
    {
      torch::nn::Sequential layer = build_alone(name, i);
      weights.push_back(detail::fastest_pass([&](const at::Tensor& in) { return layer->forward(in); }, x, &x));
    }  // each layer is freed before the next is built
    return_freed_memory();
  }
  return weights;
}

}  // namespace tandem::pipeline
