#include "tandem/pipeline/detail/stage.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/modules/container/sequential.h>

#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "absl/base/attributes.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/nn/remote_module.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/pipeline/layers.h"
#include "tandem/pipeline/pipeline.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::pipeline {
namespace detail {
namespace {

struct Losses {
  Mutex mu;
  std::map<std::string, LossFn> by_name ABSL_GUARDED_BY(mu) = {
      {"mse", [](const at::Tensor& o, const at::Tensor& t) { return at::mse_loss(o, t); }},
      {"cross_entropy", [](const at::Tensor& o, const at::Tensor& t) { return at::cross_entropy_loss(o, t); }},
      {"nll", [](const at::Tensor& o, const at::Tensor& t) { return at::nll_loss(o, t); }},
  };
};
Losses& losses() {
  static auto* l = new Losses;
  return *l;
}

// A TorchScript module as a stage: its parameters and forward. Holds the module, which is not a torch::nn::Module.
struct ScriptStage : torch::nn::Module {
  explicit ScriptStage(torch::jit::Module m) : script(std::move(m)) {
    int i = 0;
    for (const auto& p : script.parameters()) register_parameter("p" + std::to_string(i++), p, p.requires_grad());
  }
  torch::jit::Module script;
};

// The CPU generator's state (what torch.get_rng_state() returns), and setting it back.
at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The forward again, as it ran the first time: from the CPU generator's state it began with (dropout draws the same
// mask), as PyTorch's checkpoint and Megatron do; the generator then continues from where it was, so the step draws
// the same numbers as without checkpointing. The buffers (BatchNorm's running statistics) are kept in `kept`: the
// caller puts them back once the backward is done (before, the graph may hold them), so that they are updated once
// per micro-batch, by the first forward.
c10::IValue recompute(Stage& stage, const Live& live, std::vector<at::Tensor>* kept) {
  for (const auto& b : stage.buffers) kept->push_back(b.defined() ? b.clone() : at::Tensor());
  const at::Tensor now = cpu_rng_state();
  set_cpu_rng_state(live.rng_state);
  try {
    c10::IValue out = stage.forward(live.input);
    set_cpu_rng_state(now);
    return out;
  } catch (...) {
    set_cpu_rng_state(now);
    throw;
  }
}
void put_back(Stage& stage, const std::vector<at::Tensor>& kept) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < kept.size(); ++i) {
    if (kept[i].defined() && !at::equal(stage.buffers[i], kept[i])) stage.buffers[i].copy_(kept[i]);
  }
}

}  // namespace

std::shared_ptr<Stage> load_script_stage(const std::string& path) {
  auto module = std::make_shared<ScriptStage>(torch::jit::load(path));
  auto stage = std::make_shared<Stage>();
  stage->module = module;
  stage->forward = [module](Args args) { return module->script.forward(std::move(args)); };
  for (const auto& p : module->parameters()) {
    if (p.requires_grad()) stage->params.push_back(p);
  }
  for (const auto& b : module->script.buffers()) stage->buffers.push_back(b);
  stage->is_training = [module] { return module->script.is_training(); };
  stage->set_training = [module](bool on) { module->script.train(on); };
  return stage;
}

namespace {

// The stage of `module` (which the stage holds) with `forward`: its parameters, buffers and training flag.
std::shared_ptr<Stage> make_stage(std::shared_ptr<torch::nn::Module> module, std::function<c10::IValue(Args)> forward) {
  auto stage = std::make_shared<Stage>();
  stage->module = std::move(module);
  stage->forward = std::move(forward);
  for (const auto& p : stage->module->parameters()) {
    if (p.requires_grad()) stage->params.push_back(p);
  }
  for (const auto& b : stage->module->buffers()) stage->buffers.push_back(b);
  torch::nn::Module* m = stage->module.get();  // the stage holds it
  stage->is_training = [m] { return m == nullptr || m->is_training(); };
  stage->set_training = [m](bool on) {
    if (m) m->train(on);
  };
  return stage;
}

// Layers of a Sequential as a stage: one tensor in, the last layer's tensor out.
std::shared_ptr<Stage> sequential_stage(torch::nn::Sequential part) {
  return make_stage(part.ptr(), [part](Args args) mutable -> c10::IValue {
    if (args.size() != 1 || !args[0].isTensor()) {
      std::vector<std::string> kinds;
      for (const auto& a : args) kinds.push_back(a.tagKind());
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("layers of a Sequential take one tensor, and this stage got ", args.size(), " values (",
                        absl::StrJoin(kinds, ", "), "): use a registered module whose forward takes them"));
    }
    return part->forward(args[0].toTensor());
  });
}
}  // namespace

std::shared_ptr<Stage> build_stage(const std::string& factory, std::vector<c10::IValue> args, int64_t begin,
                                   int64_t end) {
  nn::detail::Instance instance;
  {
    MutexLock build_lock(&build_mutex());
    instance = nn::detail::make_instance(factory, std::move(args));
  }
  if (begin < 0) {
    auto forward = instance.forward;
    return make_stage(instance.module, [forward](Args args) { return forward(std::move(args)).value(); });
  }
  auto full = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(instance.module);
  if (!full) {
    throw_error(absl::InvalidArgumentError("factory '" + factory + "' does not return a torch::nn::Sequential"));
  }
  if (end <= begin || end > static_cast<int64_t>(full->size())) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("layers [", begin, ", ", end, ") are not within the ",
                                                        full->size(), " layers of factory '", factory, "'")));
  }
  torch::nn::Sequential part;
  for (int64_t i = begin; i < end; ++i) part->push_back(std::to_string(i), *(full->begin() + i));
  return sequential_stage(part);
}

std::shared_ptr<Stage> build_layers_stage(const std::string& layers, int64_t begin, int64_t end) {
  torch::nn::Sequential part;
  {
    MutexLock build_lock(&build_mutex());
    part = build_layers(layers, begin, end);
  }
  return sequential_stage(part);
}

LossFn find_loss(const std::string& name) {
  Losses& l = losses();
  MutexLock lock(&l.mu);
  auto it = l.by_name.find(name);
  if (it == l.by_name.end()) {
    throw_error(absl::NotFoundError(absl::StrCat("no loss named '", name, "' on worker '", self_name(),
                                                 "' (built in: mse, cross_entropy, nll; or pipeline::register_loss)")));
  }
  return it->second;
}

c10::IValue forward_microbatch(Stage& stage, Args x, bool first, bool checkpoint, Live* live) {
  if (!first) {
    for (auto& a : x) {
      a = map_tensors(a,
                      [](const at::Tensor& t) { return t.is_floating_point() ? t.detach().requires_grad_(true) : t; });
    }
  }
  c10::IValue out;
  if (checkpoint) {
    live->rng_state = cpu_rng_state();  // the recompute in backward draws what this forward draws (dropout's mask)
    at::NoGradGuard no_grad;
    out = stage.forward(x);
  } else {
    out = stage.forward(x);
  }
  live->input = std::move(x);
  live->output = checkpoint ? c10::IValue() : out;
  return out;
}

namespace {
// The gradients of an activation's tensors from its gradient message (the form of MicrobatchGradients::input),
// checked against the output's tensors `outs`.
std::vector<at::Tensor> gradients_of(const c10::IValue& g, const std::vector<at::Tensor>& outs) {
  std::vector<at::Tensor> got;
  if (g.isTensor()) {
    got.push_back(g.toTensor());
  } else if (g.isList()) {
    size_t k = 0;
    for (const c10::IValue& e : g.toListRef()) {
      if (!e.isTensor() && !e.isNone()) {
        fail(absl::StatusCode::kInvalidArgument, absl::StrCat("entry ", k, " of the gradient from the next stage is a ",
                                                              e.tagKind(), ", not a tensor or None"));
      }
      got.push_back(e.isTensor() ? e.toTensor() : at::Tensor());
      ++k;
    }
  } else {
    fail(absl::StatusCode::kInvalidArgument,
         absl::StrCat("the gradient from the next stage is a ", g.tagKind(), ", not a tensor or a list"));
  }
  if (got.size() != outs.size()) {
    fail(absl::StatusCode::kInvalidArgument, absl::StrCat("the gradient from the next stage has ", got.size(),
                                                          " tensors where this stage's output has ", outs.size()));
  }
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k].defined() && got[k].sizes() != outs[k].sizes()) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("gradient ", k, " from the next stage has shape [", absl::StrJoin(got[k].sizes(), ", "),
                        "] where this stage's output tensor ", k, " has [", absl::StrJoin(outs[k].sizes(), ", "), "]"));
    }
  }
  return got;
}
}  // namespace

MicrobatchGradients backward_microbatch(Stage& stage, Live live, const c10::IValue& grad_output, bool first, bool last,
                                        bool recompute_forward) {
  std::vector<at::Tensor> kept;  // with checkpointing: the buffers as the first forward left them
  struct PutBack {
    Stage& stage;
    const std::vector<at::Tensor>& kept;
    ~PutBack() { put_back(stage, kept); }
  } put_back_after{stage, kept};  // after the backward below (or its error): its graph may hold them
  const c10::IValue output = recompute_forward ? recompute(stage, live, &kept) : live.output;
  // The roots: the output's tensors that have a graph and a gradient (on the last stage, the loss alone).
  std::vector<at::Tensor> roots, root_grads;
  const std::vector<at::Tensor> outs = tensors_of(output);
  if (last) {
    for (const auto& t : outs) {
      if (t.requires_grad()) roots.push_back(t);
    }
  } else {
    const std::vector<at::Tensor> received = gradients_of(grad_output, outs);
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].requires_grad() && received[i].defined()) roots.push_back(outs[i]), root_grads.push_back(received[i]);
    }
  }
  const std::vector<at::Tensor> inputs = first ? std::vector<at::Tensor>{} : tensors_of(live.input);
  std::vector<at::Tensor> wrt = stage.params;
  std::vector<size_t> input_at;  // for each tensor of the input: its place in wrt, or max() when it has no gradient
  for (const auto& t : inputs) {
    input_at.push_back(t.requires_grad() ? wrt.size() : std::numeric_limits<size_t>::max());
    if (t.requires_grad()) wrt.push_back(t);
  }
  std::vector<at::Tensor> grads;
  if (!wrt.empty() && !roots.empty()) {
    grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
  } else {
    grads.resize(wrt.size());
  }
  MicrobatchGradients out;
  if (!first) {
    auto grad_of = [&](size_t k) { return input_at[k] < grads.size() ? grads[input_at[k]] : at::Tensor(); };
    if (live.input.size() == 1 && live.input[0].isTensor()) {
      at::Tensor g = grad_of(0);
      out.input = g.defined() ? g : at::zeros_like(inputs[0]);
    } else {
      c10::impl::GenericList list(c10::AnyType::get());
      for (size_t k = 0; k < inputs.size(); ++k) {
        at::Tensor g = grad_of(k);
        list.push_back(g.defined() ? c10::IValue(g) : c10::IValue());
      }
      out.input = std::move(list);
    }
  }
  grads.resize(stage.params.size());
  out.params = std::move(grads);
  return out;
}

void accumulate(std::vector<at::Tensor>& sums, std::vector<at::Tensor>&& grads) {
  for (size_t j = 0; j < sums.size() && j < grads.size(); ++j) {
    if (!grads[j].defined()) continue;
    if (sums[j].defined()) {
      sums[j].add_(grads[j]);
    } else if (grads[j].use_count() == 1 && grads[j].storage().use_count() == 1) {
      sums[j] = std::move(grads[j]);  // computed for this parameter alone: ours to accumulate into
    } else {
      sums[j] = grads[j].clone();  // the engine may hand one tensor to several inputs (x * (a + b))
    }
  }
}

}  // namespace detail

void register_loss(const std::string& name, std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss) {
  detail::Losses& l = detail::losses();
  MutexLock lock(&l.mu);
  if (!l.by_name.emplace(name, std::move(loss)).second) {
    throw RpcError(absl::AlreadyExistsError("a pipeline loss named '" + name + "' is already registered"));
  }
}

}  // namespace tandem::pipeline
