// A worker of an elastic round that does what init_rpc's rendezvous does with the round's master port, without
// LibTorch: rank 0 serves the job's store on MASTER_ADDR:MASTER_PORT, every rank meets the others there and leaves
// once all have met. launchers.sh's `ports` mode restarts it 100 times: a worker on LibTorch costs about a second of
// CPU to start on a slow 2-core machine (its static initialisers), 200 of them most of that test's minutes.
//
//   tandem-run --nnodes 2 ... -- elastic_store_worker      (exit 0 once every rank met; 1 with the error printed)
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tandem/rpc/store.h"

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    std::cerr << "elastic_store_worker: " << name << " is not set (start it under tandem-run)\n";
    std::exit(1);
  }
  return v;
}

int env_int(const char* name) {
  int v = 0;
  if (!absl::SimpleAtoi(env(name), &v)) {
    std::cerr << "elastic_store_worker: " << name << "='" << env(name) << "' is not a number\n";
    std::exit(1);
  }
  return v;
}

int fail(const std::string& rank, const absl::Status& s) {
  std::cerr << "elastic_store_worker rank " << rank << ": " << s << "\n";
  return 1;
}

}  // namespace

int main() {
  namespace rpc = tandem::rpc;
  const int rank = env_int("RANK");
  const int world_size = env_int("WORLD_SIZE");
  const std::string master = absl::StrCat(env("MASTER_ADDR"), ":", env("MASTER_PORT"));
  const std::string secret = env("TANDEM_SECRET");
  const std::string me = std::to_string(rank);
  constexpr auto kTimeout = std::chrono::seconds(60);
  std::unique_ptr<rpc::StoreServer> server;
  if (rank == 0) {  // binds the round's fresh master port, as rank 0's agent does
    auto served = rpc::serve_store(master, secret);
    if (!served.ok()) return fail(me, served.status());
    server = std::move(*served);
  }
  auto store = rpc::connect_store(master, secret, kTimeout);
  if (auto s = rpc::barrier(*store, "met", rank, world_size, kTimeout); !s.ok()) return fail(me, s);
  // Rank 0 serves until every other rank has seen the barrier pass.
  if (rank != 0) {
    if (auto s = store->set("left/" + me, "1"); !s.ok()) return fail(me, s);
  } else {
    std::vector<int> others;
    for (int r = 1; r < world_size; ++r) others.push_back(r);
    if (auto s = rpc::wait_for_ranks(*store, "left/", others, kTimeout, "leave"); !s.ok()) return fail(me, s);
  }
  std::cout << "rank " << rank << " of " << world_size << " met the others at " << master << "\n";
  return 0;
}
