// Pipeline parallelism, the driver: creating a pipeline (its stages built on their workers), a training step (the
// plans sent, every worker's reply awaited, the step abandoned on a failure), inference, and what a step measured.
// The stage workers' side is detail/runtime.cc.
#include "tandem/pipeline/pipeline.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/log/log.h"
#include "tandem/nn/remote_module.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/pipeline/detail/microbatch.h"
#include "tandem/pipeline/detail/runtime.h"
#include "tandem/pipeline/detail/shm_p2p.h"
#include "tandem/pipeline/layers.h"
#include "tandem/rpc/detail/ids.h"
#include "tandem/rpc/detail/note_batcher.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::pipeline {

using detail::Clock;
using detail::fail;
using detail::kAbort;
using detail::kCreate;
using detail::kErrorGrace;
using detail::kForward;
using detail::kGroup;
using detail::kRelease;
using detail::kReplyMargin;
using detail::kRun;
using detail::kTie;
using detail::merge_batch;
using detail::sizes_of;
using detail::split_batch;

namespace {
// Tells worker `w` to abandon step `step_id` of pipeline `id`. Not waited for; a failure is logged naming the worker
// (its run then holds its executor until its own deadline, and its next step may start late).
void send_abort(int w, int64_t id, int64_t step_id, const std::string& why) {
  const auto info = rpc::find_worker_info(w);  // now (never throws): the callback may run once RPC stopped
  const std::string name = info ? info->name : absl::StrCat("rank ", w);
  auto log = [name, id, step_id](const absl::Status& s) {
    TANDEM_LOG(kWarn, "pipeline") << "pipeline " << id << ": the abort of step " << step_id << " did not reach worker '"
                                  << name << "': " << s.message();
  };
  try {
    rpc::rpc_async(w, kAbort, id, step_id, why, kErrorGrace).add_callback([log](const rpc::Future& f) {
      if (absl::Status s = f.status(); !s.ok()) log(s);
    });
  } catch (...) {  // on an error path: the cause being reported matters more
    log(status_from_current_exception());
  }
}
}  // namespace

struct Pipeline::State {
  explicit State(PipelineOptions o) : options(std::move(o)) {}

  // Set by create() before the state is shared; read-only afterwards.
  int64_t id = 0;
  std::vector<StageSpec> specs;
  std::vector<int> stage_rank;    // per stage
  std::vector<int> workers;       // distinct ranks, in order of first stage
  std::vector<int> stage_worker;  // per stage: index into workers
  std::vector<rref::RRef> params;
  bool replica = false;  // one of a ReplicatedPipeline's (R > 1): only it steps this

  Mutex step_mu;                                                                   // one step at a time
  std::map<int, std::vector<std::vector<Action>>> plans ABSL_GUARDED_BY(step_mu);  // by number of micro-batches
  // (worker index, number of micro-batches): the plans a worker has cached, from a step that succeeded; later steps
  // of that shape send it no plan.
  std::set<std::pair<size_t, int>> plan_held ABSL_GUARDED_BY(step_mu);
  int64_t next_step ABSL_GUARDED_BY(step_mu) = 0;
  // The workers on this host write their replies here (detail/runtime.h keeps it for the pipeline, made at the first
  // step); null when shared memory is off.
  std::shared_ptr<detail::Inbox> replies_inbox ABSL_GUARDED_BY(step_mu);
  // Same-host steps without a call (detail/runtime.h: go_key), per worker index: a worker whose replies came through
  // replies_inbox, and a pidfd of its process, which tells the wait at once when it exits (-1: none to be had).
  std::set<size_t> replies_by_ring ABSL_GUARDED_BY(step_mu);
  std::map<size_t, int> pidfds ABSL_GUARDED_BY(step_mu);
  bool first_went_direct ABSL_GUARDED_BY(step_mu) = false;  // the last step started on stage 0's worker without a call

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
    for (const auto& [w, fd] : pidfds) {
      if (fd >= 0) close(fd);
    }
    detail::drop_driver_inbox(id);
    detail::drop_outlets(id);
    if (!rpc::is_initialized()) return;
    for (int w : workers) rpc::detail::releases().add(w, kRelease, {id});  // not waited for; failures are logged
  }

  std::string describe_worker(int rank) const {
    std::vector<int> hosted;
    for (size_t s = 0; s < stage_rank.size(); ++s) {
      if (stage_rank[s] == rank) hosted.push_back(static_cast<int>(s));
    }
    return absl::StrCat("worker '", rpc::get_worker_info(rank).name, "' (stage", hosted.size() > 1 ? "s " : " ",
                        absl::StrJoin(hosted, ", "), ")");
  }

  // Each micro-batch's arguments, and their rows (the target's, split alike, in *ys). Throws INVALID_ARGUMENT (and
  // FAILED_PRECONDITION without a context) before any work starts.
  static std::vector<detail::Args> split_step(const PipelineOptions& opts, const std::vector<c10::IValue>& inputs,
                                              const std::vector<bool>& replicate, const at::Tensor& target,
                                              std::vector<at::Tensor>* ys) {
    const int m = opts.n_microbatches;
    if (m < 1) fail(absl::StatusCode::kInvalidArgument, absl::StrCat("n_microbatches must be at least 1 (is ", m, ")"));
    int64_t rows = 0;
    std::vector<detail::Args> xs = detail::split_inputs(inputs, replicate, m, &rows);
    if (!target.defined() || target.dim() == 0 || target.size(0) != rows) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("the target's batch size (", target.defined() && target.dim() > 0 ? target.size(0) : 0,
                        ") differs from the input's (", rows, ")"));
    }
    if (opts.gradients == GradientsTo::kContext && dist_autograd::current_context() < 0) {
      fail(absl::StatusCode::kFailedPrecondition,
           "step() leaves gradients in the current distributed autograd context, and there is none: run it inside a "
           "dist_autograd::ContextGuard (or set gradients = GradientsTo::kDotGrad)");
    }
    *ys = split_batch(target, m);
    return xs;
  }

  // The plans of a step of m micro-batches: the schedule's, or the user's once checked.
  std::vector<std::vector<Action>> plans_for(const PipelineOptions& opts, int m) const {
    if (opts.schedule != Schedule::kCustom) {
      return make_plans(opts.schedule, stage_worker, static_cast<int>(workers.size()), m);
    }
    const std::string what = absl::StrCat("the custom schedule's plans for ", m, " micro-batches: ");
    if (opts.plans.size() != workers.size()) {
      fail(absl::StatusCode::kInvalidArgument, absl::StrCat(what, opts.plans.size(), " plans for ", workers.size(),
                                                            " workers (one per worker, in stage order)"));
    }
    try {
      (void)simulate(opts.plans, stage_worker, m, 1, 2);
    } catch (const Error& e) {
      fail(e.code(), what + std::string(e.status().message()));
    }
    return opts.plans;
  }

  double step(const std::vector<c10::IValue>& inputs, const std::vector<bool>& replicate, const at::Tensor& target) {
    MutexLock step_lock(&step_mu);
    if (replica) {
      fail(absl::StatusCode::kFailedPrecondition,
           absl::StrCat("pipeline ", id,
                        " is a replica of a ReplicatedPipeline: step it through that (its stages sum "
                        "their gradients with the other replicas' every step)"));
    }
    Started started = begin_step(inputs, replicate, target, 0);
    return end_step(started);
  }

  // A step sent to every worker, not yet answered.
  struct Started {
    PipelineOptions opts;
    int m = 0;
    int64_t step_id = 0;
    std::vector<int64_t> sizes;
    Clock::time_point t0;
    std::vector<rpc::Future> replies;  // a direct worker's: never completed
    std::vector<bool> direct;          // per worker: started without a call (go_key)
  };

  // Splits the batch and sends every worker its part of the step. `total_rows` > 0: a replica's step, whose losses
  // are shares of a batch of that many rows. The step's id is this pipeline's next, or `step` when that is larger (a
  // ReplicatedPipeline gives its replicas' steps one id: their stage workers' sums across the replicas pair by it).
  // Ids only grow: a stage worker refuses the plan of a step that comes after a later one's (detail/runtime.cc).
  Started begin_step(const std::vector<c10::IValue>& inputs, const std::vector<bool>& replicate,
                     const at::Tensor& target, int64_t total_rows, int64_t step = -1)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    const PipelineOptions opts = current_options();  // this step's: set_record_timeline() applies to the next
    wake_first_stage(opts);
    std::vector<at::Tensor> ys;
    const std::vector<detail::Args> xs = split_step(opts, inputs, replicate, target, &ys);
    const int m = opts.n_microbatches;
    const std::vector<int64_t> sizes = sizes_of(ys);
    std::vector<c10::IValue> first_inputs;  // stage 0's micro-batches, each its arguments as a tuple
    for (const auto& x : xs) first_inputs.emplace_back(c10::ivalue::Tuple::create(x));
    const auto& plan = plan_of(opts);
    const int64_t step_id = std::max(step, next_step);
    next_step = step_id + 1;
    std::vector<int64_t> ranks(stage_rank.begin(), stage_rank.end());
    const auto t0 = Clock::now();
    replies_inbox = detail::driver_inbox(id, true);
    std::vector<rpc::Future> replies;
    std::vector<bool> direct_workers;
    // A worker that cannot be sent its part (a ring or a call that throws) leaves the ones started before it waiting:
    // they are told to abandon the step before the error goes up.
    size_t w = 0;
    try {
      for (; w < workers.size(); ++w) {
        detail::send_fault_for_tests(id, step_id, workers[w]);
        // The plan goes once per shape (the number of micro-batches); then the worker has it.
        const bool held = plan_held.count({w, m}) > 0;
        std::vector<int64_t> actions, plan_ranks;
        if (!held) {
          for (const Action& a : plan[w])
            actions.insert(actions.end(), {a.stage, a.microbatch, static_cast<int64_t>(a.kind)});
          plan_ranks = ranks;
        }
        const bool first = stage_worker.front() == static_cast<int>(w),
                   last = stage_worker.back() == static_cast<int>(w);
        std::vector<int64_t> ties;  // with the plan: (tie, copy, stage) and the name of every tied copy
        std::vector<std::string> tie_names;
        for (size_t t = 0; t < opts.tied.size() && !held; ++t) {
          for (size_t c = 0; c < opts.tied[t].copies.size(); ++c) {
            ties.insert(ties.end(), {static_cast<int64_t>(t), static_cast<int64_t>(c), opts.tied[t].copies[c].first});
            tie_names.push_back(opts.tied[t].copies[c].second);
          }
        }
        const bool by_ring = (first || last) && send_by_ring(w, opts, step_id, first, first_inputs, last, ys);
        const std::vector<int64_t> flags{opts.checkpoint,      opts.gradients == GradientsTo::kDotGrad,
                                         opts.record_timeline, opts.timeout.count(),
                                         total_rows,           by_ring};
        // A worker on this host that holds the plan, has its micro-batches or targets (if any) in its inbox and
        // replied through the driver's inbox before: the step starts there without a call. Not for a replica (its
        // ReplicatedPipeline watches every replica's calls to abandon them all at the first failure).
        const bool direct = !replica && held && (by_ring || !(first || last)) && replies_by_ring.count(w) > 0 &&
                            send_direct(w, opts, step_id, sizes, flags);
        direct_workers.push_back(direct);
        if (direct) {
          replies.emplace_back(absl::Now() + absl::FromChrono(opts.timeout + kReplyMargin));
          continue;
        }
        replies.push_back(rpc::rpc_async(workers[w], kRun, id, step_id, actions, plan_ranks, sizes,
                                         first && !by_ring ? first_inputs : std::vector<c10::IValue>{},
                                         last && !by_ring ? ys : std::vector<at::Tensor>{},
                                         held ? std::string() : opts.loss, flags, ties, tie_names,
                                         opts.timeout + kReplyMargin));
      }
    } catch (...) {
      // Worker w too: its ring may have its part.
      for (size_t v = 0; v <= w && v < workers.size(); ++v) {
        send_abort(workers[v], id, step_id, "the step could not be sent to every worker");
      }
      throw;
    }
    first_went_direct = direct_workers[static_cast<size_t>(stage_worker.front())];
    return Started{opts, m, step_id, sizes, t0, std::move(replies), std::move(direct_workers)};
  }

  // The plans of steps of opts.n_microbatches, made the first time (a schedule this pipeline cannot run throws).
  const std::vector<std::vector<Action>>& plan_of(const PipelineOptions& opts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    auto& plan = plans[opts.n_microbatches];
    if (plan.empty()) plan = plans_for(opts, opts.n_microbatches);
    return plan;
  }

  // When this step will likely start without a call on stage 0's worker (it did so or replied through shared
  // memory before): rings its bell now, so that its executor's wake-up overlaps the splitting and sending of the step
  // (runtime.cc: the executor then spins for the step instead of sleeping again).
  void wake_first_stage(const PipelineOptions& opts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    const size_t w = static_cast<size_t>(stage_worker.front());
    // Only when the last step went to it without a call (a call wakes it anyway: the inputs too large for the ring).
    if (replica || !replies_inbox || !first_went_direct || replies_by_ring.count(w) == 0 ||
        plan_held.count({w, opts.n_microbatches}) == 0) {
      return;
    }
    if (const std::shared_ptr<detail::Outlet> o = outlet_to(w, opts)) o->ring();
  }

  // Same-host deliveries (detail/shm_p2p.h): the outlet into worker w's inbox, null when it has none (another host,
  // the driver itself, switched off).
  std::shared_ptr<detail::Outlet> outlet_to(size_t w, const PipelineOptions& opts) const {
    if (workers[w] == rpc::get_worker_info().id) return nullptr;
    return detail::attach_outlet(workers[w], id, std::min(opts.timeout, std::chrono::milliseconds(5000)));
  }

  // Writes stage 0's micro-batches (`first`) and the last stage's targets (`last`) into worker w's inbox, keyed as
  // the runtime takes them (detail/runtime.h); false when they go with the plan instead (no outlet, too large for
  // the ring, or a value it does not carry: what was written then is dropped with the step there).
  bool send_by_ring(size_t w, const PipelineOptions& opts, int64_t step_id, bool first,
                    const std::vector<c10::IValue>& inputs, bool last, const std::vector<at::Tensor>& targets)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    const std::shared_ptr<detail::Outlet> o = outlet_to(w, opts);
    if (!o) return false;
    const c10::IValue all_inputs = first ? c10::IValue(c10::ivalue::Tuple::create(inputs)) : c10::IValue();
    const c10::IValue all_targets = last ? c10::IValue(targets) : c10::IValue();
    const size_t bytes =
        (first ? detail::encoded_size(all_inputs) : 0) + (last ? detail::encoded_size(all_targets) : 0);
    if (bytes == 0 || bytes > detail::Inbox::kRingBytes / 2) return false;
    const int n = static_cast<int>(stage_rank.size());
    // Without a ring of the bell: the run there starts after these (on the call, or the go, sent next) and looks
    // into the rings before it sleeps; a wake-up now would only take a core from the step's start.
    if (first && !o->send(detail::inputs_key(id, step_id), all_inputs, false)) return false;
    if (last && !o->send(detail::targets_key(id, step_id, n), all_targets, false)) return false;
    return true;
  }

  // Starts the step on worker w without a call: the driver's context is shared with it (its release reaches the
  // worker), then (sizes, flags, context, this rank) goes into its inbox under detail::go_key. False when it cannot
  // (no outlet or pidfd for it, the ring full): the call starts it instead.
  bool send_direct(size_t w, const PipelineOptions& opts, int64_t step_id, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& flags) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    const std::shared_ptr<detail::Outlet> o = replies_inbox ? outlet_to(w, opts) : nullptr;
    if (!o) return false;
    auto [fd, fresh] = pidfds.try_emplace(w, -1);
    if (fresh) fd->second = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(o->pid()), 0));
    if (fd->second < 0) return false;
    const int64_t context = dist_autograd::current_context();
    if (opts.gradients == GradientsTo::kContext) dist_autograd::share_context(context, workers[w]);
    return o->send(detail::go_key(id, step_id),
                   c10::ivalue::Tuple::create({c10::IValue(sizes), c10::IValue(flags), c10::IValue(context),
                                               c10::IValue(rpc::get_worker_info().id)}));
  }

  // Waits for the workers' replies; returns the step's loss. Throws as step() does.
  double end_step(Started& started) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    const PipelineOptions& opts = started.opts;
    const int m = started.m, n = static_cast<int>(stage_rank.size());
    const std::vector<int64_t>& sizes = started.sizes;
    const auto t0 = started.t0;
    const std::vector<c10::IValue> values = wait_all(opts, started);
    for (size_t w = 0; w < workers.size(); ++w) plan_held.insert({w, m});
    StepStats step_stats;
    step_stats.step_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    step_stats.busy_ms.assign(n, 0);
    step_stats.peak_activations.assign(n, 0);
    step_stats.peak_memory_kib.assign(n, -1);
    step_stats.microbatch_sizes = sizes;
    std::vector<TimelineEvent> events;
    for (size_t w = 0; w < workers.size(); ++w) {
      if (!values[w].isTuple() || values[w].toTupleRef().elements().size() != 4) {
        fail(absl::StatusCode::kInternal,
             absl::StrCat("malformed step reply from worker '", rpc::get_worker_info(workers[w]).name, "'"));
      }
      auto reply = values[w].toTuple();
      step_stats.loss += reply->elements()[0].toDouble();
      auto st = rpc::from_ivalue<std::vector<int64_t>>(reply->elements()[1]);
      const int64_t peak_memory = reply->elements()[3].toInt();  // the worker's: each of its stages shows it
      for (size_t i = 0; i + 2 < st.size(); i += 3) {
        step_stats.peak_activations.at(st[i]) = st[i + 1];
        step_stats.busy_ms.at(st[i]) = static_cast<double>(st[i + 2]) / 1000.0;
        step_stats.peak_memory_kib.at(st[i]) = peak_memory;
      }
      auto ev = rpc::from_ivalue<std::vector<int64_t>>(reply->elements()[2]);
      for (size_t i = 0; i + 4 < ev.size(); i += 5) {
        if (ev[i + 2] < 0 || ev[i + 2] > static_cast<int>(Kind::kReduce)) continue;  // not a kind this driver knows
        events.push_back(TimelineEvent{static_cast<int>(ev[i]), workers[w], static_cast<int>(ev[i + 1]),
                                       static_cast<Kind>(ev[i + 2]), ev[i + 3], ev[i + 4]});
      }
    }
    std::sort(events.begin(), events.end(), [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    const double loss = step_stats.loss;
    MutexLock lock(&mu);
    stats = std::move(step_stats);
    timeline = std::move(events);
    return loss;
  }

  // What the workers' replies came to so far, for wait_all: per worker its reply (None: not yet), or its error when
  // it was started without a call (an error in the driver's inbox, or its process gone).
  struct Replies {
    std::vector<c10::IValue> values;
    std::vector<absl::Status> direct_errors;
    std::string ring_error;  // the driver's inbox held something malformed, or a reply announced is not there
  };

  // Takes what the replies' inbox holds for this step, the calls' replies, and whether each direct worker's process
  // is still there.
  void collect(const Started& st, detail::Inbox* bell, Replies* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    std::vector<std::tuple<detail::MailKey, c10::IValue, int>> got;
    const absl::Status drained = bell->drain(&got);
    for (auto& [key, value, from] : got) {
      if (key.pipe != id || key.step != st.step_id) continue;  // an earlier step's, which failed
      auto it = std::find(workers.begin(), workers.end(), from);
      if (it == workers.end()) continue;
      const size_t w = static_cast<size_t>(it - workers.begin());
      if (value.isTuple() && value.toTupleRef().elements().size() == 3 && value.toTupleRef().elements()[0].isString() &&
          value.toTupleRef().elements()[0].toStringRef() == detail::kErrorTag) {
        const auto& e = value.toTupleRef().elements();
        const int64_t code = e[1].isInt() ? e[1].toInt() : 2;
        r->direct_errors[w] =
            absl::Status(code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                         e[2].isString() ? e[2].toStringRef() : "(no message)");
        continue;
      }
      r->values[w] = std::move(value);
      replies_by_ring.insert(w);
    }
    if (!drained.ok() && r->ring_error.empty())
      r->ring_error = absl::StrCat("a step reply in shared memory: ", drained.message());
    for (size_t w = 0; w < workers.size(); ++w) {
      if (!r->values[w].isNone()) continue;
      if (!st.direct[w]) {
        if (st.replies[w].completed() && st.replies[w].status().ok() && !st.replies[w].value().isNone()) {
          r->values[w] = st.replies[w].value();  // replied by RPC
        }
        continue;
      }
      if (!r->direct_errors[w].ok()) continue;
      pollfd p{pidfds.at(w), POLLIN, 0};
      if (poll(&p, 1, 0) > 0) {
        r->direct_errors[w] = absl::UnavailableError("its process exited during the step");
      }
    }
  }

  // Waits for every worker's reply and returns them: from the call, or from the replies' inbox when the call says
  // the reply is there (None) or the step went without a call. On the first error, tells every worker to abandon the
  // step, gathers the others' errors for a moment, and throws one RpcError naming them (the first failure's code).
  std::vector<c10::IValue> wait_all(const PipelineOptions& opts, const Started& st)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    const std::vector<rpc::Future>& replies = st.replies;
    const int64_t step_id = st.step_id;
    struct Waiter {
      explicit Waiter(size_t n) : expected(n) {}
      bool all_done() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == expected; }
      bool settled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return failed || done == expected; }
      const size_t expected;
      Mutex mu;
      size_t done ABSL_GUARDED_BY(mu) = 0;
      bool failed ABSL_GUARDED_BY(mu) = false;
    };
    const size_t calls = static_cast<size_t>(std::count(st.direct.begin(), st.direct.end(), false));
    auto waiter = std::make_shared<Waiter>(calls);
    std::shared_ptr<detail::Inbox> bell = replies_inbox;
    for (size_t w = 0; w < replies.size(); ++w) {
      if (st.direct[w]) continue;
      replies[w].add_callback([waiter, bell](const rpc::Future& done) {
        {
          MutexLock lock(&waiter->mu);
          ++waiter->done;
          waiter->failed |= !done.status().ok();
        }
        if (bell) bell->ring();
      });
    }
    Replies r;
    r.values.resize(replies.size());
    r.direct_errors.resize(replies.size());
    const auto deadline = Clock::now() + opts.timeout + kReplyMargin;
    // With workers started without a call the wait looks again every so often: their processes may exit unheard.
    const auto slice = std::chrono::milliseconds(10);
    auto failed = [&] {
      MutexLock lock(&waiter->mu);
      return waiter->failed || !r.ring_error.empty() ||
             std::any_of(r.direct_errors.begin(), r.direct_errors.end(), [](const absl::Status& e) { return !e.ok(); });
    };
    auto all_in = [&] {
      return std::all_of(r.values.begin(), r.values.end(), [](const c10::IValue& v) { return !v.isNone(); });
    };
    if (!bell) {
      MutexLock lock(&waiter->mu);
      waiter->mu.AwaitWithTimeout(Condition(waiter.get(), &Waiter::settled),
                                  absl::FromChrono(opts.timeout + kReplyMargin));
      if (!waiter->failed && waiter->all_done()) {
        for (size_t w = 0; w < replies.size(); ++w) r.values[w] = replies[w].value();
        return r.values;
      }
    } else {
      for (;;) {
        const uint32_t seen = bell->bell();
        collect(st, bell.get(), &r);
        if (failed()) break;
        if (all_in()) return r.values;
        if (Clock::now() >= deadline) {
          for (size_t w = 0; w < replies.size(); ++w) {
            if (!st.direct[w] && r.values[w].isNone() && replies[w].completed() && replies[w].status().ok()) {
              r.ring_error = describe_worker(workers[w]) + ": its reply is not in shared memory";
            }
          }
          break;
        }
        // The driver's core is the stages' meanwhile: no spin.
        bell->wait(seen, calls < replies.size() ? std::min(deadline, Clock::now() + slice) : deadline,
                   std::chrono::microseconds(0));
      }
    }
    for (int w : workers) {
      send_abort(w, id, step_id, "another stage failed");
    }
    // The others' errors, for a moment: the calls' and, from the workers started without one, the inbox's.
    const auto grace = Clock::now() + kErrorGrace;
    for (;;) {
      const uint32_t seen = bell ? bell->bell() : 0;
      if (bell) collect(st, bell.get(), &r);
      bool settled = true;
      for (size_t w = 0; w < replies.size(); ++w) {
        settled &= st.direct[w] ? !r.values[w].isNone() || !r.direct_errors[w].ok() : replies[w].completed();
      }
      if (settled || Clock::now() >= grace) break;
      if (bell) {
        bell->wait(seen, std::min(grace, Clock::now() + slice), std::chrono::microseconds(0));
      } else {
        MutexLock lock(&waiter->mu);
        waiter->mu.AwaitWithTimeout(Condition(waiter.get(), &Waiter::all_done), absl::FromChrono(grace - Clock::now()));
      }
    }
    // A worker started without a call that gave no reply (or only an error) gets the next step by a call, which
    // says what is wrong with it (a released pipeline, say) at once.
    for (size_t w = 0; w < replies.size(); ++w) {
      if (st.direct[w] && r.values[w].isNone()) replies_by_ring.erase(w);
    }
    // The causes first; then the workers that abandoned the step on our request, which say what they were waiting
    // for (the micro-batch a dead or failed stage held up).
    std::vector<std::string> errors, abandoned;
    absl::StatusCode code = absl::StatusCode::kDeadlineExceeded;
    bool coded = false;
    for (size_t w = 0; w < replies.size(); ++w) {
      absl::Status s;
      if (st.direct[w]) {
        s = r.direct_errors[w];
        if (s.ok() && r.values[w].isNone()) {
          errors.push_back(describe_worker(workers[w]) + ": no reply within the step's timeout");
          continue;
        }
      } else if (!replies[w].completed()) {
        errors.push_back(describe_worker(workers[w]) + ": no reply within the step's timeout");
        continue;
      } else {
        s = replies[w].status();
      }
      if (s.ok()) continue;
      const std::string line = describe_worker(workers[w]) + ": " + std::string(s.message());
      if (s.code() == absl::StatusCode::kAborted) {
        abandoned.push_back(line);
        continue;
      }
      if (!coded) code = s.code(), coded = true;
      errors.push_back(line);
    }
    if (!r.ring_error.empty()) {
      errors.insert(errors.begin(), r.ring_error);
      if (!coded) code = absl::StatusCode::kInternal;
    }
    if (errors.empty()) errors.push_back("a worker failed and no other error was reported");
    errors.insert(errors.end(), abandoned.begin(), abandoned.end());
    fail(code, absl::StrCat("step ", step_id, " of pipeline ", id, " failed (", opts.timeout.count(),
                            " ms timeout): ", absl::StrJoin(errors, "; ")));
  }
};

Pipeline Pipeline::create(std::vector<StageSpec> stages, PipelineOptions options) {
  detail::ensure_runtime();
  if (stages.empty()) fail(absl::StatusCode::kInvalidArgument, "a pipeline needs at least one stage");
  if (options.timeout.count() <= 0) options.timeout = rpc::default_timeout();
  if (options.timeout > detail::kMaxTimeout) {
    fail(absl::StatusCode::kInvalidArgument,
         absl::StrCat("a step timeout (PipelineOptions::timeout, else RpcOptions::rpc_timeout) of ",
                      options.timeout.count(), " ms: at most ", detail::kMaxTimeout.count(), " ms"));
  }
  for (size_t t = 0; t < options.tied.size(); ++t) {
    const auto& copies = options.tied[t].copies;
    if (copies.size() < 2) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("tied parameter ", t, " has ", copies.size(), " copies: a tie needs at least two"));
    }
    for (size_t c = 0; c < copies.size(); ++c) {
      if (copies[c].first < 0 || copies[c].first >= static_cast<int>(stages.size())) {
        fail(absl::StatusCode::kInvalidArgument, absl::StrCat("copy ", c, " of tied parameter ", t, " names stage ",
                                                              copies[c].first, " of ", stages.size()));
      }
      if (std::count(copies.begin(), copies.end(), copies[c]) > 1) {
        fail(absl::StatusCode::kInvalidArgument,
             absl::StrCat("tied parameter ", t, " names stage ", copies[c].first, "'s '", copies[c].second, "' twice"));
      }
    }
  }
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
    built.push_back(rpc::call(info.id, kCreate,
                              {c10::IValue(st->id), c10::IValue(static_cast<int64_t>(s)), c10::IValue(spec.factory),
                               c10::IValue(args), c10::IValue(spec.layer_begin), c10::IValue(spec.layer_end),
                               c10::IValue(spec.torchscript), c10::IValue(spec.layers)},
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
  // Tied copies start from the first copy's values (each copy's name and shape checked on its worker).
  for (const auto& tie : options.tied) {
    auto call = [&](const std::pair<int, std::string>& copy, c10::IValue value) {
      rpc::Future f = rpc::call(st->stage_rank[copy.first], kTie,
                                {c10::IValue(st->id), c10::IValue(static_cast<int64_t>(copy.first)),
                                 c10::IValue(copy.second), std::move(value)},
                                options.timeout);
      if (!f.status().ok()) {
        fail(f.status().code(),
             absl::StrCat("tying stage ", copy.first, "'s '", copy.second, "': ", f.status().message()));
      }
      return f.value();
    };
    const c10::IValue first = call(tie.copies[0], c10::IValue());
    for (size_t c = 1; c < tie.copies.size(); ++c) call(tie.copies[c], first);
  }
  return Pipeline(std::move(st));
}

namespace {
// The stages of a balanced cut of `weights` into n_stages, round-robin over `workers` (for ZBV in a V: stage k on
// worker k, then back from the last worker, 2P - 1 - k); `make` makes the spec of one.
std::vector<StageSpec> cut_into_stages(const std::vector<double>& weights, const std::vector<rpc::To>& workers,
                                       int n_stages, Schedule schedule,
                                       const std::function<StageSpec(rpc::To, int64_t, int64_t)>& make) {
  const int P = static_cast<int>(workers.size());
  if (schedule == Schedule::kZeroBubbleV && n_stages != 2 * P) {
    fail(absl::StatusCode::kInvalidArgument, absl::StrCat("zbv places two stages on each worker in a V: ", P,
                                                          " workers take ", 2 * P, " stages, not ", n_stages));
  }
  const std::vector<std::pair<int64_t, int64_t>> cut = balanced_cut(weights, n_stages);
  std::vector<StageSpec> stages;
  for (int k = 0; k < n_stages; ++k) {
    const int w = schedule == Schedule::kZeroBubbleV && k >= P ? 2 * P - 1 - k : k % P;
    stages.push_back(make(workers[w], cut[k].first, cut[k].second));
  }
  return stages;
}
}  // namespace

namespace {
// Builds factory(args...) here, which must return a torch::nn::Sequential, and weighs its layers for the cut.
std::vector<double> sequential_weights(const std::string& factory, const std::vector<c10::IValue>& args,
                                       const PartitionOptions& partition) {
  nn::detail::Instance model;
  {
    MutexLock build_lock(&detail::build_mutex());  // no stage of another pipeline is built here meanwhile
    model = nn::detail::make_instance(factory, std::vector<c10::IValue>(args));
  }
  if (!std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model.module))
    fail(absl::StatusCode::kInvalidArgument, "factory '" + factory + "' does not return a torch::nn::Sequential");
  return layer_weights(model.module, partition);
}
}  // namespace

Pipeline Pipeline::from_sequential(const std::string& factory, std::vector<c10::IValue> args,
                                   const std::vector<rpc::To>& workers, PartitionOptions partition,
                                   PipelineOptions options) {
  if (workers.empty()) fail(absl::StatusCode::kInvalidArgument, "from_sequential needs at least one worker");
  return create(
      cut_into_stages(sequential_weights(factory, args, partition), workers, partition.n_stages, options.schedule,
                      [&](rpc::To worker, int64_t begin, int64_t end) {
                        return StageSpec{worker, factory, args, begin, end};
                      }),
      options);
}

Pipeline Pipeline::from_layers(const std::string& layers, const std::vector<rpc::To>& workers,
                               PartitionOptions partition, PipelineOptions options) {
  if (workers.empty()) fail(absl::StatusCode::kInvalidArgument, "from_layers needs at least one worker");
  return create(cut_into_stages(layer_weights(layers, partition), workers, partition.n_stages, options.schedule,
                                [&](rpc::To worker, int64_t begin, int64_t end) {
                                  StageSpec spec{worker};
                                  spec.layers = layers;
                                  spec.layer_begin = begin;
                                  spec.layer_end = end;
                                  return spec;
                                }),
                options);
}

double Pipeline::step(const at::Tensor& input, const at::Tensor& target) {
  return state_->step({c10::IValue(input)}, {}, target);
}

double Pipeline::step(const std::vector<c10::IValue>& inputs, const at::Tensor& target,
                      const std::vector<bool>& replicate) {
  return state_->step(inputs, replicate, target);
}

at::Tensor Pipeline::forward(const at::Tensor& input) { return forward(std::vector<c10::IValue>{input}); }

at::Tensor Pipeline::forward(const std::vector<c10::IValue>& inputs, const std::vector<bool>& replicate) {
  auto& st = *state_;
  MutexLock step_lock(&st.step_mu);  // never beside a step of this pipeline: it waits for one running
  const PipelineOptions options = st.current_options();
  int64_t rows = 0;
  (void)detail::split_inputs(inputs, replicate, 1, &rows);  // checks the inputs, counts the rows
  const int64_t m = std::min<int64_t>(std::max(1, options.n_microbatches), rows);
  const std::vector<int64_t> ranks(st.stage_rank.begin(), st.stage_rank.end());
  std::vector<rpc::Future> outs;
  for (detail::Args& x : detail::split_inputs(inputs, replicate, m, &rows)) {
    outs.push_back(rpc::rpc_async(st.stage_rank[0], kForward, st.id, int64_t{0}, ranks, std::move(x),
                                  static_cast<int64_t>(options.timeout.count()), options.timeout));
  }
  std::vector<at::Tensor> ys;
  for (const auto& f : outs) {
    absl::Status s = f.status();
    if (!s.ok()) fail(s.code(), absl::StrCat("forward of pipeline ", st.id, " failed: ", s.message()));
    if (!f.value().isTensor()) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("forward of pipeline ", st.id, ": the last stage returned a ", f.value().tagKind(),
                        ", not one tensor"));
    }
    ys.push_back(f.value().toTensor());
  }
  return merge_batch(ys);
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

// ---- replicated pipelines

ReplicatedPipeline ReplicatedPipeline::create(std::vector<std::vector<StageSpec>> replicas, PipelineOptions options) {
  if (replicas.empty()) fail(absl::StatusCode::kInvalidArgument, "a replicated pipeline needs at least one replica");
  for (size_t r = 1; r < replicas.size(); ++r) {
    if (replicas[r].size() != replicas[0].size()) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("replica ", r, " has ", replicas[r].size(), " stages, replica 0 ", replicas[0].size()));
    }
  }
  if (options.timeout.count() <= 0) options.timeout = rpc::default_timeout();
  ReplicatedPipeline out;
  for (auto& stages : replicas) out.replicas_.push_back(Pipeline::create(std::move(stages), options));
  if (out.replicas_.size() == 1) return out;
  for (auto& p : out.replicas_) p.state_->replica = true;
  // One group per stage: its worker in every replica. Created by all of them at once (a collective), each member then
  // taking replica 0's parameters.
  std::vector<rpc::Future> made;
  std::vector<std::string> what;
  for (size_t s = 0; s < out.replicas_[0].state_->stage_rank.size(); ++s) {
    std::vector<int64_t> ranks;
    for (const auto& p : out.replicas_) {
      const int rank = p.state_->stage_rank[s];
      if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) {
        fail(absl::StatusCode::kInvalidArgument,
             absl::StrCat("stage ", s, " of two replicas is on one worker ('", rpc::get_worker_info(rank).name,
                          "'): each replica's stages need workers of their own"));
      }
      ranks.push_back(rank);
    }
    const std::string name = absl::StrCat("__tandem.pipeline.", out.replicas_[0].id(), ".stage", s);
    for (size_t r = 0; r < out.replicas_.size(); ++r) {
      made.push_back(
          rpc::call(static_cast<int>(ranks[r]), kGroup,
                    {c10::IValue(out.replicas_[r].id()), c10::IValue(static_cast<int64_t>(s)), c10::IValue(name),
                     c10::IValue(ranks), c10::IValue(static_cast<int64_t>(options.timeout.count()))},
                    options.timeout));
      what.push_back(absl::StrCat("stage ", s, " of replica ", r, " (worker '",
                                  rpc::get_worker_info(static_cast<int>(ranks[r])).name, "')"));
    }
  }
  for (size_t k = 0; k < made.size(); ++k) {
    if (!made[k].status().ok()) {
      fail(made[k].status().code(),
           absl::StrCat("joining the replicas of ", what[k], " failed: ", made[k].status().message()));
    }
  }
  return out;
}

ReplicatedPipeline ReplicatedPipeline::from_sequential(const std::string& factory, std::vector<c10::IValue> args,
                                                       const std::vector<std::vector<rpc::To>>& workers,
                                                       PartitionOptions partition, PipelineOptions options) {
  if (workers.empty() || workers[0].empty()) {
    fail(absl::StatusCode::kInvalidArgument, "from_sequential needs at least one replica with one worker");
  }
  const std::vector<double> weights = sequential_weights(factory, args, partition);
  std::vector<std::vector<StageSpec>> replicas;
  for (const auto& replica_workers : workers) {
    replicas.push_back(cut_into_stages(weights, replica_workers, partition.n_stages, options.schedule,
                                       [&](rpc::To worker, int64_t begin, int64_t end) {
                                         return StageSpec{worker, factory, args, begin, end};
                                       }));
  }
  return create(std::move(replicas), std::move(options));
}

double ReplicatedPipeline::step(const at::Tensor& input, const at::Tensor& target) {
  const int64_t R = static_cast<int64_t>(replicas_.size());
  const int64_t rows = input.dim() > 0 ? input.size(0) : 0;
  const int64_t m = replicas_[0].state_->current_options().n_microbatches;
  if (rows < R * m) {
    fail(absl::StatusCode::kInvalidArgument, absl::StrCat("a batch of ", rows, " rows cannot give ", R, " replicas ", m,
                                                          " micro-batches of at least one row each"));
  }
  if (target.dim() == 0 || target.size(0) != rows) {
    fail(absl::StatusCode::kInvalidArgument, "the target's rows differ from the input's");
  }
  const std::vector<at::Tensor> xs = at::tensor_split(input, R), ys = at::tensor_split(target, R);
  std::vector<std::unique_ptr<MutexLock>> locks;
  for (auto& p : replicas_) locks.push_back(std::make_unique<MutexLock>(&p.state_->step_mu));
  // Every replica's plans first (a schedule a replica's placement cannot run throws): nothing has started yet.
  for (int64_t r = 0; r < R; ++r) {
    try {
      (void)replicas_[r].state_->plan_of(replicas_[r].state_->current_options());
    } catch (const Error& e) {
      throw_error(absl::Status(e.code(), absl::StrCat("replica ", r, ": ", e.status().message())));
    }
  }
  // One id for every replica's step: each stage worker takes its turns in its stage's sums across the replicas in
  // step order, and the replicas' turns pair by that id (detail/runtime.cc, Run::take_turns).
  int64_t step_id = 0;
  for (auto& p : replicas_) step_id = std::max(step_id, p.state_->next_step);
  std::vector<Pipeline::State::Started> started;
  for (int64_t r = 0; r < R; ++r) {
    try {
      started.push_back(replicas_[r].state_->begin_step({c10::IValue(xs[r])}, {}, ys[r], rows, step_id));
    } catch (...) {
      // A later replica could not begin (a ring or a call that throws) while the earlier ones run: they are aborted
      // and ended before the error goes up, or their workers would wait until the deadline for a sum this replica
      // never joins. This replica's workers take their turns in this step's sums, with zeros, when the next step's
      // runs begin there, so the groups stay in step.
      const absl::Status cause = status_from_current_exception();
      for (int64_t q = 0; q < r; ++q) {
        for (int w : replicas_[q].state_->workers) {
          send_abort(w, replicas_[q].id(), started[q].step_id,
                     absl::StrCat("replica ", r, " could not start its step"));
        }
      }
      // Their abort's error (ABORTED) says nothing new; any other failure of theirs (a stage worker that died
      // meanwhile) goes along with the cause.
      std::string also;
      for (int64_t q = 0; q < r; ++q) {
        try {
          (void)replicas_[q].state_->end_step(started[q]);
        } catch (...) {
          const absl::Status s = status_from_current_exception();
          if (s.code() != absl::StatusCode::kAborted) absl::StrAppend(&also, "; replica ", q, ": ", s.message());
        }
      }
      throw_error(absl::Status(cause.code(), absl::StrCat("replica ", r, ": ", cause.message(),
                                                          " (the replicas started before it were aborted)", also)));
    }
  }
  // The first failure in any replica abandons every replica's step at once: a stage worker of another replica would
  // otherwise wait until the deadline for a sum its failed peer never joins. One replica: its own wait does that (and
  // only then may its workers have been started without a call: begin_step calls every worker of a replica).
  bool failed = false;
  if (R > 1) {
    struct Watch {
      Mutex mu;
      size_t left ABSL_GUARDED_BY(mu) = 0;
      bool failed ABSL_GUARDED_BY(mu) = false;
      bool settled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return failed || left == 0; }
    };
    auto watch = std::make_shared<Watch>();
    {
      MutexLock lock(&watch->mu);
      for (const auto& s : started) watch->left += s.replies.size();
    }
    for (const auto& s : started) {
      for (const rpc::Future& reply : s.replies) {
        reply.add_callback([watch](const rpc::Future& done) {
          MutexLock lock(&watch->mu);
          --watch->left;
          watch->failed |= !done.status().ok();
        });
      }
    }
    MutexLock lock(&watch->mu);
    watch->mu.AwaitWithTimeout(Condition(watch.get(), &Watch::settled),
                               absl::FromChrono(started[0].opts.timeout + kReplyMargin));
    failed = watch->failed;
  }
  if (failed) {
    for (int64_t r = 0; r < R; ++r) {
      for (int w : replicas_[r].state_->workers) {
        send_abort(w, replicas_[r].id(), started[r].step_id, "another stage or replica failed");
      }
    }
  }
  double loss = 0;
  std::vector<std::string> errors;
  absl::StatusCode code = absl::StatusCode::kOk;
  for (int64_t r = 0; r < R; ++r) {
    try {
      loss += replicas_[r].state_->end_step(started[r]);
    } catch (const Error& e) {
      if (code == absl::StatusCode::kOk) code = e.code();
      errors.push_back(absl::StrCat("replica ", r, ": ", e.status().message()));
    }
  }
  if (!errors.empty()) {
    fail(code, absl::StrCat("step of the replicated pipeline failed: ", absl::StrJoin(errors, " | ")));
  }
  return loss;
}

std::vector<rref::RRef> ReplicatedPipeline::parameter_rrefs() const {
  std::vector<rref::RRef> out;
  for (const auto& p : replicas_) {
    for (const auto& r : p.parameter_rrefs()) out.push_back(r);
  }
  return out;
}

}  // namespace tandem::pipeline
