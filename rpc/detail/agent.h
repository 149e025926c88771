// The RPC runtime behind rpc/rpc.h: one Agent per process while RPC is initialized.
//
// The agent encodes calls into frames (rpc/detail/wire.h), hands them to a Transport (rpc/transport.h) chosen per peer
// at rendezvous, and decodes replies; it receives requests from every transport, runs the registered function and
// answers each exactly once. It does not know how a frame travels. Files:
//   rpc/rendezvous.cc     start-up: options, transports, the store, the rendezvous record, routes per peer
//   rpc/agent_server.cc   incoming calls: decode, run the function, reply
//   rpc/agent_client.cc   outgoing calls: encode, send on the peer's route, decode the reply
//   rpc/agent.cc          graceful and immediate shutdown
//   rpc/rpc.cc            the public functions of rpc/rpc.h and the process-wide agent
//
// Threads:
//   - Transports' threads deliver incoming requests (on_incoming) and complete outgoing calls (DoneFn). gRPC's never
//   run
//     a registered function: those go to pool_. The direct channel's worker threads run them on the spot.
//   - pool_ runs registered functions. A function returning a pending Future releases its thread; the reply is sent by
//     whichever thread completes that Future.
//
// Every incoming call is an InCall answered exactly once (finish_once), with the reply or, at shutdown, with CANCELLED.
// Every outgoing call is counted in outstanding_ until its transport completes it, by its deadline at the latest.
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/metrics/metrics.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/detail/direct_transport.h"
#include "tandem/rpc/detail/fault_transport.h"
#include "tandem/rpc/detail/grpc_transport.h"
#include "tandem/rpc/detail/lease.h"
#include "tandem/rpc/detail/thread_pool.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rpc/store.h"
#include "tandem/rpc/transport.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::detail {

// The record rank `rank` published at rendezvous (the store's worker/<rank>), checked: this build's wire version
// (FAILED_PRECONDITION naming both otherwise), the rank, a valid name and address, the same world size.
absl::StatusOr<tandem::wire::WorkerRecord> parse_record(const std::string& bytes, int rank, int world_size);

class Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> start(const std::string& name, int rank, int world_size,
                                                      const RpcOptions& options);
  ~Agent();

  Future call(const To& to, const std::string& function, std::vector<c10::IValue> args,
              std::chrono::milliseconds timeout);
  Future call_and_wait(const To& to, const std::string& function, std::vector<c10::IValue> args,
                       std::chrono::milliseconds timeout);
  Future send(const To& to, const std::string& function, std::vector<c10::IValue> args,
              std::chrono::milliseconds timeout);
  absl::Status shutdown(bool graceful);

  // RpcOptions::rpc_timeout: the default of every timeout left unset (rpc::default_timeout()).
  std::chrono::milliseconds rpc_timeout() const { return options_.rpc_timeout; }
  const WorkerInfo& self() const { return peers_[rank_].info; }
  Store& store() { return *store_; }
  const WorkerInfo& info(int rank) const { return peers_[rank].info; }
  std::vector<WorkerInfo> workers() const;
  absl::StatusOr<int> resolve(const To& to) const;
  const char* route(int peer) const { return peers_[peer].transport->kind_for(peer); }
  TransportStats stats() const {
    const direct::Channel::PlaceCounts places = direct_ ? direct_->place_counts() : direct::Channel::PlaceCounts{};
    return {grpc_calls_.load(),      direct_calls_.load(), by_reference_.load(),    oneway_failures_.load(),
            inline_messages_.load(), places.lent,          places.presumed_blocked, leases_lapsed_.load(),
            sync_calls_spun_.load(), places.serve_spins,   places.serve_spin_hits};
  }

  // True when everything outstanding was released (safe to delete).
  bool stopped_cleanly() const { return stopped_cleanly_; }
  // Called once init_rpc has published this agent: calls that arrived during rendezvous run from now on.
  void set_ready() {
    if (!ready_.HasBeenNotified()) ready_.Notify();
  }

 private:
  // An incoming call, whichever transport brought it.
  struct InCall {
    Incoming in;
    int caller = -1;       // the caller's rank, once the request is parsed (for value codecs of the reply)
    bool traced = false;   // the request carried a call tracer's attachment
    std::string function;  // once the request is parsed (a one-way call's failure names it)
    std::string caller_name;
    bool oneway = false;  // the request says so (rpc::send), whichever transport brought it
    // A client's call (outside the job), once the request is parsed: a graceful shutdown lets it finish (shutdown).
    std::atomic<bool> client{false};
    bool failed = false;  // answered with an error (for the metrics)
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    std::shared_ptr<void> trace_state;  // what the tracer keeps for this call
    Mutex mu;                           // makes "send the reply" one step against a concurrent stop()
    bool finished ABSL_GUARDED_BY(mu) = false;
  };
  // The way back to the agent for completions that may come after it is gone: a registered function's future may be
  // completed by the user's own thread at any time, even after shutdown destroyed the agent (its call was answered
  // CANCELLED by then). Such callbacks hold the lifeline, not the agent, and reach the agent only between enter() and
  // leave(); the destructor cuts it and waits for the callbacks inside. Atomics, not a lock: these callbacks run under
  // whatever locks the code completing the future holds, and a lock here would join every lock order in the program.
  class Lifeline {
   public:
    explicit Lifeline(Agent* agent) : agent_(agent) {}
    // The agent, or nullptr once cut; a non-null result must be given back with leave().
    Agent* enter() {
      inside_.fetch_add(1);  // sequentially consistent with cut(): either cut() sees us inside, or we see it cut
      if (!alive_.load()) {
        leave();
        return nullptr;
      }
      return agent_;
    }
    void leave() { inside_.fetch_sub(1); }
    // After this, enter() returns nullptr; waits for the callbacks inside (replies: bounded by their sends' deadlines).
    void cut() {
      alive_.store(false);
      while (inside_.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }

   private:
    Agent* const agent_;
    std::atomic<bool> alive_{true};
    std::atomic<int> inside_{0};
  };
  struct Peer {
    WorkerInfo info;
    // The route: direct (Unix socket on this host, TCP beyond) when it connects, else gRPC.
    Transport* transport = nullptr;
  };

  Agent(std::string name, int rank, int world_size, RpcOptions options)
      : name_(std::move(name)), rank_(rank), world_size_(world_size), options_(std::move(options)) {}

  // rendezvous.cc
  // `tcp_host`: where the direct channel also listens on TCP for peers on other hosts (empty: it does not).
  absl::Status start_transports(const std::string& listen, const std::string& tcp_host, int* port);
  absl::Status rendezvous(const std::string& master, const std::string& advertised);

  // agent_server.cc
  // A request's header and frame, parsed once.
  struct Parsed {
    tandem::wire::Request request;
    absl::StatusOr<wire::Frame> frame = absl::UnknownError("");  // assigned before it is read
  };
  void on_incoming(Incoming in);
  // A one-way request on the direct channel's thread: runs it here when it is a message (registry.h's
  // register_message) from a rank of the job with no distributed autograd context and no remote references; false
  // when it takes the general path (handle()), with what was parsed of it in `parsed`.
  bool serve_message(Incoming& in, Parsed* parsed);
  // `parsed`: the request as serve_message parsed it on this thread, or null.
  void handle(std::shared_ptr<InCall> call, Parsed* parsed = nullptr);
  // Calls `handler`, the one handle() looked up for `function` and labelled the call with (empty: not registered,
  // NOT_FOUND naming the function and this worker).
  void run(const std::shared_ptr<InCall>& call, const Handler& handler, const std::string& function,
           std::vector<c10::IValue> args, const std::string& caller_name);
  void reply(const std::shared_ptr<InCall>& call, const Future& result);
  void reply_error(const std::shared_ptr<InCall>& call, const absl::Status& error);
  // Answers the call unless it already was, first moving `reply` (if any) into it.
  // A one-way call whose transport needed an answer (gRPC, tensors read by reference) was answered once its arguments
  // were read, before its function ran.
  static bool acknowledged_early(const InCall& call);
  // The served call's metrics and profile range ("in"), from its arrival to now.
  void record_served(const InCall& call, bool ok, int64_t reply_bytes) const;
  void record_served(const std::string& caller, const std::string& function, const InCall& call, bool ok,
                     int64_t reply_bytes) const;
  // `unless_busy`: returns when another thread holds the call for over 100 ms (it is answering it: its reply may take
  // until that reply's deadline to write, and stop() must not wait for it).
  void finish_once(const std::shared_ptr<InCall>& call, const absl::Status& status, grpc::ByteBuffer* reply = nullptr,
                   bool unless_busy = false);
  // A one-way call's end: no result goes back (an empty Response where the transport needs an answer).
  void finish_oneway(const std::shared_ptr<InCall>& call);
  // A one-way call failed here: counted (TransportStats::oneway_failures) and written to stderr.
  void note_oneway_failure(const InCall& call, const absl::Status& error);

  // agent_client.cc
  // A request's tensors sent by reference, and their lease (lease.h): kept until the call completes; clear() ends the
  // lease before the tensors go.
  struct Referenced {
    std::vector<at::Tensor> tensors;
    Lease lease;
    bool empty() const { return tensors.empty(); }
    void clear() {
      lease.end();
      tensors.clear();
    }
    ~Referenced() { clear(); }
  };
  absl::StatusOr<grpc::ByteBuffer> encode_request(int peer, const std::string& function,
                                                  const std::vector<c10::IValue>& args, bool by_reference,
                                                  Referenced* referenced, bool oneway = false);
  // What the end of an outgoing call reports: its metrics series, profile range and start.
  struct CallRecord {
    int peer = -1;
    std::string function;
    const char* kind = "";                        // its profile range's prefix, as PyTorch names them ("rpc_sync#")
    std::chrono::steady_clock::time_point start;  // for the call's metrics
    int64_t sent_bytes = 0;                       // the frame and the tensors read by reference
    metrics::Recorder* recorder = nullptr;
  };
  // What an outgoing call or send starts with: the peer resolved, the request encoded (tensors by reference where
  // `by_reference_ok` and the route allows it), the call counted as outstanding (call_finished() ends it). Errors
  // name the call.
  struct Outgoing {
    std::chrono::milliseconds timeout{0};
    absl::Time deadline;
    Transport* route = nullptr;
    FrameBuffer frame;
    CallRecord record;
  };
  // Every outgoing call's end, whichever path it took: its metrics, its profile range (`record.start` to now, named
  // kind, function and route) and the count of outstanding calls.
  void call_finished(const CallRecord& record, bool ok, int64_t received_bytes);
  absl::StatusOr<Outgoing> start_call(const To& to, const std::string& function, std::vector<c10::IValue>& args,
                                      std::chrono::milliseconds timeout, bool by_reference_ok, bool oneway,
                                      Referenced* referenced, const char* kind);
  // The value of a reply frame from `peer` to a call of `function`; `wait` receives the futures value codecs need
  // completed before it is used. Its errors name the worker and the call (describe()).
  absl::StatusOr<c10::IValue> parse_reply(const grpc::ByteBuffer& frame, int peer, const std::string& function,
                                          std::vector<Future>* wait) const;
  // Completes `target` with `value` once `wait` has completed (at once when empty), or with the first error.
  static void deliver(const Future& target, absl::StatusOr<c10::IValue> value, std::vector<Future> wait);
  // A transport's error as the caller sees it: naming the worker and the function, the cause in words.
  absl::Status call_error(const absl::Status& s, int peer, const std::string& function,
                          std::chrono::milliseconds timeout);
  std::string describe(int peer, const std::string& function) const;
  void count_call(int peer);

  // agent.cc
  absl::Status drain_outgoing(absl::Time deadline);
  // Waits until no client's call received here is running or being answered (but the one this thread runs, if
  // any), at most until `deadline`; false if some still are.
  bool drain_incoming(absl::Time deadline);
  // Stops serving and fails whatever is outstanding; bounded by `grace`.
  void stop(std::chrono::milliseconds grace);

  const std::string name_;
  const int rank_;
  const int world_size_;
  const RpcOptions options_;
  std::string token_;
  std::string client_token_;  // a client outside the job's (auth::derive_client_token)

  std::unique_ptr<grpc::Service> store_service_;  // rank 0 only; outlives the gRPC transport
  std::unique_ptr<Store> store_;
  std::unique_ptr<ThreadPool> pool_;
  const std::shared_ptr<Lifeline> lifeline_ = std::make_shared<Lifeline>(this);
  std::unique_ptr<FaultInjector> faults_;  // when RpcOptions::faults has rules
  std::unique_ptr<GrpcTransport> grpc_;
  std::unique_ptr<DirectTransport> direct_;          // null when same-host calls go over gRPC
  std::vector<std::unique_ptr<Transport>> wrapped_;  // the fault-injecting views of grpc_ and direct_
  Transport* grpc_route_ = nullptr;
  Transport* direct_route_ = nullptr;

  std::vector<Peer> peers_;
  std::map<std::string, int> rank_of_;

  Mutex mu_;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // outgoing calls not completed yet
  std::map<InCall*, std::shared_ptr<InCall>> in_calls_ ABSL_GUARDED_BY(mu_);
  static thread_local const InCall* t_current_in_call_;  // the call whose function this thread runs (run())
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> grpc_calls_{0}, direct_calls_{0}, by_reference_{0}, oneway_failures_{0}, inline_messages_{0},
      leases_lapsed_{0}, sync_calls_spun_{0};
  bool stopped_cleanly_ = false;
  Notification ready_;
};

}  // namespace tandem::rpc::detail
