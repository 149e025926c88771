// The distributed optimizer: a local LibTorch optimizer per owner, stepped with a context's gradients.
#include "tandem/dist_optim/dist_optim.h"

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "absl/base/attributes.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/dist_autograd/detail/gradients.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/log/log.h"
#include "tandem/rpc/detail/note_batcher.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tandem/sync/sync.h"

namespace tandem::dist_optim {
namespace {

constexpr const char* kCreate = "__tandem.dist_optim.create";
constexpr const char* kStep = "__tandem.dist_optim.step";
constexpr const char* kRelease = "__tandem.dist_optim.release";
constexpr const char* kSaveState = "__tandem.dist_optim.save_state";
constexpr const char* kLoadState = "__tandem.dist_optim.load_state";

using Hyper = std::map<std::string, double>;

// Reads the hyper-parameters a kind knows; anything left over is an error.
class HyperReader {
 public:
  HyperReader(std::string kind, Hyper h) : kind_(std::move(kind)), h_(std::move(h)) {}
  double get(const std::string& name, double fallback) {
    auto it = h_.find(name);
    if (it == h_.end()) return fallback;
    double v = it->second;
    h_.erase(it);
    return v;
  }
  bool flag(const std::string& name) { return get(name, 0) != 0; }
  void check_all_used() const {
    if (h_.empty()) return;
    std::vector<std::string> names;
    for (const auto& [k, v] : h_) names.push_back(k);
    throw_error(absl::InvalidArgumentError(
        absl::StrCat("optimizer '", kind_, "' has no hyper-parameter ", absl::StrJoin(names, ", "))));
  }

 private:
  std::string kind_;
  Hyper h_;
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params,
                                                        const Hyper& hyper) {
  HyperReader h(kind, hyper);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (kind == "sgd") {
    torch::optim::SGDOptions o(h.get("lr", 0.01));
    o.momentum(h.get("momentum", 0)).dampening(h.get("dampening", 0)).weight_decay(h.get("weight_decay", 0));
    o.nesterov(h.flag("nesterov"));
    opt = std::make_unique<torch::optim::SGD>(std::move(params), o);
  } else if (kind == "adam" || kind == "adamw") {
    const double lr = h.get("lr", 1e-3), b1 = h.get("beta1", 0.9), b2 = h.get("beta2", 0.999), eps = h.get("eps", 1e-8);
    const double wd = h.get("weight_decay", kind == "adam" ? 0 : 1e-2);
    const bool amsgrad = h.flag("amsgrad");
    if (kind == "adam") {
      opt = std::make_unique<torch::optim::Adam>(
          std::move(params), torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd).amsgrad(amsgrad));
    } else {
      opt = std::make_unique<torch::optim::AdamW>(
          std::move(params), torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd).amsgrad(amsgrad));
    }
  } else if (kind == "adagrad") {
    torch::optim::AdagradOptions o(h.get("lr", 0.01));
    o.lr_decay(h.get("lr_decay", 0)).weight_decay(h.get("weight_decay", 0));
    o.initial_accumulator_value(h.get("initial_accumulator_value", 0)).eps(h.get("eps", 1e-10));
    opt = std::make_unique<torch::optim::Adagrad>(std::move(params), o);
  } else if (kind == "rmsprop") {
    torch::optim::RMSpropOptions o(h.get("lr", 0.01));
    o.alpha(h.get("alpha", 0.99)).eps(h.get("eps", 1e-8)).weight_decay(h.get("weight_decay", 0));
    o.momentum(h.get("momentum", 0)).centered(h.flag("centered"));
    opt = std::make_unique<torch::optim::RMSprop>(std::move(params), o);
  } else {
    throw_error(absl::InvalidArgumentError(
        absl::StrCat("unknown optimizer '", kind, "' (known: sgd, adam, adamw, adagrad, rmsprop)")));
  }
  h.check_all_used();
  return opt;
}

// A handle on `p`'s memory with its own autograd metadata. Locked mode: detach() shares the version counter, so an
// update is seen as the in-place change it is. Hogwild: a separate tensor over the same bytes, invisible to it.
at::Tensor handle_of(const at::Tensor& p, bool hogwild) {
  if (!hogwild) return p.detach();
  return at::from_blob(
      p.data_ptr(), p.sizes(), p.strides(), [keep = p](void*) {}, p.options());
}

// One owner's part of a DistributedOptimizer.
struct LocalOptimizer {
  LocalOptimizer(const std::string& kind, std::vector<at::Tensor> parameters, bool hogwild_steps, const Hyper& hyper)
      : params(std::move(parameters)), hogwild(hogwild_steps) {
    for (const auto& p : params) handles.push_back(handle_of(p, hogwild));
    optimizer = make_optimizer(kind, handles, hyper);
  }

  const std::vector<at::Tensor> params;  // the parameters themselves (gradients are keyed by them)
  const bool hogwild;
  Mutex mu;                                             // one step at a time on this optimizer
  std::vector<at::Tensor> handles ABSL_GUARDED_BY(mu);  // what the optimizer updates: same memory, own .grad
  std::unique_ptr<torch::optim::Optimizer> optimizer ABSL_GUARDED_BY(mu);
};

// Guards no data: steps of non-hogwild optimizers on this worker take it, so each update is applied whole.
ABSL_CONST_INIT Mutex g_owner_lock(absl::kConstInit);
ABSL_CONST_INIT Mutex g_registry_mu(absl::kConstInit);
std::unordered_map<int64_t, std::shared_ptr<LocalOptimizer>> g_optimizers ABSL_GUARDED_BY(g_registry_mu);
// Ids released while no optimizer was registered under them here (a caller whose creation failed releases it on every
// owner it asked, and the release may overtake a creation still under way): such a creation is refused. An id stays
// until the creation it refuses comes, or for released_early_ttl() (a creation still under way by then is past its
// caller's timeout and refuses itself; an id whose creation failed here, or a release sent again, is never claimed),
// at most kMaxReleasedEarly ids (the oldest go first).
constexpr size_t kMaxReleasedEarly = 4096;
std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> g_released_order ABSL_GUARDED_BY(g_registry_mu);
std::unordered_set<int64_t> g_released_early ABSL_GUARDED_BY(g_registry_mu);

std::chrono::milliseconds released_early_ttl() {
  return std::max<std::chrono::milliseconds>(std::chrono::minutes(10), 2 * rpc::default_timeout());
}

void add_released_early(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_registry_mu) {
  const auto now = std::chrono::steady_clock::now();
  g_released_order.emplace_back(now, id);
  g_released_early.insert(id);
  const auto ttl = released_early_ttl();
  while (!g_released_order.empty() &&
         (g_released_order.size() > kMaxReleasedEarly || now - g_released_order.front().first > ttl)) {
    g_released_early.erase(g_released_order.front().second);
    g_released_order.pop_front();
  }
}

// The id a DistributedOptimizer gives its optimizers on every owner: unique in the job (the caller's rank in the top
// bits, then a counter that starts at a random point, so that a restarted caller does not reuse its predecessor's).
int64_t next_id() {
  static std::atomic<int64_t> counter{[] {
    std::random_device random;
    return static_cast<int64_t>(random() & 0xffffff) << 16;
  }()};
  const int64_t rank = rpc::get_worker_info().id;
  return ((rank & 0x7fff) << 48) | (counter.fetch_add(1) & ((int64_t{1} << 48) - 1));
}

// create(id, timeout_ms, kind, names, values, hogwild, rref...) -> id. The caller gives up after timeout_ms: a
// creation still waiting for its parameters' values (RRefs being made) by then is refused, not registered for nobody.
rpc::Future on_create(std::vector<c10::IValue>&& args) {
  const auto arrived = std::chrono::steady_clock::now();
  if (args.size() < 6) throw_error(absl::InvalidArgumentError("malformed optimizer creation"));
  const int64_t id = rpc::from_ivalue<int64_t>(args[0]);
  const auto timeout = std::chrono::milliseconds(rpc::from_ivalue<int64_t>(args[1]));
  const std::string kind = rpc::from_ivalue<std::string>(args[2]);
  auto names = rpc::from_ivalue<std::vector<std::string>>(args[3]);
  auto values = rpc::from_ivalue<std::vector<double>>(args[4]);
  const bool hogwild = rpc::from_ivalue<bool>(args[5]);
  if (names.size() != values.size()) throw_error(absl::InvalidArgumentError("malformed optimizer hyper-parameters"));
  Hyper hyper;
  for (size_t i = 0; i < names.size(); ++i) hyper[names[i]] = values[i];
  std::vector<at::Tensor> params;
  for (size_t i = 6; i < args.size(); ++i) {
    c10::IValue v = rref::RRef::from_ivalue(args[i]).local_value();
    if (!v.isTensor()) throw_error(absl::InvalidArgumentError(absl::StrCat("parameter ", i - 6, " is not a tensor")));
    params.push_back(v.toTensor());
  }
  auto local = std::make_shared<LocalOptimizer>(kind, std::move(params), hogwild, hyper);
  const auto took = std::chrono::steady_clock::now() - arrived;
  const auto* call = rpc::current_call();
  const std::string creator = call ? call->caller_name : "?";
  MutexLock lock(&g_registry_mu);
  const bool released = g_released_early.erase(id) != 0;  // this creation was what it waited for
  // Both refusals reach a caller that has given up already: the log says what happened to its optimizer.
  if (took >= timeout) {
    const std::string why =
        absl::StrCat("optimizer ", id, " of worker '", creator, "' on worker '", rpc::get_worker_info().name,
                     "': its parameters took ", std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                     " ms to be made, past its creator's timeout of ", timeout.count(), " ms: not created");
    TANDEM_LOG(kWarn, "dist_optim") << why;
    throw_error(absl::DeadlineExceededError(why));
  }
  if (released) {
    const std::string why = absl::StrCat("optimizer ", id, " of worker '", creator, "' on worker '",
                                         rpc::get_worker_info().name, "': released by its creator before it was made");
    TANDEM_LOG(kWarn, "dist_optim") << why;
    throw_error(absl::CancelledError(why));
  }
  if (!g_optimizers.emplace(id, std::move(local)).second) {
    throw_error(absl::AlreadyExistsError(
        absl::StrCat("optimizer ", id, " on worker '", rpc::get_worker_info().name, "' exists already")));
  }
  return rpc::Future::ready(c10::IValue(id));
}

ABSL_CONST_INIT Mutex g_probe_mu(absl::kConstInit);
std::atomic<bool> g_probe_set{false};  // a step without a probe takes no lock for it
std::function<void()>& step_probe_slot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_probe_mu) {
  static auto* probe = new std::function<void()>();  // never destroyed: a step may run until exit
  return *probe;
}
std::function<void()> step_probe() {
  if (!g_probe_set.load(std::memory_order_acquire)) return {};
  MutexLock lock(&g_probe_mu);
  return step_probe_slot();
}

void on_step(int64_t id, int64_t context_id) {
  std::shared_ptr<LocalOptimizer> local;
  {
    MutexLock lock(&g_registry_mu);
    auto it = g_optimizers.find(id);
    if (it != g_optimizers.end()) local = it->second;
  }
  if (!local) {
    throw_error(absl::NotFoundError(
        absl::StrCat("no optimizer ", id, " on worker '", rpc::get_worker_info().name, "' (released?)")));
  }
  // No context here means no gradient reached this owner in it: nothing to apply.
  const dist_autograd::Gradients grads =
      dist_autograd::detail::find_gradients(context_id).value_or(dist_autograd::Gradients());
  std::optional<MutexLock> owner;
  if (!local->hogwild) owner.emplace(&g_owner_lock);
  MutexLock lock(&local->mu);
  bool any = false;
  for (size_t i = 0; i < local->params.size(); ++i) {
    at::Tensor g = grads[local->params[i]];
    any |= g.defined();
    local->handles[i].mutable_grad() = g;
  }
  if (any) {
    if (std::function<void()> probe = step_probe()) probe();
    local->optimizer->step();
  }
  for (auto& h : local->handles) h.mutable_grad() = at::Tensor();
}

std::shared_ptr<LocalOptimizer> find_local(int64_t id) {
  MutexLock lock(&g_registry_mu);
  auto it = g_optimizers.find(id);
  if (it != g_optimizers.end()) return it->second;
  throw_error(absl::NotFoundError(
      absl::StrCat("no optimizer ", id, " on worker '", rpc::get_worker_info().name, "' (released?)")));
}

// The optimizer's state as LibTorch saves it, in a byte tensor (tensors travel without a protobuf copy).
at::Tensor on_save_state(int64_t id) {
  std::shared_ptr<LocalOptimizer> local = find_local(id);
  std::ostringstream bytes;
  {
    MutexLock lock(&local->mu);
    torch::serialize::OutputArchive archive;
    local->optimizer->save(archive);
    archive.save_to(bytes);
  }
  const std::string s = bytes.str();
  at::Tensor out = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  std::memcpy(out.data_ptr(), s.data(), s.size());
  return out;
}

void on_load_state(int64_t id, at::Tensor bytes) {
  std::shared_ptr<LocalOptimizer> local = find_local(id);
  bytes = bytes.contiguous();
  if (bytes.scalar_type() != at::kByte) throw_error(absl::InvalidArgumentError("optimizer state: not bytes"));
  MutexLock lock(&local->mu);
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
    local->optimizer->load(archive);
  } catch (const c10::Error& e) {
    throw_error(absl::FailedPreconditionError(
        absl::StrCat("the saved optimizer state does not fit this optimizer: ", e.what_without_backtrace())));
  }
}

bool install() {
  throw_if_error(rpc::register_handler(kCreate, on_create));
  rpc::register_function(kSaveState, on_save_state);
  rpc::register_function(kLoadState, on_load_state);
  rpc::register_function(kStep, on_step);
  rpc::register_function(kRelease, [](std::vector<int64_t> ids) {  // from rpc::detail::releases()
    MutexLock lock(&g_registry_mu);
    for (int64_t id : ids) {
      if (g_optimizers.erase(id) == 0) add_released_early(id);
    }
  });
  rpc::add_stop_hook([] {
    MutexLock lock(&g_registry_mu);
    g_optimizers.clear();
    g_released_early.clear();
    g_released_order.clear();
  });
  return true;
}

const bool g_installed = install();

}  // namespace

DistributedOptimizer::DistributedOptimizer(const std::string& kind, const std::vector<rref::RRef>& parameters,
                                           const std::map<std::string, double>& hyper,
                                           DistributedOptimizerOptions options)
    : options_(options) {
  (void)g_installed;
  std::vector<std::string> names;
  std::vector<double> values;
  for (const auto& [k, v] : hyper) {
    names.push_back(k);
    values.push_back(v);
  }
  const std::chrono::milliseconds timeout = options.timeout.count() > 0 ? options.timeout : rpc::default_timeout();
  // One id on every owner, chosen here: if the creation fails anywhere (or times out while an owner still waits for
  // its parameters), every owner asked is told to release it, including those whose creation is still under way.
  const int64_t id = next_id();
  std::map<int, std::vector<c10::IValue>> by_owner;
  for (const auto& p : parameters) {
    auto& args = by_owner[p.owner()];
    if (args.empty()) {
      args = {c10::IValue(id),        c10::IValue(static_cast<int64_t>(timeout.count())),
              c10::IValue(kind),      rpc::to_ivalue(names),
              rpc::to_ivalue(values), c10::IValue(options.hogwild)};
    }
    args.push_back(p.to_ivalue());
  }
  std::vector<std::pair<int, rpc::Future>> created;
  for (auto& [owner, args] : by_owner) created.emplace_back(owner, rpc::call(owner, kCreate, args, timeout));
  std::string errors;
  absl::StatusCode code = absl::StatusCode::kOk;  // the first owner's: every owner's error is named, one code is kept
  for (auto& [owner, f] : created) {
    const absl::Status s = f.status();
    // An owner that has another optimizer under this id (ALREADY_EXISTS: a restarted caller met its predecessor's)
    // keeps it: the release below goes to every other owner asked.
    if (s.code() != absl::StatusCode::kAlreadyExists) remote_.emplace_back(owner, id);
    if (!s.ok()) {
      errors += std::string(errors.empty() ? "" : "; ") + std::string(s.message());
      if (code == absl::StatusCode::kOk) code = s.code();
    }
  }
  if (!errors.empty()) {
    release();  // on every owner asked: those that made it drop it, those still making it refuse it
    throw_error(absl::Status(code, "DistributedOptimizer: " + errors));
  }
}

DistributedOptimizer::~DistributedOptimizer() { release(); }

void detail::with_owner_lock(const std::function<void()>& f) {
  MutexLock lock(&g_owner_lock);
  f();
}

void detail::set_step_probe(std::function<void()> probe) {
  MutexLock lock(&g_probe_mu);
  g_probe_set.store(static_cast<bool>(probe), std::memory_order_release);
  step_probe_slot() = std::move(probe);
}

int64_t owned_optimizer_count() {
  MutexLock lock(&g_registry_mu);
  return static_cast<int64_t>(g_optimizers.size());
}

void DistributedOptimizer::release() {
  if (!rpc::is_initialized()) return;
  // Not waited for (failures are logged): if RPC is shutting down meanwhile, the owners drop their optimizers when
  // they stop.
  for (const auto& [owner, id] : remote_) rpc::detail::releases().add(owner, kRelease, {id});
  remote_.clear();
}

rpc::Future DistributedOptimizer::step_async(int64_t context_id) {
  std::vector<rpc::Future> steps;
  steps.reserve(remote_.size());
  for (const auto& [owner, id] : remote_)
    steps.push_back(rpc::rpc_async(owner, kStep, id, context_id, options_.timeout));
  return rpc::when_all(steps);
}

void DistributedOptimizer::step(int64_t context_id) {
  // Other owners' steps start first and run while this worker steps its own parameters in place (no RPC to itself);
  // the last remote step is a synchronous call (on the direct channel this thread reads its own reply).
  const int self = rpc::get_worker_info().id;
  std::vector<std::pair<int, int64_t>> others;
  std::vector<int64_t> mine;
  for (const auto& [owner, id] : remote_) {
    if (owner == self) {
      mine.push_back(id);
    } else {
      others.emplace_back(owner, id);
    }
  }
  std::vector<rpc::Future> steps;
  for (size_t i = 0; i + 1 < others.size(); ++i) {
    steps.push_back(rpc::rpc_async(others[i].first, kStep, others[i].second, context_id, options_.timeout));
  }
  std::vector<absl::Status> failed;  // every owner's failure is named; the first one's code is kept
  for (int64_t id : mine) {
    try {
      on_step(id, context_id);
    } catch (...) {  // as the same step on another owner would report it
      const absl::Status thrown = status_from_current_exception();
      failed.push_back(absl::Status(thrown.code(), absl::StrCat("optimizer step on worker '",
                                                                rpc::get_worker_info().name, "': ", thrown.message())));
    }
  }
  if (!others.empty()) {
    const auto& [owner, id] = others.back();
    steps.push_back(rpc::call_and_wait(owner, kStep, {c10::IValue(id), c10::IValue(context_id)}, options_.timeout));
  }
  for (const auto& f : steps) {
    if (!f.status().ok()) failed.push_back(f.status());
  }
  if (failed.size() == 1) throw_error(failed[0]);
  if (!failed.empty()) {
    std::string errors;
    for (const absl::Status& s : failed) errors += std::string(errors.empty() ? "" : "; ") + std::string(s.message());
    throw_error(absl::Status(failed[0].code(), absl::StrCat("DistributedOptimizer: ", failed.size(), " of ",
                                                            mine.size() + others.size(), " steps failed: ", errors)));
  }
}

void DistributedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  std::vector<rpc::Future> states;
  std::vector<int64_t> owners;
  for (const auto& [owner, id] : remote_) {
    owners.push_back(owner);
    states.push_back(rpc::rpc_async(owner, kSaveState, id, options_.timeout));
  }
  archive.write("owners", at::tensor(owners, at::kLong), /*is_buffer=*/true);
  for (size_t i = 0; i < states.size(); ++i) {
    throw_if_error(states[i].status());
    archive.write("state_" + std::to_string(i), states[i].get<at::Tensor>(), /*is_buffer=*/true);
  }
}

void DistributedOptimizer::load(torch::serialize::InputArchive& archive) {
  at::Tensor owners;
  archive.read("owners", owners, /*is_buffer=*/true);
  std::vector<int64_t> mine;
  for (const auto& [owner, id] : remote_) mine.push_back(owner);
  if (owners.numel() != static_cast<int64_t>(mine.size()) || !owners.equal(at::tensor(mine, at::kLong))) {
    throw_error(absl::FailedPreconditionError(absl::StrCat(
        "DistributedOptimizer: the saved state is of owners ",
        absl::StrJoin(std::vector<int64_t>(owners.data_ptr<int64_t>(), owners.data_ptr<int64_t>() + owners.numel()),
                      ","),
        "; this optimizer's are ", absl::StrJoin(mine, ","))));
  }
  std::vector<rpc::Future> loads;
  for (size_t i = 0; i < remote_.size(); ++i) {
    at::Tensor state;
    archive.read("state_" + std::to_string(i), state, /*is_buffer=*/true);
    loads.push_back(rpc::rpc_async(remote_[i].first, kLoadState, remote_[i].second, state, options_.timeout));
  }
  for (const auto& f : loads) throw_if_error(f.status());
}

}  // namespace tandem::dist_optim
