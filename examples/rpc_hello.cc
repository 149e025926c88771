// A complete Tandem RPC program: every worker registers functions, joins the job, and rank 0 calls the others.
//
//   build/tandem-run --nproc-per-node 3 build/rpc_hello
#include <ATen/ATen.h>

#include <chrono>
#include <iostream>

#include "tandem/rpc/rpc.h"

namespace rpc = tandem::rpc;
using namespace std::chrono_literals;

int main() try {
  // 1. Functions peers may call, by name, with typed signatures.
  rpc::register_function("add", [](at::Tensor a, at::Tensor b) { return a + b; });
  rpc::register_function("describe", [](std::string who, std::vector<int64_t> shape) {
    return who + " asked " + rpc::get_worker_info().name + " about a tensor of " + std::to_string(shape.size()) +
           " dims";
  });
  // An async function: the reply is sent when the returned future completes, without holding a server thread.
  rpc::register_function("delayed_double", [](at::Tensor x) {
    rpc::Future done;
    std::thread([done, x]() mutable {
      std::this_thread::sleep_for(10ms);
      done.set_value(x * 2);
    }).detach();
    return done;
  });

  // 2. Join the job described by the environment tandem-run sets (RANK, WORLD_SIZE, MASTER_ADDR, ...).
  rpc::init_rpc();
  const auto me = rpc::get_worker_info();

  // 3. Rank 0 calls every other worker: synchronously, asynchronously, and catching a remote error.
  if (me.id == 0) {
    for (const auto& peer : rpc::get_all_worker_infos()) {
      if (peer.id == 0) continue;
      at::Tensor sum = rpc::rpc_sync<at::Tensor>(peer.name, "add", at::ones({2, 2}), at::full({2, 2}, peer.id));
      std::cout << "add on " << peer.name << ": " << sum.sum().item<float>() << "\n";
      std::cout << rpc::rpc_sync<std::string>(peer.name, "describe", me.name, std::vector<int64_t>{2, 3, 4}) << "\n";
      rpc::Future f = rpc::rpc_async(peer.name, "delayed_double", at::arange(3), 2s);
      std::cout << "delayed_double: " << f.get<at::Tensor>().sum().item<int64_t>() << "\n";
      try {
        rpc::rpc_sync(peer.name, "no_such_function");
      } catch (const tandem::RpcError& e) {
        std::cout << "expected error: " << e.what() << "\n";
      }
    }
  }
  // 4. Everyone leaves together once all calls are done.
  rpc::shutdown();
  std::cout << me.name << " done\n";
  return 0;
} catch (const std::exception& e) {  // outside a launcher, a peer gone, ...: the error names the worker and call
  std::cerr << "rpc_hello: " << e.what() << "\n";
  if (rpc::is_initialized()) rpc::shutdown(/*graceful=*/false);
  return 1;
}
