// bench/run.sh rpc — Tandem's side. Two workers (tandem-run --nproc-per-node 2); rank 0 measures, rank 1 serves.
//   small_rtt_p50_us       rpc_sync of a registered add on a 1-element tensor, p50 round trip
//   bulk_64MiB_GBps        one 64 MiB float tensor sent, a tiny reply (its element count); median over repeats
//   async_128_calls_per_s  tiny calls, 128 in flight at any time
// Rank 0 also measures the floors of the first two in the same run ("impl":"floor"): the round trip's before RPC starts
// (emit_floors below), the bulk figure's beside each transfer (raw_read: the callee's own process_vm_readv of the
// caller's tensor, which is what the bulk path does, without the call around it).
// Flags: --small N (round trips), --bulk N (transfers), --async N (calls), --bulk-mib M; a count of 0 skips its
// figure. --bulk-kib K sends K KiB instead (metric bulk_<K>KiB_GBps); --bulk-min-bytes B sets RpcOptions::
// bulk_min_bytes (0: no bulk path; bench/run.sh bulk-threshold compares both paths by size); --threads T sets
// RpcOptions::num_worker_threads; --sync-spin-us / --serve-spin-us the spins. Each process runs with
// one intra-op thread, as the PyTorch peer does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "bench/common.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace bench = tandem::bench;

namespace {

using bench::full_io;

// The bytes one small round trip moves on the direct channel, each way: the channel's 24-byte message header
// (rpc/detail/direct.h, "Messages") and the frame of the request, then of its reply, encoded as the agent encodes
// them (rpc/agent_client.cc, encode_request: function, caller's name and rank, the arguments; agent_server.cc, reply).
struct SmallCallBytes {
  size_t request = 0, reply = 0;
};
SmallCallBytes small_call_bytes(const at::Tensor& a, const at::Tensor& b) {
  constexpr size_t kDirectHeader = 24;
  tandem::wire::Request request;
  request.set_function("add");
  request.set_caller_name("worker0");  // rpc::init_rpc's name for rank 0
  request.set_caller_rank(0);
  rpc::wire::Encoder to_server(0, 1);
  tandem::wire::Response response;
  rpc::wire::Encoder to_caller(0, 0);
  if (!to_server.encode({a, b}, request.mutable_args()).ok() ||
      !to_caller.encode({a + b}, response.mutable_result()).ok()) {
    return {};
  }
  return {kDirectHeader + to_server.frame(request).Length(), kDirectHeader + to_caller.frame(response).Length()};
}

// The floors of the direct channel's figures, measured between this process and a child forked before any thread
// starts (the child only reads, writes and exits), on the same kinds of kernel paths the channel uses:
//   small_rtt_p50_us  a blocking ping-pong over a Unix stream socket (no spinning) of the bytes the measured call moves
//                     (small_call_bytes: the request's one way, the reply's back); beside it same_core_us and
//                     cross_core_us, the same with both processes pinned to one core and to two
// Emitted as "impl":"floor". Returns false when the machine refuses it. With `mib` > 0, `*forked_gbps` receives the
// median of `bulk` process_vm_readv of the child's `mib` MiB into a buffer already faulted in (0 if refused): the bulk
// floor measured as before 2026-12-03, shown beside the one measured with the calls (main()).
bool emit_floors(int small, SmallCallBytes call, int bulk, int mib, double* forked_gbps) {
  if (call.request == 0 || call.reply == 0) return false;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return false;
  const size_t bytes = size_t{static_cast<unsigned>(std::max(mib, 0))} << 20;
  std::vector<char> source(bytes, 1);  // the child's copy is what the parent reads
  std::vector<char> request(call.request, 'p'), reply(call.reply, 'r');
  const pid_t child = fork();
  if (child == 0) {
    close(sv[0]);
    void* where = source.data();
    full_io(sv[1], &where, sizeof where, true);
    while (full_io(sv[1], request.data(), request.size(), false) && request[0] != 'q') {
      full_io(sv[1], reply.data(), reply.size(), true);
    }
    _exit(0);
  }
  close(sv[1]);
  void* remote = nullptr;
  bool ok = child > 0 && full_io(sv[0], &remote, sizeof remote, false);
  const std::string cond = "\"processes\":2";
  if (ok && small > 0) {
    auto pingpong = [&](int iters) {
      std::vector<double> rtt;
      for (int i = 0; i < iters + 500 && ok; ++i) {
        const double t0 = bench::now_us();
        ok = full_io(sv[0], request.data(), request.size(), true) && full_io(sv[0], reply.data(), reply.size(), false);
        if (i >= 500) rtt.push_back(bench::now_us() - t0);
      }
      return rtt.empty() ? 0.0 : bench::median(rtt);
    };
    const double floor_us = pingpong(small);
    // The same with both processes pinned to one core (they take turns: no other core is woken) and to two (every
    // message wakes the other core): left to the scheduler, the figure above lands on either, run by run. Extra
    // fields of the floor line; skipped where the machine has one core or refuses the pinning.
    std::string pinned;
    cpu_set_t all;
    if (sysconf(_SC_NPROCESSORS_ONLN) >= 2 && sched_getaffinity(0, sizeof all, &all) == 0) {
      auto pin = [](pid_t pid, int cpu) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        return sched_setaffinity(pid, sizeof one, &one) == 0;
      };
      if (pin(0, 0) && pin(child, 0)) {
        const double same = pingpong(small / 2);
        if (pin(child, 1)) {
          const double cross = pingpong(small / 2);
          pinned = ",\"same_core_us\":" + std::to_string(same) + ",\"cross_core_us\":" + std::to_string(cross);
        }
      }
      sched_setaffinity(0, sizeof all, &all);  // this process goes on as rank 0: every core again
    }
    if (ok) {
      bench::emit_floor("rpc", "small_rtt_p50_us", floor_us, "us",
                        cond + ",\"what\":\"blocking ping-pong over a Unix stream socket of the call's bytes\"" +
                            ",\"request_bytes\":" + std::to_string(call.request) + ",\"reply_bytes\":" +
                            std::to_string(call.reply) + ",\"iters\":" + std::to_string(small) + pinned);
    }
  }
  *forked_gbps = 0;
  if (ok && bulk > 0 && bytes > 0) {
    std::vector<char> dst(bytes, 0);  // faulted in
    std::vector<double> gbps;
    for (int i = 0; i < bulk + 2; ++i) {
      iovec local{dst.data(), bytes}, from{remote, bytes};
      const double t0 = bench::now_us();
      if (process_vm_readv(child, &local, 1, &from, 1, 0) != static_cast<ssize_t>(bytes)) break;
      if (i >= 2) gbps.push_back(bytes / (bench::now_us() - t0) / 1e3);
    }
    if (gbps.size() == static_cast<size_t>(bulk)) *forked_gbps = bench::median(gbps);
  }
  request[0] = 'q';
  full_io(sv[0], request.data(), request.size(), true);
  close(sv[0]);
  if (child > 0) waitpid(child, nullptr, 0);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int small = 5000, bulk = 20, calls = 50000, mib = 64, kib = 0;
  int64_t bulk_min_bytes = -1;  // -1: the library's default
  int64_t sync_spin_us = -1;    // -1: the library's default
  int64_t serve_spin_us = -1;   // -1: the library's default
  int threads = 0;              // 0: the library's default
  CLI::App app{"RPC round trips, bulk transfers and calls in flight", "rpc_bench"};
  app.add_option("--small", small, "small round trips");
  app.add_option("--bulk", bulk, "bulk transfers");
  app.add_option("--async", calls, "tiny calls, 128 in flight");
  app.add_option("--bulk-mib", mib, "bulk tensor size in MiB");
  app.add_option("--bulk-kib", kib, "bulk tensor size in KiB (wins over --bulk-mib when > 0)");
  app.add_option("--bulk-min-bytes", bulk_min_bytes, "RpcOptions::bulk_min_bytes (-1: the library's default)");
  app.add_option("--sync-spin-us", sync_spin_us, "RpcOptions::sync_spin in microseconds (-1: the library's default)");
  app.add_option("--serve-spin-us", serve_spin_us,
                 "RpcOptions::serve_spin in microseconds (-1: the library's default)");
  app.add_option("--threads", threads, "RpcOptions::num_worker_threads (0: the library's default)");
  tandem::tools::parse_flags(app, argc, argv);
  // The floors first, on rank 0, before init_rpc starts any thread (the child is forked).
  // TANDEM_BENCH_FLOORS=0 skips them (bench/run.sh hosts, whose floor is a TCP ping-pong between the hosts).
  const char* floors = std::getenv("TANDEM_BENCH_FLOORS");
  const char* r = std::getenv("RANK");
  const at::Tensor one = at::ones({1});  // the small round trips' arguments: add(one, one)
  const bool with_floors = !floors || std::string(floors) != "0";
  double forked_gbps = 0;
  if (with_floors && r && std::string(r) == "0" &&
      !emit_floors(small, small_call_bytes(one, one), bulk, kib > 0 ? 0 : mib, &forked_gbps)) {
    std::fprintf(stderr, "rpc_bench: the round trip's floor could not be measured (socketpair or fork failed)\n");
  }
  at::set_num_threads(1);
  rpc::register_function("add", [](at::Tensor a, at::Tensor b) { return a + b; });
  rpc::register_function("numel", [](at::Tensor a) { return a.numel(); });
  // The bulk figure's floor: the callee reads `bytes` at `address` of process `pid` (the caller's tensor) with one
  // process_vm_readv into a buffer of its own already faulted in; the read's time in microseconds, -1 if it failed.
  rpc::register_function("raw_read", [](int64_t pid, int64_t address, int64_t bytes) {
    static std::vector<char> dst;
    if (bytes <= 0 || bytes > (int64_t{1} << 32)) return -1.0;
    if (dst.size() != static_cast<size_t>(bytes)) dst.assign(static_cast<size_t>(bytes), 1);
    iovec local{dst.data(), dst.size()}, from{reinterpret_cast<void*>(address), dst.size()};
    const double t0 = bench::now_us();
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &from, 1, 0);
    const double us = bench::now_us() - t0;
    return n == bytes ? us : -1.0;
  });
  rpc::RpcOptions options;
  if (bulk_min_bytes >= 0) options.bulk_min_bytes = bulk_min_bytes;
  if (sync_spin_us >= 0) options.sync_spin = std::chrono::microseconds(sync_spin_us);
  if (serve_spin_us >= 0) options.serve_spin = std::chrono::microseconds(serve_spin_us);
  if (threads > 0) options.num_worker_threads = threads;
  rpc::init_rpc(options);
  if (rpc::get_worker_info().id == 0) {
    const std::string cond = "\"processes\":2,\"intra_op_threads\":1";
    // Small round trips (the warm-up also opens the connection for the other figures).
    for (int i = 0; i < 500; ++i) rpc::rpc_sync<at::Tensor>(1, "add", one, one);
    if (small > 0) {
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
    }

    // Bulk: one tensor of `mib` MiB per call.
    if (bulk > 0) {
      const at::Tensor big = kib > 0 ? at::rand({int64_t{kib} << 8}) : at::rand({int64_t{mib} << 18});
      std::vector<double> gbps, floor_gbps;
      for (int i = 0; i < bulk + 2; ++i) {
        const double t0 = bench::now_us();
        const int64_t n = rpc::rpc_sync<int64_t>(1, "numel", big);
        const double dt = bench::now_us() - t0;
        if (n != big.numel()) return 1;
        if (i >= 2) gbps.push_back(big.nbytes() / dt / 1e3);
        if (with_floors) {  // right after each call, so both see the memory as it is at that moment
          const double us = rpc::rpc_sync<double>(1, "raw_read", static_cast<int64_t>(getpid()),
                                                  static_cast<int64_t>(reinterpret_cast<uintptr_t>(big.data_ptr())),
                                                  static_cast<int64_t>(big.nbytes()));
          if (us > 0 && i >= 2) floor_gbps.push_back(big.nbytes() / us / 1e3);
        }
      }
      const std::string size = kib > 0 ? std::to_string(kib) + "KiB" : std::to_string(mib) + "MiB";
      if (with_floors && floor_gbps.size() == static_cast<size_t>(bulk)) {
        bench::emit_floor("rpc", "bulk_" + size + "_GBps", bench::median(floor_gbps), "GB/s",
                          cond + ",\"what\":\"process_vm_readv of the caller's tensor by the callee into a buffer " +
                              "already faulted in, right after each call\",\"iters\":" + std::to_string(bulk) +
                              ",\"forked_child_GBps\":" + std::to_string(forked_gbps));
      } else if (with_floors) {
        std::fprintf(stderr, "rpc_bench: the bulk floor could not be measured (process_vm_readv failed)\n");
      }
      bench::emit("rpc", "bulk_" + size + "_GBps", bench::median(gbps), "GB/s",
                  cond + ",\"iters\":" + std::to_string(bulk) + ",\"bulk_min_bytes\":" +
                      std::to_string(bulk_min_bytes >= 0 ? bulk_min_bytes : rpc::RpcOptions{}.bulk_min_bytes));
    }

    // Throughput with a window of 128 calls in flight.
    if (calls > 0) {
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
  }
  rpc::shutdown();
  return 0;
}
