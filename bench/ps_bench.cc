// bench/run.sh ps — Tandem's side: the parameter server of examples/parameter_server with the MLP 784-512-512-10,
// 2 trainers (tandem-run --nproc-per-node 3), batch 64, synchronous mode (both trainers step concurrently; the server
// averages their gradients each step), SGD. Random inputs (the figure is about the framework, not the data).
//   ps_steps_per_s  training steps per second summed over the trainers (each measures its own rate and reports it
//                   to the server, which prints the sum). The line also tells where a step's time goes:
//                   trainer_step_us (means per step over the trainers: forward; loss_backward_and_round, the loss, the
//                   distributed backward and, in it, the wait for the other trainer and the server's step; release),
//                   server_us (the server's side: serving a forward, and a backward with its wait for the round, means;
//                   the round's step, from the
//                   example's metrics gauges), against the floor's phase_us (a thread's forward and loss and
//                   backward, the round's step),
//                   server_cpu_per_round_us (the server's CPU time per round, warm-up included) and
//                   server_cores_busy (the server's CPU time over the run's wall time: 2.0 would be both cores),
//                   trainers_cpu_per_round_us (the trainers' CPU time per step, summed: they share the cores) and
//                   machine_cpu_per_round_us (the server's and the trainers'), against the floor's cpu_per_round_us;
//                   server_runqueue_wait_per_round_us and trainers_runqueue_wait_per_round_us: the time their threads
//                   were ready to run but waited for a CPU (the kernel's schedstat, 0 where it keeps none; the
//                   server's per round with warm-up, as its CPU time; the trainers' summed, per timed step),
//                   against the floor's runqueue_wait_per_round_us.
//                   Beside it (impl "floor", measured by rank 0 before the run and again after it, the higher
//                   reported with both in before_run and after_run) the limit of the
//                   machine for this training: two threads of one process, each a trainer's step on the one model
//                   (forward, loss, backward for its own gradients), then both average theirs and one of them steps
//                   SGD (momentum 0.9), as the server does; the summed steps per second, with no RPC, copy or process
//                   boundary in the way.
// Flags: --steps N (per trainer, after 10% warm-up); --trace PATH: each worker writes a Chrome trace
// (profile/profile.h; "{worker}" in PATH is the worker's name: a trainer's of its timed steps, the server's of the
// whole run), which shows when the server's threads serve which trainer (the profiler's own cost is in the figures of
// such a run, its file is written after them); --server-threads N: the server's RPC worker threads (default
// examples::default_server_threads(), the cores; bench/peer_ps.py takes the same flag).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>

#include <torch/autograd.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/sgd.h>

#include <dirent.h>
#include <sys/resource.h>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "bench/common.h"
#include "examples/parameter_server/server.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/metrics/metrics.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace bench = tandem::bench;
namespace examples = tandem::examples;

namespace {
std::mutex g_mu;
double g_rate_sum = 0;            // the trainers' own rates, reported to the server
std::vector<double> g_phases(3);  // their mean phases per step (us), summed over trainers
double g_trainers_cpu_us = 0;     // their CPU time per step (us), summed over trainers
double g_trainers_wait_us = 0;    // their threads' time waiting for a CPU per step (us), summed over trainers

// CPU time (user + system) this process used so far, in seconds.
double cpu_seconds() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// Time spent runnable but waiting for a CPU, in seconds: the second field of a schedstat file (0 where the kernel
// keeps no such statistics). thread_wait_seconds: the calling thread's; runqueue_wait_seconds: the process's threads
// alive now (a thread that ended takes its time with it).
double schedstat_wait_seconds(const std::string& path) {
  std::ifstream in(path);
  double run = 0, wait = 0;
  return in >> run >> wait ? wait / 1e9 : 0;
}
double thread_wait_seconds() { return schedstat_wait_seconds("/proc/thread-self/schedstat"); }
double runqueue_wait_seconds() {
  double seconds = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.')
        seconds += schedstat_wait_seconds(std::string("/proc/self/task/") + e->d_name + "/schedstat");
    }
    closedir(d);
  }
  return seconds;
}

// What the limit measured: the summed steps per second over `steps` rounds after a tenth as many warm-up rounds, the
// CPU time per round (us), and its phases (us): each thread's forward and loss-and-backward per step, and the step
// (the last thread's sum, the average and SGD) per round.
struct Limit {
  double rate = 0, cpu_us = 0, wait_us = 0;
  double forward_us = 0, backward_us = 0, step_us = 0;
  bool operator<(const Limit& o) const { return rate < o.rate; }
};

// The two-threads-in-one-process limit (see the top).
Limit local_limit(int steps) {
  torch::manual_seed(0);  // as the server builds it: the factory registered as "mlp"
  auto model =
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(tandem::nn::detail::make_instance("mlp", {}).module);
  std::vector<at::Tensor> params = model->parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01).momentum(0.9));
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int64_t round = 0;
  std::vector<at::Tensor> sum(params.size());
  const int warmup = steps / 10;
  double t0 = 0, cpu0 = 0, wait_s = 0;                  // wait_s: both threads' waits for a CPU over their timed steps
  double forward_us = 0, backward_us = 0, step_us = 0;  // summed over both threads (the step: over rounds)
  auto trainer = [&](int seed) {
    const at::Tensor x = at::randn({64, 784}, at::detail::createCPUGenerator(seed));
    const at::Tensor y = at::randint(0, 10, {64}, at::detail::createCPUGenerator(seed), at::kLong);
    double wait0 = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      if (s == warmup) wait0 = thread_wait_seconds();
      const double start = bench::now_us();
      at::Tensor out = model->forward(x);
      const double forwarded = bench::now_us();
      at::Tensor loss = torch::nn::functional::cross_entropy(out, y);
      std::vector<at::Tensor> grads = torch::autograd::grad({loss}, params);
      const double backwarded = bench::now_us();
      std::unique_lock<std::mutex> lock(mu);
      const double locked = bench::now_us();  // the step is timed from here, as the server times its own
      if (s >= warmup) forward_us += forwarded - start, backward_us += backwarded - forwarded;
      for (size_t i = 0; i < params.size(); ++i) sum[i] = sum[i].defined() ? sum[i].add_(grads[i]) : grads[i];
      if (++arrived < 2) {
        const int64_t mine = round;
        cv.wait(lock, [&] { return round != mine; });
        continue;
      }
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = sum[i].div_(2);
        opt.step();
        for (auto& g : sum) g = at::Tensor();
      }
      if (s >= warmup) step_us += bench::now_us() - locked;
      arrived = 0;
      ++round;
      if (round == warmup) t0 = bench::now_us(), cpu0 = cpu_seconds();
      cv.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu);
    wait_s += thread_wait_seconds() - wait0;
  };
  std::thread a(trainer, 1), b(trainer, 2);
  a.join();
  b.join();
  Limit out;
  out.rate = 2.0 * steps / ((bench::now_us() - t0) / 1e6);
  out.cpu_us = (cpu_seconds() - cpu0) / steps * 1e6;
  out.wait_us = wait_s / steps * 1e6;
  out.forward_us = forward_us / (2.0 * steps);
  out.backward_us = backward_us / (2.0 * steps);
  out.step_us = step_us / steps;
  return out;
}

// The mean time (us) the server took to serve `function`'s calls ("in": request read to reply written), over every
// trainer; 0 when none.
double serve_us(const tandem::metrics::Snapshot& snap, const std::string& function) {
  double sum = 0;
  int64_t count = 0;
  for (const auto& c : snap.calls) {
    if (c.direction == "in" && c.function == function) sum += c.latency.sum_us, count += c.latency.count;
  }
  return count ? sum / static_cast<double>(count) : 0;
}
}  // namespace

int main(int argc, char** argv) {
  int steps = 2000;
  CLI::App app{"Parameter-server training throughput, its phases and the machine's limit", "ps_bench"};
  std::string trace;
  int server_threads = examples::default_server_threads();
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--server-threads", server_threads, "the server's RPC worker threads (default: the cores)")
      ->check(CLI::PositiveNumber);
  app.add_option("--trace", trace, "a Chrome trace of the timed steps per worker ({worker} in the path)");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  examples::register_parameter_server();
  rpc::register_function("bench.rate", [](double rate, std::vector<double> phases, double cpu_us, double wait_us) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_rate_sum += rate;
    g_trainers_cpu_us += cpu_us;
    g_trainers_wait_us += wait_us;
    for (size_t i = 0; i < g_phases.size() && i < phases.size(); ++i) g_phases[i] += phases[i];
  });
  const int rank = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "0");
  const int world = std::atoi(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  // The limit, measured twice by rank 0: first, before RPC starts its threads (the trainers wait for it in init_rpc,
  // though they may still be loading), and again after RPC's shutdown; the higher is reported (the VM's speed
  // drifts, and a limit measured while something else runs is not one).
  Limit limit_before;
  if (rank == 0) limit_before = local_limit(steps);
  // The server's RPC threads: its functions never block (a backward that waits for the round returns a pending future),
  // so more threads than cores only let the trainers' requests preempt each other's work (see the top).
  rpc::RpcOptions rpc_options;
  if (rank == 0) rpc_options.num_worker_threads = server_threads;
  rpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank), rank, world, rpc_options);
  const int trainers = world - 1;
  if (rank == 0) {
    examples::ServerOptions options;
    options.model = "mlp";
    options.optimizer = "sgd";
    options.lr = 0.01;
    options.trainers = trainers;
    options.evaluate = false;
    examples::start_parameter_server(options);
    const double cpu0 = cpu_seconds(), wall0 = bench::now_us(), wait0 = runqueue_wait_seconds();
    if (!trace.empty()) tandem::profile::start();
    try {
      examples::wait_for_trainers(rpc::default_timeout() + std::chrono::seconds(5));
    } catch (const std::exception& e) {  // a trainer failed or is gone: said, and this rank fails too
      std::fprintf(stderr, "ps_bench: %s\n", e.what());
      rpc::shutdown(false);
      return 1;
    }
    // The server's CPU time and its threads' waits per round (warm-up included), its share of the machine's 2 cores
    // over the run; read before the trace is written.
    const double cpu = cpu_seconds() - cpu0, wall = (bench::now_us() - wall0) / 1e6;
    const double wait = runqueue_wait_seconds() - wait0;
    if (!trace.empty()) tandem::profile::stop(trace);
    // The server's side of a step (means, warm-up included): serving a forward (the request read, the model's forward,
    // the reply written), a backward (the gradient message: the backward through the model), and the round's step.
    const tandem::metrics::Snapshot snap = tandem::metrics::snapshot();
    const double steps_timed = snap.gauges.count("tandem_ps_steps_total") ? snap.gauges.at("tandem_ps_steps_total") : 0;
    const double step_us = steps_timed > 0 ? snap.gauges.at("tandem_ps_step_seconds_total") / steps_timed * 1e6 : 0;
    // After RPC's shutdown: the trainers wait in its barrier for this worker, and the limit takes as long as the run
    // (measured before it, with --steps 4000 their barrier's deadline ran out).
    rpc::shutdown();
    const Limit limit_after = local_limit(steps);
    const Limit& limit = std::max(limit_before, limit_after);
    auto n = [](double v) { return std::to_string(static_cast<int64_t>(v)); };
    bench::emit_floor("ps", "ps_steps_per_s", limit.rate, "steps/s",
                      "\"processes\":1,\"threads\":2,\"intra_op_threads\":1,\"model\":\"mlp784-512-512-10\","
                      "\"batch\":64,\"mode\":\"sync\",\"what\":\"two trainers as threads of one process\","
                      "\"steps_per_trainer\":" +
                          std::to_string(steps) + ",\"cpu_per_round_us\":" + n(limit.cpu_us) +
                          ",\"runqueue_wait_per_round_us\":" + n(limit.wait_us) + ",\"phase_us\":{\"forward\":" +
                          n(limit.forward_us) + ",\"loss_and_backward\":" + n(limit.backward_us) +
                          ",\"step\":" + n(limit.step_us) + "},\"before_run\":" + std::to_string(limit_before.rate) +
                          ",\"after_run\":" + std::to_string(limit_after.rate));
    const int rounds = steps + steps / 10;
    std::lock_guard<std::mutex> lock(g_mu);
    auto us = [&](int i) { return std::to_string(static_cast<int64_t>(g_phases[i] / trainers)); };
    bench::emit(
        "ps", "ps_steps_per_s", g_rate_sum, "steps/s",
        "\"processes\":" + std::to_string(world) + ",\"intra_op_threads\":1,\"trainers\":" + std::to_string(trainers) +
            ",\"server_worker_threads\":" + std::to_string(server_threads) +
            ",\"model\":\"mlp784-512-512-10\",\"batch\":64,\"mode\":\"sync\"," +
            "\"steps_per_trainer\":" + std::to_string(steps) + ",\"trainer_step_us\":{\"forward\":" + us(0) +
            ",\"loss_backward_and_round\":" + us(1) + ",\"release\":" + us(2) +
            "},\"server_us\":{\"forward\":" + n(serve_us(snap, "__tandem.rref.call")) +
            ",\"backward_and_round\":" + n(serve_us(snap, "__tandem.dist_autograd.grad")) + ",\"step\":" + n(step_us) +
            "},\"server_cpu_per_round_us\":" + std::to_string(static_cast<int64_t>(cpu / rounds * 1e6)) +
            ",\"server_cores_busy\":" + std::to_string(cpu / wall) + ",\"trainers_cpu_per_round_us\":" +
            std::to_string(static_cast<int64_t>(g_trainers_cpu_us)) + ",\"machine_cpu_per_round_us\":" +
            std::to_string(static_cast<int64_t>(cpu / rounds * 1e6 + g_trainers_cpu_us)) +
            ",\"server_runqueue_wait_per_round_us\":" + n(wait / rounds * 1e6) +
            ",\"trainers_runqueue_wait_per_round_us\":" + n(g_trainers_wait_us));
  } else {
    auto model = examples::server_model();
    const at::Tensor x = at::randn({64, 784});
    const at::Tensor y = at::randint(0, 10, {64}, at::kLong);
    double t0 = 0, cpu0 = 0, wait0 = 0;
    const int warmup = steps / 10;
    // Each phase's time (us): the forward on the server; the loss here and the distributed backward, which returns
    // with the round (the wait for the other trainers and the server's step); the context's release.
    std::vector<double> phases(3, 0.0);
    for (int s = 0; s < warmup + steps; ++s) {
      if (s == warmup) {
        if (!trace.empty()) tandem::profile::start();
        t0 = bench::now_us(), cpu0 = cpu_seconds(), wait0 = runqueue_wait_seconds();
      }
      double mark = bench::now_us();
      auto lap = [&](int phase) {
        const double now = bench::now_us();
        if (s >= warmup) phases[phase] += now - mark;
        mark = now;
      };
      {
        tandem::dist_autograd::ContextGuard ctx;
        at::Tensor out = model.forward(x);
        lap(0);
        at::Tensor loss = torch::nn::functional::cross_entropy(out, y);
        tandem::dist_autograd::backward(ctx.id(), {loss});
        lap(1);
      }
      lap(2);
    }
    // Measured before the trace is written, which is not training.
    const double rate = steps / ((bench::now_us() - t0) / 1e6);
    const double cpu_us = (cpu_seconds() - cpu0) / steps * 1e6;
    const double wait_us = (runqueue_wait_seconds() - wait0) / steps * 1e6;
    if (!trace.empty()) tandem::profile::stop(trace);
    for (double& p : phases) p /= steps;
    rpc::rpc_sync("ps", "bench.rate", rate, phases, cpu_us, wait_us);
    examples::done();
    rpc::shutdown();
  }
  return 0;
}
