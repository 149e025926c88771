// The C++ agent of examples/rl/python_observer.py: a Python process (clients/python) plays CartPole and feeds its
// observations to this agent, which chooses the actions and learns by REINFORCE (examples/rl/agent.h's Agent).
//
//   export TANDEM_SECRET=$(openssl rand -hex 32)
//   build/tandem-run --nproc-per-node 1 build/rl_python_agent --address-file /tmp/agent.addr &
//   PYTHONPATH=build/python python3 examples/rl/python_observer.py --address-file /tmp/agent.addr
//
// Functions it registers (the only ones the observer can call):
//   agent.act(observation: float64 tensor of 4, u: float) -> int: action 0 if u < p(0 | observation), else 1
//   agent.finish_episode(rewards: float64 tensor) -> float: the REINFORCE update over the episode's steps; its loss
//   agent.stop() -> None: the agent shuts down (exit 0)
// Without a stop within --max-seconds the agent gives up (exit 1).
#include <ATen/ATen.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>

#include "examples/rl/agent.h"
#include "tandem/rpc/rpc.h"
#include "tandem/sync/sync.h"
#include "tools/flags.h"

using namespace tandem;
namespace rl = tandem::examples::rl;

namespace {

struct Args {
  uint64_t seed = 0;
  double lr = 1e-2;
  std::string address_file;
  int64_t max_seconds = 600;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{
      "A REINFORCE agent for CartPole served to a Python observer (examples/rl/python_observer.py); "
      "start it with tandem-run",
      "rl_python_agent"};
  app.add_option("--seed", a.seed, "seed of the policy");
  app.add_option("--lr", a.lr, "Adam's step size");
  app.add_option("--address-file", a.address_file, "write the job's master address (host:port) here once serving");
  app.add_option("--max-seconds", a.max_seconds, "give up (exit 1) when no observer stopped the agent by then");
  tools::parse_flags(app, argc, argv);
  return a;
}

std::vector<double> values_of(const at::Tensor& t, int64_t n, const char* what) {
  if (n >= 0 && t.numel() != n) {
    throw std::invalid_argument(std::string(what) + " has " + std::to_string(t.numel()) + " values, expected " +
                                std::to_string(n));
  }
  at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

}  // namespace

int main(int argc, char** argv) {
  // Outside the try: the registered functions refer to them until RPC stops, in the catch too.
  Notification stopped;
  std::once_flag stop_once;  // two observers may both ask: the notification is given once
  try {
    const Args args = parse(argc, argv);
    at::set_num_threads(1);
    auto agent = std::make_shared<rl::Agent>(1, args.seed, args.lr);
    // Its observer plays one episode at a time, each call after the last one's answer, and stops at its first failed
    // call: there are no rounds given up to tell apart, so the agent stays in its first one (Agent::begin_round).
    rpc::register_function("agent.act", [agent](at::Tensor observation, double u) {
      const std::vector<double> s = values_of(observation, 4, "the observation");
      const auto round = static_cast<double>(agent->round());
      auto action = agent->select({rl::Request{0, s[0], s[1], s[2], s[3], u, round}})[0];
      throw_if_error(action.status());
      return *action;
    });
    rpc::register_function("agent.finish_episode", [agent](at::Tensor rewards) {
      rl::Trajectory t;
      t.rewards = values_of(rewards, -1, "the rewards");
      t.ends.assign(t.rewards.size(), 0);
      if (!t.ends.empty()) t.ends.back() = 1;
      return agent->finish_round({0}, {t});
    });
    rpc::register_function("agent.stop",
                           [&stopped, &stop_once] { std::call_once(stop_once, [&] { stopped.Notify(); }); });
    rpc::init_rpc();
    if (rpc::get_all_worker_infos().size() != 1) throw std::invalid_argument("run it as a job of one worker");
    const std::string address = rpc::get_worker_info().address;  // rank 0 serves the job's store: the master
    std::printf("rl_python_agent: serving at %s; waiting for an observer\n", address.c_str());
    std::fflush(stdout);
    if (!args.address_file.empty()) {  // written whole under another name, then renamed: a reader never sees half
      const std::string tmp = args.address_file + ".tmp";
      std::ofstream out(tmp);
      out << address << "\n";
      out.close();
      if (!out || std::rename(tmp.c_str(), args.address_file.c_str()) != 0) {
        const std::string why = std::strerror(errno);
        throw std::runtime_error("cannot write the address file " + args.address_file + ": " + why);
      }
    }
    const bool ok = stopped.WaitForNotificationWithTimeout(absl::Seconds(args.max_seconds));
    rpc::shutdown();
    if (!ok)
      std::fprintf(stderr, "rl_python_agent: no observer stopped the agent within %lld s\n",
                   static_cast<long long>(args.max_seconds));
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rl_python_agent: %s\n", e.what());
    // The registered functions refer to `stopped` and `stop_once`: RPC stops before they go.
    if (rpc::is_initialized()) {
      try {
        rpc::shutdown(false);
      } catch (const std::exception& stop) {
        std::fprintf(stderr, "rl_python_agent: stopping RPC: %s\n", stop.what());
      }
    }
    return 1;
  }
}
