// The zero-bubble split of a stage's backward (pipeline/detail/stage.h): I then W give the gradients the full backward
// gives, on every kind of stage, and W does not run the input's part again.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/pipeline/detail/stage.h"
#include "tests/pipeline/stages.h"

namespace tandem::test {
namespace {

using pipeline::detail::Args;
using pipeline::detail::Live;
using pipeline::detail::Stage;

std::shared_ptr<Stage> stage_of(std::shared_ptr<torch::nn::Module> module, std::function<c10::IValue(Args)> forward) {
  auto stage = std::make_shared<Stage>();
  stage->module = module;
  stage->forward = std::move(forward);
  for (const auto& p : module->parameters()) stage->params.push_back(p);
  for (const auto& b : module->buffers()) stage->buffers.push_back(b);
  return stage;
}

std::shared_ptr<Stage> sequential(torch::nn::Sequential seq) {
  return stage_of(seq.ptr(), [seq](Args a) mutable -> c10::IValue { return seq->forward(a[0].toTensor()); });
}

struct Grads {
  std::vector<at::Tensor> params;
  c10::IValue input;
  bool split = false;
};

// The micro-batch `x` through `stage` and back with `grad_output` (or, on a last stage, the MSE loss against
// `target`), by one full backward (split = false) or by I then W.
Grads run(Stage& stage, const Args& x, bool first, bool last, const c10::IValue& grad_output, bool by_split,
          const at::Tensor& target = {}) {
  Live live;
  c10::IValue out = pipeline::detail::forward_microbatch(stage, x, first, /*checkpoint=*/false, &live);
  if (last) live.output = torch::mse_loss(out.toTensor(), target);
  Grads g;
  if (!by_split) {
    auto full = pipeline::detail::backward_microbatch(stage, std::move(live), grad_output, first, last, false);
    g.params = std::move(full.params), g.input = full.input;
    return g;
  }
  auto i = pipeline::detail::backward_input(stage, std::move(live), grad_output, first, last, false);
  g.input = i.input;
  g.split = pipeline::detail::split(*i.work);
  g.params = pipeline::detail::backward_weight(stage, std::move(i.work));
  return g;
}

void expect_same(const Grads& full, const Grads& split) {
  ASSERT_EQ(full.params.size(), split.params.size());
  for (size_t j = 0; j < full.params.size(); ++j) {
    ASSERT_EQ(full.params[j].defined(), split.params[j].defined()) << "parameter " << j;
    if (full.params[j].defined()) EXPECT_TRUE(torch::allclose(full.params[j], split.params[j], 0, 1e-12)) << j;
  }
  const auto a = pipeline::detail::tensors_of(full.input), b = pipeline::detail::tensors_of(split.input);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::allclose(a[k], b[k], 0, 1e-12)) << "input " << k;
}

TEST(UnitPipelineSplit, IThenWEqualTheFullBackwardOnAMiddleStage) {
  auto stage = sequential(make_pipe_mlp(3, 5, 7));
  const Args x{torch::randn({4, 5}, torch::kFloat64)};
  const c10::IValue g = torch::randn({4, 5}, torch::kFloat64);
  const Grads full = run(*stage, x, false, false, g, false), split = run(*stage, x, false, false, g, true);
  EXPECT_TRUE(split.split);  // W computes the weights' part: the graph was split
  expect_same(full, split);
}

TEST(UnitPipelineSplit, IThenWEqualTheFullBackwardOnTheFirstAndLastStages) {
  auto stage = sequential(make_pipe_mlp(2, 5, 3));
  const Args x{torch::randn({4, 5}, torch::kFloat64)};
  const at::Tensor target = torch::randn({4, 5}, torch::kFloat64);
  const Grads last_full = run(*stage, x, false, true, {}, false, target);
  const Grads last_split = run(*stage, x, false, true, {}, true, target);
  EXPECT_TRUE(last_split.split);
  expect_same(last_full, last_split);
  const c10::IValue g = torch::randn({4, 5}, torch::kFloat64);
  const Grads first_full = run(*stage, x, true, false, g, false), first_split = run(*stage, x, true, false, g, true);
  EXPECT_FALSE(first_split.split);  // no input gradient: W runs the whole backward
  expect_same(first_full, first_split);
}

TEST(UnitPipelineSplit, ManyInputsAndOutputsNormsAndConvolutionsSplitToo) {
  // The masked block: a tuple in (a tensor, a mask, a double, a list of two tensors) and out, h used twice.
  MaskedBlock block(5, false);
  auto masked = stage_of(block.ptr(), [block](Args a) mutable {
    std::vector<at::Tensor> aux;
    for (const c10::IValue& t : a[3].toListRef()) aux.push_back(t.toTensor());
    return masked_block_forward(block, a[0].toTensor(), a[1].toTensor(), a[2].toDouble(), aux);
  });
  const at::Tensor x = torch::randn({3, 4}, torch::kFloat64);
  const Args in{x, torch::rand({3, 4}) > 0.3, 0.7,
                c10::List<at::Tensor>({torch::randn({3, 1}, torch::kFloat64), torch::randn({3, 4}, torch::kFloat64)})};
  Live probe;
  const c10::IValue out = pipeline::detail::forward_microbatch(*masked, in, false, false, &probe);
  c10::impl::GenericList grads(c10::AnyType::get());
  for (const auto& t : pipeline::detail::tensors_of(out)) {
    grads.push_back(t.is_floating_point() ? c10::IValue(torch::randn_like(t)) : c10::IValue());  // the mask: none
  }
  const Grads full = run(*masked, in, false, false, grads, false), split = run(*masked, in, false, false, grads, true);
  EXPECT_TRUE(split.split);
  expect_same(full, split);

  torch::manual_seed(2);
  torch::nn::Sequential conv(torch::nn::Conv1d(2, 3, 3), torch::nn::LayerNorm(torch::nn::LayerNormOptions({3, 6})),
                             torch::nn::GELU(), torch::nn::Flatten(), torch::nn::Linear(18, 4));
  conv->to(torch::kFloat64);
  auto stage = sequential(conv);
  const Args cx{torch::randn({5, 2, 8}, torch::kFloat64)};
  const c10::IValue cg = torch::randn({5, 4}, torch::kFloat64);
  const Grads cfull = run(*stage, cx, false, false, cg, false), csplit = run(*stage, cx, false, false, cg, true);
  EXPECT_TRUE(csplit.split);
  expect_same(cfull, csplit);
}

// One Linear applied twice along the input's path: its weight's two joining nodes lie one behind the other, and W from
// both would count the later one's gradient twice. Such a graph is not split (I runs it whole) and stays exact.
TEST(UnitPipelineSplit, AParameterUsedTwiceAlongThePathIsNotSplitAndStaysExact) {
  torch::manual_seed(4);
  torch::nn::Linear lin(4, 4);
  lin->to(torch::kFloat64);
  auto stage = stage_of(lin.ptr(), [lin](Args a) mutable -> c10::IValue {
    return lin->forward(torch::tanh(lin->forward(a[0].toTensor())));
  });
  const Args x{torch::randn({3, 4}, torch::kFloat64)};
  const c10::IValue g = torch::randn({3, 4}, torch::kFloat64);
  const Grads full = run(*stage, x, false, false, g, false), split = run(*stage, x, false, false, g, true);
  EXPECT_FALSE(split.split);
  expect_same(full, split);
}

// A hook on a joining node's output (here one that halves the gradient, as a gradient-scaling layer does): W would
// run the node, and its hook, again. Such a graph is not split, and the hook runs once.
TEST(UnitPipelineSplit, AHookOnAJoiningNodeIsNotRunTwice) {
  torch::manual_seed(5);
  torch::nn::Linear lin(4, 4);
  lin->to(torch::kFloat64);
  auto stage = stage_of(lin.ptr(), [lin](Args a) mutable -> c10::IValue {
    at::Tensor y = lin->forward(a[0].toTensor());
    y.register_hook([](const at::Tensor& g) { return g * 0.5; });
    return torch::tanh(y);
  });
  const Args x{torch::randn({3, 4}, torch::kFloat64)};
  const c10::IValue g = torch::randn({3, 4}, torch::kFloat64);
  const Grads full = run(*stage, x, false, false, g, false), split = run(*stage, x, false, false, g, true);
  EXPECT_FALSE(split.split);
  expect_same(full, split);
}

// W computes the weights' part only: the input's path (here a costly function before the first weight) runs in I,
// once, and not again in W.
TEST(UnitPipelineSplit, WDoesNotRunTheInputsPathAgain) {
  torch::manual_seed(6);
  torch::nn::Linear a(4, 4), b(4, 4);
  a->to(torch::kFloat64), b->to(torch::kFloat64);
  auto holder = std::make_shared<torch::nn::Module>();
  holder->register_module("a", a), holder->register_module("b", b);
  auto stage = stage_of(holder, [a, b](Args x) mutable -> c10::IValue {
    return b->forward(torch::tanh(a->forward(x[0].toTensor().exp())));
  });
  Live live;
  const c10::IValue out =
      pipeline::detail::forward_microbatch(*stage, {torch::randn({3, 4}, torch::kFloat64)}, false, false, &live);
  // Count the runs of exp's backward node (on the input's path only).
  struct Count : torch::autograd::FunctionPreHook {
    explicit Count(int* n) : n(n) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& g) override {
      ++*n;
      return g;
    }
    int* n;
  };
  int exp_runs = 0;
  torch::autograd::Node* node = out.toTensor().grad_fn().get();
  while (node->name() != "ExpBackward0") {
    // Down the first edge that leads on (the matmul's input path).
    const torch::autograd::Node* next = nullptr;
    for (const auto& e : node->next_edges()) {
      if (e.function && e.function->name() != "torch::autograd::AccumulateGrad" && e.function->name() != "TBackward0") {
        next = e.function.get();
        break;
      }
    }
    ASSERT_NE(next, nullptr) << "no ExpBackward0 below " << node->name();
    node = const_cast<torch::autograd::Node*>(next);
  }
  node->add_pre_hook(std::make_unique<Count>(&exp_runs));
  auto i = pipeline::detail::backward_input(*stage, std::move(live), torch::ones({3, 4}, torch::kFloat64), false, false,
                                            false);
  EXPECT_EQ(exp_runs, 1);
  ASSERT_TRUE(pipeline::detail::split(*i.work));
  const auto grads = pipeline::detail::backward_weight(*stage, std::move(i.work));
  EXPECT_EQ(exp_runs, 1);  // W did not go down the input's path
  for (const auto& g : grads) EXPECT_TRUE(g.defined());
}

}  // namespace
}  // namespace tandem::test
