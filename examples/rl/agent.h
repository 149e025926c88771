// Reinforcement learning with observers and an agent (PyTorch's RPC RL tutorial, batch variant): the agent holds the
// policy; every observer runs a CartPole and asks the agent for each action over RPC; the agent learns by REINFORCE.
//
// Action sampling is by inverse CDF with a number u in [0, 1) the observer draws from its own seeded generator, so an
// action is a function of (policy, state, u): batched and unbatched answers agree, whatever order requests arrive in.
//
// Rounds. run_round numbers its rounds (increasing, process-wide), and everything that belongs to a round carries its
// number: the run it asks of each observer, each action request, the observer's report that it is done, the run's
// reply. A round that gives up (its deadline, a failed observer) cannot cancel the runs it started: an observer may go
// on playing it, and its requests and report may come during the next round. The receivers drop what belongs to
// another round, with a log line naming the observer and both rounds: the agent refuses the requests (ABORTED), and
// the observer, whose run then fails, stops playing; a report of another round changes no batch size; an observer
// asked for a new round while it still plays an old one tells the old run to stop and waits for it (bounded by the
// new round's timeout) before it plays. Nothing of a round that gave up is mixed into the next.
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "tandem/rref/rref.h"
#include "tandem/sync/sync.h"

namespace tandem::examples::rl {

// A request for an action: {observer, x, x_dot, theta, theta_dot, u, round}: `round` is the agent's round the
// observer plays (Agent::begin_round).
using Request = std::vector<double>;

// What an observer reports of its part of a round.
struct Trajectory {
  std::vector<double> rewards;
  std::vector<int64_t> ends;  // 1 at the last step of each episode
  std::vector<int64_t> actions;
  std::vector<double> rtt_us;  // each select_action call's round trip, measured by the observer
};

class Agent {
 public:
  // Policy 4 -> 128 -> ReLU -> 2 -> softmax, initialised from `seed`; Adam with `lr`; discount `gamma`.
  Agent(int observers, uint64_t seed, double lr = 1e-2, double gamma = 0.99);

  // One policy forward for the well-formed requests of the current round (no autograd); action 0 if u < p0, else 1.
  // Keeps each state and action for its observer's trajectory. Every request is checked before anything is recorded:
  // a malformed one (not 7 values, an unknown observer, a round that is not a whole number) gets INVALID_ARGUMENT
  // alone, and one of another round than the agent's open one gets ABORTED alone (logged, naming the observer and
  // both rounds); neither leaves a step behind; the others are answered. Thread-safe.
  std::vector<absl::StatusOr<int64_t>> select(const std::vector<Request>& requests);

  // Opens round `round` (a number no earlier round of this agent had: run_round counts them up) and drops the steps
  // an earlier round left (one that gave up before finish_round), logging how many of whose. select() then answers
  // only requests of `round`. An agent starts in round 0, open: an agent with one observer playing one episode at a
  // time (rl_python_agent) may never change it, and tags its requests with round(). Thread-safe.
  void begin_round(int64_t round);
  // Closes round `round` if it is the current one: requests of it still on their way are refused (their observers
  // stop); its steps stay for finish_round. Thread-safe.
  void end_round(int64_t round);
  int64_t round() const;

  // REINFORCE over the round: trajectories[k] is observer observers[k]'s (rewards in step order, ends marking each
  // episode's last step); the steps of observers not named are dropped. The log-probabilities come from one forward
  // over all the round's states, on this thread: the update does not depend on which RPC threads answered (per-step
  // graphs built on several threads would be accumulated in a thread-dependent order, and training would not repeat).
  // Returns the loss.
  double finish_round(const std::vector<int>& observers, const std::vector<Trajectory>& trajectories);

 private:
  struct Steps {
    std::vector<float> states;  // 4 per step
    std::vector<int64_t> actions;
  };
  // A request's refusal when it is not of the open round (logged); OK when it is.
  absl::Status check_round_locked(const Request& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;  // select() runs on RPC threads, finish_round() and the round's changes on the round's
  torch::nn::Sequential policy_ ABSL_GUARDED_BY(mu_);
  torch::optim::Adam optimizer_ ABSL_GUARDED_BY(mu_);
  const double gamma_;
  const int n_observers_;
  std::vector<Steps> steps_ ABSL_GUARDED_BY(mu_);  // per observer, this round
  int64_t round_ ABSL_GUARDED_BY(mu_) = 0;
  bool open_ ABSL_GUARDED_BY(mu_) = true;  // requests of round_ are answered
};

// The agent side of a job: set on the agent's worker before observers call it. The functions and the Observer class
// are registered once per process by register_rl() (every worker, before init_rpc).
void register_rl();
void set_agent(std::shared_ptr<Agent> agent);

// How many observers the batched select_action waits for (its max_batch, at least 1): run_round sets it to the number
// of observers of round `round` (in slots 0..n-1), and each of them that finishes (its report rl.observer_done(round,
// slot)) or fails makes it one fewer, once, atomically with the batcher's max_batch. A report of another round, or a
// second one of a slot, changes nothing (logged).
void set_active_observers(int64_t round, int64_t n);
int64_t active_observers();

struct RoundOptions {
  bool batched = true;
  int steps = 0;  // 0: every observer plays one episode; n > 0: exactly n steps, a new episode after each end
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  bool skip_failed = false;  // a failed observer is dropped (and named in `failed`) instead of failing the round
};

struct Round {
  int64_t number = 0;          // what its requests, reports and replies carry
  std::vector<int> observers;  // the indices (into the observers given) whose trajectories came back
  std::vector<Trajectory> trajectories;
  std::vector<std::string> failed;  // "observer 2 (worker 'worker3'): cause", with skip_failed
};

// Creates observer `id` (seeded) on worker `on`, as a remote object.
rref::RRef make_observer(const rpc::To& on, int64_t id, uint64_t seed);

// One round on this (the agent's) worker, whose agent (set_agent) it begins and, however it returns, ends (see
// "Rounds" above): every observer runs concurrently, asking the agent for its actions. Throws RpcError naming the
// first observer that failed (unless skip_failed) and the round, within options.timeout (plus 1 s). An observer still
// playing an earlier round first waits for that run to stop, within the same timeout.
Round run_round(const std::vector<rref::RRef>& observers, const RoundOptions& options);

}  // namespace tandem::examples::rl
