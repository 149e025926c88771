// bench/run.sh rpc — Tandem's side. Two workers (tandem-run --nproc-per-node 2); rank 0 measures, rank 1 serves.
//   small_rtt_p50_us       rpc_sync of a registered add on a 1-element tensor, p50 round trip
//   bulk_64MiB_GBps        one 64 MiB float tensor sent, a tiny reply (its element count); median over repeats
//   async_128_calls_per_s  tiny calls, 128 in flight at any time
// Flags: --small N (round trips), --bulk N (transfers), --async N (calls), --bulk-mib M. Each process runs with one
// intra-op thread, as the PyTorch peer does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <deque>
#include <string>

#include "bench/common.h"
#include "rpc/rpc.h"

namespace rpc = tandem::rpc;
namespace bench = tandem::bench;

int main(int argc, char** argv) {
  int small = 5000, bulk = 20, calls = 50000, mib = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (f == "--small") small = v;
    else if (f == "--bulk") bulk = v;
    else if (f == "--async") calls = v;
    else if (f == "--bulk-mib") mib = v;
  }
  at::set_num_threads(1);
  rpc::register_function("add", [](at::Tensor a, at::Tensor b) { return a + b; });
  rpc::register_function("numel", [](at::Tensor a) { return a.numel(); });
  rpc::init_rpc();
  if (rpc::get_worker_info().id == 0) {
    const std::string cond = "\"processes\":2,\"intra_op_threads\":1";
    const at::Tensor one = at::ones({1});
    // Small round trips.
    for (int i = 0; i < 500; ++i) rpc::rpc_sync<at::Tensor>(1, "add", one, one);
    std::vector<double> rtt;
    rtt.reserve(small);
    for (int i = 0; i < small; ++i) {
      const double t0 = bench::now_us();
      rpc::rpc_sync<at::Tensor>(1, "add", one, one);
      rtt.push_back(bench::now_us() - t0);
    }
    bench::emit(
        "rpc", "small_rtt_p50_us", bench::median(rtt), "us",
        cond + ",\"iters\":" + std::to_string(small) + ",\"p99_us\":" + std::to_string(bench::percentile(rtt, 0.99)));

    // Bulk: one tensor of `mib` MiB per call.
    const at::Tensor big = at::rand({int64_t{mib} << 18});
    std::vector<double> gbps;
    for (int i = 0; i < bulk + 2; ++i) {
      const double t0 = bench::now_us();
      const int64_t n = rpc::rpc_sync<int64_t>(1, "numel", big);
      const double dt = bench::now_us() - t0;
      if (n != big.numel()) return 1;
      if (i >= 2) gbps.push_back(big.nbytes() / dt / 1e3);
    }
    bench::emit("rpc", "bulk_" + std::to_string(mib) + "MiB_GBps", bench::median(gbps), "GB/s",
                cond + ",\"iters\":" + std::to_string(bulk));

    // Throughput with a window of 128 calls in flight.
    std::deque<rpc::Future> window;
    const double t0 = bench::now_us();
    for (int i = 0; i < calls; ++i) {
      if (window.size() == 128) {
        window.front().value();
        window.pop_front();
      }
      window.push_back(rpc::rpc_async(1, "add", one, one));
    }
    for (auto& f : window) f.value();
    const double dt = bench::now_us() - t0;
    bench::emit("rpc", "async_128_calls_per_s", calls / dt * 1e6, "calls/s",
                cond + ",\"calls\":" + std::to_string(calls));
  }
  rpc::shutdown();
  return 0;
}
