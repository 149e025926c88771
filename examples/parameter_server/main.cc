// Parameter-server training on Fashion-MNIST: rank 0 is the server ("ps"), ranks 1..N are trainers.
//
//   build/tandem-run --nproc-per-node 3 build/parameter_server [--epochs 4] [--lr 0.002] [--mode sync|async] [--batch
//   64] [--checkpoint-dir D [--checkpoint-every 50]] [--min-accuracy A] [--rpc-timeout 60]
//
// With --min-accuracy A the job exits 1 unless the last epoch's test accuracy reaches A; in synchronous mode it also
// stops after the first epoch that reaches it (every trainer then scores the same model, so all stop together; in
// asynchronous mode each trainer's model differs, and all run every epoch).
// With --checkpoint-dir the job saves every --checkpoint-every steps and, started again (by hand, or by
// `tandem-run --max-restarts K` after a failure), resumes: in synchronous mode the server saves the model, its
// optimizer and the rounds taken, and the trainers carry on from its round, so the run ends with the same parameters
// as an uninterrupted one (trainer 1 prints their hash); in asynchronous mode each trainer saves its optimizer's
// state (held on the server) and the server saves the model once all have, at the same step (Hogwild steps are not
// reproducible, so only the place is).
//
// The model (2 conv + pooling + FC) lives on the server as an nn::RemoteModule; each trainer reads its shard of the
// training set, runs forward through the RemoteModule, and backward with distributed autograd (server.h has the two
// modes). Trainer 1 prints steps/s, loss and the server's test accuracy after every epoch.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "examples/data/allocator.h"
#include "examples/data/cnn.h"
#include "examples/data/fashion_mnist.h"
#include "examples/parameter_server/server.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/cluster/environment.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

using namespace tandem;

namespace {

struct Args {
  int epochs = 4;
  double lr = 2e-3;  // Adam's step size (the server's optimizer in sync mode, each trainer's in async mode)
  int batch = 64;
  std::string mode = "sync";
  int64_t limit = 0;        // train on at most this many images per trainer (0: the whole shard); for smoke tests
  double min_accuracy = 0;  // exit 1 if the final test accuracy is lower; sync mode: stop once an epoch reaches it
  std::string checkpoint_dir;
  int64_t checkpoint_every = 50;  // rounds
  double rpc_timeout = 60;        // seconds: RpcOptions::rpc_timeout
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Parameter-server training on Fashion-MNIST: rank 0 serves the model, the others train (start it with "
      "tandem-run)",
      "parameter_server"};
  app.add_option("--epochs", a.epochs, "epochs to train");
  app.add_option("--batch", a.batch, "images per step on each trainer")->check(CLI::PositiveNumber);
  app.add_option("--mode", a.mode, "sync: the server steps once per round; async: trainers update it on their own")
      ->check(CLI::IsMember({"sync", "async"}));
  app.add_option("--limit", a.limit, "train on at most this many images per trainer (0: the whole shard)");
  app.add_option("--lr", a.lr, "Adam's step size (the server's optimizer in sync mode, each trainer's in async mode)");
  app.add_option("--min-accuracy", a.min_accuracy,
                 "exit 1 if the final test accuracy is lower; sync mode: stop once an epoch reaches it");
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "write checkpoints here and resume from the newest ('': none)");
  app.add_option("--checkpoint-every", a.checkpoint_every, "rounds between checkpoints")->check(CLI::PositiveNumber);
  app.add_option("--rpc-timeout", a.rpc_timeout,
                 "seconds: every call's timeout, a trainer's backward pass's, and so how long a synchronous round "
                 "waits for its trainers")
      ->check(CLI::Range(0.01, 1e6));
  tools::parse_flags(app, argc, argv);
  // Checked here, on every rank before any work, so that the whole job stops at once; a trainer takes full batches
  // only, and with fewer images than a batch it would have no step to take (its epochs divided by zero steps).
  if (a.limit > 0 && a.limit < a.batch) {
    throw std::invalid_argument("--limit " + std::to_string(a.limit) + " is less than --batch " +
                                std::to_string(a.batch) + ": a trainer would have no full batch to train on");
  }
  return a;
}

int train(const Args& args, int rank, int trainers) {
  examples::Dataset data = examples::load_fashion_mnist("train");
  // This trainer's shard: every trainers-th image, starting at rank-1.
  at::Tensor shard = at::arange(rank - 1, data.images.size(0), trainers);
  if (args.limit > 0 && shard.size(0) > args.limit) shard = shard.slice(0, 0, args.limit);
  // The smallest shard's full batches (the last trainer's: data.images.size(0) / trainers images, one fewer than the
  // first ones' when the trainers do not divide the set), not this shard's: every trainer takes as many steps, or in
  // sync mode the server's round would wait for a step that a trainer with a smaller shard never sends.
  int64_t smallest = data.images.size(0) / trainers;
  if (args.limit > 0) smallest = std::min(smallest, args.limit);
  const int64_t steps_per_epoch = smallest / args.batch;
  if (steps_per_epoch == 0) {
    throw std::invalid_argument("--batch " + std::to_string(args.batch) + " is more than the smallest shard's " +
                                std::to_string(smallest) + " images (" + std::to_string(data.images.size(0)) +
                                " over " + std::to_string(trainers) + " trainers): no trainer would take a step");
  }

  nn::RemoteModule model = examples::server_model();
  std::unique_ptr<dist_optim::DistributedOptimizer> opt;
  if (args.mode == "async") {
    opt = std::make_unique<dist_optim::DistributedOptimizer>("adam", model.remote_parameters(),
                                                             std::map<std::string, double>{{"lr", args.lr}},
                                                             dist_optim::DistributedOptimizerOptions{.hogwild = true});
  }
  // After a restart: the rounds the server's checkpoint holds, so every trainer carries on from the same step.
  const int64_t resumed = args.checkpoint_dir.empty() ? 0 : examples::rounds_done();
  // Asynchronous mode: each trainer's optimizer state lives on the server, behind its DistributedOptimizer; the
  // trainer saves it (and the server its model) at common steps, and loads it back from the step the server resumed.
  std::unique_ptr<checkpoint::Checkpointer> ckpt;
  checkpoint::State state;
  if (opt && !args.checkpoint_dir.empty()) {
    ckpt = std::make_unique<checkpoint::Checkpointer>(args.checkpoint_dir + "/trainers", rank);
    state.add(
        "optimizer", [&opt](torch::serialize::OutputArchive& a) { opt->save(a); },
        [&opt](torch::serialize::InputArchive& a) { opt->load(a); });
    if (resumed > 0) ckpt->load(resumed, state);
  }
  int64_t global_step = resumed;
  if (resumed > 0 && rank == 1) {
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    std::printf("trainers resume at round %lld (epoch %lld, restart %s)\n", static_cast<long long>(resumed),
                static_cast<long long>(resumed / steps_per_epoch + 1), restart ? restart : "0");
    std::fflush(stdout);
  }
  double accuracy = 0;
  for (int epoch = static_cast<int>(resumed / steps_per_epoch) + 1; epoch <= args.epochs; ++epoch) {
    const int64_t first_step = epoch == resumed / steps_per_epoch + 1 ? resumed % steps_per_epoch : 0;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * epoch + rank);
    at::Tensor order = shard.index_select(0, at::randperm(shard.size(0), gen));
    double loss_sum = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t step = first_step; step < steps_per_epoch; ++step) {
      at::Tensor idx = order.slice(0, step * args.batch, (step + 1) * args.batch);
      at::Tensor x = data.images.index_select(0, idx), y = data.labels.index_select(0, idx);
      dist_autograd::ContextGuard ctx;
      at::Tensor loss = torch::nn::functional::cross_entropy(model.forward(x), y);
      dist_autograd::backward(ctx.id(), {loss});
      if (opt) opt->step(ctx.id());  // sync mode: the backward pass took the round's step on the server
      loss_sum += loss.item<double>();
      ++global_step;
      if (ckpt && global_step % args.checkpoint_every == 0) {
        ckpt->save(global_step, state);             // this trainer's optimizer state, fetched from the server
        examples::checkpoint_barrier(global_step);  // the server saves its model once every trainer has saved
      }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Sync mode: once a round is complete no trainer changes the model before every trainer's backward reached the
    // server again, so all score the same model here and take the same decision.
    const bool stop_early = args.min_accuracy > 0 && args.mode == "sync";
    if (rank == 1 || stop_early) accuracy = examples::evaluate();
    if (rank == 1) {
      std::printf("epoch %d/%d  %.0f steps/s (all %d trainers)  loss %.4f  test accuracy %.4f\n", epoch, args.epochs,
                  trainers * (steps_per_epoch - first_step) / secs, trainers,
                  loss_sum / std::max<int64_t>(1, steps_per_epoch - first_step), accuracy);
      std::fflush(stdout);
    }
    if (stop_early && accuracy >= args.min_accuracy) {
      if (rank == 1) {
        std::printf("reached --min-accuracy %.2f after epoch %d of %d: stopping\n", args.min_accuracy, epoch,
                    args.epochs);
        std::fflush(stdout);
      }
      break;
    }
  }
  if (rank == 1) {
    std::printf("final parameters: %016llx\n", static_cast<unsigned long long>(examples::model_hash()));
    std::fflush(stdout);
  }
  return rank == 1 ? examples::accuracy_exit_code(accuracy, args.min_accuracy) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::examples::keep_freed_memory();  // before any thread: see examples/data/allocator.h
  try {
    const Args args = parse(argc, argv);
    examples::register_parameter_server();
    // Rank and world from tandem-run's variables, or srun's (cluster/environment.h).
    auto place = cluster::worker_place();
    if (!place.ok()) throw std::invalid_argument(std::string(place.status().message()));
    const int rank = place->rank;
    const int world = place->world_size;
    if (world < 2)
      throw std::invalid_argument("run with tandem-run --nproc-per-node N (N >= 2: a server and trainers)");
    rpc::RpcOptions rpc_options;
    rpc_options.master_addr = place->master_addr;
    rpc_options.master_port = place->master_port;
    // The other trainers reach the shutdown barrier while trainer 1 still scores the test set on the server (10,000
    // images through the RemoteModule): a few seconds alone, more than the default 30 s on a loaded machine (it failed
    // so under ctest -j2). A worker that dies meanwhile still ends the job at once (tandem-run stops every rank).
    rpc_options.shutdown_timeout = std::chrono::minutes(5);
    rpc_options.rpc_timeout = std::chrono::milliseconds(static_cast<int64_t>(args.rpc_timeout * 1000));
    rpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank), rank, world, rpc_options);
    int code = 0;
    if (rank == 0) {
      examples::ServerOptions options;
      options.trainers = world - 1;
      options.lr = args.lr;
      options.sync = args.mode == "sync";
      options.checkpoint_dir = args.checkpoint_dir;
      options.checkpoint_every = args.checkpoint_every;
      std::printf("parameter server: %d trainers, %s mode, batch %d, %d epochs, Fashion-MNIST\n", world - 1,
                  args.mode.c_str(), args.batch, args.epochs);
      std::fflush(stdout);
      examples::start_parameter_server(options);
      // Longer than a synchronous round waits for a trainer that hangs (it gives up before its trainers' calls time
      // out and fails them naming it): that error, with its cause, reaches the server first (report_failure()).
      examples::wait_for_trainers(rpc_options.rpc_timeout + std::chrono::seconds(5));
    } else {
      code = train(args, rank, world - 1);
      examples::done();
    }
    rpc::shutdown(true);
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parameter_server: %s\n", e.what());
    examples::report_failure(e.what());  // a trainer's failure ends the server too (nothing on the server)
    try {
      if (rpc::is_initialized()) rpc::shutdown(false);  // the agent's threads stop before the process exits
    } catch (const std::exception& stop) {
      std::fprintf(stderr, "parameter_server: stopping RPC: %s\n", stop.what());
    }
    return 1;
  }
}
