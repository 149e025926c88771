// Models registered by their layers, so that a stage worker builds only its own layers and the driver never builds
// the whole model: what lets a model larger than one process's memory train in a pipeline.
//
//   // every worker (the driver too), before init_rpc:
//   pipeline::register_layers("gpt", {.n_layers = 48, .build = [](int64_t begin, int64_t end) {
//     torch::nn::Sequential part;
//     for (int64_t i = begin; i < end; ++i) {
//       torch::manual_seed(1000 + i);   // layer i comes out the same whatever range it is built in
//       part->push_back(Block(config));
//     }
//     return part;
//   }});
//   // the driver:
//   auto pipe = pipeline::Pipeline::from_layers("gpt", workers, {.n_stages = 4}, options);
//
// Stage k's worker calls build(begin_k, end_k) only. The driver cuts the layers by PartitionOptions: by parameter count
// from `weight` when it is given, else by building each layer alone and counting it (one layer in memory at a time,
// freed before the next); by measured time (Partition::kTime) by building each layer alone in turn and timing it on
// the sample as it comes out of the layers before it (one layer in memory at a time).
//
// Thread-safety: register_layers before init_rpc (like nn::register_module); find_layers from any thread.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tandem/pipeline/partition.h"

namespace tandem::pipeline {

struct LayerFactory {
  int64_t n_layers = 0;
  // Layers [begin, end) of the model as one Sequential (0 <= begin < end <= n_layers). Layer i must be the same
  // whatever range it is built in (seed it by i, or load its weights): stages and the driver build different ranges.
  std::function<torch::nn::Sequential(int64_t begin, int64_t end)> build;
  // Optional: layer i's weight for Partition::kParameters (its parameter count, say), known without building it.
  std::function<double(int64_t layer)> weight;
};

// Registers `factory` under `name` on this worker. Throws tandem::Error: ALREADY_EXISTS (a taken name),
// INVALID_ARGUMENT (n_layers < 1, no build function).
void register_layers(const std::string& name, LayerFactory factory);

// The factory registered under `name` here. Throws tandem::Error NOT_FOUND naming the registered ones.
LayerFactory find_layers(const std::string& name);

// Layers [begin, end) of `name` built here, checked: a Sequential of end - begin layers. Throws tandem::Error:
// NOT_FOUND (unknown name), INVALID_ARGUMENT (a range outside the model, or build returned another number of layers).
torch::nn::Sequential build_layers(const std::string& name, int64_t begin, int64_t end);

// Each layer's weight by `options` (see the header comment: never more than one layer built at a time). Throws
// tandem::Error: NOT_FOUND, INVALID_ARGUMENT (Partition::kTime without a sample).
std::vector<double> layer_weights(const std::string& name, const PartitionOptions& options);

}  // namespace tandem::pipeline
