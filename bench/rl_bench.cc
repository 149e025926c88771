// bench/run.sh rl — Tandem's side. 11 workers (tandem-run --nproc-per-node 11): rank 0 is the agent, ranks 1..10 the
// observers; the peer (bench/peer_rl.py) runs PyTorch's RPC RL tutorial, batch variant, on the same workload.
//   rl_env_steps_per_s     N = 1, 4, 10 observers, batched: --rounds rounds (after one warm-up round) in which every
//                          observer takes exactly --steps CartPole steps (a new episode after each end), asking the
//                          agent for every action; the agent answers all waiting observers from one forward pass and
//                          updates the policy (REINFORCE, Adam) after each round. Env steps of all observers per
//                          second.
//   select_action_p50_us   the median round trip of one observer's select_action call in those rounds, as the
//                          observers measured it.
//   rl_episodes_to_solve   1 observer, one episode per round, running reward 0.05 r + 0.95 running from 10: episodes
//                          until it exceeds 475 (CartPole-v1's threshold), per seed and the median over --solve-seeds
//                          seeds (capped at --max-episodes, then solved=false).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <numeric>
#include <string>

#include "bench/common.h"
#include "examples/rl/agent.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace rpc = tandem::rpc;
namespace rref = tandem::rref;
namespace bench = tandem::bench;
namespace rl = tandem::examples::rl;

namespace {

std::vector<rref::RRef> observers(int n, uint64_t seed) {
  std::vector<rref::RRef> out;
  for (int i = 0; i < n; ++i) out.push_back(rl::make_observer(i + 1, i, seed));
  return out;
}

// One round and its update; adds the observers' round trips to `rtt`.
int64_t round_and_update(rl::Agent& agent, const std::vector<rref::RRef>& obs, int steps, std::vector<double>* rtt) {
  rl::Round r = rl::run_round(obs, {.batched = true, .steps = steps});
  int64_t n = 0;
  for (const auto& t : r.trajectories) {
    n += static_cast<int64_t>(t.rewards.size());
    if (rtt) rtt->insert(rtt->end(), t.rtt_us.begin(), t.rtt_us.end());
  }
  agent.finish_round(r.observers, r.trajectories);
  return n;
}

void throughput(int n, int rounds, int steps) {
  auto agent = std::make_shared<rl::Agent>(n, 0);
  rl::set_agent(agent);
  auto obs = observers(n, 0);
  round_and_update(*agent, obs, steps, nullptr);  // warm-up
  std::vector<double> rtt;
  int64_t total = 0;
  const double t0 = bench::now_us();
  for (int r = 0; r < rounds; ++r) total += round_and_update(*agent, obs, steps, &rtt);
  const double secs = (bench::now_us() - t0) / 1e6;
  const std::string cond = "\"processes\":" + std::to_string(n + 1) +
                           ",\"intra_op_threads\":1,\"observers\":" + std::to_string(n) + ",\"batched\":true";
  bench::emit("rl", "rl_env_steps_per_s", static_cast<double>(total) / secs, "steps/s",
              cond + ",\"rounds\":" + std::to_string(rounds) + ",\"steps\":" + std::to_string(steps));
  bench::emit("rl", "select_action_p50_us", bench::median(rtt), "us", cond);
}

// Episodes until the running reward exceeds 475 with one observer (max_episodes if never).
std::pair<int64_t, bool> solve(uint64_t seed, int64_t max_episodes) {
  auto agent = std::make_shared<rl::Agent>(1, seed);
  rl::set_agent(agent);
  auto obs = observers(1, seed);
  double running = 10;
  for (int64_t episodes = 1; episodes <= max_episodes; ++episodes) {
    rl::Round r = rl::run_round(obs, {.batched = true, .steps = 0});
    const auto& t = r.trajectories.at(0);
    running = 0.05 * std::accumulate(t.rewards.begin(), t.rewards.end(), 0.0) + 0.95 * running;
    agent->finish_round(r.observers, r.trajectories);
    if (running > 475) return {episodes, true};
  }
  return {max_episodes, false};
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 20, steps = 100, seeds = 5;
  int64_t max_episodes = 3000;
  CLI::App app{"RL observer/agent rounds and CartPole solves", "rl_bench"};
  app.add_option("--rounds", rounds, "timed rounds");
  app.add_option("--steps", steps, "environment steps per round");
  app.add_option("--solve-seeds", seeds, "seeds solved for the episodes figure");
  app.add_option("--max-episodes", max_episodes, "give up on a seed after this many episodes");
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  rl::register_rl();
  rpc::RpcOptions options;
  options.shutdown_timeout = std::chrono::hours(2);  // observers wait in shutdown while the agent measures
  rpc::init_rpc(options);
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  if (rpc::get_worker_info().id == 0) {
    for (int n : {1, 4, 10}) {
      if (n < world) throughput(n, rounds, steps);
    }
    std::vector<double> episodes;
    bool all = true;
    for (int seed = 0; seed < seeds; ++seed) {
      auto [e, solved] = solve(static_cast<uint64_t>(seed), max_episodes);
      episodes.push_back(static_cast<double>(e));
      all &= solved;
      bench::emit("rl", "rl_episodes_to_solve_seed", static_cast<double>(e), "episodes",
                  "\"processes\":2,\"intra_op_threads\":1,\"observers\":1,\"seed\":" + std::to_string(seed) +
                      ",\"solved\":" + (solved ? "true" : "false"));
    }
    if (seeds > 0) {
      bench::emit("rl", "rl_episodes_to_solve", bench::median(episodes), "episodes",
                  "\"processes\":2,\"intra_op_threads\":1,\"observers\":1,\"seeds\":" + std::to_string(seeds) +
                      ",\"solved_all\":" + (all ? "true" : "false"));
    }
  }
  rpc::shutdown();
  return 0;
}
