// Batched functions: many callers' requests gathered into one call of a user function (batched inference for an RL
// agent, a batched parameter server).
//
//   rpc::register_batched_function<at::Tensor, int64_t>("select_action", {.max_batch = n_observers,
//                                                                        .max_delay = std::chrono::milliseconds(5)},
//       [&](std::vector<at::Tensor> states) { ...one forward...; return actions; });   // one result per request
//   // a caller, anywhere in the job:
//   int64_t a = rpc::rpc_sync<int64_t>("agent", "select_action", state);
//
// Contract. Every call of the registered name becomes one request of the next batch; it is answered (asynchronously:
// no server thread waits) when its batch runs. A batch is formed as soon as `max_batch` requests wait (by the call
// that completed it), or when the oldest waiting request has waited `max_delay` (by the batcher's own thread), so a
// slow, late or dead caller never holds up the others by more than max_delay. It runs on the thread that formed it
// when no batch is running then, else on the batcher's thread once the batches ahead of it have run: no thread waits
// for its turn, so a function that never returns holds one thread only (the calls behind it time out with their
// callers' timeouts). The function gets the requests in
// arrival order and returns exactly one result per request, in the same order.
//
// Order: batches of one function never run concurrently, and they run in the order they were formed, so the function
// sees every request in arrival order, across batches as within one (a batch formed by a caller never overtakes an
// older one the batcher's thread is about to run). Arrival is the moment the request was queued on this worker.
//
// Errors: a result may be an error (absl::StatusOr), which fails that request alone, as does a request whose
// arguments do not convert (the function never sees it). If the function throws, or returns another number of
// results, every request of that batch gets an error naming the function and the cause. A caller that dies while
// waiting changes nothing for the others (its reply goes nowhere). Each caller's wait is bounded by its own RPC
// timeout. At most max_waiting requests wait: one beyond fails at once (RESOURCE_EXHAUSTED).
// Profiling: each batch is one range of a running profile, rpc_batch#name(N requests), with the function's operators,
// whichever thread runs it (profile/profile.h).
// Thread-safety: registration may happen at any time from any thread; a batched function's thread lives until it is
// unregistered.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"

namespace tandem::rpc {

struct BatchOptions {
  size_t max_batch = 8;                                               // run as soon as this many requests wait
  std::chrono::microseconds max_delay{std::chrono::milliseconds(5)};  // or once the oldest has waited this long
  // At most this many requests wait (in batches formed and not run yet, or not in one yet): a call beyond it fails at
  // once with RESOURCE_EXHAUSTED, naming the function, instead of piling up in memory behind a function that has
  // stopped returning or runs slower than its calls come.
  size_t max_waiting = 16384;
};

struct BatchStats {
  int64_t batches = 0;
  int64_t requests = 0;
  int64_t full_batches = 0;  // run because max_batch requests were waiting (the others ran at max_delay)
  int64_t max_batch = 0;     // the current max_batch (set_max_batch changes it)
  int64_t refused = 0;       // calls failed because max_waiting requests were waiting
};

// The type-erased form: each request is the argument list of one call; one result (or error) per request.
using BatchHandler =
    std::function<std::vector<absl::StatusOr<c10::IValue>>(std::vector<std::vector<c10::IValue>>& requests)>;
// Fails with ALREADY_EXISTS when the name is taken, INVALID_ARGUMENT for max_batch 0 or max_waiting below max_batch.
// unregister_function(name) ends it: once the last copy of its handler is gone (calls being delivered hold one, a
// caller of find_function too), the requests still waiting run at once (not after max_delay), then its thread ends;
// batch_stats and set_max_batch no longer know the name.
absl::Status register_batched_handler(const std::string& name, BatchOptions options, BatchHandler handler);

// Counts for a function registered here (zeros for an unknown or unregistered name).
BatchStats batch_stats(const std::string& name);

// Changes how many waiting requests make a full batch (e.g. the callers still active, as some finish early); if as
// many already wait, they form a batch at once (run as above). Fails with NOT_FOUND for a name not registered here,
// INVALID_ARGUMENT for 0 or more than its max_waiting.
absl::Status set_max_batch(const std::string& name, size_t max_batch);

namespace detail {
template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {};
}  // namespace detail

// Typed: a call takes one argument of type Arg; fn maps the batch's arguments to one Result each. Result may be
// absl::StatusOr<T>: an error fails that request alone. A request whose argument does not convert to Arg fails alone
// with INVALID_ARGUMENT, and fn gets the others. Throws RpcError (ALREADY_EXISTS, INVALID_ARGUMENT) as
// register_batched_handler fails.
template <typename Arg, typename Result, typename F>
void register_batched_function(const std::string& name, BatchOptions options, F fn) {
  BatchHandler handler = [fn = std::move(fn)](std::vector<std::vector<c10::IValue>>& requests) mutable {
    std::vector<absl::StatusOr<c10::IValue>> out(requests.size(), absl::UnknownError("not answered"));
    std::vector<Arg> args;
    std::vector<size_t> index;  // args[k] is requests[index[k]]
    args.reserve(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      try {
        if (requests[i].size() != 1) detail::arity_error(1, requests[i].size());
        args.push_back(detail::convert_argument<Arg>(0, requests[i][0]));
        index.push_back(i);
      } catch (...) {
        out[i] = status_from_current_exception();
      }
    }
    if (args.empty()) return out;
    std::vector<Result> results = fn(std::move(args));
    if (results.size() != index.size()) {
      throw_error(absl::InternalError("returned " + std::to_string(results.size()) + " results for " +
                                      std::to_string(index.size()) + " requests"));
    }
    for (size_t k = 0; k < results.size(); ++k) {
      if constexpr (detail::IsStatusOr<Result>::value) {
        if (results[k].ok()) {
          out[index[k]] = to_ivalue(std::move(*results[k]));
        } else {
          out[index[k]] = std::move(results[k]).status();
        }
      } else {
        out[index[k]] = to_ivalue(std::move(results[k]));
      }
    }
    return out;
  };
  throw_if_error(register_batched_handler(name, options, std::move(handler)));
}

}  // namespace tandem::rpc
