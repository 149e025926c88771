// The public functions of rpc/rpc.h, over the process-wide agent (rpc/detail/agent.h).
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif
#include <grpcpp/impl/codegen/service_type.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/direct_transport.h"  // complete types for deleting the agent
#include "tandem/rpc/detail/fault_transport.h"
#include "tandem/rpc/detail/grpc_transport.h"
#include "tandem/rpc/detail/ids.h"
#include "tandem/rpc/detail/standby.h"
#include "tandem/rpc/detail/wait_slice.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/rpc.h"
#include "tandem/sync/sync.h"

#include "tandem/cluster/environment.h"
#include "tandem/log/log.h"
#include "tandem/metrics/metrics.h"

namespace tandem::rpc {
namespace {

// A warm standby started by tandem-run waits here, before main, for the environment of the worker it becomes
// (rpc/detail/standby.h). First among the program's own initializers; LibTorch and the other libraries have loaded.
__attribute__((constructor(101))) void standby_hook() { detail::wait_for_activation(); }

using detail::Agent;

// Never destroyed: a function still running on a leaked agent's thread (a call whose caller gave up) may reach them
// after main returned and static destruction began; ThreadSanitizer saw that lock race the mutex's destructor.
Mutex& g_mu = *new Mutex;
std::shared_ptr<Agent>& g_agent ABSL_GUARDED_BY(g_mu) = *new std::shared_ptr<Agent>;

std::shared_ptr<Agent> current_agent() {
  MutexLock lock(&g_mu);
  return g_agent;
}

std::shared_ptr<Agent> require_agent() {
  auto agent = current_agent();
  if (!agent) throw RpcError(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent;
}

// A stopped agent whose threads did not finish is leaked on purpose: deleting it under them would be worse.
void dispose(std::shared_ptr<Agent>& agent) {
  if (!agent) return;
  if (!agent->stopped_cleanly()) {
    auto* kept = new std::shared_ptr<Agent>(std::move(agent));
#if defined(__SANITIZE_ADDRESS__)
    __lsan_ignore_object(kept);  // on purpose, so not a leak report (and a failed exit) under LeakSanitizer
#else
    (void)kept;
#endif
    return;
  }
  agent.reset();
}

void at_exit_shutdown() {
  std::shared_ptr<Agent> agent;
  {
    MutexLock lock(&g_mu);
    agent = std::move(g_agent);
    detail::set_self_rank(-1);
  }
  if (agent) {
    (void)agent->shutdown(/*graceful=*/false);
    dispose(agent);
    for (const auto& hook : detail::stop_hooks()) hook();
  }
  metrics::stop_writer();  // its last write, and no thread left running into the exit
}

// exit() destroys the calling thread's thread_locals before it runs any atexit handler or static destructor (glibc's
// __call_tls_dtors; C++ [basic.start.term]). So a guard on the main thread stops RPC while every static is alive, also
// those first built after init_rpc (a function-local static of a registered function, LibTorch's), whose destructors
// run before an atexit handler registered by init_rpc: the agent's threads ran on into them (SIGSEGV in exit).
struct StopRpcAtMainThreadExit {
  ~StopRpcAtMainThreadExit() { at_exit_shutdown(); }
};

WorkerInfo worker_info(const To& to) {
  auto agent = require_agent();
  auto r = agent->resolve(to);
  throw_if_error(r.status());
  return agent->info(*r);
}

}  // namespace

namespace {

// `option` when it is at least 0, else the environment's `env` (microseconds), else `fallback`.
std::chrono::microseconds micros_from(std::chrono::microseconds option, const char* env_name, int64_t fallback) {
  if (option.count() >= 0) return option;
  const char* env = std::getenv(env_name);
  if (!env || !*env) return std::chrono::microseconds(fallback);
  int64_t us = 0;
  if (absl::SimpleAtoi(env, &us) && us >= 0) return std::chrono::microseconds(us);
  TANDEM_LOG(kWarn, "rpc") << env_name << "='" << env << "' is not a number of microseconds >= 0: using " << fallback;
  return std::chrono::microseconds(fallback);
}

// RpcOptions::metrics_file, else TANDEM_METRICS_FILE; the interval likewise (10 s when neither says).
void start_metrics_writer(const RpcOptions& options, const std::string& name, int rank) {
  std::string path = options.metrics_file;
  if (path.empty()) {
    const char* env = std::getenv("TANDEM_METRICS_FILE");
    path = env ? env : "";
  }
  if (path.empty()) return;
  std::chrono::milliseconds interval = options.metrics_interval;
  if (interval.count() <= 0) {
    int64_t ms = 0;
    const char* env = std::getenv("TANDEM_METRICS_INTERVAL_MS");
    interval = env && absl::SimpleAtoi(env, &ms) && ms > 0 ? std::chrono::milliseconds(ms) : std::chrono::seconds(10);
  }
  metrics::start_writer(path, interval, name, rank);
}

}  // namespace

void init_rpc(const std::string& name, int rank, int world_size, RpcOptions options) {
  // Debian's abseil is built without NDEBUG, so every Mutex::Lock runs its deadlock detection (a lookup in one global
  // graph under a spin lock, and a node made and forgotten for each mutex): a few microseconds of each small call.
  // Off, as in abseil's release builds; the tests keep it on (tests/common/spawner.cc).
  if (const char* check = std::getenv("TANDEM_LOCK_ORDER_CHECK"); !check || std::string(check) != "1") {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  MutexLock lock(&g_mu);
  if (g_agent) throw RpcError(absl::FailedPreconditionError("init_rpc: RPC is already initialized"));
  metrics::set_worker(name);
  profile::set_worker(name, rank);
  detail::set_wait_slice(micros_from(options.wait_slice, "TANDEM_WAIT_SLICE_US", 100));  // before the agent's threads
  options.serve_spin = micros_from(options.serve_spin, "TANDEM_SERVE_SPIN_US", 50);
  auto agent = Agent::start(name, rank, world_size, options);
  if (!agent.ok()) detail::set_wait_slice(std::chrono::microseconds(0));
  throw_if_error(agent.status());
  g_agent = std::shared_ptr<Agent>(std::move(*agent));
  detail::set_self_rank(rank);  // before set_ready: the first calls served may use it
  g_agent->set_ready();
  start_metrics_writer(options, name, rank);
  if (::syscall(SYS_gettid) == ::getpid()) {  // the main thread: main() returns, or it calls exit()
    thread_local StopRpcAtMainThreadExit stop_first;
    (void)stop_first;
  }
  // The fallback for exit() called on another thread, or init_rpc called only off the main thread; nothing to do
  // once the guard above has stopped RPC.
  static bool registered = (std::atexit(at_exit_shutdown), true);
  (void)registered;
}

void init_rpc(RpcOptions options) {
  auto place = cluster::worker_place();
  if (!place.ok()) throw RpcError(absl::InvalidArgumentError(absl::StrCat("init_rpc: ", place.status().message())));
  if (options.master_addr.empty()) options.master_addr = place->master_addr;
  if (options.master_port < 0) options.master_port = place->master_port;
  init_rpc(absl::StrCat("worker", place->rank), place->rank, place->world_size, std::move(options));
}

void shutdown(bool graceful) {
  // The agent stays published while it drains and waits at the barrier: it keeps serving peers' calls until then, and
  // their functions may use this API.
  std::shared_ptr<Agent> agent = current_agent();
  if (!agent) return;
  absl::Status s = agent->shutdown(graceful);
  {
    MutexLock lock(&g_mu);
    if (g_agent == agent) {
      g_agent.reset();
      detail::set_self_rank(-1);
      detail::set_wait_slice(std::chrono::microseconds(0));
    }
  }
  dispose(agent);
  for (const auto& hook : detail::stop_hooks()) hook();
  metrics::stop_writer();  // after the last write of this job's figures
  throw_if_error(s);
}

bool is_initialized() { return current_agent() != nullptr; }

std::chrono::milliseconds default_timeout() {
  auto agent = current_agent();
  return agent ? agent->rpc_timeout() : RpcOptions().rpc_timeout;
}

std::optional<WorkerInfo> find_worker_info(const To& to) {
  auto agent = current_agent();
  if (!agent) return std::nullopt;
  auto r = agent->resolve(to);
  if (!r.ok()) return std::nullopt;
  return agent->info(*r);
}

WorkerInfo get_worker_info() { return require_agent()->self(); }

Store& job_store() { return require_agent()->store(); }

WorkerInfo get_worker_info(const std::string& name) { return worker_info(To(name)); }

WorkerInfo get_worker_info(int id) { return worker_info(To(id)); }

std::vector<WorkerInfo> get_all_worker_infos() { return require_agent()->workers(); }

Future call(const To& to, const std::string& function, std::vector<c10::IValue> args,
            std::chrono::milliseconds timeout) {
  auto agent = current_agent();
  if (!agent) return Future::failed(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent->call(to, function, std::move(args), timeout);
}

Future call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args,
                     std::chrono::milliseconds timeout) {
  auto agent = current_agent();
  if (!agent) return Future::failed(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent->call_and_wait(to, function, std::move(args), timeout);
}

Future send(const To& to, const std::string& function, std::vector<c10::IValue> args,
            std::chrono::milliseconds timeout) {
  auto agent = current_agent();
  if (!agent) return Future::failed(absl::FailedPreconditionError("RPC is not initialized: call init_rpc first"));
  return agent->send(to, function, std::move(args), timeout);
}

TransportStats transport_stats() { return require_agent()->stats(); }

std::string transport_to(const To& to) {
  auto agent = require_agent();
  auto r = agent->resolve(to);
  throw_if_error(r.status());
  return agent->route(*r);
}

}  // namespace tandem::rpc
