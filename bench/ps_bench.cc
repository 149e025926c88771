// bench/run.sh ps — Tandem's side: the parameter server of examples/parameter_server with the MLP 784-512-512-10,
// 2 trainers (tandem-run --nproc-per-node 3), batch 64, synchronous mode (both trainers step concurrently; the server
// averages their gradients each step), SGD. Random inputs (the figure is about the framework, not the data).
//   ps_steps_per_s  training steps per second summed over the trainers (each measures its own rate and reports it
//                   to the server, which prints the sum)
// Flags: --steps N (per trainer, after 10% warm-up).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "bench/common.h"
#include "dist_autograd/dist_autograd.h"
#include "examples/parameter_server/server.h"
#include "rpc/rpc.h"

namespace rpc = tandem::rpc;
namespace bench = tandem::bench;
namespace examples = tandem::examples;

namespace {
std::mutex g_mu;
double g_rate_sum = 0;  // the trainers' own rates, reported to the server
}  // namespace

int main(int argc, char** argv) {
  int steps = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--steps") steps = std::atoi(argv[i + 1]);
  }
  at::set_num_threads(1);
  examples::register_parameter_server();
  rpc::register_function("bench.rate", [](double rate) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_rate_sum += rate;
  });
  const int rank = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "0");
  const int world = std::atoi(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  rpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank), rank, world);
  const int trainers = world - 1;
  if (rank == 0) {
    examples::ServerOptions options;
    options.model = "mlp";
    options.optimizer = "sgd";
    options.lr = 0.01;
    options.trainers = trainers;
    options.evaluate = false;
    examples::start_parameter_server(options);
    if (!examples::wait_for_trainers(std::chrono::minutes(30))) return 1;
    std::lock_guard<std::mutex> lock(g_mu);
    bench::emit("ps", "ps_steps_per_s", g_rate_sum, "steps/s",
                "\"processes\":" + std::to_string(world) + ",\"intra_op_threads\":1,\"trainers\":" +
                    std::to_string(trainers) + ",\"model\":\"mlp784-512-512-10\",\"batch\":64,\"mode\":\"sync\"," +
                    "\"steps_per_trainer\":" + std::to_string(steps));
  } else {
    auto model = examples::server_model();
    const at::Tensor x = at::randn({64, 784});
    const at::Tensor y = at::randint(0, 10, {64}, at::kLong);
    double t0 = 0;
    const int warmup = steps / 10;
    for (int s = 0; s < warmup + steps; ++s) {
      if (s == warmup) t0 = bench::now_us();
      tandem::dist_autograd::ContextGuard ctx;
      at::Tensor loss = torch::nn::functional::cross_entropy(model.forward(x), y);
      tandem::dist_autograd::backward(ctx.id(), {loss});
      examples::submit(ctx.id());
    }
    rpc::rpc_sync("ps", "bench.rate", steps / ((bench::now_us() - t0) / 1e6));
    examples::done();
  }
  rpc::shutdown();
  return 0;
}
