// RemoteModule: modules built by registered factories, held as RRef'd objects on their worker.
#include "tandem/nn/remote_module.h"

#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::nn {
namespace {

struct Factories {
  Mutex mu;
  std::map<std::string, detail::Factory> by_name ABSL_GUARDED_BY(mu);
};
Factories& factories() {
  static auto* f = new Factories;  // never destroyed: RPC threads may build modules until exit
  return *f;
}

bool install() {
  rref::detail::register_class_impl(RemoteModule::kClass, [](std::vector<c10::IValue>&& args) -> std::shared_ptr<void> {
    if (args.empty() || !args[0].isString()) {
      throw_error(absl::InvalidArgumentError("malformed RemoteModule creation: no factory name"));
    }
    return std::make_shared<detail::Instance>(
        detail::make_instance(args[0].toStringRef(), std::vector<c10::IValue>(args.begin() + 1, args.end())));
  });
  rref::detail::register_method_impl(RemoteModule::kClass, "forward", [](void* self, std::vector<c10::IValue>&& args) {
    return static_cast<detail::Instance*>(self)->forward(std::move(args));
  });
  rref::detail::register_method_impl(RemoteModule::kClass, "parameters", [](void* self, std::vector<c10::IValue>&&) {
    std::vector<c10::IValue> refs;
    for (const auto& p : static_cast<detail::Instance*>(self)->module->parameters()) {
      refs.push_back(rref::make_local(c10::IValue(p)).to_ivalue());
    }
    return rpc::Future::ready(c10::ivalue::Tuple::create(std::move(refs)));
  });
  return true;
}

const bool g_installed = install();

}  // namespace

void detail::register_factory(const std::string& name, Factory factory) {
  (void)g_installed;
  Factories& f = factories();
  MutexLock lock(&f.mu);
  if (!f.by_name.emplace(name, std::move(factory)).second) {
    throw RpcError(absl::AlreadyExistsError(absl::StrCat("a module factory named '", name, "' is already registered")));
  }
}

detail::Instance detail::make_instance(const std::string& name, std::vector<c10::IValue>&& args) {
  (void)g_installed;
  detail::Factory factory;
  {
    Factories& f = factories();
    MutexLock lock(&f.mu);
    auto it = f.by_name.find(name);
    if (it == f.by_name.end()) {
      throw_error(
          absl::NotFoundError(absl::StrCat("no module factory named '", name, "' is registered on worker '",
                                           rpc::is_initialized() ? rpc::get_worker_info().name : "(local)", "'")));
    }
    factory = it->second;
  }
  return factory(std::move(args));
}

std::shared_ptr<torch::nn::Module> RemoteModule::local_module() const {
  c10::IValue v = module_.local_value();
  auto* object = v.isCapsule() ? dynamic_cast<rref::detail::Object*>(v.toCapsule().get()) : nullptr;
  if (!object || object->class_name != kClass) {
    throw RpcError(absl::InvalidArgumentError("the RRef of this RemoteModule does not refer to a module"));
  }
  return std::static_pointer_cast<detail::Instance>(object->instance)->module;
}

std::vector<rref::RRef> RemoteModule::remote_parameters() const {
  c10::IValue refs = module_.rpc_sync("parameters");
  if (!refs.isTuple()) {
    throw_error(absl::InvalidArgumentError("malformed reply: the RemoteModule's parameters are not a tuple"));
  }
  std::vector<rref::RRef> out;
  for (const auto& r : refs.toTupleRef().elements()) out.push_back(rref::RRef::from_ivalue(r));
  return out;
}

}  // namespace tandem::nn
