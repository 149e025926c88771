// bench/run.sh ddp — Tandem's side. Two ranks (tandem-run --nproc-per-node 2), one intra-op thread each.
// Model: MLP 1024-2048-2048-1024 with ReLU (8.4 M parameters), MSE loss, SGD; batch 64 per rank. One iteration:
// zero_grad, forward, backward (gradients averaged across the ranks, overlapped with backward), step.
//   local_iter_ms   the same iteration in one process (rank 0 alone, rank 1 waiting): the weak-scaling baseline
//   ddp_iter_ms, impl "floor": every rank runs its local iteration at the same time, with no communication (rank 0's
//                   median): what a DDP iteration cannot beat on this machine. weak_scaling_limit = local / that.
//   ddp_iter_ms     median iteration on rank 0, for bucket caps 25 MiB (the default, reported first), then 1, 5, 100
//                   and 1000 MiB (the last layer's 8 MiB, then everything at the end of backward: the least overlap),
//                   with Tandem's default gradient_as_bucket_view = true; 25 MiB also with it false (PyTorch's default)
//                   and with shared_buckets = false (plain buckets, copied into the group's segment and out);
//                   per_iter_ms: means per timed iteration of rank 0's CPU time on the thread that runs the
//                   iteration, its time runnable but waiting for a CPU, and the CPU time of the process's other
//                   threads (the group's thread reducing the buckets), from /proc/self/task/*/schedstat
// Flags: --iters N (timed iterations per configuration, after 3 warm-up), --sweep 0|1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <string>

#include "bench/common.h"
#include "bench/mlp.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace bench = tandem::bench;
namespace comm = tandem::comm;
namespace ddp = tandem::ddp;
namespace rpc = tandem::rpc;

namespace {

// Median milliseconds of `iters` iterations of `step` (after 3 warm-up ones); `times`, when given, gets what the
// process's threads did per timed iteration (means).
template <typename Step>
double time_iters(int iters, Step step, bench::ThreadTimes* times = nullptr) {
  std::vector<double> t;
  bench::ThreadTimes before;
  for (int i = 0; i < iters + 3; ++i) {
    if (i == 3) before = bench::thread_times();
    const double t0 = bench::now_us();
    step();
    if (i >= 3) t.push_back((bench::now_us() - t0) / 1e3);
  }
  if (times) {
    const bench::ThreadTimes after = bench::thread_times();
    times->self_run_ms = (after.self_run_ms - before.self_run_ms) / iters;
    times->self_wait_ms = (after.self_wait_ms - before.self_wait_ms) / iters;
    times->others_run_ms = (after.others_run_ms - before.others_run_ms) / iters;
  }
  return bench::median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30, sweep = 1;
  CLI::App app{"DDP's iteration time and weak scaling on an MLP (1024-2048-2048-1024, 8.4 M parameters)", "ddp_bench"};
  app.add_option("--iters", iters, "timed iterations per configuration, after 3 warm-up");
  app.add_option("--sweep", sweep, "1: also the bucket-size configurations (1, 5, 100, 1000 MiB)");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  rpc::init_rpc();
  auto pg = comm::ProcessGroup::create("ddp_bench", {}, {.timeout = std::chrono::minutes(5)});
  const bool report = pg->rank() == 0;
  const std::string cond = "\"processes\":" + std::to_string(pg->size()) +
                           ",\"intra_op_threads\":1,\"model\":\"mlp1024-2048-2048-1024\",\"params\":" +
                           std::to_string(bench::kDdpMlpParams) + ",\"batch_per_rank\":64,\"iters\":" +
                           std::to_string(iters);
  const at::Tensor x = at::randn({64, 1024}), y = at::randn({64, 1024});

  double local_ms = 0;
  if (report) {
    auto model = bench::ddp_mlp();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
    local_ms = time_iters(iters, [&] {
      opt.zero_grad();
      at::mse_loss(model->forward(x), y).backward();
      opt.step();
    });
    bench::emit("ddp", "local_iter_ms", local_ms, "ms", cond + ",\"processes_running\":1");
  }
  comm::wait(pg->barrier());
  {
    // The limit of a DDP iteration on this machine: every rank's local iteration at once, with no communication. The
    // ranks share the machine's cores, caches and memory bandwidth, so this can be slower than one process alone.
    auto model = bench::ddp_mlp();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
    bench::ThreadTimes times;
    const double together_ms = time_iters(
        iters,
        [&] {
          opt.zero_grad();
          at::mse_loss(model->forward(x), y).backward();
          opt.step();
        },
        &times);
    if (report) {
      bench::emit_floor("ddp", "ddp_iter_ms", together_ms, "ms",
                        cond + ",\"processes_running\":" + std::to_string(pg->size()) +
                            ",\"what\":\"every rank's local iteration at the same time, no communication\","
                            "\"weak_scaling_limit\":" +
                            std::to_string(local_ms / together_ms) +
                            ",\"per_iter_ms\":{\"compute_thread_cpu\":" + std::to_string(times.self_run_ms) +
                            ",\"compute_thread_waiting_for_cpu\":" + std::to_string(times.self_wait_ms) + "}");
    }
  }
  comm::wait(pg->barrier());

  struct Config {
    int cap_mib;
    bool view, shared;  // gradient_as_bucket_view, shared_buckets
  };
  std::vector<Config> configs = {{25, true, true}, {25, false, true}, {25, true, false}};
  if (sweep) configs.insert(configs.end(), {{1, true, true}, {5, true, true}, {100, true, true}, {1000, true, true}});
  for (auto [cap, view, shared] : configs) {
    auto model = bench::ddp_mlp();
    ddp::DistributedDataParallel<torch::nn::SequentialImpl> net(model.ptr(), pg,
                                                                {.bucket_cap_bytes = static_cast<size_t>(cap) << 20,
                                                                 .gradient_as_bucket_view = view,
                                                                 .shared_buckets = shared});
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
    bench::ThreadTimes times;
    const double ms = time_iters(
        iters,
        [&] {
          opt.zero_grad();
          at::mse_loss(net.forward(x), y).backward();
          opt.step();
        },
        &times);
    if (report) {
      // Plain buckets under an impl of their own, so that bench/summarize.py keeps them apart from the default.
      bench::emit_as(shared ? "tandem" : "tandem_plain_buckets", "ddp", "ddp_iter_ms", ms, "ms",
                     cond + ",\"bucket_cap_mb\":" + std::to_string(cap) + ",\"gradient_as_bucket_view\":" +
                         (view ? "true" : "false") + ",\"shared_buckets\":" + (shared ? "true" : "false") +
                         ",\"buckets\":" + std::to_string(net.stats().bucket_bytes.size()) +
                         ",\"weak_scaling_efficiency\":" + std::to_string(local_ms / ms) +
                         ",\"per_iter_ms\":{\"compute_thread_cpu\":" + std::to_string(times.self_run_ms) +
                         ",\"compute_thread_waiting_for_cpu\":" + std::to_string(times.self_wait_ms) +
                         ",\"other_threads_cpu\":" + std::to_string(times.others_run_ms) + "}");
    }
    comm::wait(pg->barrier());
  }
  rpc::shutdown();
  return 0;
}
