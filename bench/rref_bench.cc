// bench/run.sh rref — Tandem's side. Three workers (tandem-run --nproc-per-node 3); rank 0 measures.
//   remote_to_here_p50_us  remote() of a function making a small tensor on worker 1, then to_here(); p50
//   rref_churn_per_s       RRefs created on worker 1, passed to worker 2 (which drops them), dropped here, until worker
//   1
//                          has freed every one of them (its own count); 128 in flight
// Flags: --small N, --churn N.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <deque>
#include <string>
#include <thread>

#include "bench/common.h"
#include "tandem/rref/rref.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace rref = tandem::rref;
namespace bench = tandem::bench;

int main(int argc, char** argv) {
  int small = 3000, churn = 20000;
  CLI::App app{"RRef creation, fetch and reference churn", "rref_bench"};
  app.add_option("--small", small, "remote() + to_here() round trips");
  app.add_option("--churn", churn, "references created and dropped");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  rpc::register_function("add1", [](at::Tensor x) { return x + 1; });
  rpc::register_function("touch", [](c10::IValue r) { return rref::RRef::from_ivalue(r).owner(); });
  rpc::register_function("owned", [] { return rref::stats().owned_values; });
  rpc::init_rpc();
  if (rpc::get_worker_info().id == 0) {
    const std::string cond = "\"processes\":3,\"intra_op_threads\":1";
    const at::Tensor x = at::ones({1});
    for (int i = 0; i < 300; ++i) rref::remote(1, "add1", x).to_here();
    std::vector<double> t;
    for (int i = 0; i < small; ++i) {
      const double t0 = bench::now_us();
      rref::remote(1, "add1", x).to_here();
      t.push_back(bench::now_us() - t0);
    }
    bench::emit("rref", "remote_to_here_p50_us", bench::median(t), "us", cond + ",\"iters\":" + std::to_string(small));

    const double t0 = bench::now_us();
    std::deque<rpc::Future> window;
    for (int i = 0; i < churn; ++i) {
      if (window.size() == 128) {
        window.front().value();
        window.pop_front();
      }
      rref::RRef r = rref::remote(1, "add1", x);
      window.push_back(rpc::rpc_async(2, "touch", r.to_ivalue()));
    }  // each r is dropped here, as soon as it was passed on
    for (auto& f : window) f.value();
    while (rpc::rpc_sync<int64_t>(1, "owned") != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    const double dt = bench::now_us() - t0;
    bench::emit("rref", "rref_churn_per_s", churn / dt * 1e6, "rrefs/s", cond + ",\"rrefs\":" + std::to_string(churn));
  }
  rpc::shutdown();
  return 0;
}
