#include "examples/rl/agent.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <cmath>
#include <optional>

#include "absl/base/attributes.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "examples/rl/cartpole.h"
#include "tandem/log/log.h"
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

// What an observer's run replies: its trajectory's rewards, episode ends, actions and round trips, and its round.
using RunReply =
    std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, int64_t>;

// The last round number run_round gave out in this process: every round's is new, whichever agent plays it.
std::atomic<int64_t> g_rounds{0};

// Rounds are numbered below 2^53: every whole number below it is exact in a request's double.
constexpr double kRoundsBelow = 9007199254740992.0;

// Whether `v` is a whole number in [0, below): the observer and round fields of a request.
bool whole_below(double v, double below) { return v >= 0 && v < below && v == std::floor(v); }

torch::nn::Sequential make_policy(uint64_t seed) {
  at::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(4, 128), torch::nn::ReLU(), torch::nn::Linear(128, 2));
}

ABSL_CONST_INIT Mutex g_agent_mu(absl::kConstInit);
std::shared_ptr<Agent> g_agent ABSL_GUARDED_BY(g_agent_mu);
// The observers still playing round g_active_round (batched mode: the full batch), by slot. The count and the
// batcher's max_batch change together under g_active_mu: two observers finishing at once must not leave the larger
// of their two values behind. Each slot counts out once, and only in its own round: an observer a round gave up on
// may report long after, and a failed observer the round counted out may report too.
ABSL_CONST_INIT Mutex g_active_mu(absl::kConstInit);
int64_t g_active_round ABSL_GUARDED_BY(g_active_mu) = 0;
std::vector<char> g_playing ABSL_GUARDED_BY(g_active_mu);  // 1: the slot has not finished or failed
int64_t g_active ABSL_GUARDED_BY(g_active_mu) = 0;         // the slots at 1

void set_active_locked(int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_active_mu) {
  g_active = std::max<int64_t>(0, n);
  throw_if_error(rpc::set_max_batch(kSelectBatch, static_cast<size_t>(std::max<int64_t>(1, g_active))));
}

// Slot `slot` of round `round` finished (or failed): the next batches need one request fewer. Returns false, and
// changes nothing, for a slot of another round or one already counted out; `current` gets the round counted.
bool observer_left(int64_t round, int64_t slot, int64_t* current = nullptr) {
  MutexLock lock(&g_active_mu);
  if (current) *current = g_active_round;
  if (round != g_active_round || slot < 0 || slot >= static_cast<int64_t>(g_playing.size()) ||
      !g_playing[static_cast<size_t>(slot)]) {
    return false;
  }
  g_playing[static_cast<size_t>(slot)] = 0;
  set_active_locked(g_active - 1);
  return true;
}

// rl.observer_done: the observer in slot `slot` of round `round` has played its part.
void on_observer_done(int64_t round, int64_t slot) {
  int64_t current = 0;
  if (observer_left(round, slot, &current)) return;
  const rpc::CallContext* call = rpc::current_call();
  TANDEM_LOG(kWarn, "rl") << kDone << " from worker '" << (call ? call->caller_name : std::string("?")) << "' for slot "
                          << slot << " of round " << round << ": no observer of round " << current
                          << " still playing there (a report of a round that gave up, or a second one): dropped";
}

// The trajectory a completed run of round `round` replied, or why there is none.
absl::StatusOr<Trajectory> trajectory_of(const rpc::Future& run, int64_t round) {
  if (absl::Status s = run.status(); !s.ok()) return s;
  auto [rewards, ends, actions, rtt, played] = run.get<RunReply>();
  if (played != round) {  // a reply is its call's (the RPC layer matches them), so this is a bug: named, not used
    return absl::InternalError(absl::StrCat("'run' replied for round ", played, " to round ", round, ": dropped"));
  }
  return Trajectory{std::move(rewards), std::move(ends), std::move(actions), std::move(rtt)};
}

std::shared_ptr<Agent> agent() {
  MutexLock lock(&g_agent_mu);
  if (!g_agent) throw std::runtime_error("no agent on worker '" + rpc::get_worker_info().name + "'");
  return g_agent;
}

// An observer plays one run at a time: runs of two rounds at once would race on its environment and its random
// numbers. A run asked for a newer round than the one playing (whose agent gave up on it) makes the old run stop at
// its next step, and waits for that, within its own bound: the old run is at most one action request (which the
// agent, in the newer round already, refuses at once) or one report from its next step.
class Observer {
 public:
  Observer(int64_t id, int64_t seed) : id_(id), env_(static_cast<uint64_t>(seed) * 1000 + id), rng_(seed * 7919 + id) {}

  // Plays round `round` for the agent on worker `agent_rank`, in slot `slot` of its batches: `steps` steps, or one
  // episode when steps is 0. Waits up to `wait_ms` for a run of an earlier round to stop (DEADLINE_EXCEEDED then); a
  // run of a round older than one asked for already is refused (ABORTED).
  RunReply run(int64_t agent_rank, int64_t steps, bool batched, int64_t round, int64_t slot, int64_t wait_ms) {
    start_playing(round, wait_ms);
    struct Done {
      Observer& o;
      ~Done() { o.stop_playing(); }
    } done{*this};
    Trajectory t;
    CartPole::State s = env_.reset();
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (int64_t k = 0; steps == 0 || k < steps; ++k) {
      throw_if_superseded(round, k);
      const double u = uniform(rng_);
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t action = rpc::rpc_sync<int64_t>(
          static_cast<int>(agent_rank), batched ? kSelectBatch : kSelect,
          Request{static_cast<double>(id_), s[0], s[1], s[2], s[3], u, static_cast<double>(round)});
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
    if (batched) {  // the next batches need one request fewer
      throw_if_superseded(round, static_cast<int64_t>(t.actions.size()));
      rpc::rpc_sync(static_cast<int>(agent_rank), kDone, round, slot);
    }
    return {t.rewards, t.ends, t.actions, t.rtt_us, round};
  }

 private:
  std::string who() const { return absl::StrCat("observer ", id_, " on worker '", rpc::get_worker_info().name, "'"); }

  // Makes `round` the newest round asked of this observer and waits (up to wait_ms) until no run of an earlier one
  // plays; then this run plays.
  void start_playing(int64_t round, int64_t wait_ms) {
    const std::string me = who();
    MutexLock lock(&mu_);
    if (round <= latest_) {
      throw RpcError(absl::AbortedError(absl::StrCat(me, ": asked to play round ", round, " after round ", latest_,
                                                     ": a request of a round that gave up, refused")));
    }
    latest_ = round;  // a run of an earlier round stops at its next step; a run waiting for one gives up
    if (playing_ == 0) {
      playing_ = round;
      return;
    }
    TANDEM_LOG(kWarn, "rl") << me << ": round " << round << " waits for its run of round " << playing_
                            << " to stop (its agent gave up on that round)";
    idle_.SignalAll();
    const absl::Time deadline = absl::Now() + absl::Milliseconds(std::max<int64_t>(0, wait_ms));
    bool timed_out = false;
    while (playing_ != 0 && latest_ == round && !timed_out) timed_out = idle_.WaitWithDeadline(&mu_, deadline);
    if (latest_ != round) {
      throw RpcError(absl::AbortedError(
          absl::StrCat(me, ": round ", round, " was overtaken by round ", latest_, " before it could start: refused")));
    }
    if (playing_ != 0) {
      throw RpcError(
          absl::DeadlineExceededError(absl::StrCat(me, ": its run of round ", playing_, " did not stop within ",
                                                   wait_ms, " ms; round ", round, " cannot start")));
    }
    playing_ = round;
  }

  void stop_playing() {
    MutexLock lock(&mu_);
    playing_ = 0;
    idle_.SignalAll();
  }

  // Ends the run of `round` (ABORTED) when a newer round was asked of this observer meanwhile.
  void throw_if_superseded(int64_t round, int64_t played) {
    int64_t latest = 0;
    {
      MutexLock lock(&mu_);
      latest = latest_;
    }
    if (latest == round) return;
    const std::string why = absl::StrCat(who(), ": abandons its run of round ", round, " after ", played,
                                         " steps: its agent asked for round ", latest);
    TANDEM_LOG(kWarn, "rl") << why;
    throw RpcError(absl::AbortedError(why));
  }

  Mutex mu_;
  CondVar idle_;                              // playing_ became 0, or latest_ changed
  int64_t latest_ ABSL_GUARDED_BY(mu_) = 0;   // the newest round asked of this observer
  int64_t playing_ ABSL_GUARDED_BY(mu_) = 0;  // the round of the run playing, 0 when none
  const int64_t id_;
  CartPole env_;         // used by the playing run only
  std::mt19937_64 rng_;  // likewise
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
  std::vector<size_t> formed;  // the well-formed requests, checked before anything is recorded
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    if (r.size() != 7) {
      actions[i] = absl::InvalidArgumentError(
          absl::StrCat("a request is {observer, 4 state values, u, round}; this one has ", r.size(), " values"));
    } else if (!whole_below(r[0], static_cast<double>(n_observers_))) {
      actions[i] =
          absl::InvalidArgumentError(absl::StrCat("no observer ", r[0], " (the agent has ", n_observers_, ")"));
    } else if (!whole_below(r[6], kRoundsBelow)) {
      actions[i] = absl::InvalidArgumentError(absl::StrCat("observer ", r[0], ": no round ", r[6]));
    } else {
      formed.push_back(i);
    }
  }
  at::NoGradGuard no_grad;
  MutexLock lock(&mu_);
  std::vector<size_t> good;  // and of the open round
  std::vector<double> flat;
  for (size_t i : formed) {
    if (absl::Status s = check_round_locked(requests[i]); !s.ok()) {
      actions[i] = std::move(s);
      continue;
    }
    good.push_back(i);
    flat.insert(flat.end(), requests[i].begin() + 1, requests[i].begin() + 5);
  }
  if (good.empty()) return actions;
  at::Tensor states = at::tensor(flat, at::kDouble).to(at::kFloat).view({static_cast<int64_t>(good.size()), 4});
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

absl::Status Agent::check_round_locked(const Request& r) const {
  const auto round = static_cast<int64_t>(r[6]);
  if (open_ && round == round_) return absl::OkStatus();
  const std::string why =
      absl::StrCat("observer ", static_cast<int64_t>(r[0]), ": a request of round ", round, ", but the agent is ",
                   open_ ? "in round " : "past round ", round_, ": its round gave up or ended, refused");
  TANDEM_LOG(kWarn, "rl") << why;
  return absl::AbortedError(why);
}

void Agent::begin_round(int64_t round) {
  MutexLock lock(&mu_);
  std::vector<std::string> left;
  for (size_t o = 0; o < steps_.size(); ++o) {
    if (!steps_[o].actions.empty()) left.push_back(absl::StrCat("observer ", o, ": ", steps_[o].actions.size()));
  }
  if (!left.empty()) {
    TANDEM_LOG(kWarn, "rl") << "round " << round << " drops the steps round " << round_
                            << " left (it gave up before finish_round): " << absl::StrJoin(left, ", ");
  }
  steps_.assign(steps_.size(), Steps{});
  round_ = round;
  open_ = true;
}

void Agent::end_round(int64_t round) {
  MutexLock lock(&mu_);
  if (round == round_) open_ = false;
}

int64_t Agent::round() const {
  MutexLock lock(&mu_);
  return round_;
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
  rpc::register_function(kDone, on_observer_done);
  rref::register_class<Observer>(kObserver).constructor<int64_t, int64_t>().method("run", &Observer::run);
}

void set_active_observers(int64_t round, int64_t n) {
  MutexLock lock(&g_active_mu);
  g_active_round = round;
  g_playing.assign(static_cast<size_t>(std::max<int64_t>(0, n)), 1);
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
  const std::shared_ptr<Agent> a = agent();
  Round round;
  round.number = ++g_rounds;
  a->begin_round(round.number);
  // However this returns, requests of this round still on their way are refused from now on: an observer the round
  // gave up on (or skipped) stops at its next step.
  struct EndRound {
    Agent& of;
    int64_t number;
    ~EndRound() { of.end_round(number); }
  } end_round{*a, round.number};
  if (options.batched) set_active_observers(round.number, static_cast<int64_t>(observers.size()));
  const int64_t timeout_ms = std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout).count();
  std::vector<rpc::Future> runs;
  for (size_t i = 0; i < observers.size(); ++i) {
    runs.push_back(observers[i].rpc_async("run", int64_t{me}, int64_t{options.steps}, options.batched, round.number,
                                          static_cast<int64_t>(i), timeout_ms, options.timeout));
  }
  // Failures are handled as they happen (a dead observer must not wait behind a long-lived one): the others' batches
  // stop counting it at once, or the round fails at once.
  std::vector<char> handled(runs.size(), 0);
  std::vector<std::optional<Trajectory>> done(runs.size());
  const auto deadline = std::chrono::steady_clock::now() + options.timeout + std::chrono::seconds(1);
  for (size_t left = runs.size(); left > 0;) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::vector<std::string> late;
      for (size_t i = 0; i < runs.size(); ++i) {
        if (!handled[i]) late.push_back(absl::StrCat("observer ", i, " (worker '", observers[i].owner_name(), "')"));
      }
      throw RpcError(absl::DeadlineExceededError(absl::StrCat(
          "rl: ", absl::StrJoin(late, ", "), " did not finish round ", round.number, " within ", timeout_ms, " ms")));
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      if (handled[i] || !runs[i].wait_for(std::chrono::milliseconds(runs.size() == 1 ? 100 : 2))) continue;
      handled[i] = 1, --left;
      absl::StatusOr<Trajectory> t = trajectory_of(runs[i], round.number);
      if (t.ok()) {
        done[i] = std::move(*t);
        continue;
      }
      const std::string what =
          absl::StrCat("observer ", i, " (worker '", observers[i].owner_name(), "'): ", t.status().message());
      if (!options.skip_failed) {
        throw RpcError(absl::Status(t.status().code(), absl::StrCat("rl: round ", round.number, ", ", what)));
      }
      round.failed.push_back(what);
      if (options.batched) observer_left(round.number, static_cast<int64_t>(i));
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
