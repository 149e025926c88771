// The RRef protocol (docs/rref.md). Everything here runs over rpc: internal functions named "__tandem.rref.*" and a
// value codec for RRefs, so rpc itself knows nothing of references.
#include "tandem/rref/rref.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/log/log.h"
#include "tandem/metrics/metrics.h"
#include "tandem/rpc/detail/ids.h"
#include "tandem/rpc/detail/note_batcher.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"
#include "tandem/rref/detail/descriptor.h"
#include "tandem/sync/sync.h"

namespace tandem::rref {
namespace detail {

using std::chrono::milliseconds;

class RRefImpl : public c10::RRefInterface {
 public:
  // `confirm_by`: when an unconfirmed reference's confirmation (its creation or fork call) completes at the latest.
  RRefImpl(int owner, int64_t rref_id, int64_t fork_id, bool owner_side, bool confirmed, uint64_t generation,
           absl::Time confirm_by = absl::InfiniteFuture());
  ~RRefImpl() override;

  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(owner_); }
  std::string ownerName() const override;
  bool isOwner() const override { return owner_side_; }
  bool confirmedByOwner() const override { return owner_side_ || confirmed_.completed(); }
  const c10::TypePtr type() const override { return c10::AnyType::get(); }

  const int owner_;
  const int64_t rref_id_;
  const int64_t fork_id_;  // 0 for an owner-side handle
  const bool owner_side_;
  const uint64_t generation_;
  // Completes when the owner knows this user reference (at once for owner-side handles and forks from the owner);
  // fails when its creation failed. Its deadline is the confirming call's.
  rpc::Future confirmed_;
};

std::string name_of(int rank);  // below

namespace {

using Descriptor = tandem::wire::RRefDescriptor;
constexpr auto kSelf = Descriptor::SELF;             // sent by the owner to itself: decodes to an owner-side handle
constexpr auto kFromOwner = Descriptor::FROM_OWNER;  // the owner registered the fork before sending: arrives confirmed
constexpr auto kToOwner = Descriptor::TO_OWNER;    // a user sent it to the owner: the owner releases the sender's child
constexpr auto kUserFork = Descriptor::USER_FORK;  // user to user: the receiver asks the owner to register the fork

struct OwnerEntry {
  rpc::Future value;
  std::map<int64_t, int> forks;  // fork id -> rank holding it
  int64_t local_handles = 0;
};

// Pending children are released by the child's accept, and a fork the owner sent (provisional) is made final by its
// receiver's accept; one whose message was never decoded (a reply that came after its call's timeout, a message
// refused or over the size limit) would keep its parent, or the owner's value, forever, so they expire. The message
// carrying the child may take as long as a call (rpc_timeout), and the accept as long as its batch's attempts (3, each
// up to rpc_timeout), so the expiry is RRefOptions::unaccepted_ttl, by default 4 x the RPC timeout and at least 10
// minutes for calls given longer timeouts than the default: expiring too early frees a parent (or a value) that is
// still needed, too late only keeps memory.
constexpr int kNoteAttempts = 3;
std::chrono::milliseconds pending_child_ttl(const RRefOptions& options) {
  if (options.unaccepted_ttl.count() > 0) return options.unaccepted_ttl;
  return std::max<std::chrono::milliseconds>(std::chrono::minutes(10), (kNoteAttempts + 1) * rpc::default_timeout());
}

// The longest wait for an unknown reference a peer may ask of an owner (on_fetch). Real waits are the caller's call
// timeout, which may be hours; this bound only keeps a malformed request from overflowing the deadline arithmetic.
constexpr std::chrono::milliseconds kMaxFetchWait{std::chrono::hours(24)};

constexpr const char* kDelete = "__tandem.rref.delete";
constexpr const char* kAccept = "__tandem.rref.accept";

class Context {
 public:
  static Context& get() {
    static auto* c = new Context;  // never destroyed: handles may die during static destruction
    return *c;
  }

  uint64_t generation() const { return generation_.load(); }
  int64_t new_id() const { return rpc::detail::next_global_id(rank()); }
  // This worker's rank; throws RpcError (FAILED_PRECONDITION) when RPC is not initialized.
  int rank() const {
    const int r = rpc::detail::self_rank_or(-1);
    return r >= 0 ? r : rpc::get_worker_info().id;
  }
  void configure(const RRefOptions& options) {
    MutexLock lock(&mu_);
    options_ = options;
  }

  // Owner side. Messages about one RRef come from several workers over several connections, so they arrive in any
  // order: a fork may be registered before the creation it descends from. Whichever comes first makes the entry;
  // the value future is made once and the creation completes it.
  rpc::Future create_entry(int64_t rref_id, int64_t fork_id, int holder) {
    MutexLock lock(&mu_);
    auto& e = owners_[rref_id];
    if (fork_id != 0) e.forks[fork_id] = holder;
    start_probe_locked();
    if (auto w = awaiting_.find(rref_id); w != awaiting_.end()) {  // fetches that overtook the creation
      for (auto& [deadline, waiter] : w->second) rpc::forward(e.value, waiter);
      awaiting_.erase(w);
    }
    return e.value;
  }
  // The value of `rref_id`; when the owner has not heard of it yet (a fetch may overtake the creation it follows), a
  // future that its creation completes, or that fails with NOT_FOUND after `wait`. No entry is made for it.
  rpc::Future value_or_wait(int64_t rref_id, milliseconds wait) {
    MutexLock lock(&mu_);
    if (auto it = owners_.find(rref_id); it != owners_.end()) return it->second.value;
    rpc::Future waiter;
    awaiting_[rref_id].emplace_back(std::chrono::steady_clock::now() + wait, waiter);
    start_probe_locked();
    return waiter;
  }
  absl::StatusOr<rpc::Future> value_of(int64_t rref_id) {
    MutexLock lock(&mu_);
    auto it = owners_.find(rref_id);
    if (it == owners_.end()) return missing(rref_id);
    return it->second.value;
  }
  // From a user's fork request (the entry may not exist yet, see create_entry).
  absl::Status add_fork(int64_t rref_id, int64_t fork_id, int holder) {
    create_entry(rref_id, fork_id, holder);
    return absl::OkStatus();
  }
  // From the owner's own codec (it holds a handle: the entry exists): a fork sent to `holder`, provisional until the
  // holder's accept says it decoded it (accepted()); dropped after the expiry otherwise (see pending_child_ttl).
  void add_sent_fork(int64_t rref_id, int64_t fork_id, int holder) {
    create_entry(rref_id, fork_id, holder);
    MutexLock lock(&mu_);
    provisional_[fork_id] = {rref_id, std::chrono::steady_clock::now()};
  }
  void remove_fork(int64_t rref_id, int64_t fork_id) {
    std::vector<rpc::Future> freed;  // destroyed after the lock is released (see maybe_free_locked)
    MutexLock lock(&mu_);
    provisional_.erase(fork_id);
    auto it = owners_.find(rref_id);
    if (it == owners_.end()) return;  // deletes are idempotent
    it->second.forks.erase(fork_id);
    maybe_free_locked(it, &freed);
  }
  // A receiver's accept of `child`: the parent this worker kept for it may go, or the fork this owner sent is final.
  void accepted(int64_t child) {
    c10::intrusive_ptr<RRefImpl> keep;  // destroyed outside the lock (its destructor may send a delete)
    MutexLock lock(&mu_);
    provisional_.erase(child);
    auto it = pending_children_.find(child);
    if (it == pending_children_.end()) return;
    keep = std::move(it->second.first);
    pending_children_.erase(it);
  }
  // A handle on the owner. The entry may not exist yet when the reference overtook its own creation (see
  // create_entry); the creation will fill the value.
  absl::StatusOr<c10::intrusive_ptr<RRefImpl>> owner_handle(int64_t rref_id) {
    MutexLock lock(&mu_);
    ++owners_[rref_id].local_handles;
    return c10::make_intrusive<RRefImpl>(rank(), rref_id, 0, true, true, generation());
  }
  void release_handle(int64_t rref_id, uint64_t generation) {
    std::vector<rpc::Future> freed;
    MutexLock lock(&mu_);
    if (generation != generation_) return;
    auto it = owners_.find(rref_id);
    if (it == owners_.end()) return;
    --it->second.local_handles;
    maybe_free_locked(it, &freed);
  }

  // User side.
  void hold_pending_user(const c10::intrusive_ptr<RRefImpl>& user) {
    MutexLock lock(&mu_);
    pending_users_[user->fork_id_] = user;
  }
  void release_pending_user(int64_t fork_id) {
    c10::intrusive_ptr<RRefImpl> keep;  // destroyed outside the lock (its destructor may send a delete)
    MutexLock lock(&mu_);
    auto it = pending_users_.find(fork_id);
    if (it == pending_users_.end()) return;
    keep = std::move(it->second);
    pending_users_.erase(it);
  }
  void hold_pending_child(int64_t child, c10::intrusive_ptr<RRefImpl> parent) {
    MutexLock lock(&mu_);
    pending_children_[child] = {std::move(parent), std::chrono::steady_clock::now()};
    start_probe_locked();
  }
  void release_pending_child(int64_t child) {
    c10::intrusive_ptr<RRefImpl> keep;
    MutexLock lock(&mu_);
    auto it = pending_children_.find(child);
    if (it == pending_children_.end()) return;
    keep = std::move(it->second.first);
    pending_children_.erase(it);
  }

  Stats stats() {
    MutexLock lock(&mu_);
    Stats s;
    s.owned_values = static_cast<int64_t>(owners_.size());
    for (const auto& [id, e] : owners_) s.known_forks += static_cast<int64_t>(e.forks.size());
    s.user_refs = user_refs.load();
    s.pending_children = static_cast<int64_t>(pending_children_.size() + provisional_.size());
    s.pending_confirmations = static_cast<int64_t>(pending_users_.size());
    s.failed_notes = failed_notes.load();
    return s;
  }

  // Graceful shutdown: confirmations and accepts in flight settle before the workers leave.
  absl::Status drain(absl::Time deadline) {
    batcher.flush();
    MutexLock lock(&mu_);
    while (!settled()) {
      mu_.Unlock();
      batcher.flush();  // accepts owed to other workers
      mu_.Lock();
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("rref: ", pending_users_.size(), " confirmations and ",
                                                        pending_children_.size(), " child acceptances still pending"));
      }
      // A poll (the batcher is flushed each round), which ends early when the last pending entry goes.
      mu_.AwaitWithTimeout(Condition(this, &Context::settled), absl::Milliseconds(2));
    }
    return absl::OkStatus();
  }

  // RPC stopped: every reference of this job is void. Values are freed; handles still held by user code become inert.
  void reset() {
    std::unordered_map<int64_t, OwnerEntry> owners;
    std::unordered_map<int64_t, c10::intrusive_ptr<RRefImpl>> users;
    std::unordered_map<int64_t, std::pair<c10::intrusive_ptr<RRefImpl>, std::chrono::steady_clock::time_point>>
        children;
    std::thread probe;
    {
      MutexLock lock(&mu_);
      ++generation_;
      stop_probe_ = true;  // ends the probe's wait, and no probe starts until it is joined
      owners.swap(owners_);
      users.swap(pending_users_);
      children.swap(pending_children_);
      provisional_.clear();
      awaiting_.clear();
      probe = std::move(probe_);
    }
    batcher.stop();
    if (probe.joinable()) probe.join();
    MutexLock lock(&mu_);
    stop_probe_ = false;
  }

  // accept and delete notes: one-way, so they are sent in batches per destination (flushed within 1 ms or at 256
  // pairs), which divides the protocol's message count for short-lived references. Notes are idempotent (a fork
  // already deleted, a child already released: nothing happens), so a lost batch is sent again, 3 times in all; a
  // batch that still fails counts in failed_notes (its destination is gone).
  rpc::detail::NoteBatcher batcher{batcher_options()};
  std::atomic<int64_t> failed_notes{0};
  std::atomic<int64_t> user_refs{0};

 private:
  static rpc::detail::NoteBatcher::Options batcher_options() {
    rpc::detail::NoteBatcher::Options o;
    o.policy = rpc::detail::NoteBatcher::Policy::kEveryDelay;
    o.flush_delay = absl::Milliseconds(1);
    o.max_values = 2 * 256;  // (a, b) pairs
    o.attempts = kNoteAttempts;
    o.on_failure = [](int to, const std::string& function, const absl::Status& error, int64_t notes) {
      ++Context::get().failed_notes;
      if (error.code() == absl::StatusCode::kCancelled) return;  // RPC stops here: nothing more can be sent
      // Deletes or accepts that never arrived: their values stay on that worker until it stops.
      TANDEM_LOG(kWarn, "rref") << notes << " reference note(s) with '" << function << "' to worker " << name_of(to)
                                << " failed for good (" << kNoteAttempts << " attempts): " << error;
    };
    return o;
  }

  static absl::Status missing(int64_t rref_id) {
    return absl::NotFoundError(absl::StrCat("RRef ", rref_id, " does not exist on its owner (already freed?)"));
  }

  bool settled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_users_.empty() && pending_children_.empty();
  }

  // Frees the entry when nothing refers to it any more. Its value moves to `freed`, which the caller destroys after
  // releasing mu_: a value may hold RRefs owned here (an RRef of an RRef), whose destructors take mu_.
  void maybe_free_locked(std::unordered_map<int64_t, OwnerEntry>::iterator it, std::vector<rpc::Future>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!it->second.forks.empty() || it->second.local_handles != 0) return;
    TANDEM_LOG(kDebug, "rref") << "rref " << it->first << ": no reference left anywhere, value freed";
    freed->push_back(std::move(it->second.value));
    owners_.erase(it);
  }

  // Liveness of the workers holding this owner's references, and expiry of stale pending children.
  void start_probe_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (probe_.joinable() || stop_probe_) return;
    probe_ = std::thread([this] { probe_loop(); });
  }

  void probe_loop() {
    MutexLock lock(&mu_);
    while (!stop_probe_) {
      const milliseconds interval = options_.probe_interval;
      mu_.AwaitWithTimeout(Condition(&stop_probe_), absl::FromChrono(interval));
      if (stop_probe_) return;
      std::set<int> holders;
      const int me = rpc::detail::self_rank_or(-1);
      for (const auto& [id, e] : owners_) {
        for (const auto& [fork, holder] : e.forks) {
          if (holder != me) holders.insert(holder);
        }
      }
      const auto now = std::chrono::steady_clock::now();
      const auto ttl = pending_child_ttl(options_);
      std::vector<c10::intrusive_ptr<RRefImpl>> expired;
      for (auto it = pending_children_.begin(); it != pending_children_.end();) {
        if (now - it->second.second > ttl) {
          expired.push_back(std::move(it->second.first));
          it = pending_children_.erase(it);
        } else {
          ++it;
        }
      }
      std::vector<rpc::Future> unread;  // values only forks nobody decoded kept
      for (auto it = provisional_.begin(); it != provisional_.end();) {
        if (now - it->second.second <= ttl) {
          ++it;
          continue;
        }
        const auto [rref_id, fork_id] = std::pair(it->second.first, it->first);
        it = provisional_.erase(it);
        TANDEM_LOG(kWarn, "rref") << "rref " << rref_id << ": fork " << fork_id
                                  << " sent by this owner was never accepted by its receiver within " << ttl.count()
                                  << " ms (the message was not decoded there): dropped";
        if (auto entry = owners_.find(rref_id); entry != owners_.end()) {
          entry->second.forks.erase(fork_id);
          maybe_free_locked(entry, &unread);
        }
      }
      std::vector<std::pair<int64_t, rpc::Future>> timed_out;
      for (auto it = awaiting_.begin(); it != awaiting_.end();) {
        auto& waiters = it->second;
        for (auto w = waiters.begin(); w != waiters.end();) {
          if (now > w->first) {
            timed_out.emplace_back(it->first, w->second);
            w = waiters.erase(w);
          } else {
            ++w;
          }
        }
        it = waiters.empty() ? awaiting_.erase(it) : std::next(it);
      }
      mu_.Unlock();
      expired.clear();
      unread.clear();
      for (auto& [id, f] : timed_out) f.set_error(missing(id));
      std::vector<int> dead;
      for (int h : holders) {
        rpc::Future ping = rpc::call(h, "__tandem.rref.ping", {}, interval);
        if (ping.status().code() == absl::StatusCode::kUnavailable) dead.push_back(h);
      }
      mu_.Lock();
      std::vector<rpc::Future> freed;
      for (int h : dead) {
        TANDEM_LOG(kWarn, "rref") << "rank " << h
                                  << " does not answer: dropping the references it held to this owner's values";
        drop_holder_locked(h, &freed);
      }
      if (!freed.empty()) {  // values are destroyed without mu_ (see maybe_free_locked)
        mu_.Unlock();
        freed.clear();
        mu_.Lock();
      }
    }
  }

  void drop_holder_locked(int holder, std::vector<rpc::Future>* freed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = owners_.begin(); it != owners_.end();) {
      auto& forks = it->second.forks;
      for (auto f = forks.begin(); f != forks.end();) {
        if (f->second != holder) {
          ++f;
          continue;
        }
        provisional_.erase(f->first);
        f = forks.erase(f);
      }
      if (forks.empty() && it->second.local_handles == 0) {
        freed->push_back(std::move(it->second.value));
        it = owners_.erase(it);
      } else {
        ++it;
      }
    }
  }

  Mutex mu_;
  std::unordered_map<int64_t, OwnerEntry> owners_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<int64_t, c10::intrusive_ptr<RRefImpl>> pending_users_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<int64_t, std::pair<c10::intrusive_ptr<RRefImpl>, std::chrono::steady_clock::time_point>>
      pending_children_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<int64_t, std::vector<std::pair<std::chrono::steady_clock::time_point, rpc::Future>>> awaiting_
      ABSL_GUARDED_BY(mu_);
  // Forks this owner sent and their receivers have not accepted yet: fork id -> (rref id, when sent).
  std::unordered_map<int64_t, std::pair<int64_t, std::chrono::steady_clock::time_point>> provisional_
      ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{1};
  RRefOptions options_ ABSL_GUARDED_BY(mu_);  // configure() may run while the probe reads it
  std::thread probe_ ABSL_GUARDED_BY(mu_);
  bool stop_probe_ ABSL_GUARDED_BY(mu_) = false;  // the probe's wait ends when it is set
};

// Registered classes and their methods (remote objects).
struct Classes {
  Mutex mu;
  std::map<std::string, Constructor> constructors ABSL_GUARDED_BY(mu);
  std::map<std::pair<std::string, std::string>, Method> methods ABSL_GUARDED_BY(mu);
};
Classes& classes() {
  static auto* c = new Classes;  // never destroyed: RPC threads may use it until exit
  return *c;
}

int64_t arg_int(const std::vector<c10::IValue>& args, size_t i) {
  if (i >= args.size() || !args[i].isInt()) throw_error(absl::InvalidArgumentError("malformed rref protocol message"));
  return args[i].toInt();
}

// Best effort: if the sender is gone, so is the parent it kept.
void send_accept(int to, int64_t child) { Context::get().batcher.add(to, kAccept, {child, 0}); }

// ---- the codec

absl::StatusOr<std::string> encode(const c10::IValue& v, int to) {
  auto* impl = dynamic_cast<RRefImpl*>(v.toRRef().get());
  if (!impl) return absl::InvalidArgumentError("cannot send an RRef that Tandem did not create");
  auto& ctx = Context::get();
  if (impl->generation_ != ctx.generation())
    return absl::FailedPreconditionError("this RRef belongs to a finished job");
  Descriptor w;
  w.set_rref_id(impl->rref_id_);
  w.set_owner(impl->owner_);
  w.set_fork_id(ctx.new_id());
  if (impl->owner_side_) {
    if (to == impl->owner_) {
      // Back to the owner itself (a call to self): the value must outlive this handle until the message is decoded.
      w.set_kind(kSelf);
      ctx.hold_pending_child(w.fork_id(), c10::intrusive_ptr<RRefImpl>::reclaim_copy(impl));
    } else {
      w.set_kind(kFromOwner);
      ctx.add_sent_fork(impl->rref_id_, w.fork_id(), to);
    }
  } else {
    w.set_kind(to == impl->owner_ ? kToOwner : kUserFork);
    ctx.hold_pending_child(w.fork_id(), c10::intrusive_ptr<RRefImpl>::reclaim_copy(impl));
  }
  return w.SerializeAsString();
}

absl::StatusOr<c10::IValue> decode(const std::string& data, int from, std::vector<rpc::Future>* wait) {
  auto parsed = detail::parse_descriptor(data);
  if (!parsed.ok()) return parsed.status();
  const Descriptor& w = *parsed;
  auto& ctx = Context::get();
  if (w.owner() == ctx.rank()) {
    if (w.kind() == kUserFork) return absl::InvalidArgumentError("malformed RRef: a user fork sent to its owner");
    auto handle = ctx.owner_handle(w.rref_id());
    if (!handle.ok()) return handle.status();
    if (w.kind() == kToOwner) send_accept(from, w.fork_id());
    if (w.kind() == kSelf && from == ctx.rank()) ctx.release_pending_child(w.fork_id());
    return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(*handle));
  }
  if (w.kind() == kFromOwner) {
    send_accept(w.owner(), w.fork_id());  // the owner's fork for this reference is final
    return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(
        c10::make_intrusive<RRefImpl>(w.owner(), w.rref_id(), w.fork_id(), false, true, ctx.generation())));
  }
  if (w.kind() != kUserFork) return absl::InvalidArgumentError("malformed RRef: its kind does not fit its owner");
  // Confirmed by the fork's registration below, a call with RPC's timeout: a wait for it has the same deadline (it
  // had a fixed 5 minutes, whatever the user's timeout).
  auto user = c10::make_intrusive<RRefImpl>(w.owner(), w.rref_id(), w.fork_id(), false, false, ctx.generation(),
                                            absl::Now() + absl::FromChrono(rpc::default_timeout()));
  ctx.hold_pending_user(user);  // G1: it cannot be deleted before the owner knows it
  const int64_t fork = w.fork_id();
  TANDEM_LOG(kDebug, "rref") << "rref " << w.rref_id() << " received from rank " << from << " as fork " << fork
                             << ": registering it with its owner, rank " << w.owner();
  rpc::Future registered = rpc::call(w.owner(), "__tandem.rref.fork", {c10::IValue(w.rref_id()), c10::IValue(fork)});
  rpc::Future confirmed = user->confirmed_;
  registered.add_callback([confirmed, fork, from](const rpc::Future& r) {
    const absl::Status s = r.status();
    confirmed.set_status(s);
    if (s.ok()) send_accept(from, fork);  // G2: now the parent may go
    Context::get().release_pending_user(fork);
  });
  wait->push_back(confirmed);  // user code sees the reference only once its owner knows it
  return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(user));
}

// ---- protocol functions (owner side unless stated)

rpc::Future on_create(std::vector<c10::IValue>&& args) {
  // args: rref id, fork id, function, arguments (a list)
  const int64_t rref_id = arg_int(args, 0), fork_id = arg_int(args, 1);
  if (args.size() != 4 || !args[2].isString() || !args[3].isList()) {
    throw_error(absl::InvalidArgumentError("malformed rref create"));
  }
  const std::string function = args[2].toStringRef();
  std::vector<c10::IValue> fargs(args[3].toListRef().begin(), args[3].toListRef().end());
  const auto* call = rpc::current_call();
  TANDEM_LOG(kDebug, "rref") << "rref " << rref_id << " created here by rank " << (call ? call->caller_rank : -1)
                             << " (fork " << fork_id << "), value from '" << function << "'";
  rpc::Future value = Context::get().create_entry(rref_id, fork_id, call ? call->caller_rank : -1);
  rpc::Handler handler = rpc::find_function(function);
  if (!handler) {
    value.set_error(absl::NotFoundError(absl::StrCat("no function named '", function, "' is registered on worker '",
                                                     rpc::get_worker_info().name, "'")));
  } else {
    try {
      rpc::forward(handler(std::move(fargs)), value);
    } catch (...) {
      value.set_error(status_from_current_exception());
    }
  }
  return rpc::Future::ready(c10::IValue());  // the creator's confirmation; the value follows in its own time
}

rpc::Future on_fetch(std::vector<c10::IValue>&& args) {  // rref, how long to wait for an unknown one (ms)
  return Context::get().value_or_wait(arg_int(args, 0),
                                      milliseconds(std::clamp<int64_t>(arg_int(args, 1), 0, kMaxFetchWait.count())));
}

rpc::Future on_fork(std::vector<c10::IValue>&& args) {
  const auto* call = rpc::current_call();
  TANDEM_LOG(kDebug, "rref") << "rref " << arg_int(args, 0) << ": fork " << arg_int(args, 1) << " held by rank "
                             << (call ? call->caller_rank : -1);
  auto s = Context::get().add_fork(arg_int(args, 0), arg_int(args, 1), call ? call->caller_rank : -1);
  return s.ok() ? rpc::Future::ready(c10::IValue()) : rpc::Future::failed(s);
}

// Batched notes: a flat list of (a, b) pairs.
std::vector<int64_t> note_pairs(const std::vector<c10::IValue>& args) {
  const absl::Status malformed = absl::InvalidArgumentError("malformed rref note batch");
  if (args.size() != 1 || !args[0].isList()) throw_error(malformed);
  std::vector<int64_t> v;
  for (const auto& x : args[0].toListRef()) {
    if (!x.isInt()) throw_error(malformed);
    v.push_back(x.toInt());
  }
  if (v.size() % 2 != 0) throw_error(malformed);
  return v;
}

rpc::Future on_delete(std::vector<c10::IValue>&& args) {  // (rref, fork) pairs
  const auto v = note_pairs(args);
  for (size_t i = 0; i < v.size(); i += 2) Context::get().remove_fork(v[i], v[i + 1]);
  return rpc::Future::ready(c10::IValue());
}

rpc::Future on_accept(std::vector<c10::IValue>&& args) {  // (child, 0) pairs, on the parent's holder
  const auto v = note_pairs(args);
  for (size_t i = 0; i < v.size(); i += 2) Context::get().accepted(v[i]);
  return rpc::Future::ready(c10::IValue());
}

rpc::Future on_construct(std::vector<c10::IValue>&& args) {
  if (args.empty() || !args[0].isString()) throw_error(absl::InvalidArgumentError("malformed rref construct"));
  const std::string name = args[0].toStringRef();
  Constructor ctor;
  {
    Classes& c = classes();
    MutexLock lock(&c.mu);
    auto it = c.constructors.find(name);
    if (it == c.constructors.end()) {
      throw_error(absl::NotFoundError(
          absl::StrCat("no class named '", name, "' is registered on worker '", rpc::get_worker_info().name, "'")));
    }
    ctor = it->second;
  }
  auto object = c10::make_intrusive<Object>();
  object->class_name = name;
  object->instance = ctor(std::vector<c10::IValue>(args.begin() + 1, args.end()));
  return rpc::Future::ready(c10::IValue::make_capsule(object));
}

rpc::Future on_call(std::vector<c10::IValue>&& args) {
  if (args.size() < 2 || !args[1].isString()) throw_error(absl::InvalidArgumentError("malformed rref method call"));
  auto value = Context::get().value_of(arg_int(args, 0));
  if (!value.ok()) return rpc::Future::failed(value.status());
  const std::string method = args[1].toStringRef();
  auto rest = std::make_shared<std::vector<c10::IValue>>(args.begin() + 2, args.end());
  rpc::Future result;
  // The method may run later on another thread (the object is still being built): it keeps the caller's scope (e.g.
  // its distributed autograd context).
  std::function<void()> run = rpc::bind_call_scope([result, method, rest, v = *value] {
    try {
      const c10::IValue& holder = v.value();
      auto* object = holder.isCapsule() ? dynamic_cast<Object*>(holder.toCapsule().get()) : nullptr;
      if (!object) throw_error(absl::InvalidArgumentError("the RRef does not refer to a remote object"));
      Method m;
      {
        Classes& c = classes();
        MutexLock lock(&c.mu);
        auto it = c.methods.find({object->class_name, method});
        if (it == c.methods.end()) {
          throw_error(
              absl::NotFoundError(absl::StrCat("class '", object->class_name, "' has no method '", method, "'")));
        }
        m = it->second;
      }
      rpc::forward(m(object->instance.get(), std::move(*rest)), result);
    } catch (...) {
      result.set_error(status_from_current_exception());
    }
  });
  value->add_callback([run = std::move(run)](const rpc::Future&) { run(); });
  return result;
}

bool install() {
  rpc::register_value_codec({"rref", [](const c10::IValue& v) { return v.isRRef(); }, encode, decode});
  throw_if_error(rpc::register_handler("__tandem.rref.create", on_create));
  throw_if_error(rpc::register_handler("__tandem.rref.fetch", on_fetch));
  throw_if_error(rpc::register_handler("__tandem.rref.fork", on_fork));
  throw_if_error(rpc::register_handler(kDelete, on_delete));
  throw_if_error(rpc::register_handler(kAccept, on_accept));
  throw_if_error(rpc::register_handler("__tandem.rref.construct", on_construct));
  throw_if_error(rpc::register_handler(RRef::kCallMethod, on_call));
  throw_if_error(rpc::register_handler("__tandem.rref.ping",
                                       [](std::vector<c10::IValue>&&) { return rpc::Future::ready(c10::IValue()); }));
  rpc::add_shutdown_hook([](absl::Time deadline) { return Context::get().drain(deadline); });
  rpc::add_stop_hook([] { Context::get().reset(); });
  metrics::set_gauge("tandem_rrefs_owned", [] { return static_cast<double>(Context::get().stats().owned_values); });
  metrics::set_gauge("tandem_rref_forks_known", [] { return static_cast<double>(Context::get().stats().known_forks); });
  metrics::set_gauge("tandem_rref_user_refs", [] { return static_cast<double>(Context::get().stats().user_refs); });
  metrics::set_gauge("tandem_rref_pending", [] {
    const Stats s = Context::get().stats();
    return static_cast<double>(s.pending_children + s.pending_confirmations);
  });
  return true;
}

const bool g_installed = install();

}  // namespace

RRefImpl::RRefImpl(int owner, int64_t rref_id, int64_t fork_id, bool owner_side, bool confirmed, uint64_t generation,
                   absl::Time confirm_by)
    : owner_(owner),
      rref_id_(rref_id),
      fork_id_(fork_id),
      owner_side_(owner_side),
      generation_(generation),
      confirmed_(confirm_by) {
  if (confirmed) confirmed_.set_value(c10::IValue());
  if (!owner_side_) ++Context::get().user_refs;
}

RRefImpl::~RRefImpl() {
  auto& ctx = Context::get();
  if (owner_side_) {
    ctx.release_handle(rref_id_, generation_);
    return;
  }
  --ctx.user_refs;
  if (generation_ != ctx.generation()) return;  // its job is over
  // G1: the owner learns of every deletion. A user whose creation failed may still be known to the owner (the reply
  // was lost, not the request): deletes are idempotent, so it is sent anyway.
  TANDEM_LOG(kDebug, "rref") << "rref " << rref_id_ << ": fork " << fork_id_ << " deleted, telling its owner, rank "
                             << owner_;
  ctx.batcher.add(owner_, kDelete, {rref_id_, fork_id_});
}

// A worker's name, or "rank N" once RPC is down (errors are still worth a name).
std::string name_of(int rank) {
  const auto info = rpc::find_worker_info(rank);
  return info ? info->name : "rank " + std::to_string(rank);
}

std::string RRefImpl::ownerName() const { return name_of(owner_); }

void register_class_impl(const std::string& name, Constructor constructor) {
  Classes& c = classes();
  MutexLock lock(&c.mu);
  c.constructors[name] = std::move(constructor);
}

void register_method_impl(const std::string& class_name, const std::string& method, Method m) {
  Classes& c = classes();
  MutexLock lock(&c.mu);
  c.methods[{class_name, method}] = std::move(m);
}

}  // namespace detail

// ---- RRef

RRef::RRef(c10::intrusive_ptr<c10::RRefInterface> impl) : impl_(std::move(impl)) {}

RRef RRef::from_ivalue(const c10::IValue& value) {
  if (!value.isRRef()) throw RpcError(absl::InvalidArgumentError("the value is not an RRef"));
  auto ptr = value.toRRef();
  auto* impl = dynamic_cast<detail::RRefImpl*>(ptr.get());
  if (!impl) throw RpcError(absl::InvalidArgumentError("the RRef was not created by Tandem"));
  return RRef(ptr);
}

c10::IValue RRef::to_ivalue() const { return c10::IValue(impl_); }

namespace {
const detail::RRefImpl& checked(const c10::intrusive_ptr<c10::RRefInterface>& impl) {
  if (!impl) throw RpcError(absl::FailedPreconditionError("empty RRef"));
  return static_cast<const detail::RRefImpl&>(*impl);
}
}  // namespace

int RRef::owner() const { return checked(impl_).owner_; }
std::string RRef::owner_name() const { return checked(impl_).ownerName(); }
bool RRef::is_owner() const { return checked(impl_).owner_side_; }
bool RRef::confirmed_by_owner() const { return checked(impl_).confirmedByOwner(); }
int64_t RRef::id() const { return checked(impl_).rref_id_; }

namespace {
absl::Status to_here_error(int owner, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("to_here of an RRef owned by ", detail::name_of(owner), " (rank ", owner,
                                             "): ", s.message()));
}

// A timeout as given (non-positive: RpcOptions::rpc_timeout).
std::chrono::milliseconds or_default(std::chrono::milliseconds timeout) {
  return timeout.count() > 0 ? timeout : rpc::default_timeout();
}

// The fetch: sent at once, even before the owner confirmed the reference; the owner waits for a creation it has not
// seen yet (bounded by the same timeout).
std::vector<c10::IValue> fetch_args(int64_t rref_id, std::chrono::milliseconds timeout) {
  return {c10::IValue(rref_id), c10::IValue(static_cast<int64_t>(or_default(timeout).count()))};
}
}  // namespace

rpc::Future RRef::to_here_async(std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  if (impl.owner_side_) {
    auto value = detail::Context::get().value_of(impl.rref_id_);
    if (!value.ok()) return rpc::Future::failed(value.status());
    // The value may still be being made: the wait on it is bounded by the timeout, as a fetch's would be.
    rpc::Future result(absl::Now() + absl::FromChrono(or_default(timeout)),
                       absl::StrCat("to_here() of RRef ", impl.rref_id_, " on its owner '", impl.ownerName(), "'"));
    rpc::forward(*value, result);
    return result;
  }
  rpc::Future fetch = rpc::call(impl.owner_, "__tandem.rref.fetch", fetch_args(impl.rref_id_, timeout), timeout);
  rpc::Future result(fetch.deadline());
  fetch.add_callback([result, owner = impl.owner_](const rpc::Future& fetched) {
    const absl::Status s = fetched.status();
    result.set_status(s.ok() ? s : to_here_error(owner, s), s.ok() ? fetched.value() : c10::IValue());
  });
  return result;
}

c10::IValue RRef::to_here(std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  if (impl.owner_side_) {
    rpc::Future value = to_here_async(timeout);
    const std::chrono::milliseconds wait = or_default(timeout);
    if (!value.wait_for(wait)) {
      throw_error(to_here_error(impl.owner_, absl::DeadlineExceededError(absl::StrCat("the value was not ready within ",
                                                                                      wait.count(), " ms"))));
    }
    return value.value();
  }
  // Blocking: rpc's call_and_wait lets the calling thread read its own reply (one hand-off less).
  rpc::Future fetched =
      rpc::call_and_wait(impl.owner_, "__tandem.rref.fetch", fetch_args(impl.rref_id_, timeout), timeout);
  if (absl::Status s = fetched.status(); !s.ok()) throw RpcError(to_here_error(impl.owner_, s));
  return fetched.value();
}

rpc::Future RRef::call_method(const std::string& method, std::vector<c10::IValue> args,
                              std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  args.insert(args.begin(), {c10::IValue(impl.rref_id_), c10::IValue(method)});
  // The owner knows the object once it has confirmed this reference; a call sent earlier could overtake the creation.
  // The result is due by the confirmation's deadline (now, if confirmed) plus the call's timeout.
  const absl::Time confirmed_by = impl.confirmed_.completed() ? absl::Now() : impl.confirmed_.deadline();
  rpc::Future result(confirmed_by + absl::FromChrono(or_default(timeout)));
  impl.confirmed_.add_callback([result, owner = impl.owner_, args = std::move(args), timeout](const rpc::Future& c) {
    if (absl::Status s = c.status(); !s.ok()) return (void)result.set_error(s);
    rpc::forward(rpc::call(owner, kCallMethod, args, timeout), result);
  });
  return result;
}

rpc::Future RRef::call_method_and_wait(const std::string& method, std::vector<c10::IValue> args,
                                       std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  if (!impl.confirmed_.completed() || !impl.confirmed_.status().ok()) {
    rpc::Future result = call_method(method, std::move(args), timeout);
    (void)result.status();  // waits, bounded by the confirmation's deadline plus the call's timeout
    return result;
  }
  args.insert(args.begin(), {c10::IValue(impl.rref_id_), c10::IValue(method)});
  return rpc::call_and_wait(impl.owner_, kCallMethod, std::move(args), timeout);
}

RRef RRef::remote_method(const std::string& method, std::vector<c10::IValue> args,
                         std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  // As in call_method: the creation on the owner must not overtake this reference's own (bounded by the confirming
  // call's deadline; usually done).
  throw_if_error(impl.confirmed_.status());
  args.insert(args.begin(), {c10::IValue(impl.rref_id_), c10::IValue(method)});
  return remote_call(impl.owner_, kCallMethod, std::move(args), timeout);
}

c10::IValue RRef::local_value() const {
  const auto& impl = checked(impl_);
  // A handle made on the owner for itself (remote() to self) is a user handle living where the value is: allowed.
  if (!impl.owner_side_ && impl.owner_ != detail::Context::get().rank()) {
    throw RpcError(absl::FailedPreconditionError("local_value() on a user RRef: only its owner holds the value"));
  }
  // A user handle on the owner may run ahead of the creation message it sent itself: wait for the entry as fetches do.
  const std::chrono::milliseconds wait = rpc::default_timeout();
  absl::StatusOr<rpc::Future> value =
      impl.owner_side_ ? detail::Context::get().value_of(impl.rref_id_)
                       : absl::StatusOr<rpc::Future>(detail::Context::get().value_or_wait(impl.rref_id_, wait));
  throw_if_error(value.status());
  // As in PyTorch, the owner waits for a value still being made (bounded by the RPC timeout, which the value's function
  // has too).
  if (!value->wait_for(wait)) {
    throw_error(absl::DeadlineExceededError(
        absl::StrCat("the RRef's value was not ready within ", wait.count(), " ms (RpcOptions::rpc_timeout)")));
  }
  return value->value();
}

RRef remote_call(const rpc::To& to, const std::string& function, std::vector<c10::IValue> args,
                 std::chrono::milliseconds timeout) {
  auto& ctx = detail::Context::get();
  const int owner = to.rank() >= 0 ? rpc::get_worker_info(to.rank()).id : rpc::get_worker_info(to.name()).id;
  const int64_t rref_id = ctx.new_id();
  const int64_t fork_id = ctx.new_id();
  // Confirmed by the creation call below, which completes by its deadline.
  const absl::Time confirm_by = absl::Now() + absl::FromChrono(or_default(timeout));
  auto user =
      c10::make_intrusive<detail::RRefImpl>(owner, rref_id, fork_id, false, false, ctx.generation(), confirm_by);
  ctx.hold_pending_user(user);  // until the owner confirms: it cannot be deleted before (G1)
  c10::impl::GenericList list(c10::AnyType::get());
  for (auto& a : args) list.push_back(std::move(a));
  rpc::Future created =
      rpc::call(owner, "__tandem.rref.create",
                {c10::IValue(rref_id), c10::IValue(fork_id), c10::IValue(function), c10::IValue(list)}, timeout);
  rpc::Future confirmed = user->confirmed_;
  TANDEM_LOG(kDebug, "rref") << "rref " << rref_id << " (fork " << fork_id << "): creating it on rank " << owner
                             << " from '" << function << "'";
  created.add_callback([confirmed, fork_id, rref_id](const rpc::Future& r) {
    if (r.status().ok()) {
      TANDEM_LOG(kDebug, "rref") << "rref " << rref_id << ": its owner confirmed fork " << fork_id;
    } else {
      TANDEM_LOG(kDebug, "rref") << "rref " << rref_id << ": creation failed: " << r.status().message();
    }
    confirmed.set_status(r.status());
    detail::Context::get().release_pending_user(fork_id);
  });
  return RRef(c10::intrusive_ptr<c10::RRefInterface>(user));
}

RRef make_local(c10::IValue value) {
  auto& ctx = detail::Context::get();
  const int64_t rref_id = ctx.new_id();
  ctx.create_entry(rref_id, 0, -1).set_value(std::move(value));
  auto handle = ctx.owner_handle(rref_id);
  throw_if_error(handle.status());
  return RRef(c10::intrusive_ptr<c10::RRefInterface>(*handle));
}

Stats stats() { return detail::Context::get().stats(); }

void configure(RRefOptions options) { detail::Context::get().configure(options); }

namespace detail {

absl::StatusOr<tandem::wire::RRefDescriptor> parse_descriptor(const std::string& data) {
  tandem::wire::RRefDescriptor w;
  if (!w.ParseFromString(data)) return absl::InvalidArgumentError("malformed RRef: the descriptor does not parse");
  if (w.kind() < tandem::wire::RRefDescriptor::SELF || w.kind() > tandem::wire::RRefDescriptor::USER_FORK) {
    return absl::InvalidArgumentError(absl::StrCat("malformed RRef: unknown kind ", static_cast<int>(w.kind())));
  }
  if (w.owner() < 0 || w.rref_id() < 0 || w.fork_id() < 0) {
    return absl::InvalidArgumentError("malformed RRef: a negative owner or id");
  }
  return w;
}

}  // namespace detail

}  // namespace tandem::rref
