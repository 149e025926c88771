// On a stage worker: the stages this process holds for pipelines that other workers drive (pipeline.h).
//
// Thread-safety: both may be called from any thread, also while steps run.
#pragma once

#include <cstdint>
#include <memory>

namespace torch::nn {
class Module;
}

namespace tandem::pipeline {

// The module of stage `stage` of pipeline `pipeline_id` (nullptr when it is not held here).
std::shared_ptr<torch::nn::Module> local_stage(int64_t pipeline_id, int stage);
// How many stages (of every pipeline) this worker holds now.
int64_t local_stage_count();
// How many plans (of every pipeline) this worker holds now: one per number of micro-batches a pipeline has run with.
int64_t local_plan_count();

}  // namespace tandem::pipeline
