// Fully sharded scenarios. The equivalence scenario trains the sharded model on W ranks, each on its own rows, and in
// the same process a reference model that computes what the ranks compute, one rank after another, with the average
// of their losses; after every step every gathered parameter must equal the reference's.
#include "tests/fsdp/scenarios.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "tandem/comm/process_group.h"
#include "tandem/fsdp/fsdp.h"
#include "tandem/rpc/rpc.h"
#include "tests/common/scenario.h"

namespace tandem::test {
namespace {

constexpr int64_t kRows = 3, kIn = 7, kHidden = 13, kOut = 3;

// A unit with a parameter used only when asked (on rank 0 in the scenario) and one never used.
struct PartialImpl : torch::nn::Module {
  PartialImpl() {
    used = register_module("used", torch::nn::Linear(kHidden, kHidden));
    sometimes = register_module("sometimes", torch::nn::Linear(kHidden, kHidden));
    never = register_module("never", torch::nn::Linear(2, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return use_sometimes ? used(x) + sometimes(x) : used(x); }
  torch::nn::Linear used{nullptr}, sometimes{nullptr}, never{nullptr};
  bool use_sometimes = false;
};
TORCH_MODULE(Partial);

// A nested unit: a Sequential inside (a Sequential cannot hold one directly).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    layers = register_module("layers", torch::nn::Sequential(torch::nn::Linear(kHidden, 11), torch::nn::Tanh(),
                                                             torch::nn::Linear(11, kHidden)));
  }
  at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(Block);

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential seq(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), Block(), Partial(), torch::nn::ReLU(),
                            torch::nn::Linear(kHidden, kOut));
  seq->to(at::kDouble);
  return seq;
}

std::pair<at::Tensor, at::Tensor> data(int64_t step, int world) {
  auto gen = at::detail::createCPUGenerator(100 + step);
  return {at::randn({world * kRows, kIn}, gen).to(at::kDouble), at::randn({world * kRows, kOut}, gen).to(at::kDouble)};
}

// Rank r's loss on its rows (rank 0 uses Partial's second layer).
at::Tensor rank_loss(const std::function<at::Tensor(const at::Tensor&)>& forward, torch::nn::Sequential& seq, int r,
                     const at::Tensor& x, const at::Tensor& y) {
  seq->ptr<PartialImpl>(3)->use_sometimes = r == 0;
  return torch::mse_loss(forward(x.narrow(0, r * kRows, kRows)), y.narrow(0, r * kRows, kRows));
}

std::string equivalence(const std::string& variant) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  auto group = comm::ProcessGroup::create("fsdp_" + variant);
  fsdp::FsdpOptions options;
  options.reshard_after_forward = variant != "keep";
  options.prefetch = variant != "no_prefetch";
  torch::nn::Sequential sharded_model = make_model();
  fsdp::FullyShardedDataParallel model(sharded_model, group, options);
  torch::nn::Sequential ref = make_model();
  // Adam, and SGD, which (unlike Adam) would also show a gradient off by a factor.
  auto make_opt = [&](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (variant == "sgd")
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  };
  auto opt_ptr = make_opt(model.parameters()), ref_opt_ptr = make_opt(ref->parameters());
  torch::optim::Optimizer &opt = *opt_ptr, &ref_opt = *ref_opt_ptr;
  // Between uses the model's parameters hold no memory; with reshard_after_forward, not even between a forward and
  // its backward.
  auto held = [&] {
    int64_t bytes = 0;
    for (const auto& p : sharded_model->parameters()) bytes += static_cast<int64_t>(p.storage().nbytes());
    return bytes;
  };
  if (held() != 0) return absl::StrCat("after construction the parameters hold ", held(), " bytes");
  const int micro = variant == "no_sync" ? 3 : 1;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    for (int k = 0; k < micro; ++k) {
      auto [x, y] = data(step * micro + k, world);
      model.set_requires_gradient_sync(k == micro - 1);
      at::Tensor loss = rank_loss([&](const at::Tensor& in) { return model.forward(in); }, sharded_model, rank, x, y);
      if ((held() == 0) != options.reshard_after_forward) {
        return absl::StrCat("after forward the parameters hold ", held(), " bytes");
      }
      loss.backward();
      if (held() != 0) return absl::StrCat("after backward the parameters hold ", held(), " bytes");
      at::Tensor total = at::zeros({}, at::kDouble);
      for (int r = 0; r < world; ++r) {
        total = total + rank_loss([&](const at::Tensor& in) { return ref->forward(in); }, ref, r, x, y);
      }
      (total / world).backward();
    }
    opt.step();
    ref_opt.step();
    const auto gathered = model.full_parameters();
    const auto expected = ref->named_parameters();
    if (gathered.size() != expected.size()) {
      return absl::StrCat("gathered ", gathered.size(), " parameters, the model has ", expected.size());
    }
    for (size_t i = 0; i < gathered.size(); ++i) {
      const auto& [name, value] = gathered[i];
      if (name != expected[i].key())
        return absl::StrCat("parameter ", i, " is '", name, "', not '", expected[i].key(), "'");
      const double diff = (value - expected[i].value()).abs().max().item<double>();
      if (!(diff <= 1e-10)) return absl::StrCat("step ", step, ": ", name, " differs by ", diff);
    }
  }
  const auto stats = model.stats();
  if (stats.units != 4) return absl::StrCat("units: ", stats.units);
  return "";
}

std::string run(const std::string& name) {
  if (name.rfind("equivalence/", 0) == 0) return equivalence(name.substr(12));
  return "unknown scenario " + name;
}

}  // namespace

void register_fsdp_scenarios() { register_scenario_runner(run); }

}  // namespace tandem::test
