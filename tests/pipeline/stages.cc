#include "tests/pipeline/stages.h"

#include <unistd.h>

#include "dist_autograd/dist_autograd.h"
#include "nn/remote_module.h"
#include "pipeline/pipeline.h"
#include "rpc/registry.h"

namespace tandem::test {

torch::nn::Sequential make_pipe_mlp(int64_t layers, int64_t width, int64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  for (int64_t i = 0; i < layers; ++i) {
    m->push_back(torch::nn::Linear(width, width));
    m->push_back(torch::nn::Tanh());
  }
  m->to(torch::kDouble);
  return m;
}

namespace {

std::vector<at::Tensor> stage_params(int64_t pipe, int64_t stage) {
  auto m = pipeline::local_stage(pipe, static_cast<int>(stage));
  if (!m) throw std::invalid_argument("no such stage here");
  return m->parameters();
}

// An identity layer that fails on a marked row (first value 999): throws (mode 1) or dies (mode 2).
struct Faulty : torch::nn::Module {
  explicit Faulty(int64_t mode) : mode(mode) {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    lin->to(torch::kDouble);
    torch::NoGradGuard no_grad;
    lin->weight.copy_(torch::eye(4, torch::kDouble));
    lin->bias.zero_();
  }
  at::Tensor forward(const at::Tensor& x) {
    if (mode != 0 && x.select(1, 0).eq(999).any().item<bool>()) {
      if (mode == 2) _exit(9);
      throw std::runtime_error("a marked row reached the faulty stage");
    }
    return lin->forward(x);
  }
  int64_t mode;
  torch::nn::Linear lin{nullptr};
};

}  // namespace

void register_pipeline_stages() {
  nn::register_module("pipe_mlp", make_pipe_mlp);
  nn::register_module("pipe_linear", [](int64_t in, int64_t out) {
    torch::nn::Linear l(in, out);
    l->to(torch::kDouble);
    return l;
  });
  nn::register_module("pipe_faulty", [](int64_t mode) { return std::make_shared<Faulty>(mode); });
  rpc::register_function("pipe_grads", [](int64_t pipe, int64_t stage, int64_t context) {
    const auto grads = dist_autograd::get_gradients(context);
    std::vector<at::Tensor> out;
    for (const auto& p : stage_params(pipe, stage)) out.push_back(grads.contains(p) ? grads[p] : at::zeros_like(p));
    return out;
  });
  rpc::register_function("pipe_dot_grads", [](int64_t pipe, int64_t stage) {
    std::vector<at::Tensor> out;
    for (const auto& p : stage_params(pipe, stage)) out.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
    return out;
  });
  rpc::register_function("pipe_params", [](int64_t pipe, int64_t stage) {
    std::vector<at::Tensor> out;
    for (const auto& p : stage_params(pipe, stage)) out.push_back(p.detach().clone());
    return out;
  });
}

}  // namespace tandem::test
