// Distributed autograd: contexts, the call tracer that records send/recv functions, and the FAST-mode backward pass.
// docs/dist_autograd.md describes the algorithm; this file follows it.
#include "tandem/dist_autograd/dist_autograd.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <unordered_set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/dist_autograd/detail/gradients.h"
#include "tandem/dist_autograd/detail/trace.h"
#include "tandem/log/log.h"
#include "tandem/metrics/metrics.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/detail/ids.h"
#include "tandem/rpc/detail/note_batcher.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tandem/sync/sync.h"

namespace tandem::dist_autograd {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

constexpr const char* kGradFunction = "__tandem.dist_autograd.grad";
constexpr const char* kReleaseFunction = "__tandem.dist_autograd.release";
constexpr const char* kPrefix = "__tandem.dist_autograd.";

thread_local int64_t t_context = -1;

// Sender side of a message: the gradients of the message's tensors arrive here (from the receiver's recv function)
// and continue into this worker's graph.
struct SendRpcBackward : Node {
  variable_list apply(variable_list&& grads) override { return std::move(grads); }
  std::string name() const override { return "tandem::SendRpcBackward"; }
};

// Receiver side: the tensors of a message were made its outputs. Its gradients are captured by the backward pass and
// sent to the sender's SendRpcBackward; it is never applied itself.
struct RecvRpcBackward : Node {
  RecvRpcBackward(int64_t context, int from, int64_t send) : context_id(context), from_rank(from), send_id(send) {}
  variable_list apply(variable_list&&) override {
    throw_error(absl::FailedPreconditionError(
        "RecvRpcBackward is applied by distributed autograd only (use dist_autograd::backward)"));
  }
  std::string name() const override { return "tandem::RecvRpcBackward"; }
  const int64_t context_id;
  const int from_rank;
  const int64_t send_id;
};

struct Context {
  explicit Context(int64_t i) : id(i) {}
  // Records that this context reached `worker` (its release goes there too); false once the context was taken for
  // release here (its workers were already told: one added now would never hear of it).
  bool add_worker(int worker) ABSL_LOCKS_EXCLUDED(mu) {
    MutexLock lock(&mu);
    if (released) return false;
    workers.insert(worker);
    return true;
  }
  // Adds `g` to `leaf`'s gradient in this context.
  void accumulate(const at::Tensor& leaf, const at::Tensor& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto [it, fresh] = grads.try_emplace(leaf.unsafeGetTensorImpl(), leaf, g);
    if (!fresh) it->second.second = it->second.second + g;
  }

  const int64_t id;
  Mutex mu;
  std::unordered_map<int64_t, std::shared_ptr<SendRpcBackward>> sends ABSL_GUARDED_BY(mu);
  Gradients::Map grads ABSL_GUARDED_BY(mu);
  std::set<int> workers ABSL_GUARDED_BY(mu);  // workers this context sent to or received from: release goes there
  bool released ABSL_GUARDED_BY(mu) = false;  // taken for release: `workers` was read for the last time
  // Gradient messages received, by message id, with the work each started: a duplicate (a retried or duplicated
  // message) joins that work instead of adding its gradients a second time.
  std::unordered_map<int64_t, rpc::Future> grad_messages ABSL_GUARDED_BY(mu);
};

class Container {
 public:
  static Container& get() {
    static auto* c = new Container;  // never destroyed: RPC threads may use it until exit
    return *c;
  }
  std::shared_ptr<Context> find(int64_t id) {
    MutexLock lock(&mu_);
    auto it = contexts_.find(id);
    return it == contexts_.end() ? nullptr : it->second;
  }
  // `unreleased`: null for a context released here lately instead (adopt_context: its release came first).
  std::shared_ptr<Context> get_or_create(int64_t id, bool unreleased = false) {
    std::shared_ptr<Context> made;
    {
      MutexLock lock(&mu_);
      if (unreleased && released_.count(id)) return nullptr;
      auto& c = contexts_[id];
      if (c) return c;
      made = c = std::make_shared<Context>(id);
    }
    TANDEM_LOG(kDebug, "dist_autograd") << "context " << id << " created";
    return made;
  }
  std::shared_ptr<Context> take(int64_t id) {
    // Remembered only while RPC is up: ids are unique within a job, and a context made before init_rpc has a
    // provisional rank in its id.
    const bool remember = rpc::is_initialized();
    MutexLock lock(&mu_);
    if (remember && released_.insert(id).second) {
      released_order_.push_back(id);
      if (released_order_.size() > kRemembered) released_.erase(released_order_.front()), released_order_.pop_front();
    }
    auto it = contexts_.find(id);
    if (it == contexts_.end()) return nullptr;
    auto c = std::move(it->second);
    contexts_.erase(it);
    return c;
  }
  // RPC is stopping: every context goes, and the memory of released ones (the next job's ids start again).
  void clear() {
    std::unordered_map<int64_t, std::shared_ptr<Context>> gone;
    {
      MutexLock lock(&mu_);
      gone.swap(contexts_);
      released_.clear();
      released_order_.clear();
    }
  }
  int64_t size() {
    MutexLock lock(&mu_);
    return static_cast<int64_t>(contexts_.size());
  }
  std::atomic<int64_t> failed_releases{0};

 private:
  Mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<Context>> contexts_ ABSL_GUARDED_BY(mu_);
  // The contexts released here lately (oldest first in the deque), bounded.
  static constexpr size_t kRemembered = 10000;
  std::unordered_set<int64_t> released_ ABSL_GUARDED_BY(mu_);
  std::deque<int64_t> released_order_ ABSL_GUARDED_BY(mu_);
};

std::string worker_name() {
  return rpc::is_initialized() ? rpc::get_worker_info().name : std::string("(rpc not initialized)");
}

// The attachment of a message in context `context_id` (proto/tandem_rpc.proto: AutogradTrace). When some of its tensors
// require grad, records a send function for them (their gradients come back to it) and names it.
std::string attach(Context& ctx, const std::vector<at::Tensor>& tensors) {
  tandem::wire::AutogradTrace trace;
  trace.set_context_id(ctx.id);
  std::vector<at::Tensor> recorded;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || !tensors[i].requires_grad()) continue;
    trace.add_tensor_indices(static_cast<uint32_t>(i));
    recorded.push_back(tensors[i]);
  }
  if (!recorded.empty()) {
    auto send = std::make_shared<SendRpcBackward>();
    send->set_next_edges(torch::autograd::collect_next_edges(recorded));
    for (const auto& t : recorded) send->add_input_metadata(t);
    trace.set_has_send(true);
    trace.set_send_id(rpc::detail::next_global_id());
    MutexLock lock(&ctx.mu);
    ctx.sends.emplace(trace.send_id(), std::move(send));
  }
  return trace.SerializeAsString();
}

}  // namespace

absl::StatusOr<tandem::wire::AutogradTrace> parse_trace(const std::string& bytes, size_t num_tensors) {
  tandem::wire::AutogradTrace a;
  auto bad = [](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("malformed distributed autograd record: ", why));
  };
  if (!a.ParseFromString(bytes)) return bad("it does not parse");
  if (a.context_id() < 0) return bad("a negative context id");
  if (!a.has_send()) {
    if (a.tensor_indices_size() > 0 || a.send_id() != 0) return bad("tensor indices without a send");
    return a;
  }
  if (a.send_id() < 0) return bad("a negative send id");
  if (a.tensor_indices_size() == 0) return bad("a send without tensors");
  std::unordered_set<uint32_t> seen;
  for (uint32_t index : a.tensor_indices()) {
    if (index >= num_tensors) return bad(absl::StrCat("tensor index ", index, " of ", num_tensors, " tensors"));
    if (!seen.insert(index).second) return bad(absl::StrCat("tensor index ", index, " twice"));
  }
  return a;
}

namespace {

// Makes the tensors of a received message outputs of a recv function that sends their gradients to `from`'s send.
absl::Status record_recv(const tandem::wire::AutogradTrace& a, int from, const std::vector<at::Tensor>& tensors) {
  if (!a.has_send()) return absl::OkStatus();
  for (uint32_t i : a.tensor_indices()) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || !(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()))) {
      return absl::InvalidArgumentError(absl::StrCat("distributed autograd: tensor ", i, " cannot require grad"));
    }
  }
  auto recv = std::make_shared<RecvRpcBackward>(a.context_id(), from, a.send_id());
  for (uint32_t i : a.tensor_indices()) torch::autograd::set_history(const_cast<at::Tensor&>(tensors[i]), recv);
  return absl::OkStatus();
}

struct CallState {
  int64_t context_id;
};

absl::Status released_already(int64_t context_id);

class Tracer final : public rpc::CallTracer {
 public:
  std::string request_out(int to, const std::string& function, const std::vector<at::Tensor>& tensors) override {
    if (t_context < 0 || function.rfind(kPrefix, 0) == 0) return "";
    // A context released here already (a call served in it outlived its caller's guard) is not made again: nobody
    // would release it. The call goes without it.
    auto ctx = Container::get().get_or_create(t_context, /*unreleased=*/true);
    if (!ctx || !ctx->add_worker(to)) return "";  // released meanwhile, as above
    return attach(*ctx, tensors);
  }

  absl::StatusOr<std::shared_ptr<void>> request_in(int from, const std::string& attached,
                                                   const std::vector<at::Tensor>& tensors) override {
    auto a = parse_trace(attached, tensors.size());
    if (!a.ok()) return a.status();
    if (a->has_send()) {
      // A request that arrives after its context's release (an asynchronous call overtaken by it) is refused.
      auto ctx = Container::get().get_or_create(a->context_id(), /*unreleased=*/true);
      if (!ctx || !ctx->add_worker(from)) return released_already(a->context_id());
    }
    if (auto s = record_recv(*a, from, tensors); !s.ok()) return s;
    return std::shared_ptr<void>(std::make_shared<CallState>(CallState{a->context_id()}));
  }

  std::shared_ptr<void> enter(const std::shared_ptr<void>& state) override {
    struct Scope {
      int64_t previous;
      ~Scope() { t_context = previous; }
    };
    auto scope = std::make_shared<Scope>(Scope{t_context});
    t_context = static_cast<CallState*>(state.get())->context_id;
    return scope;
  }

  std::shared_ptr<void> capture() override {
    if (t_context < 0) return nullptr;
    return std::make_shared<CallState>(CallState{t_context});
  }

  std::string reply_out(const std::shared_ptr<void>& state, int to, const std::vector<at::Tensor>& tensors) override {
    bool any = false;
    for (const auto& t : tensors) any |= t.defined() && t.requires_grad();
    if (!any) return "";
    // Released here while the call ran: the reply carries no history back (the caller's context is gone too).
    auto ctx = Container::get().get_or_create(static_cast<CallState*>(state.get())->context_id, /*unreleased=*/true);
    if (!ctx || !ctx->add_worker(to)) return "";
    return attach(*ctx, tensors);
  }

  absl::Status reply_in(int from, const std::string& attached, const std::vector<at::Tensor>& tensors) override {
    auto a = parse_trace(attached, tensors.size());
    if (!a.ok()) return a.status();
    if (auto ctx = Container::get().find(a->context_id())) ctx->add_worker(from);
    return record_recv(*a, from, tensors);
  }
};

// The local part of a backward pass: from `roots` (with gradients `inputs`) through this worker's graph. Leaves'
// gradients accumulate into the context; recv functions' gradients go to their senders. The future completes when
// every worker reached from here is done.
// `may_block`: the caller is a user thread (backward()), which may wait for the last gradient message itself (on the
// direct channel a synchronous call saves two thread hand-offs). An RPC thread may do the same only within a small
// budget (kMaxBlockedRpcThreads at once): the others stay free to serve, so chains of waits cannot exhaust a worker.
constexpr int kMaxBlockedRpcThreads = 4;
std::atomic<int> g_blocked_rpc_threads{0};

// Inside a catch: what the part of context `context_id` on this worker threw, with its code (a user's exception is
// UNKNOWN, a tandem::Error, e.g. DDP's, keeps its own), naming the worker.
rpc::Future failed_here(int64_t context_id) {
  const absl::Status thrown = status_from_current_exception();
  return rpc::Future::failed(
      absl::Status(thrown.code(), absl::StrCat("distributed backward failed on worker '", worker_name(), "' (context ",
                                               context_id, "): ", thrown.message())));
}

rpc::Future run_local(const std::shared_ptr<Context>& ctx, const torch::autograd::edge_list& roots,
                      const variable_list& inputs, std::chrono::milliseconds timeout, bool may_block) {
  // What to capture: every leaf (AccumulateGrad) and every recv function reachable from the roots.
  torch::autograd::edge_list outputs;
  std::vector<std::shared_ptr<Node>> leaves;
  std::vector<std::shared_ptr<RecvRpcBackward>> recvs;
  {
    std::unordered_set<Node*> seen;
    std::vector<std::shared_ptr<Node>> stack;
    for (const auto& e : roots) {
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function);
    }
    while (!stack.empty()) {
      std::shared_ptr<Node> n = std::move(stack.back());
      stack.pop_back();
      if (dynamic_cast<torch::autograd::AccumulateGrad*>(n.get())) {
        leaves.push_back(n);
        continue;
      }
      if (auto recv = std::dynamic_pointer_cast<RecvRpcBackward>(n)) {
        recvs.push_back(std::move(recv));
        continue;
      }
      for (const auto& e : n->next_edges()) {
        if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function);
      }
    }
  }
  // Captured gradients come back in this order: the leaves, then every input of every recv function.
  for (const auto& leaf : leaves) outputs.emplace_back(leaf, 0);
  for (const auto& recv : recvs) {
    for (uint32_t i = 0; i < recv->num_inputs(); ++i) outputs.emplace_back(recv, i);
  }
  if (outputs.empty()) return rpc::Future::ready(c10::IValue());

  variable_list captured;
  try {
    captured = torch::autograd::Engine::get_default_engine().execute(roots, inputs, /*keep_graph=*/true,
                                                                     /*create_graph=*/false,
                                                                     /*accumulate_grad=*/false, outputs);
  } catch (...) {
    return failed_here(ctx->id);  // what a backward function threw
  }

  size_t k = 0;
  {
    MutexLock lock(&ctx->mu);
    for (const auto& leaf : leaves) {
      const at::Tensor& g = captured[k++];
      if (g.defined()) ctx->accumulate(static_cast<torch::autograd::AccumulateGrad*>(leaf.get())->variable, g);
    }
  }
  struct Message {
    int to;
    std::vector<c10::IValue> args;
  };
  std::vector<Message> messages;
  for (const auto& recv : recvs) {
    std::vector<int64_t> indices;
    std::vector<at::Tensor> grads;
    for (uint32_t i = 0; i < recv->num_inputs(); ++i) {
      const at::Tensor& g = captured[k++];
      if (!g.defined()) continue;
      indices.push_back(i);
      grads.push_back(g);
    }
    if (grads.empty()) continue;  // nothing flowed into this message: its sender's part gets no gradient
    messages.push_back(
        {recv->from_rank,
         {c10::IValue(recv->context_id), c10::IValue(recv->send_id), rpc::to_ivalue(indices), rpc::to_ivalue(grads),
          c10::IValue(rpc::detail::next_global_id()), c10::IValue(static_cast<int64_t>(timeout.count()))}});
  }
  bool budget = false;
  if (!may_block && !messages.empty()) {
    budget = g_blocked_rpc_threads.fetch_add(1) < kMaxBlockedRpcThreads;
    if (!budget) g_blocked_rpc_threads.fetch_sub(1);
  }
  std::vector<rpc::Future> sent;
  for (size_t i = 0; i < messages.size(); ++i) {
    auto& m = messages[i];
    const bool last = i + 1 == messages.size();
    sent.push_back((may_block || budget) && last ? rpc::call_and_wait(m.to, kGradFunction, std::move(m.args), timeout)
                                                 : rpc::call(m.to, kGradFunction, std::move(m.args), timeout));
  }
  if (budget) g_blocked_rpc_threads.fetch_sub(1);
  return sent.size() == 1 ? sent[0] : rpc::when_all(sent);
}

Mutex g_hook_mu;
using Hook = std::function<rpc::Future(const BackwardPart&)>;
std::shared_ptr<const Hook> g_hook ABSL_GUARDED_BY(g_hook_mu);

std::shared_ptr<const Hook> backward_part_hook() {
  MutexLock lock(&g_hook_mu);
  return g_hook;
}

// Worker side of a gradient message: continue the pass from send function `send_id`. `message_id` is unique per
// message: a copy of one already received (the transport duplicated it) completes with the original's work.
// `timeout_ms`: the backward's timeout as its origin resolved it, for this worker's hops as for the caller's (0, from
// a sender of an older build: this worker's RpcOptions::rpc_timeout).
rpc::Future on_grad(int64_t context_id, int64_t send_id, std::vector<int64_t> indices, std::vector<at::Tensor> grads,
                    int64_t message_id, int64_t timeout_ms) {
  const rpc::CallContext* call = rpc::current_call();  // this message's, read before any work
  const int from = call ? call->caller_rank : -1;
  auto ctx = Container::get().find(context_id);
  if (!ctx) {
    throw_error(absl::NotFoundError(absl::StrCat("distributed autograd context ", context_id,
                                                 " does not exist on worker '", worker_name(), "' (released?)")));
  }
  std::shared_ptr<SendRpcBackward> send;
  {
    MutexLock lock(&ctx->mu);
    auto it = ctx->sends.find(send_id);
    if (it != ctx->sends.end()) send = it->second;
  }
  if (!send) {
    throw_error(absl::NotFoundError(absl::StrCat("no send function ", send_id, " in distributed autograd context ",
                                                 context_id, " on worker '", worker_name(), "'")));
  }
  if (indices.size() != grads.size()) {
    throw_error(absl::InvalidArgumentError("malformed gradient message: indices and gradients differ"));
  }
  torch::autograd::edge_list roots;
  for (int64_t i : indices) {
    if (i < 0 || i >= static_cast<int64_t>(send->num_inputs())) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("malformed gradient message: input ", i, " out of range")));
    }
    roots.emplace_back(send, static_cast<uint32_t>(i));
  }
  rpc::Future work;
  {
    MutexLock lock(&ctx->mu);
    auto [it, fresh] = ctx->grad_messages.try_emplace(message_id);
    if (!fresh) return it->second;
    it->second = work;
  }
  const auto started = std::chrono::steady_clock::now();
  auto hook = backward_part_hook();
  // With a hook: when the sender's call times out (its deadline counts from its send, a transit earlier).
  const absl::Time deadline =
      !hook ? absl::InfiniteFuture()
            : absl::Now() + absl::FromChrono(timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms)
                                                            : rpc::default_timeout());  // a sender of an older build
  rpc::Future done;
  try {
    done = run_local(ctx, roots, grads, std::chrono::milliseconds(std::max<int64_t>(0, timeout_ms)),
                     /*may_block=*/false);
  } catch (...) {  // outside the engine (its errors are a failed future): work must complete, a duplicate waits on it
    done = failed_here(context_id);
  }
  if (profile::active()) {
    done.add_callback([started, context_id, caller = call ? call->caller_name : std::string("?")](const rpc::Future&) {
      if (profile::active()) {
        profile::report_steady(absl::StrCat("dist_autograd:remote_backward#", context_id, "(from ", caller, ")"),
                               started, std::chrono::steady_clock::now());
      }
    });
  }
  if (!hook) {
    rpc::forward(done, work);
    return work;
  }
  // Once this part is done: the hook, whose future the reply waits for.
  const BackwardPart about{context_id, from, deadline};
  done.add_callback([work, hook = std::move(hook), about](const rpc::Future& part) {
    if (absl::Status s = part.status(); !s.ok()) {
      work.set_error(std::move(s));
      return;
    }
    rpc::Future after;
    try {
      after = (*hook)(about);
    } catch (...) {
      const absl::Status thrown = status_from_current_exception();
      work.set_error(
          absl::Status(thrown.code(), absl::StrCat("the backward hook on worker '", worker_name(), "' failed (context ",
                                                   about.context_id, "): ", thrown.message())));
      return;
    }
    after.add_callback([work](const rpc::Future& f) { work.set_status(f.status()); });
  });
  return work;
}

// Release messages, batched per destination as rpc::detail::release_options() says (a release is idempotent: an
// unknown context is nothing to do). Each release completes when the message carrying it does; failed ones count in
// failed_releases.
rpc::detail::NoteBatcher& releases() {
  static auto* batcher = new rpc::detail::NoteBatcher(  // never destroyed: release messages may complete until exit
      rpc::detail::release_options([](int to, const std::string& function, const absl::Status& error, int64_t notes) {
        Container::get().failed_releases.fetch_add(notes);
        if (error.code() == absl::StatusCode::kCancelled) return;  // RPC stops here: nothing more can be sent
        // Contexts that stay on that worker (their graphs and gradients) until it stops.
        TANDEM_LOG(kWarn, "dist_autograd") << "releasing " << notes << " context(s) with '" << function
                                           << "' on worker " << to << " failed for good: " << error;
      }));
  return *batcher;
}

// Takes context `context_id` here; returns the workers it reached from here (this one left out), to be told.
std::set<int> take_for_release(int64_t context_id, int asked_by) {
  auto ctx = Container::get().take(context_id);
  if (!ctx) return {};
  std::set<int> workers;
  {
    MutexLock lock(&ctx->mu);
    ctx->released = true;  // a call adding a worker from now on goes without this context (add_worker)
    workers = ctx->workers;
  }
  workers.erase(rpc::detail::self_rank_or(0));
  TANDEM_LOG(kDebug, "dist_autograd") << "context " << context_id << " released"
                                      << (asked_by >= 0 ? " (asked by rank " + std::to_string(asked_by) + ")" : "")
                                      << "; telling " << workers.size() << " workers it reached";
  return workers;
}

// A release's handler: takes the contexts here and passes their release on to the workers they reached from here,
// except the one that asked, in one message per worker sent at once (NoteBatcher::send_now). Not queued behind a
// release message in flight to that worker, as this worker's own releases are: the reply waits for these forwards, so
// around a ring of workers releasing several contexts at once (A's message to B waiting for B's forward to C, C's for
// its forward to A, and that one queued behind A's message) releases would wait on themselves until their RPC
// timeouts, and fail.
rpc::Future forward_releases(const std::vector<int64_t>& context_ids) {
  const rpc::CallContext* call = rpc::current_call();
  const int asked_by = call ? call->caller_rank : -1;
  std::map<int, std::vector<int64_t>> to;
  for (int64_t id : context_ids) {
    for (int w : take_for_release(id, asked_by)) {
      if (w != asked_by) to[w].push_back(id);
    }
  }
  std::vector<rpc::Future> released;
  for (auto& [w, ids] : to) released.push_back(releases().send_now(w, kReleaseFunction, std::move(ids)));
  return rpc::when_all(released);
}

bool install() {
  static Tracer tracer;
  rpc::set_call_tracer(&tracer);
  rpc::register_function(kGradFunction, on_grad);
  rpc::register_function(kReleaseFunction, forward_releases);
  rpc::add_stop_hook([] { Container::get().clear(); });
  metrics::set_gauge("tandem_dist_autograd_contexts", [] { return static_cast<double>(Container::get().size()); });
  return true;
}

const bool g_installed = install();

}  // namespace

ContextGuard::ContextGuard() : id_(rpc::detail::next_global_id()), previous_(t_context) {
  Container::get().get_or_create(id_);
  t_context = id_;
}

ContextGuard::~ContextGuard() {
  t_context = previous_;
  // A destructor must not throw (a release allocates and sends messages); a release that cannot be made counts as
  // failed.
  try {
    release_context(id_);
  } catch (...) {
    Container::get().failed_releases.fetch_add(1);
    TANDEM_LOG(kWarn, "dist_autograd") << "context " << id_ << " could not be released: "
                                       << status_from_current_exception().message();
  }
}

int64_t current_context() { return t_context; }

void backward(int64_t context_id, const std::vector<at::Tensor>& roots, bool /*retain_graph*/,
              std::chrono::milliseconds timeout) {
  (void)g_installed;
  auto ctx = Container::get().find(context_id);
  if (!ctx) {
    throw RpcError(absl::NotFoundError(
        absl::StrCat("distributed autograd context ", context_id, " does not exist on worker '", worker_name(), "'")));
  }
  if (roots.empty()) throw RpcError(absl::InvalidArgumentError("backward() needs at least one root"));
  torch::autograd::edge_list edges;
  variable_list grads;
  for (const auto& r : roots) {
    if (!r.defined() || !r.requires_grad()) {
      throw RpcError(absl::InvalidArgumentError("backward(): every root must be a tensor that requires grad"));
    }
    edges.push_back(torch::autograd::impl::gradient_edge(r));
    grads.push_back(at::ones_like(r));
  }
  TANDEM_LOG(kDebug, "dist_autograd") << "backward of context " << context_id << " from " << roots.size() << " roots";
  const auto started = std::chrono::steady_clock::now();
  // This worker's timeout, resolved here: the gradient messages carry it to every hop (a hook there learns when this
  // call times out, BackwardPart::deadline), not 0 for each worker's own default.
  const auto wait = timeout.count() > 0 ? timeout : rpc::default_timeout();
  rpc::Future done = run_local(ctx, edges, grads, wait, /*may_block=*/true);
  // Each hop has its RPC deadline; this bounds the whole pass as well.
  if (!done.wait_for(wait)) {
    throw RpcError(
        absl::DeadlineExceededError(absl::StrCat("distributed backward of context ", context_id, " on worker '",
                                                 worker_name(), "' did not finish within ", wait.count(), " ms")));
  }
  if (profile::active()) {
    profile::report_steady(absl::StrCat("dist_autograd:backward#", context_id), started,
                           std::chrono::steady_clock::now());
  }
  throw_if_error(done.status());
}

at::Tensor Gradients::operator[](const at::Tensor& leaf) const {
  auto it = map_.find(leaf.unsafeGetTensorImpl());
  return it == map_.end() ? at::Tensor() : it->second.second;
}

namespace {
std::shared_ptr<Context> find_or_throw(int64_t context_id) {
  auto ctx = Container::get().find(context_id);
  if (!ctx) {
    throw RpcError(absl::NotFoundError(
        absl::StrCat("distributed autograd context ", context_id, " does not exist on worker '", worker_name(), "'")));
  }
  return ctx;
}
}  // namespace

std::optional<Gradients> detail::find_gradients(int64_t context_id) {
  auto ctx = Container::get().find(context_id);
  if (!ctx) return std::nullopt;
  MutexLock lock(&ctx->mu);
  return Gradients(ctx->grads);
}

Gradients get_gradients(int64_t context_id) {
  auto ctx = find_or_throw(context_id);
  MutexLock lock(&ctx->mu);
  return Gradients(ctx->grads);
}

void set_gradient(int64_t context_id, const at::Tensor& leaf, at::Tensor grad) {
  auto ctx = find_or_throw(context_id);
  MutexLock lock(&ctx->mu);
  ctx->grads.insert_or_assign(leaf.unsafeGetTensorImpl(), std::make_pair(leaf, std::move(grad)));
}

namespace {
// The context of the call this thread serves, made known here (its caller's release reaches this worker); null when
// this thread serves no call made in `context_id`, or the context's release reached this worker already (a late call:
// brought back, nobody would release it).
std::shared_ptr<Context> adopt(int64_t context_id) {
  const rpc::CallContext* call = rpc::current_call();
  if (call == nullptr || context_id < 0 || t_context != context_id) return nullptr;
  auto ctx = Container::get().get_or_create(context_id, /*unreleased=*/true);
  if (ctx && !ctx->add_worker(call->caller_rank)) return nullptr;  // released meanwhile
  return ctx;
}

// Why a context cannot be adopted here: its release came first.
absl::Status released_already(int64_t context_id) {
  return absl::NotFoundError(absl::StrCat("distributed autograd context ", context_id, " was released on worker '",
                                          worker_name(), "' already"));
}
}  // namespace

void add_gradient(int64_t context_id, const at::Tensor& leaf, const at::Tensor& grad) {
  auto ctx = Container::get().find(context_id);
  // Not known here yet: made here only while this thread serves a call made in that context. Anything else is a
  // context that was released (or never existed): an error, never one brought back to life that nobody would release.
  if (!ctx) ctx = adopt(context_id);
  if (!ctx) {
    throw RpcError(
        absl::NotFoundError(absl::StrCat("distributed autograd context ", context_id, " does not exist on worker '",
                                         worker_name(), "' (released?), and no call made in it is being served here")));
  }
  MutexLock lock(&ctx->mu);
  ctx->accumulate(leaf, grad);
}

int64_t adopt_current_context() {
  if (!adopt(t_context)) {
    if (rpc::current_call() != nullptr && t_context >= 0) throw RpcError(released_already(t_context));
    throw RpcError(absl::FailedPreconditionError(absl::StrCat("adopt_current_context on worker '", worker_name(),
                                                              "': this thread serves no call made in a "
                                                              "distributed autograd context")));
  }
  return t_context;
}

void share_context(int64_t context_id, int worker) {
  auto ctx = Container::get().find(context_id);
  if (!ctx || !ctx->add_worker(worker)) {  // (or was released meanwhile)
    throw RpcError(absl::NotFoundError(
        absl::StrCat("distributed autograd context ", context_id, " does not exist on worker '", worker_name(), "'")));
  }
}

void adopt_context(int64_t context_id, int origin) {
  auto ctx = Container::get().get_or_create(context_id, /*unreleased=*/true);
  if (!ctx || !ctx->add_worker(origin)) throw RpcError(released_already(context_id));
}

void set_backward_part_hook(std::function<rpc::Future(const BackwardPart& part)> hook) {
  auto shared = hook ? std::make_shared<const Hook>(std::move(hook)) : nullptr;
  MutexLock lock(&g_hook_mu);
  g_hook = std::move(shared);
}

rpc::Future release_context(int64_t context_id) {
  std::vector<rpc::Future> released;
  for (int w : take_for_release(context_id, -1)) {
    released.push_back(releases().add_tracked(w, kReleaseFunction, {context_id}));
  }
  return rpc::when_all(released);
}

Stats stats() {
  return Stats{Container::get().size(), Container::get().failed_releases.load(), releases().calls_made()};
}

}  // namespace tandem::dist_autograd
