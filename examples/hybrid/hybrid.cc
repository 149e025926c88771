#include "examples/hybrid/hybrid.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "tandem/ddp_dist_autograd/ddp_dist_autograd.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/rref/rref.h"

namespace tandem::examples::hybrid {

void register_modules() {
  nn::register_module(
      kEmbeddingBag,
      [](int64_t num, int64_t dim) {
        at::manual_seed(0);
        torch::nn::EmbeddingBag m(torch::nn::EmbeddingBagOptions(num, dim).mode(torch::kSum));
        at::NoGradGuard no_grad;
        m->weight.normal_(0, 0.05);  // a bag sums many rows: small ones keep the sum near unit scale
        return m;
      },
      [](torch::nn::EmbeddingBag& m, at::Tensor ids, at::Tensor offsets) { return m->forward(ids, offsets); });
}

torch::nn::Sequential dense(int64_t dim) {
  at::manual_seed(1);
  return torch::nn::Sequential(torch::nn::Linear(dim, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
}

Trainer::Trainer(nn::RemoteModule embedding, std::shared_ptr<comm::ProcessGroup> group, int64_t dim, double lr,
                 ddp::DdpOptions options)
    : embedding_(std::move(embedding)), dense_(dense(dim)) {
  ddp_ = std::make_unique<ddp::DistributedDataParallel<torch::nn::SequentialImpl>>(dense_.ptr(), std::move(group),
                                                                                   options);
  std::vector<rref::RRef> params = embedding_.remote_parameters();
  for (const auto& p : dense_->parameters()) params.push_back(rref::make_local(p));
  opt_ = std::make_unique<dist_optim::DistributedOptimizer>("sgd", params, std::map<std::string, double>{{"lr", lr}});
}

double Trainer::step(const at::Tensor& ids, const at::Tensor& offsets, const at::Tensor& target) {
  dist_autograd::ContextGuard ctx;
  at::Tensor emb = embedding_.forward(ids, offsets);
  at::Tensor loss = at::cross_entropy_loss(ddp_->forward(emb), target);
  dist_autograd::backward(ctx.id(), {loss});
  ddp::reduce_context_gradients(*ddp_, ctx.id());
  opt_->step(ctx.id());
  return loss.item<double>();
}

at::Tensor Trainer::predict(const at::Tensor& ids, const at::Tensor& offsets) {
  at::NoGradGuard no_grad;
  return dense_->forward(embedding_.forward(ids, offsets));
}

}  // namespace tandem::examples::hybrid
