// Hybrid DDP + model parallelism on Fashion-MNIST, in the layout of PyTorch's "Combining Distributed DataParallel with
// Distributed RPC Framework" tutorial:
//
//   build/tandem-run --nproc-per-node 4 build/hybrid_train [--epochs 5] [--lr 0.05] [--batch 64]
//
// Rank 0 is the master: it creates the embedding table on the parameter server (rank 3, a RemoteModule around an
// EmbeddingBag of 1,568 tokens x 64) and starts the two trainers (ranks 1 and 2), which train a dense part (64-128-10)
// under DistributedDataParallel, each on its half of the data (DistributedSampler). An image becomes a bag of tokens:
// each 2x2 patch's mean brightness, quantised to 8 levels, at its position (196 patches x 8 levels). Every iteration
// runs in a distributed autograd context: the embedding's gradients go to the parameter server, the dense part's are
// averaged by DDP's buckets during the distributed backward, and DistributedOptimizer (SGD) steps both. Trainer 1
// prints progress, and per epoch the loss, images/s and the test accuracy.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "examples/data/allocator.h"
#include "examples/data/cnn.h"
#include "examples/data/fashion_mnist.h"
#include "examples/hybrid/hybrid.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/sampler.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

using namespace tandem;
namespace hybrid = tandem::examples::hybrid;

namespace {

constexpr int64_t kPool = 2, kSide = 28 / kPool, kLevels = 8, kPatches = kSide * kSide, kTokens = kPatches * kLevels;
constexpr int64_t kDim = 64;

// [N, 196] token ids: patch p's mean brightness in level l gives token p * 8 + l.
at::Tensor tokens(const at::Tensor& images, double lo, double hi) {
  at::Tensor means = at::avg_pool2d(images, {kPool, kPool}).view({images.size(0), kPatches});
  at::Tensor level = ((means - lo) / (hi - lo) * kLevels).floor().clamp(0, kLevels - 1).to(at::kLong);
  return level + at::arange(kPatches, at::kLong).view({1, kPatches}) * kLevels;
}

at::Tensor offsets(int64_t bags) { return at::arange(0, bags * kPatches, kPatches, at::kLong); }

// The trainers' side, run through RPC by the master; returns the final test accuracy (trainer 1) or -1.
double train(c10::IValue embedding, int64_t epochs, double lr, int64_t batch, int64_t limit) {
  auto pg = comm::ProcessGroup::create("hybrid_trainers", {1, 2});
  const bool lead = pg->rank() == 0;
  examples::Dataset data = examples::load_fashion_mnist("train");
  examples::Dataset test = examples::load_fashion_mnist("t10k");
  const double lo = data.images.min().item<double>(), hi = data.images.max().item<double>();
  at::Tensor train_ids = tokens(data.images, lo, hi), test_ids = tokens(test.images, lo, hi);
  const int64_t n = limit > 0 ? std::min(limit, train_ids.size(0)) : train_ids.size(0);
  hybrid::Trainer trainer(nn::RemoteModule::from_rref(rref::RRef::from_ivalue(embedding)), pg, kDim, lr);
  ddp::DistributedSampler sampler(static_cast<size_t>(n), *pg, {.shuffle = true, .seed = 42});
  const int64_t steps = static_cast<int64_t>((sampler.size() + batch - 1) / batch);
  double accuracy = -1;
  for (int64_t epoch = 1; epoch <= epochs; ++epoch) {
    sampler.set_epoch(static_cast<size_t>(epoch));
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    int64_t step = 0;
    while (auto b = sampler.next(static_cast<size_t>(batch))) {
      at::Tensor idx = at::tensor(std::vector<int64_t>(b->begin(), b->end()), at::kLong);
      loss_sum += trainer.step(train_ids.index_select(0, idx).reshape({-1}), offsets(idx.size(0)),
                               data.labels.index_select(0, idx));
      if (lead && ++step % 100 == 0) {
        std::printf("  epoch %lld  step %lld/%lld  loss %.4f\n", static_cast<long long>(epoch),
                    static_cast<long long>(step), static_cast<long long>(steps), loss_sum / static_cast<double>(step));
        std::fflush(stdout);
      }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!lead) continue;
    int64_t correct = 0;
    for (int64_t i = 0; i < test_ids.size(0); i += 1000) {
      at::Tensor ids = test_ids.slice(0, i, i + 1000);
      at::Tensor pred = trainer.predict(ids.reshape({-1}), offsets(ids.size(0))).argmax(1);
      correct += pred.eq(test.labels.slice(0, i, i + 1000)).sum().item<int64_t>();
    }
    accuracy = static_cast<double>(correct) / static_cast<double>(test_ids.size(0));
    std::printf("epoch %lld/%lld  %.0f images/s (both trainers)  loss %.4f  test accuracy %.4f\n",
                static_cast<long long>(epoch), static_cast<long long>(epochs),
                static_cast<double>(sampler.size() * 2) / secs,
                loss_sum / static_cast<double>(std::max<int64_t>(1, steps)), accuracy);
    std::fflush(stdout);
  }
  return accuracy;
}

struct Args {
  int64_t epochs = 5, batch = 64, limit = 0;
  double lr = 0.05, min_accuracy = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Hybrid parallelism on Fashion-MNIST: DDP trainers and a parameter server holding the embedding (start it with "
      "tandem-run)",
      "hybrid_train"};
  app.add_option("--epochs", a.epochs, "epochs to train");
  app.add_option("--lr", a.lr, "SGD's step size");
  app.add_option("--batch", a.batch, "images per step on each trainer")->check(CLI::PositiveNumber);
  app.add_option("--limit", a.limit, "train on at most this many images (0: all 60,000)");
  app.add_option("--min-accuracy", a.min_accuracy, "exit 1 unless the test accuracy reaches it");
  tools::parse_flags(app, argc, argv);
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::examples::keep_freed_memory();  // before any thread: see examples/data/allocator.h
  try {
    const Args args = parse(argc, argv);
    at::set_num_threads(1);
    hybrid::register_modules();
    rpc::register_function("hybrid.train", train);
    rpc::RpcOptions options;
    options.shutdown_timeout = std::chrono::hours(2);  // the parameter server only serves until training is over
    rpc::init_rpc(options);
    if (rpc::get_all_worker_infos().size() != 4) throw std::invalid_argument("needs 4 workers (--nproc-per-node 4)");
    int code = 0;
    if (rpc::get_worker_info().id == 0) {
      auto embedding = nn::RemoteModule::create(3, hybrid::kEmbeddingBag, kTokens, kDim);
      std::printf(
          "hybrid: embedding table %lld x %lld on %s, 2 DDP trainers, %lld epochs, batch %lld each, SGD lr %g\n",
          static_cast<long long>(kTokens), static_cast<long long>(kDim), embedding.owner_name().c_str(),
          static_cast<long long>(args.epochs), static_cast<long long>(args.batch), args.lr);
      std::fflush(stdout);
      const auto timeout = std::chrono::hours(2);
      auto t1 = rpc::rpc_async(1, "hybrid.train", embedding.module_rref().to_ivalue(), args.epochs, args.lr, args.batch,
                               args.limit, timeout);
      auto t2 = rpc::rpc_async(2, "hybrid.train", embedding.module_rref().to_ivalue(), args.epochs, args.lr, args.batch,
                               args.limit, timeout);
      const double accuracy = t1.get<double>();
      (void)t2.get<double>();
      std::printf("hybrid: final test accuracy %.4f\n", accuracy);
      code = examples::accuracy_exit_code(accuracy, args.min_accuracy);
    }
    rpc::shutdown();
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybrid_train: %s\n", e.what());
    return 1;
  }
}
