// bench/run.sh hybrid — Tandem's side. Four workers (tandem-run --nproc-per-node 4): rank 0 the master, ranks 1-2
// DDP trainers, rank 3 the parameter server; the peer (bench/peer_hybrid.py) runs PyTorch's "Combining Distributed
// DataParallel with Distributed RPC Framework" tutorial design on the same model and batches.
//   hybrid_iter_ms   the examples/hybrid model (EmbeddingBag 1568 x 64, sum, on the parameter server; a dense
//                    64-128-10 part under DDP on each trainer), batches of 64 bags of 196 random token ids per trainer,
//                    cross entropy; one iteration = forward in a distributed autograd context, distributed backward
//                    (DDP's buckets reduced during it), reduce_context_gradients, DistributedOptimizer (SGD) step. The
//                    slower trainer's median over --iters iterations after 5 warm-up ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <string>

#include "bench/common.h"
#include "examples/hybrid/hybrid.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace rref = tandem::rref;
namespace bench = tandem::bench;
namespace hybrid = tandem::examples::hybrid;

namespace {

constexpr int64_t kBatch = 64, kBag = 196, kTokens = 1568, kDim = 64;

double run_trainer(c10::IValue embedding, int64_t iters) {
  auto pg = tandem::comm::ProcessGroup::create("bench_trainers", {1, 2});
  hybrid::Trainer trainer(tandem::nn::RemoteModule::from_rref(rref::RRef::from_ivalue(embedding)), pg, kDim, 0.05);
  auto gen = at::detail::createCPUGenerator(100 + rpc::get_worker_info().id);
  at::Tensor ids = at::randint(0, kTokens, {kBatch * kBag}, gen, at::kLong);
  at::Tensor offsets = at::arange(0, kBatch * kBag, kBag, at::kLong);
  at::Tensor target = at::randint(0, 10, {kBatch}, gen, at::kLong);
  std::vector<double> t;
  for (int64_t i = 0; i < iters + 5; ++i) {
    const double t0 = bench::now_us();
    trainer.step(ids, offsets, target);
    if (i >= 5) t.push_back((bench::now_us() - t0) / 1000);
  }
  return bench::median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t iters = 50;
  CLI::App app{"Hybrid DDP + parameter-server iteration time", "hybrid_bench"};
  app.add_option("--iters", iters, "timed iterations");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  hybrid::register_modules();
  rpc::register_function("bench.run_trainer", run_trainer);
  rpc::RpcOptions options;
  options.shutdown_timeout = std::chrono::hours(1);
  rpc::init_rpc(options);
  if (rpc::get_worker_info().id == 0) {
    auto embedding = tandem::nn::RemoteModule::create(3, hybrid::kEmbeddingBag, kTokens, kDim);
    auto f1 = rpc::rpc_async(1, "bench.run_trainer", embedding.module_rref().to_ivalue(), iters, std::chrono::hours(1));
    auto f2 = rpc::rpc_async(2, "bench.run_trainer", embedding.module_rref().to_ivalue(), iters, std::chrono::hours(1));
    const double m1 = f1.get<double>(), m2 = f2.get<double>();
    bench::emit("hybrid", "hybrid_iter_ms", std::max(m1, m2), "ms",
                "\"processes\":4,\"intra_op_threads\":1,\"trainers\":2,\"batch\":64,\"bag\":196,\"embeddings\":1568,"
                "\"dim\":64,\"iters\":" +
                    std::to_string(iters) + ",\"trainer_ms\":[" + std::to_string(m1) + "," + std::to_string(m2) + "]");
  }
  rpc::shutdown();
  return 0;
}
