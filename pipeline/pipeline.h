// Pipeline parallelism: a model cut into stages on several workers, micro-batches flowing through them by a schedule
// (GPipe, 1F1B, interleaved 1F1B, looped BFS, zero-bubble ZB-H1 and ZBV, or plans a user writes), the gradients left
// where DistributedOptimizer finds them.
//
//   // every worker, before init_rpc: the model's factory (deterministic: seed it, or load weights)
//   nn::register_module("net", [] { torch::manual_seed(0); return torch::nn::Sequential(...); });
//   // the driver:
//   auto pipe = pipeline::Pipeline::from_sequential("net", {}, {"worker1", "worker2", "worker3"},
//                                                   {.n_stages = 3}, {.schedule = pipeline::Schedule::k1F1B,
//                                                                     .n_microbatches = 8, .loss = "cross_entropy"});
//   dist_optim::DistributedOptimizer opt("sgd", pipe.parameter_rrefs(), {{"lr", 0.05}});
//   for (auto& batch : *loader) {
//     dist_autograd::ContextGuard ctx;
//     double loss = pipe.step(batch.data, batch.target);   // gradients of the whole batch, in the context
//     opt.step(ctx.id());
//   }
//
// How: every stage is built on its worker (a registered module factory, layers [begin, end) of the Sequential a
// factory returns, or a TorchScript file). step() splits the batch into micro-batches (the last may be smaller; fewer
// micro-batches than stages is fine), computes every worker's plan (pipeline/schedule.h) and sends each worker its plan
// once, stage 0's micro-batches and the last stage's targets with it. Each worker then runs its actions in order: a
// forward waits for its activation from the previous stage, sends its output straight to the next stage's worker (not
// through the driver), and keeps what its backward needs (only the stage input with checkpointing, which recomputes the
// forward in backward); a backward waits for the gradient from the next stage, computes this stage's gradients with
// LibTorch's engine, sends the input's gradient to the previous stage, and frees the micro-batch's activations (a
// zero-bubble schedule splits it: I computes and sends the input's gradient, W later the weights' and frees them). The
// last stage weighs each micro-batch's loss by its share of the batch (n_i / N; PyTorch's scale_grads when they are
// equal), so the loss and the gradients are the whole batch's. Each worker runs a pipeline's plans on one thread of its
// own for that pipeline, in step order (the run of step n + 1 never starts before step n's has ended there), and holds
// its gradients when done; only when every worker has heard from every other one that it finished (one-way messages
// between them) are the gradients added to the caller's distributed autograd context on each stage's worker (or to
// the parameters' .grad, by option); then each worker replies. Between processes of one host these messages, stage
// 0's micro-batches, the last stage's targets and the replies go through shared memory (a ring per sender in each
// receiver's inbox, a futex to wake it; docs/pipeline.md), elsewhere by RPC; from the second step of a shape on, the
// step itself goes there too, with no call to the workers of the driver's host (their processes watched through
// pidfds while the driver waits). TANDEM_PIPELINE_SHM=0 turns that off.
//
// Checkpointing (PipelineOptions::checkpoint) gives the same loss, gradients and buffers as without: the recompute in
// backward starts from the CPU generator's state of the first forward (dropout draws the same mask; the generator then
// continues where it was), and buffers such as BatchNorm's running statistics are left as the first forward left them.
//
// A stage worker keeps a pipeline's stages until the Pipeline's last copy goes, its creation fails (every stage already
// built, or still building, is released), or its driver is gone (each stage worker checks its drivers every second).
//
// Errors (tandem::Error): bad input before any work starts (INVALID_ARGUMENT: an empty batch, fewer rows than
// micro-batches, inputs and target of different batch sizes); at creation, a stage placed on a worker not in the job or
// an unknown factory (NOT_FOUND);
// a stage whose forward or backward throws (for instance an input of the wrong shape or dtype from the previous stage,
// found on the first step), a dead stage worker, a lost message or the step's deadline: step() fails naming the
// stage, its worker and the micro-batch, the other workers abandon the step at once, and the next step works. A failed
// step leaves no gradient anywhere: no context on any worker, .grad unchanged. Except when the failure comes after
// every worker said that it finished its run: a worker that dies or loses its connection then, a word of finishing
// lost between two workers, or a reply lost on its way to the driver fail a step whose gradients were delivered on
// some or all workers (docs/pipeline.md, "Errors and deadlines"). At creation, a bad tie (PipelineOptions::tied):
// INVALID_ARGUMENT naming it.
//
// Thread-safety: one step or forward() at a time per Pipeline (each waits for the other); several pipelines may share
// workers.
//
// The parts: this header and pipeline.cc are the driver; partition.h cuts a Sequential; layers.h registers models by
// their layers (each stage worker builds only its own); schedule.h makes each worker's plan; timeline.h draws a step;
// local.h is what a stage worker holds; detail/ has the stage workers' runtime (runtime: a worker's executor of its
// plans; stage: building a stage and one micro-batch's forward and backward; p2p: the mailbox of activations and
// gradients; microbatch: splitting and merging batches).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/pipeline/partition.h"
#include "tandem/pipeline/schedule.h"
#include "tandem/pipeline/timeline.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rref/rref.h"

namespace tandem::pipeline {

struct StageSpec {
  rpc::To worker;
  std::string factory;            // a module factory registered with nn::register_module on that worker
  std::vector<c10::IValue> args;  // its arguments
  // When the factory returns a torch::nn::Sequential: keep only its layers [layer_begin, layer_end). -1: all of it.
  int64_t layer_begin = -1, layer_end = -1;
  // Instead of a factory: a model registered with register_layers (pipeline/layers.h); the worker builds only its
  // layers [layer_begin, layer_end), which must then be given.
  std::string layers;
  // Instead of a factory: a TorchScript module file (torch.jit.save / torch::jit::Module::save) that the worker loads
  // (the path as the worker sees it); its forward takes the stage's arguments (one tensor, or see step()).
  std::string torchscript;
};

enum class GradientsTo { kContext, kDotGrad };

// A parameter several stages share (an embedding used by the first stage and, transposed, by the last): its copies,
// each a stage and the parameter's name in that stage's module (named_parameters(): "weight", "0.weight", ...). At
// creation every copy takes the first copy's values; each step sums the copies' gradients (in copy order, so every
// copy gets the same tensor, bit for bit) before they go to the context or .grad, so the copies stay equal as long as
// one optimizer steps them alike (DistributedOptimizer over parameter_rrefs(), which lists every copy). The sum rides
// on the words the stage workers exchange at the end of a step: no extra message.
struct TiedParameter {
  std::vector<std::pair<int, std::string>> copies;
};

struct PipelineOptions {
  Schedule schedule = Schedule::k1F1B;
  int n_microbatches = 4;
  // Computed on the last stage from its output and the target: "mse", "cross_entropy", "nll", or register_loss().
  // A loss is the mean over its micro-batch.
  std::string loss = "mse";
  // kContext: step() must run inside a dist_autograd::ContextGuard; the gradients go to that context on each stage's
  // worker (for DistributedOptimizer). kDotGrad: they are added to the stage parameters' .grad (zero them yourself).
  GradientsTo gradients = GradientsTo::kContext;
  // Recompute each stage's forward in its backward (activation memory: inputs only), with the same results (above).
  bool checkpoint = false;
  // The whole step, and every wait inside it; also each stage's creation and each forward(). Non-positive (the
  // default): RpcOptions::rpc_timeout, resolved when the pipeline is created (options() then shows it). At most 1e6 s
  // (INVALID_ARGUMENT at creation).
  std::chrono::milliseconds timeout{0};
  bool record_timeline = false;  // every action's start and end, for write_chrome_trace / write_svg
  // Schedule::kCustom: each worker's plan for n_microbatches micro-batches (schedule.h; in code, or parse_plans_csv).
  // plans[w] is the w-th worker in stage order (stage 0's worker is 0, the next worker a stage names is 1, ...). A step
  // checks them first (simulate()) and fails naming the first bad action.
  std::vector<std::vector<Action>> plans;
  // Parameters shared by stages (above). Creation fails (INVALID_ARGUMENT) for a tie of fewer than two copies, a stage
  // out of range, a copy named twice, a name the stage's module does not have (the error lists the names it has) or
  // copies of different shapes or types.
  std::vector<TiedParameter> tied;
};

struct StepStats {
  double loss = 0;
  double step_ms = 0;                     // on the driver, from sending the plans to the last reply
  std::vector<double> busy_ms;            // per stage: time spent in its forwards and backwards (B, I, W)
  std::vector<int64_t> peak_activations;  // per stage: most micro-batches whose activations were alive at once
                                          // (from F to B, or to W for a split backward)
  // Per stage: its worker process's peak resident memory so far (getrusage's ru_maxrss: VmHWM, KiB) when its part of
  // the step ended; -1 where the system does not tell. Stages of one worker show the same figure.
  std::vector<int64_t> peak_memory_kib;
  std::vector<int64_t> microbatch_sizes;
};

// Registers a loss function for PipelineOptions::loss on this worker (every worker that may hold a last stage).
// Throws RpcError (ALREADY_EXISTS) for a taken name.
void register_loss(const std::string& name,
                   std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> loss);

class Pipeline {
 public:
  // Builds every stage on its worker (in parallel; returns when all are built). Throws RpcError naming the stage
  // (unknown worker, unknown factory, a layer range outside the Sequential).
  static Pipeline create(std::vector<StageSpec> stages, PipelineOptions options = {});
  // Builds factory(args...) here (it must return a torch::nn::Sequential), cuts it into balanced stages and builds
  // them on `workers`: stage k on workers[k % workers.size()] (with more stages than workers: interleaved stages;
  // with Schedule::kZeroBubbleV, 2P stages on P workers in a V: stage k on worker k, then 2P - 1 - k).
  // Every stage worker builds the whole model too and keeps its layers: from_layers builds only what each needs.
  static Pipeline from_sequential(const std::string& factory, std::vector<c10::IValue> args,
                                  const std::vector<rpc::To>& workers, PartitionOptions partition,
                                  PipelineOptions options = {});

  // Cuts the model registered with register_layers under `layers` (on this worker and on every stage's) into
  // partition.n_stages stages and builds them on `workers` as from_sequential does; each worker builds only its own
  // layers, and this worker never builds the whole model (pipeline/layers.h says how it weighs the layers).
  static Pipeline from_layers(const std::string& layers, const std::vector<rpc::To>& workers,
                              PartitionOptions partition, PipelineOptions options = {});

  // One training step on the whole batch: forward and backward of every micro-batch by the schedule. Returns the
  // batch's loss. See the header comment for where the gradients go and for errors.
  double step(const at::Tensor& input, const at::Tensor& target);
  // The same for a model of several inputs (stage 0's forward takes them as its arguments), split as PyTorch's
  // split_args_kwargs_into_chunks does by default: every tensor, also inside tuples and lists, along dimension 0 (all
  // with the batch's rows, the target's too); other values (a scalar, a string, a config) and the inputs marked in
  // `replicate` (empty, or one flag per input) whole to every micro-batch. Stages then pass structured activations:
  // what a stage returns (a tensor, or a tuple or list of tensors and other values, e.g. hidden states and an
  // attention mask) is the next stage's arguments (a tuple's elements, anything else one argument), and every
  // floating-point tensor of it gets its gradient back. The last stage returns one tensor, for the loss. A stage that
  // takes or returns more than one tensor is a registered module whose forward has those arguments
  // (nn::register_module with a forward function) or a TorchScript file; layers of a Sequential take one tensor.
  double step(const std::vector<c10::IValue>& inputs, const at::Tensor& target,
              const std::vector<bool>& replicate = {});
  // Inference: the last stage's output for the whole batch, without gradients, every stage in eval mode (dropout off,
  // BatchNorm's running statistics used and not updated; each stage's training flag is restored after). It waits for
  // a step of this pipeline that is running, and a step waits for it. The batch's micro-batches flow through the stages
  // as in a step (one at a time on each stage, several stages at once), each from stage to stage (stage i's worker
  // calls stage i+1's), computed where steps are (the pipeline's own thread on each worker), never on RPC server
  // threads. Throws RpcError naming the stage and worker that failed.
  at::Tensor forward(const at::Tensor& input);
  // The same for several inputs, split as step() splits them; the last stage returns one tensor.
  at::Tensor forward(const std::vector<c10::IValue>& inputs, const std::vector<bool>& replicate = {});
  // Turns PipelineOptions::record_timeline on or off for the following steps (a step running now keeps its setting).
  void set_record_timeline(bool on);

  int num_stages() const;
  std::string stage_worker(int stage) const;
  std::pair<int64_t, int64_t> stage_layers(int stage) const;  // (-1, -1) unless cut from a Sequential
  // RRefs to every stage's parameters, stage by stage, owned by the stages' workers (for DistributedOptimizer).
  std::vector<rref::RRef> parameter_rrefs() const;
  int64_t id() const;
  // Copies, consistent while another thread runs a step or changes the options.
  PipelineOptions options() const;
  StepStats last_stats() const;  // of the last step that succeeded
  // The last successful step's actions (needs record_timeline).
  std::vector<TimelineEvent> last_timeline() const;
  // The last step's timeline as a Chrome trace (open in Perfetto or chrome://tracing) and as a self-contained SVG
  // picture of the schedule: one row per stage, forwards and backwards by micro-batch, gaps are the bubbles.
  void write_chrome_trace(const std::string& path) const;
  void write_svg(const std::string& path) const;

  struct State;

 private:
  friend class ReplicatedPipeline;
  explicit Pipeline(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;  // released on the workers when the last copy goes
};

// R replicas of one pipeline: data parallelism across pipelines (Megatron's and DeepSpeed's "3D" without tensor
// parallelism). replicas[r] are replica r's stages, each replica's on workers of its own, the same model in each (the
// same factories and cuts; at creation every replica takes replica 0's parameters). step() splits the batch into R
// shares (tensor_split), runs every replica's step at once, and each micro-batch's loss is weighted by its share of the
// whole batch, so the sum of a stage's gradients over its replicas is the whole batch's. That sum runs on each stage's
// workers over a process group of them (comm/, one per stage, one bucket per stage), started as soon as that stage's
// last backward (or W) is done on each, while the rest of the drain runs; every replica's copy then gets it. Step all
// copies with one DistributedOptimizer over parameter_rrefs() and they stay equal.
//
// Errors: create() as Pipeline::create, and INVALID_ARGUMENT for replicas of different stage counts or one worker
// holding the same stage of two replicas. step(): INVALID_ARGUMENT for a batch of fewer than R x n_microbatches rows;
// when a replica fails (a stage throws, a message is lost), every replica's step fails at once, naming each replica's
// error, and the next step works; after a worker died its stage's group is broken (the errors say so): make a new
// ReplicatedPipeline. Each stage worker takes part in its stage's sums step by step, in step order (every replica's
// step has one id): a step whose plan did not reach it before a later step's takes part with zeros, and that plan, if
// it comes, is refused (ABORTED, naming the worker and the steps), so a plan delayed in transit never pairs one
// step's sums with another's. A replica that cannot begin a step (a ring or a call that throws) fails it, naming the
// replica, after the replicas begun before it were aborted and ended. As with one pipeline, a failure after a
// replica's workers agreed that they finished (a worker dying then, a reply lost) fails a step whose gradients some
// replicas delivered. replica(r) is for its stages, timeline and forward(); its own step() is refused
// (FAILED_PRECONDITION).
//
// Thread-safety: one step at a time.
class ReplicatedPipeline {
 public:
  static ReplicatedPipeline create(std::vector<std::vector<StageSpec>> replicas, PipelineOptions options = {});
  // Pipeline::from_sequential's cut (made once, here) with replica r's stages on workers[r], placed on them as
  // from_sequential places them.
  static ReplicatedPipeline from_sequential(const std::string& factory, std::vector<c10::IValue> args,
                                            const std::vector<std::vector<rpc::To>>& workers,
                                            PartitionOptions partition, PipelineOptions options = {});
  // One training step on the whole batch (inside a dist_autograd::ContextGuard, or with GradientsTo::kDotGrad).
  // Returns the batch's loss.
  double step(const at::Tensor& input, const at::Tensor& target);
  // Every replica's parameters (each stage's copies get the same gradient).
  std::vector<rref::RRef> parameter_rrefs() const;
  int num_replicas() const { return static_cast<int>(replicas_.size()); }
  Pipeline& replica(int r) { return replicas_.at(r); }

 private:
  ReplicatedPipeline() = default;
  std::vector<Pipeline> replicas_;
};

}  // namespace tandem::pipeline
