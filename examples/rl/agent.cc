#include "examples/rl/agent.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <optional>

#include "absl/base/attributes.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "examples/rl/cartpole.h"
#include "tandem/rpc/batching.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rpc.h"

namespace tandem::examples::rl {
namespace {

constexpr const char* kSelect = "rl.select_action";
constexpr const char* kSelectBatch = "rl.select_action_batch";
constexpr const char* kDone = "rl.observer_done";
constexpr const char* kObserver = "rl.Observer";
// How long a batch waits for the observers that have not asked yet (a slow or dead one) before it runs without them.
constexpr std::chrono::milliseconds kBatchDelay{5};

torch::nn::Sequential make_policy(uint64_t seed) {
  at::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(4, 128), torch::nn::ReLU(), torch::nn::Linear(128, 2));
}

ABSL_CONST_INIT Mutex g_agent_mu(absl::kConstInit);
std::shared_ptr<Agent> g_agent ABSL_GUARDED_BY(g_agent_mu);
// Observers still playing this round (batched mode: the full batch). The count and the batcher's max_batch change
// together under g_active_mu: two observers finishing at once must not leave the larger of their two values behind.
ABSL_CONST_INIT Mutex g_active_mu(absl::kConstInit);
int64_t g_active ABSL_GUARDED_BY(g_active_mu) = 0;

void set_active_locked(int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_active_mu) {
  g_active = std::max<int64_t>(0, n);
  throw_if_error(rpc::set_max_batch(kSelectBatch, static_cast<size_t>(std::max<int64_t>(1, g_active))));
}

// An observer finished its round (or failed): the next batches need one request fewer.
void one_observer_fewer() {
  MutexLock lock(&g_active_mu);
  set_active_locked(g_active - 1);
}

std::shared_ptr<Agent> agent() {
  MutexLock lock(&g_agent_mu);
  if (!g_agent) throw std::runtime_error("no agent on worker '" + rpc::get_worker_info().name + "'");
  return g_agent;
}

class Observer {
 public:
  Observer(int64_t id, int64_t seed) : id_(id), env_(static_cast<uint64_t>(seed) * 1000 + id), rng_(seed * 7919 + id) {}

  // Plays for the agent on worker `agent_rank`: `steps` steps, or one episode when steps is 0.
  std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>> run(
      int64_t agent_rank, int64_t steps, bool batched) {
    // One run at a time: a round retried while the last one's run still plays here (its caller gave up on it) would
    // race on the environment and its random numbers.
    if (running_.exchange(true)) {
      throw RpcError(absl::FailedPreconditionError(
          absl::StrCat("observer ", id_, " on worker '", rpc::get_worker_info().name,
                       "' is still playing an earlier round (its agent gave up on it); it takes one round at a time")));
    }
    struct Done {
      std::atomic<bool>& running;
      ~Done() { running = false; }
    } done{running_};
    Trajectory t;
    CartPole::State s = env_.reset();
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (int64_t k = 0; steps == 0 || k < steps; ++k) {
      const double u = uniform(rng_);
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t action = rpc::rpc_sync<int64_t>(static_cast<int>(agent_rank), batched ? kSelectBatch : kSelect,
                                                    Request{static_cast<double>(id_), s[0], s[1], s[2], s[3], u});
      t.rtt_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      const CartPole::Step r = env_.step(static_cast<int>(action));
      t.actions.push_back(action);
      t.rewards.push_back(r.reward);
      t.ends.push_back(r.done);
      s = r.state;
      if (r.done) {
        if (steps == 0) break;
        s = env_.reset();
      }
    }
    if (batched) rpc::rpc_sync(static_cast<int>(agent_rank), kDone);  // the next batches need one request fewer
    return {t.rewards, t.ends, t.actions, t.rtt_us};
  }

 private:
  std::atomic<bool> running_{false};
  int64_t id_;
  CartPole env_;
  std::mt19937_64 rng_;
};

}  // namespace

Agent::Agent(int observers, uint64_t seed, double lr, double gamma)
    : policy_(make_policy(seed)),
      optimizer_(policy_->parameters(), torch::optim::AdamOptions(lr)),
      gamma_(gamma),
      n_observers_(observers),
      steps_(observers) {}

std::vector<absl::StatusOr<int64_t>> Agent::select(const std::vector<Request>& requests) {
  std::vector<absl::StatusOr<int64_t>> actions(requests.size(), absl::UnknownError("not answered"));
  std::vector<size_t> good;  // the well-formed requests, checked before anything is recorded
  std::vector<double> flat;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    if (r.size() != 6) {
      actions[i] = absl::InvalidArgumentError(
          absl::StrCat("a request is {observer, 4 state values, u}; this one has ", r.size(), " values"));
    } else if (!(r[0] >= 0 && r[0] < static_cast<double>(n_observers_)) || r[0] != static_cast<int64_t>(r[0])) {
      actions[i] =
          absl::InvalidArgumentError(absl::StrCat("no observer ", r[0], " (the agent has ", n_observers_, ")"));
    } else {
      good.push_back(i);
      flat.insert(flat.end(), r.begin() + 1, r.begin() + 5);
    }
  }
  if (good.empty()) return actions;
  at::Tensor states = at::tensor(flat, at::kDouble).to(at::kFloat).view({static_cast<int64_t>(good.size()), 4});
  at::NoGradGuard no_grad;
  MutexLock lock(&mu_);
  at::Tensor p0 = at::softmax(policy_->forward(states), 1).select(1, 0).contiguous();
  const float* p = p0.data_ptr<float>();
  const float* st = states.data_ptr<float>();
  for (size_t k = 0; k < good.size(); ++k) {
    const Request& r = requests[good[k]];
    const auto o = static_cast<size_t>(r[0]);
    const int64_t a = r[5] < static_cast<double>(p[k]) ? 0 : 1;
    actions[good[k]] = a;
    steps_[o].states.insert(steps_[o].states.end(), st + 4 * k, st + 4 * k + 4);
    steps_[o].actions.push_back(a);
  }
  return actions;
}

double Agent::finish_round(const std::vector<int>& observers, const std::vector<Trajectory>& trajectories) {
  MutexLock lock(&mu_);
  // The round's steps are taken out first: a round that fails below (an observer that died mid-episode, a malformed
  // trajectory) leaves none behind to break the next one.
  std::vector<Steps> round(steps_.size());
  round.swap(steps_);
  if (trajectories.size() != observers.size()) {
    throw std::logic_error(absl::StrCat(trajectories.size(), " trajectories for ", observers.size(), " observers"));
  }
  std::vector<double> returns;
  std::vector<float> states;
  std::vector<int64_t> actions;
  for (size_t k = 0; k < observers.size(); ++k) {
    const Steps& taken = round.at(observers[k]);
    const auto& r = trajectories[k].rewards;
    const auto& ends = trajectories[k].ends;
    if (taken.actions.size() != r.size() || ends.size() != r.size()) {
      throw std::logic_error(absl::StrCat("observer ", observers[k], ": ", taken.actions.size(), " actions for ",
                                          r.size(), " rewards and ", ends.size(), " episode ends"));
    }
    std::vector<double> g(r.size());
    double R = 0;
    for (size_t i = r.size(); i-- > 0;) {
      if (ends[i]) R = 0;  // a new episode's returns start at its end
      R = r[i] + gamma_ * R;
      g[i] = R;
    }
    returns.insert(returns.end(), g.begin(), g.end());
    states.insert(states.end(), taken.states.begin(), taken.states.end());
    actions.insert(actions.end(), taken.actions.begin(), taken.actions.end());
  }
  if (actions.empty()) return 0;
  const auto n = static_cast<int64_t>(actions.size());
  at::Tensor R = at::tensor(returns, at::kDouble).to(at::kFloat);
  R = (R - R.mean()) / (n > 1 ? R.std() + 1e-8 : at::ones({}));
  at::Tensor logp = at::log_softmax(policy_->forward(at::tensor(states).view({n, 4})), 1)
                        .gather(1, at::tensor(actions, at::kLong).view({n, 1}))
                        .view({n});
  at::Tensor loss = -(logp * R).sum();
  optimizer_.zero_grad();
  loss.backward();
  optimizer_.step();
  return loss.item<double>();
}

void register_rl() {
  rpc::register_function(kSelect, [](Request r) {
    absl::StatusOr<int64_t> a = agent()->select({std::move(r)}).front();
    throw_if_error(a.status());
    return *a;
  });
  rpc::register_batched_function<Request, absl::StatusOr<int64_t>>(
      kSelectBatch, {.max_batch = 1, .max_delay = kBatchDelay},
      [](std::vector<Request> rs) { return agent()->select(rs); });
  rpc::register_function(kDone, [] { one_observer_fewer(); });
  rref::register_class<Observer>(kObserver).constructor<int64_t, int64_t>().method("run", &Observer::run);
}

void set_active_observers(int64_t n) {
  MutexLock lock(&g_active_mu);
  set_active_locked(n);
}

int64_t active_observers() {
  MutexLock lock(&g_active_mu);
  return g_active;
}

void set_agent(std::shared_ptr<Agent> a) {
  MutexLock lock(&g_agent_mu);
  g_agent = std::move(a);
}

rref::RRef make_observer(const rpc::To& on, int64_t id, uint64_t seed) {
  return rref::remote_object(on, kObserver, id, static_cast<int64_t>(seed));
}

Round run_round(const std::vector<rref::RRef>& observers, const RoundOptions& options) {
  const int me = rpc::get_worker_info().id;
  if (options.batched) set_active_observers(static_cast<int64_t>(observers.size()));
  std::vector<rpc::Future> runs;
  for (const auto& o : observers) {
    runs.push_back(o.rpc_async("run", int64_t{me}, int64_t{options.steps}, options.batched, options.timeout));
  }
  // Failures are handled as they happen (a dead observer must not wait behind a long-lived one): the others' batches
  // stop counting it at once, or the round fails at once.
  Round round;
  std::vector<char> handled(runs.size(), 0);
  std::vector<std::optional<Trajectory>> done(runs.size());
  const auto deadline = std::chrono::steady_clock::now() + options.timeout + std::chrono::seconds(1);
  for (size_t left = runs.size(); left > 0;) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::vector<std::string> late;
      for (size_t i = 0; i < runs.size(); ++i) {
        if (!handled[i]) late.push_back(absl::StrCat("observer ", i, " (worker '", observers[i].owner_name(), "')"));
      }
      throw RpcError(absl::DeadlineExceededError(
          absl::StrCat("rl: ", absl::StrJoin(late, ", "), " did not finish the round within ",
                       std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout).count(), " ms")));
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      if (handled[i] || !runs[i].wait_for(std::chrono::milliseconds(runs.size() == 1 ? 100 : 2))) continue;
      handled[i] = 1, --left;
      absl::Status s = runs[i].status();
      if (s.ok()) {
        auto [rewards, ends, actions, rtt] =
            runs[i]
                .get<
                    std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>>>();
        done[i] = Trajectory{std::move(rewards), std::move(ends), std::move(actions), std::move(rtt)};
        continue;
      }
      const std::string what =
          absl::StrCat("observer ", i, " (worker '", observers[i].owner_name(), "'): ", s.message());
      if (!options.skip_failed) throw RpcError(absl::Status(s.code(), "rl: " + what));
      round.failed.push_back(what);
      if (options.batched) one_observer_fewer();
    }
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    if (!done[i]) continue;
    round.observers.push_back(static_cast<int>(i));
    round.trajectories.push_back(std::move(*done[i]));
  }
  return round;
}

}  // namespace tandem::examples::rl
