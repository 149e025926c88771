// Tandem's synchronisation types: a mutex, its scoped lock, a condition variable and a one-shot notification. Every
// Tandem source uses these instead of absl's (or std::mutex where that is simpler).
//
// Why: Debian's abseil is not built with ThreadSanitizer, so the ordering that absl::Mutex, absl::CondVar and
// absl::Notification create is invisible to TSan, and a counter guarded by absl::MutexLock is reported as a race in our
// own frames. These wrappers tell TSan about every happens-before edge they create (__tsan_release before a mutex is
// given up or a notification fired, __tsan_acquire after a mutex is taken or a notification seen), in builds with
// -fsanitize=thread only; in any other build the annotations are nothing and every call is absl's, inlined.
//
// The clang thread-safety annotations work as with absl's types: a Mutex is a capability, members are
// ABSL_GUARDED_BY(mu_), functions ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_).
//
// Every wait that can block (CondVar's, Mutex::Await's while its condition is false, Notification's before it fired)
// tells the calling thread's WaitObserver, if it has one (set_wait_observer), that the thread is about to block and
// when it runs again: the direct channel's loop threads hand their place to run messages to another thread meanwhile.
//
// Thread-safety: as absl's types (a Mutex, CondVar or Notification may be used from any thread). Errors: none; the
// timed waits say whether they timed out, as absl's do.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
// An ordering TSan cannot see, stated where the code relies on it: everything before TANDEM_HAPPENS_BEFORE(x) in one
// thread happens before everything after a TANDEM_HAPPENS_AFTER(x) that follows it in another.
#define TANDEM_HAPPENS_BEFORE(addr) __tsan_release(const_cast<void*>(static_cast<const void*>(addr)))
#define TANDEM_HAPPENS_AFTER(addr) __tsan_acquire(const_cast<void*>(static_cast<const void*>(addr)))
#else
#define TANDEM_HAPPENS_BEFORE(addr) ((void)0)
#define TANDEM_HAPPENS_AFTER(addr) ((void)0)
#endif

namespace tandem {

// Told by the waits of this header (and any other that calls BlockingScope) when its thread blocks and runs again.
// Both calls come from the waiting thread, with whatever lock the wait holds; they must not wait themselves (their
// own waits are not reported: the observer is unset while it is called).
class WaitObserver {
 public:
  virtual void blocking() = 0;
  virtual void unblocked() = 0;

 protected:
  ~WaitObserver() = default;
};

namespace sync_detail {
inline thread_local WaitObserver* wait_observer = nullptr;
}  // namespace sync_detail

// Sets the calling thread's observer (nullptr: none); returns the one it replaces.
inline WaitObserver* set_wait_observer(WaitObserver* observer) {
  WaitObserver* before = sync_detail::wait_observer;
  sync_detail::wait_observer = observer;
  return before;
}

// For its scope, the calling thread is blocked: its observer hears blocking() now and unblocked() at the end. Waits
// inside the scope are not reported again. With `blocks` false (the wait will not block), nothing is reported.
class BlockingScope {
 public:
  explicit BlockingScope(bool blocks = true) : observer_(blocks ? sync_detail::wait_observer : nullptr) {
    if (observer_ == nullptr) return;
    sync_detail::wait_observer = nullptr;
    observer_->blocking();
  }
  BlockingScope(const BlockingScope&) = delete;
  BlockingScope& operator=(const BlockingScope&) = delete;
  ~BlockingScope() {
    if (observer_ == nullptr) return;
    observer_->unblocked();
    sync_detail::wait_observer = observer_;
  }

 private:
  WaitObserver* const observer_;
};

// A predicate for Mutex::Await and friends (absl::Condition: a function and its argument, evaluated under the lock).
using Condition = absl::Condition;

class CondVar;

// An exclusive lock (absl::Mutex) whose lock and unlock TSan sees.
class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  // For a Mutex with static storage duration, initialised before any code runs (ABSL_CONST_INIT).
  explicit constexpr Mutex(absl::ConstInitType) : mu_(absl::kConstInit) {}
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    mu_.Lock();
    TANDEM_HAPPENS_AFTER(this);
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    TANDEM_HAPPENS_BEFORE(this);
    mu_.Unlock();
  }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) {
    if (!mu_.TryLock()) return false;
    TANDEM_HAPPENS_AFTER(this);
    return true;
  }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() { mu_.AssertHeld(); }

  // Unlocks until `cond` holds, then relocks (absl::Mutex::Await). The timed forms return whether `cond` holds.
  void Await(const Condition& cond) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    BlockingScope blocked(blocks(cond));
    TANDEM_HAPPENS_BEFORE(this);
    mu_.Await(cond);
    TANDEM_HAPPENS_AFTER(this);
  }
  bool AwaitWithTimeout(const Condition& cond, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    BlockingScope blocked(blocks(cond));
    TANDEM_HAPPENS_BEFORE(this);
    const bool held = mu_.AwaitWithTimeout(cond, timeout);
    TANDEM_HAPPENS_AFTER(this);
    return held;
  }
  bool AwaitWithDeadline(const Condition& cond, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    BlockingScope blocked(blocks(cond));
    TANDEM_HAPPENS_BEFORE(this);
    const bool held = mu_.AwaitWithDeadline(cond, deadline);
    TANDEM_HAPPENS_AFTER(this);
    return held;
  }

 private:
  // An Await blocks while `cond` is false; told only to a thread with an observer (the condition is not evaluated
  // otherwise).
  static bool blocks(const Condition& cond) { return sync_detail::wait_observer != nullptr && !cond.Eval(); }
  friend class CondVar;
  absl::Mutex mu_;
};

// Holds a Mutex for its scope (absl::MutexLock).
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }

 private:
  Mutex* const mu_;
};

// A condition variable used with a Mutex (absl::CondVar). A wait unlocks and relocks the mutex, and TSan is told so.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    BlockingScope blocked;
    TANDEM_HAPPENS_BEFORE(mu);
    cv_.Wait(&mu->mu_);
    TANDEM_HAPPENS_AFTER(mu);
  }
  // True when the wait timed out (absl::CondVar::WaitWithTimeout).
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    BlockingScope blocked;
    TANDEM_HAPPENS_BEFORE(mu);
    const bool timed_out = cv_.WaitWithTimeout(&mu->mu_, timeout);
    TANDEM_HAPPENS_AFTER(mu);
    return timed_out;
  }
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    BlockingScope blocked;
    TANDEM_HAPPENS_BEFORE(mu);
    const bool timed_out = cv_.WaitWithDeadline(&mu->mu_, deadline);
    TANDEM_HAPPENS_AFTER(mu);
    return timed_out;
  }
  void Signal() { cv_.Signal(); }
  void SignalAll() { cv_.SignalAll(); }

 private:
  absl::CondVar cv_;
};

// A one-shot event (absl::Notification): what a thread did before Notify() is seen by a thread after it saw the
// notification (WaitForNotification, a timed wait that returned true, or HasBeenNotified() returning true).
class Notification {
 public:
  Notification() = default;
  explicit Notification(bool notified) : n_(notified) {}
  Notification(const Notification&) = delete;
  Notification& operator=(const Notification&) = delete;

  void Notify() {
    TANDEM_HAPPENS_BEFORE(this);
    n_.Notify();
  }
  bool HasBeenNotified() const {
    const bool yes = n_.HasBeenNotified();
    if (yes) TANDEM_HAPPENS_AFTER(this);
    return yes;
  }
  void WaitForNotification() const {
    BlockingScope blocked(blocks());
    n_.WaitForNotification();
    TANDEM_HAPPENS_AFTER(this);
  }
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const {
    BlockingScope blocked(blocks());
    const bool yes = n_.WaitForNotificationWithTimeout(timeout);
    if (yes) TANDEM_HAPPENS_AFTER(this);
    return yes;
  }
  bool WaitForNotificationWithDeadline(absl::Time deadline) const {
    BlockingScope blocked(blocks());
    const bool yes = n_.WaitForNotificationWithDeadline(deadline);
    if (yes) TANDEM_HAPPENS_AFTER(this);
    return yes;
  }

 private:
  // A wait blocks until the notification; told only to a thread with an observer.
  bool blocks() const { return sync_detail::wait_observer != nullptr && !n_.HasBeenNotified(); }
  absl::Notification n_;
};

}  // namespace tandem
