// bench/run.sh collectives — Tandem's side. Two ranks (tandem-run --nproc-per-node 2): the default process group
// (shared memory on one host; "tandem") and one forced onto Gloo ("tandem_gloo"). Rank 0 reports, per group and
// size, the median time of an allreduce (sum, float32) issued and waited back to back, and the bus bandwidth
// busbw = 2 (n-1)/n * bytes / time (NCCL-tests' definition; n = 2 gives bytes / time):
//   allreduce_4B_us, allreduce_1MiB_busbw_GBps, allreduce_64MiB_busbw_GBps, broadcast_64MiB_GBps (bytes / time)
// and, as "impl":"floor", a plain copy of 64 MiB in the same run. On shared memory also, as "tandem_shared_tensor",
// the allreduce of a ProcessGroup::shared_tensor (reduced where it is, no copies in and out; DDP's buckets are ones).
// Flags: --iters N (64 MiB iterations; smaller sizes run 10× or 100× more).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "bench/common.h"
#include "tandem/comm/process_group.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace bench = tandem::bench;
namespace comm = tandem::comm;
namespace rpc = tandem::rpc;

namespace {

// Median microseconds of `iters` runs of `op` (after a tenth, at least one, as warm-up); the ranks start together.
double time_op(comm::ProcessGroup& pg, int iters, const std::function<rpc::Future()>& op) {
  std::vector<double> t;
  comm::wait(pg.barrier());
  for (int i = 0; i < iters + std::max(1, iters / 10); ++i) {
    const double t0 = bench::now_us();
    comm::wait(op());
    if (i >= std::max(1, iters / 10)) t.push_back(bench::now_us() - t0);
  }
  return bench::median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  CLI::App app{"Collectives' bus bandwidth and latency (allreduce, broadcast, allgather, ...)", "collectives_bench"};
  app.add_option("--iters", iters, "64 MiB iterations (smaller sizes run 10x or 100x more)");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  rpc::init_rpc();
  // The default group (shared memory when both ranks are on this host, Gloo otherwise: its transport is reported) and
  // one forced onto Gloo, as "tandem_gloo".
  auto pg = comm::ProcessGroup::create("bench");
  auto gloo = comm::ProcessGroup::create("bench_gloo", {}, {.shared_memory = comm::SharedMemory::kNever});
  const int n = pg->size();
  const double factor = 2.0 * (n - 1) / n;
  auto tiny = at::ones({1});
  auto mib = at::ones({1 << 18});
  auto big = at::ones({16 << 20});
  for (comm::ProcessGroup* g : {pg.get(), gloo.get()}) {
    const std::string impl = g == pg.get() ? "tandem" : "tandem_gloo";
    const std::string cond =
        "\"processes\":" + std::to_string(n) + ",\"intra_op_threads\":1,\"backend\":\"" + g->transport() + "\"";
    const double t_tiny = time_op(*g, iters * 100, [&] { return g->allreduce(tiny); });
    const double t_mib = time_op(*g, iters * 10, [&] { return g->allreduce(mib); });
    const double t_big = time_op(*g, iters, [&] { return g->allreduce(big); });
    const double t_bcast = time_op(*g, iters, [&] { return g->broadcast(big, 0); });
    if (g->rank() != 0) continue;
    bench::emit_as(impl, "collectives", "allreduce_4B_us", t_tiny, "us",
                   cond + ",\"iters\":" + std::to_string(iters * 100));
    bench::emit_as(impl, "collectives", "allreduce_1MiB_busbw_GBps", factor * mib.nbytes() / t_mib / 1e3, "GB/s",
                   cond + ",\"iters\":" + std::to_string(iters * 10));
    bench::emit_as(impl, "collectives", "allreduce_64MiB_busbw_GBps", factor * big.nbytes() / t_big / 1e3, "GB/s",
                   cond + ",\"iters\":" + std::to_string(iters) + ",\"median_ms\":" + std::to_string(t_big / 1e3));
    bench::emit_as(impl, "collectives", "broadcast_64MiB_GBps", big.nbytes() / t_bcast / 1e3, "GB/s",
                   cond + ",\"iters\":" + std::to_string(iters));
  }
  if (at::Tensor shared = pg->shared_tensor(big.numel(), at::kFloat); shared.defined()) {
    shared.fill_(1);
    at::Tensor shared_mib = shared.narrow(0, 0, mib.numel());
    const double t_mib = time_op(*pg, iters * 10, [&] { return pg->allreduce(shared_mib); });
    const double t_big = time_op(*pg, iters, [&] { return pg->allreduce(shared); });
    if (pg->rank() == 0) {
      const std::string cond = "\"processes\":" + std::to_string(n) +
                               ",\"intra_op_threads\":1,\"backend\":\"shared_memory\",\"tensor\":\"shared\"";
      bench::emit_as("tandem_shared_tensor", "collectives", "allreduce_1MiB_busbw_GBps",
                     factor * mib.nbytes() / t_mib / 1e3, "GB/s", cond + ",\"iters\":" + std::to_string(iters * 10));
      bench::emit_as("tandem_shared_tensor", "collectives", "allreduce_64MiB_busbw_GBps",
                     factor * big.nbytes() / t_big / 1e3, "GB/s",
                     cond + ",\"iters\":" + std::to_string(iters) + ",\"median_ms\":" + std::to_string(t_big / 1e3));
    }
  }
  comm::wait(pg->barrier());
  if (pg->rank() == 0) {
    // The floor: one plain copy of the same 64 MiB into a buffer already faulted in, on one core, while the other rank
    // waits at the next barrier (an allreduce moves at least that much through memory on each rank).
    at::Tensor dst = at::empty_like(big).fill_(0);
    std::vector<double> t;
    for (int i = 0; i < iters + 1; ++i) {
      const double t0 = bench::now_us();
      dst.copy_(big);
      if (i > 0) t.push_back(bench::now_us() - t0);
    }
    const double copy_us = bench::median(t);
    bench::emit_floor("collectives", "allreduce_64MiB_busbw_GBps", big.nbytes() / copy_us / 1e3, "GB/s",
                      "\"what\":\"memcpy of 64 MiB\",\"iters\":" + std::to_string(iters));
  }
  comm::wait(pg->barrier());
  rpc::shutdown();
  return 0;
}
