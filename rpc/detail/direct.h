// The direct channel: RPC between processes of one host over a Unix-domain socket, beside gRPC.
//
// Why: on this kind of machine a call's latency is mostly thread wake-ups, and gRPC spends several per call (its
// poller, its callback executor, then ours). A direct call wakes two threads in all: on the callee, a worker thread
// waiting in epoll reads the request and runs it on the spot; on the caller of rpc_sync, the caller itself reads its
// reply. And because the kernel tells each side which process is at the other end (SO_PEERCRED), large request tensors
// can be pulled straight from the caller's memory with process_vm_readv (one copy into a pooled buffer) instead of
// being streamed through the socket.
//
// Beyond one host the same channel runs over TCP (Channel::start's `tcp_host`; the agent publishes the listener's
// address and connects to peers of other hosts with it): gRPC's HTTP/2 framing and its threads are skipped there too,
// and a large tensor goes to the socket straight from its memory (sendmsg of the frame's slices) and is read into one
// pooled buffer. No cross-memory reads over TCP: the peer's pid means nothing on another host.
//
// Messages: [Header (24 bytes)][body] (proto/tandem_rpc.proto describes both).
//   kChallenge server -> client, on accept: a DirectChallenge (a fresh nonce)
//   kHello    client -> server: a DirectHello: wire version, rank, pid, its own nonce and a proof of the job token
//             bound to both nonces (never the token itself); on a Unix socket also the address of a probe value
//   kWelcome  server -> client: a DirectWelcome: the server's proof; cma_ok when a cross-memory read of the probe
//             from the kernel-reported pid worked (Unix socket); or `refused` (wrong proof, other wire version) and
//             then the server closes
//   kRequest / kResponse: a frame of rpc/detail/wire.h; call_id pairs them.
// A server closes a connection whose hello is wrong or whose header lies (bad magic, body over the message limit).
// Every blocking read and write has a deadline.
//
// Threads: `threads` workers wait in one epoll set (EPOLLONESHOT), so at most one of them reads a given connection at a
// time; having read a whole message it re-arms the connection and runs the message's callback itself. Only `running`
// of them (the CPUs this process may use, by default) hold a place: wait in epoll or run a message. The others are
// parked, so the kernel never wakes more threads for messages than there are cores to run them (each one beyond would
// preempt a thread that computes). A thread whose message blocks in a Tandem wait (sync.h's waits, a socket read of
// this channel) lends its place to a parked thread until it runs again, then parks once its message is done if too
// many hold places. A message blocked where Tandem cannot see it (a sleep, another library's lock) is found by a parked
// thread that watches: when every place runs a message, another is waiting, and none finished for `stuck_after` (5 ms)
// twice in a row, it presumes the longest-running one blocked (unless its thread computed for more than half of that
// time, and then only after 100 ms) and takes its place, which that thread takes back when its message is done.
// The watcher rests (sleeps without a deadline) once a place waited in epoll at kQuietLooks looks in a row, as long as
// one does: no message can be stuck then. The last thread to leave epoll wakes it. So neither an idle worker nor one
// whose places are not all busy (a trainer between its calls) is woken every `stuck_after`, and a worker whose places
// all run messages now and then is woken no more often than that.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <sys/epoll.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/detail/thread_pool.h"
#include "tandem/rpc/transport.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::direct {

// A wait of the channel's (a read, a write, a connect) that ran out: DEADLINE_EXCEEDED with this message.
inline constexpr char kDeadlineExceeded[] = "direct channel: deadline exceeded";

// kOneway: a request the server does not answer (Transport::send).
enum class Kind : uint32_t { kHello = 1, kWelcome = 2, kRequest = 3, kResponse = 4, kChallenge = 5, kOneway = 6 };

struct Message {
  Kind kind;
  uint64_t call_id = 0;
  FrameBuffer body;  // moves (transport.h)
};

// The handshake's bodies, as functions of bytes (tests and fuzzing call them directly). On a Unix socket as over TCP,
// the server speaks first with a challenge (a fresh nonce); the client's hello proves the job token without sending
// it (auth::tcp_proof over both nonces and its rank), and so does the server's welcome: neither side shows the token
// to whoever holds the other end.
grpc::ByteBuffer encode_challenge(const std::string& nonce);
// The challenge's nonce; INVALID_ARGUMENT when it does not parse or has no nonce, FAILED_PRECONDITION for another
// wire version.
absl::StatusOr<std::string> parse_challenge(const grpc::ByteBuffer& body);
// A client's hello answering `challenge`: this process's pid, and `probe_address` (0 over TCP) where the server may
// read a known value to test cross-memory reads. `one_call_at_a_time`: the connection carries one request, then its
// response, at a time (DirectHello.one_call_at_a_time; Conn::set_one_call_at_a_time).
grpc::ByteBuffer encode_hello(const std::string& token, int rank, const std::string& challenge,
                              const std::string& client_nonce, uint64_t probe_address, bool one_call_at_a_time = false);
// The hello of a client holding `token` that answers `challenge` and speaks this build's wire version.
// INVALID_ARGUMENT when it does not parse or is out of range (no nonce), UNAUTHENTICATED for a wrong or missing
// proof, FAILED_PRECONDITION for another wire version.
absl::StatusOr<tandem::wire::DirectHello> parse_hello(const grpc::ByteBuffer& body, const std::string& token,
                                                      const std::string& challenge);
// The server's answer; the refusal it carries (UNAUTHENTICATED, FAILED_PRECONDITION, ...) as an error.
absl::StatusOr<tandem::wire::DirectWelcome> parse_welcome(const grpc::ByteBuffer& body);
// Whether `address` is a TCP listener's ("tcp:host:port", Channel::tcp_address) rather than an abstract socket name.
bool is_tcp_address(const std::string& address);

class Conn {
 public:
  explicit Conn(int fd) : fd_(fd) {}
  ~Conn();
  int fd() const { return fd_; }
  // Writes one message (header + every slice of `body`), one writer at a time; fails at `deadline`, also while it waits
  // for another writer (a peer that stopped reading holds that one until its own deadline): then nothing was written
  // and the connection stays usable.
  absl::Status write(Kind kind, uint64_t call_id, const grpc::ByteBuffer& body, absl::Time deadline);
  // Reads one whole message; fails at `deadline` (which bounds the body too), on EOF, or when the header lies. For the
  // first `spin` the caller polls instead of sleeping (a reply expected within microseconds then costs no wake-up).
  // `prompt_wake`: a caller waiting for its reply asks for the short wait slice before it sleeps (wait_slice.h).
  absl::StatusOr<Message> read(uint64_t max_body, absl::Time deadline,
                               std::chrono::microseconds spin = std::chrono::microseconds(0), bool prompt_wake = false);
  // For connections driven by epoll: reads what has arrived of the next header without waiting. True once it is
  // complete (then read_body); false when more must arrive; an error on EOF or a header that lies, and on a
  // one-call-at-a-time connection when bytes beyond the message came with it.
  absl::StatusOr<bool> poll_header(uint64_t max_body);
  // The body of the header completed by poll_header, waiting for it until `deadline`.
  absl::StatusOr<Message> read_body(absl::Time deadline);
  // One request and then its response at a time on this connection (rpc_sync's; DirectHello.one_call_at_a_time):
  // a message's header and the start of its body (up to kPrefetchBytes) come in one read, where other connections
  // take one for each, and nothing may follow a message before it is answered. Set before the connection's first
  // request, by the thread that reads it.
  void set_one_call_at_a_time() { one_call_at_a_time_ = true; }
  bool one_call_at_a_time() const { return one_call_at_a_time_; }
  // Wakes anyone blocked on the socket (they see an error); the fd stays open until the Conn dies.
  void shut();
  // Writes the header of a message of `body` and the first half of its bytes, then shuts the connection: the peer
  // sees a message cut mid-way (fault injection).
  void write_half_and_shut(Kind kind, uint64_t call_id, const grpc::ByteBuffer& body);

  // Set at the handshake. For an inbound connection: the peer's rank, and its pid when cross-memory reads from it work.
  int peer_rank = -1;
  pid_t cma_pid = 0;
  bool cma_ok = false;  // outbound: the server can read our memory
  bool inbound = false;
  bool tcp = false;       // inbound: over TCP (else a Unix socket)
  std::string challenge;  // inbound: the nonce this server sent
  std::atomic<bool> broken{false};

 private:
  absl::Status check_header(uint64_t max_body) const;

  // Takes the socket for one message, waiting for another writer at most until `deadline` (DEADLINE_EXCEEDED).
  absl::Status start_writing(absl::Time deadline);
  void end_writing();

  const int fd_;
  Mutex write_mu_;
  bool writing_ ABSL_GUARDED_BY(write_mu_) = false;  // one message at a time on the socket
  // The header being received (poll_header); touched by one thread at a time (EPOLLONESHOT).
  uint8_t header_[24] = {};
  size_t header_got_ = 0;
  // One call at a time: the next body's first bytes, read with its header into `pre_` (kPrefetchBytes, acquired for
  // the next message once the last one took it as its body).
  static constexpr size_t kPrefetchBytes = 4096;
  bool one_call_at_a_time_ = false;
  void* pre_ = nullptr;
  size_t pre_capacity_ = 0;
  size_t pre_got_ = 0;
};

// The epoll set and its worker threads, the listening socket, and the handshake.
class Channel {
 public:
  struct Callbacks {
    // Inline on a worker thread; the connection has been re-armed already, except a one-call-at-a-time connection's
    // (Conn::set_one_call_at_a_time), which is watched again once the callback returns.
    std::function<void(const std::shared_ptr<Conn>&, Message)> on_request;
    std::function<void(const std::shared_ptr<Conn>&, Message)> on_response;
    // A connection registered for responses failed or closed.
    std::function<void(const std::shared_ptr<Conn>&, const absl::Status&)> on_lost;
  };

  // `message_timeout`: once a message has started to arrive, the rest must follow within it. With a `tcp_host`, the
  // channel also listens on TCP at that address (an ephemeral port) for peers on other hosts.
  // `running`: how many threads run messages at once unless some block (above); 0: the CPUs this process may use.
  // `stuck_after`: how long no place may finish a message while another waits before one is presumed blocked.
  static absl::StatusOr<std::unique_ptr<Channel>> start(std::string token, int threads, uint64_t max_message_bytes,
                                                        absl::Duration message_timeout, Callbacks callbacks,
                                                        const std::string& tcp_host = "", int running = 0,
                                                        absl::Duration stuck_after = absl::Milliseconds(5));
  ~Channel();

  // This worker's abstract socket name (without the leading NUL).
  const std::string& address() const { return address_; }
  // "tcp:host:port" of the TCP listener (connect() takes it as it is), or empty.
  const std::string& tcp_address() const { return tcp_address_; }

  // Connects to `address` (an abstract socket name, or "tcp:host:port") and authenticates as `my_rank`. With
  // `for_responses` the connection joins the epoll set and its responses go to on_response; otherwise the caller reads
  // it itself (Conn::read). Errors: UNAVAILABLE (unreachable, or the handshake broke), DEADLINE_EXCEEDED,
  // UNAUTHENTICATED (the peer refused our token, or over TCP could not prove it holds the job's), FAILED_PRECONDITION
  // (another wire version).
  absl::StatusOr<std::shared_ptr<Conn>> connect(const std::string& address, int my_rank, bool for_responses,
                                                absl::Time deadline);

  // How often a loop thread lent its place while its message blocked in a Tandem wait, and how often the watching
  // thread presumed one blocked out of sight (Threads, above).
  struct PlaceCounts {
    int64_t lent = 0;
    int64_t presumed_blocked = 0;
    int64_t looks = 0;  // times the watching thread woke to look (it rests while a place waits in epoll)
    // Times a loop thread polled for the next message after serving one (set_serve_spin), and how often one came; of
    // those polls, the ones of a single one-call-at-a-time connection (poll_answered).
    int64_t serve_spins = 0;
    int64_t serve_spin_hits = 0;
    int64_t answered_polls = 0;
  };
  PlaceCounts place_counts();

  // After serving a message in at most 4 × `spin`, one loop thread at a time polls the epoll set for up to `spin`
  // (yielding its core between looks) before it sleeps in it: a caller whose next request follows its reply at once (a
  // loop of rpc_sync) is then not woken across cores each time. After kSpinMissesBeforeBackoff polls in a row that
  // found nothing, only one in kSpinProbeEvery is made, until one finds a message again. 0 (the default): never.
  // Thread-safe.
  void set_serve_spin(std::chrono::microseconds spin) { serve_spin_us_.store(spin.count()); }

  // Closes the listener and every connection, then stops the threads (waiting up to `grace` for running callbacks).
  // Returns false when threads were still busy.
  bool stop(std::chrono::milliseconds grace);

 private:
  class Place;  // a loop thread's WaitObserver: lends its place while its message blocks

  Channel() = default;
  void loop();
  // Serves one event; returns the connection handle_ready() left to this thread (below), or null.
  std::shared_ptr<Conn> serve(const epoll_event& ev);
  // Waits for a place (false when the channel stops); step_aside() first gives this thread's back when more than
  // `running` are held.
  bool take_place();
  bool step_aside();
  bool park() ABSL_EXCLUSIVE_LOCKS_REQUIRED(places_mu_);
  // held_ += delta, and over_ from it.
  void add_held(int delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(places_mu_);
  void lend_place(Place* place);
  void reclaim_place(Place* place, bool message_done);
  // The last thread to leave epoll wakes a resting watcher.
  void wake_watcher();
  // Every place runs a message, another waits in the epoll set, and none finished since `finished` was read.
  bool stuck(uint64_t finished) const;
  // Lends the place of the thread whose message has run longest, as if it blocked (none when no message runs).
  void presume_blocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(places_mu_);
  // One event of the epoll set into `ev`, as epoll_wait(…, -1) returns it; `served`: this thread has just served a
  // message, so it may poll first (set_serve_spin).
  int wait_event(epoll_event* ev, bool served);
  // Reads and delivers the message that has come on `conn`. A request of a one-call-at-a-time connection is answered
  // before that connection is watched again (nothing else can come on it first): then the connection is returned,
  // and the thread must poll it (poll_answered) or arm it. Otherwise null.
  std::shared_ptr<Conn> handle_ready(const std::shared_ptr<Conn>& conn);
  // After a quick answer on `conn` (one thread at a time, as wait_event's poll): polls that connection alone for its
  // next request for up to the serve spin. True when something came (handle_ready then reads it); false when the
  // poll did not run or found nothing (the caller arms the connection).
  bool poll_answered(Conn& conn);
  // A thread may poll (set_serve_spin; one at a time, backed off after misses): then it polls and calls end_spin.
  bool start_spin();
  void end_spin(bool hit);
  void accept_one(int listen_fd, uint64_t tag);
  // Watches `conn` for its next message (EPOLLONESHOT); the error says why it cannot be.
  absl::Status watch(const std::shared_ptr<Conn>& conn, bool add);
  // watch(), and a connection that cannot be watched is dropped with the cause (logged): then false.
  bool arm(const std::shared_ptr<Conn>& conn, bool add);
  void drop(const std::shared_ptr<Conn>& conn, const absl::Status& why);

  std::string token_;
  std::string address_;
  std::string tcp_address_;
  uint64_t max_message_bytes_ = 0;
  absl::Duration message_timeout_;
  Callbacks callbacks_;
  int epoll_fd_ = -1;
  int listen_fd_ = -1;
  int tcp_listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: stop() wakes every worker
  std::unique_ptr<detail::ThreadPool> threads_;
  Mutex mu_;
  std::map<Conn*, std::shared_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);  // epoll data points at the key
  std::atomic<bool> stopping_{false};

  int places_ = 1;  // `running`
  absl::Duration stuck_after_;
  // A message that computes is presumed blocked only after this long (it may spin, waiting for another message).
  static constexpr absl::Duration kComputeLimit = absl::Milliseconds(100);
  // The watcher rests after this many looks in a row at which a place waited in epoll.
  static constexpr int kQuietLooks = 4;
  Mutex places_mu_;
  CondVar parked_cv_;  // threads without a place
  CondVar watch_cv_;   // the one of them that watches for stuck places
  int held_ ABSL_GUARDED_BY(places_mu_) = 0;
  int parked_ ABSL_GUARDED_BY(places_mu_) = 0;  // waiting on parked_cv_
  bool watching_ ABSL_GUARDED_BY(places_mu_) = false;
  PlaceCounts counts_ ABSL_GUARDED_BY(places_mu_);
  std::vector<Place*> all_places_ ABSL_GUARDED_BY(places_mu_);  // every loop thread's
  // The message the watcher found stuck at its last look, its thread's CPU time then, and since when it is watched.
  struct Suspect {
    Place* place = nullptr;
    uint64_t message = 0;
    absl::Duration cpu;
    absl::Time seen, since;
  };
  Suspect suspect_ ABSL_GUARDED_BY(places_mu_);
  int quiet_looks_ ABSL_GUARDED_BY(places_mu_) = 0;
  // The watcher waits without a deadline. Stored before it reads in_epoll_, read after in_epoll_ falls (both
  // seq_cst): the thread that takes in_epoll_ to 0 after the watcher's read always finds it set.
  std::atomic<bool> watcher_resting_{false};
  std::atomic<uint64_t> started_{0};   // messages begun
  std::atomic<bool> over_{false};      // held_ > places_: read after each message without the lock
  std::atomic<int> in_epoll_{0};       // threads in epoll_wait (seq_cst: watcher_resting_)
  std::atomic<uint64_t> finished_{0};  // messages run
  // set_serve_spin: the poll's length, whether a thread polls, consecutive polls that found nothing, eligible polls
  // counted while backed off, and the counts of place_counts().
  static constexpr uint32_t kSpinMissesBeforeBackoff = 8;
  static constexpr uint32_t kSpinProbeEvery = 16;
  // Times the poll: a thread whose message took longer sleeps at once.
  static constexpr int kSpinAfterServingAtMost = 4;
  std::atomic<int64_t> serve_spin_us_{0};
  std::atomic<bool> spinning_{false};
  std::atomic<uint32_t> spin_misses_{0};
  std::atomic<uint32_t> spin_probes_{0};
  std::atomic<int64_t> serve_spins_{0};
  std::atomic<int64_t> serve_spin_hits_{0};
  std::atomic<int64_t> answered_polls_{0};
};

}  // namespace tandem::rpc::direct
