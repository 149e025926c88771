// Tandem RPC: workers of one job calling each other's registered functions.
//
//   tandem::rpc::register_function("add", [](at::Tensor a, at::Tensor b) { return a + b; });
//   tandem::rpc::init_rpc();                                   // torchrun environment (tandem-run sets it)
//   at::Tensor c = tandem::rpc::rpc_sync<at::Tensor>("worker1", "add", a, b);
//   tandem::rpc::Future f = tandem::rpc::rpc_async("worker1", "add", a, b, std::chrono::milliseconds(500));
//   tandem::rpc::shutdown();                                   // all workers leave together
//
// Arguments are converted with rpc/convert.h. A trailing std::chrono::duration argument is the call's timeout (it is
// not sent); without it the call uses RpcOptions::rpc_timeout.
//
// Errors. rpc_sync and every synchronous function here throw tandem::Error (rpc/errors.h; RpcError is the same type);
// a Future carries the same absl::Status. call, call_and_wait and rpc_async never throw: every failure of a call, also
// of encoding its arguments, is in the returned future. The message names the worker, the function and the cause
// (docs/errors.md has every condition and its code):
//   UNAVAILABLE          the peer died or is unreachable
//   DEADLINE_EXCEEDED    no reply within the call's timeout
//   CANCELLED            RPC was shut down (or is shutting down) on this worker
//   NOT_FOUND            no function of that name is registered on the callee; no worker of that name or rank
//   INVALID_ARGUMENT     the arguments or the result did not convert, or a message was malformed
//   UNKNOWN              the function threw (any exception but tandem::Error); the message is the exception's
//   UNAUTHENTICATED      the peer does not share this job's secret
//   RESOURCE_EXHAUSTED   a message over RpcOptions::max_message_bytes
// A tandem::Error the function throws (e.g. from a nested call) keeps its code and message.
// Every call completes (value or error) by its deadline; nothing in this API waits without one.
//
// Thread-safety: after init_rpc returns, every function may be called from any thread, including from inside registered
// functions (nested calls). init_rpc and shutdown are not to be called concurrently with each other.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/rpc/convert.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/fault_injection.h"
#include "tandem/rpc/future.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/tls.h"

namespace tandem::rpc {

struct WorkerInfo {
  std::string name;
  int id = -1;          // the rank
  std::string address;  // host:port of its server
};

struct RpcOptions {
  // Rendezvous: rank 0 serves the job's store at master_addr:master_port. Empty / -1: MASTER_ADDR / MASTER_PORT.
  std::string master_addr;
  int master_port = -1;
  // The job secret shared by all workers. Empty: TANDEM_SECRET, else the file named by TANDEM_SECRET_FILE. A job of one
  // worker without a secret gets a random one.
  std::string secret;
  // TLS for every connection of the job (all workers must agree). Unset: from TANDEM_TLS_CERT, TANDEM_TLS_KEY and
  // TANDEM_TLS_CA (all three, else init_rpc fails naming the missing ones) and TANDEM_TLS_SERVER_NAME (optional: the
  // target_name_override); none of them set: no TLS.
  std::optional<TlsOptions> tls;

  // The default per call, and of every other timeout left unset (default_timeout(); docs/errors.md lists them).
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds init_timeout{std::chrono::seconds(120)};     // rendezvous
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(30)};  // graceful shutdown barrier and drain

  // Threads running registered functions (nested rpc_sync calls hold one each). Of the direct channel's, only as
  // many as the CPUs the process may use (its affinity and container quota: cluster/cpus.h) run at once, unless some
  // block (docs/rpc.md, "Threads").
  int num_worker_threads = 16;
  int64_t max_message_bytes = int64_t{1} << 30;  // larger messages are refused, in both directions

  // Host this worker's server binds and advertises. Empty: the address it uses to reach the master (127.0.0.1 when the
  // master is on loopback).
  std::string listen_host;

  // How calls travel. "auto": to a peer on the same host (same kernel boot, reachable socket) over the direct channel
  // (docs/rpc.md), with large request tensors read straight from the caller's memory; to a peer on another host over
  // the direct channel's TCP listener (raw frames, authenticated by a challenge, no HTTP/2), else over gRPC (the job's
  // store and control always use gRPC). "grpc": every peer over gRPC. Empty: TANDEM_TRANSPORT, else "auto". With TLS,
  // every peer uses gRPC (the direct channel is not encrypted).
  std::string transport;
  // On the direct channel, request tensors of at least this many bytes are read from the caller's memory by the callee
  // (one copy, by the kernel) instead of travelling through the socket. 0 turns the bulk path off. The default is where
  // the two paths met when measured (`bench/run.sh bulk-threshold`): below it the socket is faster.
  int64_t bulk_min_bytes = int64_t{3} << 19;  // 1.5 MiB
  // On the direct channel, a thread blocked in rpc_sync polls for its reply this long before it sleeps: a quick reply
  // then costs no thread wake-up (tens of microseconds on a VM). It spends at most this much CPU per call, and none
  // when the last call of the same function to the same worker took over four times as long (but for one such call
  // in 16 of a thread, which spins to find out whether it still needs to). 0: never.
  std::chrono::microseconds sync_spin{50};
  // On the direct channel, a thread that has served a call polls for the next one this long before it sleeps (one
  // thread at a time, yielding its core between looks): a caller whose next call follows its reply at once (a loop of
  // rpc_sync) then wakes no thread here either. After 8 polls in a row that found nothing, only one in 16 is made
  // until one finds a call again, so a worker whose calls come further apart spends next to no CPU on it; after a call
  // that took over four times this long (a forward pass) the thread sleeps at once. 0: never.
  // Negative (the default): TANDEM_SERVE_SPIN_US, else 50 us.
  std::chrono::microseconds serve_spin{-1};
  // A thread that sleeps waiting for a reply (rpc_sync after its spin, a Future's wait) first asks the kernel for this
  // time slice, once, and keeps it (also after shutdown; threads it starts later inherit it): on Linux 6.12 and later
  // (EEVDF custom slices) it then runs at once when a reply comes, instead of queueing behind a busy thread for the
  // rest of that one's slice (milliseconds; a parameter server's trainer sharing the cores with it waited ~400 us per
  // step for a CPU). It gets no more CPU for it. Older kernels, threads with a policy other than SCHED_OTHER or with a
  // slice as short of their own: nothing changes. RPC's threads that run functions never take it. 0: never. The
  // kernel takes 0.1-100 ms. Negative: TANDEM_WAIT_SLICE_US, else 100 us (docs/rpc.md, "Woken at once").
  std::chrono::microseconds wait_slice{-1};

  // A file this worker keeps its metrics in (metrics/metrics.h; Prometheus text format), rewritten every
  // metrics_interval and at shutdown; "{worker}" and "{rank}" in it are replaced. Empty: TANDEM_METRICS_FILE, else
  // none. metrics_interval 0: TANDEM_METRICS_INTERVAL_MS, else 10 s.
  std::string metrics_file;
  std::chrono::milliseconds metrics_interval{0};

  // For tests: faults injected into the messages this worker sends (rpc/fault_injection.h). Empty: none.
  std::vector<FaultRule> faults;
};

// Joins the job as worker `name` with `rank` of `world_size`, after every worker has joined (or init_timeout, then
// throws naming the missing ranks). Names must be unique. Throws RpcError when already initialized.
// It also turns off abseil's lock-order (deadlock) checking in this process, as a release build of abseil has it
// (Debian's runs it on every lock: a global graph lookup per Mutex::Lock), unless TANDEM_LOCK_ORDER_CHECK=1 (the
// test binaries set it: there an inversion aborts with both stacks).
void init_rpc(const std::string& name, int rank, int world_size, RpcOptions options = {});
// Reads the launcher's environment (cluster/environment.h, worker_place): torchrun's RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT (tandem-run sets them), else SLURM's when srun started this process (SLURM_PROCID, SLURM_NTASKS, the
// first host of SLURM_JOB_NODELIST, a port from SLURM_JOB_ID); options' master_addr/master_port, when set, win. The
// name is "worker<rank>". Throws RpcError (InvalidArgument) naming a missing or malformed variable.
void init_rpc(RpcOptions options = {});

// graceful=true: waits for this worker's outstanding calls, then for every worker to arrive (a barrier with
// shutdown_timeout), then for calls from clients outside the job still running here (at most min(shutdown_timeout,
// 2 s)), then stops serving; throws RpcError naming the workers that did not arrive (after stopping
// anyway). graceful=false: fails outstanding calls with CANCELLED and stops at once. Either way the worker can init_rpc
// again. A process that ends with RPC initialized (main returns, or exit() on the main thread) stops it as
// shutdown(false) does, before any static object is destroyed (the agent's threads never run into a destroyed one);
// so does the main thread's pthread_exit (its thread_locals end), while the process runs on.
void shutdown(bool graceful = true);
bool is_initialized();
// The initialized worker's RpcOptions::rpc_timeout: the default of every timeout the user did not set (calls, RRefs,
// distributed autograd, collectives, pipelines). 60 s (RpcOptions' default) when RPC is not initialized.
std::chrono::milliseconds default_timeout();

WorkerInfo get_worker_info();  // this worker
WorkerInfo get_worker_info(const std::string& name);
WorkerInfo get_worker_info(int id);
std::vector<WorkerInfo> get_all_worker_infos();

// The destination of a call: a worker's name, its rank, or its WorkerInfo.
class To {
 public:
  To(const std::string& name) : name_(name) {}  // NOLINT: implicit by design
  To(const char* name) : name_(name) {}         // NOLINT
  To(int rank) : rank_(rank) {}                 // NOLINT
  To(const WorkerInfo& w) : rank_(w.id) {}      // NOLINT
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }

 private:
  std::string name_;
  int rank_ = -1;
};

// The worker `to` names; nullopt when there is none, or RPC is not initialized (it may be shutting down meanwhile).
// Never throws: for error paths that only want a name, and for checks that are not failures.
std::optional<WorkerInfo> find_worker_info(const To& to);

// The type-erased call behind rpc_async. A non-positive timeout means the default.
Future call(const To& to, const std::string& function, std::vector<c10::IValue> args,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
// The same, returning only once the call has completed (the future is completed). Behind rpc_sync: on the direct
// channel the calling thread reads its own reply, which saves a thread hand-off per call.
Future call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args,
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

// One-way: runs `function` on `to` without a reply. The future completes (with None) once the request was handed to
// the connection to `to` (nothing orders its run on `to` against other calls and sends), or fails with the
// errors of call() (UNAVAILABLE: the worker is unreachable or its connection broke; CANCELLED; DEADLINE_EXCEEDED: it
// could not be written by the timeout). What the function returns is dropped there; when it fails, the failure is
// counted and written to stderr on `to` (TransportStats::oneway_failures), never sent back. Tensors large enough for
// the same-host bulk path (RpcOptions::bulk_min_bytes) still go by reference: the callee then answers with an empty
// reply as soon as it has read the arguments (before the function runs), and the future completes when it came. Over
// gRPC (no one-way message) it is likewise a call answered once the arguments are read. Arguments holding RRefs are
// not for one-way calls. For protocols whose receivers owe no answer, such as a pipeline's activations: the sender
// learns of a lost receiver by other means (its own deadline, or a call that does reply).
Future send(const To& to, const std::string& function, std::vector<c10::IValue> args,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

// Which transport calls to `to` use: "direct" (Unix socket, same host), "tcp" (the direct channel to another host) or
// "grpc" (see RpcOptions::transport).
std::string transport_to(const To& to);

// The job's rendezvous store (rpc/store.h), for layers that set up more connections (collectives). Valid between
// init_rpc and shutdown; throws RpcError otherwise.
class Store;
Store& job_store();

// Counts of this worker's outgoing calls since init_rpc, by path (for tests, debugging and benchmarks' conditions).
struct TransportStats {
  int64_t grpc_calls = 0;
  int64_t direct_calls = 0;
  int64_t tensors_by_reference = 0;  // request tensors the callee read from this process's memory
  // One-way calls (send) received by this worker whose function failed or could not run; each is also written to
  // this process's stderr, naming the caller, the function and the cause (nobody waits for its reply).
  int64_t oneway_failures = 0;
  // One-way calls of messages (register_message) the direct channel brought and this worker ran inline.
  int64_t inline_messages = 0;
  // The direct channel's places (docs/rpc.md, "Threads"): how often a function or reply it ran blocked in a Tandem
  // wait and lent its thread's place, and how often one was presumed blocked out of Tandem's sight (no message done
  // on any place for 2 x 5 ms while another waited: a sleep, a std::mutex...; each such stall delays other calls).
  int64_t places_lent = 0;
  int64_t presumed_blocked = 0;
  // Calls received here refused because their caller had let go of the tensors it sent by reference before they
  // were read (its call had ended: timed out or cancelled; rpc/detail/lease.h): not run.
  int64_t leases_lapsed = 0;
  // rpc_sync calls let poll for their reply before they sleep (RpcOptions::sync_spin; only the direct channel polls):
  // not those whose function's last reply took far longer than the spin, which sleep at once.
  int64_t sync_calls_spun = 0;
  // Polls for the next message by the direct channel's thread that served the last one (RpcOptions::serve_spin), and
  // how many found one (the poller took it without sleeping; another thread asleep in the set may still be woken).
  int64_t serve_spins = 0;
  int64_t serve_spin_hits = 0;
};
TransportStats transport_stats();

namespace detail {
template <typename T>
struct IsDuration : std::false_type {};
template <typename R, typename P>
struct IsDuration<std::chrono::duration<R, P>> : std::true_type {};

template <typename A>
void append_arg(std::vector<c10::IValue>& args, std::chrono::milliseconds& timeout, A&& a) {
  if constexpr (IsDuration<std::decay_t<A>>::value) {
    timeout = std::chrono::duration_cast<std::chrono::milliseconds>(a);
  } else {
    args.push_back(to_ivalue(std::forward<A>(a)));
  }
}

// A call's arguments as sent, and its timeout (a trailing duration argument; 0: the default).
struct Packed {
  std::vector<c10::IValue> values;
  std::chrono::milliseconds timeout{0};
};
template <typename... Args>
Packed pack(Args&&... args) {
  Packed p;
  p.values.reserve(sizeof...(Args));
  (append_arg(p.values, p.timeout, std::forward<Args>(args)), ...);
  return p;
}

// The value of a completed call as R (nothing for void).
template <typename R>
R result_as(const Future& f) {
  if constexpr (std::is_void_v<R>) {
    f.value();
  } else {
    return f.get<R>();
  }
}
}  // namespace detail

template <typename... Args>
Future rpc_async(const To& to, const std::string& function, Args&&... args) {
  detail::Packed p = detail::pack(std::forward<Args>(args)...);
  return call(to, function, std::move(p.values), p.timeout);
}

// send() with rpc_async's arguments (a trailing duration is the timeout).
template <typename... Args>
Future rpc_oneway(const To& to, const std::string& function, Args&&... args) {
  detail::Packed p = detail::pack(std::forward<Args>(args)...);
  return send(to, function, std::move(p.values), p.timeout);
}

template <typename R = c10::IValue, typename... Args>
R rpc_sync(const To& to, const std::string& function, Args&&... args) {
  detail::Packed p = detail::pack(std::forward<Args>(args)...);
  return detail::result_as<R>(call_and_wait(to, function, std::move(p.values), p.timeout));
}

}  // namespace tandem::rpc
