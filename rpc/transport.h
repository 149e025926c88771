// The transport seam: how the RPC agent moves request and reply frames between workers without knowing the channel.
//
// A frame is one message of rpc/detail/wire.h (grpc::ByteBuffer: slices, tensors by reference, no copy). The agent
// encodes and decodes frames, keeps its calls and answers each incoming one exactly once; a Transport only carries
// them. Kinds (docs/architecture.md):
//   grpc    every peer, and the job's store on rank 0 (rpc/detail/grpc_transport.h)
//   direct  same-host peers over a Unix-domain socket, tensors read from the caller's memory; peers on other hosts
//           over TCP, authenticated by a challenge (rpc/detail/direct.h)
//   faults  wraps another transport and drops, delays, duplicates, reorders, corrupts or cuts chosen messages
//           (rpc/fault_injection.h; tests only)
//
// Contract of every transport:
//   - call(): `done` runs exactly once, with the reply frame or an error status, by `deadline` at the latest (plus the
//     time a callback takes), and also at stop(). Error codes: DEADLINE_EXCEEDED (no reply in time), UNAVAILABLE (the
//     peer is unreachable, died, or the connection broke), CANCELLED (stop() on this side), RESOURCE_EXHAUSTED (a frame
//     over the message limit). The agent turns them into the errors of rpc/rpc.h, naming the worker and the call.
//   - Incoming requests go to the handler given at start; their `reply` is called exactly once by the agent.
//   - Thread-safety: every method may be called from any thread once the transport is started.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::rpc {

// The message of a transport's DEADLINE_EXCEEDED that says no more than that a call's time ran out: the agent says
// "no reply within N ms" in its stead, and passes on whatever else a transport says (Agent::call_error).
inline constexpr char kNoReplyByDeadline[] = "no reply by the deadline";

// A grpc::ByteBuffer that moves. gRPC 1.51's ByteBuffer (final) has a copy constructor and no move one, so every
// std::move of a frame copied it (an allocation and a reference count per slice, then their release): a dozen times
// per call on the way from the socket to the agent and back. This one moves by Swap; copying it still copies. It
// stands for its ByteBuffer wherever one is taken by reference.
class FrameBuffer {
 public:
  FrameBuffer() = default;
  FrameBuffer(grpc::ByteBuffer&& b) noexcept { b_.Swap(&b); }  // NOLINT: implicit, as a moved ByteBuffer
  FrameBuffer(const grpc::ByteBuffer& b) : b_(b) {}            // NOLINT: implicit, as a copied ByteBuffer
  FrameBuffer(FrameBuffer&& o) noexcept { b_.Swap(&o.b_); }
  FrameBuffer(const FrameBuffer&) = default;
  FrameBuffer& operator=(FrameBuffer&& o) noexcept {
    b_.Swap(&o.b_);
    return *this;
  }
  FrameBuffer& operator=(const FrameBuffer&) = default;
  operator grpc::ByteBuffer&() { return b_; }              // NOLINT: implicit
  operator const grpc::ByteBuffer&() const { return b_; }  // NOLINT: implicit
  grpc::ByteBuffer& buffer() { return b_; }
  const grpc::ByteBuffer& buffer() const { return b_; }
  size_t Length() const { return b_.Length(); }
  bool Valid() const { return b_.Valid(); }

 private:
  grpc::ByteBuffer b_;
};

// Answers one incoming request: with a reply frame (`status` OK) or with a transport-level error the caller sees as
// that status. Called exactly once; the transport may take the frame's content (the agent's reply is not read after).
using ReplyFn = std::function<void(grpc::ByteBuffer* reply, const absl::Status& status)>;
// Completes one outgoing call: the reply frame, or why there is none.
using DoneFn = std::function<void(absl::StatusOr<grpc::ByteBuffer> reply)>;

// A request as a transport received it.
struct Incoming {
  FrameBuffer request;
  pid_t cma_pid = 0;          // the caller's process when tensors sent by reference may be read from it, else 0
  bool on_io_thread = false;  // true: the handler may run the call right here (the direct channel's worker threads)
  // A one-way request (Transport::send): nobody waits for its reply, and `reply` writes none (the agent still calls
  // it once, and reports a failure of the function itself).
  bool oneway = false;
  // The caller authenticated with a client's token (rpc/detail/auth.h): it may only call as a client (caller rank -1).
  bool from_client = false;
  ReplyFn reply;
  // Closes the connection the request came on (fault injection); with `partial`, first writes half of that reply
  // frame where the transport can. gRPC cannot close its connection from a handler: it answers UNAVAILABLE instead.
  std::function<void(const grpc::ByteBuffer* partial)> cut;
};
using IncomingFn = std::function<void(Incoming)>;

// Where a peer can be reached, as published at rendezvous.
struct PeerAddress {
  int rank = -1;
  std::string name;
  std::string grpc_address;    // host:port
  std::string direct_address;  // the direct channel's socket, empty when the peer has none
  std::string tcp_address;     // the direct channel's TCP listener ("tcp:host:port"), empty when the peer has none
  bool same_host = false;      // same kernel boot: memory can be shared
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* kind() const = 0;
  // The channel calls to `peer` take within this transport ("tcp" for the direct channel's TCP route); kind() when it
  // has one channel.
  virtual const char* kind_for(int peer) const { return kind(); }

  // Prepares to carry calls to `peer` (connects where it has to). An error means this transport cannot reach it;
  // the agent then routes the peer through another one.
  virtual absl::Status add_peer(const PeerAddress& peer, absl::Time deadline) = 0;
  // Whether request tensors may be sent by reference to `peer` (read by the callee from this process's memory).
  virtual bool by_reference(int peer) const { return false; }

  // Sends `request` to `peer`. `function` names the call in errors and for fault rules.
  virtual void call(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline,
                    DoneFn done) = 0;
  // The same, waiting on the calling thread (the direct channel reads its reply on it, spinning up to `spin`).
  virtual absl::StatusOr<grpc::ByteBuffer> call_sync(int peer, const std::string& function,
                                                     const grpc::ByteBuffer& request, absl::Time deadline,
                                                     std::chrono::microseconds spin);

  // One-way: sends `request` to `peer` without waiting for a reply; `done` runs once, with an empty buffer when the
  // request was handed to the connection (after earlier requests to `peer` on it), or with the errors of call(). The
  // default sends it as a call() and runs `done` with the reply frame when it came (gRPC has no one-way message); the
  // direct channel writes a one-way frame the callee does not answer.
  virtual void send(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline, DoneFn done);

  // Closes every connection to `peer` now: calls in flight on them fail with UNAVAILABLE; later calls reconnect.
  // With `partial`, the transport first writes the first half of that frame where it can (a message cut mid-way).
  virtual void cut(int peer, const grpc::ByteBuffer* partial) = 0;

  // Stops accepting and fails what is outstanding (CANCELLED); bounded by `grace`. Returns false when threads were
  // still busy at the end of it (the transport must then not be destroyed).
  virtual bool stop(std::chrono::milliseconds grace) = 0;
};

}  // namespace tandem::rpc
