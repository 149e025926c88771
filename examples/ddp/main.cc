// Data-parallel training on Fashion-MNIST with DistributedDataParallel: every rank holds the whole model and trains on
// its own shard (DistributedSampler); gradients are averaged across the ranks during backward.
//
//   build/tandem-run --nproc-per-node 2 build/ddp_train [--epochs 4] [--lr 0.002] [--batch 64] [--zero 1]
//                    [--shard full|zero2] [--checkpoint-dir D [--checkpoint-every 50]] [--min-accuracy A]
//
// With --min-accuracy the run stops after the first epoch whose test accuracy reaches A (every rank gets the same
// accuracy, so all stop together), and exits 1 if no epoch does.
// With --checkpoint-dir the job saves a checkpoint (checkpoint/checkpoint.h: model, optimizer, sampler position,
// counters) every --checkpoint-every steps and, when started again (by hand, or by `tandem-run --max-restarts K`
// after a worker failed), resumes from the newest one every rank has: the run ends as an uninterrupted one would, to
// the bit. Rank 0 prints a hash of the final parameters, so two runs can be compared.
//
// Model: 2 conv + pooling + FC (the parameter-server example's CNN). Adam; with --zero 1 its state is sharded across
// the ranks (ZeroRedundancyOptimizer). With --shard full the model is fully sharded instead of replicated
// (fsdp::FullyShardedDataParallel: each layer's parameters, gradients and Adam state split across the ranks, gathered
// around each layer's use), with --shard zero2 its gradients and Adam state only; either saves each rank's shards in
// its checkpoints. Rank 0 prints progress, and after every epoch the loss, the images per second of all ranks
// together and the test accuracy (each rank scores half the test set; the counts are summed).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "examples/data/allocator.h"
#include "examples/data/cnn.h"
#include "examples/data/fashion_mnist.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/ddp/sampler.h"
#include "tandem/ddp/zero.h"
#include "tandem/fsdp/fsdp.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

using namespace tandem;

namespace {

struct Args {
  int epochs = 4;
  double lr = 2e-3;
  int batch = 64;  // per rank
  bool zero = false;
  std::string shard;        // "", "full" or "zero2"
  int64_t limit = 0;        // train on at most this many images in all (0: all 60,000); for smoke tests
  double min_accuracy = 0;  // stop once an epoch's test accuracy reaches it; exit 1 if none does
  std::string checkpoint_dir;
  int64_t checkpoint_every = 50;  // steps
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"Data-parallel training of a CNN on Fashion-MNIST, one rank per process (start it with tandem-run)",
               "ddp_train"};
  app.add_option("--epochs", a.epochs, "epochs to train");
  app.add_option("--lr", a.lr, "Adam's step size");
  app.add_option("--batch", a.batch, "images per step on each rank")->check(CLI::PositiveNumber);
  app.add_option("--zero", a.zero, "1: ZeRO-1, each rank keeps a shard of the optimizer state");
  app.add_option("--shard", a.shard, "full: fully sharded (ZeRO-3); zero2: gradients and optimizer state sharded")
      ->check(CLI::IsMember({"", "full", "zero2"}));
  app.add_option("--limit", a.limit, "train on at most this many images in all (0: all 60,000)");
  app.add_option("--min-accuracy", a.min_accuracy,
                 "stop once an epoch's test accuracy reaches it; exit 1 if none does");
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "write checkpoints here and resume from the newest ('': none)");
  app.add_option("--checkpoint-every", a.checkpoint_every, "steps between checkpoints")->check(CLI::PositiveNumber);
  tools::parse_flags(app, argc, argv);
  if (!a.shard.empty() && a.zero) {
    throw std::invalid_argument("--shard does not take --zero (it shards the optimizer state itself)");
  }
  return a;
}

// FNV-1a over the parameters' bytes: equal hashes, equal parameters (to the bit, in practice).
// Test accuracy over all ranks: rank r scores every size()-th test image from r; the counts are summed. Sharded, the
// forward is collective: every rank runs the same number of chunks (the last ones may be short or empty).
double evaluate(torch::nn::Sequential& model, fsdp::FullyShardedDataParallel* sharded, const examples::Dataset& test,
                comm::ProcessGroup& pg) {
  torch::NoGradGuard no_grad;
  model->eval();
  at::Tensor idx = at::arange(pg.rank(), test.images.size(0), pg.size());
  const int64_t most = (test.images.size(0) + pg.size() - 1) / pg.size();  // rank 0's rows, the most of any
  const int64_t chunks = (most + 999) / 1000;
  int64_t correct = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    at::Tensor part = idx.slice(0, std::min(c * 1000, idx.size(0)), std::min((c + 1) * 1000, idx.size(0)));
    at::Tensor x = test.images.index_select(0, part);
    at::Tensor pred = (sharded ? sharded->forward(x) : model->forward(x)).argmax(1);
    correct += pred.eq(test.labels.index_select(0, part)).sum().item<int64_t>();
  }
  model->train();
  at::Tensor counts = at::tensor({correct, idx.size(0)}, at::kLong);
  comm::wait(pg.allreduce(counts));
  return static_cast<double>(counts[0].item<int64_t>()) / static_cast<double>(counts[1].item<int64_t>());
}

int train(const Args& args) {
  auto pg = comm::ProcessGroup::create("ddp");
  const bool lead = pg->rank() == 0;
  examples::Dataset data = examples::load_fashion_mnist("train");
  examples::Dataset test = examples::load_fashion_mnist("t10k");
  const int64_t n = args.limit > 0 ? std::min(args.limit, data.images.size(0)) : data.images.size(0);

  torch::manual_seed(pg->rank());  // different on purpose: DDP starts every rank from rank 0's parameters
  auto model = examples::fashion_mnist_cnn();
  std::unique_ptr<ddp::DistributedDataParallel<torch::nn::SequentialImpl>> replicated;
  std::unique_ptr<fsdp::FullyShardedDataParallel> sharded;
  if (args.shard.empty()) {
    replicated = std::make_unique<ddp::DistributedDataParallel<torch::nn::SequentialImpl>>(model.ptr(), pg);
  } else {
    fsdp::FsdpOptions options;  // rank 0's parameters too (sync_module_states)
    if (args.shard == "zero2") options.sharding = fsdp::Sharding::kGradientsAndOptimizer;
    sharded = std::make_unique<fsdp::FullyShardedDataParallel>(model, pg, options);
  }
  auto forward = [&](const at::Tensor& x) { return sharded ? sharded->forward(x) : replicated->forward(x); };
  std::unique_ptr<torch::optim::Optimizer> adam;
  std::unique_ptr<ddp::ZeroRedundancyOptimizer> zero;
  if (sharded) {
    adam = std::make_unique<torch::optim::Adam>(sharded->parameters(), torch::optim::AdamOptions(args.lr));
  } else if (args.zero) {
    zero = std::make_unique<ddp::ZeroRedundancyOptimizer>(model->parameters(), pg, [&](std::vector<at::Tensor> shard) {
      return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(args.lr));
    });
  } else {
    adam = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(args.lr));
  }
  ddp::DistributedSampler sampler(static_cast<size_t>(n), *pg, {.shuffle = true, .seed = 42});
  const int64_t steps = static_cast<int64_t>((sampler.size() + args.batch - 1) / args.batch);
  if (lead) {
    const char* how = args.shard == "full"    ? " (fully sharded)"
                      : args.shard == "zero2" ? " (ZeRO-2: gradients and Adam state sharded)"
                      : args.zero             ? " (ZeRO-sharded)"
                                              : "";
    std::printf("ddp: %d ranks, batch %d per rank, %lld training images, %d epochs, Adam lr %g%s\n", pg->size(),
                args.batch, static_cast<long long>(n), args.epochs, args.lr, how);
    std::fflush(stdout);
  }
  // Where the run is: saved with the model, the optimizer and the sampler's position, so a restart carries on from
  // the middle of an epoch.
  int64_t epoch = 1, global_step = 0, step = 0;  // step: within the epoch
  at::Tensor loss_sum = at::zeros({}, at::kDouble);
  std::unique_ptr<checkpoint::Checkpointer> ckpt;
  checkpoint::State state;
  bool mid_epoch = false;
  if (!args.checkpoint_dir.empty()) {
    ckpt = std::make_unique<checkpoint::Checkpointer>(args.checkpoint_dir, pg->rank());
    if (sharded) {
      state.add("model", *sharded);  // this rank's shards (checkpoint::State::Fsdp::kSharded)
    } else {
      state.add("model", *model);
    }
    if (zero) {
      state.add("optimizer", *zero);
    } else {
      state.add("optimizer", *adam);
    }
    state.add("sampler", sampler).add("epoch", epoch).add("global_step", global_step).add("step", step);
    state.add("loss_sum", loss_sum);
    // DDP state is the same on every rank: all read rank 0's files, so a job re-formed with another world size resumes
    // too (the sampler re-derives each rank's share). ZeRO's and fully sharded models' shards are per rank: the same
    // world size only.
    const auto layout = zero || sharded ? checkpoint::Layout::kPerRank : checkpoint::Layout::kReplicated;
    if (auto resumed = ckpt->restore(state, pg.get(), layout)) {
      mid_epoch = true;
      const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
      if (lead) {
        std::printf("ddp: resumed from step %lld (epoch %lld, restart %s)\n", static_cast<long long>(*resumed),
                    static_cast<long long>(epoch), restart ? restart : "0");
        std::fflush(stdout);
      }
    }
  }
  double accuracy = 0;
  for (; epoch <= args.epochs; ++epoch) {
    if (!mid_epoch) {
      sampler.set_epoch(static_cast<uint64_t>(epoch));
      step = 0;
      loss_sum.zero_();
    }
    mid_epoch = false;
    const auto t0 = std::chrono::steady_clock::now();
    while (auto batch = sampler.next(args.batch)) {
      at::Tensor idx = at::tensor(std::vector<int64_t>(batch->begin(), batch->end()), at::kLong);
      at::Tensor x = data.images.index_select(0, idx), y = data.labels.index_select(0, idx);
      zero ? zero->zero_grad() : adam->zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(forward(x), y);
      loss.backward();
      if (zero) zero->step();
      else adam->step();
      loss_sum += loss.item<double>();
      ++global_step;
      if (lead && ++step % 100 == 0) {
        std::printf("  epoch %lld  step %lld/%lld  loss %.4f\n", static_cast<long long>(epoch),
                    static_cast<long long>(step), static_cast<long long>(steps), loss_sum.item<double>() / step);
        std::fflush(stdout);
      }
      if (ckpt && global_step % args.checkpoint_every == 0) ckpt->save(global_step, state);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    at::Tensor mean_loss = at::tensor({loss_sum.item<double>() / std::max<int64_t>(1, steps)}, at::kDouble);
    comm::wait(pg->allreduce(mean_loss, comm::ReduceOp::kAvg));
    accuracy = evaluate(model, sharded.get(), test, *pg);
    if (lead) {
      std::printf("epoch %lld/%d  %.0f images/s (all ranks)  loss %.4f  test accuracy %.4f\n",
                  static_cast<long long>(epoch), args.epochs, sampler.size() * pg->size() / secs,
                  mean_loss.item<double>(), accuracy);
      std::fflush(stdout);
    }
    if (args.min_accuracy > 0 && accuracy >= args.min_accuracy) {
      if (lead) {
        std::printf("reached --min-accuracy %.2f after epoch %lld of %d: stopping\n", args.min_accuracy,
                    static_cast<long long>(epoch), args.epochs);
        std::fflush(stdout);
      }
      break;
    }
  }
  // Sharded, the parameters exist whole only when gathered (collective).
  uint64_t hash = 0;
  if (sharded) {
    std::vector<at::Tensor> whole;
    for (auto& [name, value] : sharded->full_parameters()) whole.push_back(value);
    hash = examples::tensors_hash(whole);
  } else {
    hash = examples::parameters_hash(*model);
  }
  if (lead) {
    std::printf("final parameters: %016llx\n", static_cast<unsigned long long>(hash));
    std::fflush(stdout);
  }
  return lead ? examples::accuracy_exit_code(accuracy, args.min_accuracy) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::examples::keep_freed_memory();  // before any thread: see examples/data/allocator.h
  try {
    const Args args = parse(argc, argv);
    at::set_num_threads(1);  // one intra-op thread per rank: the ranks share the machine's cores
    rpc::init_rpc();         // rank, world and rendezvous from tandem-run's environment
    const int code = train(args);
    rpc::shutdown();
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_train: %s\n", e.what());
    return 1;
  }
}
