// bench/run.sh fsdp — Tandem's side, one configuration per run (--mode), two ranks (tandem-run --nproc-per-node 2),
// one intra-op thread each. Model: the DDP benchmark's MLP 1024-2048-2048-1024 with ReLU (8.4 M parameters, 3 units
// of 8, 16 and 8 MiB), MSE loss, Adam; batch 64 per rank. One iteration: zero_grad, forward, backward, step.
//   fsdp_iter_ms        median iteration on rank 0
//   fsdp_peak_mib       rank 0's peak resident memory over the timed iterations above its resident memory before the
//                       model was built (VmHWM, reset through /proc/self/clear_refs), beside
//                       model_state_mib: what the configuration holds by the formula (P parameters, 4 bytes each:
//                       parameters 4P, gradients 4P, Adam's moments 8P; ZeRO-2 shards the last two, fully sharded
//                       all three) and bar_mib for the fully sharded one: DDP's model state / W + the largest unit,
//                       + 10% (issue 30)
// Modes: ddp (DistributedDataParallel, 25 MiB buckets), zero2 (fsdp::Sharding::kGradientsAndOptimizer), full
// (fsdp::Sharding::kFull, reshard_after_forward). Flags: --mode, --iters N (timed, after 3 warm-up).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <fstream>
#include <memory>
#include <string>

#include "bench/common.h"
#include "bench/mlp.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/fsdp/fsdp.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace bench = tandem::bench;
namespace comm = tandem::comm;
namespace rpc = tandem::rpc;

namespace {

// A field of /proc/self/status, in KiB.
int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  std::string mode = "full";
  CLI::App app{"Per-rank peak memory and iteration time: DDP, ZeRO-2, fully sharded", "fsdp_bench"};
  app.add_option("--mode", mode, "ddp, zero2 or full")->check(CLI::IsMember({"ddp", "zero2", "full"}));
  app.add_option("--iters", iters, "timed iterations, after 3 warm-up");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  rpc::init_rpc();
  auto pg = comm::ProcessGroup::create("fsdp_bench", {}, {.timeout = std::chrono::minutes(5)});
  const int world = pg->size();
  const at::Tensor x = at::randn({64, 1024}), y = at::randn({64, 1024});
  const int64_t before_kib = status_kib("VmRSS");
  auto model = bench::ddp_mlp();
  int64_t params = 0, largest = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  for (const auto& child : model->children()) {
    int64_t n = 0;
    for (const auto& p : child->parameters()) n += p.numel();
    largest = std::max(largest, n);
  }
  std::unique_ptr<tandem::ddp::DistributedDataParallel<torch::nn::SequentialImpl>> ddp;
  std::unique_ptr<tandem::fsdp::FullyShardedDataParallel> fsdp;
  std::vector<at::Tensor> trained;
  if (mode == "ddp") {
    ddp = std::make_unique<tandem::ddp::DistributedDataParallel<torch::nn::SequentialImpl>>(model.ptr(), pg);
    trained = model->parameters();
  } else {
    tandem::fsdp::FsdpOptions options;
    if (mode == "zero2") options.sharding = tandem::fsdp::Sharding::kGradientsAndOptimizer;
    fsdp = std::make_unique<tandem::fsdp::FullyShardedDataParallel>(model, pg, options);
    trained = fsdp->parameters();
  }
  torch::optim::Adam opt(trained, torch::optim::AdamOptions(1e-4));
  auto step = [&] {
    opt.zero_grad();
    at::mse_loss(ddp ? ddp->forward(x) : fsdp->forward(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 3; ++i) step();
  std::ofstream("/proc/self/clear_refs") << "5" << std::flush;  // VmHWM := VmRSS
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const double t0 = bench::now_us();
    step();
    t.push_back((bench::now_us() - t0) / 1e3);
  }
  const double peak_mib = static_cast<double>(status_kib("VmHWM") - before_kib) / 1024;
  comm::wait(pg->barrier());
  if (pg->rank() == 0) {
    const double mib = 4.0 / (1 << 20), p = static_cast<double>(params);
    const double state = mode == "ddp"     ? 4 * p * mib
                         : mode == "zero2" ? (p + 3 * p / world) * mib
                                           : 4 * p / world * mib;
    const double bar = (4 * p / world + static_cast<double>(largest)) * mib * 1.1;
    const std::string cond =
        "\"processes\":" + std::to_string(world) +
        ",\"intra_op_threads\":1,\"model\":\"mlp1024-2048-2048-1024\",\"params\":" + std::to_string(params) +
        ",\"optimizer\":\"adam\",\"batch_per_rank\":64,\"mode\":\"" + mode + "\",\"iters\":" + std::to_string(iters);
    bench::emit("fsdp", "fsdp_iter_ms", bench::median(t), "ms", cond);
    bench::emit("fsdp", "fsdp_peak_mib", peak_mib, "MiB",
                cond + ",\"model_state_mib\":" + std::to_string(state) +
                    (mode == "full" ? ",\"bar_mib\":" + std::to_string(bar) : std::string()));
  }
  rpc::shutdown();
  return 0;
}
