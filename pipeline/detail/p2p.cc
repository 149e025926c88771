#include "tandem/pipeline/detail/p2p.h"

#include "tandem/pipeline/detail/shm_p2p.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace tandem::pipeline::detail {
namespace {

// Adds `id` to a bounded memory (the oldest forgotten past `limit`).
template <typename Set, typename Id>
void remember(Set* set, std::deque<Id>* order, const Id& id, size_t limit) {
  if (!set->insert(id).second) return;
  order->push_back(id);
  if (order->size() > limit) set->erase(order->front()), order->pop_front();
}

constexpr size_t kRemembered = 10000;

}  // namespace

Mailbox& Mailbox::get() {
  static auto* m = new Mailbox;  // never destroyed: RPC threads may deliver until exit
  return *m;
}

bool Mailbox::closed_locked(int64_t pipe, int64_t step) const {
  return aborted_.count({pipe, step}) > 0 || finished_.count({pipe, step}) > 0 || released_.count(pipe) > 0;
}

void Mailbox::wake(const Slot& slot) {
  if (slot.waiter) slot.waiter->Signal();
  if (slot.bell) slot.bell->ring();
}

template <typename Match>
void Mailbox::drop_locked(Match match) {
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (!match(it->first)) {
      ++it;
      continue;
    }
    wake(it->second);  // it finds its slot gone and says why
    it = slots_.erase(it);
  }
}

void Mailbox::put(const MailKey& key, c10::IValue value) {
  MutexLock lock(&mu_);
  if (closed_locked(key.pipe, key.step)) {
    if (auto a = aborted_.find({key.pipe, key.step}); a != aborted_.end() && !released_.count(key.pipe)) {
      drop_go_locked(key, std::move(value), a->second);
    }
    return;
  }
  Slot& slot = slots_[key];
  if (slot.arrived || slot.taken) return;  // a duplicate: the first delivery stands
  slot.value = std::move(value);
  slot.arrived = true;
  wake(slot);
}

void Mailbox::set_inbox(int64_t pipe, std::shared_ptr<Inbox> inbox) {
  MutexLock lock(&mu_);
  if (released_.count(pipe)) return;
  inboxes_[pipe] = std::move(inbox);
  // A receive of this pipeline waiting on its own wake-up looks again, and from now on waits on the bell.
  for (auto& [key, slot] : slots_) {
    if (key.pipe == pipe && slot.waiter) slot.waiter->Signal();
  }
}

absl::StatusOr<c10::IValue> Mailbox::take(const MailKey& key, Clock::time_point deadline, const std::string& what) {
  MutexLock lock(&mu_);
  const int64_t epoch = epoch_;
  CondVar wake;  // this receive's own
  // Leaves no empty slot behind when the receive ends without its message.
  auto forget = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = slots_.find(key);
    if (it == slots_.end()) return;
    if (it->second.waiter == &wake) it->second.waiter = nullptr;
    it->second.bell = nullptr;
    if (!it->second.arrived && !it->second.taken && !it->second.waiter) slots_.erase(it);
  };
  for (;;) {
    if (epoch_ != epoch) {
      forget();
      return absl::Status(stopped_.code(),
                          absl::StrCat("abandoned while waiting for ", what, ": ", stopped_.message()));
    }
    if (auto a = aborted_.find({key.pipe, key.step}); a != aborted_.end()) {
      forget();
      return absl::Status(a->second.code(),
                          absl::StrCat("abandoned while waiting for ", what, ": ", a->second.message()));
    }
    if (released_.count(key.pipe)) {
      forget();
      return absl::AbortedError(absl::StrCat("abandoned while waiting for ", what, ": the pipeline was released"));
    }
    if (finished_.count({key.pipe, key.step})) {
      forget();
      return absl::FailedPreconditionError(absl::StrCat("waiting for ", what, " after its step ended here"));
    }
    auto it = slots_.find(key);
    if (it != slots_.end() && it->second.arrived) {
      Slot& slot = it->second;
      c10::IValue t = std::move(slot.value);
      slot.value = c10::IValue();
      slot.arrived = false;
      slot.taken = true;  // kept until the step ends here: a second delivery is dropped
      slot.waiter = nullptr;
      slot.bell = nullptr;
      return t;
    }
    if (auto e = ring_errors_.find(key.pipe); e != ring_errors_.end()) {
      const absl::Status lost = std::move(e->second);
      ring_errors_.erase(e);
      forget();
      return absl::Status(lost.code(),
                          absl::StrCat("waiting for ", what, ": a message before it was lost: ", lost.message()));
    }
    if (Clock::now() >= deadline) {
      forget();
      return absl::DeadlineExceededError("nothing arrived in time: waited for " + what + " until the step's deadline");
    }
    if (it == slots_.end()) it = slots_.emplace(key, Slot{}).first;
    Inbox* const inbox = inbox_of_locked(key.pipe);
    if ((it->second.waiter && it->second.waiter != &wake) || (it->second.bell && it->second.bell != inbox)) {
      return absl::InternalError("two receives wait for " + what);
    }
    if (!inbox) {
      it->second.waiter = &wake;
      wake.WaitWithTimeout(&mu_, absl::FromChrono(deadline - Clock::now()));
      // Woken by the delivery, by an end of the wait (the slot may be gone then), or by the deadline: look again.
      continue;
    }
    // Same-host deliveries: what the rings hold goes into the mailbox, then (if nothing came) a sleep on the bell,
    // which every sender and every event ending this wait rings. The bell is read before looking: a ring after that
    // ends the sleep at once.
    it->second.waiter = nullptr;
    it->second.bell = inbox;
    std::shared_ptr<Inbox> hold = inboxes_.at(key.pipe);  // released meanwhile: the bell stays valid
    const uint32_t seen = hold->bell();
    mu_.Unlock();
    bool empty = false;
    absl::Status drained = pump(*hold, &empty);
    if (drained.ok() && empty) hold->wait(seen, deadline, Inbox::spin_time());
    mu_.Lock();
    if (!drained.ok()) {
      forget();
      return absl::Status(drained.code(), absl::StrCat("waiting for ", what, ": ", drained.message()));
    }
  }
}

absl::Status Mailbox::pump(Inbox& inbox, bool* empty) {
  std::vector<std::tuple<MailKey, c10::IValue, int>> got;
  absl::Status drained = inbox.drain(&got);
  for (auto& [k, v, from] : got) put(k, std::move(v));
  if (empty) *empty = got.empty();
  return drained;
}

absl::StatusOr<std::optional<Mailbox::Go>> Mailbox::take_go(int64_t pipe) {
  std::shared_ptr<Inbox> inbox;
  {
    MutexLock lock(&mu_);
    if (auto it = inboxes_.find(pipe); it != inboxes_.end()) inbox = it->second;
  }
  if (inbox) {
    if (absl::Status drained = pump(*inbox, nullptr); !drained.ok()) {
      MutexLock lock(&mu_);
      if (!released_.count(pipe)) ring_errors_[pipe] = drained;
      return drained;
    }
  }
  MutexLock lock(&mu_);
  for (auto it = dropped_goes_.begin(); it != dropped_goes_.end(); ++it) {
    if (it->pipe != pipe) continue;
    Go go = std::move(*it);
    dropped_goes_.erase(it);
    return std::optional<Go>(std::move(go));
  }
  for (auto it = slots_.lower_bound(MailKey{pipe, std::numeric_limits<int64_t>::min(), kGoStage, 0, false});
       it != slots_.end() && it->first.pipe == pipe; ++it) {
    Slot& slot = it->second;
    if (it->first.stage != kGoStage || !slot.arrived) continue;
    Go go{pipe, it->first.step, std::move(slot.value), absl::OkStatus()};
    slot.value = c10::IValue();
    slot.arrived = false;
    slot.taken = true;  // until the step ends here: a second delivery is dropped
    return std::optional<Go>(std::move(go));
  }
  return std::optional<Go>();
}

void Mailbox::drop_go_locked(const MailKey& key, c10::IValue value, const absl::Status& reason) {
  if (key.stage != kGoStage) return;
  for (const Go& go : dropped_goes_) {
    if (go.pipe == key.pipe && go.step == key.step) return;  // a second delivery: answered once
  }
  dropped_goes_.push_back(Go{key.pipe, key.step, std::move(value), reason});
  // Bounded: the driver of one forgotten lists its worker as giving no reply after its grace.
  if (dropped_goes_.size() > 1000) dropped_goes_.pop_front();
  if (Inbox* inbox = inbox_of_locked(key.pipe)) inbox->ring();  // the idle executor answers it
}

Inbox* Mailbox::inbox_of_locked(int64_t pipe) const {
  auto it = inboxes_.find(pipe);
  return it == inboxes_.end() ? nullptr : it->second.get();
}

void Mailbox::abort(int64_t pipe, int64_t step, absl::Status reason) {
  MutexLock lock(&mu_);
  const StepId id{pipe, step};
  if (aborted_.emplace(id, std::move(reason)).second) {
    aborted_order_.push_back(id);
    if (aborted_order_.size() > 1000) aborted_.erase(aborted_order_.front()), aborted_order_.pop_front();
  }
  // A go not taken yet is answered (with the reason) by the pipeline's executor, when it is free.
  if (auto it = slots_.find(go_key(pipe, step)); it != slots_.end() && it->second.arrived) {
    drop_go_locked(it->first, std::move(it->second.value), aborted_.at(id));
  }
  drop_locked([&](const MailKey& k) { return k.pipe == pipe && k.step == step; });
}

void Mailbox::finish(int64_t pipe, int64_t step) {
  MutexLock lock(&mu_);
  remember(&finished_, &finished_order_, StepId{pipe, step}, kRemembered);
  drop_locked([&](const MailKey& k) { return k.pipe == pipe && k.step == step; });
}

void Mailbox::abort_all(const absl::Status& reason) {
  MutexLock lock(&mu_);
  stopped_ = reason;
  ++epoch_;
  dropped_goes_.clear();  // RPC is stopping: no answer can go
  drop_locked([](const MailKey&) { return true; });
}

void Mailbox::release(int64_t pipe) {
  MutexLock lock(&mu_);
  remember(&released_, &released_order_, pipe, kRemembered);
  drop_locked([&](const MailKey& k) { return k.pipe == pipe; });
  inboxes_.erase(pipe);
  ring_errors_.erase(pipe);
  dropped_goes_.erase(
      std::remove_if(dropped_goes_.begin(), dropped_goes_.end(), [&](const Go& go) { return go.pipe == pipe; }),
      dropped_goes_.end());
}

bool Mailbox::aborted(int64_t pipe, int64_t step) {
  MutexLock lock(&mu_);
  return aborted_.count({pipe, step}) > 0 || released_.count(pipe) > 0;
}

size_t Mailbox::held() {
  MutexLock lock(&mu_);
  return slots_.size() + dropped_goes_.size();
}

Mailbox::Waiting Mailbox::waiting(const MailKey& key) {
  MutexLock lock(&mu_);
  auto it = slots_.find(key);
  if (it == slots_.end()) return Waiting::kNo;
  return it->second.waiter ? Waiting::kAlone : it->second.bell ? Waiting::kOnTheBell : Waiting::kNo;
}

}  // namespace tandem::pipeline::detail
