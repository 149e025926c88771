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
//                                forward and backward times in that step) / m: what the runtime adds beyond the
//                                schedule itself. The median of 21 steps after the timed ones; its line carries that
//                                step's time, makespan and stage busy times, and the medians of the 21 steps' lead_us
//                                (from calling step() to the first action's start: splitting, the plans' sending)
//                                and tail_us (from the last action's end to step() returning: the workers' agreement
//                                that they finished, their replies): per step, not per micro-batch.
//   pipeline_p2p_delivery_us     median time from a stage's action that sent an activation or gradient ending to the
//                                receiving stage's action starting, where the receiver was idle, waiting for it (its
//                                previous action ended before the sender's did): a message's delivery (socket, decode,
//                                the hand-off to the stage's thread), over 5 more steps at each m. Beside it
//                                (impl "floor") pipeline_p2p_floor_us: half the median round trip of a blocking
//                                ping-pong of 128 B over a Unix socket between two processes, measured first (on two
//                                cores, as two stages are: under bench/run.sh's --bind-cores 1 the forked child moves
//                                to the next core, bench/common.h's away_from_parent; each side sleeps in read). And
//                                pipeline_p2p_wake_floor_us: the median one-way latency of 128 B to a process asleep
//                                in read while the sender computes on for 300 us, as a stage does after sending (the
//                                sleeper is woken on the other core). With 2 stages in 1F1B each micro-batch waits for
//                                one activation and one gradient in turn, so the control overhead per micro-batch
//                                of stages that sleep for their messages cannot go below twice that: printed as
//                                pipeline_control_overhead_us's floor line. It is the floor of waking a sleeper only:
//                                the same-host rings' receiver spins first (docs/pipeline.md), and has gone below it.
//   pipeline_bubble_ratio        4 workers (1-4), m = 8, each forward sleeping tf and each backward tb, of which tw for
//                                the weights' gradient (so the figure does not depend on cores), for GPipe, 1F1B,
//                                ZB-H1 (4 stages) and ZBV (8 stages of half the cost, in a V): step / the schedule's
//                                own makespan at these costs (simulate(); (m + p - 1)(tf + tb) for GPipe and 1F1B).
//   pipeline_bubble_fraction     the same steps: the paper's bubble rate, median over the steps of the workers' idle
//                                over busy time in the step's timeline (p x its span, first action's start to last
//                                action's end, minus the actions' measured time, over that time: the schedule without
//                                the plan's sending, the end's agreement and the optimizer; whole_step_fraction beside
//                                it is (step - m (tf
//                                + tb)) / (m (tf + tb)), the whole step against nominal work), against "theory": (p -
//                                1) / m for GPipe and 1F1B, (p - 1) / 3m for ZB-H1 (tf = tw = tb - tw), ZBV's simulated
//                                one. TANDEM_BENCH_SVG_DIR=<dir> writes each schedule's last step there
//                                (bubble_<name>.svg and .json, a Chrome trace).
//   pipeline_replicated_step_ms  2 replicas x 2 stages (workers 1-2 and 3-4) of the "large" model, batch 1024, 4
//                                micro-batches per replica, 1F1B and ZB-H1, a step as above (the optimizer steps
//                                every copy); beside it (replicas 1) one 2-stage pipeline on workers 1-2 with the whole
//                                batch in 8 micro-batches of the same size. On 2 cores the replicas share the cores:
//                                the figure shows what replication costs there, not a speed-up.
//   pipeline_reduction_hidden_share the same steps: of the time the stages' sums across the replicas took (each from
//                                when the last replica's stage began it (its last B or W ended) to when the last one
//                                had it; from the replicas' timelines, one host, one clock), the share that ran while
//                                some action of some replica was still computing: 1 - exposed / total, exposed being
//                                the part after the step's last action ended. Median over the steps; its line carries
//                                the sums' mean time and the exposed time per step. TANDEM_BENCH_SVG_DIR: replica 0's
//                                last step as replicated_<schedule>.svg.
// Flags: --steps N (timed steps per figure, after 2 warm-up steps), --tf-ms, --tb-ms, --tw-ms, --parts (of
// small,large,bubble,replicated; default all).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
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

// The median one-way latency to a process asleep while the sender computes (measured first, on rank 0), or 0.
double g_wake_floor_us = 0;

torch::nn::Sequential mlp_stage(int64_t d) {
  return torch::nn::Sequential(torch::nn::Linear(d, d), torch::nn::ReLU(), torch::nn::Linear(d, d), torch::nn::ReLU());
}

// x * weight, whose backward sleeps tb: ti for the input's gradient and tw for the weight's, each only when the
// engine asks for it, so that a split backward's I sleeps ti and its W tw. A first stage's input needs no gradient:
// its backward sleeps both (a full backward, or the W that then runs it whole), as the stage would compute both.
struct SleepMul : torch::autograd::Function<SleepMul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            int64_t ti_us, int64_t tw_us) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["ti"] = ti_us;
    ctx->saved_data["tw"] = tw_us;
    ctx->saved_data["input_needs_grad"] = x.requires_grad();
    return x * weight;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0) || !ctx->saved_data["input_needs_grad"].toBool()) {
      std::this_thread::sleep_for(std::chrono::microseconds(ctx->saved_data["ti"].toInt()));
      if (ctx->needs_input_grad(0)) gx = g[0] * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      std::this_thread::sleep_for(std::chrono::microseconds(ctx->saved_data["tw"].toInt()));
      gw = (g[0] * saved[0]).sum();
    }
    return {gx, gw, at::Tensor(), at::Tensor()};
  }
};

// A stage whose forward takes tf and backward tb (of which tw for the weight's gradient), with one parameter for the
// optimizer.
struct SleepStage : torch::nn::Module {
  SleepStage(int64_t tf_us, int64_t tb_us, int64_t tw_us) : tf_us(tf_us), tb_us(tb_us), tw_us(tw_us) {
    weight = register_parameter("weight", at::ones({}));
  }
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::microseconds(tf_us));
    return SleepMul::apply(x, weight, tb_us - tw_us, tw_us);
  }
  int64_t tf_us, tb_us, tw_us;
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
  // By (stage, micro-batch, whether it sends a gradient): F sends an activation, B and I a gradient; W sends nothing.
  std::map<std::tuple<int, int, bool>, const pipeline::TimelineEvent*> by_action;
  auto grad = [](const pipeline::TimelineEvent& e) {
    return e.kind == pipeline::Kind::kBackward || e.kind == pipeline::Kind::kInput;
  };
  std::map<int, std::vector<const pipeline::TimelineEvent*>> by_stage;  // in start order (events come sorted)
  int n = 0;
  for (const auto& e : events) {
    if (e.kind != pipeline::Kind::kWeight) by_action[{e.stage, e.microbatch, grad(e)}] = &e;
    by_stage[e.stage].push_back(&e);
    n = std::max(n, e.stage + 1);
  }
  std::vector<double> out;
  for (const auto& [stage, list] : by_stage) {
    for (size_t k = 1; k < list.size(); ++k) {
      const auto& e = *list[k];
      if (e.kind == pipeline::Kind::kWeight) continue;  // waits for nothing from another stage
      const int from = grad(e) ? stage + 1 : stage - 1;
      if (from < 0 || from >= n) continue;
      auto sender = by_action.find({from, e.microbatch, grad(e)});
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
    // A step against what the schedule alone would take with that step's measured mean costs of each stage, and where
    // the rest went: before the first action began (the plans' sending, from the call of step()) and after the last
    // one ended (the workers' agreement that they finished, their replies, until step() returned). One clock: every
    // process is on this host and the timeline is in system-clock microseconds.
    struct Overhead {
      double step_ms = 0, ideal_ms = 0, lead_us = 0, tail_us = 0;
      std::vector<double> f = std::vector<double>(2, 0), b = std::vector<double>(2, 0);
    };
    auto system_us = [] {
      return static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
    };
    auto overhead = [&](double called_us, double returned_us) {
      Overhead o;
      o.step_ms = pipe.last_stats().step_ms;
      double first = returned_us, last = called_us;
      for (const auto& e : pipe.last_timeline()) {
        (e.kind == pipeline::Kind::kForward ? o.f : o.b)[e.stage] += (e.end_us - e.start_us) / 1000.0 / m;
        first = std::min(first, static_cast<double>(e.start_us));
        last = std::max(last, static_cast<double>(e.end_us));
      }
      o.lead_us = first - called_us, o.tail_us = returned_us - last;
      const std::vector<int> placement{0, 1};
      o.ideal_ms = pipeline::simulate(pipeline::make_plans(options.schedule, placement, 2, m), placement, m, o.f, o.b);
      return o;
    };
    std::vector<Overhead> overheads;
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
    // One step's overhead swings by tens of percent on a VM (7 steps gave 25-60 us run to run on the small model).
    constexpr int kOverheadSteps = 21;
    for (int i = 0; i < kOverheadSteps; ++i) {
      dist_autograd::ContextGuard ctx;
      const double called = system_us();
      pipe.step(x, y);
      const double returned = system_us();
      opt.step(ctx.id());
      if (i < 5) {
        for (double us : deliveries(pipe.last_timeline())) delivered.push_back(us);
      }
      overheads.push_back(overhead(called, returned));
    }
    auto median_of = [&](double Overhead::*field) {
      std::vector<double> v;
      for (const Overhead& o : overheads) v.push_back(o.*field);
      return bench::median(v);
    };
    // The step whose overhead is the median of these.
    std::sort(overheads.begin(), overheads.end(), [](const Overhead& x, const Overhead& y) {
      return x.step_ms - x.ideal_ms < y.step_ms - y.ideal_ms;
    });
    const Overhead& mid = overheads[overheads.size() / 2];
    const double step_only = mid.step_ms, ideal = mid.ideal_ms;
    const std::vector<double>& f = mid.f;
    const std::vector<double>& b = mid.b;
    if (!delivered.empty()) {
      bench::emit("pipeline", "pipeline_p2p_delivery_us", bench::median(delivered), "us",
                  cond + ",\"samples\":" + std::to_string(delivered.size()) +
                      ",\"p90_us\":" + std::to_string(bench::percentile(delivered, 0.9)));
    }
    if (g_wake_floor_us > 0) {
      bench::emit_floor("pipeline", "pipeline_control_overhead_us", 2 * g_wake_floor_us, "us",
                        cond + ",\"what\":\"two pipeline_p2p_wake_floor_us: each micro-batch waits for an "
                               "activation and a gradient in turn; the floor for stages that sleep for them (a "
                               "spinning receiver can go below it)\"");
    }
    bench::emit("pipeline", "pipeline_control_overhead_us", (step_only - ideal) * 1000 / m, "us",
                cond + ",\"median_of_steps\":" + std::to_string(overheads.size()) +
                    ",\"lead_us\":" + std::to_string(median_of(&Overhead::lead_us)) +
                    ",\"tail_us\":" + std::to_string(median_of(&Overhead::tail_us)) +
                    ",\"step_ms\":" + std::to_string(step_only) +
                    ",\"schedule_makespan_ms\":" + std::to_string(ideal) + ",\"stage_busy_ms\":[" +
                    std::to_string(m * (f[0] + b[0])) + "," + std::to_string(m * (f[1] + b[1])) + "]");
  }
}

// The bubble of each schedule on p = 4 workers, m = 8, with sleeping stages: the step against the schedule's own
// makespan at these costs (simulate(): what the schedule promises) and the bubble fraction (step - m (tf + tb)) /
// (m (tf + tb)) against the schedule's formula: (p - 1) / m for GPipe and 1F1B, (p - 1) / 3m for ZB-H1 when tf = tw =
// tb - tw (the paper's F = B = W). ZBV runs 8 stages of half the cost each, two per worker in a V.
void bubble(int steps, int64_t tf_ms, int64_t tb_ms, int64_t tw_ms) {
  const int p = 4, m = 8;
  for (auto schedule : {pipeline::Schedule::kGPipe, pipeline::Schedule::k1F1B, pipeline::Schedule::kZeroBubbleH1,
                        pipeline::Schedule::kZeroBubbleV}) {
    const bool v = schedule == pipeline::Schedule::kZeroBubbleV;
    const int n_stages = v ? 2 * p : p;
    const int64_t scale_us = v ? 500 : 1000;  // a ZBV stage is half a worker's share
    pipeline::PipelineOptions options;
    options.schedule = schedule;
    options.n_microbatches = m;
    options.loss = "bench_sum";
    options.record_timeline = true;
    std::vector<pipeline::StageSpec> stages;
    std::vector<int> placement;
    for (int s = 0; s < n_stages; ++s) {
      const int w = s < p ? s : 2 * p - 1 - s;
      placement.push_back(w);
      stages.push_back({w + 1, "bench_sleep_stage", {tf_ms * scale_us, tb_ms * scale_us, tw_ms * scale_us}});
    }
    auto pipe = pipeline::Pipeline::create(stages, options);
    tandem::dist_optim::DistributedOptimizer opt("sgd", pipe.parameter_rrefs(), {{"lr", 0.0}});
    at::Tensor x = at::randn({16, 8}), y = at::zeros({16, 8});
    // The bubble of each step's timeline, as the paper counts it: the workers' idle time over their busy time within
    // the schedule's span (the first action's start to the last one's end on any worker; one host, one clock): the
    // step without sending the plans, agreeing on its end and the optimizer's step. Measured busy time, not the
    // nominal m (tf + tb): a sleep overshoots by a little, which is work done, not bubble.
    std::vector<double> fractions, spans, busy_per_worker;
    const double ms = median_ms(steps, [&] {
      dist_autograd::ContextGuard ctx;
      pipe.step(x, y);
      opt.step(ctx.id());
      int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
      double busy = 0;
      for (const auto& e : pipe.last_timeline()) {
        first = std::min(first, e.start_us), last = std::max(last, e.end_us);
        busy += static_cast<double>(e.end_us - e.start_us) / 1000;
      }
      const double span = static_cast<double>(last - first) / 1000;
      fractions.push_back((span * p - busy) / busy), spans.push_back(span), busy_per_worker.push_back(busy / p);
    });
    // The timed steps' (median_ms runs 2 warm-up steps first).
    for (auto* v : {&fractions, &spans, &busy_per_worker}) v->erase(v->begin(), v->begin() + 2);
    const double unit = static_cast<double>(scale_us) / 1000;
    const std::vector<double> f(n_stages, tf_ms * unit), b(n_stages, tb_ms * unit), w(n_stages, tw_ms * unit);
    const double ideal = pipeline::simulate(pipeline::make_plans(schedule, placement, p, m), placement, m, f, b, w);
    const double work = static_cast<double>(m * (tf_ms + tb_ms));
    const double theory = schedule == pipeline::Schedule::kZeroBubbleH1 ? (p - 1) / (3.0 * m)
                          : v                                           ? (ideal - work) / work
                                                                        : (p - 1) / static_cast<double>(m);
    const std::string name = pipeline::schedule_name(schedule);
    if (std::getenv("TANDEM_BENCH_SVG_DIR")) {
      const std::string base = std::string(std::getenv("TANDEM_BENCH_SVG_DIR")) + "/bubble_" + name;
      pipe.write_svg(base + ".svg");
      pipe.write_chrome_trace(base + ".json");
    }
    const std::string cond = fields({{"processes", "5"},
                                     {"schedule", str(name)},
                                     {"p", std::to_string(p)},
                                     {"stages", std::to_string(n_stages)},
                                     {"m", std::to_string(m)},
                                     {"tf_ms", std::to_string(tf_ms)},
                                     {"tb_ms", std::to_string(tb_ms)},
                                     {"tw_ms", std::to_string(tw_ms)},
                                     {"step_ms", std::to_string(ms)}});
    bench::emit("pipeline", "pipeline_bubble_ratio", ms / ideal, "x",
                cond + ",\"schedule_makespan_ms\":" + std::to_string(ideal));
    bench::emit("pipeline", "pipeline_bubble_fraction", bench::median(fractions), "x",
                cond + ",\"span_ms\":" + std::to_string(bench::median(spans)) +
                    ",\"busy_ms_per_worker\":" + std::to_string(bench::median(busy_per_worker)) +
                    ",\"nominal_work_ms\":" + std::to_string(work) + ",\"theory\":" + std::to_string(theory) +
                    ",\"whole_step_fraction\":" + std::to_string((ms - work) / work));
  }
}

// Two replicas of a 2-stage pipeline against one pipeline on the whole batch, and the share of the replicas'
// gradient sums that the drain hides.
void replicated(int steps) {
  const int64_t d = 1024, batch = 1024, m = 4;
  auto gen = at::detail::createCPUGenerator(0);
  at::Tensor x = at::randn({batch, d}, gen), y = at::randn({batch, d}, gen);
  for (auto schedule : {pipeline::Schedule::k1F1B, pipeline::Schedule::kZeroBubbleH1}) {
    const std::string name = pipeline::schedule_name(schedule);
    pipeline::PipelineOptions options;
    options.schedule = schedule;
    auto cond = [&](int replicas, int64_t micro) {
      return fields({{"processes", std::to_string(1 + 2 * replicas)},
                     {"intra_op_threads", "1"},
                     {"size", str("large")},
                     {"schedule", str(name)},
                     {"replicas", std::to_string(replicas)},
                     {"stages", "2"},
                     {"m", std::to_string(micro)},
                     {"dim", std::to_string(d)},
                     {"batch", std::to_string(batch)},
                     {"steps", std::to_string(steps)}});
    };
    // One pipeline on the whole batch, micro-batches of the same size.
    options.n_microbatches = 2 * m;
    auto one = pipeline::Pipeline::create({{1, "bench_mlp_stage", {d}}, {2, "bench_mlp_stage", {d}}}, options);
    tandem::dist_optim::DistributedOptimizer one_opt("sgd", one.parameter_rrefs(), {{"lr", 0.01}});
    const double one_ms = median_ms(steps, [&] {
      dist_autograd::ContextGuard ctx;
      one.step(x, y);
      one_opt.step(ctx.id());
    });
    bench::emit("pipeline", "pipeline_replicated_step_ms", one_ms, "ms", cond(1, 2 * m));
    options.n_microbatches = m;
    options.record_timeline = true;
    auto pipe = pipeline::ReplicatedPipeline::create({{{1, "bench_mlp_stage", {d}}, {2, "bench_mlp_stage", {d}}},
                                                      {{3, "bench_mlp_stage", {d}}, {4, "bench_mlp_stage", {d}}}},
                                                     options);
    tandem::dist_optim::DistributedOptimizer opt("sgd", pipe.parameter_rrefs(), {{"lr", 0.01}});
    std::vector<double> hidden, sum_ms, exposed_ms;
    const double ms = median_ms(steps, [&] {
      dist_autograd::ContextGuard ctx;
      pipe.step(x, y);
      opt.step(ctx.id());
      // Per stage, its sum over the replicas: from when the last replica joined it (until then there is nothing to
      // sum: waiting for a slower replica is not the sum's time) to when the last one had it.
      std::map<int, std::pair<int64_t, int64_t>> sums;
      int64_t last = 0;  // the step's last action's end, on any replica
      for (int r = 0; r < pipe.num_replicas(); ++r) {
        for (const auto& e : pipe.replica(r).last_timeline()) {
          if (e.kind == pipeline::Kind::kReduce) {
            auto [it, fresh] = sums.emplace(e.stage, std::make_pair(e.start_us, e.end_us));
            it->second = {std::max(it->second.first, e.start_us), std::max(it->second.second, e.end_us)};
          } else {
            last = std::max(last, e.end_us);
          }
        }
      }
      double total = 0, exposed = 0;
      for (const auto& [stage, sum] : sums) {
        const auto [start, end] = sum;
        total += static_cast<double>(end - start) / 1000;
        exposed += static_cast<double>(std::max<int64_t>(0, end - std::max(start, last))) / 1000;
      }
      if (sums.empty() || total <= 0) return;
      hidden.push_back(1 - exposed / total), sum_ms.push_back(total / sums.size()), exposed_ms.push_back(exposed);
    });
    if (hidden.size() > 2) {  // the timed steps' (median_ms runs 2 warm-up steps first)
      for (auto* v : {&hidden, &sum_ms, &exposed_ms}) v->erase(v->begin(), v->begin() + 2);
    }
    bench::emit("pipeline", "pipeline_replicated_step_ms", ms, "ms",
                cond(2, m) + ",\"vs_one_replica\":" + std::to_string(ms / one_ms));
    if (hidden.empty()) {
      std::fprintf(stderr, "pipeline_bench: the replicated steps' timelines held no sum across the replicas\n");
      continue;
    }
    bench::emit("pipeline", "pipeline_reduction_hidden_share", bench::median(hidden), "x",
                cond(2, m) + ",\"sum_ms_mean\":" + std::to_string(bench::median(sum_ms)) +
                    ",\"exposed_ms_per_step\":" + std::to_string(bench::median(exposed_ms)) +
                    ",\"bucket_mib_per_stage\":" + std::to_string(2.0 * (d * d + d) * 4 / (1 << 20)));
    if (std::getenv("TANDEM_BENCH_SVG_DIR")) {
      pipe.replica(0).write_svg(std::string(std::getenv("TANDEM_BENCH_SVG_DIR")) + "/replicated_" + name + ".svg");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 10;
  int64_t tf_ms = 20, tb_ms = 40, tw_ms = 20;
  std::string parts = "small,large,bubble,replicated";
  CLI::App app{"Pipeline step times (GPipe, 1F1B, interleaved), control overhead and bubble", "pipeline_bench"};
  app.add_option("--steps", steps, "timed steps per case");
  app.add_option("--tf-ms", tf_ms, "forward time of a stage (bubble part)");
  app.add_option("--tb-ms", tb_ms, "backward time of a stage (bubble part)");
  app.add_option("--tw-ms", tw_ms, "of which the weights' gradient (a split backward's W; bubble part)");
  app.add_option("--parts", parts, "which parts to run: small, large, bubble, replicated (comma-separated)");
  tandem::tools::parse_flags(app, argc, argv);
  auto part = [&](const std::string& name) { return ("," + parts + ",").find("," + name + ",") != std::string::npos; };
  at::set_num_threads(1);
  at::manual_seed(0);
  tandem::nn::register_module("bench_mlp_stage", [](int64_t d) {
    at::manual_seed(d);
    return mlp_stage(d);
  });
  tandem::nn::register_module("bench_sleep_stage", [](int64_t tf_us, int64_t tb_us, int64_t tw_us) {
    return std::make_shared<SleepStage>(tf_us, tb_us, tw_us);
  });
  pipeline::register_loss("bench_sum", [](const at::Tensor& out, const at::Tensor&) { return out.sum(); });
  const char* rank = std::getenv("RANK");
  if (rank && std::string(rank) == "0") {  // before any thread starts: the floor forks a child
    const std::vector<double> rtt = bench::unix_pingpong_rtts_us(2000);
    if (!rtt.empty()) {
      bench::emit_floor("pipeline", "pipeline_p2p_floor_us", bench::median(rtt) / 2, "us",
                        "\"processes\":2,\"what\":\"half a blocking ping-pong of 128 B over a Unix stream socket\","
                        "\"iters\":2000");
    }
    const std::vector<double> wakes = bench::unix_wake_latencies_us(1000, 300);
    if (!wakes.empty()) {
      g_wake_floor_us = bench::median(wakes);
      bench::emit_floor("pipeline", "pipeline_p2p_wake_floor_us", g_wake_floor_us, "us",
                        "\"processes\":2,\"what\":\"one-way 128 B over a Unix stream socket to a process asleep "
                        "in read while the sender computes on for 300 us\",\"iters\":1000,\"p90_us\":" +
                            std::to_string(bench::percentile(wakes, 0.9)));
    }
  }
  rpc::RpcOptions options;
  options.shutdown_timeout = std::chrono::hours(1);  // stage workers wait in shutdown while rank 0 measures
  rpc::init_rpc(options);
  if (rpc::get_worker_info().id == 0) {
    if (part("small")) step_time("small", 256, 128, steps);
    if (part("large")) step_time("large", 1024, 1024, steps);
    if (part("bubble")) bubble(steps, tf_ms, tb_ms, tw_ms);
    if (part("replicated")) replicated(steps);
  }
  rpc::shutdown();
  return 0;
}
