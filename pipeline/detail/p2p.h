// The mailbox of a stage worker: activations and gradients that other stages sent to this worker's stages, matched
// by (pipeline, step, stage, micro-batch, direction), and the other workers' word that they finished their run of a
// step (under a stage below zero, finished_key). Each waiting receive has a wake-up of its own: a delivery wakes
// the one receive waiting for its key, never every waiter of the process (a pipeline with same-host deliveries,
// shm_p2p.h: its one receiving thread waits on the pipeline's bell instead). A message delivered twice is kept once,
// and what arrives for a step that ended here, was abandoned, or whose pipeline was released is dropped (but for the
// driver's word to start a step, go_key: one of an abandoned step is kept for its answer, take_go).
//
// Thread-safety: every function may be called from any thread (RPC handlers deliver, executors receive).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/sync/sync.h"

namespace tandem::pipeline::detail {

struct MailKey {
  int64_t pipe = 0, step = 0;
  int stage = 0, microbatch = 0;
  bool gradient = false;  // a gradient going back (else an activation going forward)
  bool operator<(const MailKey& o) const {
    return std::tie(pipe, step, stage, microbatch, gradient) <
           std::tie(o.pipe, o.step, o.stage, o.microbatch, o.gradient);
  }
};

// Stage 0 receives no activation and the last stage no gradient: under their keys (micro-batch -1) the driver's
// shared-memory deliveries bring, when the plan does not, all of the batch's micro-batches (inputs_key: a tuple of
// each one's arguments) and all targets (targets_key: a list of tensors), one message each.
inline MailKey inputs_key(int64_t pipe, int64_t step) { return MailKey{pipe, step, 0, -1, false}; }
inline MailKey targets_key(int64_t pipe, int64_t step, int n_stages) {
  return MailKey{pipe, step, n_stages - 1, -1, true};
}

// A step the driver on this host starts without a call (runtime.cc, run_direct): its value is (sizes, flags as the
// call's, the driver's distributed autograd context, the driver's rank). Under a stage no worker's word uses.
constexpr int kGoStage = std::numeric_limits<int>::min();
inline MailKey go_key(int64_t pipe, int64_t step) { return MailKey{pipe, step, kGoStage, 0, false}; }

// The stage of the key under which worker `rank`'s word that it finished its run of a step arrives (a stage index
// below zero: no stage's).
inline int finished_key(int rank) { return -1 - rank; }

class Inbox;  // shm_p2p.h

class Mailbox {
 public:
  static Mailbox& get();  // this process's

  // Delivers `value` (an activation or a gradient: a tensor, or tuples and lists of values) for `key`; dropped when
  // `key` was delivered already, or its step ended here, was abandoned (a go: kept for take_go), or its pipeline was
  // released.
  void put(const MailKey& key, c10::IValue value);
  // The value for `key`, or an error: the step was abandoned (its reason), RPC stopped, the pipeline was released,
  // or nothing came by `deadline` (DEADLINE_EXCEEDED). `what` names the message in the error.
  absl::StatusOr<c10::IValue> take(const MailKey& key, Clock::time_point deadline, const std::string& what);
  // A step the driver started without a call (go_key), and why it must not run: OK, or the reason its step was
  // abandoned here before the go was taken (the driver is to be answered with it).
  struct Go {
    int64_t pipe = 0, step = 0;
    c10::IValue value;
    absl::Status dropped;
  };
  // Without waiting, after moving what the pipeline's inbox holds into the mailbox: a go of `pipe` dropped untaken
  // (its step abandoned), else the earliest go delivered and not yet taken, else none; an error when a ring held a
  // malformed message (as take()). The messages after it in that ring are lost, and a run may wait for one: the next
  // take() of `pipe` that finds its message not arrived fails at once with that error (not at its deadline).
  absl::StatusOr<std::optional<Go>> take_go(int64_t pipe);
  // The step is abandoned here: its waits end with `reason`, what is here of it goes (a go not yet taken is kept
  // for take_go, with `reason`), later deliveries are dropped (a go kept so too).
  void abort(int64_t pipe, int64_t step, absl::Status reason);
  // The step's run ended here (it succeeded): what is left of it goes, later deliveries (duplicates) are dropped.
  void finish(int64_t pipe, int64_t step);
  // Every wait in progress ends with `reason` (RPC is stopping); later steps are not affected.
  void abort_all(const absl::Status& reason);
  // The pipeline is gone from this worker: its waits end, what is here of it goes, later deliveries are dropped.
  void release(int64_t pipe);
  bool aborted(int64_t pipe, int64_t step);
  // Same-host deliveries (shm_p2p.h): from now on the receives of `pipe` wait on `inbox`'s bell and take what its
  // rings hold; every event that ends a wait of `pipe` rings it. Dropped at release(pipe).
  void set_inbox(int64_t pipe, std::shared_ptr<Inbox> inbox);

  // How many messages, waits and unanswered goes are held now (tests: nothing is left behind).
  size_t held();
  // How a receive of `key` waits now (tests: an event must come while it waits, not before): not at all, on its own
  // condition variable, or on its inbox's bell (its bell already read: a later ring wakes it).
  enum class Waiting { kNo, kAlone, kOnTheBell };
  Waiting waiting(const MailKey& key);

 private:
  struct Slot {
    c10::IValue value;
    bool arrived = false;       // value holds the delivery, not yet taken
    bool taken = false;         // delivered and taken: a second delivery is a duplicate
    CondVar* waiter = nullptr;  // the receive waiting for this key
    Inbox* bell = nullptr;      // or its inbox's bell, when the receive waits on that
  };
  using StepId = std::pair<int64_t, int64_t>;
  Mailbox() = default;
  bool closed_locked(int64_t pipe, int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases the slots matching `match`, waking their waiters.
  template <typename Match>
  void drop_locked(Match match) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void wake(const Slot& slot);
  // Moves what `inbox`'s rings hold into the mailbox; `empty` (if given) says whether they held nothing.
  absl::Status pump(Inbox& inbox, bool* empty) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps `value`, a go (else nothing is done) dropped because its step was abandoned, for take_go.
  void drop_go_locked(const MailKey& key, c10::IValue value, const absl::Status& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Inbox* inbox_of_locked(int64_t pipe) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  std::map<MailKey, Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::shared_ptr<Inbox>> inboxes_ ABSL_GUARDED_BY(mu_);  // by pipeline
  // Goes dropped untaken (abort, put), oldest first, bounded: take_go hands them to the executor to answer.
  std::deque<Go> dropped_goes_ ABSL_GUARDED_BY(mu_);
  // Bounded memories (oldest first in each deque) of the steps abandoned (with why), the steps ended and the
  // pipelines released here.
  std::map<StepId, absl::Status> aborted_ ABSL_GUARDED_BY(mu_);
  std::deque<StepId> aborted_order_ ABSL_GUARDED_BY(mu_);
  std::set<StepId> finished_ ABSL_GUARDED_BY(mu_);
  std::deque<StepId> finished_order_ ABSL_GUARDED_BY(mu_);
  std::set<int64_t> released_ ABSL_GUARDED_BY(mu_);
  std::deque<int64_t> released_order_ ABSL_GUARDED_BY(mu_);
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;     // abort_all() calls so far
  absl::Status stopped_ ABSL_GUARDED_BY(mu_);  // the last one's reason
  // A malformed ring seen by take_go, by pipeline: the next take() of it that finds nothing arrived fails with it.
  std::map<int64_t, absl::Status> ring_errors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::pipeline::detail
