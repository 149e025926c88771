// Remote references: a value (or object) that lives on one worker, its owner, and is used from others.
//
//   rref::RRef r = rref::remote("worker1", "make_weights", 784, 10);   // returns at once
//   at::Tensor w = r.to_here<at::Tensor>();                            // a copy, fetched from the owner
//   rpc::rpc_sync("worker2", "train_step", r);                         // RRefs travel as arguments and results
//
// An RRef is a handle like a distributed shared_ptr: the owner keeps the value while any handle to it exists anywhere,
// and frees it promptly once the last one is gone (docs/rref.md has the protocol and its guarantees).
//
// Remote objects: a registered C++ class is constructed on a worker and its methods are called through the RRef:
//
//   rref::register_class<ParameterServer>("ParameterServer")
//       .constructor<int64_t>()
//       .method("get_weights", &ParameterServer::get_weights);
//   rref::RRef ps = rref::remote_object("ps", "ParameterServer", int64_t{784});
//   at::Tensor w = ps.rpc_sync<at::Tensor>("get_weights");
//
// Errors: as in rpc (tandem::Error, or an error in the Future), naming the owner and the operation: an unknown class or
// method is NOT_FOUND, what a constructor or method throws is UNKNOWN (a tandem::Error keeps its code). If the owner
// dies, to_here and calls through its RRefs fail with UNAVAILABLE; if a user dies, its owner drops that user's
// references after detecting the death (RRefOptions::probe_interval). Every wait is bounded by the call's timeout, or
// RpcOptions::rpc_timeout when none is given.
//
// Thread-safety: RRef handles may be copied, passed and destroyed from any thread.
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/rref_interface.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "tandem/rpc/rpc.h"

namespace tandem::rref {

namespace detail {
class RRefImpl;
}

class RRef {
 public:
  RRef() = default;
  // Wraps a reference Tandem created (rref/rref.cc makes them).
  explicit RRef(c10::intrusive_ptr<c10::RRefInterface> impl);
  // The RRef inside an IValue (as received in a registered function's c10::IValue argument).
  static RRef from_ivalue(const c10::IValue& value);
  c10::IValue to_ivalue() const;

  bool valid() const { return static_cast<bool>(impl_); }
  int owner() const;
  std::string owner_name() const;
  bool is_owner() const;
  // True on the owner, and on a user once the owner has learned of this reference.
  bool confirmed_by_owner() const;

  // A copy of the value, fetched from the owner (waits for it while the owner's function runs). A non-positive
  // timeout means RpcOptions::rpc_timeout.
  rpc::Future to_here_async(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const;
  c10::IValue to_here(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const;
  template <typename T>
  T to_here(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const {
    return rpc::from_ivalue<T>(to_here(timeout));
  }
  // The value itself; only on the owner (throws tandem::Error, FAILED_PRECONDITION, elsewhere). Waits while the value
  // is being made, up to RpcOptions::rpc_timeout (then DEADLINE_EXCEEDED).
  c10::IValue local_value() const;

  // Calls `method` of the remote object this RRef refers to, on its owner (like rref.rpc_sync().method(...)). The call
  // is sent once the owner has confirmed this reference. A trailing std::chrono::duration is the timeout.
  template <typename R = c10::IValue, typename... Args>
  R rpc_sync(const std::string& method, Args&&... args) const {
    rpc::detail::Packed p = rpc::detail::pack(std::forward<Args>(args)...);
    return rpc::detail::result_as<R>(call_method_and_wait(method, std::move(p.values), p.timeout));
  }
  template <typename... Args>
  rpc::Future rpc_async(const std::string& method, Args&&... args) const {
    rpc::detail::Packed p = rpc::detail::pack(std::forward<Args>(args)...);
    return call_method(method, std::move(p.values), p.timeout);
  }
  // The result stays on the owner: a new RRef to it.
  template <typename... Args>
  RRef remote(const std::string& method, Args&&... args) const {
    rpc::detail::Packed p = rpc::detail::pack(std::forward<Args>(args)...);
    return remote_method(method, std::move(p.values), p.timeout);
  }
  rpc::Future call_method(const std::string& method, std::vector<c10::IValue> args,
                          std::chrono::milliseconds timeout) const;
  // The same, returning once the call completed (behind rpc_sync): once the owner confirmed this reference, the
  // calling thread reads its own reply (rpc::call_and_wait), a thread hand-off less per call. Its sync_spin rule
  // (rpc.h) sees every method call to the owner as one function (kCallMethod): a slow method's call can cost a quick
  // one on the same owner its spin, once.
  rpc::Future call_method_and_wait(const std::string& method, std::vector<c10::IValue> args,
                                   std::chrono::milliseconds timeout) const;
  RRef remote_method(const std::string& method, std::vector<c10::IValue> args, std::chrono::milliseconds timeout) const;

  int64_t id() const;
  static constexpr const char* kCallMethod = "__tandem.rref.call";

 private:
  c10::intrusive_ptr<c10::RRefInterface> impl_;  // always a detail::RRefImpl
};

// Runs registered function `function` on worker `to` and returns, at once, an RRef to its result there. Arguments as
// for rpc::rpc_async, including a trailing timeout (for the creation message).
RRef remote_call(const rpc::To& to, const std::string& function, std::vector<c10::IValue> args,
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
template <typename... Args>
RRef remote(const rpc::To& to, const std::string& function, Args&&... args) {
  rpc::detail::Packed p = rpc::detail::pack(std::forward<Args>(args)...);
  return remote_call(to, function, std::move(p.values), p.timeout);
}

// An RRef whose value has C++ type T (PyTorch's RRef[T]): to_here() and local_value() return T. The value is converted
// (rpc/convert.h) when fetched; a value of another type is an error then.
template <typename T>
class TypedRRef : public RRef {
 public:
  TypedRRef() = default;
  explicit TypedRRef(RRef r) : RRef(std::move(r)) {}
  T to_here(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const {
    return RRef::to_here<T>(timeout);
  }
  T local_value() const { return rpc::from_ivalue<T>(RRef::local_value()); }
};

// remote() whose result is typed: rref::remote_as<at::Tensor>("ps", "make_weights", 784).to_here() is a tensor.
template <typename T, typename... Args>
TypedRRef<T> remote_as(const rpc::To& to, const std::string& function, Args&&... args) {
  return TypedRRef<T>(remote(to, function, std::forward<Args>(args)...));
}

// An RRef owned by this worker to `value` (like PyTorch's RRef(value)), e.g. to return from a registered function.
RRef make_local(c10::IValue value);

// ---- Remote objects

namespace detail {
// A constructed object, type-erased; it lives in the owner's value as an IValue capsule, which is never sent.
struct Object : torch::CustomClassHolder {
  std::string class_name;
  std::shared_ptr<void> instance;
};
using Method = std::function<rpc::Future(void* instance, std::vector<c10::IValue>&& args)>;
using Constructor = std::function<std::shared_ptr<void>(std::vector<c10::IValue>&& args)>;
void register_class_impl(const std::string& name, Constructor constructor);
void register_method_impl(const std::string& class_name, const std::string& method, Method m);
}  // namespace detail

template <class T>
class ClassRegistration {
 public:
  explicit ClassRegistration(std::string name) : name_(std::move(name)) {}
  template <typename... CtorArgs>
  ClassRegistration& constructor() {
    detail::register_class_impl(name_, [](std::vector<c10::IValue>&& args) -> std::shared_ptr<void> {
      return construct<std::decay_t<CtorArgs>...>(args, std::index_sequence_for<CtorArgs...>{});
    });
    return *this;
  }
  template <typename R, typename... A>
  ClassRegistration& method(const std::string& name, R (T::*m)(A...)) {
    detail::register_method_impl(name_, name, [m](void* self, std::vector<c10::IValue>&& args) {
      auto bound = [self, m](std::decay_t<A>... a) -> R { return (static_cast<T*>(self)->*m)(std::move(a)...); };
      return rpc::detail::invoke(bound, args, static_cast<std::tuple<std::decay_t<A>...>*>(nullptr),
                                 std::index_sequence_for<A...>{});
    });
    return *this;
  }

 private:
  template <typename... CtorArgs, size_t... I>
  static std::shared_ptr<void> construct(std::vector<c10::IValue>& args, std::index_sequence<I...>) {
    if (args.size() != sizeof...(CtorArgs)) rpc::detail::arity_error(sizeof...(CtorArgs), args.size());
    return std::make_shared<T>(rpc::detail::convert_argument<CtorArgs>(I, args[I])...);
  }

  std::string name_;
};

template <class T>
ClassRegistration<T> register_class(const std::string& name) {
  return ClassRegistration<T>(name);
}

// Constructs an instance of registered class `class_name` on worker `to`; returns an RRef to it at once.
template <typename... Args>
RRef remote_object(const rpc::To& to, const std::string& class_name, Args&&... args) {
  return rref::remote(to, "__tandem.rref.construct", class_name, std::forward<Args>(args)...);
}

// ---- Introspection

struct Stats {
  int64_t owned_values = 0;           // values this worker owns
  int64_t known_forks = 0;            // user references the owner knows of, over all its values
  int64_t user_refs = 0;              // live user references held here
  int64_t pending_children = 0;       // references sent on, whose receivers have not accepted them yet
  int64_t pending_confirmations = 0;  // references received here, not yet confirmed by their owner
  int64_t failed_notes = 0;           // delete/accept batches that could not be delivered (their worker was gone)
};
Stats stats();

struct RRefOptions {
  // How often an owner checks that the workers holding its references are alive; a worker that cannot be reached is
  // dropped with all its references.
  std::chrono::milliseconds probe_interval{1000};
  // How long a reference sent to another worker keeps what it refers to until the receiver accepts it (says it decoded
  // the message): the parent a sender keeps for it, or, for a reference its owner sent, the owner's value. A message
  // never decoded (a reply that came after its call's timeout, a message refused or over the size limit) frees them
  // after this. Non-positive: 4 x RpcOptions::rpc_timeout, at least 10 minutes (a message may take a call's whole
  // timeout, which may be longer than the default, and its accept 3 attempts of up to rpc_timeout each). Checked
  // every probe_interval. A receiver whose accept takes longer (a partition outlasting its attempts) finds the value
  // gone (NOT_FOUND): set it above the longest time a message and its accept may take.
  std::chrono::milliseconds unaccepted_ttl{0};
};
// Optional; call before init_rpc.
void configure(RRefOptions options);

}  // namespace tandem::rref
