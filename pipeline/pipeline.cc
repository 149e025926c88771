// Pipeline parallelism: the driver (plans, step, errors) and the stage workers' runtime (stages, mailbox, runs).
#include "pipeline/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "absl/base/attributes.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "dist_autograd/dist_autograd.h"
#include "nn/remote_module.h"
#include "rpc/detail/ids.h"
#include "rpc/errors.h"
#include "rpc/extension.h"
#include "rpc/registry.h"
#include "sync/sync.h"

namespace tandem::pipeline {
namespace {

constexpr const char* kCreate = "__tandem.pipeline.create";
constexpr const char* kRun = "__tandem.pipeline.run";
constexpr const char* kAct = "__tandem.pipeline.act";
constexpr const char* kAbort = "__tandem.pipeline.abort";
constexpr const char* kRelease = "__tandem.pipeline.release";
constexpr const char* kForward = "__tandem.pipeline.forward";
constexpr const char* kCommit = "__tandem.pipeline.commit";
constexpr const char* kPing = "__tandem.pipeline.ping";
// How often a stage worker checks that the drivers of the pipelines it holds stages of are alive (a driver that died
// leaves its stages behind otherwise), and how long each check may take.
constexpr std::chrono::milliseconds kDriverCheck{1000};
// A worker's reply (its own error naming stage and micro-batch) must reach the driver before the driver's own wait
// on that worker runs out: the RPC carrying a plan gets the step's timeout plus this.
constexpr std::chrono::milliseconds kReplyMargin{2000};
// After the first failure, how long the driver waits for the other workers' errors (which name, e.g., the
// micro-batch a dead worker's neighbour could not send) before it reports.
constexpr std::chrono::milliseconds kErrorGrace{2000};

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(absl::StatusCode code, const std::string& message) {
  throw RpcError(absl::Status(code, "pipeline: " + message));
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void check_not_empty(const at::Tensor& input) {
  if (!input.defined() || input.dim() == 0 || input.size(0) == 0) {
    fail(absl::StatusCode::kInvalidArgument, "the batch is empty (the input needs at least one row)");
  }
}

std::string self_name() { return rpc::is_initialized() ? rpc::get_worker_info().name : "(local)"; }

// ---- losses ----

using LossFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;
struct Losses {
  Mutex mu;
  std::map<std::string, LossFn> by_name ABSL_GUARDED_BY(mu) = {
      {"mse", [](const at::Tensor& o, const at::Tensor& t) { return at::mse_loss(o, t); }},
      {"cross_entropy", [](const at::Tensor& o, const at::Tensor& t) { return at::cross_entropy_loss(o, t); }},
      {"nll", [](const at::Tensor& o, const at::Tensor& t) { return at::nll_loss(o, t); }},
  };
};
Losses& losses() {
  static auto* l = new Losses;
  return *l;
}
LossFn find_loss(const std::string& name) {
  Losses& l = losses();
  MutexLock lock(&l.mu);
  auto it = l.by_name.find(name);
  if (it == l.by_name.end()) {
    throw_error(absl::NotFoundError(absl::StrCat("no loss named '", name, "' on worker '", self_name(),
                                                 "' (built in: mse, cross_entropy, nll; or pipeline::register_loss)")));
  }
  return it->second;
}

// ---- stages held by this worker ----

struct Stage {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<at::Tensor> params;
  // Running statistics and the like: a checkpointed recompute leaves them as they were.
  std::vector<at::Tensor> buffers;
  std::function<bool()> is_training;
  std::function<void(bool)> set_training;
};

// Runs one pipeline's work on this worker, one task at a time in the order queued: a step's plan, an inference
// micro-batch. So the run of step n + 1 never starts before the run of step n has ended here, and nothing of a
// pipeline runs on an RPC server thread. stop() runs what is queued (those tasks fail fast: their pipeline is gone)
// and joins the thread.
class Executor {
 public:
  Executor() : thread_([this] { loop(); }) {}
  ~Executor() { stop(); }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // False when stopped.
  bool submit(std::function<void()> task) {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    return true;
  }
  // Not from the executor's own thread.
  void stop() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    std::call_once(joined_, [this] { thread_.join(); });
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
        mu_.Await(Condition(&ready));
        if (queue_.empty()) return;  // stopping, and nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();  // tasks catch their own errors
    }
  }

  Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::once_flag joined_;
  std::thread thread_;  // last: starts once the members above exist
};

// A finished run's gradients, held until the driver commits the step (every worker succeeded) or abandons it: a
// failed step leaves no gradient anywhere.
struct HeldGradients {
  int64_t step = -1;
  bool to_grad = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;  // (parameter, gradient)
};

// What this worker holds of one pipeline.
struct PipeEntry {
  int driver = -1;  // the rank that created it: when it dies, the pipeline goes
  std::map<int, std::shared_ptr<Stage>> stages;
  std::shared_ptr<Executor> executor;
  std::optional<HeldGradients> held;
};

void sweep_loop();

struct Stages {
  Mutex mu;    // taken inside the mailbox's lock (was_released); the mailbox's is never taken under it
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
std::shared_ptr<Stage> find_stage(int64_t pipe, int stage) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  auto it = s.pipes.find(pipe);
  if (it == s.pipes.end()) return nullptr;
  auto st = it->second.stages.find(stage);
  return st == it->second.stages.end() ? nullptr : st->second;
}
std::shared_ptr<Executor> executor_of(int64_t pipe) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  auto it = s.pipes.find(pipe);
  return it == s.pipes.end() ? nullptr : it->second.executor;
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
  if (!e.executor) e.executor = std::make_shared<Executor>();
  if (!s.sweeper.joinable()) s.sweeper = std::thread(sweep_loop);
  return true;
}
void hold_gradients(int64_t pipe, HeldGradients held) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  auto it = s.pipes.find(pipe);
  if (it != s.pipes.end()) it->second.held = std::move(held);
}
// The gradients held for `step`, taken out (nullopt when none: abandoned, released, or another step's).
std::optional<HeldGradients> take_gradients(int64_t pipe, int64_t step) {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  auto it = s.pipes.find(pipe);
  if (it == s.pipes.end() || !it->second.held || it->second.held->step != step) return std::nullopt;
  std::optional<HeldGradients> held = std::move(it->second.held);
  it->second.held.reset();
  return held;
}
void release_pipes(const std::vector<int64_t>& pipes);

// Every `kDriverCheck`, asks each driver of a pipeline held here whether it is alive; the pipelines of a driver that
// is gone (UNAVAILABLE) are released. Ends at RPC stop.
void sweep_loop() {
  Stages& s = stages();
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
      if (ping.status().code() == absl::StatusCode::kUnavailable) release_pipes(pipes);
    }
  }
}

// A TorchScript module as a stage: its parameters and forward. Holds the module, which is not a torch::nn::Module.
struct ScriptStage : torch::nn::Module {
  explicit ScriptStage(torch::jit::Module m) : script(std::move(m)) {
    int i = 0;
    for (const auto& p : script.parameters()) register_parameter("p" + std::to_string(i++), p, p.requires_grad());
  }
  torch::jit::Module script;
};

std::shared_ptr<Stage> load_script_stage(const std::string& path) {
  auto module = std::make_shared<ScriptStage>(torch::jit::load(path));
  auto stage = std::make_shared<Stage>();
  stage->module = module;
  stage->forward = [module](const at::Tensor& x) { return module->script.forward({x}).toTensor(); };
  for (const auto& p : module->parameters()) {
    if (p.requires_grad()) stage->params.push_back(p);
  }
  for (const auto& b : module->script.buffers()) stage->buffers.push_back(b);
  stage->is_training = [module] { return module->script.is_training(); };
  stage->set_training = [module](bool on) { module->script.train(on); };
  return stage;
}

std::shared_ptr<Stage> build_stage(const std::string& factory, std::vector<c10::IValue> args, int64_t begin,
                                   int64_t end) {
  // One build at a time in a process: factories seed LibTorch's global generator (torch::manual_seed) to build the
  // same weights everywhere, and two stages of one worker built at once would draw from it interleaved.
  ABSL_CONST_INIT static Mutex build_mu(absl::kConstInit);  // guards no data: it orders the builds
  nn::detail::Instance instance;
  {
    MutexLock build_lock(&build_mu);
    instance = nn::detail::make_instance(factory, std::move(args));
  }
  auto stage = std::make_shared<Stage>();
  if (begin < 0) {
    stage->module = instance.module;
    auto forward = instance.forward;
    stage->forward = [forward](const at::Tensor& x) { return forward({c10::IValue(x)}).value().toTensor(); };
  } else {
    auto full = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(instance.module);
    if (!full) {
      throw_error(absl::InvalidArgumentError("factory '" + factory + "' does not return a torch::nn::Sequential"));
    }
    if (end <= begin || end > static_cast<int64_t>(full->size())) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("layers [", begin, ", ", end, ") are not within the ",
                                                          full->size(), " layers of factory '", factory, "'")));
    }
    torch::nn::Sequential part;
    for (int64_t i = begin; i < end; ++i) part->push_back(std::to_string(i), *(full->begin() + i));
    stage->module = part.ptr();
    stage->forward = [part](const at::Tensor& x) mutable { return part->forward(x); };
  }
  for (const auto& p : stage->module->parameters()) {
    if (p.requires_grad()) stage->params.push_back(p);
  }
  for (const auto& b : stage->module->buffers()) stage->buffers.push_back(b);
  torch::nn::Module* module = stage->module.get();  // the stage holds it
  stage->is_training = [module] { return module == nullptr || module->is_training(); };
  stage->set_training = [module](bool on) {
    if (module) module->train(on);
  };
  return stage;
}

// The CPU generator's state (what torch.get_rng_state() returns), and setting it back.
at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// ---- the mailbox: activations and gradients arriving for this worker's stages ----

using Key = std::tuple<int64_t, int64_t, int, int, bool>;  // pipeline, step, stage, micro-batch, is gradient

class Mailbox {
 public:
  static Mailbox& get() {
    static auto* m = new Mailbox;
    return *m;
  }
  void put(const Key& key, at::Tensor t) {
    MutexLock lock(&mu_);
    if (aborted_.count(step_of(key)) || was_released(std::get<0>(key))) return;
    box_[key] = std::move(t);
    cv_.SignalAll();
  }
  // The tensor for `key`, or an error: the step was abandoned (its reason), RPC stopped, or nothing came by
  // `deadline`.
  absl::StatusOr<at::Tensor> take(const Key& key, Clock::time_point deadline, const std::string& what) {
    MutexLock lock(&mu_);
    const int64_t epoch = epoch_;
    for (;;) {
      if (epoch_ != epoch) {
        return absl::Status(stopped_.code(),
                            absl::StrCat("abandoned while waiting for ", what, ": ", stopped_.message()));
      }
      if (auto a = aborted_.find(step_of(key)); a != aborted_.end()) {
        return absl::Status(a->second.code(),
                            absl::StrCat("abandoned while waiting for ", what, ": ", a->second.message()));
      }
      if (was_released(std::get<0>(key))) {
        return absl::AbortedError(absl::StrCat("abandoned while waiting for ", what, ": the pipeline was released"));
      }
      if (auto it = box_.find(key); it != box_.end()) {
        at::Tensor t = std::move(it->second);
        box_.erase(it);
        return t;
      }
      if (cv_.WaitWithTimeout(&mu_, absl::FromChrono(deadline - Clock::now())) && Clock::now() >= deadline) {
        return absl::DeadlineExceededError("nothing arrived in time: waited for " + what +
                                           " until the step's deadline");
      }
    }
  }
  void abort(int64_t pipe, int64_t step, absl::Status reason) {
    MutexLock lock(&mu_);
    aborted_.emplace(std::make_pair(pipe, step), std::move(reason));
    order_.push_back({pipe, step});
    if (order_.size() > 1000) aborted_.erase(order_.front()), order_.erase(order_.begin());
    for (auto it = box_.begin(); it != box_.end();) {
      it = step_of(it->first) == std::make_pair(pipe, step) ? box_.erase(it) : std::next(it);
    }
    cv_.SignalAll();
  }
  // Every wait in progress ends with `reason` (RPC is stopping); later steps are not affected.
  void abort_all(const absl::Status& reason) {
    MutexLock lock(&mu_);
    stopped_ = reason;
    ++epoch_;
    box_.clear();
    cv_.SignalAll();
  }
  // The pipeline is gone from this worker (was_released, which every wait and delivery here checks, says so already):
  // what waits for it ends, and what is here for it is dropped.
  void release(int64_t pipe) {
    MutexLock lock(&mu_);
    for (auto it = box_.begin(); it != box_.end();)
      it = std::get<0>(it->first) == pipe ? box_.erase(it) : std::next(it);
    cv_.SignalAll();
  }
  bool aborted(int64_t pipe, int64_t step) {
    MutexLock lock(&mu_);
    return aborted_.count({pipe, step}) > 0 || was_released(pipe);
  }

 private:
  static std::pair<int64_t, int64_t> step_of(const Key& k) { return {std::get<0>(k), std::get<1>(k)}; }
  Mutex mu_;
  CondVar cv_;  // signalled when a tensor arrives or waits must end
  std::map<Key, at::Tensor> box_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<int64_t, int64_t>, absl::Status> aborted_ ABSL_GUARDED_BY(mu_);
  // Abandoned steps, oldest first (a bounded memory of them).
  std::vector<std::pair<int64_t, int64_t>> order_ ABSL_GUARDED_BY(mu_);
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;     // abort_all() calls so far
  absl::Status stopped_ ABSL_GUARDED_BY(mu_);  // the last one's reason
};

// Releases pipelines on this worker: their stages, mailbox entries and held gradients go, and each one's executor
// stops once the task it runs has ended (its waits end at once). Not from a pipeline's own executor thread.
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
  for (int64_t pipe : pipes) Mailbox::get().release(pipe);
  for (auto& e : gone) {
    if (e.executor) e.executor->stop();
  }
}

// ---- a worker's run of its plan ----

struct Plan {
  int64_t pipe = 0, step = 0;
  std::vector<Action> actions;
  std::vector<int> stage_rank;
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> inputs, targets;  // stage 0's micro-batches / the last stage's targets (else empty)
  std::string loss;
  bool checkpoint = false, to_grad = false, record = false;
  std::chrono::milliseconds timeout{0};
  int64_t context = -1;
};

struct StageRun {
  std::shared_ptr<Stage> stage;
  struct Live {
    at::Tensor input, output;  // output: the stage's output (none with checkpointing), or its weighted loss
    at::Tensor rng_state;      // with checkpointing: the CPU generator's state when the forward began
  };
  std::map<int, Live> live;
  int64_t peak = 0, busy_us = 0;
  std::vector<at::Tensor> grads;
};

class Run {
 public:
  explicit Run(Plan plan)
      : p_(std::move(plan)), deadline_(Clock::now() + p_.timeout), self_(rpc::get_worker_info().id) {
    for (int r : p_.stage_rank) stage_names_.push_back(rpc::get_worker_info(r).name);
  }

  // Returns (loss, [stage, peak, busy_us]..., [stage, mb, backward, start_us, end_us]...).
  c10::IValue execute() {
    const int n = static_cast<int>(p_.stage_rank.size());
    const int64_t batch = std::accumulate(p_.sizes.begin(), p_.sizes.end(), int64_t{0});
    const LossFn loss = find_loss_if_last(n);
    for (const Action& a : p_.actions) {
      StageRun& run = stage_run(a.stage);
      compute_start_ = 0;
      try {
        a.backward ? backward(run, a, n) : forward(run, a, n, loss, batch);
      } catch (...) {
        const absl::Status thrown = status_from_current_exception();
        throw_error(thrown.code(), a, thrown.message());
      }
      // Busy time and the timeline count computing only, not the wait for the action's input.
      const int64_t end = now_us(), start = compute_start_;
      run.busy_us += end - start;
      if (p_.record) events_.insert(events_.end(), {a.stage, a.microbatch, a.backward, start, end});
    }
    for (auto& f : sends_) {
      if (!f.wait_for(remaining()))
        throw RpcError(absl::DeadlineExceededError("a message to the next stage did not complete"));
      throw_if_error(f.status());
    }
    std::vector<int64_t> stats;
    HeldGradients held{p_.step, p_.to_grad, {}};
    for (auto& [index, run] : runs_) {
      for (size_t j = 0; j < run.grads.size(); ++j) {
        if (run.grads[j].defined()) held.grads.emplace_back(run.stage->params[j], std::move(run.grads[j]));
      }
      stats.insert(stats.end(), {index, run.peak, run.busy_us});
    }
    // Delivered when the driver commits the step (every worker succeeded); dropped if it abandons it.
    if (!Mailbox::get().aborted(p_.pipe, p_.step)) hold_gradients(p_.pipe, std::move(held));
    return c10::ivalue::Tuple::create({c10::IValue(loss_), rpc::to_ivalue(stats), rpc::to_ivalue(events_)});
  }

 private:
  std::chrono::milliseconds remaining() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()));
  }

  LossFn find_loss_if_last(int n) {
    for (const Action& a : p_.actions) {
      if (a.stage == n - 1) return find_loss(p_.loss);
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
                                        ", ", a.backward ? "backward" : "forward", ": ", cause)));
  }

  at::Tensor receive(int stage, int mb, bool grad) {
    const int from = grad ? stage + 1 : stage - 1;
    auto got = Mailbox::get().take({p_.pipe, p_.step, stage, mb, grad}, deadline_,
                                   absl::StrCat(grad ? "the gradient" : "the activation", " from stage ", from,
                                                " (worker '", stage_names_[from], "')"));
    throw_if_error(got.status());
    return *std::move(got);
  }

  void send(int stage, int mb, bool grad, at::Tensor t) {
    const int to = p_.stage_rank[stage];
    if (to == self_) return Mailbox::get().put({p_.pipe, p_.step, stage, mb, grad}, std::move(t));
    rpc::Future f =
        rpc::rpc_async(to, kAct, p_.pipe, p_.step, int64_t{stage}, int64_t{mb}, grad, std::move(t), remaining());
    const int64_t pipe = p_.pipe, step = p_.step;
    f.add_callback([pipe, step, stage, mb, grad](const rpc::Future& done) {
      absl::Status s = done.status();
      if (s.ok()) return;
      // Wakes this worker's waits at once: the step cannot finish without that message.
      Mailbox::get().abort(
          pipe, step,
          absl::Status(s.code(), absl::StrCat("sending the ", grad ? "gradient" : "activation", " of micro-batch ", mb,
                                              " to stage ", stage, " failed: ", s.message())));
    });
    sends_.push_back(std::move(f));
  }

  void forward(StageRun& run, const Action& a, int n, const LossFn& loss, int64_t batch) {
    const bool last = a.stage == n - 1;
    at::Tensor x = a.stage == 0 ? p_.inputs.at(a.microbatch) : receive(a.stage, a.microbatch, false);
    compute_start_ = now_us();
    if (a.stage > 0 && x.is_floating_point()) x = x.detach().requires_grad_(true);
    at::Tensor out, rng_state;
    if (p_.checkpoint && !last) {
      rng_state = cpu_rng_state();  // the recompute in backward draws what this forward draws (dropout's mask)
      at::NoGradGuard no_grad;
      out = run.stage->forward(x);
    } else {
      out = run.stage->forward(x);
    }
    if (last) {
      const double share = static_cast<double>(p_.sizes[a.microbatch]) / static_cast<double>(batch);
      at::Tensor l = loss(out, p_.targets.at(a.microbatch)) * share;
      loss_ += l.item<double>();
      run.live[a.microbatch] = {x, l, at::Tensor()};
    } else {
      run.live[a.microbatch] = {x, p_.checkpoint ? at::Tensor() : out, rng_state};
      send(a.stage + 1, a.microbatch, false, out.detach());
    }
    run.peak = std::max(run.peak, static_cast<int64_t>(run.live.size()));
  }

  void backward(StageRun& run, const Action& a, int n) {
    auto it = run.live.find(a.microbatch);
    if (it == run.live.end()) tandem::throw_error(absl::InternalError("backward before forward"));
    StageRun::Live live = std::move(it->second);
    run.live.erase(it);  // the micro-batch's activations go when this backward is done
    at::Tensor root = live.output, grad_out;
    if (a.stage < n - 1) grad_out = receive(a.stage, a.microbatch, true);
    compute_start_ = now_us();
    std::vector<at::Tensor> kept;  // with checkpointing: the buffers as the first forward left them
    struct PutBack {
      Stage& stage;
      const std::vector<at::Tensor>& kept;
      ~PutBack() { put_back(stage, kept); }
    } put_back_after{*run.stage, kept};  // after the backward below (or its error): its graph may hold them
    if (a.stage < n - 1 && p_.checkpoint) root = recompute(*run.stage, live, &kept);
    std::vector<at::Tensor> wrt = run.stage->params;
    const bool input_grad = a.stage > 0 && live.input.requires_grad();
    if (input_grad) wrt.push_back(live.input);
    std::vector<at::Tensor> grads;
    if (!wrt.empty() && root.requires_grad()) {
      grads = torch::autograd::grad({root}, wrt,
                                    grad_out.defined() ? std::vector<at::Tensor>{grad_out} : std::vector<at::Tensor>{},
                                    /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      grads.resize(wrt.size());
    }
    for (size_t j = 0; j < run.grads.size(); ++j) {
      if (!grads[j].defined()) continue;
      if (run.grads[j].defined()) {
        run.grads[j].add_(grads[j]);
      } else if (grads[j].use_count() == 1 && grads[j].storage().use_count() == 1) {
        run.grads[j] = std::move(grads[j]);  // computed for this parameter alone: ours to accumulate into
      } else {
        run.grads[j] = grads[j].clone();  // the engine may hand one tensor to several inputs (x * (a + b))
      }
    }
    if (a.stage > 0) {
      at::Tensor dx = input_grad && grads.back().defined() ? grads.back() : at::zeros_like(live.input);
      send(a.stage - 1, a.microbatch, true, dx);
    }
  }

  // The forward again, as it ran the first time: from the CPU generator's state it began with (dropout draws the same
  // mask), as PyTorch's checkpoint and Megatron do; the generator then continues from where it was, so the step draws
  // the same numbers as without checkpointing. The buffers (BatchNorm's running statistics) are kept in `kept`: the
  // caller puts them back once the backward is done (before, the graph may hold them), so that they are updated once
  // per micro-batch, by the first forward.
  static at::Tensor recompute(Stage& stage, const StageRun::Live& live, std::vector<at::Tensor>* kept) {
    for (const auto& b : stage.buffers) kept->push_back(b.defined() ? b.clone() : at::Tensor());
    const at::Tensor now = cpu_rng_state();
    set_cpu_rng_state(live.rng_state);
    try {
      at::Tensor out = stage.forward(live.input);
      set_cpu_rng_state(now);
      return out;
    } catch (...) {
      set_cpu_rng_state(now);
      throw;
    }
  }
  static void put_back(Stage& stage, const std::vector<at::Tensor>& kept) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < kept.size(); ++i) {
      if (kept[i].defined() && !at::equal(stage.buffers[i], kept[i])) stage.buffers[i].copy_(kept[i]);
    }
  }

  Plan p_;
  const Clock::time_point deadline_;
  const int self_;
  std::vector<std::string> stage_names_;
  std::map<int, StageRun> runs_;
  std::vector<rpc::Future> sends_;
  std::vector<int64_t> events_;
  double loss_ = 0;
  int64_t compute_start_ = 0;  // when the current action had its input and began computing
};

rpc::Future on_run(int64_t pipe, int64_t step, std::vector<int64_t> actions, std::vector<int64_t> stage_rank,
                   std::vector<int64_t> sizes, std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets,
                   std::string loss, std::vector<int64_t> flags) {
  Plan plan;
  plan.pipe = pipe, plan.step = step;
  if (actions.size() % 3 != 0 || flags.size() != 4) throw_error(absl::InvalidArgumentError("malformed pipeline plan"));
  for (size_t i = 0; i < actions.size(); i += 3) {
    plan.actions.push_back(Action{static_cast<int>(actions[i]), static_cast<int>(actions[i + 1]), actions[i + 2] != 0});
  }
  for (int64_t r : stage_rank) plan.stage_rank.push_back(static_cast<int>(r));
  for (const Action& a : plan.actions) {
    if (a.stage < 0 || a.stage >= static_cast<int>(stage_rank.size()) || a.microbatch < 0 ||
        a.microbatch >= static_cast<int>(sizes.size())) {
      throw_error(absl::InvalidArgumentError("malformed pipeline plan: an action outside the stages or micro-batches"));
    }
  }
  plan.sizes = std::move(sizes);
  plan.inputs = std::move(inputs);
  plan.targets = std::move(targets);
  plan.loss = std::move(loss);
  plan.checkpoint = flags[0] != 0, plan.to_grad = flags[1] != 0, plan.record = flags[2] != 0;
  plan.timeout = std::chrono::milliseconds(std::max<int64_t>(1, flags[3]));
  plan.context = dist_autograd::current_context();
  if (!plan.to_grad && plan.context < 0) {
    throw_error(absl::FailedPreconditionError("the plan came without a distributed autograd context"));
  }
  auto executor = executor_of(pipe);
  if (!executor) {
    throw_error(absl::NotFoundError(
        absl::StrCat("pipeline ", pipe, " has no stage on worker '", self_name(), "' (released?)")));
  }
  rpc::Future result(absl::Now() + absl::FromChrono(plan.timeout + kReplyMargin));
  // On the pipeline's executor: after the run of the previous step has ended here.
  const bool queued = executor->submit([plan = std::move(plan), result]() mutable {
    const int64_t pipe = plan.pipe, step = plan.step;
    try {
      Run run(std::move(plan));
      result.set_value(run.execute());
    } catch (...) {
      result.set_error(status_from_current_exception());
    }
    if (!result.completed()) result.set_error(absl::InternalError("pipeline run ended without a result"));
    // Whatever else of this step is still on its way here is of no use now.
    if (!result.status().ok()) Mailbox::get().abort(pipe, step, result.status());
  });
  if (!queued) throw_error(absl::AbortedError(absl::StrCat("pipeline ", pipe, " was released on this worker")));
  return result;
}

// The driver's commit of a step every worker finished: this worker's gradients of that step go to the parameters'
// .grad or to the distributed autograd context of this call (which the driver made in the step's context).
void on_commit(int64_t pipe, int64_t step) {
  std::optional<HeldGradients> held = take_gradients(pipe, step);
  if (!held) {
    throw_error(absl::FailedPreconditionError(absl::StrCat("no gradients of step ", step, " of pipeline ", pipe,
                                                           " are held on worker '", self_name(),
                                                           "' (abandoned, or the pipeline was released)")));
  }
  if (held->to_grad) {
    at::NoGradGuard no_grad;
    for (auto& [param, g] : held->grads) {
      if (param.grad().defined()) {
        param.mutable_grad().add_(g);
      } else {
        param.mutable_grad() = std::move(g);  // the run's own tensor: nobody else holds it
      }
    }
    return;
  }
  const int64_t context = dist_autograd::current_context();
  if (context < 0) throw_error(absl::FailedPreconditionError("the commit came without a distributed autograd context"));
  for (const auto& [param, g] : held->grads) dist_autograd::add_gradient(context, param, g);
}

// Inference, one micro-batch on one stage (on the pipeline's executor, in eval mode, without gradients), then the
// next stage's, asynchronously: no thread waits for the rest.
rpc::Future on_forward(int64_t pipe, int64_t index, std::vector<int64_t> ranks, at::Tensor x, int64_t timeout_ms) {
  auto executor = executor_of(pipe);
  if (!executor) {
    throw_error(absl::NotFoundError(
        absl::StrCat("pipeline ", pipe, " has no stage ", index, " on worker '", self_name(), "' (released?)")));
  }
  const auto timeout = std::chrono::milliseconds(timeout_ms);
  rpc::Future result(absl::Now() + absl::FromChrono(timeout));
  const bool queued = executor->submit([=]() mutable {
    try {
      auto stage = find_stage(pipe, static_cast<int>(index));
      if (!stage) {
        throw_error(absl::NotFoundError(
            absl::StrCat("pipeline ", pipe, " has no stage ", index, " on worker '", self_name(), "' (released?)")));
      }
      at::Tensor y;
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
        result.set_value(c10::IValue(y));
        return;
      }
      rpc::Future next =
          rpc::rpc_async(static_cast<int>(ranks[index + 1]), kForward, pipe, index + 1, ranks, y, timeout_ms, timeout);
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

bool install() {
  throw_if_error(rpc::register_handler(kCreate, [](std::vector<c10::IValue>&& a) -> rpc::Future {
    if (a.size() != 7 || !a[0].isInt() || !a[1].isInt() || !a[2].isString() || !a[3].isList() || !a[4].isInt() ||
        !a[5].isInt() || !a[6].isString()) {
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
    auto stage = a[6].toStringRef().empty()
                     ? build_stage(a[2].toStringRef(), std::move(args), a[4].toInt(), a[5].toInt())
                     : load_script_stage(a[6].toStringRef());
    std::vector<at::Tensor> params = stage->params;
    // A release that overtook this build (the driver gave up waiting, or its pipeline object went) drops it here.
    if (!add_stage(pipe, index, driver, std::move(stage))) throw_error(released());
    std::vector<c10::IValue> refs;
    for (const auto& p : params) refs.push_back(rref::make_local(c10::IValue(p)).to_ivalue());
    return rpc::Future::ready(c10::ivalue::Tuple::create(std::move(refs)));
  }));
  rpc::register_function(kRun, on_run);
  rpc::register_function(kCommit, on_commit);
  rpc::register_function(kForward, on_forward);
  rpc::register_function(kPing, [] {});
  rpc::register_function(kAct, [](int64_t pipe, int64_t step, int64_t stage, int64_t mb, bool grad, at::Tensor t) {
    Mailbox::get().put({pipe, step, static_cast<int>(stage), static_cast<int>(mb), grad}, std::move(t));
  });
  rpc::register_function(kAbort, [](int64_t pipe, int64_t step, std::string reason) {
    Mailbox::get().abort(pipe, step, absl::AbortedError(reason));
    (void)take_gradients(pipe, step);  // a run that finished before the abort came: its gradients go
  });
  rpc::register_function(kRelease, [](int64_t pipe) { release_pipes({pipe}); });
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
    release_pipes(all);  // joins every executor
    MutexLock lock(&s.mu);
    s.stopping = false;  // RPC may start again in this process
  });
  return true;
}

const bool g_installed = install();

}  // namespace

// ---- public functions ----

void register_loss(const std::string& name, std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss) {
  Losses& l = losses();
  MutexLock lock(&l.mu);
  if (!l.by_name.emplace(name, std::move(loss)).second) {
    throw RpcError(absl::AlreadyExistsError("a pipeline loss named '" + name + "' is already registered"));
  }
}

std::shared_ptr<torch::nn::Module> local_stage(int64_t pipeline_id, int stage) {
  auto s = find_stage(pipeline_id, stage);
  return s ? s->module : nullptr;
}

int64_t local_stage_count() {
  Stages& s = stages();
  MutexLock lock(&s.mu);
  int64_t n = 0;
  for (const auto& [pipe, e] : s.pipes) n += static_cast<int64_t>(e.stages.size());
  return n;
}

std::vector<std::pair<int64_t, int64_t>> balanced_cut(const std::vector<double>& weights, int n_stages) {
  const int L = static_cast<int>(weights.size());
  if (n_stages < 1 || L < n_stages) {
    throw_error(
        absl::InvalidArgumentError(absl::StrCat("cannot cut ", L, " layers into ", n_stages, " non-empty stages")));
  }
  std::vector<double> prefix(L + 1, 0);
  for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + weights[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest largest part cutting layers [0, i) into k parts; from[k][i]: where the last part begins.
  std::vector<std::vector<double>> best(n_stages + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> from(n_stages + 1, std::vector<int>(L + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= n_stages; ++k) {
    for (int i = k; i <= L; ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) best[k][i] = v, from[k][i] = j;
      }
    }
  }
  std::vector<std::pair<int64_t, int64_t>> cut(n_stages);
  for (int k = n_stages, i = L; k > 0; --k) {
    cut[k - 1] = {from[k][i], i};
    i = from[k][i];
  }
  return cut;
}

struct Pipeline::State {
  explicit State(PipelineOptions o) : options(std::move(o)) {}

  // Set by create() before the state is shared; read-only afterwards.
  int64_t id = 0;
  std::vector<StageSpec> specs;
  std::vector<int> stage_rank;    // per stage
  std::vector<int> workers;       // distinct ranks, in order of first stage
  std::vector<int> stage_worker;  // per stage: index into workers
  std::vector<rref::RRef> params;

  Mutex step_mu;                                                                   // one step at a time
  std::map<int, std::vector<std::vector<Action>>> plans ABSL_GUARDED_BY(step_mu);  // by number of micro-batches
  int64_t next_step ABSL_GUARDED_BY(step_mu) = 0;

  // What other threads read or change while a step runs (options(), last_stats(), set_record_timeline()): held only
  // briefly, so they need not wait for the step. Taken after step_mu when both are held.
  mutable Mutex mu;
  PipelineOptions options ABSL_GUARDED_BY(mu);  // record_timeline changes; the rest is fixed
  StepStats stats ABSL_GUARDED_BY(mu);
  std::vector<TimelineEvent> timeline ABSL_GUARDED_BY(mu);

  PipelineOptions current_options() const {
    MutexLock lock(&mu);
    return options;
  }

  ~State() {
    if (!rpc::is_initialized()) return;
    for (int w : workers) (void)rpc::rpc_async(w, kRelease, id);  // best effort, not waited for
  }

  std::string describe_worker(int rank) const {
    std::vector<int> hosted;
    for (size_t s = 0; s < stage_rank.size(); ++s) {
      if (stage_rank[s] == rank) hosted.push_back(static_cast<int>(s));
    }
    return absl::StrCat("worker '", rpc::get_worker_info(rank).name, "' (stage", hosted.size() > 1 ? "s " : " ",
                        absl::StrJoin(hosted, ", "), ")");
  }

  static void validate(const PipelineOptions& opts, const at::Tensor& input, const at::Tensor& target) {
    const int m = opts.n_microbatches;
    if (m < 1) fail(absl::StatusCode::kInvalidArgument, absl::StrCat("n_microbatches must be at least 1 (is ", m, ")"));
    check_not_empty(input);
    if (!target.defined() || target.dim() == 0 || target.size(0) != input.size(0)) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("the target's batch size (", target.defined() && target.dim() > 0 ? target.size(0) : 0,
                        ") differs from the input's (", input.size(0), ")"));
    }
    if (input.size(0) < m) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("a batch of ", input.size(0), " rows cannot be split into ", m,
                        " non-empty micro-batches: use a larger batch or fewer micro-batches"));
    }
    if (opts.gradients == GradientsTo::kContext && dist_autograd::current_context() < 0) {
      fail(absl::StatusCode::kFailedPrecondition,
           "step() leaves gradients in the current distributed autograd context, and there is none: run it inside a "
           "dist_autograd::ContextGuard (or set gradients = GradientsTo::kDotGrad)");
    }
  }

  double step(const at::Tensor& input, const at::Tensor& target) {
    MutexLock step_lock(&step_mu);
    const PipelineOptions opts = current_options();  // this step's: set_record_timeline() applies to the next
    validate(opts, input, target);
    const int m = opts.n_microbatches, n = static_cast<int>(stage_rank.size());
    const std::vector<at::Tensor> xs = at::tensor_split(input, m), ys = at::tensor_split(target, m);
    std::vector<int64_t> sizes;
    for (const auto& x : xs) sizes.push_back(x.size(0));
    auto& plan = plans[m];
    if (plan.empty()) plan = make_plans(opts.schedule, stage_worker, static_cast<int>(workers.size()), m);
    const int64_t step_id = next_step++;
    std::vector<int64_t> ranks(stage_rank.begin(), stage_rank.end());
    const std::vector<int64_t> flags{opts.checkpoint, opts.gradients == GradientsTo::kDotGrad, opts.record_timeline,
                                     opts.timeout.count()};
    const auto t0 = Clock::now();
    std::vector<rpc::Future> replies;
    for (size_t w = 0; w < workers.size(); ++w) {
      std::vector<int64_t> actions;
      for (const Action& a : plan[w]) actions.insert(actions.end(), {a.stage, a.microbatch, a.backward});
      const bool first = stage_worker.front() == static_cast<int>(w), last = stage_worker.back() == static_cast<int>(w);
      replies.push_back(rpc::rpc_async(workers[w], kRun, id, step_id, actions, ranks, sizes,
                                       first ? xs : std::vector<at::Tensor>{}, last ? ys : std::vector<at::Tensor>{},
                                       opts.loss, flags, opts.timeout + kReplyMargin));
    }
    wait_all(opts, replies, step_id);
    commit(opts, step_id);
    StepStats step_stats;
    step_stats.step_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    step_stats.busy_ms.assign(n, 0);
    step_stats.peak_activations.assign(n, 0);
    step_stats.microbatch_sizes = sizes;
    std::vector<TimelineEvent> events;
    for (size_t w = 0; w < workers.size(); ++w) {
      auto reply = replies[w].value().toTuple();
      step_stats.loss += reply->elements()[0].toDouble();
      auto st = rpc::from_ivalue<std::vector<int64_t>>(reply->elements()[1]);
      for (size_t i = 0; i + 2 < st.size(); i += 3) {
        step_stats.peak_activations.at(st[i]) = st[i + 1];
        step_stats.busy_ms.at(st[i]) = static_cast<double>(st[i + 2]) / 1000.0;
      }
      auto ev = rpc::from_ivalue<std::vector<int64_t>>(reply->elements()[2]);
      for (size_t i = 0; i + 4 < ev.size(); i += 5) {
        events.push_back(TimelineEvent{static_cast<int>(ev[i]), workers[w], static_cast<int>(ev[i + 1]), ev[i + 2] != 0,
                                       ev[i + 3], ev[i + 4]});
      }
    }
    std::sort(events.begin(), events.end(), [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    const double loss = step_stats.loss;
    MutexLock lock(&mu);
    stats = std::move(step_stats);
    timeline = std::move(events);
    return loss;
  }

  // Every worker finished the step: each now delivers the gradients it holds (to this call's distributed autograd
  // context, the caller's, or to .grad). Until here nothing of the step reached a gradient anywhere.
  void commit(const PipelineOptions& opts, int64_t step_id) {
    std::vector<rpc::Future> done;
    for (int w : workers) done.push_back(rpc::rpc_async(w, kCommit, id, step_id, opts.timeout));
    std::vector<std::string> errors;
    absl::StatusCode code = absl::StatusCode::kOk;
    for (size_t w = 0; w < done.size(); ++w) {
      absl::Status s = done[w].status();
      if (s.ok()) continue;
      if (code == absl::StatusCode::kOk) code = s.code();
      errors.push_back(describe_worker(workers[w]) + ": " + std::string(s.message()));
    }
    if (!errors.empty()) {
      fail(code, absl::StrCat("step ", step_id, " of pipeline ", id,
                              ": delivering the gradients failed (other workers may have delivered theirs): ",
                              absl::StrJoin(errors, "; ")));
    }
  }

  // Waits for every worker's reply. On the first error, tells every worker to abandon the step, gathers the others'
  // errors for a moment, and throws one RpcError naming them (the first failure's code).
  void wait_all(const PipelineOptions& opts, const std::vector<rpc::Future>& replies, int64_t step_id) {
    struct Waiter {
      explicit Waiter(size_t n) : expected(n) {}
      bool all_done() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == expected; }
      bool settled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return failed || done == expected; }
      const size_t expected;
      Mutex mu;
      size_t done ABSL_GUARDED_BY(mu) = 0;
      bool failed ABSL_GUARDED_BY(mu) = false;
    };
    auto waiter = std::make_shared<Waiter>(replies.size());
    for (const auto& f : replies) {
      f.add_callback([waiter](const rpc::Future& done) {
        MutexLock lock(&waiter->mu);
        ++waiter->done;
        waiter->failed |= !done.status().ok();
      });
    }
    {
      MutexLock lock(&waiter->mu);
      waiter->mu.AwaitWithTimeout(Condition(waiter.get(), &Waiter::settled),
                                  absl::FromChrono(opts.timeout + kReplyMargin));
      if (!waiter->failed && waiter->all_done()) return;
    }
    for (int w : workers) {
      (void)rpc::rpc_async(w, kAbort, id, step_id, std::string("another stage failed"), kErrorGrace);
    }
    {
      MutexLock lock(&waiter->mu);
      waiter->mu.AwaitWithTimeout(Condition(waiter.get(), &Waiter::all_done), absl::FromChrono(kErrorGrace));
    }
    // The causes first; then the workers that abandoned the step on our request, which say what they were waiting
    // for (the micro-batch a dead or failed stage held up).
    std::vector<std::string> errors, abandoned;
    absl::StatusCode code = absl::StatusCode::kDeadlineExceeded;
    bool coded = false;
    for (size_t w = 0; w < replies.size(); ++w) {
      if (!replies[w].completed()) {
        errors.push_back(describe_worker(workers[w]) + ": no reply within the step's timeout");
        continue;
      }
      absl::Status s = replies[w].status();
      if (s.ok()) continue;
      const std::string line = describe_worker(workers[w]) + ": " + std::string(s.message());
      if (s.code() == absl::StatusCode::kAborted) {
        abandoned.push_back(line);
        continue;
      }
      if (!coded) code = s.code(), coded = true;
      errors.push_back(line);
    }
    if (errors.empty()) errors.push_back("a worker failed and no other error was reported");
    errors.insert(errors.end(), abandoned.begin(), abandoned.end());
    fail(code, absl::StrCat("step ", step_id, " of pipeline ", id, " failed (", opts.timeout.count(),
                            " ms timeout): ", absl::StrJoin(errors, "; ")));
  }
};

Pipeline Pipeline::create(std::vector<StageSpec> stages, PipelineOptions options) {
  (void)g_installed;
  if (stages.empty()) fail(absl::StatusCode::kInvalidArgument, "a pipeline needs at least one stage");
  if (options.timeout.count() <= 0) options.timeout = rpc::default_timeout();
  auto st = std::make_shared<State>(options);
  st->id = rpc::detail::next_global_id(rpc::get_worker_info().id);
  std::vector<rpc::Future> built;
  for (size_t s = 0; s < stages.size(); ++s) {
    const StageSpec& spec = stages[s];
    const std::optional<rpc::WorkerInfo> found = rpc::find_worker_info(spec.worker);
    if (!found) {
      std::vector<std::string> names;
      for (const auto& w : rpc::get_all_worker_infos()) names.push_back(w.name);
      fail(absl::StatusCode::kNotFound,
           absl::StrCat("stage ", s, " is placed on worker '",
                        spec.worker.name().empty() ? std::to_string(spec.worker.rank()) : spec.worker.name(),
                        "', which is not in this job (workers: ", absl::StrJoin(names, ", "), ")"));
    }
    const rpc::WorkerInfo& info = *found;
    st->stage_rank.push_back(info.id);
    auto it = std::find(st->workers.begin(), st->workers.end(), info.id);
    st->stage_worker.push_back(static_cast<int>(it - st->workers.begin()));
    if (it == st->workers.end()) st->workers.push_back(info.id);
    c10::impl::GenericList args(c10::AnyType::get());
    for (const auto& a : spec.args) args.push_back(a);
    built.push_back(rpc::call(
        info.id, kCreate,
        {c10::IValue(st->id), c10::IValue(static_cast<int64_t>(s)), c10::IValue(spec.factory), c10::IValue(args),
         c10::IValue(spec.layer_begin), c10::IValue(spec.layer_end), c10::IValue(spec.torchscript)},
        options.timeout));
  }
  st->specs = std::move(stages);
  // Every build ends (or times out) before a failure is reported. When one failed, `st` goes with the exception and
  // releases the pipeline on every worker; a build still running there when the release arrives is dropped.
  std::vector<absl::Status> statuses;
  for (auto& b : built) statuses.push_back(b.status());
  for (size_t s = 0; s < built.size(); ++s) {
    if (!statuses[s].ok()) {
      fail(statuses[s].code(),
           absl::StrCat("building stage ", s, " on worker '", rpc::get_worker_info(st->stage_rank[s]).name,
                        "' failed: ", statuses[s].message()));
    }
  }
  for (auto& b : built) {
    for (const auto& r : b.value().toTupleRef().elements()) st->params.push_back(rref::RRef::from_ivalue(r));
  }
  return Pipeline(std::move(st));
}

Pipeline Pipeline::from_sequential(const std::string& factory, std::vector<c10::IValue> args,
                                   const std::vector<rpc::To>& workers, PartitionOptions partition,
                                   PipelineOptions options) {
  if (workers.empty()) fail(absl::StatusCode::kInvalidArgument, "from_sequential needs at least one worker");
  nn::detail::Instance model = nn::detail::make_instance(factory, std::vector<c10::IValue>(args));
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model.module);
  if (!seq)
    fail(absl::StatusCode::kInvalidArgument, "factory '" + factory + "' does not return a torch::nn::Sequential");
  std::vector<double> weights;
  if (partition.by == Partition::kParameters) {
    for (const auto& layer : seq->children()) {
      double n = 1;  // a layer without parameters still counts a little, so every stage gets a layer
      for (const auto& p : layer->parameters()) n += static_cast<double>(p.numel());
      weights.push_back(n);
    }
  } else {
    if (!partition.sample.defined()) fail(absl::StatusCode::kInvalidArgument, "Partition::kTime needs a sample batch");
    weights.assign(seq->size(), std::numeric_limits<double>::infinity());
    for (int rep = 0; rep < 3; ++rep) {  // the fastest of three: the first pays for allocations
      at::Tensor x = partition.sample;
      for (size_t i = 0; i < seq->size(); ++i) {
        at::Tensor in = x.is_floating_point() ? x.detach().requires_grad_(true) : x;
        const auto t0 = Clock::now();
        at::Tensor y = (seq->begin() + i)->forward(in);
        if (y.requires_grad()) y.sum().backward();
        weights[i] = std::min(weights[i], std::chrono::duration<double>(Clock::now() - t0).count());
        x = y.detach();
      }
    }
  }
  const std::vector<std::pair<int64_t, int64_t>> cut = balanced_cut(weights, partition.n_stages);
  std::vector<StageSpec> stages;
  for (int k = 0; k < partition.n_stages; ++k) {
    stages.push_back(StageSpec{workers[k % workers.size()], factory, args, cut[k].first, cut[k].second});
  }
  return create(std::move(stages), options);
}

double Pipeline::step(const at::Tensor& input, const at::Tensor& target) { return state_->step(input, target); }

at::Tensor Pipeline::forward(const at::Tensor& input) {
  check_not_empty(input);
  auto& st = *state_;
  MutexLock step_lock(&st.step_mu);  // never beside a step of this pipeline: it waits for one running
  const PipelineOptions options = st.current_options();
  const int64_t m = std::min<int64_t>(std::max(1, options.n_microbatches), input.size(0));
  const std::vector<int64_t> ranks(st.stage_rank.begin(), st.stage_rank.end());
  std::vector<rpc::Future> outs;
  for (const at::Tensor& x : at::tensor_split(input, m)) {
    outs.push_back(rpc::rpc_async(st.stage_rank[0], kForward, st.id, int64_t{0}, ranks, x,
                                  static_cast<int64_t>(options.timeout.count()), options.timeout));
  }
  std::vector<at::Tensor> ys;
  for (const auto& f : outs) {
    absl::Status s = f.status();
    if (!s.ok()) fail(s.code(), absl::StrCat("forward of pipeline ", st.id, " failed: ", s.message()));
    ys.push_back(f.value().toTensor());
  }
  return at::cat(ys);
}

void Pipeline::set_record_timeline(bool on) {
  MutexLock lock(&state_->mu);
  state_->options.record_timeline = on;
}
int Pipeline::num_stages() const { return static_cast<int>(state_->stage_rank.size()); }
namespace {
void check_stage(int stage, int num_stages) {
  if (stage < 0 || stage >= num_stages) {
    fail(absl::StatusCode::kInvalidArgument, absl::StrCat("no stage ", stage, " (the pipeline has ", num_stages, ")"));
  }
}
}  // namespace
std::string Pipeline::stage_worker(int stage) const {
  check_stage(stage, num_stages());
  return rpc::get_worker_info(state_->stage_rank[stage]).name;
}
std::pair<int64_t, int64_t> Pipeline::stage_layers(int stage) const {
  check_stage(stage, num_stages());
  const StageSpec& s = state_->specs[stage];
  return {s.layer_begin, s.layer_end};
}
std::vector<rref::RRef> Pipeline::parameter_rrefs() const { return state_->params; }
int64_t Pipeline::id() const { return state_->id; }
PipelineOptions Pipeline::options() const { return state_->current_options(); }
StepStats Pipeline::last_stats() const {
  MutexLock lock(&state_->mu);
  return state_->stats;
}
std::vector<TimelineEvent> Pipeline::last_timeline() const {
  MutexLock lock(&state_->mu);
  return state_->timeline;
}

}  // namespace tandem::pipeline
