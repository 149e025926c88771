// Pipeline-parallel training on Fashion-MNIST: the CNN cut into 3 stages on 3 workers, driven by a fourth.
//
//   build/tandem-run --nproc-per-node 4 build/pipeline_train [--epochs 4] [--lr 0.002] [--batch 64]
//        [--microbatches 4] [--schedule 1f1b|gpipe|interleaved|looped_bfs|zbh1|zbv|custom --plans FILE]
//        [--timeline pipeline_timeline] [--checkpoint 1] [--replicas 1]
//        [--min-accuracy A]
//
// Rank 0 (the driver) cuts the CNN (the other examples' model) into stages of balanced measured time, places stage k
// on worker k+1 (zbv: two stages per worker, in a V; with --replicas R, R copies of the pipeline on R groups of the
// workers, each stepping a share of every batch, their stages' gradients summed across the copies), and trains with
// Adam through DistributedOptimizer: each batch goes through pipe.step() (micro-batches by the schedule, activations
// from stage to stage), then opt.step(). It prints progress every 100 steps, per epoch the loss, images/s and test
// accuracy (inference through the pipeline), and writes one step's timeline as <timeline>.svg (the schedule as a
// picture) and <timeline>.json (a Chrome trace for Perfetto). With --min-accuracy it stops after the first epoch whose
// test accuracy reaches A, and exits 1 if none of the --epochs does.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "examples/data/allocator.h"
#include "examples/data/cnn.h"
#include "examples/data/fashion_mnist.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/nn/remote_module.h"
#include "tandem/pipeline/pipeline.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

using namespace tandem;

namespace {

struct Args {
  int epochs = 4;
  double lr = 2e-3;
  int batch = 64;
  int microbatches = 4;
  std::string schedule = "1f1b";
  std::string plans;                           // --schedule custom: each worker's plan, CSV (pipeline::parse_plans_csv)
  std::string timeline = "pipeline_timeline";  // "" writes none
  bool checkpoint = false;
  int replicas = 1;
  int64_t limit = 0;        // train on at most this many images (0: all 60,000); for smoke tests
  double min_accuracy = 0;  // stop once an epoch's test accuracy reaches it; exit 1 if none does
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Pipeline-parallel training on Fashion-MNIST: rank 0 drives, the other ranks hold the stages (start it with "
      "tandem-run)",
      "pipeline_train"};
  app.add_option("--epochs", a.epochs, "epochs to train");
  app.add_option("--lr", a.lr, "Adam's step size");
  app.add_option("--batch", a.batch, "images per step")->check(CLI::PositiveNumber);
  app.add_option("--microbatches", a.microbatches, "micro-batches per step")->check(CLI::PositiveNumber);
  app.add_option("--schedule", a.schedule,
                 "gpipe, 1f1b, interleaved, looped_bfs, zbh1, zbv (zero bubble), or custom (with --plans)");
  app.add_option("--plans", a.plans,
                 "custom schedule: a CSV file, line w worker w's actions in order (0F0,0F1,0I0,0W0,0B1,...: stage, "
                 "F, B, or a split backward's I and W, micro-batch)");
  app.add_option("--timeline", a.timeline, "write one step's timeline to <this>.svg and <this>.json ('': none)");
  app.add_option("--checkpoint", a.checkpoint, "1: recompute activations in backward instead of keeping them");
  app.add_option("--replicas", a.replicas, "copies of the pipeline, each on its share of the workers (data parallel)")
      ->check(CLI::PositiveNumber);
  app.add_option("--limit", a.limit, "train on at most this many images (0: all 60,000)");
  app.add_option("--min-accuracy", a.min_accuracy,
                 "stop once an epoch's test accuracy reaches it; exit 1 if none does");
  tools::parse_flags(app, argc, argv);
  return a;
}

double evaluate(pipeline::Pipeline& pipe, const examples::Dataset& test) {
  int64_t correct = 0;
  for (int64_t i = 0; i < test.images.size(0); i += 1000) {
    at::Tensor pred = pipe.forward(test.images.slice(0, i, i + 1000)).argmax(1);
    correct += pred.eq(test.labels.slice(0, i, i + 1000)).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(test.images.size(0));
}

int drive(const Args& args) {
  const int n_workers = static_cast<int>(rpc::get_all_worker_infos().size()) - 1;
  if (n_workers < 1) throw std::invalid_argument("needs a driver and at least one stage worker (--nproc-per-node 4)");
  if (n_workers % args.replicas != 0) {
    throw std::invalid_argument("--replicas must divide the stage workers (" + std::to_string(n_workers) + ")");
  }
  const int per_replica = n_workers / args.replicas;
  const int n_stages = args.schedule == "zbv" ? 2 * per_replica : per_replica;
  examples::Dataset data = examples::load_fashion_mnist("train");
  examples::Dataset test = examples::load_fashion_mnist("t10k");
  const int64_t n = args.limit > 0 ? std::min(args.limit, data.images.size(0)) : data.images.size(0);

  std::vector<std::vector<rpc::To>> workers(args.replicas);  // replica r: workers r * per_replica + 1, ...
  for (int r = 1; r <= n_workers; ++r) workers[(r - 1) / per_replica].emplace_back(r);
  pipeline::PipelineOptions options;
  options.schedule = pipeline::schedule_from_name(args.schedule);
  if (options.schedule == pipeline::Schedule::kCustom) {
    std::ifstream in(args.plans);
    if (args.plans.empty() || !in) throw std::invalid_argument("--schedule custom needs --plans FILE (readable)");
    options.plans = pipeline::parse_plans_csv(std::string(std::istreambuf_iterator<char>(in), {}));
  }
  options.n_microbatches = args.microbatches;
  options.loss = "cross_entropy";
  options.checkpoint = args.checkpoint;
  auto replicated = pipeline::ReplicatedPipeline::from_sequential(
      "fashion_cnn", {}, workers,
      {.n_stages = n_stages, .by = pipeline::Partition::kTime, .sample = data.images.slice(0, 0, args.batch)}, options);
  pipeline::Pipeline& pipe = replicated.replica(0);  // its timeline and, for the test set, its forward
  if (args.replicas > 1) std::printf("%d replicas; replica 0: ", args.replicas);
  std::printf("pipeline: %d stages (layers", n_stages);
  for (int s = 0; s < n_stages; ++s) {
    auto [b, e] = pipe.stage_layers(s);
    std::printf(" %lld-%lld on %s%s", static_cast<long long>(b), static_cast<long long>(e - 1),
                pipe.stage_worker(s).c_str(), s + 1 < n_stages ? "," : ")");
  }
  std::printf(", %s, batch %d in %d micro-batches, %lld training images, %d epochs, Adam lr %g\n",
              args.schedule.c_str(), args.batch, args.microbatches, static_cast<long long>(n), args.epochs, args.lr);
  std::fflush(stdout);
  dist_optim::DistributedOptimizer opt("adam", replicated.parameter_rrefs(), {{"lr", args.lr}});

  torch::manual_seed(42);
  const int64_t steps = (n + args.batch - 1) / args.batch;
  double accuracy = 0;
  for (int epoch = 1; epoch <= args.epochs; ++epoch) {
    at::Tensor order = at::randperm(n, at::kLong);
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    for (int64_t step = 0; step < steps; ++step) {
      at::Tensor idx = order.slice(0, step * args.batch, std::min(n, (step + 1) * args.batch));
      if (idx.size(0) < args.microbatches * args.replicas) continue;  // a last batch too small to split
      at::Tensor x = data.images.index_select(0, idx), y = data.labels.index_select(0, idx);
      const bool picture = epoch == 1 && step == 10 && !args.timeline.empty();
      if (picture) pipe.set_record_timeline(true);
      {
        dist_autograd::ContextGuard ctx;
        loss_sum += replicated.step(x, y);
        opt.step(ctx.id());
      }
      if (picture) {
        pipe.set_record_timeline(false);
        pipe.write_svg(args.timeline + ".svg");
        pipe.write_chrome_trace(args.timeline + ".json");
        std::printf("  wrote %s.svg and %s.json (step %lld: %.1f ms)\n", args.timeline.c_str(), args.timeline.c_str(),
                    static_cast<long long>(step), pipe.last_stats().step_ms);
      }
      if ((step + 1) % 100 == 0) {
        std::printf("  epoch %d  step %lld/%lld  loss %.4f\n", epoch, static_cast<long long>(step + 1),
                    static_cast<long long>(steps), loss_sum / static_cast<double>(step + 1));
        std::fflush(stdout);
      }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    accuracy = evaluate(pipe, test);
    std::printf("epoch %d/%d  %.0f images/s  loss %.4f  test accuracy %.4f\n", epoch, args.epochs,
                static_cast<double>(n) / secs, loss_sum / static_cast<double>(steps), accuracy);
    std::fflush(stdout);
    if (args.min_accuracy > 0 && accuracy >= args.min_accuracy) {
      std::printf("reached --min-accuracy %.2f after epoch %d of %d: stopping\n", args.min_accuracy, epoch,
                  args.epochs);
      break;
    }
  }
  return examples::accuracy_exit_code(accuracy, args.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  tandem::examples::keep_freed_memory();  // before any thread: see examples/data/allocator.h
  try {
    const Args args = parse(argc, argv);
    at::set_num_threads(1);  // one intra-op thread per process: the stages share the machine's cores
    nn::register_module("fashion_cnn", [] {
      torch::manual_seed(0);  // every worker builds the same weights; each keeps its own layers
      return examples::fashion_mnist_cnn();
    });
    // Stage workers only serve: their graceful shutdown waits for the driver's, for as long as training may take
    // (the driver's death ends the wait at once, with an error).
    rpc::RpcOptions options;
    options.shutdown_timeout = std::chrono::hours(2);
    rpc::init_rpc(options);
    const int code = rpc::get_worker_info().id == 0 ? drive(args) : 0;
    rpc::shutdown();
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_train: %s\n", e.what());
    return 1;
  }
}
