#include "tandem/pipeline/detail/stage.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

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
// Below autograd's in-place tracking, as BatchNorm's kernel updates its running statistics: their version counters
// stay, so a graph that saved these buffers still takes them (a split backward's W runs after this).
void put_back(Stage& stage, const std::vector<at::Tensor>& kept) {
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
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

namespace {

// The roots of a micro-batch's backward: the output's tensors that have a graph and a gradient (on the last stage, the
// loss alone), and the input's tensors (none on the first stage).
struct Roots {
  std::vector<at::Tensor> tensors, grads, inputs;
};
Roots roots_of(const c10::IValue& output, const Live& live, const c10::IValue& grad_output, bool first, bool last) {
  Roots r;
  const std::vector<at::Tensor> outs = tensors_of(output);
  if (last) {
    for (const auto& t : outs) {
      if (t.requires_grad()) r.tensors.push_back(t);
    }
  } else {
    const std::vector<at::Tensor> received = gradients_of(grad_output, outs);
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].requires_grad() && received[i].defined())
        r.tensors.push_back(outs[i]), r.grads.push_back(received[i]);
    }
  }
  if (!first) r.inputs = tensors_of(live.input);
  return r;
}

// The message for the previous stage (MicrobatchGradients::input) from `grads`, one per input tensor.
c10::IValue input_message(const Live& live, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& grads) {
  if (live.input.size() == 1 && live.input[0].isTensor()) {
    return grads[0].defined() ? grads[0] : at::zeros_like(inputs[0]);
  }
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& g : grads) list.push_back(g.defined() ? c10::IValue(g) : c10::IValue());
  return list;
}

// The recompute's buffers go back once the backward is done (or failed): its graph may hold them.
struct PutBack {
  Stage& stage;
  std::vector<at::Tensor> kept;
  ~PutBack() { put_back(stage, kept); }
};

// Appends the input's tensors that require gradients to `wrt`; returns, for each tensor of the input, its place there,
// or max() when it has no gradient.
std::vector<size_t> append_inputs(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>* wrt) {
  std::vector<size_t> places;
  for (const auto& t : inputs) {
    places.push_back(t.requires_grad() ? wrt->size() : std::numeric_limits<size_t>::max());
    if (t.requires_grad()) wrt->push_back(t);
  }
  return places;
}
// The input's gradients (per tensor; undefined where none) from the engine's `grads` over `wrt`.
std::vector<at::Tensor> input_gradients(const std::vector<at::Tensor>& grads, const std::vector<size_t>& input_at) {
  std::vector<at::Tensor> out;
  for (size_t k : input_at) out.push_back(k < grads.size() ? grads[k] : at::Tensor());
  return out;
}

// The full backward from `r`: the gradients of the parameters and of the input's tensors.
void full_backward(const Stage& stage, const Roots& r, std::vector<at::Tensor>* params,
                   std::vector<at::Tensor>* inputs) {
  std::vector<at::Tensor> wrt = stage.params;
  const std::vector<size_t> input_at = append_inputs(r.inputs, &wrt);
  std::vector<at::Tensor> grads;
  if (!wrt.empty() && !r.tensors.empty()) {
    grads = torch::autograd::grad(r.tensors, wrt, r.grads, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
  } else {
    grads.resize(wrt.size());
  }
  *inputs = input_gradients(grads, input_at);
  grads.resize(stage.params.size());
  *params = std::move(grads);
}

}  // namespace

MicrobatchGradients backward_microbatch(Stage& stage, Live live, const c10::IValue& grad_output, bool first, bool last,
                                        bool recompute_forward) {
  PutBack put_back_after{stage, {}};
  const c10::IValue output = recompute_forward ? recompute(stage, live, &put_back_after.kept) : live.output;
  const Roots r = roots_of(output, live, grad_output, first, last);
  MicrobatchGradients out;
  std::vector<at::Tensor> input_grads;
  full_backward(stage, r, &out.params, &input_grads);
  if (!first) out.input = input_message(live, r.inputs, input_grads);
  return out;
}

// ---- the zero-bubble split (stage.h)

namespace {
using torch::autograd::Edge;
using torch::autograd::Node;

// Keeps what reaches a node in I: the gradients of its forward's outputs.
struct Capture : torch::autograd::FunctionPreHook {
  explicit Capture(std::shared_ptr<std::vector<at::Tensor>> into) : into(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    *into = grads;
    return grads;
  }
  std::shared_ptr<std::vector<at::Tensor>> into;
};
}  // namespace

struct WeightWork {
  Live live;  // the input's tensors: their graph lives until W
  Roots roots;
  bool split = false;
  bool whole_in_w = false;       // the first stage: W runs the whole backward
  std::vector<at::Tensor> done;  // not split: the parameters' gradients, computed by I (or, first stage, by W)
  struct Group {
    std::vector<std::shared_ptr<Node>> nodes;                        // where the parameters' paths join the input's
    std::vector<std::shared_ptr<std::vector<at::Tensor>>> captured;  // what reached each of them in I
    std::vector<size_t> params;                                      // indices into Stage::params
    std::vector<Edge> outputs;                                       // their gradient edges
  };
  std::vector<Group> groups;
};

bool split(const WeightWork& work) { return work.split; }

namespace {

// The groups of W for the graph from `r` (see stage.h); false when this graph is not split.
bool plan_weights(const Stage& stage, const Roots& r, WeightWork* work) {
  std::unordered_set<const Node*> input_nodes, root_nodes;
  for (const auto& t : r.inputs) {
    if (!t.requires_grad()) continue;
    if (auto acc = torch::autograd::impl::try_get_grad_accumulator(t)) input_nodes.insert(acc.get());
  }
  if (input_nodes.empty()) return false;
  // Every node the backward can reach, whether it leads to the input, and who points to it (iterative: graphs of
  // deep stages are deep).
  std::unordered_map<const Node*, std::shared_ptr<Node>> nodes;
  std::unordered_map<const Node*, bool> reaches;
  std::unordered_map<const Node*, std::vector<const Node*>> parents;
  std::vector<std::pair<Node*, size_t>> stack;
  for (const auto& t : r.tensors) {
    const std::shared_ptr<Node>& fn = t.grad_fn();
    if (!fn) return false;  // a parameter returned as it is: no graph to split
    root_nodes.insert(fn.get());
    if (nodes.emplace(fn.get(), fn).second) stack.emplace_back(fn.get(), 0);
    while (!stack.empty()) {
      auto& [n, k] = stack.back();
      if (k < n->num_outputs()) {
        const Edge& e = n->next_edge(k++);
        if (!e.function) continue;
        parents[e.function.get()].push_back(n);
        if (nodes.emplace(e.function.get(), e.function).second) stack.emplace_back(e.function.get(), 0);
        continue;
      }
      bool yes = input_nodes.count(n) > 0;
      for (const Edge& e : n->next_edges()) yes = yes || (e.function && reaches[e.function.get()]);
      reaches[n] = yes;
      stack.pop_back();
    }
  }
  // Each parameter's joining nodes: going up from its accumulator, the first nodes that lead to the input.
  std::vector<std::vector<const Node*>> joins(stage.params.size());
  std::unordered_map<const Node*, size_t> owner;  // joining node -> a parameter's index (union-find below)
  std::vector<size_t> group_of(stage.params.size());
  for (size_t j = 0; j < group_of.size(); ++j) group_of[j] = j;
  std::function<size_t(size_t)> find = [&](size_t j) { return group_of[j] == j ? j : group_of[j] = find(group_of[j]); };
  for (size_t j = 0; j < stage.params.size(); ++j) {
    auto acc = torch::autograd::impl::try_get_grad_accumulator(stage.params[j]);
    if (!acc || !nodes.count(acc.get())) continue;  // not in this graph: no gradient
    std::unordered_set<const Node*> seen{acc.get()};
    std::vector<const Node*> todo{acc.get()};
    while (!todo.empty()) {
      const Node* n = todo.back();
      todo.pop_back();
      if (root_nodes.count(n)) return false;  // a root whose gradient reaches the parameter without the input's path
      for (const Node* up : parents[n]) {
        if (!seen.insert(up).second) continue;
        if (reaches[up]) {
          joins[j].push_back(up);
          auto [it, fresh] = owner.emplace(up, j);
          if (!fresh) group_of[find(j)] = find(it->second);
        } else {
          todo.push_back(up);
        }
      }
    }
  }
  std::map<size_t, WeightWork::Group> groups;
  std::map<size_t, std::unordered_set<const Node*>> group_nodes;
  for (size_t j = 0; j < joins.size(); ++j) {
    if (joins[j].empty()) continue;
    WeightWork::Group& g = groups[find(j)];
    g.params.push_back(j);
    g.outputs.push_back(torch::autograd::impl::gradient_edge(stage.params[j]));
    for (const Node* n : joins[j]) {
      if (group_nodes[find(j)].insert(n).second) g.nodes.push_back(nodes.at(n));
    }
  }
  // W runs a group from its joining nodes to its parameters: a joining node behind another of the same group (a
  // parameter used twice along the input's path) would run twice. Such graphs are not split.
  for (const auto& [id, members] : group_nodes) {
    for (const Node* from : members) {
      std::unordered_set<const Node*> seen{from};
      std::vector<const Node*> todo{from};
      while (!todo.empty()) {
        const Node* n = todo.back();
        todo.pop_back();
        for (const Edge& e : n->next_edges()) {
          const Node* c = e.function.get();
          if (!c || !reaches[c] || !seen.insert(c).second) continue;
          if (members.count(c)) return false;
          todo.push_back(c);
        }
      }
    }
  }
  // W runs a joining node again: a hook on it (Tensor::register_hook on its output, a retain_grad) would run twice
  // and, if it changes the gradient, change it twice. Such graphs are not split either.
  for (const auto& [id, g] : groups) {
    for (const auto& n : g.nodes) {
      if (!n->pre_hooks().empty() || !n->post_hooks().empty()) return false;
    }
  }
  for (auto& [id, g] : groups) {
    for (const auto& n : g.nodes) {
      g.captured.push_back(std::make_shared<std::vector<at::Tensor>>());
      n->add_pre_hook(std::make_unique<Capture>(g.captured.back()));
    }
    work->groups.push_back(std::move(g));
  }
  return true;
}

// Takes this split's hooks off the graph's nodes.
void remove_captures(WeightWork* work) {
  for (auto& g : work->groups) {
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      auto& hooks = g.nodes[i]->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [&](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                                   auto* c = dynamic_cast<Capture*>(h.get());
                                   return c && c->into == g.captured[i];
                                 }),
                  hooks.end());
    }
  }
}

}  // namespace

InputGradients backward_input(Stage& stage, Live live, const c10::IValue& grad_output, bool first, bool last,
                              bool recompute_forward) {
  auto work = std::make_shared<WeightWork>();
  InputGradients out;
  {
    PutBack put_back_after{stage, {}};  // after I: a later forward updates the buffers again
    const c10::IValue output = recompute_forward ? recompute(stage, live, &put_back_after.kept) : live.output;
    work->roots = roots_of(output, live, grad_output, first, last);
    const Roots& r = work->roots;
    std::vector<at::Tensor> input_grads;
    if (first) {
      work->whole_in_w = true;  // no input gradient: the whole backward is W's
    } else if (!stage.params.empty() && !r.tensors.empty() && plan_weights(stage, r, work.get())) {
      work->split = true;
      std::vector<at::Tensor> wrt;
      const std::vector<size_t> input_at = append_inputs(r.inputs, &wrt);
      std::vector<at::Tensor> grads;
      try {
        grads = torch::autograd::grad(r.tensors, wrt, r.grads, /*retain_graph=*/true, /*create_graph=*/false,
                                      /*allow_unused=*/true);
      } catch (...) {
        remove_captures(work.get());
        throw;
      }
      remove_captures(work.get());
      input_grads = input_gradients(grads, input_at);
    } else {
      work->groups.clear();
      full_backward(stage, r, &work->done, &input_grads);
    }
    if (!first) out.input = input_message(live, r.inputs, input_grads);
  }
  work->live = std::move(live);
  out.work = std::move(work);
  return out;
}

std::vector<at::Tensor> backward_weight(Stage& stage, std::shared_ptr<WeightWork> work) {
  if (!work->split) {
    if (work->whole_in_w) {
      std::vector<at::Tensor> none;
      full_backward(stage, work->roots, &work->done, &none);
    }
    return std::move(work->done);
  }
  std::vector<at::Tensor> grads(stage.params.size());
  for (const auto& g : work->groups) {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list root_grads;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      const std::vector<at::Tensor>& got = *g.captured[i];
      for (size_t k = 0; k < got.size(); ++k) {
        if (got[k].defined()) roots.emplace_back(g.nodes[i], static_cast<uint32_t>(k)), root_grads.push_back(got[k]);
      }
    }
    if (roots.empty()) continue;  // nothing reached this group's nodes: no gradient
    torch::autograd::variable_list out = torch::autograd::Engine::get_default_engine().execute(
        roots, root_grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, g.outputs);
    for (size_t i = 0; i < g.params.size() && i < out.size(); ++i) grads[g.params[i]] = std::move(out[i]);
  }
  work.reset();  // the graph goes with the work
  return grads;
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
