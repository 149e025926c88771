// Same-host delivery of a pipeline's messages between its stage workers, beside RPC. For each pipeline a worker has
// an inbox in shared memory: a doorbell (a futex word the pipeline's executor sleeps on while it waits in the mailbox)
// and one ring per worker that sends to it. A sender on the same host encodes an activation, a gradient or its word
// that it finished its run straight into its ring and rings the bell: one futex wake-up of the receiving thread, where
// RPC costs a socket write, the channel thread's wake-up, read and decoding, and a second wake-up to hand the value
// over. The memory is anonymous (memfd): a peer opens it through /proc/<pid>/fd of the receiver, so no name exists
// and nothing is left behind however the processes end.
//
// A message goes by RPC instead when it cannot go here (Outlet::send returns false): larger than half a ring, the
// ring full, or a value this encoding does not carry (tensors other than dense CPU ones, dicts, objects). The mailbox
// matches both alike. What comes out of a ring is checked as a message off the network is: a malformed one is an
// error naming its sender, never a crash.
//
// Thread-safety: Inbox::drain() from one thread at a time (the pipeline's executor; others wait); ring(), bell() and
// ends_for() from any thread. An Outlet's send() from any thread (sends are serialised: one ring, one writer); two
// Outlets of one ring must not send at once (runtime.h's attach_outlet gives each ring one per process).
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/pipeline/detail/p2p.h"

namespace tandem::pipeline::detail {

// What a sender needs to open its ring in a receiver's inbox (the receiver's answer to kAttach).
struct RingEnds {
  int64_t pid = 0, bell_fd = -1, ring_fd = -1;
  int64_t token = 0;  // written in both segments' headers: a sender checks it opened the right memory
};

class Inbox {
 public:
  static constexpr size_t kRingBytes = size_t{4} << 20;  // per sender; messages up to half of it go here

  // Throws RpcError (INTERNAL) when the memory cannot be made.
  Inbox();
  ~Inbox();
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  // The ring for messages from worker `from` (made on its first request). Throws RpcError.
  RingEnds ends_for(int from);

  // Decodes every complete message of every ring into `out` (key, value, sending worker). An error names the sender
  // (`name_of(rank)`) and what was malformed; that ring's unread messages are dropped.
  absl::Status drain(std::vector<std::tuple<MailKey, c10::IValue, int>>* out);

  // The bell: a waiter reads it, looks for its message (the mailbox, then drain()), and sleeps in wait() only if the
  // bell still shows what it read. Every sender and every local event that may end a wait (a delivery by RPC, an
  // abort, a release) rings it. wait() spins first, up to `spin` (a receiving stage: spin_time(), 200 µs unless
  // TANDEM_PIPELINE_SPIN_US says otherwise): a sender that finds nobody asleep needs no futex wake-up (20-30 µs of
  // its time on a VM), and the value is taken at once.
  uint32_t bell() const;
  void wait(uint32_t seen, Clock::time_point until, std::chrono::microseconds spin);
  static std::chrono::microseconds spin_time();
  void ring();

  struct Ring;  // shm_p2p.cc
  struct Bell;

 private:
  Bell* bell_ = nullptr;
  int bell_fd_ = -1;
  int64_t token_ = 0;
  static constexpr int kMaxRings = 64;
  std::mutex add_mu_;                   // ends_for()
  std::unique_ptr<Ring> rings_[kMaxRings];  // [0, n_rings_) published
  std::atomic<int> n_rings_{0};
  std::mutex drain_mu_;
};

class Outlet {
 public:
  // Opens a ring another process (or this one) made with Inbox::ends_for. An error when it cannot be opened here
  // (another host, /proc not readable) or is not the one the token names.
  static absl::StatusOr<std::unique_ptr<Outlet>> open(const RingEnds& ends);
  ~Outlet();
  Outlet(const Outlet&) = delete;
  Outlet& operator=(const Outlet&) = delete;

  // Writes the message into the ring and rings the receiver's bell (unless `ring_bell` is false: then the receiver
  // finds it when it next looks, or when a later send rings). false: nothing was written (too large, the
  // ring is full, or the value holds something this encoding does not carry): send it by RPC.
  bool send(const MailKey& key, const c10::IValue& value, bool ring_bell = true);
  // The receiving process (RingEnds::pid).
  int64_t pid() const { return pid_; }
  // Rings the receiver's bell with no message: it wakes (and looks, finding nothing): a driver's word that a step
  // is about to start there, so that the wake-up overlaps the driver's preparing of it.
  void ring();

 private:
  Outlet() = default;
  std::mutex send_mu_;
  void* bell_map_ = nullptr;
  void* ring_map_ = nullptr;
  size_t ring_bytes_ = 0;
  int64_t pid_ = 0;
};

// Tests: the encoding a ring carries, alone. encoded_size: the bytes `value` takes, 0 when it cannot be encoded.
size_t encoded_size(const c10::IValue& value);
void encode(const c10::IValue& value, uint8_t* out, size_t bytes);
// Throws RpcError (INVALID_ARGUMENT) on malformed input.
c10::IValue decode(const uint8_t* in, size_t bytes);

}  // namespace tandem::pipeline::detail
