// The RRef protocol (docs/rref.md). Everything here runs over rpc: internal functions named "__tandem.rref.*" and a
// value codec for RRefs, so rpc itself knows nothing of references.
#include "rref/rref.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "rpc/extension.h"
#include "rref/detail/descriptor.h"

namespace tandem::rref {
namespace detail {

using std::chrono::milliseconds;

class RRefImpl : public c10::RRefInterface {
 public:
  RRefImpl(int owner, int64_t rref_id, int64_t fork_id, bool owner_side, bool confirmed, uint64_t generation);
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
  // fails when its creation failed.
  rpc::Future confirmed_;
};

namespace {

// Forwards `from`'s outcome into `to`.
void forward(const rpc::Future& from, const rpc::Future& to) {
  from.add_callback([to](const rpc::Future& f) {
    if (absl::Status s = f.status(); !s.ok()) {
      to.set_error(s);
    } else {
      to.set_value(f.value());
    }
  });
}

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

// Pending children are released by the child's accept; one whose message was never delivered would keep its parent
// forever, so they expire after this long.
constexpr auto kPendingChildTtl = std::chrono::minutes(10);

class Context {
 public:
  static Context& get() {
    static auto* c = new Context;  // never destroyed: handles may die during static destruction
    return *c;
  }

  uint64_t generation() const { return generation_.load(); }
  int64_t new_id() {
    if (rank_ < 0) rank_ = rpc::get_worker_info().id;
    return (static_cast<int64_t>(rank_) << 48) | next_id_.fetch_add(1);
  }
  int rank() {
    if (rank_ < 0) rank_ = rpc::get_worker_info().id;
    return rank_;
  }

  // Owner side. Messages about one RRef come from several workers over several connections, so they arrive in any
  // order: a fork may be registered before the creation it descends from. Whichever comes first makes the entry;
  // the value future is made once and the creation completes it.
  rpc::Future create_entry(int64_t rref_id, int64_t fork_id, int holder) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& e = owners_[rref_id];
    if (fork_id != 0) e.forks[fork_id] = holder;
    start_probe_locked();
    if (auto w = awaiting_.find(rref_id); w != awaiting_.end()) {  // fetches that overtook the creation
      for (auto& [deadline, waiter] : w->second) forward(e.value, waiter);
      awaiting_.erase(w);
    }
    return e.value;
  }
  // The value of `rref_id`; when the owner has not heard of it yet (a fetch may overtake the creation it follows), a
  // future that its creation completes, or that fails with NOT_FOUND after `wait`. No entry is made for it.
  rpc::Future value_or_wait(int64_t rref_id, milliseconds wait) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = owners_.find(rref_id); it != owners_.end()) return it->second.value;
    rpc::Future waiter;
    awaiting_[rref_id].emplace_back(std::chrono::steady_clock::now() + wait, waiter);
    start_probe_locked();
    return waiter;
  }
  absl::StatusOr<rpc::Future> value_of(int64_t rref_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(rref_id);
    if (it == owners_.end()) return missing(rref_id);
    return it->second.value;
  }
  // From the owner's own codec (it holds a handle: the entry exists) or from a user's fork request (the entry may not
  // exist yet, see create_entry).
  absl::Status add_fork(int64_t rref_id, int64_t fork_id, int holder) {
    create_entry(rref_id, fork_id, holder);
    return absl::OkStatus();
  }
  void remove_fork(int64_t rref_id, int64_t fork_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(rref_id);
    if (it == owners_.end()) return;  // deletes are idempotent
    it->second.forks.erase(fork_id);
    maybe_free_locked(it);
  }
  // A handle on the owner. The entry may not exist yet when the reference overtook its own creation (see
  // create_entry); the creation will fill the value.
  absl::StatusOr<c10::intrusive_ptr<RRefImpl>> owner_handle(int64_t rref_id) {
    std::lock_guard<std::mutex> lock(mu_);
    ++owners_[rref_id].local_handles;
    return c10::make_intrusive<RRefImpl>(rank(), rref_id, 0, true, true, generation());
  }
  void release_handle(int64_t rref_id, uint64_t generation) {
    std::lock_guard<std::mutex> lock(mu_);
    if (generation != generation_) return;
    auto it = owners_.find(rref_id);
    if (it == owners_.end()) return;
    --it->second.local_handles;
    maybe_free_locked(it);
  }

  // User side.
  void hold_pending_user(const c10::intrusive_ptr<RRefImpl>& user) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_users_[user->fork_id_] = user;
  }
  void release_pending_user(int64_t fork_id) {
    c10::intrusive_ptr<RRefImpl> keep;  // destroyed outside the lock (its destructor may send a delete)
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_users_.find(fork_id);
    if (it == pending_users_.end()) return;
    keep = std::move(it->second);
    pending_users_.erase(it);
  }
  void hold_pending_child(int64_t child, c10::intrusive_ptr<RRefImpl> parent) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_children_[child] = {std::move(parent), std::chrono::steady_clock::now()};
    start_probe_locked();
  }
  void release_pending_child(int64_t child) {
    c10::intrusive_ptr<RRefImpl> keep;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_children_.find(child);
    if (it == pending_children_.end()) return;
    keep = std::move(it->second.first);
    pending_children_.erase(it);
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    Stats s;
    s.owned_values = static_cast<int64_t>(owners_.size());
    for (const auto& [id, e] : owners_) s.known_forks += static_cast<int64_t>(e.forks.size());
    s.user_refs = user_refs.load();
    s.pending_children = static_cast<int64_t>(pending_children_.size());
    s.pending_confirmations = static_cast<int64_t>(pending_users_.size());
    s.failed_notes = failed_notes.load();
    return s;
  }

  // Graceful shutdown: confirmations and accepts in flight settle before the workers leave.
  absl::Status drain(absl::Time deadline) {
    batcher.flush();
    std::unique_lock<std::mutex> lock(mu_);
    while (!pending_users_.empty() || !pending_children_.empty()) {
      lock.unlock();
      batcher.flush();  // accepts owed to other workers
      lock.lock();
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("rref: ", pending_users_.size(), " confirmations and ",
                                                        pending_children_.size(), " child acceptances still pending"));
      }
      lock.unlock();
      std::this_thread::sleep_for(milliseconds(2));
      lock.lock();
    }
    return absl::OkStatus();
  }

  // RPC stopped: every reference of this job is void. Values are freed; handles still held by user code become inert.
  void reset() {
    std::unordered_map<int64_t, OwnerEntry> owners;
    std::unordered_map<int64_t, c10::intrusive_ptr<RRefImpl>> users;
    std::unordered_map<int64_t, std::pair<c10::intrusive_ptr<RRefImpl>, std::chrono::steady_clock::time_point>>
        children;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++generation_;
      rank_ = -1;
      stop_probe_ = true;
      owners.swap(owners_);
      users.swap(pending_users_);
      children.swap(pending_children_);
      awaiting_.clear();
    }
    batcher.stop();
    probe_cv_.notify_all();
    if (probe_.joinable()) probe_.join();
    std::lock_guard<std::mutex> lock(mu_);
    stop_probe_ = false;
  }

  // accept and delete notes: one-way, so they are sent in batches per destination (flushed within kFlushDelay or at
  // kBatchSize), which divides the protocol's message count for short-lived references.
  class Batcher {
   public:
    static constexpr auto kFlushDelay = milliseconds(1);
    static constexpr size_t kBatchSize = 256;
    void add(int to, const char* function, int64_t a, int64_t b) {
      std::unique_lock<std::mutex> lock(mu_);
      auto& batch = batches_[{to, function}];
      batch.push_back(a);
      batch.push_back(b);
      if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { loop(); });
      if (batch.size() >= 2 * kBatchSize) cv_.notify_one();
    }
    // Sends what is queued now (for shutdown's drain).
    void flush() {
      std::map<std::pair<int, const char*>, std::vector<int64_t>> batches;
      {
        std::lock_guard<std::mutex> lock(mu_);
        batches.swap(batches_);
      }
      send(batches);
    }
    void stop() {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
        batches_.clear();  // the job is over: nobody needs them
      }
      cv_.notify_all();
      if (thread_.joinable()) thread_.join();
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = false;
      thread_ = std::thread();
    }

   private:
    void loop() {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stopping_) {
        cv_.wait_for(lock, kFlushDelay);
        if (batches_.empty()) continue;
        std::map<std::pair<int, const char*>, std::vector<int64_t>> batches;
        batches.swap(batches_);
        lock.unlock();
        send(batches);
        lock.lock();
      }
    }
    static void send(const std::map<std::pair<int, const char*>, std::vector<int64_t>>& batches) {
      for (const auto& [key, values] : batches) send_one(key.first, key.second, values, kAttempts);
    }
    // Notes are idempotent (a fork already deleted, a child already released: nothing happens), so a batch that was
    // lost on the way (no reply by its deadline) or whose connection broke is sent again, kAttempts times in all.
    static constexpr int kAttempts = 3;
    static void send_one(int to, const char* function, std::vector<int64_t> values, int attempts) {
      rpc::Future sent = rpc::call(to, function, {c10::IValue(values)});
      sent.add_callback([to, function, values = std::move(values), attempts](const rpc::Future& r) {
        const absl::Status s = r.status();
        if (s.ok()) return;
        const bool lost = s.code() == absl::StatusCode::kDeadlineExceeded || s.code() == absl::StatusCode::kUnavailable;
        if (lost && attempts > 1) return send_one(to, function, values, attempts - 1);
        ++Context::get().failed_notes;  // the destination is gone
      });
    }
    std::mutex mu_;
    std::condition_variable cv_;
    std::map<std::pair<int, const char*>, std::vector<int64_t>> batches_;
    std::thread thread_;
    bool stopping_ = false;
  };

  RRefOptions options;
  Batcher batcher;
  std::atomic<int64_t> failed_notes{0};
  std::atomic<int64_t> user_refs{0};

 private:
  static absl::Status missing(int64_t rref_id) {
    return absl::NotFoundError(absl::StrCat("RRef ", rref_id, " does not exist on its owner (already freed?)"));
  }

  void maybe_free_locked(std::unordered_map<int64_t, OwnerEntry>::iterator it) {
    if (it->second.forks.empty() && it->second.local_handles == 0) owners_.erase(it);
  }

  // Liveness of the workers holding this owner's references, and expiry of stale pending children.
  void start_probe_locked() {
    if (probe_.joinable() || stop_probe_) return;
    probe_ = std::thread([this] { probe_loop(); });
  }

  void probe_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_probe_) {
      probe_cv_.wait_for(lock, options.probe_interval, [this] { return stop_probe_; });
      if (stop_probe_) return;
      std::set<int> holders;
      const int me = rank_;
      for (const auto& [id, e] : owners_) {
        for (const auto& [fork, holder] : e.forks) {
          if (holder != me) holders.insert(holder);
        }
      }
      const auto now = std::chrono::steady_clock::now();
      std::vector<c10::intrusive_ptr<RRefImpl>> expired;
      for (auto it = pending_children_.begin(); it != pending_children_.end();) {
        if (now - it->second.second > kPendingChildTtl) {
          expired.push_back(std::move(it->second.first));
          it = pending_children_.erase(it);
        } else {
          ++it;
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
      lock.unlock();
      expired.clear();
      for (auto& [id, f] : timed_out) f.set_error(missing(id));
      std::vector<int> dead;
      for (int h : holders) {
        rpc::Future ping = rpc::call(h, "__tandem.rref.ping", {}, options.probe_interval);
        if (ping.status().code() == absl::StatusCode::kUnavailable) dead.push_back(h);
      }
      lock.lock();
      for (int h : dead) drop_holder_locked(h);
    }
  }

  void drop_holder_locked(int holder) {
    for (auto it = owners_.begin(); it != owners_.end();) {
      auto& forks = it->second.forks;
      for (auto f = forks.begin(); f != forks.end();) f = f->second == holder ? forks.erase(f) : std::next(f);
      if (forks.empty() && it->second.local_handles == 0) {
        it = owners_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mutex mu_;
  std::unordered_map<int64_t, OwnerEntry> owners_;
  std::unordered_map<int64_t, c10::intrusive_ptr<RRefImpl>> pending_users_;
  std::unordered_map<int64_t, std::pair<c10::intrusive_ptr<RRefImpl>, std::chrono::steady_clock::time_point>>
      pending_children_;
  std::unordered_map<int64_t, std::vector<std::pair<std::chrono::steady_clock::time_point, rpc::Future>>> awaiting_;
  std::atomic<uint64_t> generation_{1};
  std::atomic<int64_t> next_id_{1};
  std::atomic<int> rank_{-1};
  std::thread probe_;
  std::condition_variable probe_cv_;
  bool stop_probe_ = false;
};

std::mutex g_classes_mu;
std::map<std::string, Constructor>& classes() {
  static auto* m = new std::map<std::string, Constructor>;
  return *m;
}
std::map<std::pair<std::string, std::string>, Method>& methods() {
  static auto* m = new std::map<std::pair<std::string, std::string>, Method>;
  return *m;
}

int64_t arg_int(const std::vector<c10::IValue>& args, size_t i) {
  if (i >= args.size() || !args[i].isInt()) throw std::invalid_argument("malformed rref protocol message");
  return args[i].toInt();
}

// Best effort: if the sender is gone, so is the parent it kept.
void send_accept(int to, int64_t child) { Context::get().batcher.add(to, "__tandem.rref.accept", child, 0); }

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
      if (auto s = ctx.add_fork(impl->rref_id_, w.fork_id(), to); !s.ok()) return s;
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
    return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(
        c10::make_intrusive<RRefImpl>(w.owner(), w.rref_id(), w.fork_id(), false, true, ctx.generation())));
  }
  if (w.kind() != kUserFork) return absl::InvalidArgumentError("malformed RRef: its kind does not fit its owner");
  auto user = c10::make_intrusive<RRefImpl>(w.owner(), w.rref_id(), w.fork_id(), false, false, ctx.generation());
  ctx.hold_pending_user(user);  // G1: it cannot be deleted before the owner knows it
  const int64_t fork = w.fork_id();
  rpc::Future registered = rpc::call(w.owner(), "__tandem.rref.fork", {c10::IValue(w.rref_id()), c10::IValue(fork)});
  rpc::Future confirmed = user->confirmed_;
  registered.add_callback([confirmed, fork, from](const rpc::Future& r) {
    if (absl::Status s = r.status(); !s.ok()) {
      confirmed.set_error(s);
    } else {
      confirmed.set_value(c10::IValue());
      send_accept(from, fork);  // G2: now the parent may go
    }
    Context::get().release_pending_user(fork);
  });
  wait->push_back(confirmed);  // user code sees the reference only once its owner knows it
  return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(user));
}

// ---- protocol functions (owner side unless stated)

rpc::Future on_create(std::vector<c10::IValue>&& args) {
  // args: rref id, fork id, function, arguments (a list)
  const int64_t rref_id = arg_int(args, 0), fork_id = arg_int(args, 1);
  if (args.size() != 4 || !args[2].isString() || !args[3].isList())
    throw std::invalid_argument("malformed rref create");
  const std::string function = args[2].toStringRef();
  std::vector<c10::IValue> fargs(args[3].toListRef().begin(), args[3].toListRef().end());
  const auto* call = rpc::current_call();
  rpc::Future value = Context::get().create_entry(rref_id, fork_id, call ? call->caller_rank : -1);
  rpc::Handler handler = rpc::find_function(function);
  if (!handler) {
    value.set_error(absl::NotFoundError(absl::StrCat("no function named '", function, "' is registered on worker '",
                                                     rpc::get_worker_info().name, "'")));
  } else {
    try {
      forward(handler(std::move(fargs)), value);
    } catch (const std::exception& e) {
      value.set_error(absl::UnknownError(e.what()));
    }
  }
  return rpc::Future::ready(c10::IValue());  // the creator's confirmation; the value follows in its own time
}

rpc::Future on_fetch(std::vector<c10::IValue>&& args) {  // rref, how long to wait for an unknown one (ms)
  return Context::get().value_or_wait(arg_int(args, 0),
                                      milliseconds(std::clamp<int64_t>(arg_int(args, 1), 0, 3600000)));
}

rpc::Future on_fork(std::vector<c10::IValue>&& args) {
  const auto* call = rpc::current_call();
  auto s = Context::get().add_fork(arg_int(args, 0), arg_int(args, 1), call ? call->caller_rank : -1);
  return s.ok() ? rpc::Future::ready(c10::IValue()) : rpc::Future::failed(s);
}

// Batched notes: a flat list of (a, b) pairs.
std::vector<int64_t> note_pairs(const std::vector<c10::IValue>& args) {
  if (args.size() != 1 || !args[0].isList()) throw std::invalid_argument("malformed rref note batch");
  std::vector<int64_t> v;
  for (const auto& x : args[0].toListRef()) {
    if (!x.isInt()) throw std::invalid_argument("malformed rref note batch");
    v.push_back(x.toInt());
  }
  if (v.size() % 2 != 0) throw std::invalid_argument("malformed rref note batch");
  return v;
}

rpc::Future on_delete(std::vector<c10::IValue>&& args) {  // (rref, fork) pairs
  const auto v = note_pairs(args);
  for (size_t i = 0; i < v.size(); i += 2) Context::get().remove_fork(v[i], v[i + 1]);
  return rpc::Future::ready(c10::IValue());
}

rpc::Future on_accept(std::vector<c10::IValue>&& args) {  // (child, 0) pairs, on the parent's holder
  const auto v = note_pairs(args);
  for (size_t i = 0; i < v.size(); i += 2) Context::get().release_pending_child(v[i]);
  return rpc::Future::ready(c10::IValue());
}

rpc::Future on_construct(std::vector<c10::IValue>&& args) {
  if (args.empty() || !args[0].isString()) throw std::invalid_argument("malformed rref construct");
  const std::string name = args[0].toStringRef();
  Constructor ctor;
  {
    std::lock_guard<std::mutex> lock(g_classes_mu);
    auto it = classes().find(name);
    if (it == classes().end()) {
      throw std::invalid_argument(
          absl::StrCat("no class named '", name, "' is registered on worker '", rpc::get_worker_info().name, "'"));
    }
    ctor = it->second;
  }
  auto object = c10::make_intrusive<Object>();
  object->class_name = name;
  object->instance = ctor(std::vector<c10::IValue>(args.begin() + 1, args.end()));
  return rpc::Future::ready(c10::IValue::make_capsule(object));
}

rpc::Future on_call(std::vector<c10::IValue>&& args) {
  if (args.size() < 2 || !args[1].isString()) throw std::invalid_argument("malformed rref method call");
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
      if (!object) throw std::invalid_argument("the RRef does not refer to a remote object");
      Method m;
      {
        std::lock_guard<std::mutex> lock(g_classes_mu);
        auto it = methods().find({object->class_name, method});
        if (it == methods().end()) {
          throw std::invalid_argument(absl::StrCat("class '", object->class_name, "' has no method '", method, "'"));
        }
        m = it->second;
      }
      forward(m(object->instance.get(), std::move(*rest)), result);
    } catch (const RpcError& e) {
      result.set_error(e.status());
    } catch (const std::invalid_argument& e) {
      result.set_error(absl::InvalidArgumentError(e.what()));
    } catch (const std::exception& e) {
      result.set_error(absl::UnknownError(e.what()));
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
  throw_if_error(rpc::register_handler("__tandem.rref.delete", on_delete));
  throw_if_error(rpc::register_handler("__tandem.rref.accept", on_accept));
  throw_if_error(rpc::register_handler("__tandem.rref.construct", on_construct));
  throw_if_error(rpc::register_handler(RRef::kCallMethod, on_call));
  throw_if_error(rpc::register_handler("__tandem.rref.ping",
                                       [](std::vector<c10::IValue>&&) { return rpc::Future::ready(c10::IValue()); }));
  rpc::add_shutdown_hook([](absl::Time deadline) { return Context::get().drain(deadline); });
  rpc::add_stop_hook([] { Context::get().reset(); });
  return true;
}

const bool g_installed = install();

}  // namespace

RRefImpl::RRefImpl(int owner, int64_t rref_id, int64_t fork_id, bool owner_side, bool confirmed, uint64_t generation)
    : owner_(owner), rref_id_(rref_id), fork_id_(fork_id), owner_side_(owner_side), generation_(generation) {
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
  ctx.batcher.add(owner_, "__tandem.rref.delete", rref_id_, fork_id_);
}

// A worker's name, or "rank N" once RPC is down (errors are still worth a name).
std::string name_of(int rank) {
  try {
    return rpc::get_worker_info(rank).name;
  } catch (const std::exception&) {
    return "rank " + std::to_string(rank);
  }
}

std::string RRefImpl::ownerName() const { return name_of(owner_); }

void register_class_impl(const std::string& name, Constructor constructor) {
  std::lock_guard<std::mutex> lock(g_classes_mu);
  classes()[name] = std::move(constructor);
}

void register_method_impl(const std::string& class_name, const std::string& method, Method m) {
  std::lock_guard<std::mutex> lock(g_classes_mu);
  methods()[{class_name, method}] = std::move(m);
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

// The fetch: sent at once, even before the owner confirmed the reference; the owner waits for a creation it has not
// seen yet (bounded by the same timeout).
std::vector<c10::IValue> fetch_args(int64_t rref_id, std::chrono::milliseconds timeout) {
  const int64_t wait_ms = timeout.count() > 0 ? timeout.count() : 60000;
  return {c10::IValue(rref_id), c10::IValue(wait_ms)};
}
}  // namespace

rpc::Future RRef::to_here_async(std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  if (impl.owner_side_) {
    auto value = detail::Context::get().value_of(impl.rref_id_);
    return value.ok() ? *value : rpc::Future::failed(value.status());
  }
  rpc::Future result;
  rpc::call(impl.owner_, "__tandem.rref.fetch", fetch_args(impl.rref_id_, timeout), timeout)
      .add_callback([result, owner = impl.owner_](const rpc::Future& fetched) {
        if (absl::Status s = fetched.status(); !s.ok()) {
          result.set_error(to_here_error(owner, s));
        } else {
          result.set_value(fetched.value());
        }
      });
  return result;
}

c10::IValue RRef::to_here(std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  if (impl.owner_side_) {
    rpc::Future value = to_here_async(timeout);
    if (timeout.count() > 0 && !value.wait_for(timeout)) {
      throw RpcError(to_here_error(impl.owner_, absl::DeadlineExceededError(absl::StrCat(
                                                    "the value was not ready within ", timeout.count(), " ms"))));
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
  rpc::Future result;
  impl.confirmed_.add_callback([result, owner = impl.owner_, args = std::move(args), timeout](const rpc::Future& c) {
    if (absl::Status s = c.status(); !s.ok()) return (void)result.set_error(s);
    detail::forward(rpc::call(owner, kCallMethod, args, timeout), result);
  });
  return result;
}

RRef RRef::remote_method(const std::string& method, std::vector<c10::IValue> args,
                         std::chrono::milliseconds timeout) const {
  const auto& impl = checked(impl_);
  // As in call_method: the creation on the owner must not overtake this reference's own (bounded wait; usually done).
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
  absl::StatusOr<rpc::Future> value =
      impl.owner_side_
          ? detail::Context::get().value_of(impl.rref_id_)
          : absl::StatusOr<rpc::Future>(detail::Context::get().value_or_wait(impl.rref_id_, std::chrono::minutes(5)));
  throw_if_error(value.status());
  // As in PyTorch, the owner waits for a value still being made (bounded: the value's function has the RPC deadline).
  if (!value->wait_for(std::chrono::minutes(5))) {
    throw RpcError(absl::DeadlineExceededError("the RRef's value was not ready within 5 minutes"));
  }
  return value->value();
}

RRef remote_call(const rpc::To& to, const std::string& function, std::vector<c10::IValue> args,
                 std::chrono::milliseconds timeout) {
  auto& ctx = detail::Context::get();
  const int owner = to.rank() >= 0 ? rpc::get_worker_info(to.rank()).id : rpc::get_worker_info(to.name()).id;
  const int64_t rref_id = ctx.new_id();
  const int64_t fork_id = ctx.new_id();
  auto user = c10::make_intrusive<detail::RRefImpl>(owner, rref_id, fork_id, false, false, ctx.generation());
  ctx.hold_pending_user(user);  // until the owner confirms: it cannot be deleted before (G1)
  c10::impl::GenericList list(c10::AnyType::get());
  for (auto& a : args) list.push_back(std::move(a));
  rpc::Future created =
      rpc::call(owner, "__tandem.rref.create",
                {c10::IValue(rref_id), c10::IValue(fork_id), c10::IValue(function), c10::IValue(list)}, timeout);
  rpc::Future confirmed = user->confirmed_;
  created.add_callback([confirmed, fork_id](const rpc::Future& r) {
    if (absl::Status s = r.status(); !s.ok()) {
      confirmed.set_error(s);
    } else {
      confirmed.set_value(c10::IValue());
    }
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

void configure(RRefOptions options) { detail::Context::get().options = options; }

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
