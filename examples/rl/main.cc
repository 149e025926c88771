// Reinforcement learning with an agent and observers on CartPole-v1 (PyTorch's RPC RL tutorial, batch variant).
//
//   build/tandem-run --nproc-per-node 5 build/rl_train [--batched 1] [--seed 0] [--max-episodes 3000]
//        [--target 475] [--skip-dead 0] [--lr 0.01]
//
// Rank 0 is the agent (policy 4 -> 128 -> 2, REINFORCE, Adam); ranks 1..N are observers, created by the agent as
// remote objects, each with its own CartPole. Every round, each observer plays one episode concurrently with the
// others, asking the agent for every action: batched, the agent answers all waiting observers from one forward pass
// (rpc/batching.h; a slow or dead observer delays the others by at most 5 ms); unbatched, one call each. After the
// round the agent updates the policy from all trajectories. Each episode updates the running reward
// (0.05 r + 0.95 running); the job ends when it exceeds --target (solved, exit 0) or after --max-episodes (exit 1).
// A dead observer ends the job with an error naming it, or with --skip-dead 1 the agent carries on without it.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>

#include "examples/rl/agent.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

using namespace tandem;
namespace rl = tandem::examples::rl;

namespace {

struct Args {
  bool batched = true;
  uint64_t seed = 0;
  int64_t max_episodes = 3000;
  double target = 475;
  bool skip_dead = false;
  double lr = 1e-2;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"REINFORCE on CartPole: rank 0 is the agent, the other ranks observers (start it with tandem-run)",
               "rl_train"};
  app.add_option("--batched", a.batched, "1: the agent asks every observer's action in one batched call");
  app.add_option("--seed", a.seed, "seed of the environments and the policy");
  app.add_option("--max-episodes", a.max_episodes, "give up (exit 1) after this many episodes");
  app.add_option("--target", a.target, "stop when the running reward passes it");
  app.add_option("--skip-dead", a.skip_dead, "1: carry on without an observer that died");
  app.add_option("--lr", a.lr, "Adam's step size");
  tools::parse_flags(app, argc, argv);
  return a;
}

int train(const Args& args) {
  const int n = static_cast<int>(rpc::get_all_worker_infos().size()) - 1;
  if (n < 1) throw std::invalid_argument("needs an agent and at least one observer (--nproc-per-node 2 or more)");
  auto agent = std::make_shared<rl::Agent>(n, args.seed, args.lr);
  rl::set_agent(agent);
  std::vector<rref::RRef> observers;
  std::vector<int> ids;
  for (int i = 0; i < n; ++i) observers.push_back(rl::make_observer(i + 1, i, args.seed)), ids.push_back(i);
  std::printf("rl: agent and %d observers, %s, seed %llu, target running reward %g\n", n,
              args.batched ? "batched" : "unbatched", static_cast<unsigned long long>(args.seed), args.target);
  std::fflush(stdout);
  double running = 10;
  int64_t episodes = 0, steps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t round = 1; episodes < args.max_episodes; ++round) {
    rl::Round r = rl::run_round(observers, {.batched = args.batched, .skip_failed = args.skip_dead});
    for (const auto& f : r.failed) std::printf("rl: carrying on without %s\n", f.c_str());
    std::vector<int> who;
    double last = 0;
    for (size_t k = 0; k < r.trajectories.size(); ++k) {
      const auto& t = r.trajectories[k];
      last = std::accumulate(t.rewards.begin(), t.rewards.end(), 0.0);
      running = 0.05 * last + 0.95 * running;
      ++episodes;
      steps += static_cast<int64_t>(t.rewards.size());
      who.push_back(ids[r.observers[k]]);
    }
    agent->finish_round(who, r.trajectories);
    if (!r.failed.empty()) {  // keep the observers that answered
      std::vector<rref::RRef> alive;
      std::vector<int> alive_ids;
      for (int k : r.observers) alive.push_back(observers[k]), alive_ids.push_back(ids[k]);
      observers.swap(alive), ids.swap(alive_ids);
      if (observers.empty()) throw std::runtime_error("every observer failed");
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const bool solved = running > args.target;
    if (round % 10 == 0 || solved) {
      std::printf("round %lld  episodes %lld  last reward %.0f  running reward %.1f  %.0f steps/s\n",
                  static_cast<long long>(round), static_cast<long long>(episodes), last, running, steps / secs);
      std::fflush(stdout);
    }
    if (solved) {
      std::printf("solved after %lld episodes (%.0f s): running reward %.1f > %g\n", static_cast<long long>(episodes),
                  secs, running, args.target);
      return 0;
    }
  }
  std::fprintf(stderr, "rl: not solved within %lld episodes (running reward %.1f)\n",
               static_cast<long long>(args.max_episodes), running);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    at::set_num_threads(1);
    rl::register_rl();
    rpc::RpcOptions options;
    options.shutdown_timeout = std::chrono::hours(2);  // observers wait in shutdown while the agent trains
    rpc::init_rpc(options);
    const int code = rpc::get_worker_info().id == 0 ? train(args) : 0;
    rpc::shutdown();
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rl_train: %s\n", e.what());
    return 1;
  }
}
