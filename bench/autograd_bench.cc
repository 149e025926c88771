// bench/run.sh autograd — Tandem's side. Two workers (tandem-run --nproc-per-node 2); rank 0 drives.
// Model: Linear(d, d) on worker 0, Linear(d, d) and the loss (mean of squares) on worker 1. One iteration: forward
// (local layer, then an RPC to worker 1 that returns the loss), distributed backward, DistributedOptimizer step (SGD
// over the four parameters, each on its owner), context released.
//   dist_autograd_small_iter_us  d = 64, batch 8: median time per iteration
//   dist_autograd_overhead_ms    d = 1024, batch 64: median distributed iteration minus median local iteration (the
//                                same model, loss.backward() and torch::optim::SGD in one process), interleaved
// Flags: --small N, --large N (iterations).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <string>

#include "bench/common.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/rref/rref.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace rref = tandem::rref;
namespace bench = tandem::bench;
namespace dist_autograd = tandem::dist_autograd;

namespace {

struct Layer {
  at::Tensor w, b;
};

Layer make_layer(int64_t d) {
  return {(at::randn({d, d}) / std::sqrt(static_cast<double>(d))).set_requires_grad(true),
          at::zeros({d}).set_requires_grad(true)};
}

Layer g_remote;  // worker 1's layer

// Times `iters` distributed iterations (after a tenth as warm-up); with `local`, each one is followed by an iteration
// of the same model in this process (interleaved, so both see the same machine: this VM's speed drifts between runs).
void run(int64_t d, int64_t batch, int iters, std::vector<double>* dist, std::vector<double>* local) {
  Layer mine = make_layer(d);
  rpc::rpc_sync(1, "make_layer", d);
  std::vector<rref::RRef> params = {rref::make_local(mine.w), rref::make_local(mine.b)};
  for (const auto& r : rpc::rpc_sync<std::vector<c10::IValue>>(1, "layer_params")) {
    params.push_back(rref::RRef::from_ivalue(r));
  }
  tandem::dist_optim::DistributedOptimizer opt("sgd", params, {{"lr", 0.01}});
  Layer a = make_layer(d), b = make_layer(d);
  torch::optim::SGD local_opt({a.w, a.b, b.w, b.b}, torch::optim::SGDOptions(0.01));
  const at::Tensor x = at::randn({batch, d});
  for (int i = 0; i < iters + iters / 10; ++i) {
    const bool timed = i >= iters / 10;
    double t0 = bench::now_us();
    {
      dist_autograd::ContextGuard ctx;
      at::Tensor h = at::linear(x, mine.w, mine.b);
      at::Tensor loss = rpc::rpc_sync<at::Tensor>(1, "forward_loss", h);
      dist_autograd::backward(ctx.id(), {loss});
      opt.step(ctx.id());
    }
    if (timed) dist->push_back(bench::now_us() - t0);
    if (!local) continue;
    t0 = bench::now_us();
    local_opt.zero_grad();
    at::linear(at::linear(x, a.w, a.b), b.w, b.b).pow(2).mean().backward();
    local_opt.step();
    if (timed) local->push_back(bench::now_us() - t0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int small = 3000, large = 200;
  CLI::App app{
      "Distributed autograd's overhead against local autograd (small and large models), with PyTorch's in "
      "bench/peer_autograd.py",
      "autograd_bench"};
  app.add_option("--small", small, "iterations of the small model");
  app.add_option("--large", large, "iterations of the large model");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  rpc::register_function("make_layer", [](int64_t d) { g_remote = make_layer(d); });
  rpc::register_function("layer_params", [] {
    return std::vector<c10::IValue>{rref::make_local(g_remote.w).to_ivalue(), rref::make_local(g_remote.b).to_ivalue()};
  });
  rpc::register_function("forward_loss",
                         [](at::Tensor h) { return at::linear(h, g_remote.w, g_remote.b).pow(2).mean(); });
  rpc::init_rpc();
  if (rpc::get_worker_info().id == 0) {
    const std::string cond = "\"processes\":2,\"intra_op_threads\":1";
    std::vector<double> small_t, dist_t, local_t;
    run(64, 8, small, &small_t, nullptr);
    bench::emit("autograd", "dist_autograd_small_iter_us", bench::median(small_t), "us",
                cond + ",\"d\":64,\"batch\":8,\"iters\":" + std::to_string(small));
    run(1024, 64, large, &dist_t, &local_t);
    const double dist_ms = bench::median(dist_t) / 1000, local_ms = bench::median(local_t) / 1000;
    bench::emit("autograd", "dist_autograd_overhead_ms", dist_ms - local_ms, "ms",
                cond + ",\"d\":1024,\"batch\":64,\"iters\":" + std::to_string(large) +
                    ",\"dist_iter_ms\":" + std::to_string(dist_ms) + ",\"local_iter_ms\":" + std::to_string(local_ms));
  }
  rpc::shutdown();
  return 0;
}
