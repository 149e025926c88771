#include "examples/parameter_server/server.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "examples/data/cnn.h"
#include "examples/data/fashion_mnist.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/cluster/cpus.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/log/log.h"
#include "tandem/metrics/metrics.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rpc.h"
#include "tandem/sync/sync.h"

namespace tandem::examples {
namespace {

torch::nn::Sequential make_mlp() {
  namespace tn = torch::nn;
  return tn::Sequential(tn::Flatten(), tn::Linear(784, 512), tn::ReLU(), tn::Linear(512, 512), tn::ReLU(),
                        tn::Linear(512, 10));
}

struct Server {
  ServerOptions options;
  nn::RemoteModule model;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  Dataset test;
  rpc::Future ready;  // completed with the model's RRef once built
  // Completed once every trainer called done(); failed with the first trainer failure reported (ps.failed).
  rpc::Future finished;

  Mutex mu;
  std::vector<at::Tensor> sum ABSL_GUARDED_BY(mu);  // the gradients of this round's trainers so far
  struct InRound {
    int64_t context_id;
    rpc::Future done;  // the trainer's backward pass, waiting for the round
  };
  std::map<int, InRound> in_round ABSL_GUARDED_BY(mu);  // this round's trainers so far, by rank
  // When the round gives up (the earliest of its trainers' calls' deadlines, less a margin): watch_rounds().
  absl::Time round_deadline ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  absl::Time round_started ABSL_GUARDED_BY(mu);
  int64_t rounds ABSL_GUARDED_BY(mu) = 0;  // optimizer steps taken (async: the last checkpoint's step)
  // Sync mode: the time the rounds' steps took (the last trainer's sum, the average and the optimizer's step, which
  // every trainer waits for), as metrics gauges tandem_ps_step_seconds_total and tandem_ps_steps_total.
  double step_seconds ABSL_GUARDED_BY(mu) = 0;
  int64_t steps_timed ABSL_GUARDED_BY(mu) = 0;
  std::vector<rpc::Future> at_barrier ABSL_GUARDED_BY(mu);  // async checkpoints: trainers waiting for the others
  std::unique_ptr<checkpoint::Checkpointer> ckpt;           // with checkpoint_dir; saves under mu
  std::set<int> done_ranks ABSL_GUARDED_BY(mu);             // the trainers that called done()
  checkpoint::State state;                                  // the model, the optimizer, rounds
};

Server& server() {
  static auto* s = new Server;
  return *s;
}

// Saves the checkpoint of `step` if the server keeps them (under mu: the state must not change meanwhile). A save that
// fails is an error starting with "parameter server: " and `what`.
absl::Status save_checkpoint(Server& s, int64_t step, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  if (!s.ckpt) return absl::OkStatus();
  try {
    s.ckpt->save(step, s.state);
    return absl::OkStatus();
  } catch (...) {
    const absl::Status thrown = status_from_current_exception();
    return absl::Status(thrown.code(), absl::StrCat("parameter server: ", what, ": ", thrown.message()));
  }
}

// The options' errors, checked before any work (a checkpoint_every of 0 was a division by zero at the first round).
absl::Status validate(const ServerOptions& o) {
  if (o.trainers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter server: ServerOptions::trainers is ", o.trainers, ": it needs at least 1"));
  }
  if (o.checkpoint_every < 1) {
    return absl::InvalidArgumentError(absl::StrCat("parameter server: ServerOptions::checkpoint_every is ",
                                                   o.checkpoint_every,
                                                   ": the rounds between checkpoints are at least 1"));
  }
  return absl::OkStatus();
}

// "trainer2 (rank 2)"; the rank alone if it names no worker.
std::string trainer_name(int rank) {
  auto info = rpc::find_worker_info(rank);
  return info ? absl::StrCat(info->name, " (rank ", rank, ")") : absl::StrCat("rank ", rank);
}

// A round gives up this long before its first trainer's call would time out, so that the trainers learn why: a 20th
// of what is left, at least 100 ms (their calls' deadlines count from their sends, a transit before the server's),
// at most half of it (a short timeout still leaves the other trainers time to come).
absl::Time give_up_at(absl::Time call_deadline, absl::Time now) {
  if (call_deadline == absl::InfiniteFuture()) return call_deadline;
  const absl::Duration left = call_deadline - now;
  return call_deadline - std::min(std::max(absl::Milliseconds(100), left / 20), left / 2);
}

// Synchronous mode's backward-part hook: a trainer's gradients (context part.context_id) join the round; the last
// trainer's apply its average. The future completes with the round (its step taken), or fails when the round gives
// up (watch_rounds()).
rpc::Future on_backward_part(const dist_autograd::BackwardPart& part) {
  Server& s = server();
  const int64_t context_id = part.context_id;
  dist_autograd::Gradients grads = dist_autograd::get_gradients(context_id);
  rpc::Future done;
  std::vector<rpc::Future> release;
  absl::Status saved;
  {
    MutexLock lock(&s.mu);
    if (auto it = s.in_round.find(part.from); it != s.in_round.end()) {
      // A second part of one trainer's pass (its step sent two forwards to the server) would count it twice.
      if (it->second.context_id == context_id) {
        return rpc::Future::failed(absl::FailedPreconditionError(absl::StrCat(
            "parameter server: context ", context_id, " reached the server's backward twice in one round; the ",
            "synchronous round takes one forward per trainer step")));
      }
      // A trainer's next step while its last one still waits in the round (it went on after its backward failed,
      // say): the round would average two steps of one trainer and none of another.
      return rpc::Future::failed(absl::FailedPreconditionError(absl::StrCat(
          "parameter server: trainer ", trainer_name(part.from), " sent the gradients of another step (context ",
          context_id, ") into round ", s.rounds + 1, ", where its step of context ", it->second.context_id,
          " still waits for the other trainers; a trainer takes one step per round")));
    }
    const auto arrived = std::chrono::steady_clock::now();  // the last trainer's: its sum begins the round's step
    for (size_t i = 0; i < s.params.size(); ++i) {
      at::Tensor g = grads[s.params[i]];
      if (!g.defined()) continue;
      // The first trainer's gradient becomes the sum, in place: the context holding it is released after this
      // round, and nothing reads it meanwhile (a copy of the model's size per round, before). Not a gradient that
      // another leaf's may share or that is expanded (add_ would write through it): that one is copied.
      s.sum[i] = s.sum[i].defined() ? s.sum[i].add_(g) : g.is_non_overlapping_and_dense() ? g : g.clone();
    }
    const absl::Time now = absl::Now();
    if (s.in_round.empty()) s.round_started = now;
    // After the sums: a sum that threw leaves no trainer counted.
    s.in_round.emplace(part.from, Server::InRound{context_id, done});
    s.round_deadline = std::min(s.round_deadline, give_up_at(part.deadline, now));
    if (static_cast<int>(s.in_round.size()) == s.options.trainers) {
      for (size_t i = 0; i < s.params.size(); ++i) {
        s.params[i].mutable_grad() = s.sum[i].defined() ? s.sum[i].div_(s.options.trainers) : at::Tensor();
      }
      s.optimizer->step();
      for (size_t i = 0; i < s.params.size(); ++i) {
        s.params[i].mutable_grad() = at::Tensor();
        s.sum[i] = at::Tensor();
      }
      for (auto& [rank, t] : s.in_round) release.push_back(t.done);
      s.in_round.clear();
      s.round_deadline = absl::InfiniteFuture();
      ++s.rounds;
      s.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived).count();
      ++s.steps_timed;
      if (s.ckpt &&
          s.rounds % s.options.checkpoint_every == 0) {  // the step is taken; the trainers learn if its save is not
        saved =
            save_checkpoint(s, s.rounds, absl::StrCat("round ", s.rounds, " took its step, but its checkpoint failed"));
      }
    }
  }
  for (auto& f : release) f.set_status(saved);
  return done;
}

// Synchronous mode, on a thread of its own: a round that cannot complete before its first trainer's call times out
// (another trainer hung, or died where no launcher ends the job) fails every trainer waiting in it, naming the ones
// it waited for, and drops its gradients (no step): the trainers learn the cause instead of a bare timeout, and the
// server holds no stale gradients that a later round would mix in. It looks at the rounds only when one's deadline
// comes (or one comes earlier than it planned), not at each round: the rounds' hot path wakes nothing.
void watch_rounds() {
  Server& s = server();
  absl::Time planned = absl::InfiniteFuture();  // when this thread looks next: a round's deadline it saw
  for (;;) {
    std::vector<rpc::Future> failed;  // a round given up: failed whatever happens below
    try {
      std::map<int, Server::InRound> came;
      int64_t round = 0;
      absl::Duration waited;
      {
        MutexLock lock(&s.mu);
        auto earlier = [&s, &planned]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.round_deadline < planned; };
        if (planned == absl::InfiniteFuture()) {
          s.mu.Await(Condition(&earlier));
        } else {
          s.mu.AwaitWithDeadline(Condition(&earlier), planned);
        }
        const absl::Time now = absl::Now();
        if (s.in_round.empty() || now < s.round_deadline) {
          planned = s.round_deadline;  // the open round's (not due yet), or none
          continue;
        }
        planned = absl::InfiniteFuture();
        came.swap(s.in_round);
        for (auto& [rank, t] : came) failed.push_back(t.done);
        for (auto& g : s.sum) g = at::Tensor();
        s.round_deadline = absl::InfiniteFuture();
        round = s.rounds + 1;
        waited = now - s.round_started;
      }
      // Named outside the lock (the trainers' hooks wait on it).
      std::vector<std::string> arrived, missing;
      for (const auto& [rank, t] : came) arrived.push_back(trainer_name(rank));
      try {  // throws once RPC stops: then the error names no one absent
        const int self = rpc::get_worker_info().id;
        for (const auto& w : rpc::get_all_worker_infos()) {
          if (w.id != self && !came.count(w.id)) missing.push_back(trainer_name(w.id));
        }
      } catch (const std::exception&) {
        missing.clear();
      }
      const int absent = s.options.trainers - static_cast<int>(came.size());
      const absl::Status why = absl::DeadlineExceededError(absl::StrCat(
          "parameter server: round ", round, " waited ", absl::FormatDuration(waited), " for ", absent, " of its ",
          s.options.trainers, " trainers",
          static_cast<int>(missing.size()) == absent ? absl::StrCat(" (", absl::StrJoin(missing, ", "), ")") : "",
          ", and gives up before the calls of those that came (", absl::StrJoin(arrived, ", "),
          ") time out; their gradients are dropped, no step was taken"));
      TANDEM_LOG(kWarn, "ps") << why.message();
      for (auto& f : failed) f.set_error(why);
    } catch (const std::exception& e) {
      TANDEM_LOG(kError, "ps") << "the rounds' watch: " << e.what();
      for (auto& f : failed) {
        f.set_error(absl::DeadlineExceededError(
            absl::StrCat("parameter server: a round gave up waiting for its trainers (", e.what(), ")")));
      }
    }
  }
}

double on_evaluate() {
  Server& s = server();
  if (!s.test.images.defined()) throw std::invalid_argument("the server was started without the test set");
  torch::NoGradGuard no_grad;
  auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s.model.local_module());
  int64_t correct = 0;
  const int64_t n = s.test.images.size(0);
  for (int64_t at = 0; at < n; at += 1000) {
    at::Tensor x = s.test.images.slice(0, at, std::min(n, at + 1000));
    at::Tensor y = s.test.labels.slice(0, at, std::min(n, at + 1000));
    correct += net->forward(x).argmax(1).eq(y).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace

int default_server_threads() { return std::max(2, cluster::usable_cpus()); }

void register_parameter_server() {
  nn::register_module("cnn", fashion_mnist_cnn);
  nn::register_module("mlp", make_mlp);
  rpc::register_function("ps.evaluate", on_evaluate);
  rpc::register_function("ps.model", [] { return server().ready; });
  rpc::register_function("ps.checkpoint", [](int64_t step) {
    Server& s = server();
    rpc::Future arrived;
    std::vector<rpc::Future> release;
    absl::Status saved;
    {
      MutexLock lock(&s.mu);
      s.at_barrier.push_back(arrived);
      if (static_cast<int>(s.at_barrier.size()) == s.options.trainers) {
        s.rounds = step;
        release.swap(s.at_barrier);
        // Every trainer at the barrier learns of a failed save, not only the last to arrive.
        saved = save_checkpoint(s, step, absl::StrCat("the checkpoint of step ", step, " failed"));
      }
    }
    for (auto& f : release) f.set_status(saved);
    return arrived;
  });
  rpc::register_function("ps.rounds", [] {
    Server& s = server();
    MutexLock lock(&s.mu);
    return s.rounds;
  });
  rpc::register_function("ps.hash", [] {
    Server& s = server();
    MutexLock lock(&s.mu);
    return static_cast<int64_t>(parameters_hash(*s.model.local_module()));
  });
  rpc::register_function("ps.done", [](int64_t rank) {
    Server& s = server();
    MutexLock lock(&s.mu);
    s.done_ranks.insert(static_cast<int>(rank));
    if (static_cast<int>(s.done_ranks.size()) == s.options.trainers) s.finished.set_value(c10::IValue());
  });
  rpc::register_function("ps.failed", [](int64_t rank, std::string why) {
    server().finished.set_error(
        absl::AbortedError(absl::StrCat("parameter server: ", trainer_name(static_cast<int>(rank)), " failed: ", why)));
  });
  rpc::register_function("ps.alive", [] {});
}

void start_parameter_server(const ServerOptions& options) {
  throw_if_error(validate(options));
  Server& s = server();
  s.options = options;
  if (options.evaluate) s.test = load_fashion_mnist("t10k");
  torch::manual_seed(0);
  s.model = nn::RemoteModule::create(rpc::get_worker_info().id, options.model);
  for (const auto& r : s.model.remote_parameters()) s.params.push_back(r.local_value().toTensor());
  s.sum.resize(s.params.size());
  if (options.optimizer == "adam") {
    s.optimizer = std::make_unique<torch::optim::Adam>(s.params, torch::optim::AdamOptions(options.lr));
  } else {
    s.optimizer = std::make_unique<torch::optim::SGD>(s.params, torch::optim::SGDOptions(options.lr).momentum(0.9));
  }
  if (!options.checkpoint_dir.empty()) {
    MutexLock lock(&s.mu);
    s.ckpt = std::make_unique<checkpoint::Checkpointer>(options.checkpoint_dir, /*rank=*/0);
    s.state.add("model", *s.model.local_module()).add("optimizer", *s.optimizer).add("rounds", s.rounds);
    if (auto resumed = s.ckpt->restore(s.state)) {
      std::printf("parameter server: resumed from round %lld\n", static_cast<long long>(*resumed));
      std::fflush(stdout);
    }
  }
  metrics::set_gauge("tandem_ps_step_seconds_total", [] {
    MutexLock lock(&server().mu);
    return server().step_seconds;
  });
  metrics::set_gauge("tandem_ps_steps_total", [] {
    MutexLock lock(&server().mu);
    return static_cast<double>(server().steps_timed);
  });
  if (options.sync) {
    dist_autograd::set_backward_part_hook(on_backward_part);
    std::thread(watch_rounds).detach();  // the server lives until the process ends (server())
  }
  s.ready.set_value(s.model.module_rref().to_ivalue());
}

nn::RemoteModule server_model() {
  return nn::RemoteModule::from_rref(rref::RRef::from_ivalue(rpc::rpc_sync("ps", "ps.model")));
}

void wait_for_trainers(std::chrono::milliseconds probe_timeout) {
  Server& s = server();
  // One probe in flight per trainer that has not finished; the loop looks every second and never waits on a probe, so
  // a trainer's reported failure (finished's error) is seen within a second even while another trainer hangs.
  std::map<int, rpc::Future> probes;
  while (!s.finished.wait_for(std::chrono::seconds(1))) {
    for (int rank = 1; rank <= s.options.trainers; ++rank) {
      {
        MutexLock lock(&s.mu);
        if (s.done_ranks.count(rank) > 0) {  // checked after its probe failed too: it may have finished and left
          probes.erase(rank);
          continue;
        }
      }
      auto it = probes.find(rank);
      if (it != probes.end() && !it->second.completed()) continue;  // within its timeout
      if (it == probes.end() || it->second.status().ok()) {
        probes[rank] = rpc::call(rank, "ps.alive", {}, probe_timeout);
        continue;
      }
      if (s.finished.completed()) break;  // a failure reported meanwhile says more than the probe's error
      throw_if_error(absl::UnavailableError(
          absl::StrCat("parameter server: ", trainer_name(rank),
                       " has not finished and does not answer: ", it->second.status().ToString())));
    }
  }
  throw_if_error(s.finished.status());
}

void done() { rpc::rpc_sync("ps", "ps.done", static_cast<int64_t>(rpc::get_worker_info().id)); }

void report_failure(const std::string& why) noexcept {
  try {
    if (!rpc::is_initialized() || rpc::get_worker_info().id == 0) return;
    // A server that is gone (the failure may be that) must not hold this trainer's exit long.
    const auto timeout = std::min<std::chrono::milliseconds>(rpc::default_timeout(), std::chrono::seconds(5));
    rpc::call("ps", "ps.failed", {c10::IValue(static_cast<int64_t>(rpc::get_worker_info().id)), c10::IValue(why)},
              timeout)
        .wait_for(timeout + std::chrono::seconds(1));
  } catch (...) {
    // best effort: the trainer's own exit status and message are what count
  }
}

int64_t rounds_done() { return rpc::rpc_sync<int64_t>("ps", "ps.rounds"); }

void checkpoint_barrier(int64_t step) { rpc::rpc_sync("ps", "ps.checkpoint", step); }

uint64_t model_hash() { return static_cast<uint64_t>(rpc::rpc_sync<int64_t>("ps", "ps.hash")); }

double evaluate() { return rpc::rpc_sync<double>("ps", "ps.evaluate"); }

}  // namespace tandem::examples
