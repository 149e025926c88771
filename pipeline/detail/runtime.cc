// A stage worker's runtime (runtime.h).
#include "tandem/pipeline/detail/runtime.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "tandem/comm/detail/shm.h"
#include "tandem/comm/process_group.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/log/log.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/pipeline/detail/p2p.h"
#include "tandem/pipeline/detail/shm_p2p.h"
#include "tandem/pipeline/detail/stage.h"
#include "tandem/pipeline/local.h"
#include "tandem/pipeline/schedule.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rref/rref.h"
#include "tandem/sync/sync.h"

namespace tandem::pipeline {
namespace detail {
namespace {

constexpr const char* kKindNames[] = {"forward", "backward", "backward (input gradient)", "backward (weight gradient)"};

void run_direct(const Mailbox::Go& go);

// Runs one pipeline's work on this worker, one task at a time in the order queued: a step's plan, an inference
// micro-batch. So the run of step n + 1 never starts before the run of step n has ended here, and nothing of a
// pipeline runs on an RPC server thread. stop() runs what is queued (those tasks fail fast: their pipeline is gone)
// and joins the thread. Once the pipeline has an inbox on this host (set_inbox), the idle executor sleeps on its
// bell instead (submit() and stop() ring it): a driver on this host may start a step there with no call (go_key,
// run_direct).
class Executor {
 public:
  explicit Executor(int64_t pipe) : pipe_(pipe), thread_([this] { loop(); }) {}
  ~Executor() { stop(); }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // False when stopped.
  bool submit(std::function<void()> task) {
    std::shared_ptr<Inbox> inbox;
    {
      MutexLock lock(&mu_);
      if (stopping_) return false;
      queue_.push_back(std::move(task));
      inbox = inbox_;
    }
    if (inbox) inbox->ring();
    return true;
  }
  int64_t pipe() const { return pipe_; }
  void set_inbox(std::shared_ptr<Inbox> inbox) {
    MutexLock lock(&mu_);
    inbox_ = std::move(inbox);
  }
  // Tells the thread to end once its queue is run (stop() waits for that).
  void request_stop() {
    std::shared_ptr<Inbox> inbox;
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      inbox = inbox_;
    }
    if (inbox) inbox->ring();
  }
  // Not from the executor's own thread. request_stop(), then waits until `deadline` for the task it runs to end (a
  // stage's own code, which no abort ends: a forward that never returns); false when it still runs then: the thread is
  // left to it, and the executor must then be kept alive (release_pipes() leaks it).
  bool stop(absl::Time deadline = absl::InfiniteFuture()) {
    request_stop();
    {
      MutexLock lock(&mu_);
      auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ended_; };
      if (!mu_.AwaitWithDeadline(Condition(&ended), deadline)) return false;
    }
    std::call_once(joined_, [this] { thread_.join(); });
    return true;
  }

 private:
  void loop() {
    // The last sleep ended on a ring that brought nothing yet: the driver's word that a step starts here soon.
    bool rung_empty = false;
    for (;;) {
      std::function<void()> task;
      std::shared_ptr<Inbox> inbox;
      uint32_t seen = 0;
      {
        MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !queue_.empty() || inbox_ != nullptr;
        };
        mu_.Await(Condition(&ready));
        inbox = inbox_;
        if (inbox) seen = inbox->bell();    // before looking: a ring after this ends the sleep below at once
        if (queue_.empty() && stopping_) {  // stopping, and nothing left
          ended_ = true;
          return;
        }
        if (!queue_.empty()) {
          task = std::move(queue_.front());
          queue_.pop_front();
        }
      }
      if (task) {
        task();  // tasks catch their own errors
        rung_empty = false;
        continue;
      }
      auto go = Mailbox::get().take_go(pipe_);
      if (!go.ok()) {
        // The ring's unread messages are gone: the next receive of this pipeline that finds nothing fails with it.
        TANDEM_LOG(kWarn, "pipeline") << "pipeline " << pipe_ << ": " << go.status().message();
      } else if (go->has_value()) {
        run_direct(**go);
        rung_empty = false;
        continue;
      }
      // Idle until a task, a message or a stop rings the bell (a bounded sleep: then look again). After a ring that
      // brought nothing, first a spin: the step the driver announced comes within it, with no futex wake-up.
      const auto spin = rung_empty ? Inbox::spin_time() : std::chrono::microseconds(0);
      inbox->wait(seen, Clock::now() + std::chrono::seconds(1), spin);
      rung_empty = spin.count() == 0 && inbox->bell() != seen;
    }
  }

  const int64_t pipe_;
  Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Inbox> inbox_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // the thread's loop has returned
  std::once_flag joined_;
  std::thread thread_;  // last: starts once the members above exist
};

// One copy of a tied parameter (PipelineOptions::tied): copy `copy` of tie `tie` is parameter `name` of stage
// `stage`; `param` is its index in that stage's Stage::params when the stage is on this worker (else -1).
struct TieCopy {
  int tie = 0, copy = 0, stage = 0;
  std::string name;
  int param = -1;
};

// A plan as the driver sent it once for a number of micro-batches: later steps of that shape name it.
struct CachedPlan {
  std::vector<Action> actions;
  std::vector<int> stage_rank;
  std::string loss;
  std::vector<TieCopy> ties;  // every copy of every tied parameter, in tie then copy order
};

// What this worker holds of one pipeline.
struct PipeEntry {
  std::map<int64_t, std::shared_ptr<const CachedPlan>> plans;  // by number of micro-batches
  int driver = -1;  // the rank that created it: when it dies, the pipeline goes
  std::map<int, std::shared_ptr<Stage>> stages;
  // Replicated pipelines: per stage, the group of the workers holding that stage in every replica (its gradients are
  // summed over it each step).
  std::map<int, std::shared_ptr<comm::ProcessGroup>> replica_groups;
  // Per replicated stage: the last step whose sum across the replicas this worker took its turn in (Run::take_turns).
  // Written on the executor only (runs), under Stages::mu.
  std::map<int, int64_t> summed_through;
  // The latest step whose run came here (by a call or a go). The driver begins a step only once the one before it has
  // ended, so a plan of this step or an earlier one that comes later is of a step it gave up (or a copy): note_step.
  int64_t newest_step = -1;
  std::shared_ptr<Executor> executor;
  // How long a release waits for the executor's task to end (RPC's timeout when the stage came: release_pipes()).
  std::chrono::milliseconds stop_wait{0};
  // Same-host deliveries (shm_p2p.h): this worker's inbox for the pipeline (made when a peer first asks).
  std::shared_ptr<Inbox> inbox;
};

void sweep_loop();

struct Stages {
  Mutex mu;
  CondVar cv;  // wakes the driver checks at stop
  std::map<int64_t, PipeEntry> pipes ABSL_GUARDED_BY(mu);
  // Pipelines released here (bounded memory, oldest first): a stage whose build ends after its pipeline's release is
  // dropped instead of staying for ever.
  std::set<int64_t> released ABSL_GUARDED_BY(mu);
  std::deque<int64_t> released_order ABSL_GUARDED_BY(mu);
  std::thread sweeper ABSL_GUARDED_BY(mu);  // checks the drivers (sweep_loop) while any pipeline is held
  bool stopping ABSL_GUARDED_BY(mu) = false;

  void remember_released_locked(int64_t pipe) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!released.insert(pipe).second) return;
    released_order.push_back(pipe);
    if (released_order.size() > 10000) released.erase(released_order.front()), released_order.pop_front();
  }
};
Stages& stages() {
  static auto* s = new Stages;  // never destroyed: RPC threads may use it until exit
  return *s;
}
// f(what this worker holds of `pipe`, or null), under the lock.
template <typename F>
auto with_pipe(int64_t pipe, F f) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  auto it = s.pipes.find(pipe);
  return f(it == s.pipes.end() ? nullptr : &it->second);
}
// The outlet for this worker's replies to `driver` about `pipe`; null when the replies go by RPC (the driver is this
// process, another host, switched off).
std::shared_ptr<Outlet> reply_outlet(int64_t pipe, int driver, std::chrono::milliseconds timeout) {
  if (driver == rpc::get_worker_info().id) return nullptr;
  return attach_outlet(driver, pipe, timeout, kAttachReply);
}

// This process's outlets by (pipeline, receiving rank, the attach function), null where there is none: one per ring,
// shared by whoever in the process sends into it (a driver that also holds a stage writes micro-batches where its
// stage writes activations), so that each ring has one writer object, which serialises its sends.
struct Outlets {
  Mutex mu;
  std::map<std::tuple<int64_t, int, std::string>, std::shared_ptr<Outlet>> by ABSL_GUARDED_BY(mu);
};
Outlets& outlets() {
  static auto* o = new Outlets;  // never destroyed: executors may send until exit
  return *o;
}

struct DriverInboxes {
  Mutex mu;
  std::map<int64_t, std::shared_ptr<Inbox>> by_pipe ABSL_GUARDED_BY(mu);
};
DriverInboxes& driver_inboxes() {
  static auto* d = new DriverInboxes;  // never destroyed: RPC threads may look up until exit
  return *d;
}

std::shared_ptr<Stage> find_stage(int64_t pipe, int stage) {
  return with_pipe(pipe, [stage](PipeEntry* e) -> std::shared_ptr<Stage> {
    if (!e) return nullptr;
    auto st = e->stages.find(stage);
    return st == e->stages.end() ? nullptr : st->second;
  });
}

// The index in Stage::params of parameter `name` (its name in the stage module's named_parameters()) of a stage held
// here. Throws INVALID_ARGUMENT naming the stage, the worker and the names it has.
int tied_parameter_index(int64_t pipe, int stage, const std::string& name) {
  auto s = find_stage(pipe, stage);
  if (!s) throw_error(absl::NotFoundError(absl::StrCat("pipeline ", pipe, " has no stage ", stage, " here")));
  std::vector<std::string> names;
  for (const auto& item : s->module->named_parameters()) {
    if (item.key() != name) {
      names.push_back(item.key());
      continue;
    }
    for (size_t j = 0; j < s->params.size(); ++j) {
      if (s->params[j].unsafeGetTensorImpl() == item.value().unsafeGetTensorImpl()) return static_cast<int>(j);
    }
    throw_error(absl::InvalidArgumentError(absl::StrCat("tied parameter '", name, "' of stage ", stage, " on worker '",
                                                        self_name(), "' does not require gradients")));
  }
  throw_error(
      absl::InvalidArgumentError(absl::StrCat("stage ", stage, " on worker '", self_name(), "' has no parameter '",
                                              name, "' to tie (it has: ", absl::StrJoin(names, ", "), ")")));
}
// A replicated stage's group, and the last step whose sum across the replicas this worker took its turn in (-1: none
// yet; Run::take_turns posts the turns after it). No group: the stage is not replicated, or its pipeline is not held
// here.
struct SumTurns {
  std::shared_ptr<comm::ProcessGroup> group;
  int64_t after = -1;
};
SumTurns sum_turns(int64_t pipe, int stage) {
  return with_pipe(pipe, [stage](PipeEntry* e) {
    SumTurns turns;
    if (!e) return turns;
    auto g = e->replica_groups.find(stage);
    if (g == e->replica_groups.end()) return turns;
    turns.group = g->second;
    turns.after = e->summed_through.try_emplace(stage, -1).first->second;
    return turns;
  });
}
// This worker's turn of `step` in `stage`'s sums is posted. Recorded only then: a turn whose post threw is taken again,
// with zeros, by the next run here, so that the group's collectives stay paired step with step.
void note_summed(int64_t pipe, int stage, int64_t step) {
  with_pipe(pipe, [stage, step](PipeEntry* e) {
    if (e) {
      int64_t& last = e->summed_through.try_emplace(stage, -1).first->second;
      last = std::max(last, step);
    }
    return 0;
  });
}
// Records that the run of step `step` of `pipe` came here; false when the run of this step or of a later one came
// before it (*newest: the latest that came). The driver begins a step only once the one before it has ended: a plan
// that comes after a later step's is of a step the driver gave up (held back in transit while that step failed).
bool note_step(int64_t pipe, int64_t step, int64_t* newest) {
  return with_pipe(pipe, [step, newest](PipeEntry* e) {
    if (!e) return true;  // not held here: the caller's own lookups say so
    *newest = e->newest_step;
    if (step <= e->newest_step) return false;
    e->newest_step = step;
    return true;
  });
}
std::shared_ptr<Executor> executor_of(int64_t pipe) {
  return with_pipe(pipe, [](PipeEntry* e) { return e ? e->executor : nullptr; });
}
bool was_released(int64_t pipe) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  return s.released.count(pipe) > 0;
}
// Adds a built stage; false when its pipeline was released meanwhile (or RPC is stopping).
bool add_stage(int64_t pipe, int index, int driver, std::shared_ptr<Stage> stage) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  if (s.stopping || s.released.count(pipe)) return false;
  PipeEntry& e = s.pipes[pipe];
  e.driver = driver;
  e.stages[index] = std::move(stage);
  if (!e.executor) e.executor = std::make_shared<Executor>(pipe);
  e.stop_wait = rpc::default_timeout();  // read now: RPC's stop hooks run once its options are gone
  if (!s.sweeper.joinable()) s.sweeper = std::thread(sweep_loop);
  return true;
}
std::atomic<int64_t> g_plans_received{0};
std::atomic<int64_t> g_runs_ended{0};
std::atomic<int64_t> g_direct_runs{0};

// Keeps `plan` for steps of `m` micro-batches; false when the pipeline is not held here.
bool cache_plan(int64_t pipe, int64_t m, std::shared_ptr<const CachedPlan> plan) {
  ++g_plans_received;
  return with_pipe(pipe, [&](PipeEntry* e) { return e && (e->plans[m] = std::move(plan), true); });
}
std::shared_ptr<const CachedPlan> find_plan(int64_t pipe, int64_t m) {
  return with_pipe(pipe, [m](PipeEntry* e) -> std::shared_ptr<const CachedPlan> {
    if (!e) return nullptr;
    auto p = e->plans.find(m);
    return p == e->plans.end() ? nullptr : p->second;
  });
}
void release_pipes(const std::vector<int64_t>& pipes);

// Every `kDriverCheck`, asks each driver of a pipeline held here whether it is alive; the pipelines of a driver that
// is gone (UNAVAILABLE to two pings in a row: one connection reset is not a driver's end) are released. Ends at RPC
// stop.
void sweep_loop() {
  Stages& s = stages();
  std::map<int, int> unanswered;  // by driver: pings in a row that found it unavailable
  for (;;) {
    std::map<int, std::vector<int64_t>> by_driver;
    {
      MutexLock lock(&s.mu);
      if (!s.stopping) s.cv.WaitWithTimeout(&s.mu, absl::FromChrono(kDriverCheck));
      if (s.stopping) return;
      for (const auto& [pipe, e] : s.pipes) by_driver[e.driver].push_back(pipe);
    }
    if (!rpc::is_initialized()) continue;
    const int self = rpc::get_worker_info().id;
    for (const auto& [driver, pipes] : by_driver) {
      if (driver < 0 || driver == self) continue;
      rpc::Future ping = rpc::call(driver, kPing, {}, kDriverCheck);
      if (ping.status().code() != absl::StatusCode::kUnavailable) {
        unanswered.erase(driver);
      } else if (++unanswered[driver] >= 2) {
        unanswered.erase(driver);
        release_pipes(pipes);
      }
    }
    for (auto it = unanswered.begin(); it != unanswered.end();) {  // drivers that hold nothing here any more
      it = by_driver.count(it->first) ? std::next(it) : unanswered.erase(it);
    }
  }
}

// Releases pipelines on this worker: their stages and mailbox entries go, and each one's executor
// stops once the task it runs has ended (its waits end at once), waiting for that at most RPC's timeout (as it was
// when the stages came) in all, and at least a second for each: an executor whose task still runs then (a stage's code
// that does not return) is left to it, kept alive for good with its stages, and said. Not from a pipeline's own
// executor thread.
void release_pipes(const std::vector<int64_t>& pipes) {
  std::vector<PipeEntry> gone;
  {
    Stages& s = stages();
    MutexLock lock(&s.mu);
    for (int64_t pipe : pipes) {
      s.remember_released_locked(pipe);
      auto it = s.pipes.find(pipe);
      if (it == s.pipes.end()) continue;
      gone.push_back(std::move(it->second));
      s.pipes.erase(it);
    }
  }
  for (int64_t pipe : pipes) Mailbox::get().release(pipe), drop_outlets(pipe);
  std::chrono::milliseconds bound{0};
  for (const auto& e : gone) {
    bound = std::max(bound, e.stop_wait);
    if (e.executor) e.executor->request_stop();  // all at once: each one's thread ends while the others are waited for
  }
  const absl::Time deadline = absl::Now() + absl::FromChrono(bound);
  for (auto& e : gone) {
    // At least a second each: one whose thread was idle ends at once, also after a stuck one took the whole wait.
    if (!e.executor || e.executor->stop(std::max(deadline, absl::Now() + absl::Seconds(1)))) continue;
    TANDEM_LOG(kWarn, "pipeline") << "pipeline " << e.executor->pipe() << ": a stage's task on this worker still runs "
                                  << bound.count() << " ms (RPC's timeout) after the pipeline was released (a forward "
                                  << "or backward that does not return); its thread is left to it";
    // Kept with its stages for good: the task still uses them, and the executor's thread the executor.
    static auto* leaked = new std::vector<PipeEntry>;
    static auto* leaked_mu = new Mutex;
    MutexLock lock(leaked_mu);
    leaked->push_back(std::move(e));
  }
}

struct Plan {
  int64_t pipe = 0, step = 0;
  std::shared_ptr<const CachedPlan> kept;  // the actions, the stages' ranks and the loss
  std::vector<int64_t> sizes;
  std::vector<Args> inputs;         // stage 0's micro-batches, each its arguments (else empty)
  std::vector<at::Tensor> targets;  // the last stage's targets (else empty)
  bool checkpoint = false, to_grad = false, record = false;
  int64_t total_rows = 0;  // a replica's step: the whole batch's rows, which each micro-batch's loss is a share of
  bool by_ring = false;    // inputs and targets are not in the plan: the driver wrote them into this worker's inbox
  std::chrono::milliseconds timeout{0};
  int64_t context = -1;
  // Not OK: the step was abandoned before its plan reached this worker. The run only takes part in the replicas' sums
  // (with zeros, in order with the previous run's), then fails with this.
  absl::Status abandoned;
};

struct StageRun {
  std::shared_ptr<Stage> stage;
  std::map<int, Live> live;                            // by micro-batch: from its forward to its backward (B or I)
  std::map<int, std::shared_ptr<WeightWork>> pending;  // by micro-batch: from its I to its W (its graph)
  int64_t peak = 0, busy_us = 0;
  std::vector<at::Tensor> grads;  // per Stage::params: the step's sums
};

class Run {
 public:
  explicit Run(Plan plan)
      : p_(std::move(plan)), deadline_(Clock::now() + p_.timeout), self_(rpc::get_worker_info().id) {
    for (int r : p_.kept->stage_rank) stage_names_.push_back(rpc::get_worker_info(r).name);
  }

  // Returns (loss, [stage, peak, busy_us]..., [stage, mb, kind, start_us, end_us]..., this process's peak resident
  // memory in KiB).
  c10::IValue execute() {
    catch_up_sums();
    if (!p_.abandoned.ok()) {
      // The other replicas' stages sum with this one's, step by step: without its zeros they would pair this step's
      // sums with the next, or wait for ever.
      reduce_failed();
      throw RpcError(p_.abandoned);
    }
    const int n = static_cast<int>(p_.kept->stage_rank.size());
    const int64_t batch =
        p_.total_rows > 0 ? p_.total_rows : std::accumulate(p_.sizes.begin(), p_.sizes.end(), int64_t{0});
    const LossFn loss = find_loss_if_last(n);
    // Replicated: each stage's gradients are summed across the replicas as soon as its last B or W here is done.
    std::map<int, size_t> last_gradient_action;
    for (size_t k = 0; k < p_.kept->actions.size(); ++k) {
      const Action& a = p_.kept->actions[k];
      if (a.kind == Kind::kBackward || a.kind == Kind::kWeight) last_gradient_action[a.stage] = k;
    }
    for (size_t k = 0; k < p_.kept->actions.size(); ++k) {
      const Action& a = p_.kept->actions[k];
      StageRun& run = stage_run(a.stage);
      compute_start_ = compute_end_ = 0;
      try {
        switch (a.kind) {
          case Kind::kForward:
            forward(run, a, n, loss, batch);
            break;
          case Kind::kBackward:
          case Kind::kInput:
            backward(run, a, n);
            break;
          case Kind::kWeight:
            weight(run, a);
            break;
          case Kind::kReduce:  // never in a plan (refused when it came)
            break;
        }
      } catch (...) {
        const absl::Status thrown = status_from_current_exception();
        reduce_failed();  // a replicated stage still takes part in its sums, with zeros
        throw_error(thrown.code(), a, thrown.message());
      }
      // Busy time and the timeline count computing only, not the wait for the action's input nor its send.
      const int64_t end = compute_end_ > 0 ? compute_end_ : now_us(), start = compute_start_;
      run.busy_us += end - start;
      if (p_.record) events_.insert(events_.end(), {a.stage, a.microbatch, static_cast<int64_t>(a.kind), start, end});
      if (auto last = last_gradient_action.find(a.stage); last != last_gradient_action.end() && last->second == k) {
        try {
          reduce_across_replicas(a.stage, true);
        } catch (...) {
          const absl::Status thrown = status_from_current_exception();
          reduce_failed();
          throw_error(thrown.code(), a, absl::StrCat("starting the sum across the replicas: ", thrown.message()));
        }
      }
    }
    finish_reductions();
    for (Send& send : sends_) {
      const absl::Status s = send.future.wait_for(remaining())
                                 ? send.future.status()
                                 : absl::DeadlineExceededError("it did not complete within the step's deadline");
      if (!s.ok()) throw RpcError(send_failed(s, name_of(send.to), send.stage, send.mb, send.grad));
    }
    agree_finished();
    std::vector<int64_t> stats;
    for (auto& [index, run] : runs_) stats.insert(stats.end(), {index, run.peak, run.busy_us});
    deliver_gradients();
    return c10::ivalue::Tuple::create(
        {c10::IValue(loss_), rpc::to_ivalue(stats), rpc::to_ivalue(events_), c10::IValue(peak_resident_kib())});
  }

 private:
  // One turn of this worker in a replicated stage's sum across the replicas (take_turns).
  struct Reduction {
    int stage = 0;
    int replicas = 0;
    int64_t start_us = 0;
    std::shared_ptr<std::atomic<int64_t>> end_us = std::make_shared<std::atomic<int64_t>>(0);  // set when it ends
    at::Tensor bucket, control;
    rpc::Future done, control_done;
  };

  std::chrono::milliseconds remaining() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()));
  }

  // The step is done only when every worker of it finished its run: each tells the others (one-way) and waits to hear
  // from all of them, so a failed step leaves no gradient anywhere (its workers wait in vain until the driver, told
  // of the failure, abandons the step here). Once a worker said so it is bound to deliver: it waits for the others
  // past its own deadline, by half the driver's reply margin (each worker's deadline runs from when its run began, so
  // a peer that finished by its own deadline may say so a little after ours), and still within the driver's wait.
  void agree_finished() {
    if (Mailbox::get().aborted(p_.pipe, p_.step)) {
      throw RpcError(absl::AbortedError("the step was abandoned before this worker's run ended"));
    }
    std::set<int> others(p_.kept->stage_rank.begin(), p_.kept->stage_rank.end());
    others.erase(self_);
    // The word carries this worker's gradients of the tied copies whose ties have a copy on the receiver.
    for (int w : others) {
      std::vector<int64_t> which;
      std::vector<at::Tensor> grads;
      for (const TieCopy& c : p_.kept->ties) {
        if (c.param < 0 || !tie_held_by(c.tie, w)) continue;
        which.insert(which.end(), {c.tie, c.copy});
        grads.push_back(tied_gradient(c));
      }
      if (Outlet* o = outlet(w)) {
        const auto word = c10::ivalue::Tuple::create({c10::IValue(which), c10::IValue(grads)});
        if (o->send(MailKey{p_.pipe, p_.step, finished_key(self_), 0, false}, word)) continue;
      }
      watch(rpc::rpc_oneway(w, kDone, p_.pipe, p_.step, int64_t{self_}, std::move(which), std::move(grads),
                            remaining() + kReplyMargin / 2),
            w, /*stage=*/-1);
    }
    std::map<std::pair<int, int>, at::Tensor> received;  // by (tie, copy)
    for (int w : others) {
      auto got = Mailbox::get().take(MailKey{p_.pipe, p_.step, finished_key(w), 0, false}, deadline_ + kReplyMargin / 2,
                                     absl::StrCat("worker '", name_of(w), "' to finish its run"));
      throw_if_error(got.status());
      if (got->isTuple() && got->toTupleRef().elements().size() == 2) {
        const auto which = got->toTupleRef().elements()[0].toIntVector();
        const auto grads = got->toTupleRef().elements()[1].toTensorVector();
        for (size_t k = 0; k + 1 < which.size() && k / 2 < grads.size(); k += 2) {
          received[{static_cast<int>(which[k]), static_cast<int>(which[k + 1])}] = grads[k / 2];
        }
      }
    }
    sum_tied_gradients(received);
  }

  // Replicated pipelines: starts the sum of this stage's gradients over its replicas, while the rest of the plan runs
  // (take_turns); `ok` false: zeros, from a run that failed first.
  void reduce_across_replicas(int stage, bool ok) {
    if (!reduced_.insert(stage).second) return;
    std::optional<Reduction> r = take_turns(stage, p_.step, ok);
    if (r && ok) reductions_.push_back(std::move(*r));
  }

  // Replicated pipelines: this worker's turns in the sums of `stage` across the replicas up to step `through` (none for
  // a stage without a group). Every member of a group takes one turn per step, in step order, so that the group's
  // collectives pair step with step. A step before this one that had no turn here takes it now, with zeros: its plan
  // never came before this later one's, and since the driver begins a step only once the one before it has ended,
  // it gave that step up (its plan held back in transit, or never sent here: on_run refuses it if it comes later).
  // `through` == p_.step: this step's own turn too, with the gradients unless !ok, returned. Throws ABORTED naming the
  // stage, worker and step when this step had its turn already (its plan came twice).
  std::optional<Reduction> take_turns(int stage, int64_t through, bool ok) {
    const SumTurns turns = sum_turns(p_.pipe, stage);
    if (!turns.group) return std::nullopt;
    if (through == p_.step && turns.after >= p_.step) {
      throw RpcError(absl::AbortedError(absl::StrCat("stage ", stage, " on worker '", self_name(), "', step ", p_.step,
                                                     ": this step's turn in the sum across the replicas was taken "
                                                     "already (its plan came here twice)")));
    }
    for (int64_t missed = turns.after + 1; missed < p_.step && missed <= through; ++missed) {
      (void)post_sum(*turns.group, stage, missed, false);
      note_summed(p_.pipe, stage, missed);
    }
    if (through < p_.step) return std::nullopt;
    Reduction r = post_sum(*turns.group, stage, p_.step, ok);
    note_summed(p_.pipe, stage, p_.step);
    return r;
  }

  // The turns of the steps before this one that had none here, for every replicated stage of this run, before it
  // computes anything: a peer's sum of such a step, waiting in its group (its collectives in order behind it), ends now
  // instead of at the group's timeout.
  void catch_up_sums() {
    std::set<int> stages;
    for (const Action& a : p_.kept->actions) stages.insert(a.stage);
    for (int stage : stages) (void)take_turns(stage, p_.step - 1, false);
  }

  // Posts this worker's part of step `step`'s sum of `stage`'s gradients over `group`: one bucket of every gradient,
  // flattened, in the widest of the parameters' types (zeros unless `ok`), and beside it a control sum of two
  // doubles: a flag, 1 from a replica whose stage has its gradients and 0 from one whose run failed first (which still
  // takes part, with zeros, so that the group's collectives stay matched and the next step can use it), and the
  // step's number. A flag sum below the group's size: some replica failed this step, and nobody uses the sum; a step
  // sum other than the group's size times this step: the group's collectives are out of step (finish_reductions). The
  // tensors live until the group is done with them.
  Reduction post_sum(comm::ProcessGroup& group, int stage, int64_t step, bool ok) {
    StageRun& run = stage_run(stage);
    at::ScalarType dtype = run.stage->params.empty() ? at::kFloat : run.stage->params[0].scalar_type();
    for (const auto& p : run.stage->params) dtype = c10::promoteTypes(dtype, p.scalar_type());
    std::vector<at::Tensor> flat;
    for (size_t j = 0; j < run.grads.size(); ++j) {
      const at::Tensor& p = run.stage->params[j];
      flat.push_back(ok && run.grads[j].defined() ? run.grads[j].reshape({-1}).to(dtype)
                                                  : at::zeros({p.numel()}, p.options().dtype(dtype)));
    }
    Reduction r;
    r.stage = stage, r.replicas = group.size(), r.start_us = now_us();
    r.control = at::tensor({ok ? 1.0 : 0.0, static_cast<double>(step)}, at::kDouble);
    // All or nothing: the bucket first (the operation that may be refused, e.g. a dtype collectives do not support, and
    // whose concatenation may fail to allocate), so that a post that throws has posted nothing and the turn can be
    // taken again.
    if (!flat.empty()) {
      r.bucket = at::cat(flat);
      r.done = group.allreduce(r.bucket, comm::ReduceOp::kSum);
      r.done.add_callback([t = r.bucket](const rpc::Future&) {});  // alive until the group is done with it
    }
    r.control_done = group.allreduce(r.control, comm::ReduceOp::kSum);
    r.control_done.add_callback([t = r.control](const rpc::Future&) {});
    r.control_done.add_callback([end = r.end_us](const rpc::Future&) {  // the later of the two in the group's order
      end->store(now_us());
    });
    note_sum_posted();
    return r;
  }
  // Every local stage of a replicated pipeline whose sum has not started takes part with zeros (a failed run).
  void reduce_failed() noexcept {
    for (const Action& a : p_.kept->actions) {
      try {
        reduce_across_replicas(a.stage, false);
      } catch (...) {  // the run's own error is what the driver hears; this one is said here
        TANDEM_LOG(kWarn, "pipeline") << "pipeline " << p_.pipe << ", step " << p_.step << ": stage " << a.stage
                                      << " could not take part in the replicas' sum after a failed run: "
                                      << status_from_current_exception().message();
      }
    }
  }
  // Waits (within the step's deadline, and no longer once the step is abandoned) for one of the sums.
  void wait_reduction(const rpc::Future& f, const std::string& stage_here) {
    // In slices, so that a step abandoned meanwhile (another replica failed) ends this wait at once.
    while (!f.wait_for(std::min(remaining(), std::chrono::milliseconds(20)))) {
      if (Mailbox::get().aborted(p_.pipe, p_.step)) {
        throw RpcError(absl::AbortedError(absl::StrCat(
            stage_here,
            ": abandoned while summing its gradients across the replicas: another stage or replica failed")));
      }
      if (Clock::now() < deadline_) continue;
      throw RpcError(absl::DeadlineExceededError(
          absl::StrCat(stage_here,
                       ": summing its gradients across the replicas did not finish within the step's deadline (a "
                       "replica's worker for this stage did not take part)")));
    }
    if (!f.status().ok()) {
      throw RpcError(absl::Status(
          f.status().code(),
          absl::StrCat(stage_here, ": summing its gradients across the replicas failed: ", f.status().message())));
    }
  }
  // Waits for the sums and puts them in place of this replica's gradients.
  void finish_reductions() {
    for (Reduction& r : reductions_) {
      const std::string stage_here = absl::StrCat("stage ", r.stage, " on worker '", self_name(), "'");
      // In the order they were posted: the group runs them in that order and a failure breaks it, so the first one
      // waited for carries the failure's own error (the later one's says only that the group failed earlier).
      if (r.bucket.defined()) wait_reduction(r.done, stage_here);
      wait_reduction(r.control_done, stage_here);
      if (r.control[0].item<double>() < r.replicas - 0.5) {
        throw RpcError(
            absl::AbortedError(absl::StrCat(stage_here, ": another replica's run of this stage failed this step")));
      }
      if (r.control[1].item<double>() != static_cast<double>(r.replicas) * static_cast<double>(p_.step)) {
        throw RpcError(absl::FailedPreconditionError(absl::StrCat(
            stage_here, ": the sums across the replicas are out of step (a replica's worker missed one at step ",
            p_.step, "): make a new ReplicatedPipeline")));
      }
      if (p_.record) {  // in the timeline: from its start to its end (or to now, if its callback has not run yet)
        const int64_t end = r.end_us->load();
        events_.insert(events_.end(),
                       {r.stage, 0, static_cast<int64_t>(Kind::kReduce), r.start_us, end > 0 ? end : now_us()});
      }
      StageRun& run = stage_run(r.stage);
      int64_t at = 0;
      for (size_t j = 0; j < run.grads.size(); ++j) {
        const at::Tensor& p = run.stage->params[j];
        run.grads[j] = r.bucket.narrow(0, at, p.numel()).view(p.sizes()).to(p.scalar_type()).clone();
        at += p.numel();
      }
    }
    reductions_.clear();
  }

  bool tie_held_by(int tie, int rank) const {
    for (const TieCopy& c : p_.kept->ties) {
      if (c.tie == tie && p_.kept->stage_rank[c.stage] == rank) return true;
    }
    return false;
  }

  // This step's gradient of a copy held here (zeros when the step gave it none).
  at::Tensor tied_gradient(const TieCopy& c) {
    StageRun& run = stage_run(c.stage);
    const at::Tensor& g = run.grads[c.param];
    return g.defined() ? g : at::zeros_like(run.stage->params[c.param]);
  }

  // Every copy held here of a tied parameter gets the sum of all its copies' gradients, added in copy order on every
  // worker: the same tensor bit for bit, so that the copies, stepped alike, stay equal.
  void sum_tied_gradients(const std::map<std::pair<int, int>, at::Tensor>& received) {
    std::map<int, at::Tensor> local;  // by tie: the gradient of a copy held here, which the others must match
    for (const TieCopy& c : p_.kept->ties) {
      if (c.param >= 0 && tie_held_by(c.tie, self_) && !local.count(c.tie)) local[c.tie] = tied_gradient(c);
    }
    std::map<int, at::Tensor> sums;
    for (const TieCopy& c : p_.kept->ties) {  // tie by tie, copy by copy
      if (!tie_held_by(c.tie, self_)) continue;
      at::Tensor g;
      if (c.param >= 0) {
        g = tied_gradient(c);
      } else {
        auto it = received.find({c.tie, c.copy});
        if (it == received.end()) {
          tandem::throw_error(absl::InternalError(
              absl::StrCat("no gradient came for copy ", c.copy, " (stage ", c.stage, ") of tied parameter ", c.tie)));
        }
        g = it->second;
        const at::Tensor& want = local.at(c.tie);  // a tie held here has a copy here
        if (!g.defined() || g.sizes() != want.sizes() || g.scalar_type() != want.scalar_type()) {
          tandem::throw_error(absl::InvalidArgumentError(
              absl::StrCat("the gradient of copy ", c.copy, " (stage ", c.stage, ") of tied parameter ", c.tie, " is ",
                           g.defined() ? absl::StrCat(c10::toString(g.scalar_type()), c10::str(g.sizes()))
                                       : std::string("undefined"),
                           ", the copy here ", c10::toString(want.scalar_type()), c10::str(want.sizes()),
                           " on worker '", self_name(), "': the tied parameters differ in shape or dtype")));
        }
      }
      auto [sum, fresh] = sums.emplace(c.tie, at::Tensor());
      sum->second = fresh ? g.clone() : sum->second.add(g);
    }
    for (const TieCopy& c : p_.kept->ties) {
      if (c.param >= 0) stage_run(c.stage).grads[c.param] = sums.at(c.tie).clone();
    }
  }

  // Adds the step's gradients to the caller's distributed autograd context here, or to the parameters' .grad.
  void deliver_gradients() {
    if (Mailbox::get().aborted(p_.pipe, p_.step)) {
      throw RpcError(absl::AbortedError("the step was abandoned before its gradients were delivered"));
    }
    at::NoGradGuard no_grad;
    for (auto& [index, run] : runs_) {
      for (size_t j = 0; j < run.grads.size(); ++j) {
        at::Tensor& g = run.grads[j];
        if (!g.defined()) continue;
        at::Tensor param = run.stage->params[j];
        if (!p_.to_grad) {
          dist_autograd::add_gradient(p_.context, param, g);
        } else if (param.grad().defined()) {
          param.mutable_grad().add_(g);
        } else {
          param.mutable_grad() = std::move(g);  // the run's own tensor: nobody else holds it
        }
      }
    }
  }

  // A failed send wakes this worker's waits at once: the step cannot finish without that message. `stage` < 0: the
  // word that this run finished; else the activation (or gradient) of micro-batch `mb` for that stage. The message is
  // made only on a failure, from the name looked up here (the callback may run on a transport's thread while RPC
  // stops, and must not throw).
  void watch(rpc::Future f, int to, int stage, int mb = 0, bool grad = false) {
    f.add_callback([pipe = p_.pipe, step = p_.step, name = name_of(to), stage, mb, grad](const rpc::Future& done) {
      absl::Status s = done.status();
      if (s.ok()) return;
      Mailbox::get().abort(pipe, step, send_failed(s, name, stage, mb, grad));
    });
    sends_.push_back(Send{std::move(f), to, stage, mb, grad});
  }

  // The error of a send (watch()'s arguments) that failed with `s`: what it carried, to whom, and why.
  static absl::Status send_failed(const absl::Status& s, const std::string& name, int stage, int mb, bool grad) {
    const std::string what =
        stage < 0 ? "end of the run"
                  : absl::StrCat(grad ? "gradient" : "activation", " of micro-batch ", mb, " for stage ", stage);
    return absl::Status(s.code(), absl::StrCat("sending the ", what, " to worker '", name, "' failed: ", s.message()));
  }

  // The outlet into worker `to`'s inbox for this pipeline, or null (messages to it go by RPC). The first run in this
  // process that sends to `to` asks it for its ring (one call, within the step's deadline); attach_outlet keeps the
  // answer for the process until the pipeline goes, and this run keeps it by rank.
  Outlet* outlet(int to) {
    if (auto it = outlets_.find(to); it != outlets_.end()) return it->second.get();
    std::shared_ptr<Outlet> o = attach_outlet(to, p_.pipe, std::min(remaining(), std::chrono::milliseconds(5000)));
    return (outlets_[to] = std::move(o)).get();
  }

  // The name of worker `rank`, which holds a stage of this pipeline.
  const std::string& name_of(int rank) const {
    const std::vector<int>& ranks = p_.kept->stage_rank;
    return stage_names_.at(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  }

  LossFn find_loss_if_last(int n) {
    for (const Action& a : p_.kept->actions) {
      if (a.stage == n - 1) return find_loss(p_.kept->loss);
    }
    return nullptr;
  }

  StageRun& stage_run(int index) {
    auto it = runs_.find(index);
    if (it != runs_.end()) return it->second;
    auto stage = find_stage(p_.pipe, index);
    if (!stage) {
      throw RpcError(absl::NotFoundError(
          absl::StrCat("pipeline ", p_.pipe, " has no stage ", index, " on worker '", self_name(), "' (released?)")));
    }
    StageRun& run = runs_[index];
    run.stage = std::move(stage);
    run.grads.resize(run.stage->params.size());
    return run;
  }

  [[noreturn]] void throw_error(absl::StatusCode code, const Action& a, absl::string_view cause) {
    throw RpcError(
        absl::Status(code, absl::StrCat("stage ", a.stage, " on worker '", self_name(), "', micro-batch ", a.microbatch,
                                        ", ", kKindNames[static_cast<int>(a.kind)], ": ", cause)));
  }

  c10::IValue receive(int stage, int mb, bool grad) {
    const int from = grad ? stage + 1 : stage - 1;
    auto got = Mailbox::get().take(MailKey{p_.pipe, p_.step, stage, mb, grad}, deadline_,
                                   absl::StrCat(grad ? "the gradient" : "the activation", " from stage ", from,
                                                " (worker '", stage_names_[from], "')"));
    throw_if_error(got.status());
    return *std::move(got);
  }

  // The step's micro-batches (stage 0) or targets (the last stage), written by the driver into this worker's inbox
  // before it sent the plan.
  c10::IValue from_driver(const MailKey& key, const char* what) {
    auto got = Mailbox::get().take(key, deadline_, absl::StrCat("the driver's ", what));
    throw_if_error(got.status());
    return *std::move(got);
  }

  void send(int stage, int mb, bool grad, c10::IValue t) {
    compute_end_ = now_us();
    const int to = p_.kept->stage_rank[stage];
    const MailKey key{p_.pipe, p_.step, stage, mb, grad};
    if (to == self_) return Mailbox::get().put(key, std::move(t));
    if (Outlet* o = outlet(to); o && o->send(key, t)) return;
    // One-way: no acknowledgement comes back (a lost receiver fails the step by the driver's call to it, or by the
    // receivers' deadlines); the future completes once the message is on its way.
    watch(rpc::rpc_oneway(to, kAct, p_.pipe, p_.step, int64_t{stage}, int64_t{mb}, grad, std::move(t), remaining()), to,
          stage, mb, grad);
  }

  void forward(StageRun& run, const Action& a, int n, const LossFn& loss, int64_t batch) {
    const bool last = a.stage == n - 1;
    if (a.stage == 0 && p_.by_ring && p_.inputs.empty()) {
      c10::IValue all = from_driver(inputs_key(p_.pipe, p_.step), "micro-batches");
      if (!all.isTuple() || all.toTupleRef().elements().size() != p_.sizes.size()) {
        throw_error(absl::StatusCode::kInvalidArgument, a, "the driver's micro-batches are malformed");
      }
      for (const c10::IValue& e : all.toTupleRef().elements()) {
        if (!e.isTuple()) throw_error(absl::StatusCode::kInvalidArgument, a, "a micro-batch is not a tuple");
        p_.inputs.push_back(args_of(e));
      }
    }
    Args x = a.stage != 0 ? args_of(receive(a.stage, a.microbatch, false)) : p_.inputs.at(a.microbatch);
    compute_start_ = now_us();
    Live live;
    c10::IValue out = forward_microbatch(*run.stage, std::move(x), a.stage == 0, p_.checkpoint && !last, &live);
    if (last) {
      if (!out.isTensor()) {
        fail(absl::StatusCode::kInvalidArgument,
             absl::StrCat("the last stage returned a ", out.tagKind(), ": it returns one tensor, for the loss"));
      }
      const double share = static_cast<double>(p_.sizes[a.microbatch]) / static_cast<double>(batch);
      if (p_.by_ring && p_.targets.empty()) {
        c10::IValue all = from_driver(targets_key(p_.pipe, p_.step, n), "targets");
        if (!all.isTensorList() || all.toTensorList().size() != p_.sizes.size()) {
          throw_error(absl::StatusCode::kInvalidArgument, a, "the driver's targets are malformed");
        }
        p_.targets = all.toTensorVector();
      }
      at::Tensor l = loss(out.toTensor(), p_.targets.at(a.microbatch)) * share;
      loss_ += l.item<double>();
      live.output = l;
    } else {
      if (tensors_in_dict(out)) {
        fail(absl::StatusCode::kInvalidArgument,
             "the stage returned tensors inside a dict: return them in a tuple or a list");
      }
      send(a.stage + 1, a.microbatch, false, map_tensors(out, [](const at::Tensor& t) { return t.detach(); }));
    }
    run.live[a.microbatch] = std::move(live);
    run.peak = std::max(run.peak, static_cast<int64_t>(run.live.size() + run.pending.size()));
  }

  void backward(StageRun& run, const Action& a, int n) {
    auto it = run.live.find(a.microbatch);
    if (it == run.live.end()) tandem::throw_error(absl::InternalError("backward before forward"));
    Live live = std::move(it->second);
    run.live.erase(it);  // the micro-batch's activations go when this backward is done
    const bool last = a.stage == n - 1;
    c10::IValue grad_out;
    if (!last) grad_out = receive(a.stage, a.microbatch, true);
    compute_start_ = now_us();
    c10::IValue input_grad;
    if (a.kind == Kind::kInput) {
      InputGradients g =
          backward_input(*run.stage, std::move(live), grad_out, a.stage == 0, last, !last && p_.checkpoint);
      run.pending[a.microbatch] = std::move(g.work);
      input_grad = std::move(g.input);
    } else {
      MicrobatchGradients g =
          backward_microbatch(*run.stage, std::move(live), grad_out, a.stage == 0, last, !last && p_.checkpoint);
      accumulate(run.grads, std::move(g.params));
      input_grad = std::move(g.input);
    }
    if (a.stage > 0) send(a.stage - 1, a.microbatch, true, std::move(input_grad));
  }

  // W: the weights' gradients of a micro-batch whose I ran; its graph goes with it.
  void weight(StageRun& run, const Action& a) {
    auto it = run.pending.find(a.microbatch);
    if (it == run.pending.end()) tandem::throw_error(absl::InternalError("W before its I"));
    std::shared_ptr<WeightWork> work = std::move(it->second);
    run.pending.erase(it);
    compute_start_ = now_us();
    accumulate(run.grads, backward_weight(*run.stage, std::move(work)));
  }

  Plan p_;
  const Clock::time_point deadline_;
  const int self_;
  std::vector<std::string> stage_names_;
  std::map<int, StageRun> runs_;
  struct Send {  // a message sent by this run (watch()), and what it carries
    rpc::Future future;
    int to;
    int stage;
    int mb;
    bool grad;
  };
  std::vector<Send> sends_;
  std::map<int, std::shared_ptr<Outlet>> outlets_;  // this run's, by rank (attach_outlet's)
  std::vector<Reduction> reductions_;
  std::set<int> reduced_;  // stages whose sum across the replicas started
  std::vector<int64_t> events_;
  double loss_ = 0;
  int64_t compute_start_ = 0;  // when the current action had its input and began computing
  int64_t compute_end_ = 0;    // when it had computed what it sends (0: it sends nothing)
};

// The plan of `m` micro-batches: the one sent (cached for the following steps of that shape), or, when none came,
// the one cached.
std::shared_ptr<const CachedPlan> plan_of(int64_t pipe, int64_t m, const std::vector<int64_t>& actions,
                                          const std::vector<int64_t>& stage_rank, std::string loss,
                                          const std::vector<int64_t>& ties, const std::vector<std::string>& tie_names) {
  if (actions.empty()) {
    auto cached = find_plan(pipe, m);
    if (!cached) {
      throw_error(absl::NotFoundError(absl::StrCat("pipeline ", pipe, " has no plan of ", m,
                                                   " micro-batches on worker '", self_name(), "' (released?)")));
    }
    return cached;
  }
  auto plan = std::make_shared<CachedPlan>();
  if (actions.size() % 3 != 0) throw_error(absl::InvalidArgumentError("malformed pipeline plan"));
  for (size_t i = 0; i < actions.size(); i += 3) {
    if (actions[i + 2] < 0 || actions[i + 2] > 3) {
      throw_error(absl::InvalidArgumentError("malformed pipeline plan: an action of no known kind"));
    }
    plan->actions.push_back(
        Action{static_cast<int>(actions[i]), static_cast<int>(actions[i + 1]), static_cast<Kind>(actions[i + 2])});
  }
  for (int64_t r : stage_rank) plan->stage_rank.push_back(static_cast<int>(r));
  for (const Action& a : plan->actions) {
    if (a.stage < 0 || a.stage >= static_cast<int>(stage_rank.size()) || a.microbatch < 0 || a.microbatch >= m) {
      throw_error(absl::InvalidArgumentError("malformed pipeline plan: an action outside the stages or micro-batches"));
    }
  }
  plan->loss = std::move(loss);
  if (ties.size() != 3 * tie_names.size()) throw_error(absl::InvalidArgumentError("malformed pipeline plan: ties"));
  const int self = rpc::get_worker_info().id;
  for (size_t k = 0; k < tie_names.size(); ++k) {
    TieCopy c{static_cast<int>(ties[3 * k]), static_cast<int>(ties[3 * k + 1]), static_cast<int>(ties[3 * k + 2]),
              tie_names[k]};
    if (c.stage < 0 || c.stage >= static_cast<int>(plan->stage_rank.size())) {
      throw_error(absl::InvalidArgumentError("malformed pipeline plan: a tie names no stage"));
    }
    if (plan->stage_rank[c.stage] == self) c.param = tied_parameter_index(pipe, c.stage, c.name);
    plan->ties.push_back(std::move(c));
  }
  if (!cache_plan(pipe, m, plan)) {
    throw_error(absl::NotFoundError(
        absl::StrCat("pipeline ", pipe, " has no stage on worker '", self_name(), "' (released?)")));
  }
  return plan;
}

// A step the driver started without a call failed here: the error goes into the driver's inbox as the reply,
// (kErrorTag, code, message). When it cannot, the driver's wait ends at the step's deadline, naming this worker.
void error_to_driver(int64_t pipe, int64_t step, int driver, const absl::Status& status) noexcept try {
  std::shared_ptr<Outlet> o = driver >= 0 ? reply_outlet(pipe, driver, std::chrono::milliseconds(5000)) : nullptr;
  const auto error =
      c10::ivalue::Tuple::create({c10::IValue(std::string(kErrorTag)), c10::IValue(static_cast<int64_t>(status.code())),
                                  c10::IValue(std::string(status.message()))});
  if (!o || !o->send(MailKey{pipe, step, 0, 0, false}, error)) {
    TANDEM_LOG(kWarn, "pipeline") << "step " << step << " of pipeline " << pipe
                                  << " failed here, and the driver's inbox cannot take the error: " << status.message();
  }
} catch (...) {  // RPC stopping: the driver's wait ends at its deadline; the step's error is said here
  TANDEM_LOG(kWarn, "pipeline") << "step " << step << " of pipeline " << pipe << " failed here (" << status.message()
                                << "), and telling the driver failed: " << status_from_current_exception().message();
}

// Runs a step's plan here and answers it: a call's `result` (on one host the reply goes into the driver's inbox and
// the call answers None), or, for a step the driver started without a call (`result` null), the driver's inbox
// alone: the reply, or the error as (kErrorTag, code, message).
void run_and_reply(Plan plan, rpc::Future* result, int driver) {
  const int64_t pipe = plan.pipe, step = plan.step;
  struct Ended {
    ~Ended() { g_runs_ended.fetch_add(1); }
  } ended;
  const auto timeout = std::min(plan.timeout, std::chrono::milliseconds(5000));
  absl::Status status;
  try {
    Run run(std::move(plan));
    c10::IValue value = run.execute();
    Mailbox::get().finish(pipe, step);  // a late duplicate of one of its messages is dropped from now on
    std::shared_ptr<Outlet> o = driver >= 0 ? reply_outlet(pipe, driver, timeout) : nullptr;
    if (o && o->send(MailKey{pipe, step, 0, 0, false}, value)) value = c10::IValue();
    if (result) {
      result->set_value(std::move(value));
    } else if (!value.isNone()) {
      status = absl::InternalError("the step's reply did not fit into the driver's inbox");
    }
  } catch (...) {
    status = status_from_current_exception();
  }
  if (status.ok()) return;
  if (result) {
    result->set_error(status);
  } else {
    error_to_driver(pipe, step, driver, status);
  }
  // Whatever else of this step is still on its way here is of no use now.
  Mailbox::get().abort(pipe, step, status);
}

// A step the driver on this host started without a call (go_key: (sizes, flags, context, driver), flags as the
// call's): the plan held here runs now, its gradients go to the driver's context (made known here: the driver added
// this worker to it, so its release comes here), its reply or error into the driver's inbox. A go this worker cannot
// use, or whose step was abandoned here before it was taken (go.dropped), is answered with an error there.
void run_direct(const Mailbox::Go& go) {
  const int64_t pipe = go.pipe, step = go.step;
  int driver = with_pipe(pipe, [](PipeEntry* e) { return e ? e->driver : -1; });
  Plan plan;
  plan.pipe = pipe, plan.step = step;
  try {
    const auto& e = go.value.isTuple() ? go.value.toTupleRef().elements() : std::vector<c10::IValue>{};
    if (e.size() == 4 && e[3].isInt()) driver = static_cast<int>(e[3].toInt());
    if (!go.dropped.ok()) {
      throw_error(absl::Status(go.dropped.code(), absl::StrCat("step ", step, " of pipeline ", pipe,
                                                               " was abandoned before it started on worker '",
                                                               self_name(), "': ", go.dropped.message())));
    }
    if (e.size() != 4 || !e[0].isIntList() || !e[1].isIntList() || !e[2].isInt() || !e[3].isInt()) {
      throw_error(absl::InvalidArgumentError("malformed pipeline step in shared memory"));
    }
    plan.sizes = e[0].toIntVector();
    const std::vector<int64_t> flags = e[1].toIntVector();
    if (flags.size() != 6 || plan.sizes.empty()) {
      throw_error(absl::InvalidArgumentError("malformed pipeline step in shared memory"));
    }
    plan.kept = plan_of(pipe, static_cast<int64_t>(plan.sizes.size()), {}, {}, "", {}, {});
    plan.checkpoint = flags[0] != 0, plan.to_grad = flags[1] != 0, plan.record = flags[2] != 0;
    plan.timeout = wire_timeout(flags[3]);
    plan.total_rows = flags[4];
    plan.by_ring = flags[5] != 0;
    // A go comes in order behind the goes before it (one ring), and only once the step before it has ended; recorded
    // so that a call of an earlier step that comes later is refused (on_run).
    int64_t newest = -1;
    (void)note_step(pipe, step, &newest);
    if (!plan.to_grad) {
      if (Mailbox::get().aborted(pipe, step)) {  // its release may have come already: the context is not made here
        throw_error(absl::AbortedError(absl::StrCat("step ", step, " of pipeline ", pipe,
                                                    " was abandoned before it started on worker '", self_name(), "'")));
      }
      plan.context = e[2].toInt();
      dist_autograd::adopt_context(plan.context, driver);
    }
  } catch (...) {
    const absl::Status status = status_from_current_exception();
    error_to_driver(pipe, step, driver, status);
    Mailbox::get().abort(pipe, step, status);
    return;
  }
  g_direct_runs.fetch_add(1);
  run_and_reply(std::move(plan), nullptr, driver);
}

rpc::Future on_run(int64_t pipe, int64_t step, std::vector<int64_t> actions, std::vector<int64_t> stage_rank,
                   std::vector<int64_t> sizes, std::vector<c10::IValue> inputs, std::vector<at::Tensor> targets,
                   std::string loss, std::vector<int64_t> flags, std::vector<int64_t> ties,
                   std::vector<std::string> tie_names) {
  Plan plan;
  plan.pipe = pipe, plan.step = step;
  if (flags.size() != 6 || sizes.empty()) throw_error(absl::InvalidArgumentError("malformed pipeline plan"));
  plan.total_rows = flags[4];
  plan.by_ring = flags[5] != 0;
  plan.kept = plan_of(pipe, static_cast<int64_t>(sizes.size()), actions, stage_rank, std::move(loss), ties, tie_names);
  plan.sizes = std::move(sizes);
  for (auto& x : inputs) {
    if (!x.isTuple()) throw_error(absl::InvalidArgumentError("malformed pipeline plan: a micro-batch is not a tuple"));
    plan.inputs.push_back(args_of(std::move(x)));
  }
  plan.targets = std::move(targets);
  plan.checkpoint = flags[0] != 0, plan.to_grad = flags[1] != 0, plan.record = flags[2] != 0;
  plan.timeout = wire_timeout(flags[3]);
  if (int64_t newest = -1; !note_step(pipe, step, &newest)) {
    // A step the driver gave up (it began a later one, which only follows this one's end): nothing of it runs here,
    // and its context is not adopted (its release may have come first). A replicated stage took, or takes, its turn
    // in this step's sums with zeros when the later step's run begins (Run::take_turns).
    const absl::Status late = absl::AbortedError(
        step == newest ? absl::StrCat("step ", step, " of pipeline ", pipe, ": its plan reached worker '", self_name(),
                                      "' twice: not run again")
                       : absl::StrCat("step ", step, " of pipeline ", pipe, ": its plan reached worker '", self_name(),
                                      "' after step ", newest, "'s (the driver had given it up): not run"));
    if (step < newest) Mailbox::get().abort(pipe, step, late);  // what else of it comes is dropped
    throw_error(late);
  }
  if (!plan.to_grad) {
    // The gradients go to the caller's context here: known on this worker from now on, so the run's own thread may
    // add to it and the caller's release reaches it. Not for a step the driver already abandoned (its release may
    // have come before this late call: the context would stay).
    if (dist_autograd::current_context() < 0) {
      throw_error(absl::FailedPreconditionError("the plan came without a distributed autograd context"));
    }
    if (Mailbox::get().aborted(pipe, step)) {
      // The context is not adopted (its release may have come before this late call: it would stay), but the run is
      // queued: a replicated stage must still take part in its sums (Run::execute).
      plan.abandoned = absl::AbortedError(absl::StrCat(
          "step ", step, " of pipeline ", pipe, " was abandoned before its plan reached worker '", self_name(), "'"));
    } else {
      plan.context = dist_autograd::adopt_current_context();
    }
  }
  auto executor = executor_of(pipe);
  if (!executor) {
    throw_error(absl::NotFoundError(
        absl::StrCat("pipeline ", pipe, " has no stage on worker '", self_name(), "' (released?)")));
  }
  rpc::Future result(absl::Now() + absl::FromChrono(plan.timeout + kReplyMargin));
  const rpc::CallContext* call = rpc::current_call();
  const int driver = call ? call->caller_rank : -1;
  // On the pipeline's executor: after the run of the previous step has ended here.
  const bool queued = executor->submit(
      [plan = std::move(plan), result, driver]() mutable { run_and_reply(std::move(plan), &result, driver); });
  if (!queued) throw_error(absl::AbortedError(absl::StrCat("pipeline ", pipe, " was released on this worker")));
  return result;
}

// Inference, one micro-batch on one stage (on the pipeline's executor, in eval mode, without gradients), then the
// next stage's, asynchronously: no thread waits for the rest.
rpc::Future on_forward(int64_t pipe, int64_t index, std::vector<int64_t> ranks, std::vector<c10::IValue> x,
                       int64_t timeout_ms) {
  auto executor = executor_of(pipe);
  if (!executor) {
    throw_error(absl::NotFoundError(
        absl::StrCat("pipeline ", pipe, " has no stage ", index, " on worker '", self_name(), "' (released?)")));
  }
  const auto timeout = wire_timeout(timeout_ms);
  const auto deadline = Clock::now() + timeout;
  rpc::Future result(absl::Now() + absl::FromChrono(timeout));
  const bool queued = executor->submit([=]() mutable {
    try {
      auto stage = find_stage(pipe, static_cast<int>(index));
      if (!stage) {
        throw_error(absl::NotFoundError(
            absl::StrCat("pipeline ", pipe, " has no stage ", index, " on worker '", self_name(), "' (released?)")));
      }
      c10::IValue y;
      const bool training = stage->is_training();
      try {
        at::NoGradGuard no_grad;
        stage->set_training(false);  // dropout off, BatchNorm's running statistics used and left as they are
        y = stage->forward(x);
        stage->set_training(training);
      } catch (...) {
        stage->set_training(training);
        const absl::Status thrown = status_from_current_exception();
        throw_error(absl::Status(thrown.code(), absl::StrCat("stage ", index, " on worker '", self_name(),
                                                             "', forward: ", thrown.message())));
      }
      if (index + 1 >= static_cast<int64_t>(ranks.size())) {
        if (!y.isTensor()) {
          throw_error(absl::InvalidArgumentError(absl::StrCat("stage ", index, " on worker '", self_name(),
                                                              "', forward: the last stage returned a ", y.tagKind(),
                                                              ", not one tensor")));
        }
        result.set_value(std::move(y));
        return;
      }
      // The next hop gets what is left, less a tenth (at most 1 s) for its reply to come back: a stage that stalls
      // makes its caller's call run out first, which names it, instead of the driver's call to stage 0.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      const auto hop = left - std::min<std::chrono::milliseconds>(left / 10, std::chrono::seconds(1));
      if (hop.count() <= 0) {
        throw_error(absl::DeadlineExceededError(absl::StrCat("stage ", index, " on worker '", self_name(),
                                                             "': no time left of the ", timeout.count(),
                                                             " ms timeout for stage ", index + 1)));
      }
      rpc::Future next = rpc::rpc_async(static_cast<int>(ranks[index + 1]), kForward, pipe, index + 1, ranks,
                                        args_of(std::move(y)), static_cast<int64_t>(hop.count()), hop);
      next.add_callback([result](const rpc::Future& done) {
        const absl::Status s = done.status();
        result.set_status(s, s.ok() ? done.value() : c10::IValue());
      });
    } catch (...) {
      result.set_error(status_from_current_exception());
    }
  });
  if (!queued) throw_error(absl::AbortedError(absl::StrCat("pipeline ", pipe, " was released on this worker")));
  return result;
}

// The answer to kAttach and kAttachReply: [pid, bell fd, ring fd, token] of the ring for worker `from` in `inbox`,
// or [] when there is no inbox for it (the peer then sends by RPC).
c10::IValue ring_answer(Inbox* inbox, int64_t from) {
  if (!inbox) return c10::IValue(std::vector<int64_t>{});
  const RingEnds ends = inbox->ends_for(static_cast<int>(from));
  return c10::IValue(std::vector<int64_t>{ends.pid, ends.bell_fd, ends.ring_fd, ends.token});
}

bool install() {
  throw_if_error(rpc::register_handler(kCreate, [](std::vector<c10::IValue>&& a) -> rpc::Future {
    if (a.size() != 8 || !a[0].isInt() || !a[1].isInt() || !a[2].isString() || !a[3].isList() || !a[4].isInt() ||
        !a[5].isInt() || !a[6].isString() || !a[7].isString()) {
      throw_error(absl::InvalidArgumentError("malformed pipeline stage creation"));
    }
    const int64_t pipe = a[0].toInt();
    const int index = static_cast<int>(a[1].toInt());
    const rpc::CallContext* call = rpc::current_call();
    const int driver = call ? call->caller_rank : -1;
    auto released = [&] {
      return absl::AbortedError(absl::StrCat("pipeline ", pipe, " was released while stage ", index,
                                             " was being built on worker '", self_name(), "'"));
    };
    if (was_released(pipe)) throw_error(released());
    std::vector<c10::IValue> args;
    for (const auto& v : a[3].toListRef()) args.push_back(v);
    auto stage = !a[6].toStringRef().empty() ? load_script_stage(a[6].toStringRef())
                 : !a[7].toStringRef().empty()
                     ? build_layers_stage(a[7].toStringRef(), a[4].toInt(), a[5].toInt())
                     : build_stage(a[2].toStringRef(), std::move(args), a[4].toInt(), a[5].toInt());
    std::vector<at::Tensor> params = stage->params;
    // A release that overtook this build (the driver gave up waiting, or its pipeline object went) drops it here.
    if (!add_stage(pipe, index, driver, std::move(stage))) throw_error(released());
    std::vector<c10::IValue> refs;
    for (const auto& p : params) refs.push_back(rref::make_local(c10::IValue(p)).to_ivalue());
    return rpc::Future::ready(c10::ivalue::Tuple::create(std::move(refs)));
  }));
  rpc::register_function(kRun, on_run);
  rpc::register_message(kDone, [](int64_t pipe, int64_t step, int64_t from, std::vector<int64_t> tied,
                                  std::vector<at::Tensor> tied_grads) {
    const rpc::CallContext* call = rpc::current_call();
    if (!call || call->caller_rank != from) {
      throw_error(absl::InvalidArgumentError(
          absl::StrCat("malformed pipeline message: worker ", from, "'s end of a run sent by another worker")));
    }
    if (tied.size() != 2 * tied_grads.size()) {
      throw_error(absl::InvalidArgumentError("malformed pipeline message: tied gradients"));
    }
    Mailbox::get().put(MailKey{pipe, step, finished_key(static_cast<int>(from)), 0, false},
                       c10::ivalue::Tuple::create({c10::IValue(std::move(tied)), c10::IValue(std::move(tied_grads))}));
  });
  rpc::register_function(kTie, [](int64_t pipe, int64_t stage, std::string name, c10::IValue value) -> c10::IValue {
    auto s = find_stage(pipe, static_cast<int>(stage));
    if (!s) {
      throw_error(absl::NotFoundError(
          absl::StrCat("pipeline ", pipe, " has no stage ", stage, " on worker '", self_name(), "'")));
    }
    at::Tensor param = s->params.at(tied_parameter_index(pipe, static_cast<int>(stage), name));
    if (value.isNone()) return param.detach().clone();
    const at::Tensor v = value.toTensor();
    if (v.sizes() != param.sizes() || v.scalar_type() != param.scalar_type()) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("tied parameter '", name, "' of stage ", stage,
                                                          " on worker '", self_name(), "' is ", param.toString(), " [",
                                                          absl::StrJoin(param.sizes(), ", "), "], its first copy ",
                                                          v.toString(), " [", absl::StrJoin(v.sizes(), ", "), "]")));
    }
    at::NoGradGuard no_grad;
    param.copy_(v);
    return c10::IValue();
  });
  rpc::register_function(
      kGroup, [](int64_t pipe, int64_t stage, std::string name, std::vector<int64_t> ranks, int64_t timeout_ms) {
        auto held = find_stage(pipe, static_cast<int>(stage));
        if (!held || ranks.empty()) {
          throw_error(absl::NotFoundError(
              absl::StrCat("pipeline ", pipe, " has no stage ", stage, " on worker '", self_name(), "'")));
        }
        std::vector<int> members(ranks.begin(), ranks.end());
        // Its operations wait as long as the pipeline's steps may take.
        comm::ProcessGroupOptions group_options;
        group_options.timeout = wire_timeout(timeout_ms);
        auto group = comm::ProcessGroup::create(name, members, group_options);
        // Every replica starts from replica 0's parameters (ranks[0]'s; the group numbers its ranks in sorted order).
        std::sort(members.begin(), members.end());
        const int root = static_cast<int>(std::find(members.begin(), members.end(), ranks[0]) - members.begin());
        for (const auto& p : held->params) {
          at::Tensor t = p.detach();
          comm::wait(group->broadcast(t, root));
        }
        with_pipe(pipe, [&](PipeEntry* e) {
          if (e) e->replica_groups[static_cast<int>(stage)] = group;
          return 0;
        });
      });
  rpc::register_function(kForward, on_forward);
  rpc::register_function(kPing, [] {});
  rpc::register_message(kAct, [](int64_t pipe, int64_t step, int64_t stage, int64_t mb, bool grad, c10::IValue t) {
    // A stage's activation or gradient only: a stage below zero is a worker's end of a run or a driver's start of a
    // step, micro-batch -1 the driver's inputs or targets (kDone and the same-host rings bring those, checked there),
    // never this message. Refused (the worker's log
    // says so: nobody waits for a one-way message's reply).
    if (stage < 0 || stage > std::numeric_limits<int>::max() || mb < 0 || mb > std::numeric_limits<int>::max()) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("pipeline ", pipe, ": an activation for stage ", stage,
                                                          ", micro-batch ", mb, " names no stage's message")));
    }
    Mailbox::get().put(MailKey{pipe, step, static_cast<int>(stage), static_cast<int>(mb), grad}, std::move(t));
  });
  // A peer's request for a ring in this worker's inbox for `pipe`: [pid, bell fd, ring fd, token], or [] where
  // shared memory is not for it (another host, switched off, the pipeline not held here).
  rpc::register_function(kAttach, [](int64_t pipe, int64_t from, std::string place) -> c10::IValue {
    if (!shared_memory_enabled() || place != comm::detail::host_place()) return ring_answer(nullptr, from);
    std::shared_ptr<Inbox> inbox;
    std::shared_ptr<Executor> executor;
    bool made = false;
    with_pipe(pipe, [&](PipeEntry* e) {
      if (!e) return 0;
      if (!e->inbox) e->inbox = std::make_shared<Inbox>(), made = true;
      inbox = e->inbox, executor = e->executor;
      return 0;
    });
    if (made && inbox) {
      Mailbox::get().set_inbox(pipe, inbox);
      if (executor) executor->set_inbox(inbox);  // from now on it sleeps on the bell when idle
    }
    return ring_answer(inbox.get(), from);
  });
  // A stage worker's request for a ring in this driver's inbox for `pipe`'s replies: as kAttach.
  rpc::register_function(kAttachReply, [](int64_t pipe, int64_t from, std::string place) -> c10::IValue {
    if (!shared_memory_enabled() || place != comm::detail::host_place()) return ring_answer(nullptr, from);
    return ring_answer(driver_inbox(pipe, false).get(), from);
  });
  rpc::register_function(kAbort, [](int64_t pipe, int64_t step, std::string reason) {
    Mailbox::get().abort(pipe, step, absl::AbortedError(reason));
  });
  // Sent through rpc::detail::releases(): a list of pipelines, possibly one already released.
  rpc::register_function(kRelease, [](std::vector<int64_t> pipes) { release_pipes(pipes); });
  rpc::add_stop_hook([] {
    Mailbox::get().abort_all(absl::CancelledError("RPC is shutting down"));
    Stages& s = stages();
    std::vector<int64_t> all;
    std::thread sweeper;
    {
      MutexLock lock(&s.mu);
      s.stopping = true;
      s.cv.SignalAll();
      sweeper.swap(s.sweeper);
      for (const auto& [pipe, e] : s.pipes) all.push_back(pipe);
    }
    if (sweeper.joinable()) sweeper.join();
    release_pipes(all);  // joins every executor (a stage still running after RPC's timeout is left to it)
    MutexLock lock(&s.mu);
    s.stopping = false;  // RPC may start again in this process
  });
  return true;
}

const bool g_installed = install();

}  // namespace

void ensure_runtime() { (void)g_installed; }

int64_t plans_received() { return g_plans_received.load(); }
int64_t runs_ended() { return g_runs_ended.load(); }
int64_t runs_started_directly() { return g_direct_runs.load(); }

bool shared_memory_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_PIPELINE_SHM");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

std::shared_ptr<Outlet> attach_outlet(int to, int64_t pipe, std::chrono::milliseconds timeout, const char* function) {
  if (!shared_memory_enabled()) return nullptr;
  const auto key = std::make_tuple(pipe, to, std::string(function));
  Outlets& all = outlets();
  {
    MutexLock lock(&all.mu);
    if (auto it = all.by.find(key); it != all.by.end()) return it->second;
  }
  std::shared_ptr<Outlet> o;
  try {
    rpc::Future f = rpc::call_and_wait(
        to, function,
        {c10::IValue(pipe), c10::IValue(int64_t{rpc::get_worker_info().id}), c10::IValue(comm::detail::host_place())},
        timeout);
    if (!f.status().ok()) {
      // Kept as no ring (a peer gone or stuck must not cost every later step this call's time); said, since a live
      // peer's messages then go by RPC, 10-20x slower, for the pipeline's life.
      TANDEM_LOG(kWarn, "pipeline") << "pipeline " << pipe << ": asking rank " << to << " for its shared-memory ring "
                                    << "failed (" << f.status() << "); its messages go by RPC";
    } else if (const auto ends = f.value().toIntVector(); ends.size() == 4) {  // [] (another host, no shm): none
      auto opened = Outlet::open(RingEnds{ends[0], ends[1], ends[2], ends[3]});
      if (opened.ok()) {
        o = std::move(*opened);
      } else {  // nothing else would tell: the messages still arrive, 10-20x slower (docs/pipeline.md)
        TANDEM_LOG(kWarn, "pipeline") << "pipeline " << pipe << ": cannot open the shared-memory ring of rank " << to
                                      << " (" << opened.status() << "); its messages go by RPC";
      }
    }
  } catch (const std::exception& e) {
    o = nullptr;  // the messages go by RPC, which reports what is wrong with the peer
    TANDEM_LOG(kDebug, "pipeline") << "pipeline " << pipe << ": no shared-memory ring to rank " << to << " ("
                                   << e.what() << "); its messages go by RPC";
  }
  MutexLock lock(&all.mu);
  return all.by.emplace(key, std::move(o)).first->second;  // another thread's, if it came first
}

void drop_outlets(int64_t pipe) {
  std::vector<std::shared_ptr<Outlet>> gone;  // unmapped outside the lock
  Outlets& all = outlets();
  MutexLock lock(&all.mu);
  for (auto it = all.by.begin(); it != all.by.end();) {
    if (std::get<0>(it->first) != pipe) {
      ++it;
      continue;
    }
    gone.push_back(std::move(it->second));
    it = all.by.erase(it);
  }
}

std::shared_ptr<Inbox> driver_inbox(int64_t pipe, bool create) {
  DriverInboxes& d = driver_inboxes();
  MutexLock lock(&d.mu);
  auto it = d.by_pipe.find(pipe);
  if (it != d.by_pipe.end()) return it->second;
  if (!create || !shared_memory_enabled()) return nullptr;
  std::shared_ptr<Inbox> inbox;
  try {
    inbox = std::make_shared<Inbox>();
  } catch (const std::exception& e) {
    // No shared memory here (memfd refused, out of descriptors): the replies come by RPC. Kept as null.
    TANDEM_LOG(kWarn, "pipeline") << "pipeline " << pipe << ": no shared-memory inbox for the driver (" << e.what()
                                  << "); its replies come by RPC";
  }
  return d.by_pipe[pipe] = inbox;
}

void drop_driver_inbox(int64_t pipe) {
  std::shared_ptr<Inbox> gone;  // unmapped outside the lock
  DriverInboxes& d = driver_inboxes();
  MutexLock lock(&d.mu);
  auto it = d.by_pipe.find(pipe);
  if (it == d.by_pipe.end()) return;
  gone = std::move(it->second);
  d.by_pipe.erase(it);
}

}  // namespace detail

std::shared_ptr<torch::nn::Module> local_stage(int64_t pipeline_id, int stage) {
  auto s = detail::find_stage(pipeline_id, stage);
  return s ? s->module : nullptr;
}

int64_t local_plan_count() {
  detail::Stages& s = detail::stages();
  MutexLock lock(&s.mu);
  int64_t n = 0;
  for (const auto& [pipe, e] : s.pipes) n += static_cast<int64_t>(e.plans.size());
  return n;
}

int64_t local_stage_count() {
  detail::Stages& s = detail::stages();
  MutexLock lock(&s.mu);
  int64_t n = 0;
  for (const auto& [pipe, e] : s.pipes) n += static_cast<int64_t>(e.stages.size());
  return n;
}

}  // namespace tandem::pipeline
