// DDP scenarios every rank runs. The equivalence scenarios train a DDP model on W ranks with batch b each and, in the
// same process, a reference model on one process with batch W·b (same initial parameters: rank 0's; same data), and
// compare the parameters after every run.
#include "tests/ddp/scenarios.h"

#include <torch/torch.h>
#include <unistd.h>

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/process_group.h"
#include "ddp/ddp.h"
#include "ddp/zero.h"
#include "dist_autograd/dist_autograd.h"
#include "dist_optim/dist_optim.h"
#include "rref/rref.h"
#include "rpc/errors.h"
#include "rpc/registry.h"
#include "rpc/rpc.h"
#include "tests/common/scenario.h"

namespace tandem::test {
namespace {

constexpr int64_t kBatch = 4, kIn = 8, kHidden = 16, kOut = 4;

struct Net : torch::nn::Module {
  Net(bool with_side, bool with_unused, int64_t hidden = kHidden) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, kOut));
    if (with_side) side = register_module("side", torch::nn::Linear(hidden, kOut));
    if (with_unused) unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  at::Tensor forward(const at::Tensor& x, bool use_side = false) {
    auto h = torch::tanh(fc1(x));
    auto y = fc2(h);
    if (use_side) y = y + side(h);
    return y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, side{nullptr}, unused{nullptr};
};

// The whole batch of one (micro-)step: W·b rows; rank r trains on rows [r·b, (r+1)·b).
std::pair<at::Tensor, at::Tensor> data(int64_t step, int world) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  return {at::randn({world * kBatch, kIn}, gen), at::randn({world * kBatch, kOut}, gen)};
}
at::Tensor rows(const at::Tensor& t, int rank) { return t.narrow(0, rank * kBatch, kBatch); }

double max_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  double d = 0;
  for (size_t i = 0; i < pa.size(); ++i) d = std::max(d, (pa[i] - pb[i]).abs().max().item<double>());
  return d;
}

// Variants: "plain", "copy" (gradient_as_bucket_view off), "default_buckets", "no_sync", "unused", "fp16", "bf16",
// "uneven", "zero".
std::string equivalence(const std::string& variant) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  const bool side = variant == "unused";
  ddp::DdpOptions options;
  if (variant != "default_buckets") {
    options.first_bucket_bytes = 256;  // several buckets, so order, launch and rebuild matter
    options.bucket_cap_bytes = 512;
  }
  options.gradient_as_bucket_view = variant != "copy";
  options.find_unused_parameters = side;
  options.uneven_inputs = variant == "uneven";
  const int micro = variant == "no_sync" ? 3 : 1;
  const double tolerance = variant == "fp16" ? 5e-3 : variant == "bf16" ? 5e-2 : 1e-5;

  torch::manual_seed(100 + rank);  // different on every rank: construction must broadcast rank 0's
  auto model = std::make_shared<Net>(side, side);
  torch::manual_seed(100);
  auto ref = std::make_shared<Net>(side, side);

  auto pg = comm::ProcessGroup::create("ddp_" + variant);
  ddp::DistributedDataParallel<Net> ddp(model, pg, options);
  if (variant == "fp16") ddp.register_comm_hook(ddp::fp16_compress_hook());
  if (variant == "bf16") ddp.register_comm_hook(ddp::bf16_compress_hook());
  if (max_diff(*model, *ref) != 0) return "construction did not give every rank rank 0's parameters";

  std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;
  std::optional<ddp::ZeroRedundancyOptimizer> zero;
  if (variant == "zero") {
    zero.emplace(model->parameters(), pg, [](std::vector<at::Tensor> shard) {
      return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.01));
    });
    if (zero->shard().empty() || zero->shard().size() == model->parameters().size()) return "ZeRO did not shard";
    ref_opt = std::make_unique<torch::optim::Adam>(ref->parameters(), torch::optim::AdamOptions(0.01));
  } else {
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ref_opt = std::make_unique<torch::optim::SGD>(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  }

  // Uneven inputs: rank r has 3 + r steps; gradients are averaged over the whole group (joined ranks add zeros).
  const int mine = variant == "uneven" ? 3 + rank : 5;
  const int steps = variant == "uneven" ? 3 + world - 1 : 5;
  for (int step = 0; step < steps; ++step) {
    const bool use_side = side && step % 2 == 0;  // the side branch is used on even steps only
    if (step < mine) {
      zero ? zero->zero_grad() : opt->zero_grad();
      for (int k = 0; k < micro; ++k) {
        auto [x, y] = data(step * micro + k, world);
        std::optional<ddp::DistributedDataParallelBase::NoSync> no_sync;
        if (k + 1 < micro) no_sync.emplace(ddp);
        torch::mse_loss(ddp.forward(rows(x, rank), use_side), rows(y, rank)).backward();
      }
      if (zero) zero->step(); else opt->step();
    }
    ref_opt->zero_grad();
    for (int k = 0; k < micro; ++k) {
      auto [x, y] = data(step * micro + k, world);
      at::Tensor loss;
      if (variant == "uneven") {
        loss = at::zeros({});
        for (int r = 0; r < world; ++r) {
          if (step < 3 + r) loss = loss + torch::mse_loss(ref->forward(rows(x, r)), rows(y, r)) / world;
        }
      } else {
        loss = torch::mse_loss(ref->forward(x, use_side), y);
      }
      loss.backward();
    }
    ref_opt->step();
  }
  if (variant == "uneven") ddp.join();
  const double d = max_diff(*model, *ref);
  if (!(d <= tolerance)) return absl::StrCat(variant, ": parameters differ from one process by ", d, " (tolerance ", tolerance, ")");
  if (variant == "unused" && model->unused->weight.grad().defined()) return "a parameter no rank used got a gradient";
  if (variant == "plain") {
    auto g = model->fc1->weight.grad();  // shares its bucket with fc1.bias: the storage is larger than the gradient
    if (g.storage().nbytes() <= g.nbytes()) return "with gradient_as_bucket_view, .grad is not a view into a bucket";
  }
  if (variant == "plain" && (!ddp.stats().rebuilt || ddp.stats().bucket_bytes.size() < 2)) return "buckets were not rebuilt";
  return "";
}

std::string run(const std::string& name) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  if (absl::StartsWith(name, "equivalence/")) return equivalence(name.substr(12));
  if (name == "hybrid") {
    // DDP over ranks 0 and 1 combined with the RPC path: the forward calls rank 2 (tanh there) under distributed
    // autograd; reduce_context_gradients averages the context's gradients; DistributedOptimizer steps them. The
    // trainers follow one process with both batches.
    if (rank == 2) return "";
    torch::manual_seed(100 + rank);
    auto model = std::make_shared<Net>(false, false);
    torch::manual_seed(100);
    auto ref = std::make_shared<Net>(false, false);
    auto pg = comm::ProcessGroup::create("hybrid", {0, 1});
    ddp::DistributedDataParallel<Net> ddp(model, pg);
    std::vector<rref::RRef> handles;
    for (const auto& p : model->parameters()) handles.push_back(rref::make_local(p));
    dist_optim::DistributedOptimizer opt("sgd", handles, {{"lr", 0.1}});
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = data(step, 2);
      {
        dist_autograd::ContextGuard ctx;
        at::Tensor out = rpc::rpc_sync<at::Tensor>(2, "ddp_remote_tanh", ddp.forward(rows(x, rank)));
        dist_autograd::backward(ctx.id(), {torch::mse_loss(out, rows(y, rank))});
        ddp.reduce_context_gradients(ctx.id());
        opt.step(ctx.id());
      }
      ref_opt.zero_grad();
      torch::mse_loss(torch::tanh(ref->forward(x)), y).backward();
      ref_opt.step();
    }
    const double d = max_diff(*model, *ref);
    if (!(d <= 1e-5)) return absl::StrCat("hybrid: parameters differ from one process by ", d);
    return "";
  }
  if (name == "buckets") {
    // Reverse registration order, the first bucket capped at first_bucket_bytes; rebuilt after one iteration.
    auto model = std::make_shared<Net>(false, false);  // fc1: 576 + 64 bytes, fc2: 256 + 16 bytes
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("buckets"),
                                          {.bucket_cap_bytes = 600, .first_bucket_bytes = 200});
    std::string err;
    auto s = ddp.stats();
    // Reverse order: fc2.bias (16), fc2.weight (256) -> first bucket (272 >= 200); fc1.bias (64), fc1.weight (512).
    if (s.bucket_bytes != std::vector<size_t>{272, 576}) err += "initial buckets; ";
    torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
    ddp.forward(at::ones({2, kIn}));
    if (!ddp.stats().rebuilt || ddp.stats().iterations != 1) err += "not rebuilt after the first iteration; ";
    return err;
  }
  if (name == "missing_gradient") {
    // Without find_unused_parameters, a parameter without gradient is an error naming it; the next iteration works.
    auto model = std::make_shared<Net>(true, false);
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("missing"));
    std::string err;
    try {
      torch::mse_loss(ddp.forward(at::ones({2, kIn}), false), at::zeros({2, kOut})).backward();
      err += "backward without the side branch succeeded; ";
    } catch (const std::exception& e) {
      const std::string m = e.what();
      if (m.find("side.weight") == std::string::npos || m.find("find_unused_parameters") == std::string::npos) {
        err += "error does not name the parameter and the option: " + m + "; ";
      }
    }
    torch::mse_loss(ddp.forward(at::ones({2, kIn}), true), at::zeros({2, kOut})).backward();
    return err;
  }
  if (name == "shape_mismatch") {
    auto model = std::make_shared<Net>(false, false, rank == 1 ? kHidden + 1 : kHidden);
    try {
      ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("shapes"));
      return "construction with different models succeeded";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (m.find("rank 1 of process group 'shapes'") == std::string::npos) return "error does not name rank 1: " + m;
    }
    return "";
  }
  if (name == "buffers") {
    // Buffers (batch-norm statistics, updated differently on every rank) are rank 0's after each pre-forward.
    struct BnNet : torch::nn::Module {
      BnNet() {
        fc = register_module("fc", torch::nn::Linear(kIn, kOut));
        bn = register_module("bn", torch::nn::BatchNorm1d(kOut));
      }
      at::Tensor forward(const at::Tensor& x) { return bn(fc(x)); }
      torch::nn::Linear fc{nullptr};
      torch::nn::BatchNorm1d bn{nullptr};
    };
    auto model = std::make_shared<BnNet>();
    auto pg = comm::ProcessGroup::create("buffers");
    ddp::DistributedDataParallel<BnNet> ddp(model, pg);
    torch::mse_loss(ddp.forward(at::randn({4, kIn}) + rank), at::zeros({4, kOut})).backward();
    ddp.pre_forward();
    auto mean = model->bn->running_mean.clone();
    auto all = at::empty({world * kOut});
    comm::wait(pg->allgather(all, mean));
    if (!all.view({world, kOut}).eq(all.view({world, kOut})[0]).all().item<bool>()) return "buffers differ after pre_forward";
    if (mean.abs().sum().item<double>() == 0) return "running statistics never updated";
    return "";
  }
  if (name == "dead_rank") {
    // The last rank dies between iterations: the next iteration fails on the others within the group's timeout, naming
    // the group and the collective (the rebuild's broadcast in forward, or a bucket's allreduce in backward).
    auto model = std::make_shared<Net>(false, false);
    auto pg = comm::ProcessGroup::create("ddp_dead", {}, {.timeout = std::chrono::milliseconds(3000)});
    ddp::DistributedDataParallel<Net> ddp(model, pg);
    torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
    if (rank == world - 1) _exit(9);
    try {
      torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
      return "an iteration succeeded without the dead rank";
    } catch (const std::exception& e) {
      const std::string m = e.what();
      if (m.find("process group 'ddp_dead'") == std::string::npos ||
          (m.find("allreduce") == std::string::npos && m.find("broadcast") == std::string::npos)) {
        return "error does not name the group and the operation: " + m;
      }
    }
    return "";
  }
  return "unknown scenario " + name;
}

}  // namespace

void register_scenarios() {
  register_scenario_runner(run);
  rpc::register_function("ddp_remote_tanh", [](at::Tensor x) { return torch::tanh(x); });
}

}  // namespace tandem::test
