// Modules and functions the pipeline tests register on every worker (the test process is the driver, rank 0).
#pragma once

#include <torch/torch.h>

namespace tandem::test {

// "pipe_mlp"(layers, width, seed): a float64 Sequential of `layers` Linear(width, width), each followed by Tanh.
torch::nn::Sequential make_pipe_mlp(int64_t layers, int64_t width, int64_t seed);

// "pipe_layers" (pipeline::register_layers): kPipeLayers layers, even ones a float64 Linear(kPipeLayersWidth,
// kPipeLayersWidth) seeded by its index, odd ones Tanh; make_pipe_layers builds layers [begin, end).
constexpr int64_t kPipeLayers = 8, kPipeLayersWidth = 5;
torch::nn::Sequential make_pipe_layers(int64_t begin, int64_t end);
// "pipe_big_layers": kBigLayers float Linear(kBigWidth, kBigWidth), each seeded by its index (16 MiB each).
constexpr int64_t kBigLayers = 8, kBigWidth = 2048;
// Ends the stall of every "pipe_stall" stage's forward in this process, as "pipe_unstall" does on its worker.
void unstall_stages();

// reset_peak_memory sets this process's peak (VmHWM) to the resident memory now (Linux's clear_refs 5); false where
// the system does not allow it. "pipe_memory_kib"(reset) returns {VmRSS, VmHWM, 1 if reset and the reset worked, else
// 0} of the worker it runs on (pipeline/detail/common.h's status_kib reads them).
bool reset_peak_memory();

// "pipe_dropout_bn"(seed): a float64 Sequential Linear(4, 6), Dropout(0.5), Linear(6, 6), BatchNorm1d(6), Tanh,
// Linear(6, 4).
torch::nn::Sequential make_pipe_dropout_bn(int64_t seed);

// "pipe_masked"(seed, last): a float64 Linear(4, 4) seeded by `seed` whose forward takes (x, mask, scale, [a, b]) —
// a float64 batch, a bool mask of its shape, a double, and a list of a (rows x 1) and b (rows x 4) — and returns
// masked_block_forward's value. With z = lin(x + 0.1 b): h = tanh(z * scale) * mask and the tuple
// (h, mask, scale, [0.5 a + h[:, :1], h]) (h twice), or on a last stage the tensor z * mask + a.
struct MaskedBlockImpl : torch::nn::Module {
  MaskedBlockImpl(int64_t seed, bool last);
  torch::nn::Linear lin{nullptr};
  bool last;
};
TORCH_MODULE(MaskedBlock);
c10::IValue masked_block_forward(MaskedBlock& block, const at::Tensor& x, const at::Tensor& mask, double scale,
                                 const std::vector<at::Tensor>& aux);

// Also registers "pipe_slow_backward"(ms) (an identity Linear(4, 4) whose backward sleeps; "pipe_slow_forwards" counts
// its forwards), "pipe_slow_build"(ms) (a Linear(4, 4) whose factory sleeps), "pipe_plans" ({plans received, plans
// held, runs started directly, runs ended} by the worker), "pipe_seed", "pipe_buffers",
// "pipe_training", "pipe_stage_count", "pipe_contexts" and "pipe_create_and_die" (see stages.cc); "pipe_linear"(in,
// out) (float64 Linear); "pipe_faulty"(mode): a float64 identity Linear(4, 4) whose forward, when a row's first value
// is 999, throws (mode 1) or kills its process with exit code 9 (mode 2); "pipe_dies_after_sum"(peer): the same
// as mode 2, once worker `peer` posted a turn in a sum across the replicas ("pipe_sums_posted": how many it posted);
// "pipe_stall"(ms): an identity Linear(4, 4)
// whose forward stalls for ms, or until "pipe_unstall" is called on its worker; "pipe_pings"(peer) ({calls, errors}
// of the worker's pings of driver `peer`); "pipe_shrink_param"(pipeline, stage, name) (makes a local stage's parameter
// one element, after creation); and the functions "pipe_grads"(pipeline,
// stage, context) / "pipe_params"(pipeline, stage) / "pipe_dot_grads"(pipeline, stage) returning a local stage's
// context gradients, parameters and .grad (zeros where undefined).
void register_pipeline_stages();

}  // namespace tandem::test
