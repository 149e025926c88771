// ChunkedAdam: see adam.h.
#include "tandem/optim/adam.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/string_utils.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

namespace tandem::optim {

namespace {

int64_t checked_chunk(int64_t chunk_elements) {
  TORCH_CHECK(chunk_elements > 0 && chunk_elements % 64 == 0,
              "ChunkedAdam: chunk_elements must be a positive multiple of 64, not ", chunk_elements);
  return chunk_elements;
}

// Whether a step can walk these tensors as flat arrays of the same layout (otherwise it takes them whole).
bool flat(const at::Tensor& p, std::initializer_list<const at::Tensor*> others) {
  if (!p.is_contiguous()) return false;
  for (const at::Tensor* t : others) {
    if (t->defined() && (!t->is_contiguous() || t->sizes() != p.sizes() || t->scalar_type() != p.scalar_type())) {
      return false;
    }
  }
  return true;
}

}  // namespace

ChunkedAdam::ChunkedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                         torch::optim::AdamOptions defaults, int64_t chunk_elements)
    : torch::optim::Adam(std::move(param_groups), defaults), chunk_(checked_chunk(chunk_elements)) {}

ChunkedAdam::ChunkedAdam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults, int64_t chunk_elements)
    : ChunkedAdam({torch::optim::OptimizerParamGroup(std::move(params))}, defaults, chunk_elements) {}

// torch::optim::Adam::step (LibTorch 1.13), each operation applied to one chunk of every tensor at a time, into
// chunk-sized temporaries taken once per parameter.
at::Tensor ChunkedAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor grad = p.grad();
      TORCH_CHECK(!grad.is_sparse(), "Adam does not support sparse gradients");
      const std::string key = c10::guts::to_string(p.unsafeGetTensorImpl());
      if (state_.find(key) == state_.end()) {
        auto fresh = std::make_unique<torch::optim::AdamParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        state_[key] = std::move(fresh);
      }
      auto& state = static_cast<torch::optim::AdamParamState&>(*state_[key]);
      state.step(state.step() + 1);
      const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
      const double bias_correction1 = 1 - std::pow(beta1, state.step());
      const double bias_correction2 = 1 - std::pow(beta2, state.step());
      const double step_size = options.lr() / bias_correction1;
      const double wd = options.weight_decay();
      const at::Tensor& max_sq = state.max_exp_avg_sq();

      // The whole tensors, or flat views of them walked a chunk at a time.
      const bool chunked = flat(p, {&grad, &state.exp_avg(), &state.exp_avg_sq(), &max_sq});
      const int64_t n = p.numel(), chunk = chunked ? std::min(chunk_, n) : n;
      auto whole = [&](const at::Tensor& t) { return chunked ? t.view({-1}) : t; };
      const at::Tensor P = whole(p.detach()), G = whole(grad), M = whole(state.exp_avg()),
                       V = whole(state.exp_avg_sq()), X = options.amsgrad() ? whole(max_sq) : at::Tensor();
      at::Tensor denom_buf = at::empty(chunked ? at::IntArrayRef{chunk} : p.sizes(), P.options());
      at::Tensor decayed_buf = wd != 0 ? at::empty_like(denom_buf) : at::Tensor();
      for (int64_t at_ = 0; at_ < (chunked ? n : 1); at_ += chunked ? chunk : 1) {  // once when whole
        const int64_t len = chunked ? std::min(chunk, n - at_) : 0;
        auto part = [&](const at::Tensor& t) { return chunked ? t.narrow(0, at_, len) : t; };
        auto scratch = [&](const at::Tensor& t) { return chunked ? t.narrow(0, 0, len) : t; };
        const at::Tensor pc = part(P), mc = part(M), vc = part(V);
        at::Tensor denom = scratch(denom_buf), g = part(G);
        if (wd != 0) {  // grad.add(p, weight_decay)
          at::Tensor decayed = scratch(decayed_buf);
          g = at::add_out(decayed, g, pc, wd);
        }
        mc.mul_(beta1).add_(g, 1 - beta1);
        vc.mul_(beta2).addcmul_(g, g, 1 - beta2);
        if (options.amsgrad()) {
          at::Tensor xc = part(X);
          at::max_out(xc, vc, xc);
          at::sqrt_out(denom, xc);
        } else {
          at::sqrt_out(denom, vc);
        }
        denom.div_(std::sqrt(bias_correction2)).add_(options.eps());
        pc.addcdiv_(mc, denom, -step_size);
      }
    }
  }
  return loss;
}

}  // namespace tandem::optim
