// Two workers call each other through an installed Tandem: a function call each way, and an RRef to a value the
// other worker owns. Run by tests/install/run.sh as `tandem-run --nproc-per-node 2 consumer`.
#include <ATen/ATen.h>

#include <iostream>

#include "tandem/rpc/rpc.h"
#include "tandem/rref/rref.h"

namespace rpc = tandem::rpc;

int main() {
  rpc::register_function("scale", [](at::Tensor x, double by) { return x * by; });
  rpc::register_function("make", [](int64_t n) { return at::arange(n); });
  rpc::init_rpc();
  const auto me = rpc::get_worker_info();
  const std::string peer = rpc::get_worker_info(1 - me.id).name;
  const double got = rpc::rpc_sync<at::Tensor>(peer, "scale", at::ones({4}), me.id + 2.0).sum().item<double>();
  auto held = tandem::rref::remote_as<at::Tensor>(peer, "make", int64_t{5});
  const int64_t fetched = held.to_here().sum().item<int64_t>();
  std::cout << me.name << " scale " << got << " rref " << fetched << "\n";
  rpc::shutdown();
  return got == 4 * (me.id + 2.0) && fetched == 10 ? 0 : 1;
}
