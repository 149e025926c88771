// RemoteModule: a torch::nn::Module that lives on another worker, used as if it were here (PyTorch's
// torch.distributed.nn.RemoteModule).
//
//   // every worker, before init_rpc:
//   nn::register_module("mlp", [](int64_t in, int64_t out) { return torch::nn::Linear(in, out); });
//   // a trainer:
//   auto m = nn::RemoteModule::create("ps", "mlp", int64_t{784}, int64_t{10});
//   dist_autograd::ContextGuard ctx;
//   at::Tensor y = m.forward(x);                               // runs on "ps", recorded for distributed autograd
//   dist_autograd::backward(ctx.id(), {loss(y)});
//   dist_optim::DistributedOptimizer opt("sgd", m.remote_parameters(), {{"lr", 0.1}});
//
// A factory returns a module holder (torch::nn::Linear, torch::nn::Sequential, ...) or a std::shared_ptr to a module;
// forward takes one tensor and returns one, unless a forward function is given:
//   nn::register_module("net", make_net, [](Net& net, at::Tensor x, double scale) { return net->forward(x) * scale; });
//
// The module is an RRef'd object (rref/rref.h): it lives while any RemoteModule handle to it exists. forward calls
// run concurrently on the owner (modules with state changed by forward need their own care).
// Errors: tandem::Error naming the owner: an unknown factory is NOT_FOUND, bad arguments INVALID_ARGUMENT, an exception
// in the factory or in forward UNKNOWN.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/rpc/registry.h"
#include "tandem/rref/rref.h"

namespace tandem::nn {

namespace detail {
struct Instance {
  std::shared_ptr<torch::nn::Module> module;
  std::function<rpc::Future(std::vector<c10::IValue>&&)> forward;
};
using Factory = std::function<Instance(std::vector<c10::IValue>&& args)>;
void register_factory(const std::string& name, Factory factory);
// Builds a module here with the factory registered under `name` (for layers that place modules themselves, e.g. the
// pipeline). Throws tandem::Error (NOT_FOUND) for an unknown name, or what the factory throws.
Instance make_instance(const std::string& name, std::vector<c10::IValue>&& args);

template <typename M>
std::shared_ptr<torch::nn::Module> module_ptr(const M& m) {
  if constexpr (std::is_convertible_v<M, std::shared_ptr<torch::nn::Module>>) {
    return m;
  } else {
    return m.ptr();  // a ModuleHolder (torch::nn::Linear, ...)
  }
}

template <typename T>
struct Tail;
template <typename H, typename... R>
struct Tail<std::tuple<H, R...>> {
  using type = std::tuple<R...>;
};
}  // namespace detail

// Registers `factory(args...)` under `name`, with forward `forward(module, args...)`.
template <typename Factory, typename Forward>
void register_module(const std::string& name, Factory factory, Forward forward) {
  using M = std::decay_t<typename rpc::detail::FnTraits<std::decay_t<Factory>>::Result>;
  using CtorArgs = typename rpc::detail::FnTraits<std::decay_t<Factory>>::Args;
  detail::register_factory(name, [factory, forward](std::vector<c10::IValue>&& args) {
    // Build the module through rpc's argument conversion (arity and types are checked the same way).
    std::shared_ptr<M> made;
    auto build = [&](auto&&... a) -> int {
      made = std::make_shared<M>(factory(std::forward<decltype(a)>(a)...));
      return 0;
    };
    rpc::detail::invoke(build, args, static_cast<CtorArgs*>(nullptr),
                        std::make_index_sequence<std::tuple_size_v<CtorArgs>>{});
    detail::Instance instance;
    instance.module = detail::module_ptr(*made);
    using FwdArgs = typename rpc::detail::FnTraits<std::decay_t<Forward>>::Args;
    instance.forward = [made, forward](std::vector<c10::IValue>&& in) {
      auto call = [&](auto&&... a) { return forward(*made, std::forward<decltype(a)>(a)...); };
      return rpc::detail::invoke(call, in, static_cast<typename detail::Tail<FwdArgs>::type*>(nullptr),
                                 std::make_index_sequence<std::tuple_size_v<FwdArgs> - 1>{});
    };
    return instance;
  });
}

// The common case: forward(module, tensor) is module->forward(tensor).
template <typename Factory>
void register_module(const std::string& name, Factory factory) {
  using M = std::decay_t<typename rpc::detail::FnTraits<std::decay_t<Factory>>::Result>;
  register_module(name, std::move(factory), [](M& m, at::Tensor x) -> at::Tensor { return m->forward(x); });
}

class RemoteModule {
 public:
  RemoteModule() = default;
  // Builds the module on worker `on` with factory `factory`; returns at once (creation errors show on first use).
  template <typename... Args>
  static RemoteModule create(const rpc::To& on, const std::string& factory, Args&&... args) {
    return RemoteModule(rref::remote_object(on, kClass, factory, std::forward<Args>(args)...));
  }

  // A handle on a module another RemoteModule created (its module_rref(), e.g. received through RPC).
  static RemoteModule from_rref(rref::RRef module) { return RemoteModule(std::move(module)); }

  template <typename... Args>
  at::Tensor forward(Args&&... args) const {
    return module_.rpc_sync<at::Tensor>("forward", std::forward<Args>(args)...);
  }
  template <typename... Args>
  rpc::Future forward_async(Args&&... args) const {
    return module_.rpc_async("forward", std::forward<Args>(args)...);
  }
  // RRefs to the module's parameters, owned by the module's worker (for dist_optim::DistributedOptimizer).
  std::vector<rref::RRef> remote_parameters() const;
  const rref::RRef& module_rref() const { return module_; }
  // The module itself; only on its worker, once built (throws tandem::Error elsewhere).
  std::shared_ptr<torch::nn::Module> local_module() const;
  std::string owner_name() const { return module_.owner_name(); }

  static constexpr const char* kClass = "__tandem.nn.Module";

 private:
  explicit RemoteModule(rref::RRef module) : module_(std::move(module)) {}
  rref::RRef module_;
};

}  // namespace tandem::nn
