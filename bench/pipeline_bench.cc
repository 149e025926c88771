// bench/run.sh pipeline — Tandem's side. Five workers (tandem-run --nproc-per-node 5); rank 0 drives, ranks 1.. hold
// stages. The peer (bench/peer_pipeline.py) runs PyTorch's RPC pipeline tutorial design on the same models.
//   pipeline_step_ms             2 stages on workers 1-2, 1F1B, m = 1, 2, 4, 8 micro-batches; a step is pipe.step()
//                                plus DistributedOptimizer(SGD) over both stages, in a distributed autograd context.
//                                Each stage: Linear(d, d), ReLU, Linear(d, d), ReLU; loss MSE; "small": d 256, batch
//                                128 (about 1 ms per stage and micro-batch at m = 8); "large": d 1024, batch 1024
//                                (about 25 ms per stage and micro-batch at m = 8). Its line carries
//                                stage_peak_memory_mib: each stage worker's peak resident memory (StepStats).
//   pipeline_local_step_ms       the same model unsplit, in one process (loss.backward(), torch::optim::SGD).
//   pipeline_control_overhead_us per micro-batch: (step - the schedule's makespan with each stage's measured mean
//                                forward and backward times) / m: what the runtime adds beyond the schedule itself.
//   pipeline_p2p_delivery_us     median time from a stage's action that sent an activation or gradient ending to the
//                                receiving stage's action starting, where the receiver was idle, waiting for it (its
//                                previous action ended before the sender's did): a message's delivery (socket, decode,
//                                the hand-off to the stage's thread), over 5 more steps at each m. Beside it
//                                (impl "floor") pipeline_p2p_floor_us: half the median round trip of a blocking
//                                ping-pong of 128 B over a Unix socket between two processes, measured first. With 2
//                                stages in 1F1B each micro-batch waits for one activation and one gradient in turn, so
//                                the control overhead per micro-batch cannot go below twice that floor.
//   pipeline_bubble_ratio        4 stages on workers 1-4, m = 8, each forward sleeping tf and each backward tb (so the
//                                figure does not depend on cores): step / ideal, ideal = (m + p - 1)(tf + tb).
// Flags: --steps N (timed steps per figure, after 2 warm-up steps), --tf-ms, --tb-ms, --parts (of
// small,large,bubble; default all).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <tuple>

#include "bench/common.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/nn/remote_module.h"
#include "tandem/pipeline/pipeline.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace bench = tandem::bench;
namespace pipeline = tandem::pipeline;
namespace dist_autograd = tandem::dist_autograd;

namespace {

torch::nn::Sequential mlp_stage(int64_t d) {
  return torch::nn::Sequential(torch::nn::Linear(d, d), torch::nn::ReLU(), torch::nn::Linear(d, d), torch::nn::ReLU());
}

// Identity whose backward sleeps.
struct SleepBackward : torch::autograd::Function<SleepBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t tb_us) {
    ctx->saved_data["tb"] = tb_us;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    std::this_thread::sleep_for(std::chrono::microseconds(ctx->saved_data["tb"].toInt()));
    return {g[0], at::Tensor()};
  }
};

// A stage whose forward takes tf and backward tb, with one parameter for the optimizer.
struct SleepStage : torch::nn::Module {
  SleepStage(int64_t tf_us, int64_t tb_us) : tf_us(tf_us), tb_us(tb_us) {
    weight = register_parameter("weight", at::ones({}));
  }
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::microseconds(tf_us));
    return SleepBackward::apply(x * weight, tb_us);
  }
  int64_t tf_us, tb_us;
  at::Tensor weight;
};

template <typename F>
double median_ms(int steps, F&& step) {
  std::vector<double> t;
  for (int i = 0; i < steps + 2; ++i) {
    const double t0 = bench::now_us();
    step();
    if (i >= 2) t.push_back((bench::now_us() - t0) / 1000);
  }
  return bench::median(t);
}

std::string fields(const std::map<std::string, std::string>& f) {
  std::string out;
  for (const auto& [k, v] : f) out += (out.empty() ? "" : ",") + ("\"" + k + "\":" + v);
  return out;
}
std::string str(const std::string& s) { return "\"" + s + "\""; }

// Delivery times (see pipeline_p2p_delivery_us) in a step's timeline.
std::vector<double> deliveries(const std::vector<pipeline::TimelineEvent>& events) {
  std::map<std::tuple<int, int, bool>, const pipeline::TimelineEvent*> by_action;
  std::map<int, std::vector<const pipeline::TimelineEvent*>> by_stage;  // in start order (events come sorted)
  int n = 0;
  for (const auto& e : events) {
    by_action[{e.stage, e.microbatch, e.backward}] = &e;
    by_stage[e.stage].push_back(&e);
    n = std::max(n, e.stage + 1);
  }
  std::vector<double> out;
  for (const auto& [stage, list] : by_stage) {
    for (size_t k = 1; k < list.size(); ++k) {
      const auto& e = *list[k];
      const int from = e.backward ? stage + 1 : stage - 1;
      if (from < 0 || from >= n) continue;
      auto sender = by_action.find({from, e.microbatch, e.backward});
      if (sender == by_action.end()) continue;
      const int64_t sent = sender->second->end_us;
      if (list[k - 1]->end_us <= sent) out.push_back(static_cast<double>(e.start_us - sent));
    }
  }
  return out;
}

void step_time(const std::string& size, int64_t d, int64_t batch, int steps) {
  auto gen = at::detail::createCPUGenerator(0);
  at::Tensor x = at::randn({batch, d}, gen), y = at::randn({batch, d}, gen);
  // The unsplit model on one process.
  torch::nn::Sequential local;
  for (int s = 0; s < 2; ++s) {
    torch::nn::Sequential stage = mlp_stage(d);
    for (const auto& layer : *stage) local->push_back(layer);
  }
  torch::optim::SGD local_opt(local->parameters(), torch::optim::SGDOptions(0.01));
  const double local_ms = median_ms(steps, [&] {
    local_opt.zero_grad();
    at::mse_loss(local->forward(x), y).backward();
    local_opt.step();
  });
  bench::emit("pipeline", "pipeline_local_step_ms", local_ms, "ms",
              fields({{"processes", "1"},
                      {"intra_op_threads", "1"},
                      {"size", str(size)},
                      {"dim", std::to_string(d)},
                      {"batch", std::to_string(batch)},
                      {"steps", std::to_string(steps)}}));
  double m1_ms = 0;
  for (int m : {1, 2, 4, 8}) {
    pipeline::PipelineOptions options;
    options.schedule = pipeline::Schedule::k1F1B;
    options.n_microbatches = m;
    options.record_timeline = true;
    auto pipe = pipeline::Pipeline::create({{1, "bench_mlp_stage", {d}}, {2, "bench_mlp_stage", {d}}}, options);
    tandem::dist_optim::DistributedOptimizer opt("sgd", pipe.parameter_rrefs(), {{"lr", 0.01}});
    const double ms = median_ms(steps, [&] {
      dist_autograd::ContextGuard ctx;
      pipe.step(x, y);
      opt.step(ctx.id());
    });
    if (m == 1) m1_ms = ms;
    // What the schedule alone would take with the last step's measured costs of the slowest stage.
    std::vector<double> f(2, 0), b(2, 0);
    for (const auto& e : pipe.last_timeline()) (e.backward ? b : f)[e.stage] += (e.end_us - e.start_us) / 1000.0 / m;
    const std::vector<int> placement{0, 1};
    const double ideal =
        pipeline::simulate(pipeline::make_plans(options.schedule, placement, 2, m), placement, m, f, b);
    const double step_only = pipe.last_stats().step_ms;
    std::string peak_mib;  // each stage worker's peak resident memory
    for (int64_t kib : pipe.last_stats().peak_memory_kib) {
      peak_mib += (peak_mib.empty() ? "" : ",") + std::to_string(kib / 1024);
    }
    const std::string cond = fields({{"processes", "3"},
                                     {"intra_op_threads", "1"},
                                     {"size", str(size)},
                                     {"m", std::to_string(m)},
                                     {"schedule", str("1f1b")},
                                     {"dim", std::to_string(d)},
                                     {"batch", std::to_string(batch)},
                                     {"steps", std::to_string(steps)}});
    bench::emit("pipeline", "pipeline_step_ms", ms, "ms",
                cond + ",\"speedup_vs_m1\":" + std::to_string(m1_ms / ms) + ",\"speedup_vs_local\":" +
                    std::to_string(local_ms / ms) + ",\"stage_peak_memory_mib\":[" + peak_mib + "]");
    std::vector<double> delivered;
    for (int i = 0; i < 5; ++i) {
      dist_autograd::ContextGuard ctx;
      pipe.step(x, y);
      opt.step(ctx.id());
      for (double us : deliveries(pipe.last_timeline())) delivered.push_back(us);
    }
    if (!delivered.empty()) {
      bench::emit("pipeline", "pipeline_p2p_delivery_us", bench::median(delivered), "us",
                  cond + ",\"samples\":" + std::to_string(delivered.size()) +
                      ",\"p90_us\":" + std::to_string(bench::percentile(delivered, 0.9)));
    }
    bench::emit("pipeline", "pipeline_control_overhead_us", (step_only - ideal) * 1000 / m, "us",
                cond + ",\"last_step_ms\":" + std::to_string(step_only) +
                    ",\"schedule_makespan_ms\":" + std::to_string(ideal) + ",\"stage_busy_ms\":[" +
                    std::to_string(m * (f[0] + b[0])) + "," + std::to_string(m * (f[1] + b[1])) + "]");
  }
}

void bubble(int steps, int64_t tf_ms, int64_t tb_ms) {
  const int p = 4, m = 8;
  for (auto schedule : {pipeline::Schedule::kGPipe, pipeline::Schedule::k1F1B}) {
    pipeline::PipelineOptions options;
    options.schedule = schedule;
    options.n_microbatches = m;
    options.loss = "bench_sum";
    std::vector<pipeline::StageSpec> stages;
    for (int s = 0; s < p; ++s) stages.push_back({s + 1, "bench_sleep_stage", {tf_ms * 1000, tb_ms * 1000}});
    auto pipe = pipeline::Pipeline::create(stages, options);
    tandem::dist_optim::DistributedOptimizer opt("sgd", pipe.parameter_rrefs(), {{"lr", 0.0}});
    at::Tensor x = at::randn({16, 8}), y = at::zeros({16, 8});
    const double ms = median_ms(steps, [&] {
      dist_autograd::ContextGuard ctx;
      pipe.step(x, y);
      opt.step(ctx.id());
    });
    const double ideal = static_cast<double>((m + p - 1) * (tf_ms + tb_ms));
    bench::emit("pipeline", "pipeline_bubble_ratio", ms / ideal, "x",
                fields({{"processes", "5"},
                        {"schedule", str(pipeline::schedule_name(schedule))},
                        {"p", "4"},
                        {"m", "8"},
                        {"tf_ms", std::to_string(tf_ms)},
                        {"tb_ms", std::to_string(tb_ms)},
                        {"step_ms", std::to_string(ms)},
                        {"ideal_ms", std::to_string(ideal)}}));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 10;
  int64_t tf_ms = 10, tb_ms = 20;
  std::string parts = "small,large,bubble";
  CLI::App app{"Pipeline step times (GPipe, 1F1B, interleaved), control overhead and bubble", "pipeline_bench"};
  app.add_option("--steps", steps, "timed steps per case");
  app.add_option("--tf-ms", tf_ms, "forward time of a stage (bubble part)");
  app.add_option("--tb-ms", tb_ms, "backward time of a stage (bubble part)");
  app.add_option("--parts", parts, "which parts to run: small, large, bubble (comma-separated)");
  tandem::tools::parse_flags(app, argc, argv);
  auto part = [&](const std::string& name) { return ("," + parts + ",").find("," + name + ",") != std::string::npos; };
  at::set_num_threads(1);
  at::manual_seed(0);
  tandem::nn::register_module("bench_mlp_stage", [](int64_t d) {
    at::manual_seed(d);
    return mlp_stage(d);
  });
  tandem::nn::register_module("bench_sleep_stage",
                              [](int64_t tf_us, int64_t tb_us) { return std::make_shared<SleepStage>(tf_us, tb_us); });
  pipeline::register_loss("bench_sum", [](const at::Tensor& out, const at::Tensor&) { return out.sum(); });
  const char* rank = std::getenv("RANK");
  if (rank && std::string(rank) == "0") {  // before any thread starts: the floor forks a child
    const std::vector<double> rtt = bench::unix_pingpong_rtts_us(2000);
    if (!rtt.empty()) {
      bench::emit_floor("pipeline", "pipeline_p2p_floor_us", bench::median(rtt) / 2, "us",
                        "\"processes\":2,\"what\":\"half a blocking ping-pong of 128 B over a Unix stream socket\","
                        "\"iters\":2000");
    }
  }
  rpc::RpcOptions options;
  options.shutdown_timeout = std::chrono::hours(1);  // stage workers wait in shutdown while rank 0 measures
  rpc::init_rpc(options);
  if (rpc::get_worker_info().id == 0) {
    if (part("small")) step_time("small", 256, 128, steps);
    if (part("large")) step_time("large", 1024, 1024, steps);
    if (part("bubble")) bubble(steps, tf_ms, tb_ms);
  }
  rpc::shutdown();
  return 0;
}
