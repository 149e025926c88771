#include "tests/rref/rref_test_functions.h"

#include <ATen/ATen.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/rref/rref.h"

namespace tandem::test {
namespace {

std::mutex g_mu;
std::vector<rref::RRef> g_held;  // references a worker keeps until told to drop them

class Counter {
 public:
  explicit Counter(int64_t start) : value_(start) {}
  int64_t add(int64_t k) { return value_ += k; }
  int64_t get() { return value_; }
  at::Tensor as_tensor(int64_t n) { return at::full({n}, static_cast<double>(value_)); }

 private:
  int64_t value_;
};

}  // namespace

void register_rref_test_functions() {
  rpc::register_function("make_tensor", [](int64_t n) { return at::arange(n, at::kFloat); });
  rpc::register_function("fail", [](std::string msg) -> int64_t { throw std::runtime_error(msg); });
  rpc::register_function("whoami", [] { return rpc::get_worker_info().name; });
  // Sums the value an RRef refers to, wherever it lives (owner, or fetched).
  rpc::register_function("sum_rref", [](c10::IValue r) {
    rref::RRef ref = rref::RRef::from_ivalue(r);
    return std::make_tuple(ref.to_here<at::Tensor>().sum().item<double>(), ref.is_owner(), ref.confirmed_by_owner());
  });
  // Passes the RRef on to `next` (a chain A -> B -> C -> ...).
  rpc::register_function("forward_rref", [](std::vector<std::string> path, c10::IValue r) {
    if (path.empty()) {
      return rref::RRef::from_ivalue(r).to_here<at::Tensor>().sum().item<double>();
    }
    const std::string next = path.front();
    path.erase(path.begin());
    return rpc::rpc_sync<double>(next, "forward_rref", path, r);
  });
  rpc::register_function("hold", [](std::vector<c10::IValue> refs) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& r : refs) g_held.push_back(rref::RRef::from_ivalue(r));
    return static_cast<int64_t>(g_held.size());
  });
  rpc::register_function("drop_held", [] {
    std::vector<rref::RRef> dropped;
    std::lock_guard<std::mutex> lock(g_mu);
    dropped.swap(g_held);
    return static_cast<int64_t>(dropped.size());
  });
  rpc::register_function("echo_rref", [](c10::IValue r) { return r; });
  // An RRef owned by this worker, returned to the caller (owner -> user).
  rpc::register_function("own_value", [](int64_t n) { return rref::make_local(at::full({n}, 2.0)).to_ivalue(); });
  // The same after `ms` milliseconds: a reply that comes after its caller gave up.
  rpc::register_function("own_value_late", [](int64_t n, int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return rref::make_local(at::full({n}, 2.0)).to_ivalue();
  });
  // Calls `to`'s `function` (int, int) with a timeout of `timeout_ms`; the code of its status.
  rpc::register_function(
      "call_with_timeout", [](int64_t to, std::string function, int64_t a, int64_t b, int64_t timeout_ms) {
        rpc::Future f = rpc::rpc_async(static_cast<int>(to), function, a, b, std::chrono::milliseconds(timeout_ms));
        return static_cast<int64_t>(f.status().code());
      });
  rpc::register_function("rref_stats", [] {
    auto s = rref::stats();
    return std::vector<int64_t>{s.owned_values, s.known_forks, s.user_refs, s.pending_children,
                                s.pending_confirmations};
  });
  rref::register_class<Counter>("Counter")
      .constructor<int64_t>()
      .method("add", &Counter::add)
      .method("get", &Counter::get)
      .method("as_tensor", &Counter::as_tensor);
}

}  // namespace tandem::test
