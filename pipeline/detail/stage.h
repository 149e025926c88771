// One stage on its worker: how it is built (a registered factory, a layer range of a Sequential, a range of a model
// registered by its layers, a TorchScript file), the losses the last stage computes, and the forward and backward of
// one micro-batch. The runtime (runtime.h) moves the micro-batches between stages; nothing here talks to another
// worker.
//
// Thread-safety: building is serialised per process (factories seed LibTorch's global generator); a Stage's forward
// and backward run on its pipeline's executor thread only; the loss registry is guarded.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/pipeline/detail/microbatch.h"

namespace torch::nn {
class Module;
}

namespace tandem::pipeline::detail {

struct Stage {
  std::shared_ptr<torch::nn::Module> module;
  // The stage on its arguments (Args: the model's inputs, or what the previous stage returned); returns a tensor, or a
  // tuple or list of tensors and other values (an attention mask, lengths) that the next stage takes.
  std::function<c10::IValue(Args)> forward;
  std::vector<at::Tensor> params;  // those that require gradients, in the module's order
  // Running statistics and the like: a checkpointed recompute leaves them as they were.
  std::vector<at::Tensor> buffers;
  std::function<bool()> is_training;
  std::function<void(bool)> set_training;
};

// factory(args...) from nn::register_module; with begin >= 0 only layers [begin, end) of the Sequential it returns.
// Throws tandem::Error: NOT_FOUND (unknown factory), INVALID_ARGUMENT (not a Sequential, a range outside it).
std::shared_ptr<Stage> build_stage(const std::string& factory, std::vector<c10::IValue> args, int64_t begin,
                                   int64_t end);
// Layers [begin, end) of a model registered with register_layers (pipeline/layers.h): only those are built. Throws
// tandem::Error: NOT_FOUND (unknown name), INVALID_ARGUMENT (a range outside the model).
std::shared_ptr<Stage> build_layers_stage(const std::string& layers, int64_t begin, int64_t end);
// A TorchScript module file (its forward takes the stage's arguments). Throws what torch::jit::load throws.
std::shared_ptr<Stage> load_script_stage(const std::string& path);

using LossFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;
// The loss registered under `name` on this worker (built in: mse, cross_entropy, nll). Throws NOT_FOUND.
LossFn find_loss(const std::string& name);

// What a micro-batch leaves on its stage between its forward and its backward.
struct Live {
  Args input;            // what the forward took (floating-point tensors requiring grad after the first stage)
  c10::IValue output;    // the stage's output (none with checkpointing), or on the last stage its weighted loss
  at::Tensor rng_state;  // with checkpointing: the CPU generator's state when the forward began
};

// The forward of one micro-batch. `x` is the micro-batch's arguments (first stage) or the activation received (its
// floating-point tensors are detached and made to require grad, so their gradients can be sent back). With
// `checkpoint` only the input is kept (the forward runs without a graph and is recomputed in backward). Returns what
// the forward produced (the activation for the next stage, or the last stage's output) and fills `live`.
c10::IValue forward_microbatch(Stage& stage, Args x, bool first, bool checkpoint, Live* live);

// The gradient that goes back to the previous stage for an activation `a`: for one tensor, its gradient (a tensor);
// otherwise a list with one entry per tensor of `a` (tensors_of's order): its gradient, or None where it has none.
struct MicrobatchGradients {
  std::vector<at::Tensor> params;  // per Stage::params; undefined where the micro-batch gave none
  c10::IValue input;               // the input's gradient, for the previous stage (none on the first stage)
};
// The backward of one micro-batch from `live` (taken: its activations go with it). `grad_output` is the gradient
// received from the next stage, in the form above (none on the last stage, whose live.output is its loss). With
// `recompute` the forward runs again first from live.input and live.rng_state, and the buffers are left as the first
// forward left them. Throws INVALID_ARGUMENT when grad_output is not of that form or does not match the output's
// tensors (their number, each one's shape).
MicrobatchGradients backward_microbatch(Stage& stage, Live live, const c10::IValue& grad_output, bool first, bool last,
                                        bool recompute);

// The zero-bubble split of a backward (Qi et al., "Zero Bubble Pipeline Parallelism"): backward_input (I) computes
// only the input's gradient, for the previous stage, and leaves in a WeightWork what backward_weight (W) needs to
// compute the parameters' gradients later, without running the input's part again. I keeps the micro-batch's graph;
// W frees it. How: before I, the graph is searched for the nodes where paths from parameters join the path to the
// input (PyTorch's pipelining finds the same "intermediates"); I captures the gradients arriving there, and W runs
// the engine from those nodes to the parameters only, one group of parameters sharing such nodes at a time. A graph
// where that would count a gradient twice (one joining node behind another of its group), a joining node with a hook
// (it would run twice), an output that does not depend on the input, or the first stage (no input gradient) has all
// its backward run by I (then W only hands its result over) or, on the first stage, by W.
struct WeightWork;
struct InputGradients {
  c10::IValue input;                 // as MicrobatchGradients::input
  std::shared_ptr<WeightWork> work;  // for backward_weight
};
// I: as backward_microbatch for the input's gradient. Same arguments and errors.
InputGradients backward_input(Stage& stage, Live live, const c10::IValue& grad_output, bool first, bool last,
                              bool recompute);
// W: the parameters' gradients (per Stage::params, undefined where none) of the micro-batch whose I left `work`.
std::vector<at::Tensor> backward_weight(Stage& stage, std::shared_ptr<WeightWork> work);
// Whether backward_input split this micro-batch's backward (W computes the weights' part): for tests and the timeline.
bool split(const WeightWork& work);

// Adds `grads` into `sums` (per parameter), taking a gradient tensor over when nothing else holds it.
void accumulate(std::vector<at::Tensor>& sums, std::vector<at::Tensor>&& grads);

}  // namespace tandem::pipeline::detail
