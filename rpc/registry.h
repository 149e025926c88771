// Registered functions: the only things a peer can call by name.
//
//   tandem::rpc::register_function("add", [](at::Tensor a, at::Tensor b) { return a + b; });
//
// Arguments and the result convert through rpc/convert.h. A function returning void replies None. A function returning
// a Future is "async execution": the server thread is released at once and the reply is sent when that future completes
// (use it for functions that wait for several callers, e.g. a batching parameter server).
//
// A call whose name is not registered, whose arguments do not convert, or whose function throws gets an error reply
// that names the function and the cause; the worker keeps serving.
//
// Thread-safety: registration and lookup may happen from any thread at any time, also while RPC is running. Names are
// process-wide; registering a name twice fails with ALREADY_EXISTS (unregister first to replace).
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "tandem/rpc/convert.h"
#include "tandem/rpc/future.h"

namespace tandem::rpc {

// The caller rank of a client outside the job (clients/python): it authenticates with the job's secret like a worker,
// but has no rank. It may call only registered functions that are not Tandem's own (`__tandem.*`), and sends and
// receives no extension values (remote references) and no distributed autograd context.
constexpr int kClientRank = -1;

// Who is calling: valid on the thread that runs a registered function, for the synchronous part of its execution.
struct CallContext {
  std::string caller_name;
  int caller_rank = -1;  // kClientRank for a client outside the job
  std::string function;
};
// The context of the call running on this thread; nullptr outside a registered function.
const CallContext* current_call();

// The type-erased form every registered function takes.
using Handler = std::function<Future(std::vector<c10::IValue>&& args)>;

absl::Status register_handler(const std::string& name, Handler handler);
// Unregisters a function or a message.
bool unregister_function(const std::string& name);
// The handler registered under `name`, or an empty function.
Handler find_function(const std::string& name);
std::vector<std::string> registered_functions();

// A message's handler (register_message): it returns nothing and may not wait.
using MessageHandler = std::function<void(std::vector<c10::IValue>&& args)>;
// The message handler registered under `name`, or null (also for a function that is not a message).
std::shared_ptr<const MessageHandler> find_message(const std::string& name);

namespace detail {

template <typename T>
struct FnTraits : FnTraits<decltype(&T::operator())> {};
template <typename R, typename... A>
struct FnTraits<R (*)(A...)> {
  using Result = R;
  using Args = std::tuple<std::decay_t<A>...>;
};
template <typename R, typename... A>
struct FnTraits<R(A...)> : FnTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct FnTraits<R (C::*)(A...) const> : FnTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct FnTraits<R (C::*)(A...)> : FnTraits<R (*)(A...)> {};

// Throw tandem::Error (INVALID_ARGUMENT): the caller sent the wrong number of arguments, or argument `index` did not
// convert (`e` says why).
[[noreturn]] void arity_error(size_t expected, size_t got);
[[noreturn]] void argument_error(size_t index, const std::exception& e);

template <typename T>
T convert_argument(size_t index, const c10::IValue& v) {
  try {
    return from_ivalue<T>(v);
  } catch (const std::exception& e) {
    argument_error(index, e);
  }
}

template <typename F, typename... A, size_t... I>
Future invoke(F& f, std::vector<c10::IValue>& args, std::tuple<A...>*, std::index_sequence<I...>) {
  if (args.size() != sizeof...(A)) arity_error(sizeof...(A), args.size());
  using R = decltype(f(std::declval<A>()...));
  if constexpr (std::is_void_v<R>) {
    f(convert_argument<A>(I, args[I])...);
    return Future::ready(c10::IValue());
  } else if constexpr (std::is_same_v<std::decay_t<R>, Future>) {
    return f(convert_argument<A>(I, args[I])...);
  } else {
    return Future::ready(to_ivalue(f(convert_argument<A>(I, args[I])...)));
  }
}

// Registers `name` as a function (`handler`) and a message (`message`) in one step, or neither.
absl::Status register_message_handlers(const std::string& name, Handler handler, MessageHandler message);

template <typename F, typename... A, size_t... I>
void invoke_message(F& f, std::vector<c10::IValue>& args, std::tuple<A...>*, std::index_sequence<I...>) {
  if (args.size() != sizeof...(A)) arity_error(sizeof...(A), args.size());
  f(convert_argument<A>(I, args[I])...);
}

}  // namespace detail

// Registers a function (plain function, function pointer or non-generic lambda) under `name`. Throws RpcError
// (ALREADY_EXISTS) when the name is taken.
template <typename F>
void register_function(const std::string& name, F f) {
  using Args = typename detail::FnTraits<std::decay_t<F>>::Args;
  Handler handler = [f = std::move(f)](std::vector<c10::IValue>&& args) mutable -> Future {
    return detail::invoke(f, args, static_cast<Args*>(nullptr), std::make_index_sequence<std::tuple_size_v<Args>>{});
  };
  throw_if_error(register_handler(name, std::move(handler)));
}

// Registers a message: a function returning void that runs briefly and never waits (it may not block: it may hold
// the thread that read it), e.g. a hand-off into a mailbox. It is called as any function (rpc_oneway, and rpc_async
// or rpc_sync, which reply None), over every route. But a one-way call of it from a rank of the job that the direct
// channel brings (same host or TCP) runs inline on the channel's thread with nothing around it: no record of the call,
// no reply, no per-call metrics series or profile range (rpc::transport_stats().inline_messages counts them). Such a
// call with a distributed autograd context or remote references, one whose tensors were large enough to be read from
// the sender's memory (it needs an answer), and one from a client outside the job take the general path. A failure
// (arguments that do not convert, the function throws) is logged and counted as a one-way failure either way.
// current_call() holds the caller while it runs. Throws RpcError (ALREADY_EXISTS) when the name is taken.
template <typename F>
void register_message(const std::string& name, F f) {
  using Args = typename detail::FnTraits<std::decay_t<F>>::Args;
  static_assert(std::is_void_v<typename detail::FnTraits<std::decay_t<F>>::Result>, "a message returns void");
  Handler handler = [f](std::vector<c10::IValue>&& args) mutable -> Future {
    return detail::invoke(f, args, static_cast<Args*>(nullptr), std::make_index_sequence<std::tuple_size_v<Args>>{});
  };
  MessageHandler message = [f = std::move(f)](std::vector<c10::IValue>&& args) mutable {
    detail::invoke_message(f, args, static_cast<Args*>(nullptr), std::make_index_sequence<std::tuple_size_v<Args>>{});
  };
  throw_if_error(detail::register_message_handlers(name, std::move(handler), std::move(message)));
}

}  // namespace tandem::rpc
