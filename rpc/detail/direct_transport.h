// The direct channel (rpc/detail/direct.h) as a Transport: calls to same-host peers over a Unix-domain socket, and to
// peers on other hosts over TCP when both listen on it.
//
// Async calls share one connection per peer whose replies the channel's epoll threads read (paired by call id);
// rpc_sync calls each take an idle connection of their own and read the reply on the calling thread. A timer thread
// fails async calls at their deadline, their callbacks run on a short-lived thread per batch of expired calls (at most
// 8 at once; beyond, on the timer thread). Incoming requests run on the channel's thread that read them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "tandem/rpc/detail/direct.h"
#include "tandem/rpc/transport.h"
#include "tandem/sync/sync.h"
#include "tandem/sync/threads.h"

namespace tandem::rpc::detail {

class DirectTransport final : public Transport {
 public:
  // Listens on a fresh abstract socket, and with a `tcp_host` also on TCP there (for peers on other hosts); `threads`
  // epoll threads read them and run incoming requests (`on_request`). `message_timeout`: once a message has started
  // to arrive, the rest must follow within it.
  static absl::StatusOr<std::unique_ptr<DirectTransport>> start(std::string token, int my_rank, int threads,
                                                                uint64_t max_message_bytes,
                                                                std::chrono::milliseconds message_timeout,
                                                                IncomingFn on_request,
                                                                const std::string& tcp_host = "");
  ~DirectTransport() override;

  const std::string& address() const { return channel_->address(); }
  const std::string& tcp_address() const { return channel_->tcp_address(); }
  direct::Channel::PlaceCounts place_counts() const { return channel_->place_counts(); }
  // RpcOptions::serve_spin (direct::Channel::set_serve_spin).
  void set_serve_spin(std::chrono::microseconds spin) { channel_->set_serve_spin(spin); }

  const char* kind() const override { return "direct"; }
  absl::Status add_peer(const PeerAddress& peer, absl::Time deadline) override;
  const char* kind_for(int peer) const override;
  bool by_reference(int peer) const override;
  void call(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline, DoneFn done) override;
  absl::StatusOr<grpc::ByteBuffer> call_sync(int peer, const std::string& function, const grpc::ByteBuffer& request,
                                             absl::Time deadline, std::chrono::microseconds spin) override;
  void send(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline, DoneFn done) override;
  void cut(int peer, const grpc::ByteBuffer* partial) override;
  bool stop(std::chrono::milliseconds grace) override;
  // From now on a reply waits at most `grace` to be written (not the message timeout): the agent's stop answers the
  // calls still running with CANCELLED, and one whose connection another reply holds (its caller stopped reading)
  // must not hold the stop for the message timeout. Before stop().
  void cap_reply_writes(std::chrono::milliseconds grace) { reply_write_cap_ms_->store(grace.count()); }

 private:
  struct Peer {
    std::string address;
    bool cma_ok = false;
    Mutex mu;
    std::shared_ptr<direct::Conn> async_conn ABSL_GUARDED_BY(mu);
    // A call is making the async connection: the others to this peer wait for it, each until its own deadline.
    bool connecting ABSL_GUARDED_BY(mu) = false;
    std::vector<std::shared_ptr<direct::Conn>> idle_sync ABSL_GUARDED_BY(mu);  // connections of finished rpc_sync calls
  };
  using Deadlines = std::multimap<absl::Time, uint64_t>;
  struct Pending {
    DoneFn done;
    const direct::Conn* conn = nullptr;
    Deadlines::iterator deadline;  // its entry in deadlines_, erased with it; deadlines_.end() once the timer took it
  };

  DirectTransport(int my_rank, uint64_t max_message_bytes) : my_rank_(my_rank), max_bytes_(max_message_bytes) {}
  Peer* peer(int rank) const;
  absl::StatusOr<std::shared_ptr<direct::Conn>> async_conn(Peer& p, absl::Time deadline);
  void on_request(const std::shared_ptr<direct::Conn>& conn, direct::Message msg);
  void on_response(direct::Message msg);
  void on_lost(const direct::Conn* conn, const absl::Status& why);
  // Whether an async call or send may go out: true unless the transport has stopped, after running `while_locked`
  // (if any) under mu_, so that stop() either sees what it registers or refuses the call; false once `done` has been
  // failed with CANCELLED, outside mu_ (call() and send() share this, so the two cannot drift).
  // A template (defined in the .cc, its only user): a std::function here allocated on every call.
  template <typename F>
  bool admit(DoneFn& done, F&& while_locked);
  bool admit(DoneFn& done);
  // Completes the call `id` (when it is still pending) with `reply`.
  void complete(uint64_t id, absl::StatusOr<grpc::ByteBuffer> reply);
  void run_timer();

  const int my_rank_;
  const uint64_t max_bytes_;
  absl::Duration message_timeout_;
  // cap_reply_writes(): 0, or the longest a reply's write waits (ms); shared with the replies' functions.
  std::shared_ptr<std::atomic<int64_t>> reply_write_cap_ms_ = std::make_shared<std::atomic<int64_t>>(0);
  IncomingFn on_request_;
  std::unique_ptr<direct::Channel> channel_;
  std::thread timer_;
  // Threads completing calls that ran out of time (run_timer).
  static constexpr size_t kMaxExpiringThreads = 8;
  ReapedThreads expiring_{kMaxExpiringThreads};

  Mutex peers_mu_;
  std::map<int, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(peers_mu_);

  Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  Deadlines deadlines_ ABSL_GUARDED_BY(mu_);                                 // of the pending calls only
  std::set<std::shared_ptr<direct::Conn>> sync_calls_ ABSL_GUARDED_BY(mu_);  // connections of rpc_sync calls running
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tandem::rpc::detail
